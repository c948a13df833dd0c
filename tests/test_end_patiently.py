"""Ending a read or a write at the peer (`end_patiently`, `PeerLinks.end_read`): it is
tried again while the peer cannot be reached or is busy with this client's other calls
(BusyError: the call never ran there), with the same read token, and stops at a
definite answer or when its patience runs out (the peer's lease then ends on its own).
A limit the call itself exceeds (a message too large) is definite: trying the same
call again would fail the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

from kvxfer._exceptions import (
    BusyError,
    KvxferError,
    LimitExceededError,
    NotFoundError,
    PeerUnavailableError,
)
from kvxfer.core.profiles import layout_for_model
from kvxfer.server import pulls
from kvxfer.server.metrics import Metrics
from kvxfer.server.peers import Dialer, PeerLink, PeerLinks
from kvxfer.server.pulls import end_patiently
from kvxfer.server.settings import load_settings
from kvxfer.server.status import abort_with
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.sidecar import PeerHello


@pytest.fixture
def no_pause(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    async def sleep(_: float) -> None:
        return None

    monkeypatch.setattr(pulls.asyncio, "sleep", sleep)
    yield


def answers(*outcomes: KvxferError | str) -> tuple[Callable[[], Any], list[int]]:
    calls = [0]

    async def call() -> str:
        outcome = outcomes[calls[0]]
        calls[0] += 1
        if isinstance(outcome, KvxferError):
            raise outcome
        return outcome

    return call, calls


@pytest.mark.usefixtures("no_pause")
@pytest.mark.parametrize(
    "transient",
    [PeerUnavailableError("peer gone"), BusyError("limits.max_calls_per_peer: 2 calls")],
)
async def test_transient_refusals_are_retried_until_an_answer(transient: KvxferError) -> None:
    call, calls = answers(transient, transient, "ended")
    assert await end_patiently(call, "ending", 60) == "ended"
    assert calls == [3]


@pytest.mark.usefixtures("no_pause")
async def test_a_definite_answer_ends_it_and_patience_bounds_it() -> None:
    for definite in (NotFoundError("no such lease"), LimitExceededError("message too large")):
        call, calls = answers(definite, "never")
        assert await end_patiently(call, "ending", 60) is None
        assert calls == [1]
    call, calls = answers(*[BusyError("busy")] * 10)
    assert await end_patiently(call, "ending", 0.1) is None
    assert calls == [1]  # the first pause (0.25 s) would already be past 0.1 s


class BusyOncePeer(pb_grpc.PeerServiceServicer):
    """A peer whose first EndRead is refused as busy, as its port guard would."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    async def EndRead(
        self, request: pb.EndReadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EndReadResponse:
        self.tokens.append(request.read_token)
        if len(self.tokens) == 1:
            await abort_with(context, BusyError("limits.max_calls_per_peer: 1 calls running"))
        return pb.EndReadResponse()


async def test_a_busy_peer_ends_the_read_on_the_next_try_with_the_same_token() -> None:
    peer = BusyOncePeer()
    server = grpc.aio.server()
    pb_grpc.add_PeerServiceServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    settings = load_settings(["--transfer.rpc-timeout-s", "5"], environ={})
    links = PeerLinks(settings=settings, backend=None, metrics=Metrics(),  # type: ignore[arg-type]
                      dialer=Dialer(settings), sidecar_id="test", epoch=7)  # fmt: skip
    hello = PeerHello(1, 9, "engine", "peer", layout_for_model("gpt-oss-20b"), {}, b"m", 30, 1)
    link = PeerLink(f"127.0.0.1:{port}", 0, hello, "agent")
    links._keep_token(link, "r1", "secret")
    try:
        request = pb.EndReadRequest(epoch=9, request_id="r1")
        await end_patiently(lambda: links.end_read(link, request), "ending", 10)
    finally:
        await server.stop(None)
    assert peer.tokens == ["secret", "secret"]  # refused busy, then taken, token and all
