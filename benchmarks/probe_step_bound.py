"""What a pull would cost if its params, plan and binding cost nothing.

Runs `kvxfer-cli bench` at 1k tokens in alternating pairs: one unchanged, one
with `benchmarks/step_bound` first on PYTHONPATH, where the decode sidecar's
`params_from_proto`, `plan_transfer` and `handle_jobs` return what they
returned for the same input (see that directory's sitecustomize.py). The bench
pulls one request shape every round, so in the second run of a pair those
three steps are dictionary lookups, and its overhead is the lowest that any
faster implementation of them (native code) could reach on this machine in
that hour. A bounded run in which any of the three steps was remembered
fewer times than there were rounds is refused.

    .venv/bin/python benchmarks/probe_step_bound.py --pairs 3 [--models gpt-oss-20b ...] [--out F]

Each line of `--out` is one bench run: its case rows, `bounded` true or false,
its pair and what the steps remembered.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_child  # benchmarks/, beside this script

BOUND_DIR = Path(__file__).resolve().parent / "step_bound"
ENV = "STEP_BOUND_DIR"  # step_bound/sitecustomize.py reads it
MODELS = ("gpt-oss-20b", "gemma-3-4b-it", "qwen3-next-80b-a3b")
STEPS = ("params", "plan", "bind")


def run_bench(models: list[str], repeat: int, bounded: bool) -> dict[str, Any]:
    """One bench run at 1k; its case rows, and when `bounded`, the steps' counts."""
    arguments = ["--models", *models, "--sizes", "1k", "--repeat", str(repeat)]
    with tempfile.TemporaryDirectory(prefix="kvxfer-bound-") as tmp:
        # Unbounded: the variable set empty (the sitecustomize acts only when it is not).
        site, env = (BOUND_DIR, {ENV: tmp}) if bounded else (None, {ENV: ""})
        cases = bench_child.run_bench(arguments, site, env)["cases"]
        counts = _counts(Path(tmp))
    if bounded and min(counts["hits"].values()) < repeat * len(models):
        raise SystemExit(f"the bounded run skipped a step too rarely: {counts}")
    return {"cases": cases, "bounded": bounded, "steps": counts if bounded else None}


def _counts(directory: Path) -> dict[str, dict[str, int]]:
    """Hits and misses of each step, summed over the processes that wrote any."""
    total = {"hits": dict.fromkeys(STEPS, 0), "misses": dict.fromkeys(STEPS, 0)}
    for path in directory.glob("*.json"):
        written = json.loads(path.read_text(encoding="utf-8"))
        for kind, steps in total.items():
            for step in STEPS:
                steps[step] += written[kind][step]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path, help="append each run as a JSON line")
    args = parser.parse_args()
    if args.pairs < 1 or args.repeat < 1:
        parser.error("--pairs and --repeat must be at least 1")
    overheads: dict[tuple[str, bool], list[float]] = {}
    for pair in range(1, args.pairs + 1):
        for bounded in (False, True):
            run = run_bench(args.models, args.repeat, bounded)
            run |= {"pair": pair, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            run["load_average"] = os.getloadavg()[0]
            if args.out:
                with args.out.open("a", encoding="utf-8") as out:
                    out.write(json.dumps(run) + "\n")
            for case in run["cases"]:
                overheads.setdefault((case["model"], bounded), []).append(case["overhead_ms_p50"])
                print(
                    f"pair {pair} {'bounded' if bounded else 'as built'}: {case['model']} "
                    f"raw {case['raw_ms_p50']:.2f} ms, overhead p50 {case['overhead_ms_p50']:+.2f}"
                    f" p99 {case['overhead_ms_p99']:+.2f}, hops {case['hops_ms_p50']:.2f}",
                    flush=True,
                )
    print("\n1k overhead p50, median of the pairs (ms): as built -> params, plan, binding free")
    for model in args.models:
        built = statistics.median(overheads[(model, False)])
        free = statistics.median(overheads[(model, True)])
        print(f"  {model}: {built:+.2f} -> {free:+.2f} ({free - built:+.2f})")


if __name__ == "__main__":
    main()
