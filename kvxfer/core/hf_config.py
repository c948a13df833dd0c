"""Recognising a HuggingFace config: which family reads it, or why none may.

The rule (issue 12): a config kvxfer does not fully understand is refused,
naming what is not supported; a layout it does produce is exact. So the
reader is chosen by `model_type` (or the architecture name), never guessed
from whichever keys happen to be present, and every key known to change
attention or state semantics must be read by the chosen family or the config
is refused with `model_type X: <feature> is not supported (field Y)`.

A config of a `model_type` with no reader here is refused too: many look
like plain attention and are not (per-layer `block_configs`, recurrent
blocks under names of their own). The supported and refused families are
listed in docs/models.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvxfer._exceptions import ProfileError, UnsupportedModelError

Config = Mapping[str, Any]

# Layer kinds of `layer_types` and the families whose reader models them.
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
CHUNKED = "chunked_attention"


@dataclass(frozen=True)
class Family:
    """How one group of model types is read.

    `reads` are the semantics-changing keys (or key prefixes ending in "_")
    that this family's reader models; `layer_kinds` the `layer_types` values
    it understands; `sliding` how a model-wide `sliding_window` applies:
    "all" (every layer slides), "opt-in" (only with `use_sliding_window`,
    which is then refused), "layers" (only through per-layer kinds).
    """

    name: str
    reader: str
    reads: frozenset[str] = frozenset()
    layer_kinds: frozenset[str] = frozenset({FULL, SLIDING})
    sliding: str = "layers"
    model_types: tuple[str, ...] = field(default=())
    ssm_dtype_default: str | None = None  # ssm state dtype when the config declares none


_ATTENTION = "attention"

# Declared state dtypes: read by the families with state layers (profiles._StateDtypes).
STATE_DTYPE_KEYS = ("mamba_ssm_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype")

# Families whose layers hold recurrent state (Mamba-1/2, lightning attention, short
# convolution) beside or instead of attention; read by kvxfer.core.state_families.
STATE_FAMILIES: tuple[Family, ...] = (
    Family(
        "Mamba-1 (every layer a Mamba-1 state)",
        "mamba1",
        reads=frozenset({"state_size", "conv_kernel", "time_step_rank"}),
        model_types=("mamba", "falcon_mamba"),
    ),
    Family(
        "Mamba-2 (every layer a Mamba-2 state)",
        "mamba2",
        reads=frozenset({"state_size", "conv_kernel", "time_step_rank"}),
        model_types=("mamba2",),
    ),
    Family(
        "Nemotron-H (hybrid_override_pattern: M Mamba-2, * attention, - and E no cache)",
        "nemotron_h",
        reads=frozenset(
            {
                "hybrid_override_pattern",
                "layers_block_type",
                "attention_head_dim",
                "conv_kernel",
                "mamba_",
                "ssm_",
            }
        ),
        layer_kinds=frozenset({FULL, LINEAR, "mlp", "moe", "mamba", "attention"}),
        model_types=("nemotron_h",),
        ssm_dtype_default="float32",
    ),
    Family(
        "Granite-4.0-H (layer_types: Mamba-2 or attention)",
        "granite_hybrid",
        reads=frozenset({"mamba_"}),
        layer_kinds=frozenset({FULL, LINEAR, "mamba", "attention"}),
        model_types=("granitemoehybrid",),
    ),
    Family(
        "Bamba (attention at attn_layer_indices, Mamba-2 elsewhere)",
        "bamba",
        reads=frozenset({"attn_layer_indices", "mamba_"}),
        model_types=("bamba",),
    ),
    Family(
        "Zamba2 (Mamba-2 in every layer; hybrid layers add a shared attention block "
        "with a KV cache of their own)",
        "zamba2",
        reads=frozenset(
            {"layers_block_type", "attention_head_dim", "kv_channels", "num_query_groups", "mamba_"}
        ),
        model_types=("zamba2",),
    ),
    Family(
        "MiniMax-Text-01 / M1 (lightning linear attention state, or full attention)",
        "minimax",
        reads=frozenset({"attn_type_list", "linear_attn_"}),
        layer_kinds=frozenset({FULL, LINEAR}),
        model_types=("minimax_text_01", "minimax_m1", "minimax"),
    ),
    Family(
        "LFM2 (layer_types: short convolution state or full attention)",
        "lfm2",
        reads=frozenset({"conv_"}),
        layer_kinds=frozenset({FULL, "conv"}),
        model_types=("lfm2", "lfm2_moe"),
    ),
)

SUPPORTED: tuple[Family, ...] = (
    Family("Llama", _ATTENTION, model_types=("llama",)),
    Family("Mistral, Mixtral", _ATTENTION, sliding="all", model_types=("mistral", "mixtral")),
    Family(
        "Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE",
        _ATTENTION,
        sliding="opt-in",
        model_types=("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
    ),
    Family("Gemma (1)", _ATTENTION, model_types=("gemma",)),
    Family(
        "Gemma-2 (even layers slide unless layer_types says otherwise)",
        "gemma2",
        reads=frozenset({"sliding_window_size"}),
        model_types=("gemma2",),
    ),
    Family(
        "Gemma-3 (layer_types, or sliding_window_pattern)",
        "gemma3",
        reads=frozenset({"sliding_window_pattern", "_sliding_window_pattern"}),
        model_types=("gemma3", "gemma3_text"),
    ),
    Family("GPT-OSS", _ATTENTION, model_types=("gpt_oss",)),
    Family(
        "Qwen3-Next, Qwen3.5 (Gated DeltaNet linear attention + full attention; "
        "Qwen3.5's declared mamba_ssm_dtype)",
        "qwen3_next",
        reads=frozenset({"full_attention_interval", "linear_", *STATE_DTYPE_KEYS}),
        layer_kinds=frozenset({FULL, LINEAR}),
        model_types=(
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_5_text",
            "qwen3_5_moe_text",
        ),
    ),
    Family(
        "Gemma-3n (layer_types; the last num_kv_shared_layers layers reuse earlier KV)",
        "gemma3n",
        reads=frozenset({"num_kv_shared_layers"}),
        model_types=("gemma3n", "gemma3n_text"),
    ),
    Family(
        "MiMo-V2 (hybrid_layer_pattern; sliding and full layers with their own KV heads "
        "and K / V head dims)",
        "mimo_v2",
        reads=frozenset({"hybrid_layer_pattern", "sliding_window_size", "swa_", "v_head_dim"}),
        model_types=("mimo_v2_flash", "mimo_v2"),
    ),
    Family(
        "Llama 4 (chunked local attention on RoPE layers, NoPE layers global)",
        "llama4",
        reads=frozenset({"attention_chunk_size", "no_rope_layers", "no_rope_layer_interval"}),
        layer_kinds=frozenset({FULL, CHUNKED}),
        model_types=("llama4", "llama4_text"),
    ),
    Family(
        "DeepSeek-V2, DeepSeek-V3, Kimi-K2 (multi-head latent attention on every layer)",
        "mla",
        reads=frozenset(
            {"kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"}
            | {"num_nextn_predict_layers"}
        ),
        layer_kinds=frozenset({FULL}),
        model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"),
    ),
    Family(
        "Jamba (Mamba-1 + attention)",
        "jamba",
        reads=frozenset({"attn_layer_period", "attn_layer_offset", "mamba_"}),
        model_types=("jamba",),
    ),
    Family(
        "Falcon-H1 (Mamba-2 beside attention in every layer)",
        "falcon_h1",
        reads=frozenset({"attn_layer_indices", "mamba_", "ssm_"}),
        model_types=("falcon_h1",),
    ),
    *STATE_FAMILIES,
)

# Model types known to need a group kind kvxfer does not have yet: the
# feature, and the fields that define it (the first one present is named).
REFUSED: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "zamba": (
        "the Mamba/shared-attention hybrid (no vLLM model to size it against)",
        ("layers_block_type", "attn_layer_period"),
    ),
    "kimi_linear": (
        "Kimi Delta Attention (linear) beside MLA",
        ("linear_attn_config", "kv_lora_rank"),
    ),
    "deepseek_v32": (
        "DeepSeek sparse attention (an indexer key cache beside the MLA latent)",
        ("index_topk", "index_head_dim"),
    ),
}

# Keys known to change what a layer caches or reads. Keys ending in "_" are
# prefixes. Checked in this order, so the most telling one is named first.
SEMANTIC_KEYS: Mapping[str, str] = {
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "hybrid_override_pattern": "a hybrid Mamba/attention layer pattern",
    "layers_block_type": "a per-layer block type list",
    "attn_type_list": "a per-layer linear/full attention list",
    "hybrid_layer_pattern": "a hybrid sliding/full attention pattern",
    "compress_ratios": "compressed-KV attention",
    "attention_chunk_size": "chunked local attention",
    "num_kv_shared_layers": "KV sharing across layers",
    "global_head_dim": "per-layer head geometry",
    "num_global_key_value_heads": "per-layer head geometry",
    "attention_k_eq_v": "keys reused as values",
    "v_head_dim": "a value head dim apart from the key head dim",
    "attention_head_dim": "a separate attention head dim",
    "kv_channels": "a KV head dim under another name",
    "multi_query": "multi-query attention under another name",
    "num_kv_heads": "a KV head count under another name",
    "n_head_kv": "a KV head count under another name",
    "multi_query_group_num": "a KV head count under another name",
    "num_query_groups": "a KV head count under another name",
    "new_decoder_architecture": "Falcon's grouped KV layout",
    "cross_attention_layers": "cross-attention",
    "attention_types": "local/global attention",
    "attention_layers": "local/global attention",
    "interleaved_sliding_window": "an interleaved sliding window",
    "sliding_window_pattern": "a sliding window pattern",
    "sliding_window_size": "a separate sliding window size",
    "full_attention_interval": "a linear/full attention interval",
    "attn_layer_period": "a hybrid attention layer period",
    "attn_layer_offset": "a hybrid attention layer offset",
    "attn_layer_indices": "hybrid attention layer indices",
    "mamba_ssm_dtype": "a declared state dtype",
    "mamba_cache_dtype": "a declared state dtype",
    "mamba_ssm_cache_dtype": "a declared state dtype",
    "state_size": "a state-space layer",
    "ssm_cfg": "a state-space layer",
    "conv_kernel": "a convolution state",
    "time_step_rank": "a state-space layer",
    "swa_": "per-kind sliding-window geometry",
    "mamba_": "a Mamba layer",
    "ssm_": "a state-space layer",
    "linear_": "linear attention",
    "conv_": "a convolution state",
}

_BY_TYPE: Mapping[str, Family] = {t: f for f in SUPPORTED for t in f.model_types}

# What an unknown model type is checked as before it is refused: a family that reads
# nothing, so a key that names a feature is reported before the unknown type itself.
_UNKNOWN = Family("a model_type without a reader", "none")

# Architecture names for configs that carry no model_type.
_ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3nForCausalLM": "gemma3n_text",
    "Gemma3nForConditionalGeneration": "gemma3n",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
    "JambaForCausalLM": "jamba",
    "FalconH1ForCausalLM": "falcon_h1",
    "MambaForCausalLM": "mamba",
    "Mamba2ForCausalLM": "mamba2",
    "FalconMambaForCausalLM": "falcon_mamba",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "BambaForCausalLM": "bamba",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "MiniMaxM1ForCausalLM": "minimax_m1",
    "MiniMaxForCausalLM": "minimax",
    "Zamba2ForCausalLM": "zamba2",
    "MiniMaxText01ForCausalLM": "minimax_text_01",
    "Llama4ForCausalLM": "llama4_text",
    "MiMoV2FlashForCausalLM": "mimo_v2_flash",
    "Llama4ForConditionalGeneration": "llama4",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def model_type_of(config: Config, text: Config) -> str | None:
    """The text model's type: text_config's own, else the outer one, else by architecture."""
    for source in (text, config):
        value = source.get("model_type")
        if value is None or value == "":  # "" is transformers' default for none
            continue
        if not isinstance(value, str):
            # Not a type kvxfer could read: an architecture must not stand in for it.
            where = "model_type" if source is config else "text_config.model_type"
            raise ProfileError(where, f"must be a string, got {value!r}")
        return value
    architectures = config.get("architectures")
    if isinstance(architectures, list):
        for name in architectures:
            if isinstance(name, str) and name in _ARCHITECTURES:
                return _ARCHITECTURES[name]
    return None


def refusal(model_type: str | None, feature: str, field_name: str) -> UnsupportedModelError:
    """The one message shape every refusal has."""
    who = f"model_type {model_type!r}" if model_type else "a config without model_type"
    return UnsupportedModelError(
        field_name, f"{who}: {feature} is not supported (field {field_name})"
    )


def recognise(config: Config, text: Config) -> tuple[str | None, Family]:
    """The family that reads this config, or UnsupportedModelError naming why none may."""
    model_type = model_type_of(config, text)
    if model_type is not None and model_type in REFUSED:
        feature, fields = REFUSED[model_type]
        present = [f for f in fields if _is_set(text.get(f))]
        raise refusal(model_type, feature, present[0] if present else "model_type")
    family = _BY_TYPE.get(model_type or "")
    checked = family or _UNKNOWN
    _check_semantic_keys(model_type, checked, text)  # the most telling refusal first
    _check_sliding(model_type, checked, text)
    _check_layer_kinds(model_type, checked, text)
    if family is None:  # fail closed: a family nobody wrote a reader for is never guessed
        raise refusal(
            model_type, "a model family kvxfer has no reader for (see docs/models.md)", "model_type"
        )
    return model_type, family


def _is_set(value: Any) -> bool:
    """A key whose value changes nothing (null, false, 0, empty) is as good as absent."""
    if value is None or value is False or value == 0:
        return False
    return value not in ("", [], {})


def _reads(family: Family, key: str) -> bool:
    return key in family.reads or any(p.endswith("_") and key.startswith(p) for p in family.reads)


def _check_semantic_keys(model_type: str | None, family: Family, text: Config) -> None:
    present = [k for k in text if _is_set(text[k])]
    for key, feature in SEMANTIC_KEYS.items():
        if key.endswith("_"):
            hits = sorted(k for k in present if k.startswith(key) and not _reads(family, k))
        else:
            hits = [key] if key in present and not _reads(family, key) else []
        hits = [k for k in hits if not _neutral(k, text)]
        if hits:
            raise refusal(model_type, feature, hits[0])


def _neutral(key: str, text: Config) -> bool:
    """A key set to a value that changes nothing kvxfer reads."""
    if key == "v_head_dim":
        return text.get("head_dim") is not None and text.get("v_head_dim") == text.get("head_dim")
    return False


def _check_sliding(model_type: str | None, family: Family, text: Config) -> None:
    if _is_set(text.get("use_sliding_window")) and family.sliding == "opt-in":
        raise refusal(
            model_type,
            "a sliding window on the layers from max_window_layers on",
            "use_sliding_window",
        )
    window = text.get("sliding_window")
    if not _is_set(window) or family.sliding != "layers":
        return
    if family.reader in ("gemma2", "gemma3", "gemma3n", "mimo_v2") or "layer_types" in text:
        return
    raise refusal(
        model_type, "a model-wide sliding_window without per-layer layer_types", "sliding_window"
    )


def _check_layer_kinds(model_type: str | None, family: Family, text: Config) -> None:
    layer_types = text.get("layer_types")
    if not isinstance(layer_types, list):
        return
    for index, kind in enumerate(layer_types):
        if not isinstance(kind, str) or kind not in family.layer_kinds:
            raise refusal(model_type, f"layer type {kind!r}", f"layer_types[{index}]")
