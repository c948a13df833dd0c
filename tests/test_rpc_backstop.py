"""A gRPC call whose completion never comes back ends as its deadline would.

grpc.aio was seen to lose a call's completion, deadline included: a Handshake
stayed unanswered for 240 s on an idle loop. Every caller that gives a call a
deadline (peer calls, the engine client's gRPC path, kvxfer-cli) also tells
`guarded`, which stops waiting at `backstop_s(deadline)` with
PeerUnavailableError, what an expired deadline is. A lost completion cannot be
caused on purpose, so the call here is an awaitable that never finishes, at the
seam where the real call's awaitable goes; a real server shows that gRPC's own
deadline still answers first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest

from kvxfer._exceptions import PeerUnavailableError
from kvxfer.cli.admin import _call as admin_call
from kvxfer.client.engine import EngineClient
from kvxfer.server.peers import Dialer
from kvxfer.server.settings import load_settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.errors import backstop_s, guarded

DEADLINE_S = 0.05


def lost() -> tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]:
    """A call whose answer never comes, and the future it waits on."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def call() -> Any:
        return await future

    return call, future


def test_the_backstop_is_twice_the_deadline_and_at_least_a_second_more() -> None:
    assert backstop_s(0.05) == pytest.approx(1.05)
    assert backstop_s(5.0) == pytest.approx(10.0)
    assert backstop_s(300.0) == pytest.approx(600.0)


async def test_a_lost_completion_ends_as_unreachable_and_cancels_the_call() -> None:
    call, future = lost()
    start = time.monotonic()
    with pytest.raises(PeerUnavailableError, match=r"begin read at peer p:1: unreachable"):
        await guarded("begin read at peer p:1", call, DEADLINE_S)
    assert time.monotonic() - start >= backstop_s(DEADLINE_S) * 0.9  # not before the backstop
    assert future.cancelled()  # the call was given up, not left waiting


async def test_an_answer_before_the_backstop_is_returned() -> None:
    async def call() -> str:
        await asyncio.sleep(DEADLINE_S * 2)  # past the deadline, inside the backstop
        return "answer"

    assert await guarded("heartbeat", call, DEADLINE_S) == "answer"


async def test_a_timeout_the_call_raises_itself_is_not_taken_for_a_lost_one() -> None:
    async def call() -> str:
        raise TimeoutError("the caller's own")

    with pytest.raises(TimeoutError, match="the caller's own"):
        await guarded("heartbeat", call, DEADLINE_S)


class SlowPeer(pb_grpc.PeerServiceServicer):
    async def Handshake(self, request: pb.HandshakeRequest, context: Any) -> pb.HandshakeResponse:
        await asyncio.sleep(30)
        return pb.HandshakeResponse()


@contextlib.asynccontextmanager
async def slow_peer() -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_PeerServiceServicer_to_server(SlowPeer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_grpc_deadline_still_answers_first_on_a_real_call() -> None:
    async with slow_peer() as address, grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PeerServiceStub(channel)
        with pytest.raises(PeerUnavailableError, match="DEADLINE_EXCEEDED"):
            await guarded(
                "handshake", lambda: stub.Handshake(pb.HandshakeRequest(), timeout=0.2), 0.2
            )


async def test_peer_calls_take_the_rpc_timeout_as_their_deadline() -> None:
    settings = load_settings([], {"KVXFER_TRANSFER__RPC_TIMEOUT_S": str(DEADLINE_S)})
    dialer = Dialer(settings)
    call, _ = lost()
    try:
        said = r"no answer within 1\.05s; the call's deadline was 0\.05s"
        with pytest.raises(PeerUnavailableError, match=said):
            await dialer.call("127.0.0.1:9", "end read", call)
    finally:
        await dialer.close()


async def test_the_engine_client_gives_up_on_a_lost_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = EngineClient("unix:/nonexistent/kvxfer.sock", timeout_s=DEADLINE_S, lane=False)

    async def connected() -> None:  # the socket is not what this test is about
        return None

    monkeypatch.setattr(client, "connect", connected)
    call, _ = lost()
    try:
        with pytest.raises(PeerUnavailableError, match="publish at sidecar unix:"):
            await client._call("publish", call)
    finally:
        await client.close()


async def test_kvxfer_cli_calls_give_up_on_a_lost_call() -> None:
    call, _ = lost()
    with pytest.raises(PeerUnavailableError, match=r"status at 127\.0\.0\.1:9"):
        await admin_call("127.0.0.1:9", "status", lambda _channel: call(), DEADLINE_S)
