"""A vLLM state page as its state tensors, each cut over TP ranks (kvxfer/integrations/
vllm_state.py), so that a prefill and a decode vLLM engine of different TP sizes pair on a
hybrid model: built from vLLM-shaped cache configs of Qwen3-Next (plain dataclasses named
and shaped like vLLM 0.32's, with MambaStateShapeCalculator's per-rank shapes), negotiated
between TP sizes, and every state byte of each plan checked against the atom oracle of
tests/test_tp_state_oracle.py, which reads the config and knows nothing of the cuts."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_tp_state_oracle import _atoms
from test_vllm_layout import HeadedSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec
from test_vllm_params import _params

from kvxfer._exceptions import InvalidInputError, LayoutError, NegotiationError, ProfileError
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind
from kvxfer.core.negotiation import negotiate
from kvxfer.core.planner import plan_transfer
from kvxfer.core.profiles import load_config
from kvxfer.integrations.vllm_layout import layout_from_vllm
from kvxfer.integrations.vllm_params import (
    decode_tp_size,
    params_to_dict,
    publication_id,
    rank_params,
    reader_sources,
    readers_of,
)
from kvxfer.integrations.vllm_state import (
    StateCuts,
    StateTensor,
    cuts_from_config,
    packed_states,
    state_groups,
)

MODEL = "qwen3-next-80b-a3b"
CONFIG = load_config(MODEL)[1]
NUM_BLOCKS = 6
BLOCK = 16


@dataclass(frozen=True)
class DType:
    """What the split reads of a torch dtype."""

    itemsize: int


BF16, F32 = DType(2), DType(4)


@dataclass(frozen=True)
class GDNSpec(MambaSpec):
    """vLLM 0.32's MambaSpec of a Gated DeltaNet layer: conv and temporal states packed
    from the page's start, the page padded to the attention page."""

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[DType, ...] = ()
    tp_replicated: bool = False

    @property
    def real_page_size_bytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))


def gdn_shapes(tp: int, conv: str = "SD", spec_tokens: int = 0) -> tuple[tuple[int, ...], ...]:
    """MambaStateShapeCalculator.gated_delta_net_state_shape, from the config."""
    keys, values = CONFIG["linear_num_key_heads"], CONFIG["linear_num_value_heads"]
    kd, vd = CONFIG["linear_key_head_dim"], CONFIG["linear_value_head_dim"]
    channels = (2 * keys * kd + values * vd) // tp
    rows = CONFIG["linear_conv_kernel_dim"] - 1 + spec_tokens
    conv_shape = (rows, channels) if conv == "SD" else (channels, rows)
    return conv_shape, (values // tp, vd, kd)


def vllm_config(tp: int, conv: str = "SD", **state: Any) -> KVCacheConfig:
    """Qwen3-Next's cache on one rank of `tp`: full-attention layers in one group of
    head-major pages, Gated DeltaNet layers in three others, every layer in its own
    tensor."""
    kinds = CONFIG["layer_types"]
    heads, head_size = max(1, CONFIG["num_key_value_heads"] // tp), CONFIG["head_dim"]
    states = {"shapes": gdn_shapes(tp, conv), "dtypes": (BF16, F32), **state}
    attention_page = BLOCK * heads * 2 * head_size * 2
    page = max(attention_page, GDNSpec(BLOCK, 0, **states).real_page_size_bytes)
    names = [f"model.layers.{i}.{'self_attn.attn' if k == 'full_attention' else 'linear_attn'}"
             for i, k in enumerate(kinds)]  # fmt: skip
    attention = [n for n, k in zip(names, kinds, strict=True) if k == "full_attention"]
    linear = [n for n, k in zip(names, kinds, strict=True) if k != "full_attention"]
    size = page * NUM_BLOCKS
    headed = HeadedSpec(BLOCK, attention_page, num_kv_heads=heads, head_size=head_size)
    # vLLM groups layers in groups of one size: 12 attention layers, 3 groups of 12 GDN.
    gdn = GDNSpec(BLOCK, page, **states)
    thirds = [linear[i : i + len(attention)] for i in range(0, len(linear), len(attention))]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size, [n], size, page, i * size) for i, n in enumerate(names)
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(attention, headed),
            *(KVCacheGroupSpec(layers, gdn) for layers in thirds),
        ],
    )


def cuts(tp: int, conv: str = "SD") -> StateCuts:
    return cuts_from_config(CONFIG, tp_size=tp, conv_layout=conv)


def layout(tp: int, rank: int, conv: str = "SD", *, cut: bool = True) -> EngineLayout:
    config = vllm_config(tp, conv)
    states = state_groups(config, cuts(tp, conv), tp_size=tp) if cut else None
    return layout_from_vllm(
        config, buffer=f"r{rank}", base_offset=64, model=MODEL, tp_size=tp, tp_rank=rank,
        num_kv_heads=CONFIG["num_key_value_heads"], head_major=True, states=states,
    )  # fmt: skip


def test_a_gdn_page_is_its_conv_then_its_ssm_state_with_their_cuts() -> None:
    for tp in (1, 2, 4):
        conv, ssm = gdn_shapes(tp)
        groups = state_groups(vllm_config(tp), cuts(tp), tp_size=tp)
        assert sorted(groups) == [1, 2, 3]
        tensors = groups[1]
        assert groups[2] == groups[3] == tensors
        conv_bytes = math.prod(conv) * 2
        assert [(t.suffix, t.offset, t.nbytes) for t in tensors] == [
            ("conv", 0, conv_bytes),
            ("ssm", conv_bytes, math.prod(ssm) * 4),
        ]
        assert [t.shard.rows for t in tensors] == [3, 1]
        # The cut counts the model's units (q, k, v heads; value heads), whatever the TP.
        assert [[s.heads for s in t.shard.segments] for t in tensors] == [[16, 16, 32], [32]]


def test_regions_are_each_state_tensor_at_its_place_in_the_page() -> None:
    one = layout(2, 1)
    state = next(g for g in one.groups if g.kind is GroupKind.MAMBA)
    first = state.layers[0]
    name = f"model.layers.{first}.linear_attn"
    conv, ssm = one.region_map[f"{name}.conv"], one.region_map[f"{name}.ssm"]
    spec = vllm_config(2).kv_cache_groups[1].kv_cache_spec
    page = spec.page_size_bytes
    assert (conv.offset_bytes, ssm.offset_bytes) == (
        64 + first * page * NUM_BLOCKS,
        conv.offset_bytes + conv.block_bytes,
    )
    assert ssm.stride_bytes == conv.stride_bytes == page
    assert conv.block_bytes + ssm.block_bytes == spec.real_page_size_bytes
    assert [t.name for t in state.tensors[:2]] == [f"{name}.conv", f"{name}.ssm"]


def test_ranks_of_different_tp_sizes_agree_and_opaque_pages_are_refused_by_name() -> None:
    assert layout(1, 0).fingerprint == layout(2, 1).fingerprint == layout(4, 3).fingerprint
    agreement = negotiate(layout(2, 1), layout(1, 0))
    state = next(g for g in agreement.groups if g.kind == "mamba")
    assert {(r.tensor, r.src_rank) for r in state.state_reads} == {("conv", 0), ("ssm", 0)}
    with pytest.raises(NegotiationError, match="shard"):
        negotiate(layout(2, 1, cut=False), layout(1, 0, cut=False))
    with pytest.raises(NegotiationError, match="fingerprint"):  # conv states SD and DS
        negotiate(layout(2, 1, "DS"), layout(1, 0, "SD"))


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "conv"), [(1, 2, "SD"), (2, 1, "SD"), (2, 4, "DS"), (4, 2, "SD")]
)
def test_every_state_byte_lands_from_the_prefill_rank_holding_it(
    src_tp: int, dst_tp: int, conv: str
) -> None:
    """Each decode rank's state blocks, assembled from every prefill rank's plan: each
    byte lands once, from the same atom (row, q/k/v part, head) on the prefill rank."""
    src_ids, dst_ids = 2, 4  # the request's state block on each side
    for rank in range(dst_tp):
        dst = layout(dst_tp, rank, conv)
        group = next(g for g in dst.groups if g.kind is GroupKind.MAMBA)
        landed: dict[str, set[int]] = {t.name: set() for t in group.tensors}
        for source in reader_sources(2, src_tp, dst_tp, rank, _cuts(dst)):
            src = layout(src_tp, source, conv)
            plan = plan_transfer(src, dst, _spans(src, src_ids), _spans(dst, dst_ids), 40, 0, 64)
            for chunk in plan.chunks:
                if chunk.group_id != group.group_id:
                    continue
                for d in chunk.descriptors():
                    name = next(
                        t.name for t in group.tensors if _inside(dst, t.name, d.dst_offset, dst_ids)
                    )
                    suffix = name.rsplit(".", 1)[-1]
                    there, here = src.region_map[name], dst.region_map[name]
                    theirs = _atoms(MODEL, suffix, src_tp, source, there.block_bytes, conv)
                    mine = _atoms(MODEL, suffix, dst_tp, rank, here.block_bytes, conv)
                    at_src = {atom: at for at, (atom, _) in theirs.items()}
                    d_at = d.dst_offset - here.offset_bytes - dst_ids * here.stride_bytes
                    s_at = d.src_offset - there.offset_bytes - src_ids * there.stride_bytes
                    end = d_at + d.length
                    while d_at < end:
                        atom, size = mine[d_at]
                        assert at_src[atom] == s_at, (name, atom, source)
                        assert d_at not in landed[name], f"{name} byte {d_at} lands twice"
                        landed[name].add(d_at)
                        d_at, s_at = d_at + size, s_at + size
        for tensor in group.tensors:
            suffix = tensor.name.rsplit(".", 1)[-1]
            want = _atoms(MODEL, suffix, dst_tp, rank, tensor.bytes_per_block, conv)
            assert landed[tensor.name] == set(want), f"{tensor.name}: not every byte landed"


def _inside(layout: EngineLayout, name: str, offset: int, block: int) -> bool:
    region = layout.region_map[name]
    start = region.offset_bytes + block * region.stride_bytes
    return start <= offset < start + region.block_bytes


def _spans(layout: EngineLayout, state_block: int) -> list[BlockSpan]:
    spans = []
    for group in layout.groups:
        ids = (state_block,) if group.kind is GroupKind.MAMBA else (1, 3, 5)
        spans.append(BlockSpan(GroupId(group.group_id), 0, tuple(BlockId(b) for b in ids)))
    return spans


def _pub(source: int, readers: int) -> dict[str, object]:
    """Prefill rank `source`'s publication of request "r" for decode rank 0 of `readers`."""
    params = dataclasses.replace(
        _params(), tp_rank=source, request_id=publication_id("r", source, 0, readers)
    )
    return params_to_dict(params)


def _cuts(layout: EngineLayout) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(t.shard for g in layout.groups for t in g.tensors if t.shard))


def test_a_decode_tp_size_the_state_cannot_be_placed_on_is_refused() -> None:
    shards = _cuts(layout(1, 0))
    assert decode_tp_size({"decode_tp_size": 2}, 1, 2, shards) == 2
    with pytest.raises(InvalidInputError, match=r"decode_tp_size.*16 units"):  # 16 key heads
        decode_tp_size({"decode_tp_size": 3}, 1, 3, shards)
    with pytest.raises(InvalidInputError, match=r"decode_tp_size.*state pages cannot be cut"):
        decode_tp_size({"decode_tp_size": 2}, 1, 2, "no config")
    assert decode_tp_size({}, 1, 2, "no config") == 1


def test_what_vllm_allocated_must_match_the_configs_cut_or_the_page_stays_opaque() -> None:
    where = re.escape("kv_cache_groups[1].kv_cache_spec")

    def split(config: KVCacheConfig, cut: StateCuts) -> dict[int, tuple[StateTensor, ...]]:
        return state_groups(config, cut, tp_size=2)

    # Speculative tokens lengthen the conv state: not the config's bytes.
    with pytest.raises(LayoutError, match=rf"{where}\.shapes\[0\].*holds"):
        split(vllm_config(2, shapes=(gdn_shapes(2, spec_tokens=1)[0], gdn_shapes(2)[1])), cuts(2))
    # vLLM stores conv states DS, the cut was read as SD, and the reverse.
    with pytest.raises(LayoutError, match="rows are not its first dimension"):
        split(vllm_config(2, "DS"), cuts(2, "SD"))
    with pytest.raises(LayoutError, match="does not fall on its dimensions"):
        split(vllm_config(2, "SD"), cuts(2, "DS"))
    with pytest.raises(LayoutError, match=rf"{where}\.tp_replicated"):
        split(vllm_config(2, tp_replicated=True), cuts(2))
    with pytest.raises(LayoutError, match=rf"{where}\.shapes.*1 state tensors"):
        split(vllm_config(2, shapes=gdn_shapes(2)[:1], dtypes=(BF16,)), cuts(2))
    # State layers other than the config's.
    other = dataclasses.replace(cuts(2), layers=frozenset({0, 1}))
    with pytest.raises(LayoutError, match=r"kv_cache_groups.*state layers"):
        split(vllm_config(2), other)
    with pytest.raises(ProfileError):
        cuts_from_config({**CONFIG, "linear_num_key_heads": None}, tp_size=2, conv_layout="SD")
    with pytest.raises(LayoutError, match="describes no state"):
        cuts_from_config(load_config("llama-3.1-8b")[1], tp_size=1, conv_layout="SD")
    spec = vllm_config(1).kv_cache_groups[1].kv_cache_spec
    packed = packed_states(spec, cuts(1), tp_size=1, where="g")
    with pytest.raises(LayoutError, match=r"state tensors hold \d+ bytes, its page"):
        layout_from_vllm(
            vllm_config(2), buffer="b", base_offset=0, model=MODEL, tp_size=2, states={1: packed}
        )


def test_state_adds_the_prefill_ranks_a_decode_rank_reads() -> None:
    """Prefill TP 4 -> decode TP 2: Qwen3-Next's 2 KV heads are replicated on the prefill
    ranks and each decode rank reads its head from one replica, but its half of the
    16 key and 32 value heads of the state from two prefill ranks: both publish for it."""
    states = _cuts(layout(1, 0))
    assert [reader_sources(2, 4, 2, d) for d in range(2)] == [[0], [3]]
    assert [reader_sources(2, 4, 2, d, states) for d in range(2)] == [[0, 1], [2, 3]]
    assert [readers_of(2, 4, 2, p, states) for p in range(4)] == [[0], [0], [1], [1]]

    heads_only = {"num_tokens": 299, "prefill_tp_size": 4, "readers": [[_pub(0, 2)], [_pub(3, 2)]]}
    with pytest.raises(InvalidInputError, match=r"heads and state from prefill ranks \[0, 1\]"):
        rank_params(heads_only, 2, 0, 2, states)
    both = {**heads_only, "readers": [[_pub(0, 2), _pub(1, 2)], [_pub(3, 2)]]}
    assert [p.tp_rank for p in rank_params(both, 2, 0, 2, states)] == [0, 1]


def test_a_one_part_conv_state_stored_the_other_way_is_refused() -> None:
    """Mamba-1's conv state is one run of channels: stored SD (3, C) or DS (C, 3) it has
    the same bytes and one cut fits either shape's bytes, so the storage itself is checked
    (a DS cut read over SD storage would hand a decode rank half the rows of every
    channel instead of half the channels)."""
    path = Path(__file__).parent / "data" / "configs" / "falcon-mamba-tiny-dev.json"
    config = json.loads(path.read_text())
    inner, rows = config["intermediate_size"] // 2, config["conv_kernel"] - 1
    ssm = (inner, config["state_size"])
    stored = {"SD": ((rows, inner), ssm), "DS": ((inner, rows), ssm)}
    for layout_name, shapes in stored.items():
        spec = GDNSpec(BLOCK, 1 << 16, shapes=shapes, dtypes=(F32, F32))
        for cut_for in ("SD", "DS"):
            cut = cuts_from_config(config, tp_size=2, conv_layout=cut_for)
            assert cut.conv_rows == (rows, None)
            if cut_for == layout_name:
                conv, _ = packed_states(spec, cut, tp_size=2, where="g")
                assert conv.nbytes == rows * inner * 4
                continue
            with pytest.raises(LayoutError, match=r"not its first dimension|conv state layout"):
                packed_states(spec, cut, tp_size=2, where="g")


def test_a_model_without_attention_takes_its_sources_from_its_state() -> None:
    """Mamba-1 has no KV heads (vLLM reports 0): a decode rank's sources are the prefill
    ranks holding its state, the decode TP size is checked on the state alone, and a
    decode rank given a publication it does not read from is refused."""
    path = Path(__file__).parent / "data" / "configs" / "falcon-mamba-tiny-dev.json"
    config = json.loads(path.read_text())
    states = tuple(
        shard for _, shard in cuts_from_config(config, tp_size=1, conv_layout="SD").tensors
    )
    assert [reader_sources(0, 2, 1, 0, states)] == [[0, 1]]
    assert [reader_sources(None, 1, 2, d, states) for d in range(2)] == [[0], [0]]
    assert decode_tp_size({"decode_tp_size": 4}, 1, 0, states) == 4
    with pytest.raises(InvalidInputError, match=r"decode_tp_size.*cannot be placed"):
        decode_tp_size({"decode_tp_size": 3}, 1, 0, states)

    one = {"num_tokens": 299, "prefill_tp_size": 2, "readers": [[_pub(0, 1)]]}
    with pytest.raises(InvalidInputError, match=r"state from prefill ranks \[0, 1\]"):
        rank_params(one, 1, 0, None, states)
    both = {**one, "readers": [[_pub(0, 1), _pub(1, 1)]]}
    assert [p.tp_rank for p in rank_params(both, 1, 0, None, states)] == [0, 1]
