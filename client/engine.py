"""The engine's client of its sidecar: register buffers, publish, pull, watch, abort.

`EngineClient` is asyncio (grpc.aio); `SyncEngineClient` wraps it on a private
event-loop thread for engines that are not asyncio. Every call has a
deadline, and failed RPCs raise the kvxfer error their status stands for
(`NegotiationError` with its mismatches, `PeerUnavailableError` naming the
address, ...). With a unix address, per-request calls (publish, pull, abort,
...) and events take the engine lane beside the socket (`kvxfer.wire.lane_client`:
no gRPC on the request path); `lane=False` keeps them on gRPC.

The first call waits for the sidecar: for a unix socket, until its file appears
(a sidecar and an engine started together, e.g. in one pod), then until the
channel connects, for at most `connect_timeout_s` (default 10 s) in all; after
that `PeerUnavailableError` names the path or address.

    async with EngineClient("unix:/tmp/kvxfer-engine.sock") as client:
        await client.register(cache.layout, cache.buffers, name="prefill-0")
        params = await client.publish("req-1", num_tokens, spans)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvxfer._exceptions import InvalidInputError, PeerUnavailableError
from kvxfer.core.buffers import BufferHandle
from kvxfer.core.layout import BlockSpan, EngineLayout
from kvxfer.core.requests import (
    AbortState,
    EngineEvent,
    Held,
    HoldState,
    Publication,
    PullAccepted,
    PushAccepted,
    TransferParams,
    check_address,
)
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.errors import backstop_s, guarded, rpc_error
from kvxfer.wire.lane import lane_path
from kvxfer.wire.lane_client import Lane
from kvxfer.wire.layout import layout_to_proto, span_to_proto
from kvxfer.wire.loops import DEFAULT_EVENT_LOOP, EventLoop, loop_factory
from kvxfer.wire.sidecar import (
    abort_state_from_proto,
    event_from_proto,
    handle_to_proto,
    params_from_proto,
    params_to_proto,
    publication_to_proto,
)

T = TypeVar("T")
R = TypeVar("R", bound=Message)
MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_CONNECT_TIMEOUT_S = 10.0
_HOLD_STATES = {
    pb.LEASE_STATE_HELD: HoldState.HELD,
    pb.LEASE_STATE_ABORTED: HoldState.ABORTED,
    pb.LEASE_STATE_UNKNOWN: HoldState.GONE,
}
_SOCKET_POLL_S = 0.05


@dataclass(frozen=True)
class Registration:
    engine_id: str
    epoch: int
    peer_address: str


class EngineClient:
    def __init__(
        self,
        address: str,
        *,
        engine_id: str = "",
        timeout_s: float = 30.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        lane: bool | None = None,
    ) -> None:
        self.address = check_address(address, "sidecar address", allow_unix=True)
        unix = self.address.startswith("unix:")
        if lane is None:
            lane = unix
        elif lane and not unix:
            raise InvalidInputError(
                "lane", f"the engine lane needs a unix sidecar address, not {self.address}"
            )
        # Per-request calls and events over the engine lane (kvxfer.wire.lane) beside a
        # unix engine socket; registration always over gRPC.
        self._lane = Lane(lane_path(self.address), connect_timeout_s) if lane else None
        if not connect_timeout_s > 0:
            raise InvalidInputError(
                "connect_timeout_s", f"must be positive, got {connect_timeout_s}"
            )
        self.engine_id = engine_id
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._connected = False
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.EngineServiceStub(self._channel)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._lane is not None:
            await self._lane.close()
        await self._channel.close()

    async def connect(self) -> None:
        """Wait until the sidecar accepts connections (every call does this first)."""
        if self._connected:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        if self.address.startswith("unix:"):
            path = self.address.removeprefix("unix:").removeprefix("//")
            while not os.path.exists(path):
                if loop.time() >= deadline:
                    raise PeerUnavailableError(
                        f"sidecar socket {path} did not appear within "
                        f"{self._connect_timeout_s:g}s: is kvxfer-server running with "
                        f"--engine-address unix:{path}?"
                    )
                await asyncio.sleep(_SOCKET_POLL_S)
        try:
            # Not asyncio.wait_for: on Python 3.11 a task cancelled in the loop turn the
            # channel became ready returns from it as if not cancelled (an event watcher
            # cancelled while connecting then watched for ever).
            async with asyncio.timeout_at(deadline):
                await self._channel.channel_ready()
        except TimeoutError:
            raise PeerUnavailableError(
                f"sidecar at {self.address} did not accept a connection within "
                f"{self._connect_timeout_s:g}s"
            ) from None
        self._connected = True

    async def _call(self, what: str, rpc: Callable[[], Awaitable[T]]) -> T:
        """`rpc` is one unary call with the client's `timeout_s` deadline."""
        await self.connect()
        return await guarded(f"{what} at sidecar {self.address}", rpc, self._timeout_s)

    async def _unary(self, what: str, method: str, request: Message, reply: type[R]) -> R:
        """One per-request call: on the lane when there is one, else over gRPC."""
        if self._lane is not None:
            await self.connect()  # the engine socket first: its waits and messages
            where = f"{what} at sidecar {self.address}"
            return await self._lane.call(method, request, reply, self._timeout_s, where)
        call = getattr(self._stub, method)
        answer: R = await self._call(what, lambda: call(request, timeout=self._timeout_s))
        return answer

    def _engine(self) -> str:
        if not self.engine_id:
            raise InvalidInputError("engine_id", "register first (or pass engine_id=)")
        return self.engine_id

    async def register(
        self, layout: EngineLayout, buffers: Sequence[BufferHandle], name: str = ""
    ) -> Registration:
        request = pb.RegisterEngineRequest(
            layout=layout_to_proto(layout),
            buffers=[handle_to_proto(b) for b in buffers],
            engine_name=name,
        )
        # Which connected process registers: the sidecar checks the claim against the
        # socket's peer credentials and retires the engine when this process exits.
        metadata = (("kvxfer-engine-pid", str(os.getpid())),)
        reply = await self._call(
            "register",
            lambda: self._stub.RegisterEngine(request, timeout=self._timeout_s, metadata=metadata),
        )
        self.engine_id = reply.engine_id
        return Registration(reply.engine_id, reply.epoch, reply.peer_address)

    async def publish(
        self, request_id: str, num_tokens: int, spans: Sequence[BlockSpan]
    ) -> TransferParams:
        request = pb.PublishRequest(
            engine_id=self._engine(),
            request_id=request_id,
            num_tokens=num_tokens,
            spans=[span_to_proto(s) for s in spans],
        )
        reply = await self._unary("publish", "Publish", request, pb.PublishResponse)
        return params_from_proto(reply.params, "params")

    async def pull(
        self, params: TransferParams, local_spans: Sequence[BlockSpan], computed_tokens: int
    ) -> PullAccepted:
        request = pb.PullRequest(
            engine_id=self._engine(),
            params=params_to_proto(params),
            local_spans=[span_to_proto(s) for s in local_spans],
            computed_tokens=computed_tokens,
        )
        reply = await self._unary("pull", "Pull", request, pb.PullResponse)
        return PullAccepted(
            bytes_planned=reply.bytes_planned,
            full_attention_bytes=reply.full_attention_bytes,
            chunks=reply.chunks,
            descriptors=reply.descriptors,
        )

    async def expect(
        self,
        request_id: str,
        num_tokens: int,
        spans: Sequence[BlockSpan],
        computed_tokens: int = 0,
    ) -> TransferParams:
        """Announce this (decode) engine's blocks for a push: hand the params to the
        prefill engine, whose sidecar writes into them; `Received` reports the outcome."""
        request = pb.ExpectRequest(
            engine_id=self._engine(),
            request_id=request_id,
            num_tokens=num_tokens,
            spans=[span_to_proto(s) for s in spans],
            computed_tokens=computed_tokens,
        )
        reply = await self._unary("expect", "Expect", request, pb.ExpectResponse)
        return params_from_proto(reply.params, "params")

    async def push(
        self,
        params: TransferParams,
        local_spans: Sequence[BlockSpan],
        tokens_ready: int,
        final: bool = True,
    ) -> PushAccepted:
        """Push this (prefill) engine's blocks into what `params` announced: the first call
        starts it, later ones add readiness; `Pushed` reports the end."""
        request = pb.PushRequest(
            engine_id=self._engine(),
            params=params_to_proto(params),
            local_spans=[span_to_proto(s) for s in local_spans],
            tokens_ready=tokens_ready,
            final=final,
        )
        reply = await self._unary("push", "Push", request, pb.PushResponse)
        return PushAccepted(reply.bytes_planned, reply.chunks, reply.chunks_posted)

    async def abort(self, request_id: str) -> AbortState:
        request = pb.AbortRequest(engine_id=self._engine(), request_id=request_id)
        reply = await self._unary("abort", "Abort", request, pb.AbortResponse)
        return abort_state_from_proto(reply.state, "AbortResponse.state")

    async def hold(self, publications: Sequence[Publication | TransferParams]) -> Held:
        """Ask each publisher to keep a publication while this engine has no blocks to pull
        it into yet (up to the publisher's lease.max_hold_s after it published); call again
        every `interval_s` of the answer until the request is pulled."""
        named = [p if isinstance(p, Publication) else Publication.of(p) for p in publications]
        request = pb.HoldRequest(
            engine_id=self._engine(), publications=[publication_to_proto(p) for p in named]
        )
        reply = await self._unary("hold", "Hold", request, pb.HoldResponse)
        if len(reply.states) != len(named):
            raise PeerUnavailableError(
                f"hold at sidecar {self.address}: {len(reply.states)} states for "
                f"{len(named)} publications"
            )
        states = tuple(_HOLD_STATES.get(s, HoldState.UNASKED) for s in reply.states)
        return Held(states, reply.interval_ms / 1000)

    async def events(self) -> AsyncIterator[EngineEvent]:
        """This engine's events, as they happen, until the sidecar ends the stream."""
        await self.connect()
        if self._lane is not None:
            request = pb.WatchEventsRequest(engine_id=self._engine())
            where = f"watch events at sidecar {self.address}"
            async for message in self._lane.stream(
                "WatchEvents", request, pb.WatchEventsResponse, where
            ):
                yield event_from_proto(message)
            return
        call = self._stub.WatchEvents(pb.WatchEventsRequest(engine_id=self._engine()))
        try:
            async for message in call:
                yield event_from_proto(message)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                raise rpc_error(exc, f"watch events at sidecar {self.address}") from exc
        finally:
            call.cancel()

    async def unregister(self) -> tuple[int, int]:
        request = pb.UnregisterRequest(engine_id=self._engine())
        reply = await self._unary("unregister", "Unregister", request, pb.UnregisterResponse)
        return reply.released_leases, reply.cancelled_pulls


class SyncEngineClient:
    """`EngineClient` for threads: each call blocks until done (or its deadline)."""

    def __init__(
        self,
        address: str,
        *,
        engine_id: str = "",
        timeout_s: float = 30.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        lane: bool | None = None,
        event_loop: EventLoop = DEFAULT_EVENT_LOOP,
    ) -> None:
        self._loop = loop_factory(event_loop, "event_loop")()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        # A call may first wait for the sidecar to come up, and ends by its backstop
        # (PeerUnavailableError, `guarded`): this wait is longer, a last resort.
        self._timeout_s = backstop_s(timeout_s) + connect_timeout_s

        async def make() -> EngineClient:
            return EngineClient(
                address,
                engine_id=engine_id,
                timeout_s=timeout_s,
                connect_timeout_s=connect_timeout_s,
                lane=lane,
            )

        self._client = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._last_resort_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise self._unanswered() from exc

    @property
    def _last_resort_s(self) -> float:
        return self._timeout_s + 5

    def _unanswered(self) -> PeerUnavailableError:
        # No answer: the sidecar may have acted on it, as after a deadline.
        return PeerUnavailableError(f"sidecar call did not finish in {self._timeout_s}s")

    def _soon(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """`coro` started on the client's loop without waiting for it: the future ends as
        the blocking call would have (its answer, or the error it raises; with no answer
        by the same last resort, PeerUnavailableError)."""

        async def bounded() -> T:
            try:
                return await asyncio.wait_for(coro, self._last_resort_s)
            except TimeoutError as exc:
                raise self._unanswered() from exc

        return asyncio.run_coroutine_threadsafe(bounded(), self._loop)

    @property
    def engine_id(self) -> str:
        return self._client.engine_id

    def connect(self) -> None:
        self._run(self._client.connect())

    def register(
        self, layout: EngineLayout, buffers: Sequence[BufferHandle], name: str = ""
    ) -> Registration:
        return self._run(self._client.register(layout, buffers, name))

    def publish(
        self, request_id: str, num_tokens: int, spans: Sequence[BlockSpan]
    ) -> TransferParams:
        return self._run(self._client.publish(request_id, num_tokens, spans))

    def pull(
        self, params: TransferParams, local_spans: Sequence[BlockSpan], computed_tokens: int
    ) -> PullAccepted:
        """Blocks until the sidecar answers, once the read's first chunk is posted (1-4
        ms for a 1k-token pull here, `benchmarks/probe_pull_call.py`): a thread that must
        not stall, an engine's step, uses `pull_soon`."""
        return self._run(self._client.pull(params, local_spans, computed_tokens))

    def pull_soon(
        self, params: TransferParams, local_spans: Sequence[BlockSpan], computed_tokens: int
    ) -> concurrent.futures.Future[PullAccepted]:
        """`pull` without waiting for the sidecar's answer: an engine step that starts
        pulls need not stall for them. The future holds what `pull` would have returned
        or raised; the pull's PullDone may come before it."""
        return self._soon(self._client.pull(params, local_spans, computed_tokens))

    def expect(
        self,
        request_id: str,
        num_tokens: int,
        spans: Sequence[BlockSpan],
        computed_tokens: int = 0,
    ) -> TransferParams:
        return self._run(self._client.expect(request_id, num_tokens, spans, computed_tokens))

    def push(
        self,
        params: TransferParams,
        local_spans: Sequence[BlockSpan],
        tokens_ready: int,
        final: bool = True,
    ) -> PushAccepted:
        return self._run(self._client.push(params, local_spans, tokens_ready, final))

    def abort(self, request_id: str) -> AbortState:
        return self._run(self._client.abort(request_id))

    def hold(self, publications: Sequence[Publication | TransferParams]) -> Held:
        return self._run(self._client.hold(publications))

    def unregister(self) -> tuple[int, int]:
        return self._run(self._client.unregister())

    def events(self, timeout_s: float | None = None) -> Iterator[EngineEvent]:
        """Blocking iterator over events; stops after `timeout_s` without one."""
        inbox: queue.Queue[EngineEvent | BaseException | None] = queue.Queue()

        async def pump() -> None:
            try:
                async for event in self._client.events():
                    inbox.put(event)
            except BaseException as exc:
                inbox.put(exc)
                return
            inbox.put(None)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                try:
                    item = inbox.get(timeout=timeout_s)
                except queue.Empty:
                    return
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    def close(self) -> None:
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
