"""Different TP sizes on the two sides, against the head-by-head, token-by-token oracle.

The planner reads a decode rank's heads from each prefill rank as byte ranges inside
every token (kvxfer/core/tp_map.py, reblock.head_region). The oracle
(tests/oracle.py) knows only which global heads each rank holds and which prefill
rank serves each head; here every descriptor is cut back into (token, head) copies
and compared with the oracle's, for every prefill rank of the pairing: together they
must land every head of every moved token exactly once.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_head_server, oracle_moved_tokens, oracle_rank_heads
from test_reblock_oracle import OFFSET, _ids, _trim, _with_regions

from kvxfer._exceptions import PlanError
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, KVGroup
from kvxfer.core.negotiation import negotiate
from kvxfer.core.planner import TransferPlan, plan_transfer
from kvxfer.core.profiles import layout_for_model

# Models whose groups are all split by head (no state, no latent).
TP_PROFILES = ("llama-3.1-8b", "gpt-oss-20b", "gemma-3-4b-it", "mistral-7b-v0.1")
TP_SIZES = (1, 2, 4, 8, 16)
Copy = tuple[str, int, int, int]  # tensor, src byte, dst byte, bytes


@dataclasses.dataclass(frozen=True)
class TPCase:
    model: str
    src_tp: int
    dst_tp: int
    dst_rank: int
    src_size: int
    dst_size: int
    num_tokens: int
    computed: int
    seed: int

    def layout(self, tp: int, rank: int, size: int, side: str) -> EngineLayout:
        layout = layout_for_model(self.model, block_size=size, tp_size=tp, tp_rank=rank)
        trimmed = dataclasses.replace(layout, groups=tuple(_trim(g) for g in layout.groups))
        return _with_regions(trimmed, self.pool(size), side)

    def pool(self, size: int) -> int:
        return -(-self.num_tokens // size) + 1

    def ids(self, side: str, layout: EngineLayout) -> dict[int, list[int]]:
        # The same seed per side: every prefill rank of a request uses the same blocks.
        rng = random.Random(f"{self.seed}{side}")
        size = layout.block_size
        return {g.group_id: _ids(rng, self.pool(size)) for g in layout.groups}

    @property
    def dst(self) -> EngineLayout:
        return self.layout(self.dst_tp, self.dst_rank, self.dst_size, "d")

    def src(self, rank: int) -> EngineLayout:
        return self.layout(self.src_tp, rank, self.src_size, "s")

    def plan(self, rank: int, chunk_blocks: int) -> TransferPlan:
        src, dst = self.src(rank), self.dst

        def spans(ids: dict[int, list[int]]) -> list[BlockSpan]:
            return [BlockSpan(GroupId(g), 0, tuple(BlockId(b) for b in v)) for g, v in ids.items()]

        return plan_transfer(
            src,
            dst,
            spans(self.ids("s", src)),
            spans(self.ids("d", dst)),
            self.num_tokens,
            self.computed,
            chunk_blocks,
        )


def _heads(model: str) -> int:
    heads = layout_for_model(model).groups[0].num_kv_heads
    assert heads is not None
    return heads


def draw_tokens(draw: st.DrawFn, dst_size: int, most: int) -> tuple[int, int]:
    """(num_tokens, computed_tokens): a prompt of up to `most` tokens; nine times in ten
    a prefix of whole decode blocks is computed, else all of it (nothing moves)."""
    num_tokens = draw(st.integers(1, most))
    if not draw(st.integers(0, 9)):
        return num_tokens, num_tokens
    return num_tokens, draw(st.integers(0, (num_tokens - 1) // dst_size)) * dst_size


@st.composite
def tp_cases(draw: st.DrawFn) -> TPCase:
    model = draw(st.sampled_from(TP_PROFILES))
    heads = _heads(model)
    placeable = [t for t in TP_SIZES if heads % t == 0 or t % heads == 0]
    src_tp = draw(st.sampled_from(placeable))
    dst_tp = draw(st.sampled_from([t for t in placeable if t != src_tp]))
    src_size, dst_size = draw(st.sampled_from((16, 32))), draw(st.sampled_from((16, 32)))
    num_tokens, computed = draw_tokens(draw, dst_size, 200)
    return TPCase(
        model,
        src_tp,
        dst_tp,
        draw(st.integers(0, dst_tp - 1)),
        src_size,
        dst_size,
        num_tokens,
        computed,
        draw(st.integers(0, 2**32)),
    )


def _expected(case: TPCase, group: KVGroup, rank: int) -> set[Copy]:
    """Every (token, head) copy prefill rank `rank` serves the decode rank, by hand."""
    heads = _heads(case.model)
    dst, src = case.dst, case.src(rank)
    mine = oracle_rank_heads(heads, case.dst_tp, case.dst_rank)
    theirs = oracle_rank_heads(heads, case.src_tp, rank)
    served = [h for h in mine if oracle_head_server(heads, case.src_tp, h, case.dst_rank) == rank]
    moved = oracle_moved_tokens(group, case.num_tokens, case.computed, case.src_size, case.dst_size)
    src_ids, dst_ids = case.ids("s", src)[group.group_id], case.ids("d", dst)[group.group_id]
    copies = set()
    for tensor in group.tensors:
        dst_token = tensor.bytes_per_block // case.dst_size
        head = dst_token // len(mine)
        src_token = head * len(theirs)
        src_block = src.region_map[tensor.name].block_bytes
        for t in moved:
            for h in served:
                s = OFFSET + src_ids[t // case.src_size] * src_block
                s += t % case.src_size * src_token + theirs.index(h) * head
                d = OFFSET + dst_ids[t // case.dst_size] * tensor.bytes_per_block
                d += t % case.dst_size * dst_token + mine.index(h) * head
                copies.add((tensor.name, s, d, head))
    return copies


def _planned(plan: TransferPlan, group: KVGroup, head: int) -> list[Copy]:
    """The plan's descriptors for `group`, cut into one copy per head of each token."""
    out = []
    for chunk in plan.chunks:
        if chunk.group_id != group.group_id:
            continue
        for d in chunk.descriptors():
            name = d.src_buffer.removeprefix("s:")
            assert d.dst_buffer == f"d:{name}" and d.length % head == 0, d
            out += [
                (name, d.src_offset + i, d.dst_offset + i, head) for i in range(0, d.length, head)
            ]
    return out


@settings(max_examples=120, deadline=None)
@given(tp_cases(), st.integers(1, 6))
def test_every_head_of_every_token_comes_from_its_serving_rank(
    case: TPCase, chunk_blocks: int
) -> None:
    heads = _heads(case.model)
    mine = oracle_rank_heads(heads, case.dst_tp, case.dst_rank)
    servers = {oracle_head_server(heads, case.src_tp, h, case.dst_rank) for h in mine}
    landed: dict[int, list[Copy]] = {}
    for rank in range(case.src_tp):
        if rank not in servers:
            with pytest.raises(PlanError, match="holds none of decode rank"):
                case.plan(rank, chunk_blocks)
            continue
        plan = case.plan(rank, chunk_blocks)
        for group_plan in plan.groups:
            group = group_plan.group
            head = case.dst.head_bytes(group, group.tensors[0])
            assert head is not None
            planned = _planned(plan, group, head)
            assert len(planned) == len(set(planned)), "a byte range moves twice"
            expected = _expected(case, group, rank)
            assert set(planned) == expected
            assert group_plan.nbytes == sum(c[3] for c in expected)
            landed.setdefault(group.group_id, []).extend(planned)
        assert plan.nbytes == sum(c.nbytes for c in plan.chunks)
    for group in case.dst.groups:  # all ranks together: each head of each token once
        moved = oracle_moved_tokens(
            group, case.num_tokens, case.computed, case.src_size, case.dst_size
        )
        dsts = [(c[0], c[2]) for c in landed.get(group.group_id, [])]
        assert len(dsts) == len(set(dsts))
        assert len(dsts) == len(moved) * len(mine) * len(group.tensors)


def test_whole_heads_coalesce_and_partial_heads_go_token_by_token() -> None:
    """Llama (8 KV heads), TP 1 -> 2: decode rank 1 reads heads 4..7 of each prefill
    token, a strided byte range, so one descriptor per token; TP 8 -> 16 replicates one
    head per rank on both sides: whole tokens, one descriptor per run of blocks."""
    split = TPCase("llama-3.1-8b", 1, 2, 1, 16, 16, 64, 0, seed=0)
    plan = split.plan(0, 8)
    tensors = len(split.dst.groups[0].tensors)
    assert sum(c.num_descriptors for c in plan.chunks) == 64 * tensors
    first = next(plan.chunks[0].descriptors())
    assert first.length == 4 * 128 * 2  # four heads of 128 bf16 values
    whole = TPCase("llama-3.1-8b", 8, 16, 5, 16, 16, 64, 0, seed=0)
    plan = whole.plan(oracle_head_server(8, 8, 2, 5), 8)
    runs = sum(len(c.runs) for c in plan.chunks)
    assert sum(c.num_descriptors for c in plan.chunks) == runs * tensors


def test_a_rank_that_serves_nothing_and_an_unsplittable_side_are_refused() -> None:
    case = TPCase("llama-3.1-8b", 2, 1, 0, 16, 16, 40, 0, seed=1)
    assert case.plan(1, 4).nbytes > 0  # 2 -> 1: rank 0 reads from both prefill ranks
    narrow = TPCase("llama-3.1-8b", 8, 4, 0, 16, 16, 40, 0, seed=1)  # heads 0, 1: ranks 0, 1
    with pytest.raises(PlanError, match="prefill rank 2 of 8 holds none of decode rank 0"):
        narrow.plan(2, 4)
    src, dst = case.src(0), case.dst
    unknown = dataclasses.replace(
        dst, groups=tuple(dataclasses.replace(g, num_kv_heads=None) for g in dst.groups)
    )
    spans = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(4)))]
    with pytest.raises(PlanError, match=r"groups\[0\].num_kv_heads: dst: the layout does not"):
        plan_transfer(src, unknown, spans, spans, 40, 0)


def _latent_beside_heads(tp: int, rank: int) -> EngineLayout:
    """Llama's attention group and DeepSeek-V2-Lite's first latent layer as group 1: an
    mla latent beside head-split groups (no profile has one; the planner must not care)."""
    llama = layout_for_model("llama-3.1-8b", tp_size=tp, tp_rank=rank)
    latent = layout_for_model("deepseek-v2-lite", tp_size=tp, tp_rank=rank).groups[0]
    latent = dataclasses.replace(
        latent, group_id=GroupId(1), layers=(32,), tensors=(
            dataclasses.replace(latent.tensors[0], name="layer.32.latent", layer=32),
        ),
    )  # fmt: skip
    layout = dataclasses.replace(llama, groups=(_trim(llama.groups[0]), latent))
    return _with_regions(layout, 5, "s" if tp == 4 else "d")


def test_an_mla_latent_beside_heads_is_read_whole_from_a_rank_already_read() -> None:
    """TP 4 -> 2, decode rank 1: heads 4..7 come from prefill ranks 2 and 3, so the latent
    comes from rank 2 (not 1 = d mod 4, which would add a source); the agreement holds."""
    dst = _latent_beside_heads(2, 1)
    spans = [BlockSpan(GroupId(g), 0, tuple(BlockId(b) for b in range(4))) for g in (0, 1)]
    moved: dict[int, list[int]] = {}
    for rank in range(4):
        src = _latent_beside_heads(4, rank)
        if rank < 2:
            with pytest.raises(PlanError, match=f"prefill rank {rank} of 4 holds none"):
                plan_transfer(src, dst, spans, spans, 60, 0)
            continue
        plan = plan_transfer(src, dst, spans, spans, 60, 0)
        moved[rank] = [len(g.blocks) for g in plan.groups]
        latent = [c for c in plan.chunks if c.group_id == 1]
        for chunk in latent:  # whole blocks, coalesced: the same latent on every rank
            assert chunk.num_descriptors == len(chunk.runs)
    assert moved == {2: [4, 4], 3: [4, 0]}
    agreement = negotiate(dst, _latent_beside_heads(4, 2))
    assert agreement.source_ranks == (2, 3)
