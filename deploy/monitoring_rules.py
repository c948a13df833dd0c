"""Write the monitoring bundle's PromQL as plain Prometheus rule files for promtool.

    python deploy/monitoring_rules.py OUTDIR

OUTDIR/kvxfer.rules.yaml: spec.groups of monitoring/prometheusrule.yaml, next to a
copy of monitoring/rules-test.yaml (`promtool test rules` reads it from there).
OUTDIR/dashboard.rules.yaml: every query of monitoring/grafana-dashboard.json as a
recording rule, Grafana's variables replaced, so `promtool check rules` parses it.
Run by deploy/check.sh (make deploy-check).
"""

import json
import shutil
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent / "monitoring"
GRAFANA_VARS = {
    "$__rate_interval": "5m",
    "$namespace": "kvxfer",
    "$role": ".*",
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rule = yaml.safe_load((HERE / "prometheusrule.yaml").read_text())
    (out / "kvxfer.rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    shutil.copy(HERE / "rules-test.yaml", out / "rules-test.yaml")
    dashboard = json.loads((HERE / "grafana-dashboard.json").read_text())
    rules = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in GRAFANA_VARS.items():
                expr = expr.replace(name, value)
            if "$" in expr:
                sys.exit(f"panel {panel['title']!r}: unknown variable in {expr!r}")
            rules.append(
                {"record": f"dashboard:panel{panel['id']}:{target['refId']}", "expr": expr}
            )
    groups = {"groups": [{"name": "dashboard", "rules": rules}]}
    (out / "dashboard.rules.yaml").write_text(yaml.safe_dump(groups))
    print(f"{len(rules)} dashboard queries")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
