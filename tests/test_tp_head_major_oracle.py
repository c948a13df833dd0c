"""Different TP sizes between head-major layouts, against the block-by-block, head-by-head
oracle.

A head-major block (vLLM's CPU pages) is [the heads the rank holds][one head's bytes for
every token of the block]: a run of heads is one byte range of each block, so the planner
moves whole blocks (equal block sizes on both sides) with every region narrowed to the
head run one prefill rank serves (kvxfer/core/planner.py, `_head_pairs`). The oracle
(tests/oracle.py) knows only which global heads each rank holds, which prefill rank
serves each head and which tokens move; here every descriptor is cut back into
(block, head) copies and compared with the oracle's, for every prefill rank of the
pairing: together they must land every head of every moved block exactly once.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_head_server, oracle_moved_tokens, oracle_rank_heads
from test_reblock_oracle import OFFSET, _trim, _with_regions
from test_tp_oracle import TP_PROFILES, TP_SIZES, TPCase, draw_tokens

from kvxfer._exceptions import LayoutError, NegotiationError, PlanError
from kvxfer.core.buffers import MemoryKind
from kvxfer.core.layout import EngineLayout, KVGroup, Region
from kvxfer.core.negotiation import negotiate
from kvxfer.core.planner import Chunk
from kvxfer.core.profiles import layout_for_model
from kvxfer.dataplane.descriptors import BoundBuffer, chunk_arrays

SIZES = (1, 8, 16, 32, 64)
Copy = tuple[str, int, int, int]  # tensor, src byte, dst byte, bytes


@dataclasses.dataclass(frozen=True)
class HMCase(TPCase):
    """A `TPCase` whose blocks are head-major (on the sides asked for), regions `pad`
    bytes apart (0: contiguous, as test_reblock_oracle registers them)."""

    src_head_major: bool = True
    dst_head_major: bool = True
    pad: int = 0
    ascending: bool = False  # block ids 0, 1, 2, ... on both sides: runs coalesce

    def ids(self, side: str, layout: EngineLayout) -> dict[int, list[int]]:
        if not self.ascending:
            return super().ids(side, layout)
        return {g.group_id: list(range(self.pool(layout.block_size))) for g in layout.groups}

    def layout(self, tp: int, rank: int, size: int, side: str) -> EngineLayout:
        layout = layout_for_model(self.model, block_size=size, tp_size=tp, tp_rank=rank)
        head_major = self.src_head_major if side == "s" else self.dst_head_major
        trimmed = dataclasses.replace(
            layout,
            groups=tuple(_trim(g) for g in layout.groups),
            token_major=not head_major,
            head_major=head_major,
        )
        pool = self.pool(size)
        if not self.pad:
            out = _with_regions(trimmed, pool, side)
        else:
            pad = self.pad
            out = trimmed.with_regions(  # pages padded apart: strided regions
                [
                    Region(t.name, f"{side}:{t.name}", OFFSET, pool, t.bytes_per_block + pad,
                           t.bytes_per_block)
                    for g in trimmed.groups
                    for t in g.tensors
                ]
            )  # fmt: skip
        assert (out.head_major, out.token_major) == (head_major, not head_major)  # kept
        assert out.regions
        return out


def _heads(model: str, group_id: int) -> int:
    """Global KV heads of a group, from the model's TP-1 profile."""
    heads = layout_for_model(model).groups[group_id].num_kv_heads
    assert heads is not None
    return heads


def _placeable(model: str) -> list[int]:
    heads = {_heads(model, g.group_id) for g in layout_for_model(model).groups}
    return [t for t in TP_SIZES if all(h % t == 0 or t % h == 0 for h in heads)]


@st.composite
def hm_cases(draw: st.DrawFn) -> HMCase:
    model = draw(st.sampled_from(TP_PROFILES))
    placeable = _placeable(model)
    src_tp = draw(st.sampled_from(placeable))
    dst_tp = draw(st.sampled_from([t for t in placeable if t != src_tp]))
    size = draw(st.sampled_from(SIZES))  # equal on both sides
    num_tokens, computed = draw_tokens(draw, size, 200)
    return HMCase(
        model,
        src_tp,
        dst_tp,
        draw(st.integers(0, dst_tp - 1)),
        size,
        size,
        num_tokens,
        computed,
        draw(st.integers(0, 2**32)),
        pad=draw(st.sampled_from((0, 0, 64))),
        ascending=draw(st.booleans()),
    )


def serving_ranks(case: TPCase) -> set[int]:
    """The prefill ranks that serve the decode rank some head of some group (oracle)."""
    return {
        oracle_head_server(_heads(case.model, g.group_id), case.src_tp, h, case.dst_rank)
        for g in case.dst.groups
        for h in oracle_rank_heads(_heads(case.model, g.group_id), case.dst_tp, case.dst_rank)
    }


def _moved_blocks(case: HMCase, group: KVGroup) -> set[int]:
    """Logical blocks that move: those of the oracle's moved tokens (equal sizes)."""
    size = case.dst_size
    tokens = oracle_moved_tokens(group, case.num_tokens, case.computed, size, size)
    return {t // size for t in tokens}


def _head_block_bytes(case: HMCase, group: KVGroup, tensor_bytes: int) -> int:
    """Bytes of one head over a whole block: a decode block is its rank's heads."""
    mine = oracle_rank_heads(_heads(case.model, group.group_id), case.dst_tp, case.dst_rank)
    assert tensor_bytes % len(mine) == 0
    return tensor_bytes // len(mine)


def _expected(case: HMCase, group: KVGroup, rank: int) -> set[Copy]:
    """Every (block, head) copy prefill rank `rank` serves the decode rank, by hand."""
    heads = _heads(case.model, group.group_id)
    dst, src = case.dst, case.src(rank)
    mine = oracle_rank_heads(heads, case.dst_tp, case.dst_rank)
    theirs = oracle_rank_heads(heads, case.src_tp, rank)
    served = [h for h in mine if oracle_head_server(heads, case.src_tp, h, case.dst_rank) == rank]
    src_ids, dst_ids = case.ids("s", src)[group.group_id], case.ids("d", dst)[group.group_id]
    copies = set()
    for tensor in group.tensors:
        head = _head_block_bytes(case, group, tensor.bytes_per_block)
        src_region, dst_region = src.region_map[tensor.name], dst.region_map[tensor.name]
        assert src_region.block_bytes == head * len(theirs)  # a prefill block: its heads
        for b in _moved_blocks(case, group):
            for h in served:
                s = OFFSET + src_ids[b] * src_region.stride_bytes + theirs.index(h) * head
                d = OFFSET + dst_ids[b] * dst_region.stride_bytes + mine.index(h) * head
                copies.add((tensor.name, s, d, head))
    return copies


def _chunk_copies(chunk: Chunk, group: KVGroup, case: HMCase) -> list[Copy]:
    """One chunk's descriptors cut into one copy per head of each block."""
    heads = {t.name: _head_block_bytes(case, group, t.bytes_per_block) for t in group.tensors}
    out = []
    for d in chunk.descriptors():
        name = d.src_buffer.removeprefix("s:")
        head = heads[name]
        assert d.dst_buffer == f"d:{name}" and d.length % head == 0 and d.length, d
        out += [(name, d.src_offset + i, d.dst_offset + i, head) for i in range(0, d.length, head)]
    return out


def _check_arrays(chunk: Chunk) -> None:
    """The data plane's numpy descriptors are the planner's, narrowed regions too."""
    size = 1 << 44
    src = {p.src.buffer: BoundBuffer(1 << 40, size, 0, MemoryKind.DRAM) for p in chunk.regions}
    dst = {p.dst.buffer: BoundBuffer(1 << 41, size, 3, MemoryKind.DRAM) for p in chunk.regions}
    s, d = chunk_arrays(chunk, src, dst)
    want = [((1 << 40) + w.src_offset, (1 << 41) + w.dst_offset, w.length, w.length)
            for w in chunk.descriptors()]  # fmt: skip
    assert s.shape == d.shape == (len(want), 3)
    got = [tuple(row) for row in np.stack((s[:, 0], d[:, 0], s[:, 1], d[:, 1]), 1).tolist()]
    wrong = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
    assert wrong is None, (wrong, got[wrong], want[wrong])


def _logical(copy: Copy, stride: int, dst_ids: list[int]) -> tuple[int, int]:
    """(decode logical block, byte inside the block) a copy lands on."""
    block, within = divmod(copy[2] - OFFSET, stride)
    return dst_ids.index(block), within


def _check_coalesced(case: HMCase, chunk: Chunk, group: KVGroup, copies: list[Copy]) -> None:
    """One descriptor per tensor per stretch of (block, head) copies, in the decode
    rank's logical order, that is contiguous on both sides: never split where it need
    not be (a merge where it must not shows as a wrong copy). A head run narrower than
    a block, or pages padded apart, break at every block; whole contiguous blocks run
    on across consecutive ids."""
    dst_ids = case.ids("d", case.dst)[group.group_id]
    regions = case.dst.region_map
    descriptors = list(chunk.descriptors())
    for tensor in group.tensors:
        stride = regions[tensor.name].stride_bytes
        keyed = sorted((_logical(c, stride, dst_ids), c) for c in copies if c[0] == tensor.name)
        mine = [c for _, c in keyed]
        breaks = sum(
            1 for a, b in itertools.pairwise(mine) if (b[1], b[2]) != (a[1] + a[3], a[2] + a[3])
        )
        count = sum(1 for d in descriptors if d.src_buffer == f"s:{tensor.name}")
        assert count == (breaks + 1 if mine else 0), tensor.name


@settings(max_examples=120, deadline=None)
@given(hm_cases(), st.integers(1, 6))
def test_every_head_of_every_block_comes_from_its_serving_rank(
    case: HMCase, chunk_blocks: int
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
        total = 0
        for group_plan in plan.groups:
            group = group_plan.group
            expected = _expected(case, group, rank)
            assert group_plan.tokens is None  # whole blocks, never token slices
            if expected:
                assert set(group_plan.blocks) == _moved_blocks(case, group)
            planned: list[Copy] = []
            for chunk in plan.chunks:
                if chunk.group_id != group.group_id:
                    continue
                copies = _chunk_copies(chunk, group, case)
                _check_coalesced(case, chunk, group, copies)
                _check_arrays(chunk)
                assert chunk.nbytes == sum(c[3] for c in copies)
                planned += copies
            assert len(planned) == len(set(planned)), "a byte range moves twice"
            missing, extra = expected - set(planned), set(planned) - expected
            assert not missing and not extra, (sorted(missing)[:4], sorted(extra)[:4])
            assert group_plan.nbytes == sum(c[3] for c in expected)
            total += group_plan.nbytes
            landed.setdefault(group.group_id, []).extend(planned)
        assert plan.nbytes == total == sum(c.nbytes for c in plan.chunks)
    for group in dst.groups:  # all ranks together: each head of each moved block once
        mine = oracle_rank_heads(_heads(case.model, group.group_id), case.dst_tp, case.dst_rank)
        dsts = [(c[0], c[2]) for c in landed.get(group.group_id, [])]
        assert len(dsts) == len(set(dsts))
        assert len(dsts) == len(_moved_blocks(case, group)) * len(mine) * len(group.tensors)


def test_head_runs_go_block_by_block_and_whole_blocks_coalesce() -> None:
    """Llama (8 KV heads), 64 tokens in 4 blocks of 16, consecutive ids on both sides,
    one chunk. Each decode rank below reads all its heads from one prefill rank (one head
    slice), yet a head run narrower than the block on either side is strided by the page
    (the next block's run starts a whole block later), so it is one descriptor per block
    per tensor, not one per run. Where both sides hold exactly the heads moved (one head
    per rank, TP 8 <-> 16) the narrowed regions are the whole, contiguous blocks: one
    descriptor per run per tensor, as between equal TP sizes."""
    blocks, head = 4, 16 * 128 * 2  # one head of a 16-token block, 128 bf16 values a token
    for src_tp, dst_tp, dst_rank, rank, heads, coalesced in (
        (1, 2, 1, 0, 4, False),  # heads 4..7 of prefill rank 0's 8: src narrowed
        (4, 8, 3, 1, 1, False),  # head 3 of prefill rank 1's 2, 3: src narrowed
        (8, 16, 5, 2, 1, True),  # head 2, prefill rank 2's only head, decode rank 5's
        (16, 8, 3, 7, 1, True),  # head 3, replicated on prefill ranks 6, 7: 3 mod 2 -> 7
    ):
        case = HMCase("llama-3.1-8b", src_tp, dst_tp, dst_rank, 16, 16, 64, 0, 0, ascending=True)
        plan = case.plan(rank, 8)
        (chunk,) = plan.chunks
        tensors = len(case.dst.groups[0].tensors)
        assert len(chunk.runs) == 1 and chunk.units == blocks
        assert len(chunk.regions) == tensors  # one head slice per tensor
        descriptors = list(chunk.descriptors())
        if coalesced:
            assert len(descriptors) == len(chunk.runs) * tensors
            assert {d.length for d in descriptors} == {blocks * heads * head}
        else:
            assert len(descriptors) == blocks * tensors
            assert {d.length for d in descriptors} == {heads * head}
        assert chunk.num_descriptors == len(descriptors)
        assert plan.nbytes == blocks * heads * head * tensors
    # Padded pages: even whole blocks are strided, so one descriptor per block.
    padded = HMCase("llama-3.1-8b", 8, 16, 5, 16, 16, 64, 0, 0, pad=64, ascending=True)
    (chunk,) = padded.plan(2, 8).chunks
    assert chunk.num_descriptors == len(list(chunk.descriptors())) == blocks * 2


def _pair(src_major: bool, dst_major: bool, src_size: int, dst_size: int) -> HMCase:
    """Llama TP 1 -> 2, decode rank 0, with the given orders and block sizes."""
    return HMCase(
        "llama-3.1-8b", 1, 2, 0, src_size, dst_size, 64, 0, 0, src_major, dst_major, ascending=True
    )


@pytest.mark.parametrize(
    ("src_major", "dst_major", "src_size", "dst_size", "reason"),
    [
        (True, False, 16, 16, "prefill side's blocks are head-major"),
        (False, True, 16, 16, "decode side's blocks are head-major"),
        (True, True, 16, 32, r"head-major blocks of 16 \(prefill\) and 32 \(decode\) tokens"),
        (True, True, 32, 16, r"head-major blocks of 32 \(prefill\) and 16 \(decode\) tokens"),
    ],
)
def test_mixed_orders_and_unequal_head_major_blocks_are_refused(
    src_major: bool, dst_major: bool, src_size: int, dst_size: int, reason: str
) -> None:
    case = _pair(src_major, dst_major, src_size, dst_size)
    with pytest.raises(PlanError, match=reason) as info:
        case.plan(0, 16)
    assert info.value.field == "groups[0].block_size"
    with pytest.raises(NegotiationError) as refused:
        negotiate(case.dst, case.src(0))  # the decode side pulls
    (mismatch,) = [m for m in refused.value.mismatches if m.field.endswith(".block_size")]
    assert "head-major" in mismatch.hint
    assert mismatch.local == f"{'head' if dst_major else 'token'}-major blocks of {dst_size} tokens"
    assert mismatch.peer == f"{'head' if src_major else 'token'}-major blocks of {src_size} tokens"


def test_the_refusals_are_about_order_and_size_alone() -> None:
    """The same pairings with matching orders are planned and agreed: head-major with
    equal block sizes (whole blocks: slice_tokens is the block size), token-major with
    different ones (one token at a time)."""
    head_major = _pair(True, True, 32, 32)
    assert head_major.plan(0, 16).nbytes == 2 * 32 * 128 * 2 * 4 * 2  # 2 blocks, 4 heads, k+v
    (group,) = negotiate(head_major.dst, head_major.src(0)).groups
    assert (group.block_mapping, group.slice_tokens) == ("heads", 32)
    token_major = _pair(False, False, 16, 32)
    assert token_major.plan(0, 16).nbytes == 64 * 128 * 2 * 4 * 2
    (group,) = negotiate(token_major.dst, token_major.src(0)).groups
    assert (group.block_mapping, group.slice_tokens) == ("heads", 1)


def test_same_tp_head_major_blocks_of_different_sizes_are_refused() -> None:
    """Between equal TP sizes a head-major block cannot be cut into token ranges."""
    case = HMCase("llama-3.1-8b", 2, 2, 0, 16, 32, 64, 0, 0, ascending=True)
    with pytest.raises(
        PlanError, match=r"head-major blocks of 16 \(prefill\) and 32 \(decode\) tokens"
    ):
        case.plan(0, 16)
    assert dataclasses.replace(case, src_size=32).plan(0, 16).nbytes == 64 * 128 * 2 * 4 * 2


def test_a_layout_cannot_be_both_head_major_and_token_major() -> None:
    layout = layout_for_model("llama-3.1-8b", tp_size=2)
    assert layout.token_major and not layout.head_major
    with pytest.raises(LayoutError, match="head_major") as info:
        dataclasses.replace(layout, head_major=True)
    assert info.value.field == "head_major"
    assert dataclasses.replace(layout, token_major=False, head_major=True).head_major
