"""How long a decode engine's thread is held when it starts a pull: the blocking
`SyncEngineClient.pull` (until the sidecar answers Pull) against `pull_soon` (the
vLLM connector's way since it stopped waiting: the call goes out on the client's
own loop). Also Pull call to PullDone either way, which should not change.

A real pair of sidecars and engine-sims (gpt-oss-20b, one request of `--tokens`
published and pulled per round, alternating the two ways), as the bench runs them.
Prints one JSON object; no assertion (tests/test_pull_answer.py checks behaviour).

    .venv/bin/python benchmarks/probe_pull_call.py --rounds 200 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvxfer.cli.fleet import Fleet
from kvxfer.client.engine import SyncEngineClient
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import PullDone

MODEL = "gpt-oss-20b"
GAP_S = 0.02  # between rounds, as the bench's pulls follow its other methods


def _spans(layout_groups: int, first: int, count: int) -> list[BlockSpan]:
    ids = tuple(BlockId(first + i) for i in range(count))
    return [BlockSpan(GroupId(g), 0, ids) for g in range(layout_groups)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument(
        "--ways", nargs="+", choices=("pull", "pull_soon"), default=["pull", "pull_soon"],
        help="which calls to alternate (an older build has no pull_soon)",
    )  # fmt: skip
    args = parser.parse_args()
    layout = layout_for_model(MODEL)
    blocks = -(-args.tokens // layout.block_size)
    groups = len(layout.groups)
    with tempfile.TemporaryDirectory(prefix="kvxfer-probe-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            p, d = fleet.sidecar("p"), fleet.sidecar("d")
            extra = ("--num-blocks", str(2 * blocks), "--state-blocks", "4")
            pe = fleet.engine(p, MODEL, "prefill", *extra)
            de = fleet.engine(d, MODEL, "decode", *extra)
            pc = SyncEngineClient(p.ready["engine_address"], engine_id=pe.engine_id)
            dc = SyncEngineClient(d.ready["engine_address"], engine_id=de.engine_id)
            events = dc.events()
            held: dict[str, list[float]] = {way: [] for way in args.ways}
            ended: dict[str, list[float]] = {way: [] for way in args.ways}
            for i in range(args.rounds + 10):
                way = args.ways[i % len(args.ways)]
                params = pc.publish(f"r{i}", args.tokens, _spans(groups, 0, blocks))
                time.sleep(GAP_S)
                start = time.perf_counter()
                started = getattr(dc, way)(params, _spans(groups, blocks, blocks), 0)
                returned = time.perf_counter()
                done = next(events)
                finished = time.perf_counter()
                if way == "pull_soon":
                    started.result(5)
                assert isinstance(done, PullDone) and done.status.value == "ok", done
                if i >= 10:  # warm-up rounds are not counted
                    held[way].append(returned - start)
                    ended[way].append(finished - start)
            pc.close()
            dc.close()
        finally:
            fleet.close()
    report = {
        "model": MODEL,
        "tokens": args.tokens,
        "rounds": args.rounds,
        **{
            way: {
                "thread_held_ms_p50": _pct(held[way], 0.5),
                "thread_held_ms_p99": _pct(held[way], 0.99),
                "pull_to_pulldone_ms_p50": _pct(ended[way], 0.5),
                "pull_to_pulldone_ms_mean": round(statistics.fmean(ended[way]) * 1000, 3),
            }
            for way in held
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
