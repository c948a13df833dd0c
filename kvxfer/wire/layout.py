"""Layouts and block spans to and from their protobuf messages.

Decoding validates everything through the domain constructors, so a bad
message becomes a LayoutError whose field path starts at the message
(`layout.groups[1].sliding_window: ...`), never a half-built object.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import (
    MAX_LAYERS,
    BlockId,
    BlockSpan,
    EngineLayout,
    GroupId,
    GroupKind,
    KVGroup,
    Region,
    ShardSegment,
    StateShard,
    TensorSpec,
    span_where,
)
from kvxfer.v1 import layout_pb2 as pb

_KIND_TO_PB = {
    GroupKind.FULL_ATTENTION: pb.GROUP_KIND_FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW: pb.GROUP_KIND_SLIDING_WINDOW,
    GroupKind.MAMBA: pb.GROUP_KIND_MAMBA,
    GroupKind.CHUNKED_LOCAL: pb.GROUP_KIND_CHUNKED_LOCAL,
    GroupKind.MLA: pb.GROUP_KIND_MLA,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def layout_to_proto(layout: EngineLayout) -> pb.EngineLayout:
    return pb.EngineLayout(
        model=layout.model,
        fingerprint=layout.fingerprint,
        kv_dtype=layout.kv_dtype,
        block_size=layout.block_size,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        groups=[_group_to_proto(g) for g in layout.groups],
        regions=[_region_to_proto(r) for r in layout.regions],
        token_major=layout.token_major,
        head_major=layout.head_major,
        token_rows=layout.token_rows,
    )


def _group_to_proto(group: KVGroup) -> pb.KVGroup:
    message = pb.KVGroup(
        group_id=group.group_id,
        kind=_KIND_TO_PB[group.kind],
        layers=list(group.layers),
        tensors=[_tensor_to_proto(t) for t in group.tensors],
    )
    if group.sliding_window is not None:
        message.sliding_window = group.sliding_window
    if group.block_size is not None:
        message.block_size = group.block_size
    if group.chunk_size is not None:
        message.chunk_size = group.chunk_size
    if group.num_kv_heads is not None:
        message.num_kv_heads = group.num_kv_heads
    return message


def _region_to_proto(region: Region) -> pb.Region:
    return pb.Region(
        name=region.name,
        buffer=region.buffer,
        offset_bytes=region.offset_bytes,
        num_blocks=region.num_blocks,
        stride_bytes=region.stride_bytes,
        block_bytes=region.block_bytes,
    )


# What the largest real models need, many times over; checked on the decoded message's
# counts before any kvxfer object is built, so a hostile layout costs no more.
MAX_GROUPS = 256
MAX_LAYERS_PER_GROUP = MAX_LAYERS
MAX_TENSORS_PER_GROUP = 16384
MAX_REGIONS = 65536


def _check_counts(message: pb.EngineLayout, field: str) -> None:
    counts = [(f"{field}.groups", len(message.groups), MAX_GROUPS)]
    counts.append((f"{field}.regions", len(message.regions), MAX_REGIONS))
    for i, group in enumerate(message.groups):
        counts.append((f"{field}.groups[{i}].layers", len(group.layers), MAX_LAYERS_PER_GROUP))
        counts.append((f"{field}.groups[{i}].tensors", len(group.tensors), MAX_TENSORS_PER_GROUP))
    for name, count, limit in counts:
        if count > limit:
            raise LayoutError(name, f"{count} entries exceed the limit of {limit}")


def layout_from_proto(message: pb.EngineLayout, field: str = "layout") -> EngineLayout:
    _check_counts(message, field)
    try:
        return EngineLayout(
            model=message.model,
            fingerprint=message.fingerprint,
            kv_dtype=message.kv_dtype,
            block_size=message.block_size,
            tp_size=message.tp_size,
            tp_rank=message.tp_rank,
            groups=tuple(_group_from_proto(g, i) for i, g in enumerate(message.groups)),
            regions=tuple(_region_from_proto(r) for r in message.regions),
            token_major=message.token_major,
            head_major=message.head_major,
            token_rows=message.token_rows,
        )
    except LayoutError as exc:
        raise LayoutError(f"{field}.{exc.field}", exc.detail) from exc


def _group_from_proto(message: pb.KVGroup, index: int) -> KVGroup:
    kind = _KIND_FROM_PB.get(message.kind)
    if kind is None:
        raise LayoutError(f"groups[{index}].kind", f"unknown group kind {message.kind}")
    return KVGroup(
        group_id=GroupId(message.group_id),
        kind=kind,
        sliding_window=message.sliding_window if message.HasField("sliding_window") else None,
        layers=tuple(message.layers),
        tensors=tuple(_tensor_from_proto(t, index, i) for i, t in enumerate(message.tensors)),
        block_size=message.block_size if message.HasField("block_size") else None,
        chunk_size=message.chunk_size if message.HasField("chunk_size") else None,
        num_kv_heads=message.num_kv_heads if message.HasField("num_kv_heads") else None,
    )


# Segments of one state tensor's row: [x | B | C] or [q | k | v] need three; a bound
# keeps a hostile message from costing more than it could mean.
MAX_SHARD_SEGMENTS = 64


def _tensor_to_proto(tensor: TensorSpec) -> pb.TensorSpec:
    message = pb.TensorSpec(
        name=tensor.name, layer=tensor.layer, bytes_per_block=tensor.bytes_per_block
    )
    if tensor.shard is not None:
        message.shard.rows = tensor.shard.rows
        message.shard.segments.extend(
            pb.ShardSegment(heads=s.heads, head_bytes=s.head_bytes) for s in tensor.shard.segments
        )
    return message


def _tensor_from_proto(message: pb.TensorSpec, group: int, index: int) -> TensorSpec:
    shard = None
    if message.HasField("shard"):
        where = f"groups[{group}].tensors[{index}].shard"
        if len(message.shard.segments) > MAX_SHARD_SEGMENTS:
            raise LayoutError(
                f"{where}.segments",
                f"{len(message.shard.segments)} segments, at most {MAX_SHARD_SEGMENTS}",
            )
        shard = StateShard(
            message.shard.rows,
            tuple(ShardSegment(s.heads, s.head_bytes) for s in message.shard.segments),
        )
        shard.check(where)  # named by position here, before the tensor's name is known
    return TensorSpec(
        name=message.name,
        layer=message.layer,
        bytes_per_block=message.bytes_per_block,
        shard=shard,
    )


def _region_from_proto(message: pb.Region) -> Region:
    return Region(
        name=message.name,
        buffer=message.buffer,
        offset_bytes=message.offset_bytes,
        num_blocks=message.num_blocks,
        stride_bytes=message.stride_bytes,
        block_bytes=message.block_bytes,
    )


def span_to_proto(span: BlockSpan) -> pb.BlockSpan:
    return pb.BlockSpan(
        group_id=span.group_id, first_block=span.first_block, block_ids=list(span.block_ids)
    )


def spans_from_proto(messages: Iterable[pb.BlockSpan], field: str) -> tuple[BlockSpan, ...]:
    spans = []
    for i, message in enumerate(messages):
        try:
            spans.append(
                BlockSpan(
                    group_id=GroupId(message.group_id),
                    first_block=message.first_block,
                    block_ids=cast(tuple[BlockId, ...], tuple(message.block_ids)),
                )
            )
        except LayoutError as exc:
            # Named by its position here, keeping the part of the span that is wrong
            # (`.first_block`, `.block_ids[3]`): the span itself names only its group.
            part = exc.field.removeprefix(span_where(message.group_id))
            raise LayoutError(f"{field}[{i}]{part}", exc.detail) from exc
    return tuple(spans)
