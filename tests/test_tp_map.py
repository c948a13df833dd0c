"""Different TP sizes: the head mapping against a head-by-head brute force.

Pure groundwork (kvxfer/core/tp_map.py); negotiation still refuses different TP sizes.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer._exceptions import LayoutError
from kvxfer.core.tp_map import head_sources, request_valid_tokens


def _holdings(num_heads: int, tp: int) -> list[list[int]]:
    """Global heads of each rank, head by head: heads dealt out in equal contiguous
    shares, or each head copied to an equal share of the ranks."""
    if num_heads >= tp:
        return [[h for h in range(num_heads) if h * tp // num_heads == r] for r in range(tp)]
    return [[r * num_heads // tp] for r in range(tp)]


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    sizes = [t for t in (1, 2, 4, 8, 16, 32, 64) if heads % t == 0 or t % heads == 0]
    return heads, draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))


@given(shapes())
def test_every_decode_head_comes_from_a_prefill_rank_holding_it(
    shape: tuple[int, int, int],
) -> None:
    heads, src_tp, dst_tp = shape
    src, dst = _holdings(heads, src_tp), _holdings(heads, dst_tp)
    readers: dict[int, set[int]] = {}
    for rank in range(dst_tp):
        slices = head_sources(heads, src_tp, dst_tp, rank)
        pairs = [
            (s.src_rank, s.src_heads.start + i, s.dst_heads.start + i)
            for s in slices
            for i in range(len(s.dst_heads))
        ]
        assert [d for _, _, d in pairs] == list(range(len(dst[rank])))  # each once, in order
        for src_rank, src_local, dst_local in pairs:
            assert src[src_rank][src_local] == dst[rank][dst_local]
            readers.setdefault(dst[rank][dst_local], set()).add(src_rank)
        for a, b in itertools.pairwise(slices):  # maximal runs: none could merge
            assert a.src_rank != b.src_rank or a.src_heads.stop != b.src_heads.start
        for s in slices:
            offset_src, offset_dst, length = s.byte_range(256)
            assert (offset_src, offset_dst, length) == (
                s.src_heads.start * 256, s.dst_heads.start * 256, len(s.dst_heads) * 256
            )  # fmt: skip
    for head, ranks in readers.items():  # replicated prefill heads: readers spread out
        copies = sum(head in held for held in src)
        reading = sum(head in held for held in dst)
        assert len(ranks) == min(copies, reading)


def test_uneven_splits_are_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="tp_size"):
        head_sources(6, 4, 2, 0)
    with pytest.raises(LayoutError, match="tp_size"):
        head_sources(4, 2, 6, 0)


def test_one_valid_tokens_for_the_request() -> None:
    assert request_valid_tokens({0: 512, 1: 384}) == 384
    with pytest.raises(LayoutError, match="valid_tokens"):
        request_valid_tokens({})
