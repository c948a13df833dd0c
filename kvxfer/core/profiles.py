"""Model profiles: a HuggingFace `config.json` becomes an EngineLayout.

`hf_config.recognise` first picks the family that reads the config, or
refuses it naming the feature and field kvxfer does not model (see
docs/models.md). The family's reader then classifies each layer (see
shared/models/README.md): `layer_types` where given; Gemma-2's implicit
alternation; Gemma-3's `sliding_window_pattern`; Qwen3-Next's
`full_attention_interval`; Jamba's attention period/offset; Falcon-H1's
parallel attention + Mamba-2 layers; Mistral's model-wide `sliding_window`;
plain full attention otherwise.

One KV group is made per distinct (kind, window), numbered in order of the
first layer that uses it. Mamba / linear-attention state is sized from the
config in its own dtypes (`_StateDtypes`), one state block per request.

Built-in profiles are the JSON files shipped in `kvxfer/profiles/`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvxfer._exceptions import ProfileError, UnsupportedModelError
from kvxfer.core.hf_config import CHUNKED, FULL, LINEAR, SLIDING, Family, recognise, refusal
from kvxfer.core.layout import (
    MAX_LAYERS,
    EngineLayout,
    GroupId,
    GroupKind,
    KVGroup,
    StateShard,
    TensorSpec,
    dtype_bytes,
)
from kvxfer.core.state_shards import check_conv_layout

Config = Mapping[str, Any]


@dataclass(frozen=True)
class _LayerTensors:
    """What one layer contributes to one group kind: (name suffix, bytes per block)."""

    kind: GroupKind
    window: int | None
    tensors: tuple[tuple[str, int], ...]
    chunk: int | None = None
    kv_heads: int | None = None  # the model's KV heads, for a split by head
    shards: tuple[StateShard | None, ...] = ()  # per tensor, a state's cut over TP


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with kvxfer (usable as `--model NAME`)."""
    files = resources.files("kvxfer.profiles").iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """Read a built-in profile by name, or a config.json by path; return (name, config)."""
    if model in builtin_profiles():
        text = resources.files("kvxfer.profiles").joinpath(f"{model}.json").read_text()
        return model, _parse_json(text, model)
    path = Path(model)
    if not path.is_file():
        known = ", ".join(builtin_profiles())
        raise ProfileError("model", f"{model!r} is neither a built-in profile ({known}) nor a file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError("model", f"cannot read {model!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(
            "model", f"{model!r} is not UTF-8 text (byte {exc.start}): not a config.json"
        ) from exc
    return path.stem if path.name != "config.json" else path.parent.name or "model", _parse_json(
        text, model
    )


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(
            "model", f"{source!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from exc
    except RecursionError as exc:  # a config.json is a few levels deep
        raise ProfileError("model", f"{source!r} nests too deeply to be a model config") from exc
    if not isinstance(config, dict):
        raise ProfileError("model", f"{source!r} must hold a JSON object")
    return config


def layout_for_model(
    model: str,
    *,
    kv_dtype: str = "bfloat16",
    block_size: int = 16,
    tp_size: int = 1,
    tp_rank: int = 0,
    state_dtype: str | None = None,
    conv_state_layout: str = "SD",
) -> EngineLayout:
    """Layout of a built-in profile name or a config.json path."""
    name, config = load_config(model)
    return layout_from_config(
        config,
        name=name,
        kv_dtype=kv_dtype,
        block_size=block_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        state_dtype=state_dtype,
        conv_state_layout=conv_state_layout,
    )


def layout_from_config(
    config: Config,
    *,
    name: str,
    kv_dtype: str = "bfloat16",
    block_size: int = 16,
    tp_size: int = 1,
    tp_rank: int = 0,
    state_dtype: str | None = None,
    conv_state_layout: str = "SD",
) -> EngineLayout:
    """Layout of one engine rank. Mamba / linear-attention state is sized in its own
    dtypes (`_StateDtypes`), never in `kv_dtype`; `state_dtype` overrides both. A conv
    state is stored as `conv_state_layout` says (vLLM's VLLM_SSM_CONV_STATE_LAYOUT: "SD",
    its default, or "DS"), which only changes how it is cut over TP ranks."""
    text = config.get("text_config", config)
    if not isinstance(text, Mapping):
        raise ProfileError("text_config", "must be a JSON object")
    model_type, family = recognise(config, text)
    elem = dtype_bytes(kv_dtype)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ProfileError("block_size", f"must be a positive integer, got {block_size!r}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ProfileError("tp_size", f"must be a positive integer, got {tp_size!r}")
    state = _StateDtypes(config, text, state_dtype, family.ssm_dtype_default)
    sizing = _Sizing(text, elem, block_size, tp_size, state.element_bytes, model_type)
    sizing.conv_layout = check_conv_layout(conv_state_layout)
    groups = _groups(family, sizing)
    return EngineLayout(
        model=name,
        fingerprint=fingerprint(text),
        kv_dtype=kv_dtype,
        block_size=block_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        groups=groups,
    )


def _groups(family: Family, sizing: _Sizing) -> tuple[KVGroup, ...]:
    return _group_layers([_layer_tensors(family, sizing, i) for i in range(sizing.num_layers)])


# Keys that never change what a layer caches: metadata, training-only settings, the
# context limit and the checkpoint dtype (the KV dtype is negotiated as its own field).
_NOT_KV_KEYS = frozenset(
    {
        "transformers_version", "_name_or_path", "name_or_path", "architectures",
        "auto_map", "torch_dtype", "dtype", "use_cache", "max_position_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
        "attention_dropout", "hidden_dropout", "output_router_logits",
        "router_aux_loss_coef", "return_dict", "output_hidden_states", "output_attentions",
    }
)  # fmt: skip


def fingerprint(text: Config) -> str:
    """Hash of the architecture: the text config without the keys known not to change
    what a layer caches (`_NOT_KV_KEYS`). Everything else counts, unknown keys included
    (fail closed): hidden size, MLP width, vocabulary and rotary settings all change
    the K and V a layer computes, so Qwen3-4B and Qwen3-8B, whose caches have the same
    shape, stay apart. Two fine-tunes of one architecture cannot be told apart by
    their configs: pairing engines that run the same weights stays the operator's job."""
    facts = {k: v for k, v in text.items() if k not in _NOT_KV_KEYS}
    canonical_json = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical_json.encode()).hexdigest()[:16]


class _Sizing:
    """Reads sizes out of a text config, validating each field it touches."""

    def __init__(
        self,
        text: Config,
        elem: int,
        block_size: int,
        tp_size: int,
        state_bytes: Callable[[], tuple[int, int]],
        model_type: str | None = None,
    ) -> None:
        self.text = text
        self.model_type = model_type
        self.elem = elem
        self.state_bytes = state_bytes  # (conv, ssm) element bytes, read on first use
        self.block_size = block_size
        self.tp = tp_size
        self.conv_layout = "SD"  # how a conv state is stored (state_shards.conv_cut)
        self.num_layers = self.positive("num_hidden_layers")
        if self.num_layers > MAX_LAYERS:
            raise ProfileError(
                "num_hidden_layers", f"{self.num_layers} exceeds the limit of {MAX_LAYERS}"
            )

    def positive(self, key: str) -> int:
        value = self.text.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(key, f"must be a positive integer, got {value!r}")
        return value

    def per_layer(self, key: str, value: Any, items: str = "strings") -> list[Any]:
        """`value` (read from `key`) as a list with one entry per layer."""
        if not isinstance(value, list) or len(value) != self.num_layers:
            raise ProfileError(
                key, f"must be a list of num_hidden_layers ({self.num_layers}) {items}"
            )
        return value

    def flag(self, key: str, value: Any, index: int) -> int:
        """Entry `index` of the per-layer 0/1 list `value` (read from `key`)."""
        entry = self.per_layer(key, value, "0/1")[index]
        if entry not in (0, 1) or isinstance(entry, bool):
            raise ProfileError(f"{key}[{index}]", f"must be 0 or 1, got {entry!r}")
        return int(entry)

    def split(self, key: str, value: int) -> int:
        """value / tp for a tensor-parallel-sharded dimension; must divide exactly."""
        if value % self.tp:
            raise ProfileError(key, f"{value} does not divide by tp_size {self.tp}")
        return value // self.tp

    def attention_bytes(self) -> tuple[int, int]:
        """Bytes of K (or V) of one layer for one block of block_size tokens, per TP rank,
        and the model's KV heads."""
        heads = self.positive("num_attention_heads")
        kv_heads = self.text.get("num_key_value_heads")
        if kv_heads is None:  # HF: no KV head count means one per query head
            kv_heads = heads
        if self.text.get("head_dim") is None:  # HF: hidden_size / heads, floored
            head_dim = self.positive("hidden_size") // heads
        else:
            head_dim = self.positive("head_dim")
        size = self.head_bytes("num_key_value_heads", kv_heads, head_dim)
        self.query_groups("num_key_value_heads", kv_heads, heads)
        return size, int(kv_heads)

    @staticmethod
    def query_groups(key: str, kv_heads: object, heads: int) -> None:
        """`kv_heads` (read from `key`; `head_bytes` checked it first) must share the
        `heads` query heads out evenly: grouped-query attention gives each KV head the
        same number of query heads."""
        assert isinstance(kv_heads, int), "checked by head_bytes"
        if heads % kv_heads:
            raise ProfileError(
                key, f"{kv_heads} KV heads do not divide num_attention_heads ({heads})"
            )

    def head_bytes(self, key: str, kv_heads: object, head_dim: int) -> int:
        """Bytes of one block of `kv_heads` (read from `key`) heads of `head_dim`, per TP
        rank: split across ranks when they divide, else replicated (one per rank)."""
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
            raise ProfileError(key, f"must be a positive integer, got {kv_heads!r}")
        if kv_heads % self.tp == 0:
            per_rank = kv_heads // self.tp
        elif self.tp % kv_heads == 0:
            per_rank = 1  # KV heads are replicated across ranks
        else:
            raise ProfileError(key, f"{kv_heads} heads cannot be placed on tp_size {self.tp}")
        return self.block_size * per_rank * head_dim * self.elem


def _attention(
    kind: GroupKind, window: int | None, sizing: _Sizing, chunk: int | None = None
) -> _LayerTensors:
    size, kv_heads = sizing.attention_bytes()
    return _LayerTensors(kind, window, (("k", size), ("v", size)), chunk, kv_heads)


class _StateDtypes:
    """The dtypes of conv and ssm state, by vLLM's rule: conv in `mamba_cache_dtype`, else
    the model dtype; ssm in `mamba_ssm_cache_dtype` (Qwen3.5 spells it `mamba_ssm_dtype`),
    else the family's default (Nemotron-H: float32), else as conv. The model dtype is the
    config's `torch_dtype` / `dtype`. An override (`state_dtype`) sets both, for engines
    run with other cache dtypes."""

    _SSM_KEYS = ("mamba_ssm_cache_dtype", "mamba_ssm_dtype")

    def __init__(
        self, config: Config, text: Config, override: str | None, ssm_default: str | None = None
    ) -> None:
        self.config = config
        self.text = text
        # Checked now, not when a state layer asks for it: a model without state layers
        # would otherwise take any name.
        if override is not None:
            dtype_bytes(override, "state_dtype")
        self.override = override
        self.ssm_default = ssm_default

    def element_bytes(self) -> tuple[int, int]:
        if self.override is not None:
            size = dtype_bytes(self.override, "state_dtype")
            return size, size
        declared = self._declared(("mamba_cache_dtype",))
        conv = dtype_bytes(*declared) if declared else self._model_dtype_bytes()
        declared = self._declared(self._SSM_KEYS)
        if declared:
            return conv, dtype_bytes(*declared)
        return conv, dtype_bytes(self.ssm_default) if self.ssm_default else conv

    def _declared(self, keys: tuple[str, ...]) -> tuple[str, str] | None:
        """(value, key) of the first state dtype the config declares ("auto" is none)."""
        for key in keys:
            value = self.text.get(key)
            if value is not None and value != "auto":
                if not isinstance(value, str):
                    raise ProfileError(key, f"must be a dtype name, got {value!r}")
                return value, key
        return None

    def _model_dtype_bytes(self) -> int:
        for source in (self.text, self.config):
            for key in ("torch_dtype", "dtype"):
                value = source.get(key)
                if value is None:
                    continue
                if value == "float32":
                    raise ProfileError(
                        key,
                        "float32 checkpoints are served in a 16-bit dtype the engine picks; "
                        "give the state dtype explicitly (state_dtype; kvxfer-cli --state-dtype)",
                    )
                if not isinstance(value, str):
                    raise ProfileError(key, f"must be a dtype name, got {value!r}")
                return dtype_bytes(value, key)
        raise ProfileError(
            "torch_dtype",
            "state layers are kept in the model dtype and the config declares none "
            "(torch_dtype or dtype); give the state dtype explicitly "
            "(state_dtype; kvxfer-cli --state-dtype)",
        )


def _window(sizing: _Sizing) -> int:
    return sizing.positive("sliding_window")


def _layer_tensors(family: Family, sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """The group kinds layer `index` takes part in, with its tensors for each."""
    text = sizing.text
    layer_types = text.get("layer_types")
    from kvxfer.core.state_families import (  # noqa: PLC0415 (it imports this module)
        READERS,
        falcon_h1,
        jamba,
    )

    state_reader = READERS.get(family.reader)
    if state_reader is not None:
        return state_reader(sizing, index)
    if family.reader == "falcon_h1":
        return falcon_h1(text, sizing, index)
    if family.reader == "llama4":
        return [_llama4(text, sizing, index)]
    if family.reader == "gemma3n":
        return _gemma3n(sizing, index)
    if family.reader == "mimo_v2":
        return [_mimo_v2(sizing, index)]
    if family.reader == "mla":
        return [_mla(sizing)]
    if layer_types is not None:
        return [_from_layer_type(layer_types, sizing, index)]
    if family.reader == "jamba":
        return [jamba(text, sizing, index)]
    if family.reader == "qwen3_next":
        interval = sizing.positive("full_attention_interval")
        kind = FULL if (index + 1) % interval == 0 else LINEAR
        return [_from_layer_type([kind] * sizing.num_layers, sizing, index)]
    if family.reader == "gemma2":
        return [_gemma2(text, sizing, index)]
    if family.reader == "gemma3" and text.get("sliding_window") is not None:
        full = (index + 1) % _pattern(sizing) == 0
        if full:
            return [_attention(GroupKind.FULL_ATTENTION, None, sizing)]
        return [_attention(GroupKind.SLIDING_WINDOW, _window(sizing), sizing)]
    if family.sliding == "all" and text.get("sliding_window") is not None:
        return [_attention(GroupKind.SLIDING_WINDOW, _window(sizing), sizing)]
    return [_attention(GroupKind.FULL_ATTENTION, None, sizing)]


def _llama4(text: Config, sizing: _Sizing, index: int) -> _LayerTensors:
    """Llama 4, by vLLM's rule: a layer with RoPE (`no_rope_layers[i]` 1) attends within
    chunks of `attention_chunk_size` tokens, a NoPE layer (0) to everything. An empty or
    absent `no_rope_layers` means NoPE on every `no_rope_layer_interval`-th layer (4). A
    `layer_types` list (which transformers reads instead) must say the same."""
    chunk = text.get("attention_chunk_size")
    rope = text.get("no_rope_layers") or [
        int((i + 1) % _interval(sizing) != 0) for i in range(sizing.num_layers)
    ]
    chunked = chunk is not None and sizing.flag("no_rope_layers", rope, index) == 1
    layer_types = text.get("layer_types")
    if layer_types is not None:
        said = sizing.per_layer("layer_types", layer_types)[index]
        if said != (CHUNKED if chunked else FULL):
            runs = "chunked" if chunked else "full"
            raise refusal(
                sizing.model_type,
                f"layer_types disagreeing with no_rope_layers / attention_chunk_size "
                f"(layer {index}: {said!r}, which vLLM runs as {runs} attention)",
                "layer_types",
            )
    if not chunked:
        return _attention(GroupKind.FULL_ATTENTION, None, sizing)
    return _attention(
        GroupKind.CHUNKED_LOCAL, None, sizing, sizing.positive("attention_chunk_size")
    )


def _gemma3n(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Gemma-3n: layer_types (default: every 5th layer full, the rest sliding), and the
    last `num_kv_shared_layers` layers cache nothing: each reads the KV of an earlier
    layer of its own type, so it has no region and nothing moves for it. transformers
    takes the last earlier layer of that type, vLLM layer first-2 (sliding) or first-1
    (full); a config where the two differ is refused."""
    layer_types = sizing.text.get("layer_types") or [
        FULL if (i + 1) % 5 == 0 else SLIDING for i in range(sizing.num_layers)
    ]
    shared = sizing.text.get("num_kv_shared_layers", 0)
    if (
        isinstance(shared, bool)
        or not isinstance(shared, int)
        or not 0 <= shared < sizing.num_layers
    ):
        raise ProfileError(
            "num_kv_shared_layers",
            f"must be an integer in [0, num_hidden_layers={sizing.num_layers}), got {shared!r}",
        )
    first = sizing.num_layers - shared
    if index < first:
        return [_from_layer_type(layer_types, sizing, index)]
    kind = layer_types[index]
    earlier = [j for j in range(first) if layer_types[j] == kind]
    engine = first - 2 if kind == SLIDING else first - 1
    if not earlier or earlier[-1] != engine:
        raise refusal(
            sizing.model_type,
            f"KV sharing where layer {index} ({kind}) has no earlier layer of its type "
            f"at layer {engine}, the one vLLM reads",
            "num_kv_shared_layers",
        )
    return []


def _mimo_v2(sizing: _Sizing, index: int) -> _LayerTensors:
    """MiMo-V2, by vLLM's rule: `hybrid_layer_pattern[i]` 1 is a sliding layer (window
    `sliding_window_size`) with its own `swa_num_key_value_heads`, `swa_head_dim` and
    `swa_v_head_dim`; 0 a full layer with `num_key_value_heads`, `head_dim`, `v_head_dim`.
    A V head dim left out is the K head dim. K and V differ in size per block."""
    text = sizing.text
    pattern = text.get("hybrid_layer_pattern")
    if pattern is None:
        raise refusal(
            sizing.model_type,
            "MiMo-V2 without hybrid_layer_pattern (the per-layer list vLLM reads)",
            "hybrid_layer_pattern",
        )
    sliding = sizing.flag("hybrid_layer_pattern", pattern, index)
    _check_agrees(sizing, index, SLIDING if sliding else FULL)
    prefix = "swa_" if sliding else ""
    k_dim = sizing.positive(f"{prefix}head_dim")
    v_dim = sizing.positive(f"{prefix}v_head_dim") if text.get(f"{prefix}v_head_dim") else k_dim
    heads_key = f"{prefix}num_key_value_heads"
    k = sizing.head_bytes(heads_key, text.get(heads_key), k_dim)
    v = sizing.head_bytes(heads_key, text.get(heads_key), v_dim)
    if not sliding:
        return _LayerTensors(GroupKind.FULL_ATTENTION, None, (("k", k), ("v", v)))
    return _LayerTensors(
        GroupKind.SLIDING_WINDOW, sizing.positive("sliding_window_size"), (("k", k), ("v", v))
    )


def _mla(sizing: _Sizing) -> _LayerTensors:
    """Multi-head latent attention, as vLLM caches it (MLAAttentionSpec): one latent of
    `kv_lora_rank + qk_rope_head_dim` elements per token in the KV dtype, no V, one KV
    head, not split by TP (every rank holds the whole latent). Every one of the
    `num_hidden_layers` layers is an MLA layer; the `num_nextn_predict_layers` MTP layers
    are not: vLLM builds them only in a speculative-decoding draft model, whose KV the
    main engine does not hold."""
    if sizing.text.get("kv_lora_rank") is None:
        raise refusal(
            sizing.model_type,
            "DeepSeek attention without kv_lora_rank (plain K/V, which vLLM runs without MLA)",
            "kv_lora_rank",
        )
    mtp = sizing.text.get("num_nextn_predict_layers", 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ProfileError("num_nextn_predict_layers", f"must be an integer >= 0, got {mtp!r}")
    latent = sizing.positive("kv_lora_rank") + sizing.positive("qk_rope_head_dim")
    return _LayerTensors(
        GroupKind.MLA, None, (("latent", sizing.block_size * latent * sizing.elem),)
    )


def _check_agrees(sizing: _Sizing, index: int, kind: str) -> None:
    """A `layer_types` or `sliding_window` beside MiMo-V2's own keys must say the same."""
    layer_types = sizing.text.get("layer_types")
    said = kind if layer_types is None else sizing.per_layer("layer_types", layer_types)[index]
    window = sizing.text.get("sliding_window")
    if said != kind or (
        kind == SLIDING and window is not None and window != sizing.text.get("sliding_window_size")
    ):
        field = "layer_types" if said != kind else "sliding_window"
        raise refusal(
            sizing.model_type,
            f"{field} disagreeing with hybrid_layer_pattern / sliding_window_size "
            f"(layer {index}), which vLLM reads",
            field,
        )


def _interval(sizing: _Sizing) -> int:
    if sizing.text.get("no_rope_layer_interval") is None:
        return 4  # the Llama 4 default
    return sizing.positive("no_rope_layer_interval")


def _pattern(sizing: _Sizing) -> int:
    """Gemma-3's sliding_window_pattern (newer configs spell it _sliding_window_pattern)."""
    key = "sliding_window_pattern" if "sliding_window_pattern" in sizing.text else None
    return sizing.positive(key or "_sliding_window_pattern")


def _gemma2(text: Config, sizing: _Sizing, index: int) -> _LayerTensors:
    """Gemma-2 without layer_types: even layers slide, odd layers attend to everything
    (the rule lives in the model code, not in the config)."""
    window = _window(sizing)
    duplicate = text.get("sliding_window_size")
    if duplicate is not None and duplicate != window:
        raise ProfileError(
            "sliding_window_size", f"{duplicate!r} disagrees with sliding_window {window}"
        )
    if index % 2 == 0:
        return _attention(GroupKind.SLIDING_WINDOW, window, sizing)
    return _attention(GroupKind.FULL_ATTENTION, None, sizing)


def _from_layer_type(layer_types: Any, sizing: _Sizing, index: int) -> _LayerTensors:
    kind = sizing.per_layer("layer_types", layer_types)[index]
    if kind == FULL:
        return _attention(GroupKind.FULL_ATTENTION, None, sizing)
    if kind == SLIDING:
        return _attention(GroupKind.SLIDING_WINDOW, _window(sizing), sizing)
    if kind == LINEAR:  # recognise() lets it through only for Qwen3-Next
        from kvxfer.core.state_families import gated_deltanet  # noqa: PLC0415 (a cycle)

        return gated_deltanet(sizing)
    raise UnsupportedModelError(f"layer_types[{index}]", f"layer type {kind!r} is not supported")


def _group_layers(per_layer: list[list[_LayerTensors]]) -> tuple[KVGroup, ...]:
    """One group per distinct (kind, window, chunk), in order of first use."""
    members: dict[tuple[GroupKind, int | None, int | None], list[tuple[int, _LayerTensors]]] = {}
    for index, contributions in enumerate(per_layer):
        for part in contributions:
            members.setdefault((part.kind, part.window, part.chunk), []).append((index, part))
    groups = []
    for group_id, ((kind, window, chunk), layers) in enumerate(members.items()):
        tensors = tuple(
            TensorSpec(
                name=f"layer.{index}.{suffix}",
                layer=index,
                bytes_per_block=size,
                shard=part.shards[i] if part.shards else None,
            )
            for index, part in layers
            for i, (suffix, size) in enumerate(part.tensors)
        )
        heads = {part.kv_heads for _, part in layers}  # one count for all, or unknown
        groups.append(
            KVGroup(
                group_id=GroupId(group_id),
                kind=kind,
                sliding_window=window,
                layers=tuple(index for index, _ in layers),
                tensors=tensors,
                chunk_size=chunk,
                num_kv_heads=heads.pop() if len(heads) == 1 else None,
            )
        )
    return tuple(groups)
