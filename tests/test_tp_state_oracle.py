"""State groups under different TP sizes, against an oracle written from the model config.

The oracle knows nothing of `StateShard` or tp_map: it reads the config (Gated DeltaNet's
key/value heads and dims, Mamba-2's heads, groups and state size), lays out each rank's
state block as vLLM shards it (conv: kernel - 1 rows of [q | k | v] or [x | B | C]
channels, each part split by TP and a single B/C group replicated, or in the DS layout
one row of channels of kernel - 1 values; ssm: whole heads), and
names every *atom* of it (row, part, global unit). Every descriptor of every prefill
rank's plan is cut back into atoms: each decode atom must land exactly once, from a byte
of a prefill rank holding that same atom, and the state must be read only from ranks
the decode rank needs for its split parts (a replicated group adds no source).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_rank_heads
from test_reblock_oracle import _trim, _with_regions
from test_tp_oracle import TPCase

from kvxfer._exceptions import PlanError, ProfileError
from kvxfer.core.layout import EngineLayout, GroupKind, KVGroup
from kvxfer.core.negotiation import negotiate
from kvxfer.core.profiles import layout_for_model, layout_from_config, load_config
from kvxfer.core.tp_map import state_pieces

STATE_MODELS = ("qwen3-next-80b-a3b", "falcon-h1-7b")
TP_SIZES = (1, 2, 4, 8)
Atom = tuple[int, int, int]  # row, part, global unit
Parts = list[tuple[int, int]]  # per part: (global units, elements per unit in a row)


def _cut(model: str, suffix: str, conv: str = "SD") -> tuple[int, Parts]:
    """(rows, parts) of one state tensor, straight from the config: a conv state stored
    (kernel - 1, channels) ("SD") or (channels, kernel - 1) ("DS": one row)."""
    rows, parts = _sd_cut(model, suffix)
    if conv == "DS" and suffix == "conv":
        return 1, [(units, per * rows) for units, per in parts]
    return rows, parts


def _sd_cut(model: str, suffix: str) -> tuple[int, Parts]:
    c = load_config(model)[1]
    if model == "qwen3-next-80b-a3b":
        keys, values = c["linear_num_key_heads"], c["linear_num_value_heads"]
        kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
        if suffix == "conv":
            return c["linear_conv_kernel_dim"] - 1, [(keys, kd), (keys, kd), (values, vd)]
        return 1, [(values, vd * kd)]
    heads, groups, state = c["mamba_n_heads"], c["mamba_n_groups"], c["mamba_d_state"]
    if suffix == "conv":
        x = (heads, c["mamba_d_ssm"] // heads)
        return c["mamba_d_conv"] - 1, [x, (groups, state), (groups, state)]
    return 1, [(heads, c["mamba_d_head"] * state)]


def _atoms(
    model: str, suffix: str, tp: int, rank: int, nbytes: int, conv: str = "SD"
) -> dict[int, tuple[Atom, int]]:
    """Byte offset -> (atom, atom bytes) of rank `rank`'s block of `nbytes` bytes."""
    rows, parts = _cut(model, suffix, conv)
    held = [oracle_rank_heads(units, tp, rank) for units, _ in parts]
    elements = rows * sum(len(h) * per for h, (_, per) in zip(held, parts, strict=True))
    assert nbytes % elements == 0
    elem = nbytes // elements
    out, at = {}, 0
    for row in range(rows):
        for part, (units, (_, per)) in enumerate(zip(held, parts, strict=True)):
            for unit in units:
                out[at] = ((row, part, unit), per * elem)
                at += per * elem
    assert at == nbytes
    return out


def _split_holders(model: str, suffix: str, src_tp: int, dst_tp: int, dst_rank: int) -> set[int]:
    """Prefill ranks holding a unit the decode rank needs of a part split on both sides."""
    _, parts = _cut(model, suffix)
    ranks = set()
    for units, _ in parts:
        if units >= src_tp:
            for unit in oracle_rank_heads(units, dst_tp, dst_rank):
                ranks |= {p for p in range(src_tp) if unit in oracle_rank_heads(units, src_tp, p)}
    return ranks


def oracle_state_bytes(model: str, group: KVGroup, src_tp: int, dst: EngineLayout, src: int) -> int:
    """Bytes of decode rank `dst.tp_rank`'s state block prefill rank `src` serves: each
    atom from the rank holding it, a replicated one from the lowest holder the decode
    rank already reads for split parts (else the reader-spread holder)."""
    total = 0
    for tensor in group.tensors:
        suffix = tensor.name.rsplit(".", 1)[-1]
        _, parts = _cut(model, suffix)
        split = _split_holders(model, suffix, src_tp, dst.tp_size, dst.tp_rank)
        atoms = _atoms(model, suffix, dst.tp_size, dst.tp_rank, tensor.bytes_per_block)
        for (_, part, unit), size in atoms.values():
            units = parts[part][0]
            holders = [p for p in range(src_tp) if unit in oracle_rank_heads(units, src_tp, p)]
            preferred = sorted(set(holders) & split)
            if len(holders) == 1:
                server = holders[0]
            else:
                server = preferred[0] if preferred else holders[dst.tp_rank % len(holders)]
            total += size if server == src else 0
    return total


@dataclasses.dataclass(frozen=True)
class StateCase(TPCase):
    conv: str = "SD"  # the conv state layout of both sides

    def layout(self, tp: int, rank: int, size: int, side: str) -> EngineLayout:
        layout = layout_for_model(
            self.model, block_size=size, tp_size=tp, tp_rank=rank, conv_state_layout=self.conv
        )
        trimmed = dataclasses.replace(layout, groups=tuple(_trim(g) for g in layout.groups))
        return _with_regions(trimmed, self.pool(size), side)


@st.composite
def state_cases(draw: st.DrawFn) -> StateCase:
    model = draw(st.sampled_from(STATE_MODELS))
    src_tp = draw(st.sampled_from(TP_SIZES))
    dst_tp = draw(st.sampled_from([t for t in TP_SIZES if t != src_tp]))
    size = draw(st.sampled_from((16, 32)))
    tokens = draw(st.integers(1, 120))
    return StateCase(
        model, src_tp, dst_tp, draw(st.integers(0, dst_tp - 1)), size, size, tokens, 0,
        draw(st.integers(0, 2**32)), draw(st.sampled_from(("SD", "DS"))),
    )  # fmt: skip


def _state_group(layout: EngineLayout) -> KVGroup:
    return next(g for g in layout.groups if g.kind is GroupKind.MAMBA)


@settings(max_examples=60, deadline=None)
@given(state_cases())
def test_every_state_byte_comes_from_a_prefill_rank_holding_it(case: StateCase) -> None:
    dst = case.dst
    group = _state_group(dst)
    landed: dict[str, set[int]] = {t.name: set() for t in group.tensors}
    used: dict[str, set[int]] = {t.name: set() for t in group.tensors}
    for rank in range(case.src_tp):
        src = case.src(rank)
        try:
            plan = case.plan(rank, 4)
        except PlanError as exc:
            assert "holds none of decode rank" in str(exc)
            continue
        dst_ids = case.ids("d", dst)[group.group_id]
        src_ids = case.ids("s", src)[group.group_id]
        state_bytes = 0
        for chunk in plan.chunks:
            if chunk.group_id != group.group_id:
                continue
            for d in chunk.descriptors():
                name = d.dst_buffer.removeprefix("d:")
                suffix = name.rsplit(".", 1)[-1]
                tensor = next(t for t in group.tensors if t.name == name)
                src_bytes = src.region_map[name].block_bytes
                dst_atoms = _atoms(
                    case.model,
                    suffix,
                    case.dst_tp,
                    case.dst_rank,
                    tensor.bytes_per_block,
                    case.conv,
                )
                held = _atoms(case.model, suffix, case.src_tp, rank, src_bytes, case.conv)
                src_atoms = {a: at for at, (a, _) in held.items()}
                d_at = d.dst_offset - 64 - dst_ids[0] * tensor.bytes_per_block
                s_at = d.src_offset - 64 - src_ids[0] * src_bytes
                end = d_at + d.length
                while d_at < end:
                    atom, size = dst_atoms[d_at]  # a descriptor starts and ends on atoms
                    assert src_atoms.get(atom) == s_at, (name, atom, rank)
                    assert d_at not in landed[name], f"{name} byte {d_at} lands twice"
                    landed[name].add(d_at)
                    used[name].add(rank)
                    d_at, s_at = d_at + size, s_at + size
                assert d_at == end
                state_bytes += d.length
        state_plan = next(g for g in plan.groups if g.group.group_id == group.group_id)
        assert state_plan.nbytes == state_bytes
    for tensor in group.tensors:
        suffix = tensor.name.rsplit(".", 1)[-1]
        atoms = _atoms(
            case.model, suffix, case.dst_tp, case.dst_rank, tensor.bytes_per_block, case.conv
        )
        assert landed[tensor.name] == set(atoms), f"{tensor.name}: not every byte landed"
        split = _split_holders(case.model, suffix, case.src_tp, case.dst_tp, case.dst_rank)
        assert used[tensor.name] == split or not split, (tensor.name, used, split)
    # The agreement names the same serving ranks the plans used.
    agreement = negotiate(dst, case.src(min(set().union(*used.values()))))
    named = {(r.tensor, r.src_rank) for g in agreement.groups for r in g.state_reads}
    assert named == {(n.rsplit(".", 1)[-1], r) for n, ranks in used.items() for r in ranks}


def test_conv_state_pieces_coalesce_per_row_and_ds_layout_reads_three_ranges() -> None:
    """Qwen3-Next TP 1 -> 2, decode rank 1: the conv state (3 rows of [q | k | v]) is
    three byte ranges per row in SD, three in all in DS; the ssm state one range."""
    case = TPCase("qwen3-next-80b-a3b", 1, 2, 1, 16, 16, 40, 0, seed=0)
    plan = case.plan(0, 4)
    group = _state_group(case.dst)
    chunk = next(c for c in plan.chunks if c.group_id == group.group_id)
    per_tensor: dict[str, int] = {}
    for d in chunk.descriptors():
        per_tensor[d.dst_buffer] = per_tensor.get(d.dst_buffer, 0) + 1
    assert sorted(per_tensor.values()) == [1, 9]
    conv = layout_for_model(case.model, conv_state_layout="DS").groups[0].tensors[0]
    assert conv.shard is not None and len(state_pieces(conv.shard, 1, 2, 1)) == 3


def test_falcon_replicated_group_is_read_from_a_rank_already_read() -> None:
    """Falcon-H1 has one B/C group, replicated on every rank: TP 2 -> 4, decode rank 1
    reads x from prefill rank 0, so B and C come from rank 0 too (rank 1 serves none)."""
    case = TPCase("falcon-h1-7b", 2, 4, 1, 16, 16, 40, 0, seed=0)
    agreement = negotiate(case.dst, case.src(0))
    state = next(g for g in agreement.groups if g.kind == "mamba")
    assert {r.src_rank for r in state.state_reads} == {0}
    with pytest.raises(PlanError, match="prefill rank 1 of 2 holds none"):
        # Falcon-H1's attention has 2 KV heads: decode rank 1 of 4 reads head 0 from
        # rank 0 as well, so rank 1 serves it nothing at all.
        case.plan(1, 4)


def test_mamba2_groups_neither_split_nor_single_are_refused_as_vllm_does() -> None:
    """vLLM's MambaMixer2 splits B/C groups evenly over TP ranks or replicates a single
    one: two groups on four ranks has no layout (refused naming the field)."""
    _, config = load_config("falcon-h1-7b")
    two = {**config, "mamba_n_groups": 2}
    assert layout_from_config(two, name="f", tp_size=2).tp_size == 2
    with pytest.raises(ProfileError, match="2 groups on tp_size 4: vLLM splits") as refused:
        layout_from_config(two, name="f", tp_size=4)
    assert refused.value.field == "mamba_n_groups"
