"""Prefill and decode with different block sizes, end to end: `kvxfer-cli demo` with
real sidecar processes, real NIXL over shared memory and chunk failures injected
through the decode sidecar's fault seam.

The demo checks every byte itself (each decode block: its old image with the moved
tokens of the prefill blocks laid over it; every other decode byte untouched). This
test checks, independently of the planner, what the token-level oracle says: how
many bytes each request moves and where the engine resumes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from oracle import oracle_moved_tokens, oracle_valid_tokens_moved
from test_demo import Demos, demos  # noqa: F401 (the fixture)

from kvxfer.core.layout import EngineLayout, GroupKind
from kvxfer.core.profiles import layout_for_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _oracle_bytes(
    layout: EngineLayout, src_block: int, row: dict[str, Any], failed: dict[int, list[int]]
) -> int:
    """Bytes that land in decode blocks that did not fail, token by token."""
    tokens, computed, total = row["tokens"], row["computed_tokens"], 0
    for group in layout.groups:
        lost = set(failed.get(group.group_id, ()))
        if group.kind is GroupKind.MAMBA:
            total += group.bytes_per_block if computed < tokens and not lost else 0
            continue
        moved = oracle_moved_tokens(group, tokens, computed, src_block, layout.block_size)
        landed = [t for t in moved if t // layout.block_size not in lost]
        total += len(landed) * (group.bytes_per_block // layout.block_size)
    return total


@pytest.mark.parametrize(
    ("model", "prefill_block", "decode_block"),
    [
        ("gpt-oss-20b", 16, 32),  # sliding window + full attention, decode blocks larger
        ("gemma-3-4b-it", 32, 16),  # the reverse
        ("qwen3-next-80b-a3b", 16, 48),  # a state group beside attention; 16 divides 48
        ("llama-3.1-8b", 48, 32),  # neither divides the other: slices of 16 tokens
    ],
)
def test_different_block_sizes_pull_byte_for_byte_with_failures(
    demos: Demos,  # noqa: F811 (the fixture)
    model: str,
    prefill_block: int,
    decode_block: int,
) -> None:
    result = demos.run(
        "--model", model, "--requests", "5", "--tokens-range", "100:1500",
        "--prefix-hit-rate", "0.5", "--fail-rate", "0.25", "--seed", "2",
        "--prefill-block-size", str(prefill_block), "--decode-block-size", str(decode_block),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    check_demo_report(json.loads(result.stdout), model, prefill_block, decode_block)


def check_demo_report(
    report: dict[str, Any], model: str, prefill_block: int, decode_block: int
) -> None:
    """Every request of a `demo --json` report against the token-level oracle: bytes
    moved and valid_tokens, with at least one failure and one whole request."""
    assert report["block_sizes"] == {"prefill": prefill_block, "decode": decode_block}
    assert report["verified_requests"] == 5 and report["untouched_bytes_verified"] is True
    assert report["failed_blocks"] > 0, "seed 2 injects at least one failure"
    layout = layout_for_model(model, block_size=decode_block)
    groups = list(layout.groups)
    clean = 0
    for row in report["per_request"]:
        assert row["problems"] == []
        failed = {int(g): blocks for g, blocks in row["failed_blocks"].items()}
        moved = {
            g.group_id: oracle_moved_tokens(
                g, row["tokens"], row["computed_tokens"], prefill_block, decode_block
            )
            for g in groups
            if g.kind is not GroupKind.MAMBA
        }
        want = oracle_valid_tokens_moved(
            groups, row["tokens"], row["computed_tokens"], decode_block, failed, moved
        )
        assert row["valid_tokens"] == want
        assert row["bytes_moved"] == _oracle_bytes(layout, prefill_block, row, failed)
        clean += not failed
        assert row["status"] == "ok" if not failed else row["status"] in ("partial", "failed")
    assert clean > 0, "seed 2 leaves at least one request whole"
