"""Model profiles: layer classification and sizes follow shared/models/README.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle import oracle_blocks
from strategies import requests

from kvxfer._exceptions import InvalidInputError, LayoutError, ProfileError, UnsupportedModelError
from kvxfer.core.layout import GroupKind
from kvxfer.core.planner import plan_blocks
from kvxfer.core.profiles import (
    builtin_profiles,
    layout_for_model,
    layout_from_config,
    load_config,
)

EXPECTED_BUILTINS = {
    "gpt-oss-20b",
    "gpt-oss-120b",
    "gemma-3-4b-it",
    "gemma-3-27b-it",
    "llama-3.1-8b",
    "mistral-7b-v0.1",
    "qwen3-next-80b-a3b",
    "jamba-mini-1.5",
    "falcon-h1-7b",
}


def kinds(model: str, **kw: int) -> list[tuple[str, int | None, int]]:
    layout = layout_for_model(model, **kw)  # type: ignore[arg-type]
    return [(g.kind.value, g.sliding_window, len(g.layers)) for g in layout.groups]


def test_builtins_are_shipped() -> None:
    assert set(builtin_profiles()) >= EXPECTED_BUILTINS


def test_group_structure_of_each_builtin() -> None:
    assert kinds("gemma-3-4b-it") == [("sliding_window", 1024, 29), ("full_attention", None, 5)]
    assert kinds("gemma-3-27b-it") == [("sliding_window", 1024, 52), ("full_attention", None, 10)]
    assert kinds("gpt-oss-20b") == [("sliding_window", 128, 12), ("full_attention", None, 12)]
    assert kinds("gpt-oss-120b") == [("sliding_window", 128, 18), ("full_attention", None, 18)]
    assert kinds("llama-3.1-8b") == [("full_attention", None, 32)]
    assert kinds("mistral-7b-v0.1") == [("sliding_window", 4096, 32)]
    assert kinds("qwen3-next-80b-a3b") == [("mamba", None, 36), ("full_attention", None, 12)]
    assert kinds("jamba-mini-1.5") == [("mamba", None, 28), ("full_attention", None, 4)]
    assert kinds("falcon-h1-7b") == [("full_attention", None, 44), ("mamba", None, 44)]


def test_jamba_attention_layers() -> None:
    layout = layout_for_model("jamba-mini-1.5")
    assert layout.groups[1].layers == (4, 12, 20, 28)


def test_attention_bytes_per_block() -> None:
    # llama: 8 KV heads x 128 dims x bf16 x 16 tokens, for K and for V
    layout = layout_for_model("llama-3.1-8b", block_size=16)
    assert layout.groups[0].tensors[0].bytes_per_block == 8 * 128 * 2 * 16
    assert layout.groups[0].bytes_per_block == 32 * 2 * 8 * 128 * 2 * 16
    # fp8 halves it, TP 2 halves it again
    fp8_tp2 = layout_for_model("llama-3.1-8b", kv_dtype="float8_e4m3fn", tp_size=2)
    assert fp8_tp2.groups[0].bytes_per_block == layout.groups[0].bytes_per_block // 4


def test_state_sizes_follow_the_readme() -> None:
    qwen = layout_for_model("qwen3-next-80b-a3b").groups[0].tensors
    conv_dim = 2 * 128 * 16 + 128 * 32
    assert qwen[0].bytes_per_block == 3 * conv_dim * 2
    assert qwen[1].bytes_per_block == 32 * 128 * 128 * 2
    jamba = layout_for_model("jamba-mini-1.5").groups[0].tensors
    assert jamba[0].bytes_per_block == 3 * 8192 * 2
    assert jamba[1].bytes_per_block == 8192 * 16 * 2
    falcon = layout_for_model("falcon-h1-7b").groups[1].tensors
    assert falcon[0].bytes_per_block == 3 * (3072 + 2 * 256) * 2
    assert falcon[1].bytes_per_block == 24 * 128 * 256 * 2
    # state does not depend on the block size
    assert layout_for_model("jamba-mini-1.5", block_size=256).groups[0].tensors == jamba


def test_deepseek_v2_lite_is_one_mla_group() -> None:
    """27 layers, one latent each: 16 tokens x (512 + 64) x 2 bytes = 18432 per block."""
    (group,) = layout_for_model("deepseek-v2-lite").groups
    assert (group.kind, group.layers) == (GroupKind.MLA, tuple(range(27)))
    assert [(t.name, t.bytes_per_block) for t in group.tensors[:2]] == [
        ("layer.0.latent", 18432),
        ("layer.1.latent", 18432),
    ]


def test_config_path_and_text_config_nesting(tmp_path: Path) -> None:
    config = {
        "text_config": {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_size": 256,
        }
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    layout = layout_for_model(str(path))
    assert layout.groups[0].kind is GroupKind.FULL_ATTENTION
    assert layout.groups[0].tensors[0].bytes_per_block == 2 * 64 * 2 * 16


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": "x"}, "num_attention_heads"),
        (
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 3,
                "hidden_size": 64,
            },
            "num_key_value_heads",
        ),
        (
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "hidden_size": 64,
                "layer_types": ["full_attention"],
            },
            "layer_types",
        ),
        (
            {
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "hidden_size": 64,
                "layer_types": ["cross_attention"],
            },
            "layer_types[0]",
        ),
        ({"text_config": 5}, "text_config"),
    ],
)
def test_malformed_configs_name_the_field(config: dict[str, object], field: str) -> None:
    if "text_config" not in config:
        config = {"model_type": "llama", **config}
    with pytest.raises(ProfileError) as info:
        layout_from_config(config, name="bad", tp_size=2)
    assert info.value.field == field


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(LayoutError, match="kv_dtype: unknown dtype 'int3'"):
        layout_for_model("llama-3.1-8b", kv_dtype="int3")
    with pytest.raises(ProfileError, match="neither a built-in profile"):
        layout_for_model("no-such-model")


def test_fingerprint_depends_on_architecture_not_name() -> None:
    a = layout_for_model("gpt-oss-20b")
    b = layout_for_model("gpt-oss-120b")
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == layout_for_model("gpt-oss-20b", block_size=32).fingerprint


def _attention_config(model_type: str | None, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_size": 512,
        **extra,
    }
    if model_type is not None:
        config["model_type"] = model_type
    return config


@pytest.mark.parametrize(
    ("model_type", "extra", "field", "feature"),
    [
        # Families named in issue 12 whose published config.json is not stored in
        # tests/data/configs: their published keys, on a small attention config.
        ("nemotron_h", {"block_configs": [{}] * 4}, "block_configs", "Puzzle"),
        ("", {"hybrid_layer_pattern": [0, 1, 1, 1]}, "hybrid_layer_pattern", "sliding/full"),
        ("glm4_moe", {"swa_num_key_value_heads": 8}, "swa_num_key_value_heads", "geometry"),
        ("deepseek_v4", {"compress_ratios": [0, 4, 128, 4]}, "compress_ratios", "compressed"),
        ("gemma4_text", {"num_kv_shared_layers": 2}, "num_kv_shared_layers", "KV sharing"),
        ("gemma4_text", {"global_head_dim": 512}, "global_head_dim", "head geometry"),
        ("gemma4_text", {"attention_k_eq_v": True}, "attention_k_eq_v", "values"),
        ("qwen3", {"mamba_ssm_dtype": "float32"}, "mamba_ssm_dtype", "state dtype"),
        ("llama", {"mamba_ssm_cache_dtype": "float32"}, "mamba_ssm_cache_dtype", "state dtype"),
        ("llama", {"attention_chunk_size": 8192}, "attention_chunk_size", "chunked"),
        ("llama", {"sliding_window": 4096}, "sliding_window", "sliding_window"),
        ("phi3", {"sliding_window": 2047}, "sliding_window", "sliding_window"),
        (
            "cohere2",
            {"sliding_window_pattern": 4, "sliding_window": 4096},
            "sliding_window_pattern",
            "pattern",
        ),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 4096},
            "use_sliding_window",
            "max_window_layers",
        ),
        (
            "some_hybrid",
            {"layer_types": ["full_attention", "mamba"] * 2},
            "layer_types[1]",
            "'mamba'",
        ),
        (
            "minimax",
            {"layer_types": ["linear_attention"] * 4, "sliding_window": 64},
            "sliding_window",
            "sliding window",
        ),
        ("my_ssm", {"ssm_state_size": 128}, "ssm_state_size", "state-space"),
        (None, {"conv_L_cache": 3}, "conv_L_cache", "convolution"),
        ("my_model", {"attention_head_dim": 160}, "attention_head_dim", "head dim"),
        ("glm4_moe", {"v_head_dim": 128}, "v_head_dim", "value head dim"),
        ("falcon", {"multi_query": True}, "multi_query", "multi-query"),
        (
            "falcon",
            {"new_decoder_architecture": True, "num_kv_heads": 8},
            "num_kv_heads",
            "KV head",
        ),
        ("chatglm", {"multi_query_group_num": 2, "kv_channels": 128}, "kv_channels", "head dim"),
        ("minicpm3", {"kv_lora_rank": 256}, "kv_lora_rank", "MLA"),
    ],
)
def test_published_features_are_refused_by_name(
    model_type: str | None, extra: dict[str, object], field: str, feature: str
) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_config(_attention_config(model_type, **extra), name="m")
    assert info.value.field == field
    assert feature in info.value.detail
    assert info.value.detail.endswith(f"is not supported (field {field})")


@pytest.mark.parametrize(
    "extra",
    [
        {"sliding_window": None, "attention_chunk_size": None, "use_sliding_window": False},
        {"num_kv_shared_layers": 0, "v_head_dim": 64},  # values that change nothing
        {"layer_types": ["full_attention"] * 4},
        {"num_key_value_heads": None},  # one KV head per query head, as in HF
    ],
)
def test_neutral_values_of_semantic_keys_are_accepted(extra: dict[str, object]) -> None:
    layout = layout_from_config(_attention_config("llama", **extra), name="m")
    assert [(g.kind, len(g.layers)) for g in layout.groups] == [(GroupKind.FULL_ATTENTION, 4)]


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("some_new_model", {}),  # looks like plain attention: still never guessed
        (None, {}),  # neither model_type nor a known architecture
        # Llama-Nemotron Super/Ultra: per-layer attention no-ops and KV heads (published
        # keys; vLLM's DeciLM reader), which no generic reader could size.
        (
            "nemotron-nas",
            {
                "num_key_value_heads": None,
                "block_configs": [{"attention": {"n_heads_in_group": 8, "no_op": False}}] * 4,
            },
        ),
        # RecurrentGemma: recurrent blocks under a key of its own.
        ("recurrent_gemma", {"block_types": ["recurrent", "recurrent", "attention"]}),
    ],
)
def test_model_types_without_a_reader_are_refused(
    model_type: str | None, extra: dict[str, object]
) -> None:
    config = _attention_config(model_type, **extra)
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_config(config, name="m")
    assert info.value.field == "model_type"
    assert "no reader" in info.value.detail


def test_linear_attention_is_gated_deltanet_only_for_qwen3_next() -> None:
    config = json.loads(
        (Path(__file__).parents[1] / "kvxfer/profiles/qwen3-next-80b-a3b.json").read_text()
    )
    config["model_type"] = "some_linear_model"
    with pytest.raises(UnsupportedModelError, match="field"):
        layout_from_config(config, name="q")
    del config["layer_types"], config["model_type"]
    config["model_type"] = "qwen3_next"  # layer kinds from full_attention_interval alone
    derived = layout_for_model("qwen3-next-80b-a3b")
    assert layout_from_config(config, name="q").groups == derived.groups


def test_falcon_h1_groups_are_replicated_across_tp_ranks() -> None:
    """One B/C group and TP 2: each rank keeps the whole group (vLLM adds a group rather
    than splitting one), so the conv state is d_ssm/2 + 2 x d_state channels, not half."""
    tp2 = layout_for_model("falcon-h1-7b", tp_size=2).groups[1].tensors
    assert tp2[0].bytes_per_block == 3 * (3072 // 2 + 2 * 256) * 2
    assert tp2[1].bytes_per_block == 12 * 128 * 256 * 2


def test_fingerprint_ignores_metadata_and_follows_the_architecture(tmp_path: Path) -> None:
    base = json.loads((Path(__file__).parents[1] / "kvxfer/profiles/llama-3.1-8b.json").read_text())
    same = {
        **base,
        "transformers_version": "4.99.0",
        "max_position_embeddings": 131072,
        "_name_or_path": "someone/else",
        "torch_dtype": "float16",
        "use_cache": False,
    }
    fingerprint = layout_from_config(base, name="a").fingerprint
    assert layout_from_config(same, name="b").fingerprint == fingerprint
    changes = (
        {"num_key_value_heads": 4},
        {"rope_theta": 1e6},
        {"num_hidden_layers": 31},
        {"hidden_size": 2048},  # same cache shape, another model (Qwen3-4B vs 8B)
        {"intermediate_size": 8192},
        {"vocab_size": 32000},
        {"a_key_nobody_knows": 1},  # fail closed
    )
    for change in changes:
        assert layout_from_config({**base, **change}, name="c").fingerprint != fingerprint, change


STATE_PROFILES = ("qwen3-next-80b-a3b", "jamba-mini-1.5", "falcon-h1-7b")
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@given(
    st.sampled_from(STATE_PROFILES),
    st.sampled_from(DTYPES),
    st.one_of(st.none(), st.sampled_from(DTYPES)),
    st.data(),
)
def test_state_is_sized_in_the_state_dtype_not_the_kv_dtype(
    model: str, kv_dtype: str, state_dtype: str | None, data: st.DataObject
) -> None:
    """Attention scales with kv_dtype, state with the model dtype (bf16 in every built-in)
    or the override; plans still move exactly the oracle's blocks of each group."""
    base = layout_for_model(model)  # bf16 everywhere
    layout = layout_for_model(model, kv_dtype=kv_dtype, state_dtype=state_dtype)
    state_elem = ELEM[state_dtype or "bfloat16"]
    for got, ref in zip(layout.groups, base.groups, strict=True):
        elem = state_elem if got.kind is GroupKind.MAMBA else ELEM[kv_dtype]
        assert [t.bytes_per_block for t in got.tensors] == [
            t.bytes_per_block // 2 * elem for t in ref.tensors
        ]
    num_tokens, computed = data.draw(requests(layout.block_size))
    for plan in plan_blocks(layout, num_tokens, computed):
        blocks = oracle_blocks(plan.group, num_tokens, computed, layout.block_size)
        assert plan.nbytes == len(blocks) * plan.group.bytes_per_block


def test_declared_state_dtypes_follow_vllm_rule() -> None:
    """conv in mamba_cache_dtype else the model dtype; ssm in mamba_ssm_cache_dtype
    (or Qwen3.5's mamba_ssm_dtype) else as conv."""
    path = Path(__file__).parents[1] / "kvxfer/profiles/jamba-mini-1.5.json"
    config = json.loads(path.read_text())
    ssm32 = layout_from_config({**config, "mamba_ssm_cache_dtype": "float32"}, name="j")
    conv, ssm = ssm32.groups[0].tensors[:2]
    assert (conv.bytes_per_block, ssm.bytes_per_block) == (3 * 8192 * 2, 8192 * 16 * 4)
    both = layout_from_config({**config, "mamba_cache_dtype": "float16"}, name="j")
    assert both.groups[0].tensors[1].bytes_per_block == 8192 * 16 * 2
    auto = layout_from_config({**config, "mamba_ssm_cache_dtype": "auto"}, name="j")
    assert auto.groups == layout_for_model("jamba-mini-1.5").groups


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"torch_dtype": None}, "torch_dtype"),
        ({"torch_dtype": "float32"}, "torch_dtype"),
        ({"mamba_ssm_cache_dtype": 4}, "mamba_ssm_cache_dtype"),
        ({"mamba_ssm_cache_dtype": "int4"}, "mamba_ssm_cache_dtype"),
    ],
)
def test_state_dtype_that_cannot_be_known_is_refused(change: dict[str, object], field: str) -> None:
    path = Path(__file__).parents[1] / "kvxfer/profiles/jamba-mini-1.5.json"
    config = {**json.loads(path.read_text()), **change}
    with pytest.raises(InvalidInputError) as info:
        layout_from_config(config, name="j")
    assert info.value.field == field
    if "torch_dtype" in change:  # an attention-only config needs no model dtype
        llama = json.loads((path.parent / "llama-3.1-8b.json").read_text())
        assert layout_from_config({**llama, **change}, name="l").groups


def _llama4(**extra: object) -> dict[str, object]:
    return _attention_config("llama4_text", num_hidden_layers=8, **extra)


def _groups_of(config: dict[str, object]) -> list[tuple[str, int | None, tuple[int, ...]]]:
    layout = layout_from_config(config, name="l4")
    return [(g.kind.value, g.chunk_size, g.layers) for g in layout.groups]


@pytest.mark.parametrize("rope", [None, []])
def test_llama4_default_makes_every_fourth_layer_global(rope: object) -> None:
    """No (or an empty) no_rope_layers: NoPE, full attention, on layers 3, 7, ...; the
    others attend within chunks (transformers' default, which vLLM reads)."""
    config = _llama4(attention_chunk_size=8192, no_rope_layers=rope)
    assert _groups_of(config) == [
        ("chunked_local", 8192, (0, 1, 2, 4, 5, 6)),
        ("full_attention", None, (3, 7)),
    ]
    config["no_rope_layer_interval"] = 2
    assert _groups_of(config) == [
        ("chunked_local", 8192, (0, 2, 4, 6)),
        ("full_attention", None, (1, 3, 5, 7)),
    ]


def test_llama4_reads_explicit_rope_layers_and_a_consistent_layer_types() -> None:
    rope = [1, 0, 1, 1, 0, 0, 1, 1]
    kinds = ["chunked_attention" if r else "full_attention" for r in rope]
    expected = [
        ("chunked_local", 4096, (0, 2, 3, 6, 7)),
        ("full_attention", None, (1, 4, 5)),
    ]
    config = _llama4(attention_chunk_size=4096, no_rope_layers=rope)
    assert _groups_of(config) == expected
    assert _groups_of({**config, "layer_types": kinds}) == expected
    # Without a chunk size vLLM runs every layer as full attention.
    assert _groups_of(_llama4(attention_chunk_size=None)) == [
        ("full_attention", None, tuple(range(8)))
    ]
    # The multimodal wrapper: the text config nests, the outer model_type is llama4.
    outer = {"model_type": "llama4", "text_config": {**config, "model_type": "llama4_text"}}
    assert _groups_of(outer) == expected


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
        ({"no_rope_layers": [1, 2, 1, 1, 1, 1, 1, 1]}, "no_rope_layers[1]"),
        ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
        ({"attention_chunk_size": -5}, "attention_chunk_size"),
        ({"layer_types": ["chunked_attention"] * 3}, "layer_types"),
    ],
)
def test_llama4_malformed_fields_are_named(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ProfileError) as info:
        layout_from_config(_llama4(**{"attention_chunk_size": 8192, **extra}), name="l4")
    assert info.value.field == field


def test_llama4_layer_types_that_disagree_with_vllm_are_refused() -> None:
    """transformers masks by layer_types, vLLM by no_rope_layers: where they differ the
    two engines cache different things, so kvxfer refuses rather than pick one."""
    config = _llama4(attention_chunk_size=8192, layer_types=["full_attention"] * 8)
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_config(config, name="l4")
    assert info.value.field == "layer_types"
    assert "layer 0: 'full_attention', which vLLM runs as chunked" in info.value.detail


# Gemma-3n E4B's text config as published in transformers' Gemma3nTextConfig defaults
# (no config.json of the model was found in the stored pages): 35 layers, the last 15
# sharing KV, 4 sliding (512) then 1 full, 2 KV heads of 256.
GEMMA3N_E4B: dict[str, object] = {
    "model_type": "gemma3n_text",
    "num_hidden_layers": 35,
    "num_kv_shared_layers": 15,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
}


def test_gemma3n_shared_layers_have_no_region() -> None:
    """20 of 35 layers cache KV: 16 sliding, 4 full; layers 20..34 own nothing."""
    layout = layout_from_config(GEMMA3N_E4B, name="gemma-3n-e4b", block_size=16)
    sliding, full = layout.groups
    assert (sliding.kind, sliding.sliding_window) == (GroupKind.SLIDING_WINDOW, 512)
    assert sliding.layers == tuple(i for i in range(20) if (i + 1) % 5)
    assert full.layers == (4, 9, 14, 19)
    assert {t.layer for g in layout.groups for t in g.tensors} == set(range(20))
    assert full.bytes_per_block == 4 * 2 * 16 * 2 * 256 * 2
    # The outer multimodal config, and the default layer_types, give the same groups.
    defaults = {k: v for k, v in GEMMA3N_E4B.items() if k != "layer_types"}
    outer = {"model_type": "gemma3n", "text_config": defaults}
    assert layout_from_config(outer, name="gemma-3n-e4b", block_size=16).groups == layout.groups


def test_gemma3n_plan_counts_only_the_caching_layers() -> None:
    """32k tokens: 4 full layers move 2048 blocks, 16 sliding layers the 32 blocks under
    the last 511 tokens; 35 layers planned as full attention would move 35 x 2048."""
    layout = layout_from_config(GEMMA3N_E4B, name="gemma-3n-e4b", block_size=16)
    plans = plan_blocks(layout, 32768, 0)
    assert [len(p.blocks) for p in plans] == [32, 2048]
    per_layer_block = 2 * 16 * 2 * 256 * 2
    assert sum(p.nbytes for p in plans) == per_layer_block * (16 * 32 + 4 * 2048)


@pytest.mark.parametrize(
    ("shared", "error"),
    [
        (13, UnsupportedModelError),  # layer 22: transformers reads layer 21, vLLM layer 20
        (35, ProfileError),  # no layer left to cache anything
        (-1, ProfileError),
    ],
)
def test_gemma3n_sharing_the_engines_read_differently_is_refused(
    shared: int, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        layout_from_config({**GEMMA3N_E4B, "num_kv_shared_layers": shared}, name="g")
    assert info.value.field == "num_kv_shared_layers"  # type: ignore[attr-defined]


def _mimo(**extra: object) -> dict[str, object]:
    """MiMo-V2-Flash's attention keys as vLLM reads them, with its published sizes (no
    config.json of the model was found in the stored pages): 48 layers, layer 0 and every
    6th layer full (4 KV heads), the rest sliding over 128 tokens (8 KV heads); K head
    dim 192, V head dim 128 on both."""
    config: dict[str, object] = {
        "model_type": "mimo_v2_flash",
        "num_hidden_layers": 48,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 192,
        "v_head_dim": 128,
        "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8,
        "swa_head_dim": 192,
        "swa_v_head_dim": 128,
        "sliding_window_size": 128,
        "hybrid_layer_pattern": [0] + [1 if (i + 1) % 6 else 0 for i in range(1, 48)],
        "hidden_size": 4096,
    }
    return config | extra


def test_mimo_v2_groups_have_their_own_geometry() -> None:
    layout = layout_from_config(_mimo(), name="mimo", block_size=16)
    full, sliding = layout.groups
    assert full.layers == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert (sliding.kind, sliding.sliding_window, len(sliding.layers)) == (
        GroupKind.SLIDING_WINDOW,
        128,
        39,
    )
    # per layer: K = 16 tokens x heads x 192 x 2 bytes, V the same with 128
    assert [t.bytes_per_block for t in full.tensors[:2]] == [16 * 4 * 192 * 2, 16 * 4 * 128 * 2]
    assert [t.bytes_per_block for t in sliding.tensors[:2]] == [16 * 8 * 192 * 2, 16 * 8 * 128 * 2]
    assert full.bytes_per_block == 9 * 16 * 4 * 320 * 2
    # TP 8: 4 full-layer KV heads are replicated (one per rank), 8 sliding ones split.
    tp8 = layout_from_config(_mimo(), name="mimo", block_size=16, tp_size=8)
    assert [t.bytes_per_block for t in tp8.groups[0].tensors[:2]] == [16 * 192 * 2, 16 * 128 * 2]
    assert [t.bytes_per_block for t in tp8.groups[1].tensors[:2]] == [16 * 192 * 2, 16 * 128 * 2]
    # A V head dim left out is the K head dim.
    no_v = layout_from_config(_mimo(v_head_dim=None), name="mimo", block_size=16)
    assert [t.bytes_per_block for t in no_v.groups[0].tensors[:2]] == [16 * 4 * 192 * 2] * 2


@pytest.mark.parametrize(
    ("extra", "field", "error"),
    [
        ({"hybrid_layer_pattern": None}, "hybrid_layer_pattern", UnsupportedModelError),
        ({"layer_types": ["full_attention"] * 48}, "layer_types", UnsupportedModelError),
        ({"sliding_window": 4096}, "sliding_window", UnsupportedModelError),
        ({"hybrid_layer_pattern": [0, 1]}, "hybrid_layer_pattern", ProfileError),
        ({"swa_num_key_value_heads": 0}, "swa_num_key_value_heads", ProfileError),
        ({"swa_v_head_dim": -1}, "swa_v_head_dim", ProfileError),
        ({"layer_types": ["full_attention"]}, "layer_types", ProfileError),
    ],
)
def test_mimo_v2_what_vllm_would_read_differently_is_refused(
    extra: dict[str, object], field: str, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        layout_from_config(_mimo(**extra), name="mimo")
    assert info.value.field == field  # type: ignore[attr-defined]


def _llama(**extra: object) -> dict[str, object]:
    return {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "hidden_size": 512,
        **extra,
    }


@pytest.mark.parametrize(
    ("config", "field"),
    [
        # head_dim, when given, is read as it is: never truncated, coerced or replaced
        (_llama(head_dim="abc"), "head_dim"),
        (_llama(head_dim=64.9), "head_dim"),
        (_llama(head_dim=True), "head_dim"),
        (_llama(head_dim=0), "head_dim"),
        (_llama(head_dim=-64), "head_dim"),
        (_llama(head_dim=[64]), "head_dim"),
        # KV heads must share the query heads out evenly (no engine runs otherwise)
        (_llama(num_key_value_heads=16), "num_key_value_heads"),
        (_llama(num_key_value_heads=3), "num_key_value_heads"),
        # past what a layout may carry, refused before a layer is read
        (_llama(num_hidden_layers=100_000_000), "num_hidden_layers"),
        # an architecture never stands in for a model_type that is there but unreadable
        (_llama(model_type=5, architectures=["LlamaForCausalLM"]), "model_type"),
        ({"text_config": _llama(model_type=["llama"])}, "text_config.model_type"),
    ],
)
def test_config_values_no_engine_could_run_are_refused_by_name(
    config: dict[str, object], field: str
) -> None:
    with pytest.raises(ProfileError) as info:
        layout_from_config(config, name="bad")
    assert info.value.field == field


def test_head_dim_given_or_derived_sizes_the_blocks() -> None:
    derived = layout_from_config(_llama(), name="derived")
    given = layout_from_config(_llama(head_dim=128), name="given")
    assert derived.groups[0].tensors[0].bytes_per_block == 16 * 8 * 64 * 2
    assert given.groups[0].tensors[0].bytes_per_block == 16 * 8 * 128 * 2


@pytest.mark.parametrize("indices", ["0,1", 7, ["0", "1"], [999], [True]])
def test_falcon_h1_attention_layers_must_be_layer_indices(indices: object) -> None:
    _, config = load_config("falcon-h1-7b")
    with pytest.raises(ProfileError) as info:
        layout_from_config({**config, "attn_layer_indices": indices}, name="falcon")
    assert info.value.field == "attn_layer_indices"


@pytest.mark.parametrize("offset", [8, -1, "4", 4.0, True])
def test_jamba_attention_offset_must_fall_within_its_period(offset: object) -> None:
    _, config = load_config("jamba-mini-1.5")
    assert config["attn_layer_period"] == 8
    with pytest.raises(ProfileError) as info:
        layout_from_config({**config, "attn_layer_offset": offset}, name="jamba")
    assert info.value.field == "attn_layer_offset"


def test_model_files_that_are_not_json_text_are_refused(tmp_path: Path) -> None:
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    for path, says in ((binary, "not UTF-8"), (deep, "nests too deeply")):
        with pytest.raises(ProfileError, match=says) as info:
            layout_for_model(str(path))
        assert info.value.field == "model"
