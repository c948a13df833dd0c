"""Thin gRPC servicers: decode the request, call the Sidecar, encode the answer.

A kvxfer error ends the call through `kvxfer.server.status.abort_with`: the
status code from its one table, a message naming the field or entity, and
google.rpc rich details (a negotiation failure's mismatches field by field).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvxfer._exceptions import InvalidInputError, KvxferError
from kvxfer.core.requests import Publication, TransferParams
from kvxfer.server.callers import claimed_pid
from kvxfer.server.destinations import WriteEnd
from kvxfer.server.guard import identity
from kvxfer.server.leases import LeaseState
from kvxfer.server.sidecar import Sidecar
from kvxfer.server.status import abort_with
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.layout import layout_from_proto, span_to_proto, spans_from_proto
from kvxfer.wire.sidecar import (
    abort_state_to_proto,
    event_to_proto,
    handles_from_proto,
    hello_to_proto,
    params_from_proto,
    params_to_proto,
    publication_from_proto,
    release_reason_from_proto,
    spans_failed_from_proto,
)

Context = grpc.aio.ServicerContext[Any, Any]
S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")

_LEASE_STATE_TO_PB = {
    LeaseState.HELD: pb.LEASE_STATE_HELD,
    LeaseState.READING: pb.LEASE_STATE_HELD,
    LeaseState.ABORTED: pb.LEASE_STATE_ABORTED,
    None: pb.LEASE_STATE_UNKNOWN,
}


def rpc(
    method: Callable[[S, Req, Context], Awaitable[Resp]],
) -> Callable[[S, Req, Context], Awaitable[Resp]]:
    """Map kvxfer errors to their status code; anything else to INTERNAL, logged."""

    @functools.wraps(method)
    async def wrapper(self: S, request: Req, context: Context) -> Resp:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return wrapper


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    @rpc
    async def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: Context
    ) -> pb.RegisterEngineResponse:
        layout = layout_from_proto(request.layout, "layout")
        handles = handles_from_proto(request.buffers, "buffers")
        pid = claimed_pid(context.invocation_metadata())
        engine = await self._sidecar.register_engine(layout, handles, request.engine_name, pid)
        return pb.RegisterEngineResponse(
            engine_id=engine.engine_id,
            epoch=self._sidecar.epoch,
            peer_address=self._sidecar.address,
        )

    @rpc
    async def Publish(self, request: pb.PublishRequest, context: Context) -> pb.PublishResponse:
        spans = spans_from_proto(request.spans, "spans")
        params = await self._sidecar.publish(
            request.engine_id, request.request_id, request.num_tokens, spans
        )
        ttl_ms = round(self._sidecar.lease_ttl_s() * 1000)
        return pb.PublishResponse(params=params_to_proto(params), lease_ttl_ms=ttl_ms)

    @rpc
    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.PullResponse:
        params = self._peer_params(request)
        local = spans_from_proto(request.local_spans, "local_spans")
        accepted = await self._sidecar.pull(
            request.engine_id, params, local, request.computed_tokens
        )
        return pb.PullResponse(
            bytes_planned=accepted.bytes_planned,
            full_attention_bytes=accepted.full_attention_bytes,
            chunks=accepted.chunks,
            descriptors=accepted.descriptors,
        )

    @rpc
    async def Expect(self, request: pb.ExpectRequest, context: Context) -> pb.ExpectResponse:
        spans = spans_from_proto(request.spans, "spans")
        params = self._sidecar.push_side.expect(
            request.engine_id, request.request_id, request.num_tokens, spans,
            request.computed_tokens,
        )  # fmt: skip
        ttl_ms = round(self._sidecar.lease_ttl_s() * 1000)
        return pb.ExpectResponse(params=params_to_proto(params), lease_ttl_ms=ttl_ms)

    @rpc
    async def Push(self, request: pb.PushRequest, context: Context) -> pb.PushResponse:
        params = self._peer_params(request)
        local = spans_from_proto(request.local_spans, "local_spans")
        accepted = await self._sidecar.push_side.push(
            request.engine_id, params, local, request.tokens_ready, request.final
        )
        return pb.PushResponse(
            bytes_planned=accepted.bytes_planned,
            chunks=accepted.chunks,
            chunks_posted=accepted.chunks_posted,
        )

    def _peer_params(self, request: pb.PullRequest | pb.PushRequest) -> TransferParams:
        """The params of another sidecar's request: never this sidecar's own."""
        if not request.HasField("params"):
            raise InvalidInputError("params", "missing")
        params = params_from_proto(request.params, "params")
        self._not_ours(params, "params")
        return params

    def _peer_publication(self, message: pb.Publication, field: str) -> Publication:
        publication = publication_from_proto(message, field)
        self._not_ours(publication, field)
        return publication

    def _not_ours(self, named: TransferParams | Publication, field: str) -> None:
        """Params or a publication of another sidecar's: never this sidecar's own."""
        if named.epoch == self._sidecar.epoch or named.peer_address == self._sidecar.address:
            raise InvalidInputError(
                f"{field}.peer_address",
                f"{named.peer_address} (epoch {named.epoch}) is this sidecar itself: "
                "transfer with the sidecar that published or expects the request",
            )

    @rpc
    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        state = await self._sidecar.abort(request.engine_id, request.request_id)
        return pb.AbortResponse(state=abort_state_to_proto(state))

    @rpc
    async def Hold(self, request: pb.HoldRequest, context: Context) -> pb.HoldResponse:
        publications = [
            self._peer_publication(p, f"publications[{i}]")
            for i, p in enumerate(request.publications)
        ]
        states, interval_s = await self._sidecar.hold(request.engine_id, publications)
        return pb.HoldResponse(states=states, interval_ms=round(interval_s * 1000))

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        try:
            events = self._sidecar.watch(request.engine_id)
            async for event in events:
                yield event_to_proto(event)
        except KvxferError as exc:
            await abort_with(context, exc)

    @rpc
    async def Unregister(
        self, request: pb.UnregisterRequest, context: Context
    ) -> pb.UnregisterResponse:
        released, cancelled = await self._sidecar.unregister(request.engine_id)
        return pb.UnregisterResponse(released_leases=released, cancelled_pulls=cancelled)


class PeerServicer(pb_grpc.PeerServiceServicer):
    """The allow-list, body limits and call bounds are checked before these run, by
    `kvxfer.server.guard.PeerPortGuard`; here each read is bound to its caller."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    @rpc
    async def Handshake(
        self, request: pb.HandshakeRequest, context: Context
    ) -> pb.HandshakeResponse:
        layout = layout_from_proto(request.layout, "layout")
        rank = request.peer_tp_rank if request.HasField("peer_tp_rank") else layout.tp_rank
        hello = await self._sidecar.read_side.hello(request.protocol_version, rank, request.dry_run)
        return hello_to_proto(hello)

    @rpc
    async def BeginRead(
        self, request: pb.BeginReadRequest, context: Context
    ) -> pb.BeginReadResponse:
        lease = self._sidecar.read_side.begin_read(
            request.epoch, request.tp_rank, request.request_id, identity(context)
        )
        return pb.BeginReadResponse(
            num_tokens=lease.num_tokens,
            spans=[span_to_proto(s) for s in lease.spans],
            lease_ttl_ms=round(self._sidecar.lease_ttl_s() * 1000),
            registration_version=self._sidecar.registration_version,
            read_token=lease.read_token,
        )

    @rpc
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Context
    ) -> pb.HeartbeatResponse:
        states = self._sidecar.read_side.heartbeat(
            request.epoch,
            request.tp_rank,
            list(request.request_ids),
            identity(context),
            list(request.read_tokens),
        )
        return pb.HeartbeatResponse(states=[_LEASE_STATE_TO_PB[s] for s in states])

    @rpc
    async def HoldLeases(
        self, request: pb.HoldLeasesRequest, context: Context
    ) -> pb.HoldLeasesResponse:
        states = self._sidecar.read_side.hold(
            request.epoch, request.tp_rank, list(request.request_ids)
        )
        return pb.HoldLeasesResponse(states=[_LEASE_STATE_TO_PB[s] for s in states])

    @rpc
    async def EndRead(self, request: pb.EndReadRequest, context: Context) -> pb.EndReadResponse:
        reason = release_reason_from_proto(request.reason)
        self._sidecar.read_side.end_read(
            request.epoch,
            request.tp_rank,
            request.request_id,
            reason,
            request.bytes_read,
            reader=identity(context),
            token=request.read_token,
        )
        return pb.EndReadResponse()

    @rpc
    async def BeginWrite(
        self, request: pb.BeginWriteRequest, context: Context
    ) -> pb.BeginWriteResponse:
        lease = self._sidecar.push_side.begin_write(
            request.epoch, request.tp_rank, request.request_id, identity(context)
        )
        return pb.BeginWriteResponse(
            num_tokens=lease.num_tokens,
            spans=[span_to_proto(s) for s in lease.spans],
            computed_tokens=lease.computed_tokens,
            lease_ttl_ms=round(self._sidecar.lease_ttl_s() * 1000),
            registration_version=self._sidecar.registration_version,
            write_token=lease.read_token,
        )

    @rpc
    async def EndWrite(self, request: pb.EndWriteRequest, context: Context) -> pb.EndWriteResponse:
        end = WriteEnd(
            writer=identity(context),
            token=request.write_token,
            reason=release_reason_from_proto(request.reason),
            failed=spans_failed_from_proto(request.failed_blocks, "failed_blocks"),
            bytes_written=request.bytes_written,
            valid_tokens=request.valid_tokens,
            detail=request.detail[:1024],
            settled=request.settled,
        )
        valid = await self._sidecar.push_side.end_write(
            request.epoch, request.tp_rank, request.request_id, end
        )
        return pb.EndWriteResponse(valid_tokens=valid)


class AdminServicer(pb_grpc.AdminServiceServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    @rpc
    async def GetStatus(
        self, request: pb.GetStatusRequest, context: Context
    ) -> pb.GetStatusResponse:
        sidecar = self._sidecar
        now = time.monotonic()
        return pb.GetStatusResponse(
            sidecar_id=sidecar.sidecar_id,
            epoch=sidecar.epoch,
            peer_address=sidecar.address,
            engines=[
                pb.EngineStatus(
                    engine_id=e.engine_id,
                    engine_name=e.name,
                    model=e.layout.model,
                    tp_rank=e.layout.tp_rank,
                    buffers=len(e.buffers),
                    registered_bytes=e.registered_bytes,
                )
                for e in sidecar.engines()
            ],
            leases=[
                pb.LeaseStatus(
                    request_id=lease.request_id,
                    engine_id=lease.engine_id,
                    blocks=lease.blocks,
                    expires_in_ms=round(expires_in * 1000),
                    reading=lease.state is not LeaseState.HELD,
                )
                for lease, expires_in in sidecar.leases()
            ],
            pulls=[
                pb.PullStatusInfo(
                    request_id=p.request_id,
                    peer_address=p.params.peer_address,
                    bytes_planned=p.plan.nbytes,
                    running_ms=round((now - p.started) * 1000),
                )
                for p in sidecar.pulls()
            ],
            uptime_ms=round((now - sidecar.started) * 1000),
        )

    @rpc
    async def ListPeers(
        self, request: pb.ListPeersRequest, context: Context
    ) -> pb.ListPeersResponse:
        return pb.ListPeersResponse(
            peers=[
                pb.PeerInfo(
                    address=link.address,
                    tp_rank=link.tp_rank,
                    epoch=link.epoch,
                    engine_id=link.hello.engine_id,
                    model=link.layout.model,
                    groups=len(link.layout.groups),
                    last_handshake_unix_ms=round(link.last_handshake_unix * 1000),
                    handshakes=link.handshakes,
                    agent_loaded=not link.stale,
                )
                for link in self._sidecar.links.all()
            ]
        )
