"""The sidecar's messages to and from domain objects: buffers, params, events.

Decoding validates through the domain constructors and prefixes the field
path with where the value sat in the message (`params.spans[0].block_ids`),
so a bad message is a field-named InvalidInputError and never half-decoded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvxfer._exceptions import InvalidInputError, shown
from kvxfer.core.buffers import BoundBuffer, BufferHandle, MemoryKind
from kvxfer.core.layout import EngineLayout
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.requests import (
    AbortState,
    EngineEvent,
    LeaseExpired,
    Publication,
    PullDone,
    PullStatus,
    Pushed,
    Received,
    Released,
    ReleaseReason,
    TransferMode,
    TransferParams,
)
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.layout import layout_from_proto, layout_to_proto, span_to_proto, spans_from_proto

_MEMORY_TO_PB = {MemoryKind.DRAM: pb.MEMORY_KIND_DRAM, MemoryKind.VRAM: pb.MEMORY_KIND_VRAM}
_MEMORY_FROM_PB = {v: k for k, v in _MEMORY_TO_PB.items()}
_STATUS_TO_PB = {
    PullStatus.OK: pb.PULL_STATUS_OK,
    PullStatus.PARTIAL: pb.PULL_STATUS_PARTIAL,
    PullStatus.FAILED: pb.PULL_STATUS_FAILED,
    PullStatus.ABORTED: pb.PULL_STATUS_ABORTED,
}
_STATUS_FROM_PB = {v: k for k, v in _STATUS_TO_PB.items()}
_REASON_TO_PB = {
    ReleaseReason.CONSUMED: pb.RELEASE_REASON_CONSUMED,
    ReleaseReason.ABORTED: pb.RELEASE_REASON_ABORTED,
    ReleaseReason.UNREGISTERED: pb.RELEASE_REASON_UNREGISTERED,
}
_REASON_FROM_PB = {v: k for k, v in _REASON_TO_PB.items()}
_ABORT_TO_PB = {
    AbortState.HELD: pb.ABORT_STATE_HELD,
    AbortState.READING: pb.ABORT_STATE_READING,
    AbortState.ABORTED: pb.ABORT_STATE_ABORTED,
    AbortState.PULLING: pb.ABORT_STATE_PULLING,
    AbortState.PUSHING: pb.ABORT_STATE_PUSHING,
    AbortState.EXPECTED: pb.ABORT_STATE_EXPECTED,
    AbortState.WRITING: pb.ABORT_STATE_WRITING,
}
_ABORT_FROM_PB = {v: k for k, v in _ABORT_TO_PB.items()}
_MODE_TO_PB = {TransferMode.PULL: pb.TRANSFER_MODE_PULL, TransferMode.PUSH: pb.TRANSFER_MODE_PUSH}
_MODE_FROM_PB = {
    **{v: k for k, v in _MODE_TO_PB.items()},
    pb.TRANSFER_MODE_UNSPECIFIED: TransferMode.PULL,
}


def mode_to_proto(mode: TransferMode) -> pb.TransferMode.ValueType:
    return _MODE_TO_PB[mode]  # type: ignore[no-any-return,unused-ignore]


def mode_from_proto(value: int, field: str = "mode") -> TransferMode:
    mode: TransferMode | None = _MODE_FROM_PB.get(value)  # type: ignore[call-overload,unused-ignore]
    if mode is None:
        raise InvalidInputError(field, f"unknown transfer mode {value}")
    return mode


def memory_kind_from_proto(value: int, field: str) -> MemoryKind:
    kind: MemoryKind | None = _MEMORY_FROM_PB.get(value)  # type: ignore[call-overload]
    if kind is None:
        raise InvalidInputError(field, f"unknown memory kind {value}")
    return kind


def handle_to_proto(handle: BufferHandle) -> pb.BufferHandle:
    return pb.BufferHandle(
        name=handle.name,
        kind=_MEMORY_TO_PB[handle.kind],
        size_bytes=handle.size_bytes,
        shm_name=handle.shm_name,
        ipc_handle=handle.ipc_handle,
        device_id=handle.device_id,
        offset_bytes=handle.offset_bytes,
    )


# Buffers one engine registers: each is mapped and registered with NIXL, so a list without
# end would walk the sidecar toward the kernel's map limit (vm.max_map_count, 65530 by
# default). Engines register one per KV pool or per layer tensor, far fewer.
MAX_BUFFERS = 4096


def handles_from_proto(messages: Sequence[pb.BufferHandle], field: str) -> list[BufferHandle]:
    if len(messages) > MAX_BUFFERS:
        raise InvalidInputError(
            field, f"{len(messages)} buffers exceed the limit of {MAX_BUFFERS} per engine"
        )
    handles = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        try:
            handles.append(
                BufferHandle(
                    name=message.name,
                    kind=memory_kind_from_proto(message.kind, f"{where}.kind"),
                    size_bytes=message.size_bytes,
                    shm_name=message.shm_name,
                    ipc_handle=message.ipc_handle,
                    device_id=message.device_id,
                    offset_bytes=message.offset_bytes,
                )
            )
        except InvalidInputError as exc:
            raise InvalidInputError(
                exc.field if exc.field.startswith(field) else f"{where}.{exc.field}", exc.detail
            ) from exc
    names = [h.name for h in handles]
    if len(set(names)) != len(names):
        raise InvalidInputError(field, "buffer names repeat")
    return handles


def bound_to_proto(name: str, buffer: BoundBuffer) -> pb.RegisteredBuffer:
    return pb.RegisteredBuffer(
        name=name,
        kind=_MEMORY_TO_PB[buffer.kind],
        address=buffer.address,
        size_bytes=buffer.size_bytes,
        device_id=buffer.device_id,
    )


def bound_from_proto(
    messages: Iterable[pb.RegisteredBuffer], field: str = "buffers"
) -> dict[str, BoundBuffer]:
    bound: dict[str, BoundBuffer] = {}
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not message.name or message.name in bound:
            raise InvalidInputError(
                f"{where}.name", f"empty or repeated name {shown(message.name)}"
            )
        if message.address == 0 or message.size_bytes == 0:
            raise InvalidInputError(where, "address and size_bytes must be non-zero")
        if message.address + message.size_bytes > 1 << 64:
            raise InvalidInputError(
                where, "address + size_bytes runs past the end of a 64-bit address space"
            )
        bound[message.name] = BoundBuffer(
            address=message.address,
            size_bytes=message.size_bytes,
            device_id=message.device_id,
            kind=memory_kind_from_proto(message.kind, f"{where}.kind"),
        )
    return bound


def params_to_proto(params: TransferParams) -> pb.TransferParams:
    return pb.TransferParams(
        peer_address=params.peer_address,
        engine_id=params.engine_id,
        epoch=params.epoch,
        tp_rank=params.tp_rank,
        request_id=params.request_id,
        num_tokens=params.num_tokens,
        spans=[span_to_proto(s) for s in params.spans],
        mode=_MODE_TO_PB[params.mode],
    )


def params_from_proto(message: pb.TransferParams, field: str = "params") -> TransferParams:
    spans = spans_from_proto(message.spans, f"{field}.spans")
    mode = mode_from_proto(message.mode, f"{field}.mode")
    try:
        return TransferParams(
            peer_address=message.peer_address,
            engine_id=message.engine_id,
            epoch=message.epoch,
            tp_rank=message.tp_rank,
            request_id=message.request_id,
            num_tokens=message.num_tokens,
            spans=spans,
            mode=mode,
        )
    except InvalidInputError as exc:
        name = exc.field.removeprefix("params.")
        raise InvalidInputError(f"{field}.{name}", exc.detail) from exc


def publication_to_proto(publication: Publication) -> pb.Publication:
    return pb.Publication(
        peer_address=publication.peer_address,
        engine_id=publication.engine_id,
        epoch=publication.epoch,
        tp_rank=publication.tp_rank,
        request_id=publication.request_id,
    )


def publication_from_proto(message: pb.Publication, field: str) -> Publication:
    try:
        return Publication(
            message.peer_address,
            message.engine_id,
            message.epoch,
            message.tp_rank,
            message.request_id,
        )
    except InvalidInputError as exc:
        name = exc.field.removeprefix("publication.")
        raise InvalidInputError(f"{field}.{name}", exc.detail) from exc


def failed_to_proto(failed: Mapping[int, tuple[int, ...]]) -> list[pb.GroupBlocks]:
    return [
        pb.GroupBlocks(group_id=g, logical_blocks=list(blocks))
        for g, blocks in sorted(failed.items())
    ]


def spans_failed_from_proto(
    messages: Iterable[pb.GroupBlocks], field: str
) -> dict[int, tuple[int, ...]]:
    """Failed blocks per group, each group once (blocks are checked against the plan)."""
    failed: dict[int, tuple[int, ...]] = {}
    for i, message in enumerate(messages):
        if message.group_id in failed:
            raise InvalidInputError(f"{field}[{i}].group_id", f"group {message.group_id} repeats")
        blocks = tuple(message.logical_blocks)
        if len(set(blocks)) != len(blocks):
            raise InvalidInputError(f"{field}[{i}].logical_blocks", "blocks repeat")
        failed[message.group_id] = blocks
    return failed


def abort_state_to_proto(state: AbortState) -> pb.AbortState.ValueType:
    return _ABORT_TO_PB[state]


def abort_state_from_proto(value: int, field: str = "state") -> AbortState:
    state: AbortState | None = _ABORT_FROM_PB.get(value)  # type: ignore[call-overload]
    if state is None:
        raise InvalidInputError(field, f"unknown abort state {value}")
    return state


def _done_to_proto(event: PullDone) -> pb.PullDone:
    return pb.PullDone(
        request_id=event.request_id,
        status=_STATUS_TO_PB[event.status],
        failed_blocks=failed_to_proto(event.failed_blocks),
        valid_tokens=event.valid_tokens,
        bytes_moved=event.bytes_moved,
        duration_us=round(event.duration_s * 1e6),
        reason=event.reason,
    )


def _done_from_proto(done: pb.PullDone, kind: type[PullDone]) -> PullDone:
    return kind(
        request_id=done.request_id,
        status=_STATUS_FROM_PB.get(done.status, PullStatus.FAILED),
        failed_blocks={g.group_id: tuple(g.logical_blocks) for g in done.failed_blocks},
        valid_tokens=done.valid_tokens,
        bytes_moved=done.bytes_moved,
        duration_s=done.duration_us / 1e6,
        reason=done.reason,
    )


def status_to_proto(status: PullStatus) -> pb.PullStatus.ValueType:
    return _STATUS_TO_PB[status]


def event_to_proto(event: EngineEvent) -> pb.WatchEventsResponse:
    if isinstance(event, Received):
        return pb.WatchEventsResponse(received=_done_to_proto(event))
    if isinstance(event, Pushed):
        return pb.WatchEventsResponse(pushed=_done_to_proto(event))
    if isinstance(event, PullDone):
        return pb.WatchEventsResponse(pull_done=_done_to_proto(event))
    if isinstance(event, Released):
        return pb.WatchEventsResponse(
            released=pb.Released(
                request_id=event.request_id,
                reason=_REASON_TO_PB[event.reason],
                bytes_read=event.bytes_read,
            )
        )
    return pb.WatchEventsResponse(
        lease_expired=pb.LeaseExpired(
            request_id=event.request_id, held_ms=round(event.held_s * 1000)
        )
    )


def event_from_proto(message: pb.WatchEventsResponse) -> EngineEvent:
    which = message.WhichOneof("event")
    if which == "pull_done":
        return _done_from_proto(message.pull_done, PullDone)
    if which == "received":
        return _done_from_proto(message.received, Received)
    if which == "pushed":
        return _done_from_proto(message.pushed, Pushed)
    if which == "released":
        return Released(
            request_id=message.released.request_id,
            reason=release_reason_from_proto(message.released.reason),
            bytes_read=message.released.bytes_read,
        )
    if which == "lease_expired":
        return LeaseExpired(
            request_id=message.lease_expired.request_id,
            held_s=message.lease_expired.held_ms / 1000,
        )
    raise InvalidInputError("event", "empty event")


def release_reason_to_proto(reason: ReleaseReason) -> pb.ReleaseReason.ValueType:
    return _REASON_TO_PB[reason]


def release_reason_from_proto(value: int, field: str = "reason") -> ReleaseReason:
    reason: ReleaseReason | None = _REASON_FROM_PB.get(value)  # type: ignore[call-overload]
    if reason is None:
        raise InvalidInputError(field, f"unknown release reason {value}")
    return reason


@dataclass(frozen=True)
class PeerHello:
    """A serving sidecar's handshake answer, decoded and validated."""

    protocol_version: int
    epoch: int
    engine_id: str
    sidecar_id: str
    layout: EngineLayout
    buffers: dict[str, BoundBuffer]
    agent_metadata: bytes
    lease_ttl_s: float
    registration_version: int
    # What the serving sidecar accepts as the passive side (its transfer.modes); a
    # sidecar of before push sends none: pull only.
    modes: frozenset[TransferMode] = frozenset({TransferMode.PULL})
    # Its peer lane's TCP port on the host the handshake went to; 0: none, use gRPC.
    lane_port: int = 0


def hello_request(
    layout: EngineLayout,
    *,
    epoch: int,
    sidecar_id: str,
    dry_run: bool,
    peer_tp_rank: int | None = None,
) -> pb.HandshakeRequest:
    """What a pulling sidecar (or a dry run from the CLI or the bench) sends; the
    serving rank is `peer_tp_rank`, else the pulling engine's own."""
    message = pb.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION,
        epoch=epoch,
        sidecar_id=sidecar_id,
        layout=layout_to_proto(layout),
        dry_run=dry_run,
    )
    if peer_tp_rank is not None and peer_tp_rank != layout.tp_rank:
        message.peer_tp_rank = peer_tp_rank
    return message


def hello_to_proto(hello: PeerHello) -> pb.HandshakeResponse:
    return pb.HandshakeResponse(
        protocol_version=hello.protocol_version,
        epoch=hello.epoch,
        engine_id=hello.engine_id,
        layout=layout_to_proto(hello.layout),
        buffers=[bound_to_proto(n, b) for n, b in hello.buffers.items()],
        agent_metadata=hello.agent_metadata,
        lease_ttl_ms=round(hello.lease_ttl_s * 1000),
        sidecar_id=hello.sidecar_id,
        registration_version=hello.registration_version,
        modes=[_MODE_TO_PB[m] for m in sorted(hello.modes)],
        lane_port=hello.lane_port,
    )


def hello_from_proto(message: pb.HandshakeResponse, dry_run: bool) -> PeerHello:
    """Decode a handshake answer; a real one must carry NIXL metadata and every buffer
    its layout's regions name."""
    layout = layout_from_proto(message.layout, "handshake.layout")
    buffers = bound_from_proto(message.buffers, "handshake.buffers")
    if not dry_run:
        if not message.agent_metadata:
            raise InvalidInputError("handshake.agent_metadata", "missing")
        for region in layout.regions:
            if region.buffer not in buffers:
                raise InvalidInputError(
                    "handshake.buffers",
                    f"region {shown(region.name)} names unknown {shown(region.buffer)}",
                )
    if message.epoch == 0:
        raise InvalidInputError("handshake.epoch", "must be non-zero")
    return PeerHello(
        protocol_version=message.protocol_version,
        epoch=message.epoch,
        engine_id=message.engine_id,
        sidecar_id=message.sidecar_id,
        layout=layout,
        buffers=buffers,
        agent_metadata=message.agent_metadata,
        lease_ttl_s=message.lease_ttl_ms / 1000,
        registration_version=message.registration_version,
        modes=frozenset(
            mode_from_proto(m, f"handshake.modes[{i}]") for i, m in enumerate(message.modes)
        )
        or frozenset({TransferMode.PULL}),
        lane_port=_lane_port(message.lane_port),
    )


def _lane_port(port: int) -> int:
    if port > 65535:
        raise InvalidInputError("handshake.lane_port", f"{port} is not a TCP port")
    return port
