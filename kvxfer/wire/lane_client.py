"""The calling end of a lane (`kvxfer.wire.lane`): one connection carrying every call
and stream, multiplexed by call id. An engine's lane to its sidecar (a unix socket;
registration stays on gRPC, `EngineClient.register`) and a sidecar's peer lane to
another (TCP, with the peer port's mTLS: server/peer_lane.py) are both this.

A call that fails at the far end raises the same kvxfer error as over gRPC; a
call with no answer by its deadline raises `PeerUnavailableError` (and is
cancelled at the sidecar); a lost connection fails every call on it, and the
next call connects again. A connection the far end turned away (its limit of
connections) fails its calls with `LaneUnreachableError`: none of them ran.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from kvxfer._exceptions import (
    LaneUnreachableError,
    LimitExceededError,
    PeerUnavailableError,
)
from kvxfer.wire.errors import lane_error
from kvxfer.wire.lane import (
    CONNECTION_ID,
    MAX_PAYLOAD_BYTES,
    Kind,
    LaneProtocolError,
    frame,
    read_frame,
    request_payload,
)
from kvxfer.wire.loops import within

R = TypeVar("R", bound=Message)
_RETRY_S = 0.05
MAX_CALL_ID = (1 << 32) - 1
CLOSE_WAIT_S = 1.0
_Answer = tuple[Kind, bytes]


class _Link:
    """One open connection and the calls waiting on it."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str
    ) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.waiting: dict[int, asyncio.Future[_Answer]] = {}
        self.streams: dict[int, asyncio.Queue[_Answer | None]] = {}
        self.pump: asyncio.Task[None] | None = None
        self.lost = ""
        self.turned_away = False  # by the far end, before it read any call
        self.answered = False  # a frame came: a refusal can no longer (see run)

    async def run(self) -> None:
        try:
            while (got := await read_frame(self.reader)) is not None:
                call_id, kind, payload = got
                if call_id == CONNECTION_ID:
                    # Only as the first frame: after an answer, a call may have run,
                    # and one reported as never run would be sent again over gRPC.
                    if kind is not Kind.ERROR or self.answered:
                        raise LaneProtocolError(f"a {kind.name} frame on call id 0, not first")
                    self.lost = f"{self.name} refused: {_status(payload).message}"
                    self.turned_away = True
                    return
                self.answered = True
                # A stream's frames after the engine cancelled it are dropped.
                streamed = kind is Kind.ERROR and call_id in self.streams
                if kind in (Kind.ITEM, Kind.END) or streamed:
                    queue = self.streams.get(call_id)
                    if queue is not None:
                        queue.put_nowait((kind, payload))
                elif kind in (Kind.REPLY, Kind.ERROR):
                    future = self.waiting.pop(call_id, None)
                    if future is not None and not future.done():
                        future.set_result((kind, payload))
                else:
                    raise LaneProtocolError(f"a {kind.name} frame from the sidecar")
            self.lost = f"the sidecar closed the {self.name}"
        except (LaneProtocolError, OSError) as exc:  # OSError: ssl.SSLError too
            self.lost = f"{self.name} broken: {exc}"
        finally:
            if not self.lost:
                self.lost = f"the {self.name} was closed"
            error = LaneUnreachableError if self.turned_away else PeerUnavailableError
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(error(self.lost))
            for queue in self.streams.values():
                queue.put_nowait(None)
            self.writer.close()

    def send(self, call_id: int, kind: Kind, payload: bytes = b"") -> None:
        if self.turned_away:
            raise LaneUnreachableError(self.lost)
        if self.lost or self.writer.is_closing():
            raise PeerUnavailableError(self.lost or f"the {self.name} was closed")
        self.writer.write(frame(call_id, kind, payload))


Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class Lane:
    """The engine lane at `path`; or, given `opener`, a lane it connects (once a call:
    it raises `PeerUnavailableError` when it cannot), named `name` in errors."""

    def __init__(
        self,
        path: str,
        connect_timeout_s: float,
        *,
        opener: Opener | None = None,
        name: str = "engine lane",
    ) -> None:
        self.path = path
        self.name = name
        self._opener = opener
        self._connect_timeout_s = connect_timeout_s
        self._link: _Link | None = None
        self._opening = asyncio.Lock()
        self._last_id = 0
        # Connect attempts that failed, and how the last did: callers that waited while
        # an attempt failed fail with it, instead of each trying (and waiting) in turn.
        self._failures = 0
        self._failed: PeerUnavailableError | None = None
        self._closed = False

    def _call_id(self, link: _Link) -> int:
        """The next call id: 1 to 2**32 - 1 (a frame's u32), wrapping, never one in use."""
        while True:
            self._last_id = self._last_id % MAX_CALL_ID + 1
            if self._last_id not in link.waiting and self._last_id not in link.streams:
                return self._last_id

    async def _open(self) -> _Link:
        link = self._link
        if link is not None and not link.lost:
            return link
        failures = self._failures
        async with self._opening:
            if self._closed:
                raise LaneUnreachableError(f"the {self.name} was closed")
            if self._link is not None and not self._link.lost:
                return self._link
            if self._failures != failures and self._failed is not None:
                # An attempt failed while this call waited for it (the same kind of
                # error: a caller may tell "nothing was sent" by it).
                raise type(self._failed)(str(self._failed))
            try:
                if self._opener is not None:
                    reader, writer = await self._opener()
                else:
                    reader, writer = await self._open_unix()
            except PeerUnavailableError as exc:
                self._failures += 1
                self._failed = exc
                raise
            self._failed = None
            self._link = link = _Link(reader, writer, self.name)
            link.pump = asyncio.create_task(link.run())
            return link

    async def _open_unix(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        while True:
            try:
                return await asyncio.open_unix_connection(self.path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() >= deadline:  # nothing was sent
                    raise LaneUnreachableError(
                        f"no engine lane at {self.path} within "
                        f"{self._connect_timeout_s:g}s ({exc.strerror}): is kvxfer-server "
                        "running with this unix engine socket? (lane=False uses gRPC only)"
                    ) from None
                await asyncio.sleep(_RETRY_S)

    async def call(
        self, method: str, request: Message, reply: type[R], timeout_s: float, what: str
    ) -> R:
        payload = _sendable(method, request, what)  # refused before any connection, as a stream's
        link = await self._open()
        call_id = self._call_id(link)
        answer: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        link.waiting[call_id] = answer
        try:
            link.send(call_id, Kind.UNARY, payload)
            kind, payload = await within(answer, timeout_s)
        except TimeoutError:
            with contextlib.suppress(PeerUnavailableError):
                link.send(call_id, Kind.CANCEL)
            raise PeerUnavailableError(
                f"{what}: unreachable (DEADLINE_EXCEEDED: no answer within {timeout_s:g}s)"
            ) from None
        except PeerUnavailableError as exc:  # LaneUnreachableError stays one: not sent
            raise type(exc)(f"{what}: {exc}") from None
        finally:
            link.waiting.pop(call_id, None)
        return _decoded(kind, payload, reply, what)

    async def stream(
        self, method: str, request: Message, item: type[R], what: str
    ) -> AsyncIterator[R]:
        payload = _sendable(method, request, what)
        link = await self._open()
        call_id = self._call_id(link)
        queue: asyncio.Queue[_Answer | None] = asyncio.Queue()
        link.streams[call_id] = queue
        ended = False
        try:
            link.send(call_id, Kind.STREAM, payload)
            while True:
                got = await queue.get()
                if got is None:
                    ended = True
                    raise PeerUnavailableError(f"{what}: {link.lost}")
                kind, payload = got
                if kind is Kind.END:
                    ended = True
                    return
                if kind is Kind.ERROR:
                    ended = True
                yield _decoded(kind, payload, item, what)
        finally:
            link.streams.pop(call_id, None)
            if not ended:
                with contextlib.suppress(PeerUnavailableError):
                    link.send(call_id, Kind.CANCEL)

    async def close(self) -> None:
        """Close the connection; the lane is not opened again. A far end that does not
        answer the close (a frozen peer's TLS goodbye) is cut off after CLOSE_WAIT_S."""
        self._closed = True
        link, self._link = self._link, None
        if link is None:
            return
        link.writer.close()
        if link.pump is not None:
            link.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await link.pump
        try:
            await asyncio.wait_for(link.writer.wait_closed(), CLOSE_WAIT_S)
        except (OSError, TimeoutError):
            link.writer.transport.abort()


def _status(payload: bytes) -> status_pb2.Status:
    try:
        return status_pb2.Status.FromString(payload)
    except DecodeError:
        raise LaneProtocolError("a refusal of the connection that does not decode") from None


def _decoded(kind: Kind, payload: bytes, cls: type[R], what: str) -> R:
    try:
        if kind is Kind.ERROR:
            raise lane_error(status_pb2.Status.FromString(payload), what)
        return cls.FromString(payload)
    except DecodeError:
        # The far end ran the call, and what it did cannot be read: as after a deadline,
        # the caller cannot know, so it must not take it as refused (nothing done).
        raise PeerUnavailableError(
            f"{what}: the answer does not decode; the call may have been carried out"
        ) from None


def _sendable(method: str, request: Message, what: str) -> bytes:
    """The request's frame payload, refused when no lane takes a frame that large: sent,
    it would end the connection and every call and event watch on it (gRPC's channels
    refuse such a message the same way, for that call alone)."""
    payload = request_payload(method, request.SerializeToString())
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise LimitExceededError(
            f"{what}: a {len(payload)}-byte request exceeds the lane's {MAX_PAYLOAD_BYTES} "
            "bytes (gRPC's message limit too): split it"
        )
    return payload
