"""The engine lane: EngineService's per-request calls over a plain unix socket.

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
serving every other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from kvxfer._exceptions import InvalidInputError
from kvxfer.server.guard import Refusals, Refused
from kvxfer.server.metrics import Metrics
from kvxfer.server.servicers import EngineServicer
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.errors import DETAILS_TRAILER
from kvxfer.wire.lane import (
    Kind,
    LaneProtocolError,
    frame,
    read_frame,
    split_request,
)

log = logging.getLogger(__name__)

Unary = Callable[[Any, Any], Awaitable[Message]]
Streaming = Callable[[Any, Any], AsyncIterator[Message]]

UNARY_REQUESTS: dict[str, type[Message]] = {
    "Publish": pb.PublishRequest,
    "Pull": pb.PullRequest,
    "Expect": pb.ExpectRequest,
    "Push": pb.PushRequest,
    "Abort": pb.AbortRequest,
    "Unregister": pb.UnregisterRequest,
}
STREAM_REQUESTS: dict[str, type[Message]] = {"WatchEvents": pb.WatchEventsRequest}


class _Aborted(grpc.aio.AbortError):
    """How a lane call ends with an error: raised by `LaneContext.abort`, and passed
    through the servicer's error mapping like gRPC's own AbortError."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


class LaneContext:
    """The part of `grpc.aio.ServicerContext` the engine servicer and `abort_with` use."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

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


class EngineLane:
    def __init__(self, servicer: EngineServicer, metrics: Metrics) -> None:
        self._servicer = servicer
        self._refusals = Refusals(metrics)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
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
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            if self.path:
                os.unlink(self.path)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await _Connection(self, reader, writer).serve()
        finally:
            self._connections.discard(task)

    def unary(self, method: str) -> Unary:
        handler: Unary = getattr(self._servicer, method)
        return handler

    def stream(self, method: str) -> Streaming:
        handler: Streaming = getattr(self._servicer, method)
        return handler

    async def refuse(self, refused: Refused, method: str) -> NoReturn:
        await self._refusals.check(refused, f"lane {method}", LaneContext())  # type: ignore[arg-type]
        raise AssertionError("unreachable: a refusal always aborts")


class _Connection:
    def __init__(
        self, lane: EngineLane, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._lane, self._reader, self._writer = lane, reader, writer
        self._calls: dict[int, asyncio.Task[None]] = {}

    async def serve(self) -> None:
        try:
            while (got := await read_frame(self._reader)) is not None:
                self._dispatch(*got)
        except LaneProtocolError as exc:
            log.warning("engine lane connection closed: %s", exc)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for task in list(self._calls.values()):
                task.cancel()
            self._writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await self._writer.wait_closed()

    def _dispatch(self, call_id: int, kind: Kind, payload: bytes) -> None:
        if kind is Kind.CANCEL:
            task = self._calls.get(call_id)
            if task is not None:
                task.cancel()
            return
        if kind not in (Kind.UNARY, Kind.STREAM):
            raise LaneProtocolError(f"a {kind.name} frame from the engine")
        if call_id in self._calls:
            raise LaneProtocolError(f"call id {call_id} is already in use")
        method, body = split_request(payload)
        run = self._unary if kind is Kind.UNARY else self._stream
        task = asyncio.create_task(run(call_id, method, body))
        self._calls[call_id] = task
        task.add_done_callback(lambda _: self._calls.pop(call_id, None))

    def _send(self, call_id: int, kind: Kind, payload: bytes = b"") -> None:
        if not self._writer.is_closing():
            self._writer.write(frame(call_id, kind, payload))

    async def _unary(self, call_id: int, method: str, body: bytes) -> None:
        async def answer() -> None:
            request = await self._decode(UNARY_REQUESTS, method, body)
            reply = await self._lane.unary(method)(request, LaneContext())
            self._send(call_id, Kind.REPLY, reply.SerializeToString())

        await self._answered(call_id, method, answer())

    async def _stream(self, call_id: int, method: str, body: bytes) -> None:
        async def answer() -> None:
            request = await self._decode(STREAM_REQUESTS, method, body)
            async for item in self._lane.stream(method)(request, LaneContext()):
                self._send(call_id, Kind.ITEM, item.SerializeToString())
                await self._writer.drain()
            self._send(call_id, Kind.END)

        await self._answered(call_id, method, answer())

    async def _answered(self, call_id: int, method: str, call: Awaitable[None]) -> None:
        """Run one call; whatever it raises ends it with an ERROR frame, so no call is
        left without an answer (a lost connection has nobody left to answer)."""
        try:
            await call
        except _Aborted as exc:
            self._send(call_id, Kind.ERROR, exc.status.SerializeToString())
        except ConnectionError:
            pass
        except Exception:
            log.exception("engine lane %s failed", method)
            self._send(call_id, Kind.ERROR, _internal(method))

    async def _decode(self, served: dict[str, type[Message]], method: str, body: bytes) -> Message:
        cls = served.get(method)
        if cls is None:
            raise _unimplemented(method)
        try:
            return cls.FromString(body)
        except (DecodeError, ValueError, RuntimeError) as exc:
            reason = f"undecodable request body ({type(exc).__name__})"
            await self._lane.refuse(Refused("undecodable", reason), method)


def _unimplemented(method: str) -> _Aborted:
    served = ", ".join(sorted(UNARY_REQUESTS) + sorted(STREAM_REQUESTS))
    return _Aborted(
        status_pb2.Status(
            code=grpc.StatusCode.UNIMPLEMENTED.value[0],
            message=f"method: the engine lane serves {served}, not {method!r}",
        )
    )


def _internal(method: str) -> bytes:
    message = f"internal error serving {method} on the engine lane; see the sidecar log"
    status = status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message)
    return status.SerializeToString()
