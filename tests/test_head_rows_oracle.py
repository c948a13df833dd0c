"""Blocks ordered differently on the two sides, against the token-by-token, head-by-head
oracle: token-major blocks ([tokens][heads][head bytes]) against HND ones ([heads][tokens]
[head bytes], `EngineLayout.token_rows`), and HND blocks of different sizes, at equal or
different TP sizes.

The planner moves one head at a time there (kvxfer/core/tp_map.py, `HeadCut.ROWS`). The
oracle below places every (token, head) of a block by the two orders' definitions alone
and knows which global heads each rank holds and which prefill rank serves each
(tests/oracle.py); every descriptor is cut back into (token, head) copies and compared
with the oracle's, for every prefill rank of the pairing: together they must land every
head of every moved token exactly once, and nothing else.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_head_server, oracle_moved_tokens, oracle_rank_heads
from test_reblock_oracle import OFFSET, _trim, _with_regions
from test_tp_head_major_oracle import _check_arrays, _placeable, serving_ranks
from test_tp_oracle import TP_PROFILES, TPCase, draw_tokens

from kvxfer._exceptions import LayoutError, NegotiationError, PlanError
from kvxfer.core.layout import (
    BlockId,
    BlockSpan,
    EngineLayout,
    GroupId,
    KVGroup,
    Region,
    TensorSpec,
)
from kvxfer.core.negotiation import negotiate
from kvxfer.core.planner import TransferPlan, plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.wire.layout import layout_from_proto, layout_to_proto

SIZES = (1, 8, 16, 32, 48, 64)
ORDERS = ("token", "hnd")
Copy = tuple[str, int, int, int]  # tensor, src byte, dst byte, bytes
SPANS = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(5)))]  # llama, 64 tokens


@dataclasses.dataclass(frozen=True)
class RowsCase(TPCase):
    """A `TPCase` whose sides order their blocks as asked, TP sizes equal or not."""

    src_order: str = "token"
    dst_order: str = "hnd"

    def layout(self, tp: int, rank: int, size: int, side: str) -> EngineLayout:
        layout = layout_for_model(self.model, block_size=size, tp_size=tp, tp_rank=rank)
        hnd = (self.src_order if side == "s" else self.dst_order) == "hnd"
        ordered = dataclasses.replace(
            layout,
            groups=tuple(_trim(g) for g in layout.groups),
            token_major=not hnd,
            head_major=hnd,
            token_rows=hnd,
        )
        return _with_regions(ordered, self.pool(size), side)


def _heads(model: str, group_id: int) -> int:
    heads = layout_for_model(model).groups[group_id].num_kv_heads
    assert heads is not None
    return heads


def place(order: str, size: int, held: int, head: int, token: int, local: int) -> int:
    """Byte of (token, local head) inside a block, from the order's definition alone:
    token-major [size][held][head], HND [held][size][head]."""
    row = token % size
    if order == "token":
        return (row * held + local) * head
    return (local * size + row) * head


@st.composite
def rows_cases(draw: st.DrawFn) -> RowsCase:
    model = draw(st.sampled_from(TP_PROFILES))
    placeable = _placeable(model)
    src_tp, dst_tp = draw(st.sampled_from(placeable)), draw(st.sampled_from(placeable))
    src_size, dst_size = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    num_tokens, computed = draw_tokens(draw, dst_size, 160)
    return RowsCase(
        model,
        src_tp,
        dst_tp,
        draw(st.integers(0, dst_tp - 1)),
        src_size,
        dst_size,
        num_tokens,
        computed,
        draw(st.integers(0, 2**32)),
        src_order=draw(st.sampled_from(ORDERS)),
        dst_order=draw(st.sampled_from(ORDERS)),
    )


def _head_bytes(case: RowsCase, group: KVGroup, tensor: TensorSpec) -> int:
    """One head of one token: a decode block is its rank's heads of every token."""
    mine = oracle_rank_heads(_heads(case.model, group.group_id), case.dst_tp, case.dst_rank)
    assert tensor.bytes_per_block % (case.dst_size * len(mine)) == 0
    return tensor.bytes_per_block // case.dst_size // len(mine)


def _expected(case: RowsCase, group: KVGroup, rank: int) -> set[Copy]:
    """Every (token, head) copy prefill rank `rank` serves the decode rank, by hand."""
    heads = _heads(case.model, group.group_id)
    dst, src = case.dst, case.src(rank)
    mine = oracle_rank_heads(heads, case.dst_tp, case.dst_rank)
    theirs = oracle_rank_heads(heads, case.src_tp, rank)
    served = [h for h in mine if oracle_head_server(heads, case.src_tp, h, case.dst_rank) == rank]
    moved = oracle_moved_tokens(group, case.num_tokens, case.computed, case.src_size, case.dst_size)
    src_ids, dst_ids = case.ids("s", src)[group.group_id], case.ids("d", dst)[group.group_id]
    copies = set()
    for tensor in group.tensors:
        head = _head_bytes(case, group, tensor)
        src_block = src.region_map[tensor.name].block_bytes
        assert src_block == case.src_size * len(theirs) * head
        for t in moved:
            for h in served:
                s = OFFSET + src_ids[t // case.src_size] * src_block
                s += place(case.src_order, case.src_size, len(theirs), head, t, theirs.index(h))
                d = OFFSET + dst_ids[t // case.dst_size] * tensor.bytes_per_block
                d += place(case.dst_order, case.dst_size, len(mine), head, t, mine.index(h))
                copies.add((tensor.name, s, d, head))
    return copies


def _planned(case: RowsCase, plan: TransferPlan, group: KVGroup) -> list[Copy]:
    """The plan's descriptors for `group`, cut into one copy per head of each token."""
    heads = {t.name: _head_bytes(case, group, t) for t in group.tensors}
    out = []
    for chunk in plan.chunks:
        if chunk.group_id != group.group_id:
            continue
        _check_arrays(chunk)
        descriptors = list(chunk.descriptors())
        assert len(descriptors) == chunk.num_descriptors
        for d in descriptors:
            name = d.src_buffer.removeprefix("s:")
            head = heads[name]
            assert d.dst_buffer == f"d:{name}" and d.length % head == 0 and d.length, d
            out += [
                (name, d.src_offset + i, d.dst_offset + i, head) for i in range(0, d.length, head)
            ]
    return out


@settings(max_examples=150, deadline=None)
@given(rows_cases(), st.integers(1, 6))
def test_every_head_of_every_token_lands_where_the_readers_order_puts_it(
    case: RowsCase, chunk_blocks: int
) -> None:
    dst = case.dst
    landed: dict[int, list[Copy]] = {}
    servers = serving_ranks(case)
    for rank in range(case.src_tp):
        if rank not in servers:
            with pytest.raises(PlanError, match="holds none of decode rank"):
                case.plan(rank, chunk_blocks)
            continue
        plan = case.plan(rank, chunk_blocks)
        for group_plan in plan.groups:
            group = group_plan.group
            planned = _planned(case, plan, group)
            assert len(planned) == len(set(planned)), "a byte range moves twice"
            expected = _expected(case, group, rank)
            missing, extra = expected - set(planned), set(planned) - expected
            assert not missing and not extra, (sorted(missing)[:3], sorted(extra)[:3])
            assert group_plan.nbytes == sum(c[3] for c in expected)
            landed.setdefault(group.group_id, []).extend(planned)
        assert plan.nbytes == sum(c.nbytes for c in plan.chunks)
    for group in dst.groups:  # all ranks together: each head of each moved token once
        mine = oracle_rank_heads(_heads(case.model, group.group_id), case.dst_tp, case.dst_rank)
        moved = oracle_moved_tokens(
            group, case.num_tokens, case.computed, case.src_size, case.dst_size
        )
        dsts = [(c[0], c[2]) for c in landed.get(group.group_id, [])]
        assert len(dsts) == len(set(dsts))
        assert len(dsts) == len(moved) * len(mine) * len(group.tensors)


def _case(src_order: str, dst_order: str, src: tuple[int, int], dst: tuple[int, int]) -> RowsCase:
    """Llama (8 KV heads, 128 bf16 values a head), 64 tokens from 0, blocks ascending on
    both sides (runs coalesce where memory allows), decode rank 0; (TP size, block size)."""
    return dataclasses.replace(
        RowsCase("llama-3.1-8b", src[0], dst[0], 0, src[1], dst[1], 64, 0, 0),
        src_order=src_order,
        dst_order=dst_order,
    )


def _ascending(case: RowsCase) -> RowsCase:
    class Ascending(RowsCase):
        def ids(self, side: str, layout: EngineLayout) -> dict[int, list[int]]:
            return {g.group_id: list(range(self.pool(layout.block_size))) for g in layout.groups}

    return Ascending(**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)})


def test_descriptors_are_as_few_as_the_two_orders_allow() -> None:
    """A token's heads are one range in token-major blocks, a head's tokens in HND ones:
    between the two, every (token, head) is its own descriptor; between HND blocks of
    16 and 32 tokens each head moves 16 rows at a time; with one head per rank both
    orders are the same bytes and whole runs of blocks coalesce."""
    head, tensors = 128 * 2, 2
    mixed = _ascending(_case("token", "hnd", (1, 16), (1, 16))).plan(0, 8)
    assert sum(c.num_descriptors for c in mixed.chunks) == 64 * 8 * tensors
    assert {d.length for c in mixed.chunks for d in c.descriptors()} == {head}
    rows = _ascending(_case("hnd", "hnd", (1, 16), (1, 32))).plan(0, 8)
    assert sum(c.num_descriptors for c in rows.chunks) == 4 * 8 * tensors
    assert {d.length for c in rows.chunks for d in c.descriptors()} == {16 * head}
    split = _ascending(_case("token", "hnd", (1, 16), (2, 32))).plan(0, 8)  # heads 0..3
    assert sum(c.num_descriptors for c in split.chunks) == 64 * 4 * tensors
    one = _ascending(_case("token", "hnd", (8, 16), (8, 32))).plan(0, 8)  # one head a rank
    assert sum(c.num_descriptors for c in one.chunks) == tensors
    assert {d.length for c in one.chunks for d in c.descriptors()} == {64 * head}
    for plan in (mixed, rows, split, one):
        assert plan.nbytes == sum(c.nbytes for c in plan.chunks)


def test_the_agreement_says_how_heads_are_cut() -> None:
    """The decode side's view: mapped by heads, one token (token-major against HND) or a
    row run (HND of different sizes) per byte range; orders alike agree as before."""
    for src_order, dst_order, src, dst, unit in (
        ("token", "hnd", (1, 16), (1, 16), 1),
        ("hnd", "token", (2, 32), (1, 16), 1),
        ("hnd", "hnd", (1, 16), (1, 48), 16),
        ("hnd", "hnd", (1, 48), (2, 32), 16),
        ("token", "hnd", (8, 32), (8, 16), 16),  # one head a rank: rows on both sides
    ):
        case = _case(src_order, dst_order, src, dst)
        agreement = negotiate(case.dst, case.src(0))
        assert {(g.block_mapping, g.slice_tokens) for g in agreement.groups} == {("heads", unit)}
    same = _case("hnd", "hnd", (1, 16), (1, 16))
    assert {g.block_mapping for g in negotiate(same.dst, same.src(0)).groups} == {"same"}


def _opaque(layout: EngineLayout) -> EngineLayout:
    """Head-major blocks in an engine's own order inside a head (vLLM's CPU pages)."""
    return dataclasses.replace(layout, token_major=False, head_major=True, token_rows=False)


def test_what_cannot_be_cut_to_meet_is_refused_with_the_reason() -> None:
    """Head-major blocks in an engine's own order name no token of a head: they meet
    only their own order at their own size. Strided HND pages are no array of rows."""
    opaque = _opaque(_case("hnd", "hnd", (1, 16), (1, 16)).dst)  # the decode side
    for src_order, size, reason in (
        (
            "token",
            16,
            r"decode side's blocks are head-major \(.*own order\), the other side's token",
        ),
        ("hnd", 16, r"decode side's blocks are head-major \(.*own order\), the other side's HND"),
        ("hnd", 32, "the decode side's blocks are head-major .* the other side's HND"),
        ("opaque", 32, r"head-major blocks of 32 \(prefill\) and 16 \(decode\) tokens"),
    ):
        src = _case("hnd" if src_order == "opaque" else src_order, "hnd", (1, size), (1, 16))
        src = _opaque(src.src(0)) if src_order == "opaque" else src.src(0)
        with pytest.raises(NegotiationError) as refused:
            negotiate(opaque, src)
        (mismatch,) = refused.value.mismatches
        assert mismatch.field == "layout.groups[0].block_size"
        assert re.search(reason, mismatch.hint), mismatch.hint
        with pytest.raises(PlanError, match="block_size"):
            plan_transfer(src, opaque, SPANS, SPANS, 64, 0)
    case = _case("token", "hnd", (1, 16), (1, 16))
    padded = case.dst.with_regions(
        Region(r.name, r.buffer, r.offset_bytes, r.num_blocks, r.stride_bytes + 64, r.block_bytes)
        for r in case.dst.regions
    )
    with pytest.raises(PlanError, match=r"decode side region .* is strided .* not one array"):
        plan_transfer(case.src(0), padded, SPANS, SPANS, 64, 0)
    with pytest.raises(NegotiationError) as refused:
        negotiate(padded, case.src(0))
    assert [m.field for m in refused.value.mismatches] == ["layout.groups[0].tensors"]
    plan_transfer(case.src(0), case.dst, SPANS, SPANS, 64, 0)  # unpadded: planned


def test_an_mla_latent_in_hnd_blocks_is_token_major() -> None:
    """A latent is one head: HND rows are its tokens, so it pairs with token-major
    latents of another block size by token ranges, as token-major ones do."""
    model = "deepseek-v2-lite"
    hnd = dataclasses.replace(
        layout_for_model(model, block_size=32), token_major=False, head_major=True, token_rows=True
    )
    agreement = negotiate(layout_for_model(model), hnd)
    assert {(g.block_mapping, g.slice_tokens) for g in agreement.groups} == {("tokens", 16)}
    opaque = dataclasses.replace(hnd, token_rows=False)
    with pytest.raises(NegotiationError, match="not token-major"):
        negotiate(layout_for_model(model), opaque)


def test_token_rows_go_over_the_wire_and_need_head_major() -> None:
    layout = _case("token", "hnd", (1, 16), (1, 16)).dst
    assert layout.token_rows and layout_from_proto(layout_to_proto(layout)) == layout
    message = layout_to_proto(layout)
    message.head_major = False
    with pytest.raises(LayoutError) as info:
        layout_from_proto(message)
    assert info.value.field == "layout.token_rows"
