"""The peer port's gate: every kvxfer call on it passes here before its servicer runs.

One gRPC server interceptor wraps each unary `kvxfer.v1.*` method of the peer
server and, in this order:

1. refuses a body larger than its RPC can need (`MAX_REQUEST_BYTES`, checked
   on the raw bytes before protobuf allocates anything) and a body that does
   not decode: INVALID_ARGUMENT naming the method, with at most one log line
   per `LOG_EVERY_S` (the port is reachable by untrusted clients: a flood of
   junk must not become a flood of tracebacks);
2. with mTLS and an allow-list, refuses a client certificate not on it:
   PERMISSION_DENIED, for PeerService and AdminService alike;
3. bounds the calls one client identity runs at once
   (`limits.max_calls_per_peer`): RESOURCE_EXHAUSTED beyond it.

`identity()` is the caller as the lease table binds reads to it: the
certificate's common name with mTLS, else `anonymous` (then a per-read token
binds the read; see `LeaseTable.begin_read`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from kvxfer._exceptions import BusyError, InvalidInputError, PermissionDeniedError
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import Settings
from kvxfer.server.status import abort_with

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
LOG_EVERY_S = 10.0
_KIB = 1 << 10
# What a real request of each RPC can need, with room to spare. Handshake
# carries the reader's layout (groups, layers, regions: tens of KiB for the
# largest models); Heartbeat carries up to limits.max_heartbeat_ids ids of at
# most 256 bytes each, and so does HoldLeases; the rest carry one request id or nothing.
MAX_REQUEST_BYTES: dict[str, int] = {
    "/kvxfer.v1.PeerService/Handshake": 1024 * _KIB,
    "/kvxfer.v1.PeerService/BeginRead": 4 * _KIB,
    "/kvxfer.v1.PeerService/Heartbeat": 2048 * _KIB,
    "/kvxfer.v1.PeerService/HoldLeases": 2048 * _KIB,
    "/kvxfer.v1.PeerService/EndRead": 4 * _KIB,
    "/kvxfer.v1.PeerService/BeginWrite": 4 * _KIB,
    # failed blocks of every group: up to limits.max_blocks_per_request ids of 10 bytes
    "/kvxfer.v1.PeerService/EndWrite": 2048 * _KIB,
    "/kvxfer.v1.AdminService/GetStatus": 1 * _KIB,
    "/kvxfer.v1.AdminService/ListPeers": 1 * _KIB,
}
PEER_SERVER_MAX_RECEIVE_BYTES = max(MAX_REQUEST_BYTES.values())
Context = grpc.aio.ServicerContext[Any, Any]
if TYPE_CHECKING:  # the stubs' generic; not subscriptable at run time
    Handler = grpc.RpcMethodHandler[Any, Any]


class Refused:
    """What the deserializer hands on instead of a message it would not decode;
    `kind` is the `kvxfer_refusals_total` reason (too_large, undecodable)."""

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        self.reason = reason


def identity(context: Context) -> str:
    """The authenticated caller: its certificate's common name, or `anonymous`."""
    names = context.auth_context().get("x509_common_name", [])
    return min(n.decode(errors="replace") for n in names) if names else ANONYMOUS


def client_host(peer: str) -> str:
    """The host part of a `context.peer()` (`ipv4:HOST:PORT`, `ipv6:[HOST]:PORT`): gRPC
    percent-encodes an IPv6 host's brackets (`ipv6:%5B::1%5D:PORT`) where the peer lane
    spells them plainly, and one client must count once on both."""
    return unquote(peer).rpartition(":")[0]


class PeerPortGuard(grpc.aio.ServerInterceptor):
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._allowed = frozenset(settings.tls.allowed_peers)
        self._max_calls = settings.limits.max_calls_per_peer
        self._calls: dict[str, int] = {}
        self._metrics = metrics
        self._refusals = Refusals(metrics)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        method = details.method
        if handler is None or handler.unary_unary is None or method not in MAX_REQUEST_BYTES:
            return handler
        behavior: Any = handler.unary_unary
        deserialize = _checked_decoder(handler, method, MAX_REQUEST_BYTES[method])

        async def guarded(request: Any, context: Context) -> Any:
            return await self.run(method, request, context, behavior)

        wrapped: Any = guarded  # an async behavior: the stubs only know the sync signature
        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )

    async def run(
        self,
        method: str,
        request: Any,
        context: Context,
        behavior: Callable[[Any, Context], Awaitable[Any]],
        transport: str = "grpc",
    ) -> Any:
        """One call through the gate (the peer lane's calls too, `transport` lane):
        `request` is the decoded message or what `checked_decode` refused."""
        await self._refusals.check(request, method, context)
        who = await self._authorize(context)
        if who == ANONYMOUS:  # no certificate: count by the client's host instead
            who = client_host(context.peer()) or ANONYMOUS
        if self._calls.get(who, 0) >= self._max_calls:
            self._metrics.refusals.labels("too_many_calls").inc()
            await abort_with(
                context,
                BusyError(
                    f"limits.max_calls_per_peer: {self._max_calls} calls from {who} already running"
                ),
            )
        self._calls[who] = self._calls.get(who, 0) + 1
        self._metrics.peer_calls.labels(method.rpartition("/")[2], transport).inc()
        try:
            return await behavior(request, context)
        finally:
            self._calls[who] -= 1
            if not self._calls[who]:
                del self._calls[who]

    async def _authorize(self, context: Context) -> str:
        """With an allow-list, the client certificate's common name must be on it."""
        who = identity(context)
        if self._allowed:
            names = {
                n.decode(errors="replace")
                for n in context.auth_context().get("x509_common_name", [])
            }
            if not names & self._allowed:
                self._metrics.refusals.labels("not_allowed").inc()
                await abort_with(
                    context,
                    PermissionDeniedError(
                        f"peer certificate {sorted(names) or ['none']} is not in tls.allowed_peers"
                    ),
                )
        return who


class EngineSocketGuard(grpc.aio.ServerInterceptor):
    """The engine socket's gate: a body that does not decode gets INVALID_ARGUMENT (and
    at most one log line per `LOG_EVERY_S`), never UNKNOWN and a traceback. Only local
    callers reach it (a 0600 unix socket), so there are no per-RPC caps beyond the
    server's message limit and no identities here (callers.py identifies engines)."""

    def __init__(self, metrics: Metrics) -> None:
        self._refusals = Refusals(metrics)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith("/kvxfer.v1."):
            return handler
        deserialize = _checked_decoder(handler, method, None)
        refusals = self._refusals
        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary

            async def guarded(request: Any, context: Context) -> Any:
                await refusals.check(request, method, context)
                return await unary(request, context)

            wrapped: Any = guarded
            return grpc.unary_unary_rpc_method_handler(
                wrapped, request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )  # fmt: skip
        if handler.unary_stream is not None:
            stream: Any = handler.unary_stream

            async def guarded_stream(request: Any, context: Context) -> AsyncIterator[Any]:
                await refusals.check(request, method, context)
                async for item in stream(request, context):
                    yield item

            wrapped_stream: Any = guarded_stream
            return grpc.unary_stream_rpc_method_handler(
                wrapped_stream, request_deserializer=deserialize,
                response_serializer=handler.response_serializer,
            )  # fmt: skip
        return handler


def _checked_decoder(handler: Handler, method: str, limit: int | None) -> Callable[[bytes], Any]:
    """The handler's deserializer, handing on `Refused` for an oversized or undecodable
    body instead of raising (which gRPC would turn into UNKNOWN and a traceback)."""
    decode: Any = handler.request_deserializer
    return lambda raw: checked_decode(decode, raw, method, limit)


def checked_decode(
    decode: Callable[[bytes], Any], raw: bytes, method: str, limit: int | None
) -> Any:
    """`decode(raw)`, or `Refused` for a body over `limit` bytes or one that does not
    decode."""
    if limit is not None and len(raw) > limit:
        return Refused(
            "too_large", f"{len(raw)} bytes exceed the {limit} a {method} request may use"
        )
    try:
        return decode(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        return Refused("undecodable", f"undecodable request body ({type(exc).__name__})")


class Refusals:
    """Aborts a refused request with INVALID_ARGUMENT, logging at most a line per
    `LOG_EVERY_S` (junk floods must not become log floods)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._last_log = -LOG_EVERY_S
        self._suppressed = 0

    async def check(self, request: Any, method: str, context: Context) -> None:
        if not isinstance(request, Refused):
            return
        self._metrics.refusals.labels(request.kind).inc()
        now = time.monotonic()
        if now - self._last_log < LOG_EVERY_S:
            self._suppressed += 1
        else:
            more = f" ({self._suppressed} more since the last line)" if self._suppressed else ""
            log.warning("refused a %s request: %s%s", method, request.reason, more)
            self._last_log, self._suppressed = now, 0
        await abort_with(context, InvalidInputError(method, request.reason))
