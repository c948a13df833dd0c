"""State families (kvxfer/core/state_families.py): groups and bytes worked out by hand
from vLLM's state shapes, block by block against the token-level oracle, at TP 1 and 2.

Where no published config.json of a family is stored (Nemotron-H, Mamba-Codestral,
Bamba, Qwen3.5), the configs below carry the published keys with the published sizes of
one model of the family, written by hand (see tests/data/configs/SOURCES.md). Sizes at
B = 16 tokens per block: K or V of one layer is 16 x elem x kv_heads x head_dim bytes; a
Mamba-2 conv state (d_conv - 1) x (intermediate/tp + 2 x groups_per_rank x d_state)
elements, its ssm state heads/tp x head_dim x d_state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_blocks
from strategies import requests

from kvxfer._exceptions import ProfileError, UnsupportedModelError
from kvxfer.core.layout import EngineLayout
from kvxfer.core.planner import plan_blocks
from kvxfer.core.profiles import layout_from_config

CONFIGS = Path(__file__).parent / "data" / "configs"

# nvidia/Nemotron-H-8B-Base-8K's architecture keys as published.
NEMOTRON_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "attention_head_dim": 128,
    "chunk_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "hidden_size": 4096,
    "hybrid_override_pattern": NEMOTRON_PATTERN,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "ssm_state_size": 128,
    "torch_dtype": "bfloat16",
    "use_conv_bias": True,
}

# mistralai/Mamba-Codestral-7B-v0.1's sizes under transformers' Mamba2Config keys.
MAMBA_CODESTRAL: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"],
    "model_type": "mamba2",
    "hidden_size": 4096,
    "num_hidden_layers": 64,
    "num_heads": 128,
    "head_dim": 64,
    "n_groups": 8,
    "state_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 256,
    "time_step_rank": 256,
    "torch_dtype": "bfloat16",
}

# ibm-ai-platform/Bamba-9B's sizes under transformers' BambaConfig keys.
BAMBA_9B: dict[str, Any] = {
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_indices": [9, 18, 27],
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "torch_dtype": "bfloat16",
}

# A small Qwen3.5 (multimodal wrapper, text_config) with its declared float32 ssm state.
QWEN3_5: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "dtype": "bfloat16",
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 2048,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
    },
}
QWEN3_5["text_config"]["layer_types"] = QWEN3_5["text_config"]["layer_types"] * 2


def _real(name: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return config | extra


def _summary(layout: EngineLayout) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(kind, layers, bytes of each tensor of the first layer) per group."""
    return [
        (
            g.kind.value,
            g.layers,
            tuple(t.bytes_per_block for t in g.tensors if t.layer == g.layers[0]),
        )
        for g in layout.groups
    ]


def _at(pattern: str, char: str) -> tuple[int, ...]:
    return tuple(i for i, c in enumerate(pattern) if c == char)


def _mamba2(
    d_ssm: int, groups: int, d_state: int, heads: int, d_head: int, elem: int = 2
) -> tuple[int, int]:
    return 3 * (d_ssm + 2 * groups * d_state) * 2, heads * d_head * d_state * elem


def _kv(kv_heads: int, head_dim: int) -> tuple[int, int]:
    return 32 * kv_heads * head_dim, 32 * kv_heads * head_dim


# name -> (config, state_dtype, tp_size, expected groups)
CASES: dict[str, tuple[dict[str, Any], str | None, int, list[Any]]] = {
    # Nemotron-H: M layers Mamba-2 with the ssm state in float32 (vLLM's default for the
    # family), * layers attention with 8 KV heads x 128, - layers nothing at all.
    "nemotron-h-8b": (
        NEMOTRON_H_8B, None, 1,
        [
            ("mamba", _at(NEMOTRON_PATTERN, "M"), _mamba2(8192, 8, 128, 128, 64, elem=4)),
            ("full_attention", _at(NEMOTRON_PATTERN, "*"), _kv(8, 128)),
        ],
    ),
    "nemotron-h-8b-tp2": (
        NEMOTRON_H_8B, None, 2,
        [
            ("mamba", _at(NEMOTRON_PATTERN, "M"), _mamba2(4096, 4, 128, 64, 64, elem=4)),
            ("full_attention", _at(NEMOTRON_PATTERN, "*"), _kv(4, 128)),
        ],
    ),
    "mamba-codestral": (
        MAMBA_CODESTRAL, None, 1, [("mamba", tuple(range(64)), _mamba2(8192, 8, 128, 128, 64))]
    ),
    "mamba-codestral-tp2": (
        MAMBA_CODESTRAL, None, 2, [("mamba", tuple(range(64)), _mamba2(4096, 4, 128, 64, 64))]
    ),
    "bamba-9b": (
        BAMBA_9B, None, 1,
        [
            ("mamba", tuple(i for i in range(32) if i not in (9, 18, 27)),
             _mamba2(8192, 1, 128, 128, 64)),
            ("full_attention", (9, 18, 27), _kv(8, 4096 // 32)),
        ],
    ),
    # TP 2 with one B/C group: each rank keeps the whole group (vLLM adds one).
    "bamba-9b-tp2": (
        BAMBA_9B, None, 2,
        [
            ("mamba", tuple(i for i in range(32) if i not in (9, 18, 27)),
             _mamba2(4096, 1, 128, 64, 64)),
            ("full_attention", (9, 18, 27), _kv(4, 4096 // 32)),
        ],
    ),
    # Qwen3.5: Gated DeltaNet conv 3 x (2 x 128 x 16 + 128 x 32) in bf16, ssm 32 heads x
    # 128 x 128 in the declared float32.
    "qwen3.5": (
        QWEN3_5, None, 1,
        [
            ("mamba", (0, 1, 2, 4, 5, 6), (3 * 8192 * 2, 32 * 128 * 128 * 4)),
            ("full_attention", (3, 7), _kv(2, 256)),
        ],
    ),
    "qwen3.5-tp2": (
        QWEN3_5, None, 2,
        [
            ("mamba", (0, 1, 2, 4, 5, 6), (3 * 4096 * 2, 16 * 128 * 128 * 4)),
            ("full_attention", (3, 7), _kv(1, 256)),
        ],
    ),
    # The real files of tests/data/configs at TP 2 (TP 1 is in test_real_configs.py).
    "falcon-mamba-tiny-dev-tp2": (
        _real("falcon-mamba-tiny-dev"), "bfloat16", 2,
        [("mamba", (0, 1, 2, 3), (3 * 128 * 2, 128 * 8 * 2))],
    ),
    "granite-4.0-h-1b-tp2": (
        _real("granite-4.0-h-1b"), "bfloat16", 2,
        [
            ("mamba", tuple(i for i in range(40) if i % 10 != 5), _mamba2(2048, 1, 128, 32, 64)),
            ("full_attention", (5, 15, 25, 35), _kv(4, 64)),
        ],
    ),
    "lfm2-350m-tp2": (
        _real("lfm2-350m"), None, 2,
        [
            ("mamba", (0, 1, 3, 4, 6, 7, 9, 11, 13, 15), (2 * 512 * 2,)),
            ("full_attention", (2, 5, 8, 10, 12, 14), _kv(4, 64)),
        ],
    ),
    "minimax-tiny-random-tp2": (
        _real("minimax-tiny-random"), None, 2,
        [
            ("mamba", tuple(range(7)), (4 * 64 * 64 * 2,)),
            ("full_attention", (7,), _kv(1, 64)),
        ],
    ),
    # Zamba2's page is cut: the two keys are restored from the file (see test_real_configs).
    "zamba2-2.7b-tp2": (
        _real("zamba2-2.7b-instruct-v2", num_hidden_layers=54, num_attention_heads=32),
        "bfloat16", 2,
        [
            ("mamba", tuple(range(54)), _mamba2(2560, 1, 64, 40, 64)),
            ("full_attention", (6, 12, 18, 24, 30, 36, 42, 47, 51), _kv(16, 160)),
        ],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_family_groups_and_bytes(name: str) -> None:
    config, state_dtype, tp, expected = CASES[name]
    layout = layout_from_config(config, name=name, tp_size=tp, state_dtype=state_dtype)
    assert _summary(layout) == expected
    for group in layout.groups:  # every layer of a group holds the same tensors
        sizes: dict[int, list[int]] = {}
        for t in group.tensors:
            sizes.setdefault(t.layer, []).append(t.bytes_per_block)
        assert len({tuple(v) for v in sizes.values()}) == 1


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.sampled_from((1, 16, 64)), st.data())
def test_state_family_plans_match_the_token_oracle(
    name: str, block_size: int, data: st.DataObject
) -> None:
    config, state_dtype, tp, _ = CASES[name]
    layout = layout_from_config(
        config, name=name, tp_size=tp, block_size=block_size, state_dtype=state_dtype
    )
    num_tokens, computed = data.draw(requests(block_size))
    for plan in plan_blocks(layout, num_tokens, computed):
        expected = oracle_blocks(plan.group, num_tokens, computed, block_size)
        assert set(plan.blocks) == expected
        assert plan.nbytes == len(expected) * plan.group.bytes_per_block


def test_nemotron_mlp_and_moe_layers_have_no_region() -> None:
    pattern = "M-E*ME-*"
    config = NEMOTRON_H_8B | {"hybrid_override_pattern": pattern, "num_hidden_layers": 8}
    layout = layout_from_config(config, name="n")
    held = {t.layer for g in layout.groups for t in g.tensors}
    assert held == {0, 3, 4, 7}
    as_list = {
        "layers_block_type": [
            "mamba",
            "mlp",
            "moe",
            "attention",
            "mamba",
            "moe",
            "mlp",
            "attention",
        ]
    }
    both = layout_from_config(config | as_list, name="n")
    assert both.groups == layout.groups


def test_nemotron_declared_ssm_dtype_and_override() -> None:
    bf16 = layout_from_config(NEMOTRON_H_8B | {"mamba_ssm_cache_dtype": "bfloat16"}, name="n")
    assert _summary(bf16)[0][2] == _mamba2(8192, 8, 128, 128, 64, elem=2)
    override = layout_from_config(NEMOTRON_H_8B, name="n", state_dtype="float16")
    assert _summary(override)[0][2] == _mamba2(8192, 8, 128, 128, 64, elem=2)
    assert _summary(override)[1][2] == _kv(8, 128)  # KV stays in the KV dtype


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        (NEMOTRON_H_8B | {"hybrid_override_pattern": "M*X" + NEMOTRON_PATTERN[3:]},
         "hybrid_override_pattern[2]", "'X'"),
        (NEMOTRON_H_8B | {"hybrid_override_pattern": NEMOTRON_PATTERN[:-1]},
         "hybrid_override_pattern", None),
        (NEMOTRON_H_8B | {"layers_block_type": ["mamba"] * 52}, "layers_block_type",
         "disagreeing"),
        (NEMOTRON_H_8B | {"mamba_n_groups": 1}, "mamba_n_groups", "n_groups"),
        (NEMOTRON_H_8B | {"sliding_window": 4096}, "sliding_window", "sliding_window"),
        # hidden / heads = 96, transformers' default 128: which one the engine uses
        # depends on the config class, so neither is guessed.
        (NEMOTRON_H_8B | {"hidden_size": 3072, "attention_head_dim": None}, "head_dim",
         "candidates"),
        (_real("granite-4.0-h-1b", head_dim=128), "head_dim", "hidden_size"),
        (_real("granite-4.0-h-1b", layer_types=["mamba"] * 39 + ["conv"]),
         "layer_types[39]", "'conv'"),
        (_real("lfm2-350m", layer_types=["mamba"] * 16), "layer_types[0]", "'mamba'"),
        (_real("lfm2-350m", layer_types=[["conv"]] * 16), "layer_types[0]", "['conv']"),
        (_real("minimax-tiny-random", layer_types=None, attn_type_list=[0] * 7 + [True]),
         "attn_type_list[7]", "True"),
        (_real("lfm2-350m", linear_conv_kernel_dim=4), "linear_conv_kernel_dim", "linear"),
        (_real("minimax-m1-tiny-random", layer_types=["full_attention"] * 8), "layer_types",
         "disagreeing"),
        (_real("zamba2-2.7b-instruct-v2", num_hidden_layers=54, num_attention_heads=32,
               num_key_value_heads=8), "num_key_value_heads", "one KV head per query head"),
        (_real("zamba2-2.7b-instruct-v2", num_hidden_layers=54, num_attention_heads=32,
               hybrid_layer_ids=[6, 12]), "hybrid_layer_ids", "disagreeing"),
        (_real("zamba2-2.7b-instruct-v2", num_hidden_layers=54, num_attention_heads=32,
               mamba_headdim=32), "mamba_headdim", "n_mamba_heads"),
        (_real("zamba2-2.7b-instruct-v2", num_hidden_layers=54, num_attention_heads=32,
               attention_head_dim=128), "attention_head_dim", "attention_hidden_size"),
        (_real("falcon-mamba-tiny-dev", mamba_d_state=16), "mamba_d_state", "Mamba layer"),
        (MAMBA_CODESTRAL | {"attn_layer_indices": [3]}, "attn_layer_indices", "indices"),
        # vLLM takes these from its cache flags, not the config (Nemotron-H's
        # mamba_ssm_cache_dtype aside), so a declared one cannot be trusted either way.
        (_real("granite-4.0-h-1b", mamba_ssm_cache_dtype="float32"), "mamba_ssm_cache_dtype",
         "declared"),
        (_real("lfm2-350m", mamba_cache_dtype="float32"), "mamba_cache_dtype", "declared"),
        (NEMOTRON_H_8B | {"mamba_cache_dtype": "float32"}, "mamba_cache_dtype", "declared"),
        (MAMBA_CODESTRAL | {"mamba_ssm_cache_dtype": "float32"}, "mamba_ssm_cache_dtype",
         "state dtype"),
    ],
)  # fmt: skip
def test_what_vllm_would_read_differently_is_refused_by_name(
    config: dict[str, Any], field: str, words: str | None
) -> None:
    with pytest.raises(ProfileError) as info:
        layout_from_config(config, name="m", state_dtype="bfloat16")
    assert info.value.field == field
    if words is not None:
        assert isinstance(info.value, UnsupportedModelError)
        assert words in info.value.detail
        assert info.value.detail.endswith(f"is not supported (field {field})")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (NEMOTRON_H_8B | {"n_groups": 3}, "n_groups"),  # 3 groups on 2 ranks
        (MAMBA_CODESTRAL | {"num_heads": 127}, "num_heads"),
        (BAMBA_9B | {"attn_layer_indices": [9, 32]}, "attn_layer_indices"),
        (_real("minimax-tiny-random", num_attention_heads=7), "num_attention_heads"),
    ],
)
def test_tp_and_malformed_fields_are_named(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ProfileError) as info:
        layout_from_config(config, name="m", tp_size=2)
    assert info.value.field == field
