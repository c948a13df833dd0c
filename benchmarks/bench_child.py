"""`kvxfer-cli bench --json` as a child process, with a `sitecustomize` directory
first on its PYTHONPATH: how the pull tracer (`trace_pull.py`) and the step bound
(`probe_step_bound.py`) reach into every kvxfer process of a bench run. Python
runs that directory's sitecustomize.py in each of them; it acts only when its
environment variable is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_bench(arguments: list[str], site: Path | None, env: dict[str, str]) -> dict[str, Any]:
    """The bench's JSON report for `arguments`, run with `env` over this process's
    environment and `site` (if any) first on PYTHONPATH. A bench that fails, or a
    sitecustomize that fails to install (site.py prints it and goes on), ends the
    caller with the child's error."""
    cli = Path(sys.executable).parent / "kvxfer-cli"
    child = dict(os.environ) | env
    if site is not None:
        child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), child.get("PYTHONPATH")]))
    done = subprocess.run(
        [str(cli), "bench", *arguments, "--json"],
        env=child, capture_output=True, text=True, check=False, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"bench failed ({done.returncode}): {done.stderr[-2000:]}")
    if "Error in sitecustomize" in done.stderr:
        raise SystemExit(f"{site} failed to install: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report
