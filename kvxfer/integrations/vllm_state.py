"""A vLLM state page as its state tensors, each with its cut over TP ranks (docs/vllm.md,
"State models across TP sizes").

vLLM packs a Mamba/GDN layer's states (conv, ssm, ...) from each page's start, in the
order and sizes of its `MambaSpec`'s `shapes` and `dtypes` (`MambaBase.bind_kv_cache`).
The spec does not say how each tensor is cut over TP ranks: which of a rank's conv
channels are q, k or v, which heads its recurrent state holds. That cut is the model's,
and kvxfer's state readers know it from the model's config, as vLLM shards it
(`kvxfer.core.state_families`, checked against vLLM's own state shapes by
tests/test_state_families_vllm.py). It is taken only where it agrees with what vLLM
allocated on this rank: the same tensors, the same bytes for each, a conv state's rows
and every cut falling on the tensor's own dimensions. Anything else raises, naming the
field; the worker then keeps each page one opaque block (pairs of one TP size work as
before, and different TP sizes are refused by negotiation naming the missing cut).

Imports neither vLLM nor torch: specs are read by attribute (`shapes`, `dtypes` with
`itemsize`, `tp_replicated`), so tests feed plain objects shaped like vLLM's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import GroupKind, ShardSegment, StateShard
from kvxfer.core.profiles import layout_from_config
from kvxfer.core.state_shards import check_conv_layout

# The config's cut is sized with 4-byte elements (state_dtype float32 overrides every
# state dtype), then each tensor is rescaled to the element size vLLM allocated it in.
_CUT_ELEMENT = 4
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class StateCuts:
    """The model's state tensors per state layer, from its config: the layers that hold
    state, and each tensor's suffix (conv, ssm, ...) and cut, in 4-byte elements.
    `conv_rows` is, per tensor, kernel - 1 for a conv state (whose storage, SD or DS,
    changes its cut) and None for any other; `conv_layout` the storage the cuts are for."""

    layers: frozenset[int]
    tensors: tuple[tuple[str, StateShard], ...]
    conv_rows: tuple[int | None, ...]
    conv_layout: str


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a page: `nbytes` at `offset` from the page's start, cut over
    TP ranks as `shard` says (in the bytes vLLM allocated it in)."""

    suffix: str
    offset: int
    nbytes: int
    shard: StateShard


def cuts_from_config(config: Mapping[str, Any], *, tp_size: int, conv_layout: str) -> StateCuts:
    """The state cuts of the model `config` (vLLM's hf_config as a dict) describes, on
    `tp_size` ranks with conv states stored as `conv_layout` (vLLM's
    get_conv_state_layout: "SD" or "DS"). Raises ProfileError / UnsupportedModelError
    for a config kvxfer does not read, LayoutError where its state layers differ."""
    check_conv_layout(conv_layout)
    # A conv state's cut depends on its storage: kernel - 1 rows of channels (SD), or one
    # row of each channel's kernel - 1 values (DS). Where the two cuts differ the tensor
    # is a conv state, and the SD cut's rows are its kernel - 1, which the storage check
    # (`_check_conv`) needs.
    layers, stored_sd = _config_cuts(config, tp_size, "SD")
    _, stored_ds = _config_cuts(config, tp_size, "DS")
    rows = tuple(
        None if sd == ds else sd[1].rows for sd, ds in zip(stored_sd, stored_ds, strict=True)
    )
    tensors = stored_sd if conv_layout == "SD" else stored_ds
    return StateCuts(layers, tensors, rows, conv_layout)


def _config_cuts(
    config: Mapping[str, Any], tp_size: int, conv_layout: str
) -> tuple[frozenset[int], tuple[tuple[str, StateShard], ...]]:
    layout = layout_from_config(
        dict(config),
        name="vllm",
        tp_size=tp_size,
        state_dtype="float32",
        conv_state_layout=conv_layout,
    )
    per_layer: dict[int, list[tuple[str, StateShard]]] = {}
    for group in layout.groups:
        if group.kind is not GroupKind.MAMBA:
            continue
        for tensor in group.tensors:
            if tensor.shard is None:
                raise LayoutError("config", f"state tensor {tensor.name} has no TP cut")
            suffix = tensor.name.rsplit(".", 1)[-1]
            per_layer.setdefault(tensor.layer, []).append((suffix, tensor.shard))
    if not per_layer:
        raise LayoutError("config", "the model's config describes no state layer")
    shapes = {tuple(tensors) for tensors in per_layer.values()}
    if len(shapes) != 1:
        raise LayoutError("config", "the model's state layers hold different state tensors")
    return frozenset(per_layer), shapes.pop()


def layer_index(name: str, fallback: int) -> int:
    """The model layer a vLLM layer name (`model.layers.<i>.…`) belongs to."""
    found = _LAYER_INDEX.search(name)
    return int(found.group(1)) if found else fallback


def state_groups(
    kv_cache_config: Any, cuts: StateCuts, *, tp_size: int
) -> dict[int, tuple[StateTensor, ...]]:
    """Every state group's packed tensors (`packed_states`), its layers being the state
    layers of the config the cuts came from."""
    out: dict[int, tuple[StateTensor, ...]] = {}
    layers: set[int] = set()
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if "MambaSpec" not in [cls.__name__ for cls in type(spec).__mro__]:
            continue
        where = f"kv_cache_groups[{gid}].kv_cache_spec"
        out[gid] = packed_states(spec, cuts, tp_size=tp_size, where=where)
        layers |= {layer_index(name, -1) for name in group.layer_names}
    if layers != cuts.layers:
        raise LayoutError(
            "kv_cache_groups",
            f"state layers {sorted(layers)}, but the model's config has them at "
            f"{sorted(cuts.layers)}",
        )
    return out


def packed_states(
    spec: Any, cuts: StateCuts, *, tp_size: int, where: str
) -> tuple[StateTensor, ...]:
    """The state tensors packed in one page of `spec` (vLLM's MambaSpec of one group on a
    rank of `tp_size`), each with its cut, checked against what vLLM allocated."""
    if getattr(spec, "tp_replicated", False):
        raise LayoutError(f"{where}.tp_replicated", "every rank holds the whole state")
    shapes = [tuple(int(n) for n in shape) for shape in spec.shapes]
    if len(shapes) != len(cuts.tensors) or len(spec.dtypes) != len(shapes):
        names = [suffix for suffix, _ in cuts.tensors]
        raise LayoutError(
            f"{where}.shapes",
            f"{len(shapes)} state tensors, but the model's config has {len(names)} ({names})",
        )
    out: list[StateTensor] = []
    offset = 0
    for index, (shape, dtype, (suffix, cut), rows) in enumerate(
        zip(shapes, spec.dtypes, cuts.tensors, cuts.conv_rows, strict=True)
    ):
        itemsize = int(dtype.itemsize)
        shard = _rescaled(cut, itemsize)
        at = f"{where}.shapes[{index}]"
        _check_cut(shard, shape, itemsize, tp_size, at, suffix)
        if rows is not None:
            _check_conv(shape, rows, cuts.conv_layout, at, suffix)
        nbytes = math.prod(shape) * itemsize
        out.append(StateTensor(suffix, offset, nbytes, shard))
        offset += nbytes
    return tuple(out)


def _check_conv(shape: tuple[int, ...], rows: int, layout: str, where: str, name: str) -> None:
    """A conv state is (kernel - 1, channels) stored SD, (channels, kernel - 1) stored DS:
    a cut for the other storage would read each row as channels, or the reverse."""
    want = 0 if layout == "SD" else 1
    if len(shape) != 2 or shape[want] != rows:
        stored = "(kernel - 1, channels)" if layout == "SD" else "(channels, kernel - 1)"
        raise LayoutError(
            where,
            f"{shape}: the {name} state is not {stored} with kernel - 1 = {rows}, as the conv "
            f"state layout {layout} stores it",
        )


def _rescaled(cut: StateShard, itemsize: int) -> StateShard:
    segments = (
        ShardSegment(s.heads, s.head_bytes // _CUT_ELEMENT * itemsize) for s in cut.segments
    )
    return StateShard(cut.rows, tuple(segments))


def _check_cut(
    shard: StateShard, shape: tuple[int, ...], itemsize: int, tp_size: int, where: str, name: str
) -> None:
    """The cut must hold this rank's bytes of the tensor, its rows be the tensor's first
    dimension when there are several (a conv state stored (kernel - 1, channels)), and
    every segment of a row end on the dimension the rank's part is cut along."""
    nbytes = math.prod(shape) * itemsize
    row = shard.row_bytes(tp_size)
    if shard.rows * row != nbytes:
        raise LayoutError(
            where,
            f"{shape} holds {nbytes} bytes on this rank, but the model's config gives the "
            f"{name} state {shard.rows} rows of {row} bytes",
        )
    if shard.rows > 1 and shape[0] != shard.rows:
        raise LayoutError(
            where, f"{shape}: the {name} state's {shard.rows} rows are not its first dimension"
        )
    inner = shape[2:] if shard.rows > 1 else shape[1:]
    unit = math.prod(inner) * itemsize
    for count, segment in zip(shard.rank_units(tp_size), shard.segments, strict=True):
        if (count * segment.head_bytes) % unit:
            raise LayoutError(
                where,
                f"{shape}: the {name} state's cut over TP ranks does not fall on its "
                "dimensions (conv state layout SD/DS?)",
            )
