"""plan_transfer: exact per-(region, block) coverage, maximal coalescing, id validation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import oracle_blocks
from strategies import layouts, requests

from kvxfer._exceptions import LayoutError, PlanError
from kvxfer.core.layout import MAX_BLOCKS, BlockId, BlockSpan, EngineLayout, GroupId, Region
from kvxfer.core.planner import Chunk, plan_transfer
from kvxfer.core.profiles import layout_for_model


def bind(layout: EngineLayout, num_blocks: int, prefix: str, strided: bool = False) -> EngineLayout:
    """Put every tensor in its own region of one buffer per group (stride doubled if asked)."""
    regions = []
    for group in layout.groups:
        offset = 0
        for tensor in group.tensors:
            stride = tensor.bytes_per_block * (2 if strided else 1)
            regions.append(
                Region(
                    tensor.name,
                    f"{prefix}{group.group_id}",
                    offset,
                    num_blocks,
                    stride,
                    tensor.bytes_per_block,
                )
            )
            offset += stride * num_blocks
    return layout.with_regions(regions)


def spans_for(
    layout: EngineLayout, num_tokens: int, num_blocks: int, rng: random.Random, shuffle: float
) -> list[BlockSpan]:
    """One span per group from logical block 0, ids mostly consecutive with some jumps."""
    spans = []
    for group in layout.groups:
        count = 1 if group.kind.value == "mamba" else -(-num_tokens // layout.block_size)
        ids = list(range(num_blocks))[:count]
        for i in range(len(ids)):
            if rng.random() < shuffle:
                j = rng.randrange(len(ids))
                ids[i], ids[j] = ids[j], ids[i]
        spans.append(BlockSpan(GroupId(group.group_id), 0, tuple(BlockId(b) for b in ids)))
    return spans


@given(st.data())
def test_descriptors_cover_exactly_the_planned_blocks(data: st.DataObject) -> None:
    base = data.draw(layouts())
    num_tokens, computed = data.draw(requests(base.block_size, max_tokens=4000))
    num_blocks = -(-num_tokens // base.block_size) + data.draw(st.integers(0, 5))
    strided = data.draw(st.booleans())
    src = bind(base, num_blocks, "p", strided)
    dst = bind(base, num_blocks, "d", strided=False)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    src_spans = spans_for(
        src, num_tokens, num_blocks, rng, data.draw(st.sampled_from([0, 0.05, 0.5]))
    )
    dst_spans = spans_for(
        dst, num_tokens, num_blocks, rng, data.draw(st.sampled_from([0, 0.05, 0.5]))
    )
    chunk_blocks = data.draw(st.integers(1, 300))
    plan = plan_transfer(src, dst, src_spans, dst_spans, num_tokens, computed, chunk_blocks)

    # Expected: every (tensor, logical block) the oracle needs, once, at the right offsets.
    expected: dict[tuple[str, int], tuple[str, int]] = {}
    for group, s_span, d_span in zip(base.groups, src_spans, dst_spans, strict=True):
        for block in oracle_blocks(group, num_tokens, computed, base.block_size):
            for tensor in group.tensors:
                s_reg, d_reg = src.region_map[tensor.name], dst.region_map[tensor.name]
                s_off = s_reg.block_offset(s_span.block_ids[block])
                d_off = d_reg.block_offset(d_span.block_ids[block])
                expected[(s_reg.buffer, s_off)] = (d_reg.buffer, d_off)
    got: dict[tuple[str, int], tuple[str, int]] = {}
    total = 0
    for chunk in plan.chunks:
        assert len(chunk.blocks) <= chunk_blocks
        assert chunk.num_descriptors == len(list(chunk.descriptors()))
        for d in chunk.descriptors():
            total += d.length
            step = _block_bytes_at(chunk, d.src_buffer, d.src_offset)
            assert d.length % step == 0
            for i in range(0, d.length, step):
                key = (d.src_buffer, d.src_offset + i)
                assert key not in got, "a byte range is moved twice"
                got[key] = (d.dst_buffer, d.dst_offset + i)
    assert got == expected
    assert total == plan.nbytes
    _assert_maximal(plan.chunks)


def _block_bytes_at(chunk: Chunk, buffer: str, offset: int) -> int:
    for pair in chunk.regions:
        if pair.src.buffer == buffer and pair.src.offset_bytes <= offset < pair.src.end_bytes:
            return int(pair.src.block_bytes)
    raise AssertionError(f"descriptor at {buffer}+{offset} is in no region")


def _assert_maximal(chunks: tuple[Chunk, ...]) -> None:
    """No two runs inside a chunk could have been one."""
    for chunk in chunks:
        for a, b in zip(chunk.runs, chunk.runs[1:], strict=False):
            assert not (
                b.src_block == a.src_block + a.count and b.dst_block == a.dst_block + a.count
            )


def test_consecutive_ids_give_one_descriptor_per_region_per_chunk() -> None:
    base = layout_for_model("llama-3.1-8b", block_size=16)
    src, dst = bind(base, 100, "p"), bind(base, 100, "d")
    spans = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(64)))]
    plan = plan_transfer(src, dst, spans, spans, 1024, 0, chunk_blocks=32)
    assert len(plan.chunks) == 2
    for chunk in plan.chunks:
        descriptors = list(chunk.descriptors())
        assert len(descriptors) == 64  # 32 layers x (K, V)
        assert {d.length for d in descriptors} == {32 * 16 * 8 * 128 * 2}


def test_plans_between_the_same_layouts_share_their_checked_region_pairs() -> None:
    base = layout_for_model("gpt-oss-20b", block_size=16)
    src, dst = bind(base, 80, "p"), bind(base, 80, "d")
    spans = spans_for(src, 1024, 80, random.Random(0), 0)
    first = plan_transfer(src, dst, spans, spans, 1024, 0)
    again = plan_transfer(src, dst, spans, spans, 1024, 0)
    assert len(first.chunks) == len(again.chunks) == 2
    for a, b in zip(first.chunks, again.chunks, strict=True):
        assert a.regions is b.regions  # found again, not rebuilt
    # A layout equal to dst but another object is checked and paired on its own.
    twin = bind(base, 80, "d")
    assert twin == dst and twin is not dst
    other = plan_transfer(src, twin, spans, spans, 1024, 0)
    for a, b in zip(first.chunks, other.chunks, strict=True):
        assert a.regions == b.regions and a.regions is not b.regions
    # A pair that does not match is refused every time, never remembered as checked.
    wrong = bind(layout_for_model("llama-3.1-8b", block_size=16), 80, "d")
    for _ in range(2):
        with pytest.raises(PlanError, match="src has 2 groups, dst has 1"):
            plan_transfer(src, wrong, spans, spans, 1024, 0)


def test_out_of_range_id_is_rejected_naming_the_region() -> None:
    base = layout_for_model("llama-3.1-8b", block_size=16)
    src, dst = bind(base, 8, "p"), bind(base, 8, "d")
    good = BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(4)))
    bad = BlockSpan(GroupId(0), 0, (BlockId(0), BlockId(1), BlockId(9), BlockId(3)))
    with pytest.raises(
        PlanError,
        match=r"block 9 \(logical block 2\) out of range for region "
        r"'layer.0.k' \(8 blocks\)",
    ):
        plan_transfer(src, dst, [good], [bad], 64, 0)


def test_span_that_does_not_cover_the_needed_blocks_is_rejected() -> None:
    base = layout_for_model("gpt-oss-20b", block_size=16)
    src, dst = bind(base, 100, "p"), bind(base, 100, "d")
    full = BlockSpan(GroupId(1), 0, tuple(BlockId(b) for b in range(63)))
    short_window = BlockSpan(GroupId(0), 56, tuple(BlockId(b) for b in range(6)))
    with pytest.raises(PlanError, match=r"covers logical blocks 56..61, needs 54..62"):
        plan_transfer(src, dst, [short_window, full], [short_window, full], 1000, 0)


def test_missing_span_and_duplicate_group_are_rejected() -> None:
    base = layout_for_model("llama-3.1-8b", block_size=16)
    src, dst = bind(base, 10, "p"), bind(base, 10, "d")
    span = BlockSpan(GroupId(0), 0, (BlockId(0),))
    with pytest.raises(PlanError, match=r"dst_spans\[group 0\]: missing"):
        plan_transfer(src, dst, [span], [], 16, 0)
    with pytest.raises(PlanError, match=r"src_spans\[1\].group_id: group 0 appears twice"):
        plan_transfer(src, dst, [span, span], [span], 16, 0)


def test_region_block_size_must_match_layout() -> None:
    base = layout_for_model("llama-3.1-8b", block_size=16)
    regions = list(bind(base, 4, "p").regions)
    regions[3] = Region("layer.1.v", "p0", 0, 4, 100, 100)
    with pytest.raises(LayoutError, match=r"region 'layer.1.v'.block_bytes: expected 32768"):
        base.with_regions(regions)


@pytest.mark.parametrize(
    ("bad", "message"),
    [(-5, "must be in"), (MAX_BLOCKS + 1, "must be in"), (True, "must be an integer"),
     (2.0, "must be an integer")],
)  # fmt: skip
def test_a_bad_span_id_is_rejected_naming_the_field(bad: object, message: str) -> None:
    ids = [BlockId(b) for b in range(1000)]  # checked all at once, named one by one
    ids[700] = bad  # type: ignore[call-overload]
    with pytest.raises(LayoutError, match=rf"spans\[group 1\].block_ids\[700\]: {message}"):
        BlockSpan(GroupId(1), 0, tuple(ids))
