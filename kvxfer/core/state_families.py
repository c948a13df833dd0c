"""Readers of the families whose layers keep recurrent state, sized as vLLM allocates it.

Pure Mamba-1 and Mamba-2 models, Nemotron-H, Granite-4.0-H, Bamba, Zamba2, MiniMax
lightning attention and LFM2 short convolution; and the state layers profiles.py
dispatches to here: Qwen3-Next's Gated DeltaNet, Jamba's Mamba-1, Falcon-H1's Mamba-2.
Each reader maps one layer to the group kinds it takes part in
(`profiles._LayerTensors`): a `mamba` state group (one block per request holding the
latest state) and/or attention KV. Shapes follow vLLM's
`MambaStateShapeCalculator` (vllm/model_executor/layers/mamba/mamba_utils.py) as each
model's `get_mamba_state_shape_from_config` calls it; dtypes follow
`MambaStateDtypeCalculator` through `profiles._StateDtypes` (conv-like states in the
conv dtype, the Mamba ssm state in the ssm dtype). Under TP, heads and channels split by
tp_size and Mamba-2 B/C groups that do not divide are replicated, as vLLM does; each
state tensor carries that cut (`TensorSpec.shard`, kvxfer/core/state_shards.py), which
a pairing of different TP sizes reads.

A field vLLM reads differently from the config class, or two fields that would have to
agree and do not, is refused by name rather than guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvxfer._exceptions import ProfileError, UnsupportedModelError
from kvxfer.core.hf_config import FULL, LINEAR, STATE_DTYPE_KEYS, refusal
from kvxfer.core.layout import GroupKind
from kvxfer.core.profiles import Config, _attention, _LayerTensors, _Sizing
from kvxfer.core.state_shards import Cut, channel_units, conv_cut, head_cut

Reader = Callable[[_Sizing, int], list[_LayerTensors]]


def _refuse(sizing: _Sizing, feature: str, field: str) -> UnsupportedModelError:
    return refusal(sizing.model_type, feature, field)


def _full_attention(sizing: _Sizing, head_dim: int, kv_heads: Any = None) -> _LayerTensors:
    """K and V of one full-attention layer with `head_dim`, heads from num_key_value_heads
    (or `kv_heads` where the model fixes them), split or replicated per TP rank."""
    key = "num_key_value_heads"
    heads = sizing.text.get(key) if kv_heads is None else kv_heads
    size = sizing.head_bytes(key, heads, head_dim)
    if kv_heads is None:
        sizing.query_groups(key, heads, sizing.positive("num_attention_heads"))
    return _LayerTensors(GroupKind.FULL_ATTENTION, None, (("k", size), ("v", size)))


def _hidden_over_heads(sizing: _Sizing) -> int:
    """head_dim = hidden_size / num_attention_heads, for models whose vLLM code ignores a
    `head_dim` key: a config giving another one is refused."""
    head_dim = sizing.positive("hidden_size") // sizing.positive("num_attention_heads")
    given = sizing.text.get("head_dim")
    if given is not None and given != head_dim:
        raise _refuse(
            sizing,
            f"a head_dim ({given!r}) other than hidden_size / num_attention_heads "
            f"({head_dim}), which vLLM uses for this model",
            "head_dim",
        )
    return head_dim


def _single_state(name: str, elements: int, sizing: _Sizing, cut: Cut) -> _LayerTensors:
    """A state with one tensor, in the conv dtype (vLLM's short_conv_state_dtype and
    linear_attention_state_dtype both take mamba_cache_dtype, else the model dtype),
    cut over TP ranks as `cut` says."""
    conv_bytes, _ = sizing.state_bytes()
    return _LayerTensors(
        GroupKind.MAMBA, None, ((name, elements * conv_bytes),), shards=(cut.shard(conv_bytes),)
    )


def _kinds(sizing: _Sizing, key: str, allowed: Mapping[Any, str], values: Any = None) -> list[str]:
    """The per-layer list `key` (or `values` read from it), each entry mapped through
    `allowed`; any other entry is refused naming its index."""
    values = sizing.per_layer(key, sizing.text.get(key) if values is None else values)
    kinds = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, str | int) or value not in allowed:
            raise _refuse(sizing, f"layer type {value!r}", f"{key}[{index}]")
        kinds.append(allowed[value])
    return kinds


# --- Shared state shapes and the families profiles.py dispatches ---------------------


def _state(
    conv_elems: int, ssm_elems: int, sizing: _Sizing, cuts: tuple[Cut, Cut] | None = None
) -> _LayerTensors:
    """A conv + ssm state; `cuts` says how each is cut over TP ranks (state_shards)."""
    conv_bytes, ssm_bytes = sizing.state_bytes()
    shards = (cuts[0].shard(conv_bytes), cuts[1].shard(ssm_bytes)) if cuts else ()
    return _LayerTensors(
        GroupKind.MAMBA,
        None,
        (("conv", conv_elems * conv_bytes), ("ssm", ssm_elems * ssm_bytes)),
        shards=shards,
    )


def gated_deltanet(sizing: _Sizing) -> _LayerTensors:
    """Qwen3-Next linear attention: a recurrent conv + ssm state instead of KV."""
    key_dim = sizing.positive("linear_key_head_dim")
    value_dim = sizing.positive("linear_value_head_dim")
    key_heads = sizing.split("linear_num_key_heads", sizing.positive("linear_num_key_heads"))
    value_heads = sizing.split("linear_num_value_heads", sizing.positive("linear_num_value_heads"))
    conv_dim = 2 * key_dim * key_heads + value_dim * value_heads
    kernel = sizing.positive("linear_conv_kernel_dim")
    all_keys, all_values = key_heads * sizing.tp, value_heads * sizing.tp
    cuts = (
        conv_cut(
            kernel,
            ((all_keys, key_dim), (all_keys, key_dim), (all_values, value_dim)),
            sizing.conv_layout,
        ),
        head_cut(all_values, value_dim * key_dim),
    )
    return _state((kernel - 1) * conv_dim, value_heads * value_dim * key_dim, sizing, cuts)


def jamba(text: Config, sizing: _Sizing, index: int) -> _LayerTensors:
    period = sizing.positive("attn_layer_period")
    offset = text.get("attn_layer_offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ProfileError(
            "attn_layer_offset", f"must be an integer in [0, {period}) (attn_layer_period)"
        )
    if index % period == offset:
        return _attention(GroupKind.FULL_ATTENTION, None, sizing)
    intermediate = sizing.split(
        "mamba_expand", sizing.positive("mamba_expand") * sizing.positive("hidden_size")
    )
    kernel, d_state = sizing.positive("mamba_d_conv"), sizing.positive("mamba_d_state")
    return _state(
        (kernel - 1) * intermediate,
        intermediate * d_state,
        sizing,
        mamba1_cuts(sizing, intermediate * sizing.tp, kernel, d_state),
    )


def mamba1_cuts(sizing: _Sizing, channels: int, kernel: int, d_state: int) -> tuple[Cut, Cut]:
    """Mamba-1: conv over `channels` split one by one, ssm (channels/tp, d_state)."""
    return conv_cut(kernel, ((channels, 1),), sizing.conv_layout), head_cut(channels, d_state)


def falcon_h1(text: Config, sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Falcon-H1: a Mamba-2 mixer in every layer, attention beside it (all layers by default)."""
    attn_layers = text.get("attn_layer_indices")
    kinds: list[_LayerTensors] = []
    if attn_layers is None or index in _layer_indices(sizing):
        kinds.append(_attention(GroupKind.FULL_ATTENTION, None, sizing))
    kinds.append(
        _mamba2_state(
            sizing,
            ("mamba_d_ssm", sizing.positive("mamba_d_ssm")),
            ("mamba_n_groups", sizing.positive("mamba_n_groups")),
            ("mamba_n_heads", sizing.positive("mamba_n_heads")),
            sizing.positive("mamba_d_head"),
            sizing.positive("mamba_d_state"),
            sizing.positive("mamba_d_conv"),
        )
    )
    return kinds


def _mamba2_state(
    sizing: _Sizing,
    intermediate: tuple[str, int],
    groups: tuple[str, int],
    heads: tuple[str, int],
    head_dim: int,
    d_state: int,
    d_conv: int,
) -> _LayerTensors:
    """One Mamba-2 layer's state on one TP rank, as vLLM's
    MambaStateShapeCalculator.mamba2_state_shape sizes it: conv (d_conv - 1) rows of
    intermediate/tp + 2 x groups_per_rank x d_state channels; ssm heads/tp x head_dim x
    d_state. `intermediate`, `groups` and `heads` are (config key, value)."""
    channels = sizing.split(*intermediate) + 2 * _groups_per_rank(*groups, sizing) * d_state
    ssm = sizing.split(*heads) * head_dim * d_state
    x = channel_units(intermediate[1], heads[1])
    cuts = (
        conv_cut(d_conv, (x, (groups[1], d_state), (groups[1], d_state)), sizing.conv_layout),
        head_cut(heads[1], head_dim * d_state),
    )
    return _state((d_conv - 1) * channels, ssm, sizing, cuts)


def _groups_per_rank(key: str, groups: int, sizing: _Sizing) -> int:
    """Mamba-2 B/C groups on one TP rank: split when they divide, else a single group
    replicated on every rank (vLLM adds the missing groups rather than splitting one, and
    MambaMixer2 asserts that only one group is ever replicated)."""
    if groups % sizing.tp == 0:
        return groups // sizing.tp
    if groups == 1:
        return 1
    raise ProfileError(
        key,
        f"{groups} groups on tp_size {sizing.tp}: vLLM splits B/C groups evenly or "
        "replicates a single one, nothing else",
    )


# --- Mamba-1 -------------------------------------------------------------------------


def _mamba1(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Every layer a Mamba-1 state, as MambaForCausalLM.get_mamba_state_shape_from_config
    (vllm/model_executor/models/mamba.py) calls mamba1_state_shape: conv (conv_kernel - 1)
    x intermediate/tp, ssm intermediate/tp x state_size. transformers sets intermediate_size
    to expand x hidden_size unless the file gives it (Falcon-Mamba-7B gives 8192 beside
    expand 16), so the file's value wins."""
    text = sizing.text
    if text.get("intermediate_size") is not None:
        intermediate = sizing.positive("intermediate_size")
    else:
        intermediate = sizing.positive("expand") * sizing.positive("hidden_size")
    channels = sizing.split("intermediate_size", intermediate)
    kernel, d_state = sizing.positive("conv_kernel"), sizing.positive("state_size")
    cuts = mamba1_cuts(sizing, intermediate, kernel, d_state)
    return [_state((kernel - 1) * channels, channels * d_state, sizing, cuts)]


# --- Mamba-2 families ----------------------------------------------------------------


def _mamba2(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Every layer a Mamba-2 state, as Mamba2ForCausalLM.get_mamba_state_shape_from_config
    (mamba2.py): intermediate expand x hidden_size, n_groups, num_heads, head_dim,
    state_size, conv_kernel."""
    p = sizing.positive
    return [
        _mamba2_state(
            sizing,
            ("expand", p("expand") * p("hidden_size")),
            ("n_groups", p("n_groups")),
            ("num_heads", p("num_heads")),
            p("head_dim"),
            p("state_size"),
            p("conv_kernel"),
        )
    ]


# Nemotron-H's per-layer characters, and the list names transformers maps them to.
_PATTERN_CHARS: Mapping[str, str] = {"M": "mamba", "*": "attention", "-": "none", "E": "none"}
_BLOCK_TYPES: Mapping[str, str] = {
    "mamba": "mamba", LINEAR: "mamba", "attention": "attention", FULL: "attention",
    "mlp": "none", "moe": "none",
}  # fmt: skip


def _nemotron_pattern(sizing: _Sizing) -> list[str]:
    """Layer kinds from hybrid_override_pattern (a string of M, *, -, E) or
    layers_block_type / layer_types (lists); where more than one is given they must agree.
    vLLM builds one layer per entry, so each must have num_hidden_layers entries."""
    text = sizing.text
    readings: list[tuple[str, list[str]]] = []
    pattern = text.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ProfileError("hybrid_override_pattern", "must be a string of M, *, - and E")
        readings.append(
            (
                "hybrid_override_pattern",
                _kinds(sizing, "hybrid_override_pattern", _PATTERN_CHARS, list(pattern)),
            )
        )
    for key in ("layers_block_type", "layer_types"):
        if text.get(key) is not None:
            readings.append((key, _kinds(sizing, key, _BLOCK_TYPES)))
    if not readings:
        raise ProfileError("hybrid_override_pattern", "Nemotron-H needs its layer pattern")
    for key, kinds in readings[1:]:
        if kinds != readings[0][1]:
            raise _refuse(sizing, f"{key} disagreeing with {readings[0][0]}", key)
    return readings[0][1]


def _nemotron_head_dim(sizing: _Sizing) -> int:
    """`head_dim` where given. Otherwise transformers' NemotronHConfig defaults it to 128
    while older remote configs use hidden_size / num_attention_heads (or name it
    attention_head_dim): read only when all of these agree."""
    text = sizing.text
    if text.get("head_dim") is not None:
        return sizing.positive("head_dim")
    candidates = {sizing.positive("hidden_size") // sizing.positive("num_attention_heads"), 128}
    if text.get("attention_head_dim") is not None:
        candidates.add(sizing.positive("attention_head_dim"))
    if len(candidates) != 1:
        raise _refuse(
            sizing,
            f"an attention head dim left to the config class (candidates {sorted(candidates)})",
            "head_dim",
        )
    return candidates.pop()


def _nemotron_h(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Nemotron-H, as vLLM's nemotron_h.py builds it: `M` a Mamba-2 state
    (NemotronHForCausalLM.get_mamba_state_shape_from_config: intermediate mamba_num_heads
    x mamba_head_dim, n_groups, ssm_state_size, conv_kernel; ssm state in
    mamba_ssm_cache_dtype, else float32 by NemotronHForCausalLMConfig), `*` full attention,
    `-` (MLP) and `E` (MoE) cache nothing."""
    text = sizing.text
    for key, feature in (
        ("block_configs", "per-layer (Puzzle) block configs"),
        ("sliding_window", "a sliding window on the attention layers"),
    ):
        if text.get(key) is not None:
            raise _refuse(sizing, feature, key)
    for alias, key in (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel")):
        if text.get(alias) is not None and text.get(alias) != text.get(key):
            raise _refuse(
                sizing,
                f"{alias} (transformers reads it over {key}, vLLM's own config class does not)",
                alias,
            )
    kind = _nemotron_pattern(sizing)[index]
    if kind == "none":
        return []
    if kind == "attention":
        return [_full_attention(sizing, _nemotron_head_dim(sizing))]
    p = sizing.positive
    heads, head_dim = p("mamba_num_heads"), p("mamba_head_dim")
    return [
        _mamba2_state(
            sizing,
            ("mamba_num_heads", heads * head_dim),
            ("n_groups", p("n_groups")),
            ("mamba_num_heads", heads),
            head_dim,
            p("ssm_state_size"),
            p("conv_kernel"),
        )
    ]


def _granite_mamba(sizing: _Sizing) -> _LayerTensors:
    """Granite-4.0-H's and Bamba's Mamba-2 layer (granitemoehybrid.py / bamba.py
    get_mamba_state_shape_from_config): intermediate mamba_expand x hidden_size,
    mamba_n_groups, mamba_n_heads, mamba_d_head ("auto": intermediate / heads),
    mamba_d_state, mamba_d_conv."""
    p = sizing.positive
    intermediate = p("mamba_expand") * p("hidden_size")
    heads = p("mamba_n_heads")
    head_dim = sizing.text.get("mamba_d_head")
    head_dim = intermediate // heads if head_dim == "auto" else p("mamba_d_head")
    return _mamba2_state(
        sizing,
        ("mamba_expand", intermediate),
        ("mamba_n_groups", p("mamba_n_groups")),
        ("mamba_n_heads", heads),
        head_dim,
        p("mamba_d_state"),
        p("mamba_d_conv"),
    )


def _granite_hybrid(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Granite-4.0-H: layer_types `mamba` / `linear_attention` (transformers' newer name)
    a Mamba-2 state, `attention` / `full_attention` full attention with head_dim =
    hidden_size / num_attention_heads (granitemoehybrid.py)."""
    kinds = {"mamba": "mamba", LINEAR: "mamba", "attention": "attention", FULL: "attention"}
    if sizing.text.get("layer_types") is None:
        raise ProfileError("layer_types", "Granite-4.0-H needs its per-layer layer_types")
    if _kinds(sizing, "layer_types", kinds)[index] == "attention":
        return [_full_attention(sizing, _hidden_over_heads(sizing))]
    return [_granite_mamba(sizing)]


def _layer_indices(sizing: _Sizing) -> list[int]:
    """`attn_layer_indices`: the layers with attention, each an index of a layer."""
    indices = sizing.text.get("attn_layer_indices")
    if not isinstance(indices, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < sizing.num_layers
        for i in indices
    ):
        raise ProfileError(
            "attn_layer_indices", f"must be a list of layer indices below {sizing.num_layers}"
        )
    return indices


def _bamba(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Bamba: attention on the layers in attn_layer_indices, Mamba-2 elsewhere
    (transformers' layers_block_type, which bamba.py reads)."""
    if index in _layer_indices(sizing):
        return [_full_attention(sizing, _hidden_over_heads(sizing))]
    return [_granite_mamba(sizing)]


def _zamba2(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """Zamba2 (vLLM's zamba2.py): every layer has a Mamba-2 mixer
    (Zamba2ForCausalLM.get_mamba_state_shape_from_config: intermediate mamba_expand x
    hidden_size, mamba_ngroups, n_mamba_heads, mamba_headdim, mamba_d_state, mamba_d_conv);
    a `hybrid` layer also runs a shared attention block whose KV cache is its own (one
    Attention per hybrid layer), with num_attention_heads KV heads (vLLM gives it no other
    KV head count) of attention_head_dim (default 2 x hidden_size / num_attention_heads)."""
    text = sizing.text
    kinds = {"mamba": "mamba", LINEAR: "mamba", "hybrid": "hybrid"}
    layer_kinds = _kinds(sizing, "layers_block_type", kinds)
    hybrid_ids = [i for i, kind in enumerate(layer_kinds) if kind == "hybrid"]
    if text.get("hybrid_layer_ids") is not None and text["hybrid_layer_ids"] != hybrid_ids:
        raise _refuse(
            sizing, "hybrid_layer_ids disagreeing with layers_block_type", "hybrid_layer_ids"
        )
    p = sizing.positive
    heads = p("num_attention_heads")
    intermediate = p("mamba_expand") * p("hidden_size")
    mamba_heads = p("n_mamba_heads")
    if text.get("mamba_headdim") not in (None, intermediate // mamba_heads):
        raise _refuse(
            sizing,
            "a mamba_headdim other than the mixer's intermediate / n_mamba_heads",
            "mamba_headdim",
        )
    state = _mamba2_state(
        sizing,
        ("mamba_expand", intermediate),
        ("mamba_ngroups", p("mamba_ngroups")),
        ("n_mamba_heads", mamba_heads),
        intermediate // mamba_heads,
        p("mamba_d_state"),
        p("mamba_d_conv"),
    )
    if layer_kinds[index] != "hybrid":
        return [state]
    if text.get("num_key_value_heads") not in (None, heads):
        raise _refuse(
            sizing,
            "num_key_value_heads other than num_attention_heads (vLLM's "
            "Zamba2 attention has one KV head per query head)",
            "num_key_value_heads",
        )
    given = text.get("attention_head_dim") is not None
    head_dim = p("attention_head_dim") if given else 2 * p("hidden_size") // heads
    given = text.get("attention_hidden_size") is not None
    hidden = p("attention_hidden_size") if given else 2 * p("hidden_size")
    if head_dim * heads != hidden:
        raise _refuse(
            sizing,
            "attention_head_dim x num_attention_heads other than attention_hidden_size",
            "attention_head_dim",
        )
    return [_full_attention(sizing, head_dim, heads), state]


# --- Lightning attention and short convolution ----------------------------------------


def _minimax(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """MiniMax-Text-01 / M1 / transformers' MiniMax: attn_type_list (0 linear, 1 full),
    else decoder_attention_types, else layer_types, as vLLM's minimax_text_01.py picked
    them (that model was removed in vLLM 0.23; its lightning layer lives on as
    layers/mamba/linear/base.py LinearAttention). A linear layer keeps one state of
    num_attention_heads/tp x head_dim x head_dim (linear_attention_state_shape) in the conv
    dtype; a full layer K and V of num_key_value_heads x head_dim. head_dim defaults to
    hidden_size / num_attention_heads."""
    text = sizing.text
    if text.get("sliding_window") is not None:
        raise _refuse(
            sizing, "a sliding window (vLLM ignores it, transformers applies it)", "sliding_window"
        )
    sources = [
        (key, _kinds(sizing, key, allowed))
        for key, allowed in (
            ("attn_type_list", {0: LINEAR, 1: FULL}),
            ("decoder_attention_types", {0: LINEAR, 1: FULL}),
            ("layer_types", {LINEAR: LINEAR, FULL: FULL}),
        )
        if text.get(key) is not None
    ]
    if not sources:
        raise ProfileError("attn_type_list", "MiniMax needs its per-layer attention types")
    for key, kinds in sources[1:]:
        if kinds != sources[0][1]:
            raise _refuse(sizing, f"{key} disagreeing with {sources[0][0]}", key)
    heads = sizing.positive("num_attention_heads")
    given = text.get("head_dim") is not None
    head_dim = sizing.positive("head_dim") if given else sizing.positive("hidden_size") // heads
    if sources[0][1][index] == FULL:
        return [_full_attention(sizing, head_dim)]
    state_heads = sizing.split("num_attention_heads", heads)
    cut = head_cut(heads, head_dim * head_dim)
    return [_single_state("state", state_heads * head_dim * head_dim, sizing, cut)]


def _lfm2(sizing: _Sizing, index: int) -> list[_LayerTensors]:
    """LFM2 / LFM2-MoE: layer_types `conv` a short-convolution state of (conv_L_cache - 1)
    x dim/tp (short_conv_state_shape; Lfm2ForCausalLM takes dim = conv_dim, Lfm2MoeForCausalLM
    hidden_size), `full_attention` K and V with head_dim = hidden_size / num_attention_heads."""
    kinds = _kinds(sizing, "layer_types", {"conv": "conv", FULL: FULL})
    if kinds[index] == FULL:
        return [_full_attention(sizing, _hidden_over_heads(sizing))]
    dim_key = "hidden_size" if sizing.model_type == "lfm2_moe" else "conv_dim"
    channels = sizing.split(dim_key, sizing.positive(dim_key))
    kernel = sizing.positive("conv_L_cache")
    cut = conv_cut(kernel, ((sizing.positive(dim_key), 1),), sizing.conv_layout)
    return [_single_state("conv", (kernel - 1) * channels, sizing, cut)]


def _declared_dtypes_read_by_vllm(reader: Reader, honoured: frozenset[str] = frozenset()) -> Reader:
    """`reader`, refusing a state dtype the config declares that vLLM does not take from
    the config for this family (it takes them from --mamba-cache-dtype /
    --mamba-ssm-cache-dtype; only Nemotron-H's config sets mamba_ssm_cache_dtype)."""

    def read(sizing: _Sizing, index: int) -> list[_LayerTensors]:
        if index == 0:
            for key in STATE_DTYPE_KEYS:
                value = sizing.text.get(key)
                if key not in honoured and value not in (None, "auto"):
                    raise _refuse(
                        sizing,
                        "a state dtype declared in the config, which vLLM ignores for this model",
                        key,
                    )
        return reader(sizing, index)

    return read


READERS: Mapping[str, Reader] = {
    "mamba1": _declared_dtypes_read_by_vllm(_mamba1),
    "mamba2": _declared_dtypes_read_by_vllm(_mamba2),
    "nemotron_h": _declared_dtypes_read_by_vllm(_nemotron_h, frozenset({"mamba_ssm_cache_dtype"})),
    "granite_hybrid": _declared_dtypes_read_by_vllm(_granite_hybrid),
    "bamba": _declared_dtypes_read_by_vllm(_bamba),
    "zamba2": _declared_dtypes_read_by_vllm(_zamba2),
    "minimax": _declared_dtypes_read_by_vllm(_minimax),
    "lfm2": _declared_dtypes_read_by_vllm(_lfm2),
}
