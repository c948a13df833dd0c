"""The lanes' serving end, and the engine lane: EngineService's per-request calls over
a plain unix socket. (`LaneListener` and its connections serve the peer lane too:
server/peer_lane.py.)

Served beside the unix engine socket (its path plus `.lane`, created 0600 like
it), with the framing of `kvxfer.wire.lane`. Every call goes to the same
`EngineServicer` method as over gRPC, with a context whose `abort` ends the
call with the same google.rpc status; a body that does not decode is refused
as the engine socket's guard refuses it. Registration stays on gRPC: it
identifies the engine's process by the gRPC socket's peer credentials, and the
engine id it returns is what every lane call names.

One connection carries any number of concurrent calls; a stream (WatchEvents)
runs until the sidecar ends it, the engine cancels it or the connection closes.
A connection that breaks the framing is closed and logged; the sidecar keeps
serving every other. A lane with a connection limit (the peer lane's
`limits.max_lane_connections`) turns a connection beyond it away before reading
any of its calls: an ERROR frame on call id 0, then the connection closes.

What a connection holds is bounded: it is not read while it runs
`max_calls_per_connection` calls, nor while its answers wait unsent beyond its
transport's high-water mark (asyncio's 64 KiB; 512 KiB with TLS), so it holds
that much plus the answers of the calls already running, and a call's request
only until it is decoded. On a lane with a `drain_deadline_s` (the peer lane's),
a connection whose client takes not one byte of its answers for that long (as
its socket counts them: a client reading slowly is making progress) is aborted,
its calls cancelled: TCP never ends a client that keeps its window shut. The
engine lane has none: its socket ends with the engine's process, and cutting off
a busy engine would lose the events written to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import stat
import struct
import termios
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NoReturn

import grpc
import grpc.aio
from google.protobuf.message import Message
from google.rpc import status_pb2

from kvxfer._exceptions import InvalidInputError, shown
from kvxfer.core.throttle import LogThrottle
from kvxfer.server.guard import LOG_EVERY_S, Refusals, checked_decode
from kvxfer.server.metrics import Metrics
from kvxfer.server.servicers import EngineServicer
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.errors import DETAILS_TRAILER
from kvxfer.wire.lane import (
    CONNECTION_ID,
    MAX_PAYLOAD_BYTES,
    Kind,
    LaneProtocolError,
    frame,
    read_frame,
    split_request,
)

log = logging.getLogger(__name__)
CLOSE_FLUSH_S = 1.0  # the most a closing lane waits for a client to take what it was sent

Unary = Callable[[Any, Any], Awaitable[Message]]
Streaming = Callable[[Any, Any], AsyncIterator[Message]]

UNARY_REQUESTS: dict[str, type[Message]] = {
    "Publish": pb.PublishRequest,
    "Pull": pb.PullRequest,
    "Expect": pb.ExpectRequest,
    "Push": pb.PushRequest,
    "Abort": pb.AbortRequest,
    "Hold": pb.HoldRequest,
    "Unregister": pb.UnregisterRequest,
}
STREAM_REQUESTS: dict[str, type[Message]] = {"WatchEvents": pb.WatchEventsRequest}
# How long a turned-away connection is read (and what it sent dropped) until its client
# closes it: closing with its bytes unread would reset it, and the refusal with it.
TURN_AWAY_S = 1.0
# Connections being turned away at once; beyond, one is closed at once, unanswered (a
# client opening them faster than that gets no courtesy, and holds no socket for it).
MAX_TURNING_AWAY = 64
# Linux's SIOCOUTQ: the bytes a socket holds that the other end has not acknowledged.
_SIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None)


class _Aborted(grpc.aio.AbortError):
    """How a lane call ends with an error: raised by `LaneContext.abort`, and passed
    through the servicer's error mapping like gRPC's own AbortError."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


class LaneContext:
    """The part of `grpc.aio.ServicerContext` the servicers, the peer port's guard and
    `abort_with` use: on the peer lane, the caller's certificate names and address as
    gRPC would give them."""

    def __init__(self, names: tuple[bytes, ...] = (), peer: str = "unix:") -> None:
        self._auth = {"x509_common_name": list(names)} if names else {}
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer(self) -> str:
        return self._peer

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: tuple[tuple[str, str | bytes], ...] = (),
    ) -> NoReturn:
        for key, value in trailing_metadata:
            if key == DETAILS_TRAILER and isinstance(value, bytes):
                raise _Aborted(status_pb2.Status.FromString(value))
        raise _Aborted(status_pb2.Status(code=code.value[0], message=details))


class LaneListener:
    """What serves one kind of lane: its listener, its connections and how a call runs
    (the engine's lane and the peer lane differ only in those)."""

    name = "lane"
    max_frame_bytes = MAX_PAYLOAD_BYTES
    # Calls one connection runs at once; beyond, it is not read until one ends. An
    # engine's one connection carries all its pulls' calls (each answered at once).
    max_calls_per_connection = 4096
    # Connections served at once (None: no limit); one beyond is turned away.
    max_connections: int | None = None
    # How long a connection may take none of its answers before it is aborted (None:
    # never; see the module doc).
    drain_deadline_s: float | None = None

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._serving = 0  # of those, the ones not turned away
        self._turning_away = 0  # and the ones being turned away
        self._logs = LogThrottle(LOG_EVERY_S)  # by kind of warning

    def broken(self, exc: LaneProtocolError) -> None:
        """A connection broke the framing and was closed."""
        self._warn("broken", f"{self.name} connection closed: {exc}")

    def turned_away(self) -> str:
        """A connection beyond `max_connections` is being refused: counted and logged
        (a subclass counts it too); what its client is told."""
        reason = (
            f"the {self.name} serves at most {self.max_connections} connections at once "
            "and refused this one before running any call of it"
        )
        self._warn("turned away", f"{self.name}: a connection turned away ({reason})")
        return reason

    def stalled(self, unsent_bytes: int) -> None:
        """A connection was aborted: its client took none of its answers for
        `drain_deadline_s`."""
        self._warn(
            "stalled",
            f"{self.name} connection closed, its calls cancelled: its client read none of "
            f"its answers ({unsent_bytes} bytes unsent) for {self.drain_deadline_s:g}s",
        )

    def _warn(self, kind: str, message: str) -> None:
        """At most one line of each `kind` per LOG_EVERY_S: a client sending junk, or
        opening connections without end, must not flood the log (nor hide the other)."""
        unlogged = self._logs.due(kind)
        if unlogged is None:
            return
        more = f" ({unlogged} more since the last line)" if unlogged else ""
        log.warning("%s%s", message, more)

    def context(self, writer: asyncio.StreamWriter) -> LaneContext:
        return LaneContext()

    async def decode(self, method: str, body: bytes, stream: bool) -> Any:
        """The request of a call; raises `_Aborted` for a method not served here."""
        raise unimplemented(self.name, method, ())

    async def unary(self, method: str, request: Any, context: LaneContext) -> Message:
        raise NotImplementedError

    def stream(self, method: str, request: Any, context: LaneContext) -> AsyncIterator[Message]:
        raise NotImplementedError

    async def close(self) -> None:
        """Stop listening and end every connection: a plain one once what was written to
        it is sent (events included), or CLOSE_FLUSH_S after, if its client is not
        reading (a hung engine must not keep its sidecar from stopping)."""
        if self._server is not None:
            self._server.close()
        for task, writer in list(self._connections.items()):
            if writer.get_extra_info("ssl_object") is not None:
                # No TLS goodbye: a client that stopped reading would hold it for
                # asyncio's 30 s TLS shutdown timeout.
                writer.transport.abort()
            task.cancel()
        ending = list(self._connections)
        if ending:
            _, unflushed = await asyncio.wait(ending, timeout=CLOSE_FLUSH_S)
            for task in unflushed:
                unread = self._connections.get(task)
                if unread is not None:
                    unread.transport.abort()  # its answers will not be read: dropped
        for task in ending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            if self.max_connections is not None and self._serving >= self.max_connections:
                await self._turn_away(reader, writer)
                return
            self._serving += 1
            try:
                await _Connection(self, reader, writer).serve()
            finally:
                self._serving -= 1
        finally:
            self._connections.pop(task, None)

    async def _turn_away(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Refuse a connection before reading any call of it: RESOURCE_EXHAUSTED on call
        id 0, which no call uses (so its client knows none of its calls ran), then close
        it (no TLS goodbye either: nothing more is owed), even when the sidecar shuts
        down meanwhile."""
        why = self.turned_away()
        if self._turning_away >= MAX_TURNING_AWAY:
            writer.transport.abort()
            return
        self._turning_away += 1
        try:
            status = status_pb2.Status(
                code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=why
            )
            writer.write(frame(CONNECTION_ID, Kind.ERROR, status.SerializeToString()))
            async with asyncio.timeout(TURN_AWAY_S):
                await writer.drain()
                while await reader.read(1 << 16):  # until the client has it and closes
                    pass
        except (OSError, TimeoutError, asyncio.CancelledError):
            pass  # it went away, or took too long, or the lane is closing: closed below
        finally:
            self._turning_away -= 1
            writer.transport.abort()


class EngineLane(LaneListener):
    name = "engine lane"

    def __init__(
        self, servicer: EngineServicer, metrics: Metrics, max_message_bytes: int = MAX_PAYLOAD_BYTES
    ) -> None:
        super().__init__()
        self._servicer = servicer
        self._refusals = Refusals(metrics)
        self._max_message_bytes = max_message_bytes  # limits.max_message_bytes, as gRPC's
        self.path = ""

    async def start(self, path: str) -> None:
        """Listen at `path` (0600). The engine socket beside it was claimed first (no
        live sidecar serves there), so a socket file left at `path` is stale and is
        replaced; any other kind of file is refused, never removed."""
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise InvalidInputError(
                    "engine_address", f"{path} (the engine lane) exists and is not a socket"
                )
            os.unlink(path)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=path)
        except OSError as exc:
            raise InvalidInputError(
                "engine_address",
                f"cannot serve the engine lane at {path}: {exc.strerror or exc} (a unix "
                "socket path must be shorter than 108 bytes, this one with its .lane suffix)",
            ) from exc
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self.path = path

    async def close(self) -> None:
        """Stop listening and end every connection (the sidecar has shut down)."""
        await super().close()
        with contextlib.suppress(FileNotFoundError):
            if self.path:
                os.unlink(self.path)

    async def decode(self, method: str, body: bytes, stream: bool) -> Any:
        served = STREAM_REQUESTS if stream else UNARY_REQUESTS
        cls = served.get(method)
        if cls is None:
            raise unimplemented(self.name, method, [*UNARY_REQUESTS, *STREAM_REQUESTS])
        if len(body) > self._max_message_bytes:  # refused as gRPC refuses it: this call only
            raise _Aborted(
                status_pb2.Status(
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                    message=f"limits.max_message_bytes: a {len(body)}-byte {method} request "
                    f"exceeds {self._max_message_bytes} bytes",
                )
            )
        request = checked_decode(cls.FromString, body, f"lane {method}", None)
        context: Any = LaneContext()  # the part of a gRPC context refusing needs
        await self._refusals.check(request, f"lane {method}", context)  # aborts a Refused
        return request

    async def unary(self, method: str, request: Any, context: LaneContext) -> Message:
        handler: Unary = getattr(self._servicer, method)
        return await handler(request, context)

    def stream(self, method: str, request: Any, context: LaneContext) -> AsyncIterator[Message]:
        handler: Streaming = getattr(self._servicer, method)
        return handler(request, context)


class _Connection:
    def __init__(
        self, lane: LaneListener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._lane, self._reader, self._writer = lane, reader, writer
        self._context = lane.context(writer)
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._slot = asyncio.Event()  # set while fewer than max_calls_per_connection run
        self._task: asyncio.Task[Any] | None = None  # the one serving it
        self._written_bytes = 0  # of answers, since it opened
        self._stalled = False

    async def serve(self) -> None:
        self._task = asyncio.current_task()
        try:
            while await self._next_call():
                await self._backpressure()
        except LaneProtocolError as exc:
            self._lane.broken(exc)
        except (OSError, asyncio.CancelledError):  # the client went away (or broke TLS)
            pass
        finally:
            for task in list(self._calls.values()):
                task.cancel()
            self._writer.close()  # after the answers already written, unless it stalls
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await self._unless_stalled(self._writer.wait_closed())

    async def _next_call(self) -> bool:
        """Read a frame and start (or cancel) its call; False at the end of the stream.
        (The frame is not held past this: a call holds its own copy of its request.)"""
        got = await read_frame(self._reader, self._lane.max_frame_bytes)
        if got is None:
            return False
        self._dispatch(*got)
        return True

    async def _backpressure(self) -> None:
        """A client that sends calls faster than it reads their answers stops being read:
        while it runs as many calls as it may (each ends once its answer has drained),
        and while its answers wait unsent beyond the transport's high-water mark."""
        while len(self._calls) >= self._lane.max_calls_per_connection:
            self._slot.clear()
            await self._slot.wait()
        await self._drain()

    def _dispatch(self, call_id: int, kind: Kind, payload: bytes) -> None:
        if call_id == CONNECTION_ID:
            raise LaneProtocolError(f"call id {CONNECTION_ID} is the connection's, not a call's")
        if kind is Kind.CANCEL:
            task = self._calls.get(call_id)
            if task is not None:
                task.cancel()
            return
        if kind not in (Kind.UNARY, Kind.STREAM):
            raise LaneProtocolError(f"a {kind.name} frame from the client")
        if call_id in self._calls:
            raise LaneProtocolError(f"call id {call_id} is already in use")
        method, body = split_request(payload)
        task = asyncio.create_task(self._call(call_id, method, body, kind is Kind.STREAM))
        self._calls[call_id] = task
        task.add_done_callback(lambda _: self._ended(call_id))

    def _ended(self, call_id: int) -> None:
        self._calls.pop(call_id, None)
        self._slot.set()

    def _send(self, call_id: int, kind: Kind, payload: bytes = b"") -> None:
        if not self._writer.is_closing():
            data = frame(call_id, kind, payload)
            self._writer.write(data)
            self._written_bytes += len(data)

    async def _call(self, call_id: int, method: str, body: bytes, stream: bool) -> None:
        """Run one call; whatever it raises ends it with an ERROR frame, so no call is
        left without an answer (a lost connection has nobody left to answer)."""
        answer = self._answer(call_id, method, body, stream)
        del body  # `answer` holds it until it is decoded, not while the answer drains
        try:
            await answer
        except _Aborted as exc:
            self._send(call_id, Kind.ERROR, exc.status.SerializeToString())
        except ConnectionError:
            pass
        except Exception:
            log.exception("%s %s failed", self._lane.name, method)
            self._send(call_id, Kind.ERROR, _internal(self._lane.name, method))
        # The call ends once its answer is on its way (see _backpressure).
        with contextlib.suppress(OSError):
            await self._drain()

    async def _answer(self, call_id: int, method: str, body: bytes, stream: bool) -> None:
        request = await self._lane.decode(method, body, stream)
        del body  # decoded: no longer held by the call
        if not stream:
            reply = await self._lane.unary(method, request, self._context)
            self._send(call_id, Kind.REPLY, reply.SerializeToString())
            return
        async for item in self._lane.stream(method, request, self._context):
            self._send(call_id, Kind.ITEM, item.SerializeToString())
            await self._drain()
        self._send(call_id, Kind.END)

    async def _drain(self) -> None:
        """Until the transport takes more answers (at once unless its buffer passed the
        high-water mark); raises ConnectionResetError if the connection is lost."""
        transport = self._writer.transport
        # At or below the low-water mark the transport is not paused (it resumes there):
        # drain returns at once, and no stall watch (a task and a timer) is armed.
        if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[0]:
            await self._writer.drain()
        else:
            await self._unless_stalled(self._writer.drain())

    async def _unless_stalled(self, waiting: Awaitable[None]) -> None:
        """Await `waiting`; on a lane with a `drain_deadline_s`, a client that takes not
        one byte of its answers for that long has its connection aborted and its calls
        cancelled instead (ConnectionResetError). Each waiter watches its own window: a
        client reading at any pace is never cut off."""
        deadline_s = self._lane.drain_deadline_s
        if deadline_s is None:
            await waiting
            return
        task = asyncio.ensure_future(waiting)
        try:
            while True:
                taken = self._taken_bytes()
                done, _ = await asyncio.wait((task,), timeout=deadline_s)
                if done:
                    task.result()  # raises what the wait raised
                    return
                if self._taken_bytes() <= taken:
                    self._abort_stalled()
                    raise ConnectionResetError(f"the {self._lane.name} client stalled")
        finally:
            task.cancel()

    def _taken_bytes(self) -> int:
        """How much of its answers the client has taken: written, less what waits in the
        transport and what the socket holds unacknowledged. Where the kernel cannot be
        asked, what it holds counts as taken once handed to it, so a slow client may
        look stalled (never a stalled one alive); with TLS, what waits below the TLS
        layer is not seen (off by that transport's buffer at most)."""
        unsent = self._writer.transport.get_write_buffer_size()
        return self._written_bytes - unsent - _unacknowledged_bytes(self._writer)

    def _abort_stalled(self) -> None:
        if self._stalled:
            return
        self._stalled = True
        self._lane.stalled(self._written_bytes - self._taken_bytes())
        self._writer.transport.abort()  # no TLS goodbye: it would not be read either
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()  # serve ends, cancelling the calls


def _unacknowledged_bytes(writer: asyncio.StreamWriter) -> int:
    """What the connection's socket holds that the other end has not acknowledged (0 when
    the kernel cannot be asked, or the socket is closed)."""
    sock = writer.get_extra_info("socket")
    fd = -1 if sock is None else sock.fileno()
    if fd < 0 or _SIOCOUTQ is None:
        return 0
    try:
        queued: int = struct.unpack("i", fcntl.ioctl(fd, _SIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return 0
    return queued


def unimplemented(lane: str, method: str, served: Iterable[str]) -> _Aborted:
    return _Aborted(
        status_pb2.Status(
            code=grpc.StatusCode.UNIMPLEMENTED.value[0],
            message=f"method: the {lane} serves {', '.join(sorted(served))}, not {shown(method)}",
        )
    )


def _internal(lane: str, method: str) -> bytes:
    message = f"internal error serving {method} on the {lane}; see the sidecar log"
    status = status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message)
    return status.SerializeToString()
