"""Real published config.json files (tests/data/configs, sources in SOURCES.md).

Each is either planned exactly or refused by name. The expected groups below
are worked out by hand from each file's numbers (K and V of kv_heads x head_dim
per token per layer; Mamba-2 conv and ssm state from d_ssm, groups, d_state,
heads), not by calling the profile reader, and the plans are checked against
the token-level oracle. At B = 16 tokens per block in bf16 (2 bytes), K or V
of one layer is 16 x 2 x kv_heads x head_dim = 32 x kv_heads x head_dim bytes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_blocks
from strategies import requests

from kvxfer._exceptions import ProfileError, UnsupportedModelError
from kvxfer.core.layout import EngineLayout, GroupKind
from kvxfer.core.planner import plan_blocks
from kvxfer.core.profiles import layout_for_model, layout_from_config

CONFIGS = Path(__file__).parent / "data" / "configs"


class Expected(NamedTuple):
    kind: str
    window: int | None
    layers: tuple[int, ...]
    tensor_bytes: tuple[int, ...]  # per layer, B = 16, bf16, TP 1
    chunk: int | None = None


def _kv(kv_heads: int, head_dim: int) -> tuple[int, int]:
    side = 32 * kv_heads * head_dim
    return side, side


def _full(n: int, kv_heads: int, head_dim: int) -> Expected:
    return Expected("full_attention", None, tuple(range(n)), _kv(kv_heads, head_dim))


def _every(n: int, period: int, offset: int) -> tuple[int, ...]:
    return tuple(i for i in range(n) if i % period == offset)


def _except(n: int, period: int, offset: int) -> tuple[int, ...]:
    return tuple(i for i in range(n) if i % period != offset)


def _mamba2(n: int, d_ssm: int, groups: int, d_state: int, heads: int, d_head: int) -> Expected:
    conv = 3 * (d_ssm + 2 * groups * d_state) * 2  # (d_conv - 1) rows, d_conv = 4
    return Expected("mamba", None, tuple(range(n)), (conv, heads * d_head * d_state * 2))


# hidden / heads gives head_dim where the config has no head_dim.
SUPPORTED: dict[str, list[Expected]] = {
    "llama-3.2-1b": [_full(16, 8, 64)],
    "llama-2-13b": [_full(40, 40, 5120 // 40)],
    "qwen2.5-7b-instruct": [_full(28, 4, 3584 // 28)],  # use_sliding_window false
    "qwen2-0.5b-instruct": [_full(24, 2, 896 // 14)],
    "qwen2-72b-instruct": [_full(80, 8, 8192 // 64)],
    "qwen3-8b": [_full(36, 8, 128)],
    "qwen3-4b": [_full(36, 8, 128)],
    "qwen3-0.6b": [_full(28, 8, 128)],
    "mistral-7b-v0.1": [Expected("sliding_window", 4096, tuple(range(32)), _kv(8, 128))],
    "codestral-22b-v0.1": [_full(56, 8, 6144 // 48)],  # sliding_window null
    "gemma-2-9b-it": [
        Expected("sliding_window", 4096, _every(42, 2, 0), _kv(8, 256)),
        Expected("full_attention", None, _every(42, 2, 1), _kv(8, 256)),
    ],
    "gemma-3-270m": [
        Expected("sliding_window", 512, _except(18, 6, 5), _kv(1, 256)),
        Expected("full_attention", None, _every(18, 6, 5), _kv(1, 256)),
    ],
    "gemma-3-1b-pt": [  # no layer_types: sliding_window_pattern 6
        Expected("sliding_window", 512, _except(26, 6, 5), _kv(1, 256)),
        Expected("full_attention", None, _every(26, 6, 5), _kv(1, 256)),
    ],
    "falcon-h1-0.5b": [_full(36, 2, 64), _mamba2(36, 1536, 1, 128, 24, 64)],
    "falcon-h1-tiny-random": [_full(2, 4, 32), _mamba2(2, 256, 2, 32, 8, 32)],
    "jamba-v0.1": [
        # Mamba-1: intermediate 2 x 4096; conv 3 rows of it, ssm x d_state 16
        Expected("mamba", None, _except(32, 8, 4), (3 * 8192 * 2, 8192 * 16 * 2)),
        Expected("full_attention", None, _every(32, 8, 4), _kv(8, 4096 // 32)),
    ],
    "jamba2-mini": [
        Expected("mamba", None, _except(32, 8, 4), (3 * 8192 * 2, 8192 * 16 * 2)),
        Expected("full_attention", None, _every(32, 8, 4), _kv(8, 4096 // 32)),
    ],
    "qwen3-next-tiny-test": [
        # Gated DeltaNet: conv_dim 2 x 128 x 8 + 128 x 16; ssm 16 heads x 128 x 128
        Expected("mamba", None, _except(10, 4, 3), (3 * 4096 * 2, 16 * 128 * 128 * 2)),
        Expected("full_attention", None, _every(10, 4, 3), _kv(2, 128)),
    ],
    "gpt-oss-tiny-random": [
        Expected("sliding_window", 64, (0,), _kv(2, 16)),
        Expected("full_attention", None, (1,), _kv(2, 16)),
    ],
    # State families (kvxfer/core/state_families.py), by vLLM's state shapes.
    # Falcon-Mamba tiny: Mamba-1, intermediate 256; conv 3 rows, ssm x state_size 8.
    "falcon-mamba-tiny-dev": [Expected("mamba", None, tuple(range(4)), (3 * 256 * 2, 256 * 8 * 2))],
    # Granite-4.0-H-1B: Mamba-2 (2 x 2048, 1 group, d_state 128, 64 heads x 64); attention
    # at 5, 15, 25, 35 with 8 KV heads of 2048 / 32.
    "granite-4.0-h-1b": [
        _mamba2(40, 4096, 1, 128, 64, 64)._replace(layers=_except(40, 10, 5)),
        Expected("full_attention", None, _every(40, 10, 5), _kv(8, 2048 // 32)),
    ],
    # LFM2-350M: conv state (conv_L_cache 3 - 1) rows x conv_dim 1024; attention with
    # 8 KV heads of 1024 / 16.
    "lfm2-350m": [
        Expected("mamba", None, (0, 1, 3, 4, 6, 7, 9, 11, 13, 15), (2 * 1024 * 2,)),
        Expected("full_attention", None, (2, 5, 8, 10, 12, 14), _kv(8, 1024 // 16)),
    ],
    # MiniMax tiny: lightning state 8 heads x 64 x 64 on layers 0-6, full attention on 7.
    "minimax-tiny-random": [
        Expected("mamba", None, tuple(range(7)), (8 * 64 * 64 * 2,)),
        Expected("full_attention", None, (7,), _kv(2, 64)),
    ],
    "minimax-m1-tiny-random": [
        Expected("mamba", None, tuple(range(7)), (8 * 64 * 64 * 2,)),
        Expected("full_attention", None, (7,), _kv(2, 64)),
    ],
    # Zamba2-2.7B: Mamba-2 in all 54 layers (2 x 2560, 1 group, d_state 64, 80 heads x 64);
    # the 9 hybrid layers also hold their own KV: 32 heads (MHA) of attention_head_dim 160.
    "zamba2-2.7b-instruct-v2": [
        _mamba2(54, 5120, 1, 64, 80, 64),
        Expected("full_attention", None, (6, 12, 18, 24, 30, 36, 42, 47, 51), _kv(32, 160)),
    ],
    # Llama 4: every layer has RoPE (no_rope_layers all 1), so every layer is chunked.
    "llama4-text-formomouse": [
        Expected("chunked_local", None, tuple(range(28)), _kv(8, 128), chunk=8192)
    ],
    # MLA: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements per token:
    # 16 x 576 x 2 = 18432 bytes per block, every num_hidden_layers layer, no V.
    "deepseek-v2-lite-chat": [Expected("mla", None, tuple(range(27)), (18432,))],
    # DeepSeek-V3's one MTP layer (num_nextn_predict_layers) is not in the main engine.
    "deepseek-v3-w8a8": [Expected("mla", None, tuple(range(61)), (18432,))],
}

# name -> (model_type, field named, words of the feature)
REFUSED: dict[str, tuple[str, str, str]] = {
    "zamba-7b-v1": ("zamba", "attn_layer_period", "no vLLM model"),
    # transformers reads layer_types (all full), vLLM no_rope_layers (all RoPE: chunked)
    "mobilellm-r1-950m": ("llama4_text", "layer_types", "disagreeing with no_rope_layers"),
    "kimi-linear-48b-a3b-instruct": ("kimi_linear", "linear_attn_config", "Kimi Delta"),
}

# Keys a stored page was cut before, restored by the test from the file itself:
# MobileLLM-R1's layer_types and no_rope_layers both list its 22 layers.
COMPLETED: dict[str, dict[str, int]] = {
    "mobilellm-r1-950m": {"num_hidden_layers": 22},
    # Zamba2-2.7B's page stops after n_mamba_heads: 54 = its layers_block_type's length,
    # 32 = its attention_hidden_size 5120 / attention_head_dim 160.
    "zamba2-2.7b-instruct-v2": {"num_hidden_layers": 54, "num_attention_heads": 32},
}

# Pages cut before a field the layout needs: refused by that field, never guessed.
CUT: dict[str, str] = {
    "falcon-mamba-7b-instruct-4bit": "state_size",
    "minimax-text-01": "torch_dtype",
    "granite-4.0-micro": "num_hidden_layers",
}


# State dtypes the files cannot give: one page was cut before its dtype, one test model
# is stored in float32 (which engines serve in a 16-bit dtype of their choosing).
STATE_DTYPE = {
    "falcon-h1-tiny-random": "bfloat16",
    "qwen3-next-tiny-test": "bfloat16",
    "falcon-mamba-tiny-dev": "bfloat16",  # float32
    "granite-4.0-h-1b": "bfloat16",  # float32
    "minimax-m1-tiny-random": "bfloat16",  # float32
    "zamba2-2.7b-instruct-v2": "bfloat16",  # cut before torch_dtype
}


def _path(name: str) -> str:
    return str(CONFIGS / f"{name}.json")


def _layout(name: str, **kw: Any) -> EngineLayout:
    """The stored config with the keys its page was cut before (COMPLETED)."""
    config = json.loads(Path(_path(name)).read_text()) | COMPLETED.get(name, {})
    return layout_from_config(config, name=name, **kw)


def test_every_stored_config_is_tested_and_sourced() -> None:
    stored = {p.stem for p in CONFIGS.glob("*.json")}
    assert stored == set(SUPPORTED) | set(REFUSED) | set(CUT)
    assert len(stored) >= 25
    sources = (CONFIGS / "SOURCES.md").read_text()
    missing = sorted(name for name in stored if f"`{name}.json`" not in sources)
    assert not missing, f"not in SOURCES.md: {missing}"


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_config_has_exact_groups_and_bytes(name: str) -> None:
    layout = _layout(name, block_size=16, kv_dtype="bfloat16", state_dtype=STATE_DTYPE.get(name))
    got = [
        Expected(
            g.kind.value,
            g.sliding_window,
            g.layers,
            tuple(t.bytes_per_block for t in g.tensors if t.layer == g.layers[0]),
            g.chunk_size,
        )
        for g in layout.groups
    ]
    assert got == SUPPORTED[name]
    for group in layout.groups:  # every layer of a group holds the same tensors
        sizes = {t.layer: [] for t in group.tensors}
        for t in group.tensors:
            sizes[t.layer].append(t.bytes_per_block)
        assert len({tuple(v) for v in sizes.values()}) == 1


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(SUPPORTED)), st.sampled_from((1, 16, 64, 256)), st.data())
def test_supported_config_plans_match_the_token_oracle(
    name: str, block_size: int, data: st.DataObject
) -> None:
    layout = _layout(name, block_size=block_size, state_dtype=STATE_DTYPE.get(name))
    num_tokens, computed = data.draw(requests(block_size))
    for plan in plan_blocks(layout, num_tokens, computed):
        expected = oracle_blocks(plan.group, num_tokens, computed, block_size)
        assert set(plan.blocks) == expected
        assert plan.nbytes == len(expected) * plan.group.bytes_per_block


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_config_names_the_feature_and_field(name: str) -> None:
    model_type, field, feature = REFUSED[name]
    with pytest.raises(UnsupportedModelError) as info:
        _layout(name)
    assert info.value.field == field
    pattern = (
        rf"model_type '{model_type}': .*{re.escape(feature)}.* is not supported \(field {field}\)"
    )
    assert re.fullmatch(pattern, info.value.detail), info.value.detail


def test_gemma2_long_prompt_moves_the_window_only_on_even_layers() -> None:
    """32k tokens on Gemma-2-9B: 21 full layers move all 2048 blocks, 21 sliding layers
    move the blocks under the last 4095 cached tokens (a window of 4096 at B = 16)."""
    layout = layout_for_model(_path("gemma-2-9b-it"), block_size=16)
    plans = {p.group.kind: p for p in plan_blocks(layout, 32768, 0)}
    assert len(plans[GroupKind.FULL_ATTENTION].blocks) == 2048
    assert list(plans[GroupKind.SLIDING_WINDOW].blocks) == list(range(1792, 2048))


def test_cli_refuses_a_real_config_in_one_line() -> None:
    cli = shutil.which("kvxfer-cli") or str(Path(sys.executable).parent / "kvxfer-cli")
    args = [cli, "plan", "--model", _path("zamba-7b-v1"), "--tokens", "1000"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "kvxfer-cli: error: attn_layer_period: model_type 'zamba': the Mamba/shared-attention "
        "hybrid (no vLLM model to size it against) is not supported (field attn_layer_period)"
    ]


@pytest.mark.parametrize(
    ("name", "field"), [("falcon-h1-tiny-random", "torch_dtype"), ("qwen3-next-tiny-test", "dtype")]
)
def test_state_without_a_known_dtype_is_refused_by_field(name: str, field: str) -> None:
    assert name in STATE_DTYPE
    with pytest.raises(ProfileError) as info:
        layout_for_model(_path(name))
    assert info.value.field == field
    assert "state_dtype" in info.value.detail


@pytest.mark.parametrize("name", sorted(CUT))
def test_a_page_cut_before_a_needed_field_is_refused_by_it(name: str) -> None:
    with pytest.raises(ProfileError) as info:
        layout_for_model(_path(name))
    assert info.value.field == CUT[name]


def test_a_cut_page_is_refused_by_the_missing_field() -> None:
    """MobileLLM-R1's stored page stops before num_hidden_layers: a field error, not a guess."""
    with pytest.raises(ProfileError) as info:
        layout_for_model(_path("mobilellm-r1-950m"))
    assert info.value.field == "num_hidden_layers"


def test_llama4_moves_only_the_last_chunk() -> None:
    """130000 tokens, chunks of 8192: the step at 130000 reads chunk 15, tokens
    [122880, 130000) = blocks 7680..8124 of 16; at 131072 (a chunk start) nothing."""
    layout = layout_for_model(_path("llama4-text-formomouse"), block_size=16)
    (plan,) = plan_blocks(layout, 130000, 0)
    assert plan.blocks == range(7680, 8125)
    assert plan.nbytes == 445 * 28 * 2 * 32 * 8 * 128
    assert set(plan.blocks) == oracle_blocks(plan.group, 130000, 0, 16)
    (plan,) = plan_blocks(layout, 131072, 0)
    assert not plan.blocks
    (plan,) = plan_blocks(layout, 130000, 128000)  # C inside the last chunk
    assert plan.blocks == range(8000, 8125)


# Kimi-K2's published MLA values (moonshotai/Kimi-K2-Instruct; no verbatim file stored).
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("tp_size", [1, 2, 8])
def test_mla_latent_is_whole_on_every_tp_rank(tp_size: int) -> None:
    """Kimi-K2 at fp8, B = 64: 64 x 576 x 1 = 36864 bytes per layer per block, the
    same at every TP size (the latent is replicated, not split by heads)."""
    layout = layout_from_config(
        KIMI_K2, name="kimi-k2", kv_dtype="float8_e4m3fn", block_size=64, tp_size=tp_size
    )
    (group,) = layout.groups
    assert group.kind is GroupKind.MLA
    assert group.layers == tuple(range(61))
    assert [t.name for t in group.tensors[:2]] == ["layer.0.latent", "layer.1.latent"]
    assert {t.bytes_per_block for t in group.tensors} == {36864}


def test_mla_long_prompt_moves_every_cached_block() -> None:
    """DeepSeek-V3, 100000 tokens with 32768 computed: blocks 2048..6249 of 16 on all
    61 layers, 4202 x 61 x 18432 bytes; the oracle agrees block by block."""
    layout = layout_for_model(_path("deepseek-v3-w8a8"), block_size=16)
    (plan,) = plan_blocks(layout, 100000, 32768)
    assert plan.blocks == range(2048, 6250)
    assert plan.nbytes == 4202 * 61 * 18432
    assert set(plan.blocks) == oracle_blocks(plan.group, 100000, 32768, 16)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kv_lora_rank": None}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ],
)
def test_mla_geometry_errors_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises((ProfileError, UnsupportedModelError)) as info:
        layout_from_config(KIMI_K2 | change, name="kimi-k2")
    assert info.value.field == field


def test_deepseek_v32_sparse_attention_stays_refused_by_name() -> None:
    config = KIMI_K2 | {"model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 128}
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_config(config, name="v32")
    assert info.value.field == "index_topk"
    assert "indexer key cache" in info.value.detail
