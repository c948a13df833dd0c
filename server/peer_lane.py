"""The peer lane: a reader's per-request calls to this sidecar without gRPC.

A pull waits for its BeginRead's answer before its PullDone, and over gRPC
that round trip costs about 1.3 ms on a 2-core host (a plain gRPC aio echo
0.7 ms), most of a small pull's fixed cost where the copy itself is short.
The lane carries the same PeerService messages with the framing of
`kvxfer.wire.lane` over one TCP connection per peer, to the same
`PeerServicer` methods, through the same gate as the peer port
(`PeerPortGuard.run`: body limits, the allow-list, `max_calls_per_peer`,
counted together with the gRPC calls), with the same mTLS: with `tls.*` set
the lane requires a client certificate the CA signed and names the caller by
its common name, as gRPC's auth context does; without, it listens only where
the peer port may listen without TLS (settings refuse the rest).

A peer sidecar keeps one connection to it. At most
`limits.max_lane_connections` are served at once: one beyond is turned away
before any of its calls is read (counted as a `too_many_connections`
refusal), and its caller, told so, makes those calls over gRPC. With TLS, a
client has `transfer.rpc_timeout_s` (at most 60 s) to finish its handshake; a
client that takes none of its answers for as long is cut off, its calls
cancelled (server/lane.py: what a connection may hold).

It serves the per-request calls only (BeginRead, Heartbeat, EndRead,
BeginWrite, EndWrite). The handshake stays on gRPC: it tells the peer this
lane's port (`HandshakeResponse.lane_port`), and a peer that got 0 (the lane
is off here, or the sidecar predates it) uses gRPC for everything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import Message

from kvxfer._exceptions import InvalidInputError
from kvxfer.server.guard import MAX_REQUEST_BYTES, PeerPortGuard, checked_decode
from kvxfer.server.lane import LaneContext, LaneListener, unimplemented
from kvxfer.server.metrics import Metrics
from kvxfer.server.peer_tls import server_tls
from kvxfer.server.servicers import PeerServicer
from kvxfer.server.settings import Settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.lane import keep_alive

SERVICE = "/kvxfer.v1.PeerService/"
TLS_HANDSHAKE_MAX_S = 60.0  # asyncio's default
REQUESTS: dict[str, type[Message]] = {
    "BeginRead": pb.BeginReadRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "HoldLeases": pb.HoldLeasesRequest,
    "EndRead": pb.EndReadRequest,
    "BeginWrite": pb.BeginWriteRequest,
    "EndWrite": pb.EndWriteRequest,
}


def common_name(certificate: dict[str, Any] | None) -> tuple[bytes, ...]:
    """The subject's first common name of a verified certificate
    (`SSLObject.getpeercert()`), as gRPC's auth context gives it: a certificate with
    several is the same caller on both transports, checked against the allow-list by
    the same name."""
    for rdn in (certificate or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return (value.encode(),)
    return ()


def grpc_peer(address: Any) -> str:
    """A TCP peer as gRPC's `context.peer()` spells it (ipv4:HOST:PORT, ipv6:[HOST]:PORT),
    so the guard counts a client's lane and gRPC calls as one."""
    if not isinstance(address, tuple) or len(address) < 2:
        return "unknown:"
    host, port = address[0], address[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


class PeerLane(LaneListener):
    name = "peer lane"
    # A frame is one request: its body within the method's limit (a larger one is
    # refused by the gate, as over gRPC), its method name within 256 bytes.
    max_frame_bytes = max(MAX_REQUEST_BYTES[SERVICE + m] for m in REQUESTS) + 256

    def __init__(
        self, servicer: PeerServicer, guard: PeerPortGuard, settings: Settings, metrics: Metrics
    ) -> None:
        super().__init__()
        self._servicer = servicer
        self._guard = guard
        self._settings = settings
        self._metrics = metrics
        # One client's calls beyond the gate's limit would be refused anyway: beyond it
        # its connection waits (backpressure) instead of piling up tasks and answers.
        self.max_calls_per_connection = settings.limits.max_calls_per_peer
        # A peer sidecar keeps one connection; a client opening them without end is
        # turned away beyond this, and a peer turned away calls over gRPC.
        self.max_connections = settings.limits.max_lane_connections
        # A client that has taken none of its answers for a peer call's deadline has no
        # call left waiting for one: its connection is aborted rather than held.
        self.drain_deadline_s = settings.transfer.rpc_timeout_s

    def stalled(self, unsent_bytes: int) -> None:
        self._metrics.lane_stalled.inc()
        super().stalled(unsent_bytes)

    def turned_away(self) -> str:
        self._metrics.refusals.labels("too_many_connections").inc()
        return f"limits.max_lane_connections: {super().turned_away()}"

    async def start(self, host: str) -> int:
        """Listen on `host` (the peer port's) at `lane.port`; the port it got."""
        port = self._settings.lane.port
        try:
            tls = server_tls(self._settings)
            self._server = await asyncio.start_server(
                self._accept,
                host=host.strip("[]"),
                port=port,
                ssl=tls,
                # A client that has not finished its TLS handshake within a peer call's
                # deadline could not have made a call in time: it holds no socket longer
                # (nor ever longer than asyncio's own default).
                ssl_handshake_timeout=(
                    min(self._settings.transfer.rpc_timeout_s, TLS_HANDSHAKE_MAX_S) if tls else None
                ),
            )
        except OSError as exc:
            raise InvalidInputError(
                "lane.port",
                f"cannot serve the peer lane on {host}:{port}: {exc.strerror or exc} (is "
                "something else listening there? lane.port 0 takes any free port)",
            ) from exc
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    def context(self, writer: asyncio.StreamWriter) -> LaneContext:
        """Once per connection: who is calling, and keepalive on its socket."""
        keep_alive(writer)
        names: tuple[bytes, ...] = ()
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object is not None:
            names = common_name(ssl_object.getpeercert())
        return LaneContext(names, grpc_peer(writer.get_extra_info("peername")))

    async def decode(self, method: str, body: bytes, stream: bool) -> Any:
        cls = None if stream else REQUESTS.get(method)
        if cls is None:
            raise unimplemented(self.name, method, REQUESTS)
        # What the gate refuses (too large, undecodable) is handed on to it as over gRPC.
        return checked_decode(
            cls.FromString, body, SERVICE + method, MAX_REQUEST_BYTES[SERVICE + method]
        )

    async def unary(self, method: str, request: Any, context: LaneContext) -> Message:
        behavior = getattr(self._servicer, method)
        grpc_like: Any = context  # the part of a gRPC context the gate and servicer use
        reply: Message = await self._guard.run(
            SERVICE + method, request, grpc_like, behavior, transport="lane"
        )
        return reply

    def stream(self, method: str, request: Any, context: LaneContext) -> AsyncIterator[Message]:
        raise AssertionError("the peer lane serves no streams")  # decode refused it
