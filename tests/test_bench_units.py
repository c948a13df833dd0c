"""The benchmarks' round runner and summary: warm-up dropped, order rotated, ratios paired."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.cli.bench import Method, run_rounds, summarize


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
