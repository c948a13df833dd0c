"""Different tensor-parallel sizes, end to end through `kvxfer-cli demo --prefill-tp
--decode-tp`: engine-sim ranks, real sidecar processes, real NIXL, chunk failures
injected through the decode sidecar's fault seam.

The demo checks every decode byte itself (head by head over the decode blocks, every
other byte untouched). This test checks, from the oracle alone (tests/oracle.py, which
knows nothing of tp_map or the planner), each pull's bytes (which heads the source
serves, which tokens move, minus failed blocks) and where each decode rank resumes.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from oracle import (
    oracle_head_server,
    oracle_moved_tokens,
    oracle_rank_heads,
    oracle_valid_tokens_moved,
)
from test_demo import CLI, Demos, demos  # noqa: F401 (the fixture)

from kvxfer.core.layout import EngineLayout
from kvxfer.core.profiles import layout_for_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _oracle_pull_bytes(
    layout: EngineLayout, src_tp: int, src_block: int, pull: dict[str, Any], row: dict[str, Any]
) -> int:
    """Bytes one pull lands: the source's heads of every moved token outside failed blocks."""
    total, size = 0, layout.block_size
    failed = {int(g): set(b) for g, b in pull["failed_blocks"].items()}
    for group in layout.groups:
        heads = group.num_kv_heads
        assert heads is not None
        mine = oracle_rank_heads(heads, layout.tp_size, layout.tp_rank)
        served = [
            h
            for h in mine
            if oracle_head_server(heads, src_tp, h, layout.tp_rank) == pull["prefill_rank"]
        ]
        moved = oracle_moved_tokens(group, row["tokens"], row["computed_tokens"], src_block, size)
        landed = [t for t in moved if t // size not in failed.get(group.group_id, set())]
        per_head = sum(t.bytes_per_block for t in group.tensors) // size // len(mine)
        total += len(landed) * len(served) * per_head
    return total


@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp", "blocks"),
    [
        ("llama-3.1-8b", 1, 2, (16, 16)),
        ("gpt-oss-20b", 2, 1, (16, 16)),
        ("gpt-oss-20b", 1, 2, (32, 16)),  # block sizes differ as well
    ],
)
def test_different_tp_sizes_pull_head_by_head_with_failures(
    demos: Demos,  # noqa: F811 (the fixture)
    model: str,
    prefill_tp: int,
    decode_tp: int,
    blocks: tuple[int, int],
) -> None:
    result = demos.run(
        "--model", model, "--requests", "4", "--tokens-range", "100:1200",
        "--prefix-hit-rate", "0.5", "--fail-rate", "0.25", "--seed", "2",
        "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--prefill-block-size", str(blocks[0]), "--decode-block-size", str(blocks[1]),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    check_tp_report(json.loads(result.stdout), model, prefill_tp, decode_tp, blocks)


def check_tp_report(
    report: dict[str, Any], model: str, prefill_tp: int, decode_tp: int, blocks: tuple[int, int]
) -> None:
    """Each transfer's bytes and valid_tokens of a TP `demo --json` report, from the
    oracle alone, and one valid_tokens per request."""
    assert report["tp"] == {"prefill": prefill_tp, "decode": decode_tp}
    assert report["verified_requests"] == 4 and report["untouched_bytes_verified"] is True
    assert report["failed_blocks"] > 0, "seed 2 injects at least one failure"
    assert report["head_bytes_verified"] == report["bytes_moved"]
    layouts = [
        layout_for_model(model, block_size=blocks[1], tp_size=decode_tp, tp_rank=r)
        for r in range(decode_tp)
    ]
    for row in report["per_request"]:
        assert row["problems"] == []
        assert len(row["pulls"]) == max(prefill_tp, decode_tp)  # one per (source, reader)
        resume = []
        for pull in row["pulls"]:
            layout = layouts[pull["decode_rank"]]
            assert pull["bytes_moved"] == _oracle_pull_bytes(
                layout, prefill_tp, blocks[0], pull, row
            )
            failed = {int(g): b for g, b in pull["failed_blocks"].items()}
            groups = list(layout.groups)
            moved = {
                g.group_id: oracle_moved_tokens(
                    g, row["tokens"], row["computed_tokens"], blocks[0], blocks[1]
                )
                for g in groups
            }
            want = oracle_valid_tokens_moved(
                groups, row["tokens"], row["computed_tokens"], blocks[1], failed, moved
            )
            assert pull["valid_tokens"] == want
            resume.append(want)
        assert row["valid_tokens"] == min(resume)  # one answer for the whole request


@pytest.mark.parametrize(
    ("model", "decode_tp", "refusal"),
    [
        ("qwen3-next-80b-a3b", 2, ("--decode-tp", "layout.groups[0].kind: local mamba")),
        ("llama-3.1-8b", 3, ("num_key_value_heads", "8 heads cannot be placed on tp_size 3")),
    ],
)
def test_pairings_negotiation_refuses_stop_the_demo_before_it_starts(
    model: str, decode_tp: int, refusal: tuple[str, str]
) -> None:
    """No process is started: the refusal comes from the layouts alone."""
    result = subprocess.run(
        [CLI, "demo", "--model", model, "--prefill-tp", "1", "--decode-tp", str(decode_tp),
         "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    error = json.loads(result.stdout)
    assert error["field"] == refusal[0] and refusal[1] in error["error"], error
