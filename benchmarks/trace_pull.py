"""Where a pull's time goes: `kvxfer-cli bench` with a timestamp at each step.

Runs one bench case (one model, one size) with `benchmarks/pull_trace` first on
PYTHONPATH. Every kvxfer process then logs a timestamp at each traced step: the
bench's engine, both sidecars, and the decode sidecar's NIXL threads (see that
directory's sitecustomize.py). This script lines the logs up pull by pull, from
the engine's Pull call to the PullDone event it decodes. For each step it
prints two medians over the pulls: the time after the Pull call, and the time
since the step on the line above, taken within each pull. The first `--skip`
pulls are dropped: the bench's two one-block handshake pulls and its warm-up
round. A step is shown when at least 80% of the pulls passed it.

    .venv/bin/python benchmarks/trace_pull.py --model gpt-oss-20b --size 1k [--repeat 150] [--json]

The trace costs a few microseconds a step, so the overhead printed is the
traced run's own: it reads a little above an untraced run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import bench_child  # benchmarks/, beside this script

TRACE_DIR = Path(__file__).resolve().parent / "pull_trace"
ENV = "PULL_TRACE_DIR"  # pull_trace/sitecustomize.py reads it
# A process's role is told by a point only it records.
ROLES = {"engine.pull>": "engine", "decode.Pull>": "decode", "prefill.BeginRead>": "prefill"}
START, END = "engine.pull>", "engine.event.pull_done>"
# Steps every traced pull passes: a run without them traced nothing useful (the tracer
# failed to install in some process, or a step moved).
REQUIRED = ("engine.pull>", "decode.Pull>", "decode.post>@nixl", "decode.post<@nixl", END)
PRESENT = 0.8  # a step is shown when at least this share of the pulls passed it


@dataclass(frozen=True)
class Event:
    ns: int
    role: str
    point: str


@dataclass(frozen=True)
class Step:
    point: str  # role, point and occurrence within the pull ("#2": its second)
    median_us: float  # after the Pull call
    step_us: float  # since the step shown before it, within each pull (the first: median_us)
    pulls: int


def read_logs(directory: Path) -> list[Event]:
    """Every traced process's events, each named by its role (processes of no role,
    which trace nothing of a pull, are left out), in time order."""
    events = []
    for log in directory.glob("*.log"):
        lines = [line.split(" ", 1) for line in log.read_text().splitlines() if line]
        points = {point for _, point in lines}
        role = next((r for p, r in ROLES.items() if p in points), None)
        if role is None:
            continue
        for ns, point in lines:
            name = point if point.startswith(f"{role}.") else f"{role} {point}"
            events.append(Event(int(ns), role, name))
    events.sort(key=lambda e: e.ns)
    return events


def pulls(events: Sequence[Event]) -> list[list[Event]]:
    """Each pull's events: from the engine's Pull call to the first event the engine
    decodes after it (its PullDone: the bench's decode engine hears of nothing else)."""
    found: list[list[Event]] = []
    current: list[Event] | None = None
    for event in events:
        if event.point == START:
            current = [event]
        elif current is not None:
            current.append(event)
            if event.point == END:
                found.append(current)
                current = None
    return found


def timeline(traced: Iterable[list[Event]]) -> list[Step]:
    """Each step most pulls passed, in order of its median time after the Pull call,
    with the median time since the step before it within the same pull."""
    offsets: dict[str, dict[int, float]] = defaultdict(dict)
    count = 0
    for index, pull in enumerate(traced):
        count += 1
        seen: Counter[str] = Counter()
        for event in pull:
            seen[event.point] += 1
            key = event.point if seen[event.point] == 1 else f"{event.point}#{seen[event.point]}"
            offsets[key][index] = (event.ns - pull[0].ns) / 1e3
    shown = sorted(
        (key for key, at in offsets.items() if len(at) >= PRESENT * count),
        key=lambda key: statistics.median(offsets[key].values()),
    )
    steps = []
    for before, key in zip([None, *shown], shown, strict=False):
        at = offsets[key]
        gaps = (
            [t - offsets[before][i] for i, t in at.items() if i in offsets[before]]
            if before
            else []
        )
        median = round(statistics.median(at.values()), 1)
        step = round(statistics.median(gaps), 1) if gaps else median
        steps.append(Step(key, median, step, len(at)))
    return steps


def missing(steps: Sequence[Step]) -> list[str]:
    """The steps every pull passes that the timeline lacks."""
    shown = {step.point for step in steps}
    return [point for point in REQUIRED if point not in shown]


def run_bench(model: str, size: str, repeat: int, logs: Path) -> dict[str, object]:
    """One traced bench case; its JSON row."""
    arguments = ["--models", model, "--sizes", size, "--repeat", str(repeat)]
    cases = bench_child.run_bench(arguments, TRACE_DIR, {ENV: str(logs)})["cases"]
    if len(cases) != 1:
        raise SystemExit(f"the bench ran {len(cases)} cases of {model} {size}, not one")
    return dict(cases[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--size", default="1k", choices=["16", "1k", "16k"])
    parser.add_argument("--repeat", type=int, default=150)
    parser.add_argument("--skip", type=int, default=20, help="warm-up pulls dropped")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeat < 1 or args.skip < 0:
        parser.error("--repeat must be at least 1 and --skip not negative")
    with tempfile.TemporaryDirectory(prefix="kvxfer-trace-") as tmp:
        case = run_bench(args.model, args.size, args.repeat, Path(tmp))
        traced = pulls(read_logs(Path(tmp)))[args.skip :]
    if not traced:
        raise SystemExit("no pull was traced: is benchmarks/pull_trace importable?")
    steps = timeline(traced)
    if lacking := missing(steps):
        raise SystemExit(f"the trace lacks steps every pull passes: {', '.join(lacking)}")
    report = {
        "model": args.model,
        "tokens": case["tokens"],
        "pulls": len(traced),
        "overhead_ms_p50": case["overhead_ms_p50"],
        "raw_ms_p50": case["raw_ms_p50"],
        "steps": [vars(s) for s in steps],
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{args.model} {case['tokens']} tokens, {len(traced)} pulls: raw p50 "
        f"{case['raw_ms_p50']} ms, overhead p50 +{case['overhead_ms_p50']} ms (this traced run)"
    )
    print(f"{'after Pull (us)':>16} {'step (us)':>10} {'pulls':>6}  point")
    for step in steps:
        print(f"{step.median_us:16.1f} {step.step_us:10.1f} {step.pulls:6d}  {step.point}")


if __name__ == "__main__":
    main()
