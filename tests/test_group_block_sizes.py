"""Groups sized apart from their layout (vLLM's hybrid manager): planner, recompute,
negotiation and the wire, against the token-level oracle."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle import oracle_blocks, oracle_valid_tokens

from kvxfer._exceptions import InvalidInputError, NegotiationError, PlanError
from kvxfer.core.layout import BlockSpan, EngineLayout, GroupId, GroupKind, KVGroup, TensorSpec
from kvxfer.core.negotiation import negotiate
from kvxfer.core.planner import plan_blocks
from kvxfer.core.recompute import valid_tokens
from kvxfer.server.engines import check_spans_cover
from kvxfer.wire.layout import layout_from_proto, layout_to_proto

SIZES = (16, 32, 96, 128, 160, 1024)


def _group(gid: int, kind: GroupKind, window: int | None, size: int | None) -> KVGroup:
    return KVGroup(GroupId(gid), kind, window, (gid,), (TensorSpec(f"layer.{gid}", gid, 64),), size)


@st.composite
def mixed_layouts(draw: st.DrawFn) -> EngineLayout:
    """1-3 attention groups and maybe a state group, each with its own block size."""
    layout_size = draw(st.sampled_from(SIZES))
    groups: list[KVGroup] = []
    for gid in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from([GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW]))
        window = draw(st.integers(1, 700)) if kind is GroupKind.SLIDING_WINDOW else None
        size = draw(st.one_of(st.none(), st.sampled_from(SIZES)))
        groups.append(_group(gid, kind, window, size))
    if draw(st.booleans()):
        groups.append(_group(len(groups), GroupKind.MAMBA, None, draw(st.sampled_from(SIZES))))
    return EngineLayout("m", "f", "bfloat16", layout_size, 1, 0, tuple(groups))


@st.composite
def mixed_requests(draw: st.DrawFn, layout: EngineLayout) -> tuple[int, int]:
    """(N, C) with C a multiple of every attention group's block size, or N."""
    sizes = [layout.block_size_of(g) for g in layout.groups if g.kind is not GroupKind.MAMBA]
    step = math.lcm(*sizes)
    num_tokens = draw(st.integers(1, 3000))
    if draw(st.integers(0, 9)) == 0:
        return num_tokens, num_tokens
    computed = draw(st.integers(0, (num_tokens - 1) // step)) * step
    return num_tokens, computed


@settings(max_examples=200)
@given(st.data())
def test_each_group_moves_its_own_blocks(data: st.DataObject) -> None:
    layout = data.draw(mixed_layouts())
    num_tokens, computed = data.draw(mixed_requests(layout))
    for plan in plan_blocks(layout, num_tokens, computed):
        expected = oracle_blocks(plan.group, num_tokens, computed, layout.block_size)
        assert set(plan.blocks) == expected


@settings(max_examples=200)
@given(st.data())
def test_valid_tokens_with_own_block_sizes_matches_simulation(data: st.DataObject) -> None:
    layout = data.draw(mixed_layouts())
    num_tokens, computed = data.draw(mixed_requests(layout))
    failed: dict[int, set[int]] = {}
    for plan in plan_blocks(layout, num_tokens, computed):
        if plan.blocks and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(plan.blocks) - 1))
            failed[plan.group.group_id] = set(plan.blocks[start : start + 3])
    got = valid_tokens(layout.groups, num_tokens, computed, layout.block_size, failed)
    assert got == oracle_valid_tokens(
        layout.groups, num_tokens, computed, layout.block_size, failed
    )


@settings(max_examples=200)
@given(st.data())
def test_the_publish_check_sizes_each_group_by_its_own_block_size(data: st.DataObject) -> None:
    """The sidecar accepts a publish whose spans hold exactly the oracle's blocks of each
    group, and refuses one that stops a block short in any group that moves anything."""
    layout = data.draw(mixed_layouts())
    num_tokens = data.draw(st.integers(1, 3000))
    needed = {g.group_id: oracle_blocks(g, num_tokens, 0, layout.block_size) for g in layout.groups}
    spans = tuple(
        BlockSpan(gid, min(blocks), tuple(range(max(blocks) - min(blocks) + 1)))
        for gid, blocks in needed.items()
        if blocks
    )
    assume(spans)  # nothing to move at all (a window of 1 at N = 1): no publish to check
    check_spans_cover(layout, num_tokens, spans)
    short = data.draw(st.sampled_from(spans))
    if len(short.block_ids) == 1:  # the one block it needs, moved one block on
        short = dataclasses.replace(short, first_block=short.first_block + 1)
    else:  # the last block dropped
        short = dataclasses.replace(short, block_ids=short.block_ids[:-1])
    with pytest.raises(InvalidInputError):
        check_spans_cover(
            layout, num_tokens, tuple(short if s.group_id == short.group_id else s for s in spans)
        )


def test_a_state_group_of_1024_tokens_beside_160_token_attention() -> None:
    """Qwen3-Next on vLLM CPU: attention blocks of 160, a GDN state group of 1024."""
    attention = _group(0, GroupKind.FULL_ATTENTION, None, None)
    state = _group(1, GroupKind.MAMBA, None, 1024)
    layout = EngineLayout("m", "f", "bfloat16", 160, 1, 0, (attention, state))
    plans = plan_blocks(layout, 600, 160)  # 160 is not a multiple of 1024: still accepted
    assert [p.blocks for p in plans] == [range(1, 4), range(1)]


def test_prefix_must_align_with_every_attention_group() -> None:
    a = _group(0, GroupKind.FULL_ATTENTION, None, 32)
    b = _group(1, GroupKind.SLIDING_WINDOW, 100, 96)
    layout = EngineLayout("m", "f", "bfloat16", 32, 1, 0, (a, b))
    with pytest.raises(PlanError, match="block_size 96"):
        plan_blocks(layout, 500, 64)
    assert [p.blocks for p in plan_blocks(layout, 500, 96)] == [range(3, 16), range(4, 6)]


def test_group_block_size_survives_the_wire_and_is_negotiated() -> None:
    layout = EngineLayout(
        "m",
        "f",
        "bfloat16",
        160,
        1,
        0,
        (_group(0, GroupKind.FULL_ATTENTION, None, None), _group(1, GroupKind.MAMBA, None, 1024)),
    )
    assert layout_from_proto(layout_to_proto(layout)) == layout
    other = dataclasses.replace(
        layout,
        groups=(layout.groups[0], dataclasses.replace(layout.groups[1], block_size=512)),
    )
    # A state group holds one state per request whatever its block size: it maps whole.
    assert negotiate(layout, other).groups[1].block_mapping == "state"
    wider = dataclasses.replace(
        other,
        groups=(
            other.groups[0],
            dataclasses.replace(other.groups[1], tensors=(TensorSpec("layer.1", 1, 128),)),
        ),
    )
    with pytest.raises(NegotiationError) as caught:
        negotiate(layout, wider)  # ... and its state bytes must be equal
    assert [m.field for m in caught.value.mismatches] == [
        "layout.groups[1].tensors['layer.1'].bytes_per_block"
    ]
