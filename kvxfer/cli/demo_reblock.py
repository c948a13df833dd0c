"""The demo's byte check when prefill and decode use different block sizes.

With equal block sizes the demo compares whole blocks. With different ones a
decode block receives a token range, possibly from two prefill blocks, and
keeps its old bytes elsewhere, so the check goes token range by token range:
each decode block the pull wrote must equal its previous image (its fill
pattern, or what an earlier request left in it) with the moved tokens'
bytes of the prefill blocks laid over it. The expected images are kept for
the final check of every decode byte (`EngineView.image_mismatch`).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import numpy as np
import numpy.typing as npt

from kvxfer.cli.fleet import EngineView
from kvxfer.core.layout import BlockSpan
from kvxfer.core.planner import GroupPlan

Images = MutableMapping[tuple[str, int], npt.NDArray[np.uint8]]


def source_blocks(plan: GroupPlan, src_block_size: int) -> range:
    """The prefill's logical blocks a group plan reads (its own when sizes are equal)."""
    if plan.tokens is None:
        return plan.blocks
    return range(plan.tokens.start // src_block_size, -(-plan.tokens.stop // src_block_size))


def _pieces(tokens: range, src_size: int, dst_size: int) -> Iterator[range]:
    """`tokens` cut at every block boundary of either side."""
    start = tokens.start
    while start < tokens.stop:
        stop = min(
            tokens.stop, (start // src_size + 1) * src_size, (start // dst_size + 1) * dst_size
        )
        yield range(start, stop)
        start = stop


def check_token_ranges(
    pe: EngineView,
    de: EngineView,
    plan: GroupPlan,
    spans: tuple[BlockSpan, BlockSpan],
    lost: set[int],
    images: Images,
) -> tuple[int, list[str]]:
    """Check one group's moved tokens in the decode blocks that did not fail; returns
    (bytes verified, problems) and records each written block's expected image."""
    assert plan.tokens is not None
    src, dst = spans
    src_size, dst_size = pe.layout.block_size, de.layout.block_size
    verified, problems = 0, []
    for logical in plan.blocks:
        if logical in lost:
            continue
        inside = range(
            max(plan.tokens.start, logical * dst_size),
            min(plan.tokens.stop, (logical + 1) * dst_size),
        )
        d_id = dst.block_id(logical)
        for tensor in plan.group.tensors:
            per_token = tensor.bytes_per_block // dst_size
            expected = images.get((tensor.name, d_id))
            expected = de.pattern_block(tensor.name, d_id) if expected is None else expected.copy()
            for piece in _pieces(inside, src_size, dst_size):
                source = pe.block(tensor.name, src.block_id(piece.start // src_size))
                s_at = piece.start % src_size * per_token
                d_at = piece.start % dst_size * per_token
                size = len(piece) * per_token
                expected[d_at : d_at + size] = source[s_at : s_at + size]
                verified += size
            if not np.array_equal(de.block(tensor.name, d_id), expected):
                problems.append(f"{tensor.name} decode block {logical} differs (token ranges)")
            images[(tensor.name, d_id)] = expected
    return verified, problems
