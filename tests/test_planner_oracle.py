"""The planner against the token-level oracle, on every supported built-in profile."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_blocks, oracle_layer_blocks
from strategies import PROFILES, layouts, requests

from kvxfer._exceptions import LayoutError, PlanError
from kvxfer.core.layout import (
    MAX_TOKENS,
    EngineLayout,
    GroupId,
    GroupKind,
    KVGroup,
    TensorSpec,
)
from kvxfer.core.planner import (
    full_attention_blocks,
    full_attention_bytes,
    needed_blocks,
    plan_blocks,
    pool_blocks,
)
from kvxfer.core.profiles import layout_for_model, layout_from_config


@given(st.data())
def test_plan_matches_token_oracle(data: st.DataObject) -> None:
    layout = data.draw(layouts())
    num_tokens, computed = data.draw(requests(layout.block_size))
    plans = plan_blocks(layout, num_tokens, computed)
    total = 0
    for plan in plans:
        expected = oracle_blocks(plan.group, num_tokens, computed, layout.block_size)
        assert set(plan.blocks) == expected, plan.group
        assert plan.nbytes == len(expected) * plan.group.bytes_per_block
        total += plan.nbytes
    assert sum(p.nbytes for p in plans) == total


@given(st.data())
def test_full_attention_bytes_treats_windows_as_full(data: st.DataObject) -> None:
    layout = data.draw(layouts(vary_window=False))
    num_tokens, computed = data.draw(requests(layout.block_size))
    expected = 0
    for group in layout.groups:
        if group.kind is GroupKind.SLIDING_WINDOW:
            as_full = KVGroup(
                group.group_id, GroupKind.FULL_ATTENTION, None, group.layers, group.tensors
            )
            expected += len(oracle_blocks(as_full, num_tokens, computed, layout.block_size)) * (
                group.bytes_per_block
            )
        else:
            blocks = oracle_blocks(group, num_tokens, computed, layout.block_size)
            expected += len(blocks) * group.bytes_per_block
    assert full_attention_bytes(layout, num_tokens, computed) == expected


def _fixed_count_blocks(num_tokens: int, block_size: int, count: int) -> set[int]:
    """What a connector moving a fixed number of trailing blocks would move."""
    last = math.ceil(num_tokens / block_size) - 1
    return set(range(max(0, last - count + 1), last + 1))


def test_fixed_window_rules_are_wrong_and_kvxfer_is_exact() -> None:
    """cdiv(W, B)+1 moves one block too many and cdiv(W, B) misses one, depending on N."""
    layout = layout_for_model("gpt-oss-20b", block_size=16)
    group = next(g for g in layout.groups if g.kind is GroupKind.SLIDING_WINDOW)
    window, block = 128, 16
    assert group.sliding_window == window
    plus_one_count, plain_count = math.ceil(window / block) + 1, math.ceil(window / block)

    # N = 143: the window [16, 143) starts on a block boundary -> blocks 1..8, eight blocks.
    exact = oracle_blocks(group, 143, 0, block)
    assert exact == set(range(1, 9))
    assert set(needed_blocks(group.kind, window, 143, 0, block)) == exact
    assert _fixed_count_blocks(143, block, plus_one_count) - exact == {0}  # one wasted block

    # N = 130: the window [3, 130) touches blocks 0..8, nine blocks.
    exact = oracle_blocks(group, 130, 0, block)
    assert exact == set(range(9))
    assert set(needed_blocks(group.kind, window, 130, 0, block)) == exact
    assert exact - _fixed_count_blocks(130, block, plain_count) == {0}  # one block missed

    # And over every alignment of N, each fixed rule is wrong somewhere; kvxfer never is.
    over = under = 0
    for num_tokens in range(window, window + 4 * block):
        exact = oracle_blocks(group, num_tokens, 0, block)
        assert set(needed_blocks(group.kind, window, num_tokens, 0, block)) == exact
        over += len(_fixed_count_blocks(num_tokens, block, plus_one_count)) > len(exact)
        under += not exact <= _fixed_count_blocks(num_tokens, block, plain_count)
    assert over > 0 and under > 0


def test_unaligned_window_missed_by_cdiv() -> None:
    """Window 100 with B = 16 (not aligned): cdiv(W, B) = 7 blocks misses one at N = 113."""
    layout = layout_for_model("mistral-7b-v0.1", block_size=16)
    group = layout.groups[0]
    exact = set(needed_blocks(GroupKind.SLIDING_WINDOW, 100, 113, 0, 16))
    # tokens [14, 113) -> blocks 0..7: 8 blocks, more than cdiv(100, 16) = 7
    assert exact == set(range(8))
    assert exact == oracle_blocks(
        KVGroup(group.group_id, GroupKind.SLIDING_WINDOW, 100, group.layers, group.tensors),
        113,
        0,
        16,
    )
    assert len(_fixed_count_blocks(113, 16, math.ceil(100 / 16))) == 7


@pytest.mark.parametrize("model", PROFILES)
def test_full_prefix_hit_moves_nothing(model: str) -> None:
    layout = layout_for_model(model)
    for plan in plan_blocks(layout, 1000, 1000):
        assert not plan.blocks and plan.nbytes == 0


def test_mamba_moves_one_state_block_unless_fully_computed() -> None:
    layout = layout_for_model("jamba-mini-1.5")
    mamba = next(p for p in plan_blocks(layout, 5000, 4992) if p.group.kind is GroupKind.MAMBA)
    assert list(mamba.blocks) == [0]
    assert mamba.nbytes == mamba.group.bytes_per_block


def test_gemma_32k_moves_far_less_than_full_attention() -> None:
    layout = layout_for_model("gemma-3-4b-it")
    total = sum(p.nbytes for p in plan_blocks(layout, 32768, 0))
    full = full_attention_bytes(layout, 32768, 0)
    # 5 full layers move everything; 29 sliding layers move 64 of 2048 blocks.
    per_layer_block = 2 * 16 * 4 * 256 * 2
    assert total == per_layer_block * (5 * 2048 + 29 * 64)
    assert full == per_layer_block * 34 * 2048
    assert total < full / 5


@given(st.data())
def test_pool_blocks_bound_every_request_tightly(data: st.DataObject) -> None:
    """An engine sized by pool_blocks holds any request up to max_tokens, and the bound
    is reached (no over-allocation) for the longest requests."""
    layout = data.draw(layouts())
    max_tokens = data.draw(st.integers(1, 20_000))
    pools = pool_blocks(layout, max_tokens)
    for group in layout.groups:
        need = [
            len(oracle_blocks(group, n, 0, layout.block_size))
            for n in range(max(1, max_tokens - 2 * layout.block_size), max_tokens + 1)
        ]
        tokens = data.draw(st.integers(1, max_tokens))
        assert len(oracle_blocks(group, tokens, 0, layout.block_size)) <= pools[group.kind]
        assert max(need) <= pools[group.kind]
        windows = {g.sliding_window for g in layout.groups if g.sliding_window is not None}
        # Tight unless several windows share one sliding pool, or W == 1 (which moves
        # nothing; the pool still keeps one block so an engine can be sized at all).
        if group.kind is not GroupKind.SLIDING_WINDOW or windows == {group.sliding_window} != {1}:
            assert max(need) == pools[group.kind]


@st.composite
def llama4_layouts(draw: st.DrawFn) -> EngineLayout:
    """A Llama 4 text config with a drawn chunk size (aligned to the block size or not),
    NoPE interval and block size: chunked_local groups beside full attention."""
    block_size = draw(st.sampled_from((1, 16, 64, 256)))
    chunk = draw(
        st.one_of(
            st.integers(1, 5000),
            st.integers(1, 64).map(lambda k: k * block_size),
            st.just(8192),
        )
    )
    config = {
        "model_type": "llama4_text",
        "num_hidden_layers": draw(st.integers(1, 8)),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "attention_chunk_size": chunk,
        "no_rope_layer_interval": draw(st.integers(1, 5)),
    }
    return layout_from_config(config, name="llama4-drawn", block_size=block_size)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chunked_plan_matches_token_oracle(data: st.DataObject) -> None:
    layout = data.draw(llama4_layouts())
    num_tokens, computed = data.draw(requests(layout.block_size, max_tokens=40_000))
    for plan in plan_blocks(layout, num_tokens, computed):
        expected = oracle_blocks(plan.group, num_tokens, computed, layout.block_size)
        assert set(plan.blocks) == expected, plan.group.kind
        assert plan.nbytes == len(expected) * plan.group.bytes_per_block


@settings(deadline=None)
@given(st.data())
def test_chunked_pool_bound_holds_every_request(data: st.DataObject) -> None:
    layout = data.draw(llama4_layouts())
    max_tokens = data.draw(st.integers(1, 20_000))
    pools = pool_blocks(layout, max_tokens)
    for group in layout.groups:
        if group.kind is not GroupKind.CHUNKED_LOCAL:
            continue
        assert group.chunk_size is not None
        # The worst N of every chunk is its last token; check those and a drawn N.
        worst = [n for n in range(group.chunk_size - 1, max_tokens + 1, group.chunk_size)]
        for tokens in [*worst[-3:], data.draw(st.integers(1, max_tokens))]:
            assert len(oracle_blocks(group, tokens, 0, layout.block_size)) <= pools[group.kind]


def test_chunk_start_moves_nothing_and_chunk_end_moves_the_chunk() -> None:
    """S = 100, B = 16: at N = 300 (a chunk start) nothing is read; at N = 299 the chunk
    [200, 299) spans blocks 12..18, which no fixed block count aligned to N gives."""
    layout = layout_for_model("llama-3.1-8b", block_size=16)
    group = KVGroup(
        GroupId(0), GroupKind.CHUNKED_LOCAL, None, (0,), layout.groups[0].tensors, chunk_size=100
    )
    assert oracle_blocks(group, 300, 0, 16) == set()
    assert needed_blocks(GroupKind.CHUNKED_LOCAL, None, 300, 0, 16, chunk_size=100) == range(0)
    assert oracle_blocks(group, 299, 0, 16) == set(range(12, 19))
    assert needed_blocks(GroupKind.CHUNKED_LOCAL, None, 299, 0, 16, chunk_size=100) == range(12, 19)
    # A chunked group never moves more than the same layers as full attention.
    only = dataclasses.replace(layout, groups=(group,))
    assert full_attention_bytes(only, 299, 0) == 19 * group.bytes_per_block


def test_chunked_needs_its_chunk_size() -> None:
    with pytest.raises(PlanError, match="chunk_size"):
        needed_blocks(GroupKind.CHUNKED_LOCAL, None, 300, 0, 16)


def test_a_request_longer_than_max_tokens_is_a_plan_error() -> None:
    """Not an OverflowError from len(range) at 10^21 tokens: the sidecar's own limit."""
    layout = layout_for_model("llama-3.1-8b")
    assert plan_blocks(layout, MAX_TOKENS, 0)[0].blocks.stop == MAX_TOKENS // 16
    for tokens in (MAX_TOKENS + 1, 10**21):
        with pytest.raises(PlanError) as refused:
            plan_blocks(layout, tokens, 0)
        assert refused.value.field == "num_tokens"


@st.composite
def gemma3n_configs(draw: st.DrawFn) -> dict[str, object]:
    """Gemma-3n text configs (transformers' default layer_types: 4 sliding, 1 full) whose
    last num_kv_shared_layers layers, a multiple of the pattern, share earlier KV."""
    patterns = draw(st.integers(2, 7))
    return {
        "model_type": "gemma3n_text",
        "num_hidden_layers": 5 * patterns,
        "num_kv_shared_layers": 5 * draw(st.integers(0, patterns - 1)),
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_size": 128,
        "sliding_window": draw(st.integers(1, 3000)),
    }


def _gemma3n_reads(config: dict[str, object]) -> tuple[list[tuple[str, int | None]], list[int]]:
    """Each layer's kind and the layer whose cache it reads, by transformers' rule: a shared
    layer reads the last layer of its own kind before the shared range."""
    n, shared, window = (
        int(config[k]) for k in ("num_hidden_layers", "num_kv_shared_layers", "sliding_window")
    )  # type: ignore[call-overload]
    kinds: list[tuple[str, int | None]] = [
        ("full", None) if (i + 1) % 5 == 0 else ("sliding", window) for i in range(n)
    ]
    first = n - shared
    cache_of = [
        i if i < first else max(j for j in range(first) if kinds[j] == kinds[i]) for i in range(n)
    ]
    return kinds, cache_of


@settings(max_examples=200, deadline=None)
@given(gemma3n_configs(), st.sampled_from((1, 16, 64)), st.data())
def test_kv_shared_layers_move_nothing_of_their_own(
    config: dict[str, object], block_size: int, data: st.DataObject
) -> None:
    """Per layer and token: what every layer, shared or not, reads and the destination
    lacks is exactly what the plan moves, region by region, and no more."""
    layout = layout_from_config(config, name="gemma3n", block_size=block_size)
    num_tokens, computed = data.draw(requests(block_size, max_tokens=6000))
    moved = {
        (tensor.layer, block)
        for plan in plan_blocks(layout, num_tokens, computed)
        for tensor in plan.group.tensors
        for block in plan.blocks
    }
    kinds, cache_of = _gemma3n_reads(config)
    assert moved == oracle_layer_blocks(kinds, cache_of, num_tokens, computed, block_size)
    per_layer = 2 * block_size * 2 * 16 * 2  # K and V, 2 KV heads of 16, bf16
    total = sum(p.nbytes for p in plan_blocks(layout, num_tokens, computed))
    assert total == len(moved) * per_layer


@st.composite
def mimo_configs(draw: st.DrawFn) -> dict[str, object]:
    """MiMo-V2 configs: a drawn sliding/full pattern, window and per-kind geometry."""
    layers = draw(st.integers(1, 8))
    dims = st.sampled_from((8, 16, 24))
    return {
        "model_type": "mimo_v2_flash",
        "num_hidden_layers": layers,
        "hybrid_layer_pattern": draw(
            st.lists(st.sampled_from((0, 1)), min_size=layers, max_size=layers)
        ),
        "sliding_window_size": draw(st.integers(1, 3000)),
        "num_attention_heads": 8,
        "num_key_value_heads": draw(st.sampled_from((1, 2, 4))),
        "head_dim": draw(dims),
        "v_head_dim": draw(dims),
        "swa_num_key_value_heads": draw(st.sampled_from((1, 2, 8))),
        "swa_head_dim": draw(dims),
        "swa_v_head_dim": draw(dims),
    }


@settings(max_examples=200, deadline=None)
@given(mimo_configs(), st.sampled_from((1, 16, 64)), st.data())
def test_per_kind_geometry_moves_exact_bytes(
    config: dict[str, object], block_size: int, data: st.DataObject
) -> None:
    """Each layer's (layer, block) reads from the token oracle, each priced at that
    layer's own K + V size: the plan's bytes are exactly their sum."""
    layout = layout_from_config(config, name="mimo", block_size=block_size)
    num_tokens, computed = data.draw(requests(block_size, max_tokens=6000))
    pattern = config["hybrid_layer_pattern"]
    assert isinstance(pattern, list)
    window = config["sliding_window_size"]
    assert isinstance(window, int)
    kinds: list[tuple[str, int | None]] = [
        ("sliding", window) if p else ("full", None) for p in pattern
    ]
    reads = oracle_layer_blocks(kinds, range(len(kinds)), num_tokens, computed, block_size)

    def layer_bytes(layer: int) -> int:
        pre = "swa_" if pattern[layer] else ""
        heads, k, v = (
            config[f"{pre}{key}"] for key in ("num_key_value_heads", "head_dim", "v_head_dim")
        )
        return block_size * heads * (k + v) * 2  # type: ignore[operator]

    plans = plan_blocks(layout, num_tokens, computed)
    moved = {(t.layer, b) for p in plans for t in p.group.tensors for b in p.blocks}
    assert moved == reads
    assert sum(p.nbytes for p in plans) == sum(layer_bytes(layer) for layer, _ in reads)


@st.composite
def mla_layouts(draw: st.DrawFn) -> EngineLayout:
    """An MLA group (drawn latent width and layer count) first, and sometimes a sliding,
    chunked or Mamba group beside it, so the MLA rule is also exercised in combination."""
    block_size = draw(st.sampled_from((1, 16, 64, 256)))
    layers = draw(st.integers(1, 6))
    latent = draw(st.integers(1, 1024))
    groups = [
        KVGroup(
            GroupId(0),
            GroupKind.MLA,
            None,
            tuple(range(layers)),
            tuple(TensorSpec(f"layer.{i}.latent", i, block_size * latent) for i in range(layers)),
        )
    ]
    extra = draw(st.sampled_from((None, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)))
    if extra is not None:
        size = draw(st.integers(1, 5000))
        groups.append(
            KVGroup(
                GroupId(1),
                extra,
                size if extra is GroupKind.SLIDING_WINDOW else None,
                (layers,),
                (TensorSpec(f"layer.{layers}.k", layers, 8),),
                chunk_size=size if extra is GroupKind.CHUNKED_LOCAL else None,
            )
        )
    return EngineLayout("mla-drawn", "sha256:0", "bfloat16", block_size, 1, 0, tuple(groups))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mla_plan_matches_token_oracle(data: st.DataObject) -> None:
    layout = data.draw(mla_layouts())
    num_tokens, computed = data.draw(requests(layout.block_size, max_tokens=40_000))
    plans = plan_blocks(layout, num_tokens, computed)
    for plan in plans:
        expected = oracle_blocks(plan.group, num_tokens, computed, layout.block_size)
        assert set(plan.blocks) == expected, plan.group.kind
        assert plan.nbytes == len(expected) * plan.group.bytes_per_block
    mla = plans[0]
    assert (
        mla.nbytes
        == len(full_attention_blocks(mla.group, num_tokens, computed, layout.block_size))
        * mla.group.bytes_per_block
    )


def test_mla_group_needs_one_latent_per_layer() -> None:
    tensors = (TensorSpec("layer.0.latent", 0, 64), TensorSpec("layer.0.rope", 0, 64))
    with pytest.raises(LayoutError, match=r"groups\[0\]\.tensors: an mla group holds exactly one"):
        KVGroup(GroupId(0), GroupKind.MLA, None, (0,), tensors)
    with pytest.raises(LayoutError, match=r"groups\[0\]\.tensors: an mla group"):
        KVGroup(GroupId(0), GroupKind.MLA, None, (0, 1), tensors[:1])
