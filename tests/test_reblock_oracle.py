"""Different block sizes on the two sides, against the token-level oracle.

The planner works in slices of gcd(Bs, Bd) tokens (kvxfer/core/reblock.py); the
oracle (tests/oracle.py) only knows tokens: which ones move, the byte address of
each on each side, and where the engine may resume. Every descriptor is expanded
back into tokens and compared with the oracle's copies, one token at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_blocks, oracle_moved_tokens, oracle_valid_tokens_moved
from strategies import PROFILES

from kvxfer._exceptions import PlanError
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind, KVGroup, Region
from kvxfer.core.planner import Chunk, TransferPlan, plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.recompute import valid_tokens
from kvxfer.wire.layout import layout_from_proto, layout_to_proto

SIZES = (8, 16, 24, 32, 48, 64, 128)
HETERO_PROFILES = ("gpt-oss-20b", "gemma-3-4b-it", "qwen3-next-80b-a3b", "llama-3.1-8b",
                   "deepseek-v2-lite", "jamba-mini-1.5")  # fmt: skip
OFFSET = 64  # regions do not start at their buffer's first byte
Copy = tuple[str, int, int, int]  # tensor, src byte, dst byte, bytes


def _trim(group: KVGroup) -> KVGroup:
    """Two tensors per group keep the token-by-token comparison quick; the planner
    treats every tensor of a group alike."""
    tensors = group.tensors[:2]
    return dataclasses.replace(
        group, layers=tuple(sorted({t.layer for t in tensors})), tensors=tensors
    )


def _with_regions(layout: EngineLayout, pool: int, side: str) -> EngineLayout:
    """One buffer per tensor, `pool` contiguous blocks each, starting at OFFSET."""
    regions = [
        Region(t.name, f"{side}:{t.name}", OFFSET, pool, t.bytes_per_block, t.bytes_per_block)
        for g in layout.groups
        for t in g.tensors
    ]
    return layout.with_regions(regions)


@dataclasses.dataclass(frozen=True)
class Case:
    src: EngineLayout
    dst: EngineLayout
    src_ids: dict[int, list[int]]  # group -> block id of logical block i
    dst_ids: dict[int, list[int]]
    num_tokens: int
    computed: int

    def spans(self, ids: dict[int, list[int]]) -> list[BlockSpan]:
        return [
            BlockSpan(GroupId(g), 0, tuple(BlockId(b) for b in blocks)) for g, blocks in ids.items()
        ]

    def plan(self, chunk_blocks: int) -> TransferPlan:
        return plan_transfer(
            self.src,
            self.dst,
            self.spans(self.src_ids),
            self.spans(self.dst_ids),
            self.num_tokens,
            self.computed,
            chunk_blocks,
        )


def _ids(rng: random.Random, pool: int) -> list[int]:
    """Ascending (runs coalesce), ascending with a wrap, or shuffled."""
    ids = list(range(pool))
    style = rng.randrange(3)
    if style == 1:
        cut = rng.randrange(pool)
        ids = ids[cut:] + ids[:cut]
    elif style == 2:
        rng.shuffle(ids)
    return ids


@st.composite
def cases(draw: st.DrawFn, profiles: tuple[str, ...] = HETERO_PROFILES) -> Case:
    model = draw(st.sampled_from([p for p in profiles if p in PROFILES]))
    src_size, dst_size = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    src, dst = (layout_for_model(model, block_size=b) for b in (src_size, dst_size))
    window = draw(st.one_of(st.none(), st.integers(1, 48), st.integers(1, 400)))
    trimmed = []
    for layout in (src, dst):
        groups = tuple(
            _trim(
                dataclasses.replace(g, sliding_window=window)
                if window and g.kind is GroupKind.SLIDING_WINDOW
                else g
            )
            for g in layout.groups
        )
        trimmed.append(dataclasses.replace(layout, groups=groups))
    num_tokens = draw(st.integers(1, 1200))
    computed = num_tokens
    if draw(st.integers(0, 9)):
        computed = draw(st.integers(0, (num_tokens - 1) // dst_size)) * dst_size
    rng = random.Random(draw(st.integers(0, 2**32)))
    src_pool, dst_pool = -(-num_tokens // src_size) + 1, -(-num_tokens // dst_size) + 1
    return Case(
        _with_regions(trimmed[0], src_pool, "s"),
        _with_regions(trimmed[1], dst_pool, "d"),
        {g.group_id: _ids(rng, src_pool) for g in trimmed[0].groups},
        {g.group_id: _ids(rng, dst_pool) for g in trimmed[1].groups},
        num_tokens,
        computed,
    )


def _expected_copies(case: Case, group: KVGroup) -> set[Copy]:
    """(tensor, src byte, dst byte, bytes) for every token (or whole state) that moves."""
    gid = group.group_id
    src_size, dst_size = case.src.block_size, case.dst.block_size
    src_regions, dst_regions = case.src.region_map, case.dst.region_map
    if group.kind is GroupKind.MAMBA:
        if case.computed == case.num_tokens:
            return set()
        return {
            (
                t.name,
                OFFSET + case.src_ids[gid][0] * src_regions[t.name].stride_bytes,
                OFFSET + case.dst_ids[gid][0] * dst_regions[t.name].stride_bytes,
                t.bytes_per_block,
            )
            for t in group.tensors
        }
    moved = oracle_moved_tokens(group, case.num_tokens, case.computed, src_size, dst_size)
    copies = set()
    for tensor in group.tensors:
        per_token = tensor.bytes_per_block // dst_size
        src_block_bytes = src_regions[tensor.name].block_bytes
        for t in moved:
            src = OFFSET + case.src_ids[gid][t // src_size] * src_block_bytes
            dst = OFFSET + case.dst_ids[gid][t // dst_size] * tensor.bytes_per_block
            src += t % src_size * per_token
            dst += t % dst_size * per_token
            copies.add((tensor.name, src, dst, per_token))
    return copies


def _chunk_copies(chunk: Chunk, group: KVGroup, block_size: int) -> list[Copy]:
    """One chunk's descriptors cut back into tokens (a whole state stays whole)."""
    out = []
    for d in chunk.descriptors():
        name = d.src_buffer.removeprefix("s:")
        assert d.dst_buffer == f"d:{name}"
        if group.kind is GroupKind.MAMBA:
            out.append((name, d.src_offset, d.dst_offset, d.length))
            continue
        tensor = next(t for t in group.tensors if t.name == name)
        per_token = tensor.bytes_per_block // block_size
        assert d.length % per_token == 0, d
        out += [
            (name, d.src_offset + i * per_token, d.dst_offset + i * per_token, per_token)
            for i in range(d.length // per_token)
        ]
    return out


def _dst_token(case: Case, group: KVGroup, copy: Copy) -> int:
    """The destination token a per-token copy lands on."""
    tensor = next(t for t in group.tensors if t.name == copy[0])
    block, within = divmod(copy[2] - OFFSET, tensor.bytes_per_block)
    logical = case.dst_ids[group.group_id].index(block)
    return logical * case.dst.block_size + within // copy[3]


def _check_coalesced(case: Case, group: KVGroup, chunk: Chunk, copies: list[Copy]) -> None:
    """One descriptor per tensor per stretch of consecutive tokens that is contiguous
    on both sides: never split where it need not be, never merged where it must not."""
    descriptors = list(chunk.descriptors())
    for tensor in group.tensors:
        mine = sorted(
            (c for c in copies if c[0] == tensor.name), key=lambda c: _dst_token(case, group, c)
        )
        breaks = sum(
            1 for a, b in itertools.pairwise(mine) if (b[1], b[2]) != (a[1] + a[3], a[2] + a[3])
        )
        count = sum(1 for d in descriptors if d.src_buffer == f"s:{tensor.name}")
        assert count == (breaks + 1 if mine else 0), tensor.name


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(1, 6))
def test_every_moved_byte_matches_the_token_oracle(case: Case, chunk_blocks: int) -> None:
    plan = case.plan(chunk_blocks)
    for group_plan in plan.groups:
        group = group_plan.group
        size = case.dst.block_size
        assert set(group_plan.blocks) == oracle_blocks(group, case.num_tokens, case.computed, size)
        expected = _expected_copies(case, group)
        chunks = [c for c in plan.chunks if c.group_id == group.group_id]
        assert [b for c in chunks for b in c.blocks] == list(group_plan.blocks)
        planned = []
        for chunk in chunks:
            copies = _chunk_copies(chunk, group, size)
            if group.kind is not GroupKind.MAMBA:  # a failed chunk loses its own blocks only
                tokens = {_dst_token(case, group, c) // size for c in copies}
                assert tokens <= set(chunk.blocks)
                _check_coalesced(case, group, chunk, copies)
            planned += copies
        assert len(planned) == len(set(planned)), "a byte range moves twice"
        assert set(planned) == expected
        assert group_plan.nbytes == sum(c[3] for c in expected)
    assert plan.nbytes == sum(c.nbytes for c in plan.chunks)


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(1, 6), st.data())
def test_valid_tokens_in_the_readers_blocks_match_the_oracle(
    case: Case, chunk_blocks: int, data: st.DataObject
) -> None:
    """Fail whole chunks, as NIXL does (one handle each), and compare where the engine
    resumes with the oracle's token-by-token answer."""
    plan = case.plan(chunk_blocks)
    failed: dict[int, list[int]] = {}
    for chunk in plan.chunks:
        if data.draw(st.integers(0, 3)) == 0:
            failed.setdefault(chunk.group_id, []).extend(chunk.blocks)
    groups = [g.group for g in plan.groups]
    moved = {
        g.group_id: oracle_moved_tokens(
            g, case.num_tokens, case.computed, case.src.block_size, case.dst.block_size
        )
        for g in groups
        if g.kind is not GroupKind.MAMBA
    }
    expected = oracle_valid_tokens_moved(
        groups, case.num_tokens, case.computed, case.dst.block_size, failed, moved
    )
    got = valid_tokens(
        groups, case.num_tokens, case.computed, case.dst.block_size, failed, plan.moved_from
    )
    assert got == expected


def test_a_half_moved_block_is_not_counted_whole() -> None:
    """P B=16 -> D B=32, W=20 at N=100: tokens [81, 100) are needed, so [80, 112) move:
    decode block 2 (tokens [64, 96)) gets only [80, 96). When the full-attention group's
    block 3 fails, s = 96 would need window tokens [77, 96): not there, so the engine
    resumes at C = 0. Counting block 2 as whole would wrongly say 96."""
    layout = layout_for_model("gpt-oss-20b", block_size=32)
    sliding, full = (dataclasses.replace(layout.groups[0], sliding_window=20), layout.groups[1])
    assert (sliding.kind, full.kind) == (GroupKind.SLIDING_WINDOW, GroupKind.FULL_ATTENTION)
    assert oracle_moved_tokens(sliding, 100, 0, 16, 32) == set(range(80, 112))
    groups = [sliding, full]
    assert valid_tokens(groups, 100, 0, 32, {1: [3]}, {0: 80, 1: 0}) == 0
    assert valid_tokens(groups, 100, 0, 32, {1: [3]}) == 96  # what whole blocks would say


def test_slicing_is_refused_where_a_token_range_is_not_one_byte_range() -> None:
    src = _with_regions(layout_for_model("llama-3.1-8b", block_size=16), 8, "s")
    dst = _with_regions(layout_for_model("llama-3.1-8b", block_size=32), 4, "d")
    case = Case(src, dst, {0: list(range(8))}, {0: list(range(4))}, 100, 0)
    assert case.plan(4).nbytes == 112 * dst.groups[0].bytes_per_block // 32  # [0, 112)
    fused = dataclasses.replace(case.dst, token_major=False)
    both = dataclasses.replace(case, src=dataclasses.replace(case.src, token_major=False))
    with pytest.raises(PlanError, match="not token-major"):
        dataclasses.replace(both, dst=fused).plan(4)
    with pytest.raises(PlanError, match="in the engine's own order"):  # orders differ too
        dataclasses.replace(case, dst=fused).plan(4)
    region = case.src.regions[0]
    strided = case.src.with_regions(
        [dataclasses.replace(region, stride_bytes=2 * region.block_bytes), *case.src.regions[1:]]
    )
    with pytest.raises(PlanError, match="strided"):
        dataclasses.replace(case, src=strided).plan(4)


def test_block_order_survives_the_wire() -> None:
    layout = layout_for_model("gpt-oss-20b")
    for token_major, head_major, rows in (
        (True, False, False), (False, False, False), (False, True, False), (False, True, True)
    ):  # fmt: skip
        flagged = dataclasses.replace(
            layout, token_major=token_major, head_major=head_major, token_rows=rows
        )
        assert layout_from_proto(layout_to_proto(flagged)) == flagged
