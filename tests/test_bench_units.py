"""The benchmarks' round runner and summary: warm-up dropped, order rotated, ratios paired."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvxfer._exceptions import KvxferError
from kvxfer.cli.bench import Method, pull_cpu, rounds_per_size, run_rounds, summarize
from kvxfer.cli.bench_concurrency import (
    Burst,
    PullOnce,
    measure_levels,
    percentile,
    summarize_bursts,
    threads_cpu_ns,
    timed_burst,
)
from kvxfer.cli.bench_table import report_text
from kvxfer.cli.main import UsageError, build_parser, concurrency_levels


async def test_rounds_drop_the_warm_up_and_rotate_the_order() -> None:
    calls: list[str] = []

    def method(name: str, seconds: float) -> Method:
        async def run() -> float:
            calls.append(name)
            return seconds + len(calls)  # distinct per call, so dropped ones are visible

        return run

    times = await run_rounds({"a": method("a", 0), "b": method("b", 100), "c": method("c", 200)}, 3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # Round 0 (calls 1-3) is dropped; each method keeps one time per later round.
    assert times == {"a": [6.0, 8.0, 10.0], "b": [104.0, 109.0, 111.0], "c": [205.0, 207.0, 212.0]}


def test_summary_pairs_raw_and_kvxfer_round_by_round() -> None:
    # The machine drifts: both methods slow down together in round 2. Paired per round
    # the ratio is steady at 0.9, while the ratio of medians reads differently.
    times = {
        "memcpy": [0.5, 1.0, 0.5],
        "per_block": [1.0, 2.0, 1.0],
        "raw": [0.9, 1.8, 0.9],
        "kvxfer": [1.0, 2.0, 1.0],
    }
    summary = summarize(times, nbytes=10**9)
    assert summary["kvxfer_vs_raw_rounds"] == {"min": 0.9, "median": 0.9, "max": 0.9}
    assert summary["raw_nixl_gbps"] == pytest.approx(1 / 0.9, abs=1e-3)
    assert summary["kvxfer_gbps"] == 1.0
    assert summary["overhead_ms_p50"] == pytest.approx(100.0)
    times["kvxfer"] = [1.0, 1.5, 1.2]
    rounds = summarize(times, nbytes=10**9)["kvxfer_vs_raw_rounds"]
    assert rounds == {"min": 0.75, "median": 0.9, "max": 1.2}


def test_the_bare_hand_offs_are_reported_beside_the_overhead() -> None:
    times = {
        "memcpy": [0.5],
        "per_block": [1.0],
        "raw": [0.9],
        "kvxfer": [1.0],
        "engine_call": [0.0004, 0.0006, 0.0005],
        "nixl_thread": [0.0002, 0.0001, 0.0003],
    }
    summary = summarize(times, nbytes=10**9)
    assert summary["engine_call_ms_p50"] == pytest.approx(0.5)
    assert summary["nixl_thread_ms_p50"] == pytest.approx(0.2)
    assert summary["hops_ms_p50"] == pytest.approx(0.7)
    del times["engine_call"]  # a run without them (the pairings' rounds) reports none
    assert "hops_ms_p50" not in summarize(times, nbytes=10**9)
    case = {"model": "m", "tokens": 1024, "full_attention_bytes": 10**9, **summary}
    report = {"memcpy_gbps": 5.0, "cases": [case], "handshakes": [], "skipped": []}
    (row,) = [line for line in report_text(report).splitlines() if line.startswith("m ")]
    assert row.split()[-4:-1] == ["+100.00ms", "+100.00ms", "0.70ms"]  # p50, p99, hops


def test_the_overhead_p99_is_the_99th_of_100_rounds_not_the_worst() -> None:
    # 100 rounds: raw is 1.0 s but for one 5.0 s round; kvxfer is 1.2 s but for a 3.0 s
    # and a 9.0 s round. Nearest rank, p99 is the 99th value of each, sorted.
    times = {
        "memcpy": [0.5] * 100,
        "per_block": [1.0] * 100,
        "raw": [1.0] * 50 + [5.0] + [1.0] * 49,
        "kvxfer": [9.0] + [1.2] * 98 + [3.0],
    }
    summary = summarize(times, nbytes=10**9)
    assert summary["rounds"] == 100
    assert summary["raw_ms_p99"] == pytest.approx(1000.0)
    assert summary["kvxfer_ms_p99"] == pytest.approx(3000.0)
    assert summary["overhead_ms_p99"] == pytest.approx(2000.0)
    assert summary["overhead_ms_p50"] == pytest.approx(200.0)
    case = {"model": "m", "tokens": 1024, "full_attention_bytes": 10**9, **summary}
    report = {"memcpy_gbps": 5.0, "cases": [case], "handshakes": [], "skipped": []}
    (row,) = [line for line in report_text(report).splitlines() if line.startswith("m ")]
    assert row.split()[-4:-2] == ["+200.00ms", "+2000.00ms"]


def test_small_requests_get_enough_rounds_for_a_p99_unless_told() -> None:
    assert rounds_per_size(["1k", "16k", "128k"], None, default=5) == {
        "1k": 100,
        "16k": 5,
        "128k": 5,
    }
    assert rounds_per_size(["1k", "16k"], None, default=2) == {"1k": 100, "16k": 2}
    assert rounds_per_size(["1k", "16k"], 3, default=2) == {"1k": 3, "16k": 3}
    assert rounds_per_size(["16", "1k"], None, default=2) == {"16": 100, "1k": 100}


def test_a_pulls_cpu_is_reported_per_place_beside_its_time() -> None:
    cpu = {
        "engine_loop": [0.3, 0.5, 0.4],
        "decode_sidecar": [7.0, 9.0, 8.0],
        "decode_nixl_threads": [5.0, 6.0, 5.5],
        "prefill_sidecar": [1.0, 2.0, 1.5],
        "unmeasured": [],
    }
    p50 = pull_cpu(cpu)
    assert p50 == {
        "engine_loop": 0.4,
        "decode_sidecar": 8.0,
        "decode_nixl_threads": 5.5,
        "prefill_sidecar": 1.5,
    }
    times = {"memcpy": [0.5], "per_block": [1.0], "raw": [0.9], "kvxfer": [1.0]}
    case = {"model": "m", "tokens": 1024, "full_attention_bytes": 10**9}
    case |= summarize(times, nbytes=10**9) | {"cpu_ms_per_pull_p50": p50}
    report = {"memcpy_gbps": 5.0, "cases": [case], "handshakes": [], "skipped": []}
    (line,) = [x for x in report_text(report).splitlines() if x.startswith("m 1024: CPU")]
    assert "decode sidecar 8.00 ms (its NIXL threads, which copy, 5.50)" in line
    assert "prefill sidecar 1.50 ms, engine loop 0.40 ms; the pull took 1000.00 ms" in line


def test_threads_cpu_counts_every_thread_and_the_named_ones_apart() -> None:
    """The scheduler's exact run time of a process's threads, and of those whose OS name
    starts with a prefix (NIXL agents name theirs): a thread that burns CPU here is
    counted in both, and only in the total when named otherwise."""

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    burnt, done = threading.Barrier(3), threading.Event()

    def named(name: str) -> None:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name)
        burn(0.05)
        burnt.wait()
        done.wait()  # a thread's count leaves /proc with it

    threads = [threading.Thread(target=named, args=(n,)) for n in ("burner-1", "other")]
    before = threads_cpu_ns([os.getpid()], "burner-")
    for thread in threads:
        thread.start()
    burnt.wait()
    after = threads_cpu_ns([os.getpid()], "burner-")
    done.set()
    for thread in threads:
        thread.join()
    total, burners = after[0] - before[0], after[1] - before[1]
    assert 0.05e9 <= burners < 0.08e9, burners  # the named thread's 50 ms, not the other's
    assert total >= 0.1e9, total  # both threads' 50 ms
    assert threads_cpu_ns([2**22 + 1], "x") == (0, 0)  # no such process: nothing, no error


def test_concurrency_levels_are_validated_naming_the_option() -> None:
    assert concurrency_levels("1,8,64,256,1024") == (1, 8, 64, 256, 1024)
    for bad, message in [("1,x", "comma-separated"), ("0,8", "1..65536"), ("8,8", "repeats")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message) as caught:
            concurrency_levels(bad)
        assert "--concurrency" in str(caught.value)
    args = build_parser().parse_args(
        ["bench", "--concurrency", "1,8", "--concurrency-max-gib", "2"]
    )
    assert args.concurrency == (1, 8) and args.concurrency_max_gib == 2.0
    with pytest.raises(UsageError, match="--concurrency-max-gib"):
        build_parser().parse_args(["bench", "--concurrency-max-gib", "0"])


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([2.0, 1.0], 50) == 1.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_burst_summary_pools_rounds_and_counts_errors() -> None:
    raw = [Burst(1.0, [0.5, 1.0]), Burst(1.0, [0.5, 1.0])]
    kvx = [Burst(2.0, [1.0, 2.0]), Burst(2.0, [1.5], ["refused"])]
    row = summarize_bursts(2, 10**9, raw, kvx)
    assert row["raw_nixl_gbps"] == 2.0  # 4 pulls of 1 GB in 2 s
    assert row["kvxfer_gbps"] == 0.75  # 3 pulls done in 4 s
    assert row["kvxfer_vs_raw"] == 0.375
    assert row["raw_nixl_2agents_gbps"] is None and row["kvxfer_vs_raw_2agents"] is None
    two = summarize_bursts(2, 10**9, raw, kvx, [Burst(0.5, [0.25, 0.5])])
    assert two["raw_nixl_2agents_gbps"] == 4.0 and two["kvxfer_vs_raw_2agents"] == 0.188
    assert (row["kvxfer_ms_p50"], row["kvxfer_ms_p99"]) == (1500.0, 2000.0)
    assert row["errors"] == 1 and row["error_examples"] == ["refused"]


async def test_a_burst_counts_failed_pulls_instead_of_raising() -> None:
    async def ok() -> None:
        await asyncio.sleep(0)

    async def refused() -> None:
        raise KvxferError("limits.max_queued_pulls_per_peer")

    burst = await timed_burst([ok, refused, ok])
    assert len(burst.latencies_s) == 2 and burst.errors == ["limits.max_queued_pulls_per_peer"]
    assert burst.wall_s >= max(burst.latencies_s)


class _Case:
    """A BurstCase that moves nothing: records what the bench asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def pull_bytes(self, tokens: int) -> int:
        return tokens << 10

    async def kvxfer_burst(self, tokens: int, level: int) -> list[PullOnce]:
        self.calls.append(("kvxfer", level))

        async def pull() -> None:
            await asyncio.sleep(0)

        return [pull] * level

    async def raw_burst(self, tokens: int, level: int, agents: int = 1) -> Burst:
        self.calls.append(("raw" if agents == 1 else f"raw{agents}", level))
        return Burst(0.5 / agents, [0.5 / agents] * level)


async def test_levels_alternate_who_goes_first_and_skip_oversized_bursts() -> None:
    case = _Case()
    rows, skipped = await measure_levels(
        case, 1024, [1, 8, 64], rounds=2, max_bytes=8 << 20, pids={"self": os.getpid()}
    )
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert case.calls == [("raw", 1), ("kvxfer", 1), ("kvxfer", 1), ("raw", 1),
                          ("raw", 8), ("raw2", 8), ("kvxfer", 8),
                          ("kvxfer", 8), ("raw2", 8), ("raw", 8)]  # fmt: skip
    (skip,) = skipped
    assert skip["concurrency"] == 64 and "--concurrency-max-gib" in skip["reason"]
    one, eight = rows
    assert one["raw_nixl_2agents_gbps"] is None and one["kvxfer_vs_raw_2agents"] is None
    assert eight["raw_nixl_2agents_gbps"] == pytest.approx(2 * eight["raw_nixl_gbps"], rel=1e-3)
    for row in rows:
        assert row["errors"] == 0 and row["rounds"] == 2 and row["bytes_per_pull"] == 1 << 20
        assert row["self_sidecar_rss_mib"] > 0 and row["self_sidecar_cpu_cores"] is not None


def test_the_text_report_shows_handshakes_levels_and_skipped_bursts() -> None:
    level = summarize_bursts(
        1024, 1 << 20, [Burst(1.0, [1.0] * 1024)], [Burst(2.0, [2.0] * 1024)],
        [Burst(0.5, [0.5] * 1024)],
    )  # fmt: skip
    report = {
        "memcpy_gbps": 5.0,
        "cases": [],
        "handshakes": [
            {"model": "m", "handshake_ms": 14.0, "first_pull_ms": 500.0, "next_pull_ms": 4.0}
        ],
        "concurrency": [{"model": "m", "tokens": 1024, **level, "decode_sidecar_cpu_cores": 0.9}],
        "skipped": [{"model": "m", "tokens": 16384, "concurrency": 256, "reason": "too big"}],
    }
    lines = report_text(report).splitlines()
    assert "m: handshake 14.0 ms; first pull 500.0 ms, next 4.0 ms (one block)" in lines
    (row,) = [line for line in lines if line.startswith("m ") and " 1024 " in line]
    # pulls, raw, kvxfer, ratio, raw on two agents, ratio
    assert row.split()[2:8] == ["1024", "1.07", "0.54", "0.500", "2.15", "0.250"]
    assert "-/0.9" in row  # no prefill CPU in this row, the decode sidecar's 0.9 cores
    assert "skipped m 16384 x 256: too big" in lines


@pytest.mark.nixl
@pytest.mark.timeout(180)
def test_dataplane_bench_script_runs_one_case(tmp_path: Path) -> None:
    """benchmarks/bench_dataplane.py is a script, not a test; this keeps it running.
    It runs outside the checkout, so the installed kvxfer is the one imported."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dataplane.py"
    result = subprocess.run(
        [sys.executable, str(script), "--models", "qwen3-next-80b-a3b", "--sizes", "1k",
         "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=170, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (case,) = json.loads(result.stdout)["cases"]
    assert case["model"] == "qwen3-next-80b-a3b" and case["tokens"] == 1024
    assert case["chunks_kvxfer"] == 2  # the Mamba state block, then the attention blocks
    for key in ("raw_nixl_gbps", "kvxfer_gbps", "setup_coalesced_ms", "prep_once_ms"):
        assert case[key] > 0, key
