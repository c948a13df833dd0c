"""The engine lane (per-request calls and events over a plain unix socket): served
0600 beside a real sidecar's engine socket, the same errors as over gRPC, junk
refused without harming the sidecar, and the client's deadlines and reconnects
checked against a lane server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2
from sidecars import exchange, scrape, start_sidecar

from kvxfer._exceptions import (
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
    PeerUnavailableError,
)
from kvxfer.cli.fleet import ChildDiedError, Fleet, Proc, metric
from kvxfer.client import EngineClient
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.lane import HEADER, Kind, frame, read_frame, request_payload
from kvxfer.wire.lane_client import Lane

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_sidecar(tmp_path_factory.mktemp("lane"), "lane")
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _exchange(
    path: str, *frames: bytes, half_close: bool = False, wait_s: float = 0.5
) -> Awaitable[tuple[list[tuple[int, Kind, bytes]], bool]]:
    return exchange(
        asyncio.open_unix_connection(path), *frames, half_close=half_close, wait_s=wait_s
    )


def test_the_lane_is_private_and_beside_the_engine_socket(sidecar: Proc) -> None:
    engine_socket = sidecar.ready["engine_address"].removeprefix("unix:")
    assert sidecar.ready["engine_lane"] == engine_socket + ".lane"
    mode = os.stat(sidecar.ready["engine_lane"]).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


async def test_errors_are_the_same_as_over_grpc(sidecar: Proc) -> None:
    address = sidecar.ready["engine_address"]
    raised = []
    for lane in (True, False):
        async with EngineClient(address, engine_id="e-nobody", lane=lane) as client:
            with pytest.raises(NotFoundError) as error:
                await client.abort("req-1")
            raised.append(str(error.value))
    assert raised[0] == raised[1] and "e-nobody" in raised[0]


async def _refused(sidecar: Proc, method: str, body: bytes) -> status_pb2.Status:
    """The status of one call the sidecar answers with an ERROR frame, its connection
    left open."""
    request = frame(7, Kind.UNARY, request_payload(method, body))
    ((call_id, kind, payload),), closed = await _exchange(sidecar.ready["engine_lane"], request)
    assert (call_id, kind) == (7, Kind.ERROR)
    assert not closed
    return status_pb2.Status.FromString(payload)


async def test_an_undecodable_body_is_refused_naming_the_method(sidecar: Proc) -> None:
    before = metric(scrape(sidecar), "kvxfer_refusals_total", reason="undecodable")
    status = await _refused(sidecar, "Pull", b"\xff\xff\xff")
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "Pull" in status.message and "undecodable" in status.message
    after = metric(scrape(sidecar), "kvxfer_refusals_total", reason="undecodable")
    assert after == before + 1


async def test_a_method_the_lane_does_not_serve_is_unimplemented(sidecar: Proc) -> None:
    status = await _refused(sidecar, "RegisterEngine", b"")
    assert status.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "'RegisterEngine'" in status.message and "Pull" in status.message


@pytest.mark.parametrize(
    "junk",
    [
        HEADER.pack(0, 1, 99),  # no such kind
        HEADER.pack(1 << 30, 1, Kind.UNARY),  # larger than any message may be
        frame(1, Kind.REPLY),  # a sidecar's kind, from the engine
        frame(1, Kind.UNARY, b"\x09Pull"),  # method name shorter than its length byte
        HEADER.pack(5, 1, Kind.UNARY)[:6],  # the connection ends inside a header
    ],
    ids=["kind", "oversized", "reply", "name", "cut"],
)
async def test_junk_closes_only_its_own_connection(sidecar: Proc, junk: bytes) -> None:
    cut = len(junk) < HEADER.size  # only the end of the stream shows the header is cut
    got, closed = await _exchange(sidecar.ready["engine_lane"], junk, half_close=cut, wait_s=5)
    assert got == [] and closed
    async with EngineClient(sidecar.ready["engine_address"], engine_id="e-nobody") as client:
        with pytest.raises(NotFoundError):  # still serving, on the lane
            await client.abort("req-1")


def test_the_lane_needs_a_unix_address() -> None:
    with pytest.raises(InvalidInputError) as error:
        EngineClient("127.0.0.1:5000", lane=True)
    assert error.value.field == "lane"


# -- the client against a lane server that misbehaves on purpose ---------------

Behaviour = Callable[[int, Kind, bytes, asyncio.StreamWriter], None]


@contextlib.asynccontextmanager
async def _fake_lane(path: Path, behave: Behaviour) -> AsyncIterator[list[tuple[int, Kind]]]:
    seen: list[tuple[int, Kind]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (got := await read_frame(reader)) is not None:
            seen.append(got[:2])
            behave(*got, writer)
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield seen
    finally:
        server.close()


async def test_a_call_without_an_answer_fails_by_its_deadline_and_is_cancelled(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.sock.lane"
    async with _fake_lane(path, lambda *_: None) as seen:
        lane = Lane(str(path), connect_timeout_s=1)
        try:
            with pytest.raises(PeerUnavailableError, match=r"DEADLINE_EXCEEDED.*0\.3s"):
                await lane.call("Abort", pb.AbortRequest(), pb.AbortResponse, 0.3, "abort")
            for _ in range(50):
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.02)
            assert [kind for _, kind in seen] == [Kind.UNARY, Kind.CANCEL]
            assert seen[0][0] == seen[1][0]
        finally:
            await lane.close()


async def test_a_lost_connection_fails_its_calls_and_the_next_call_reconnects(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.sock.lane"
    calls = 0

    def behave(call_id: int, kind: Kind, payload: bytes, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            writer.transport.abort()  # the sidecar went away mid-call
        else:
            reply = pb.AbortResponse(state=pb.ABORT_STATE_HELD)
            writer.write(frame(call_id, Kind.REPLY, reply.SerializeToString()))

    async with _fake_lane(path, behave):
        lane = Lane(str(path), connect_timeout_s=1)
        try:
            with pytest.raises(PeerUnavailableError, match=r"abort: .*engine lane"):
                await lane.call("Abort", pb.AbortRequest(), pb.AbortResponse, 5, "abort")
            reply = await lane.call("Abort", pb.AbortRequest(), pb.AbortResponse, 5, "abort")
            assert reply.state == pb.ABORT_STATE_HELD
        finally:
            await lane.close()


async def test_an_answer_that_does_not_decode_is_no_answer_not_a_refusal(
    tmp_path: Path,
) -> None:
    """The sidecar ran the call and its reply cannot be read: the caller cannot know
    what was done (a Pull may have been taken), so it is told as after a deadline."""
    path = tmp_path / "e.sock.lane"

    def behave(call_id: int, kind: Kind, payload: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(call_id, Kind.REPLY, b"\xff\xff\xff"))  # no PullResponse

    async with _fake_lane(path, behave):
        lane = Lane(str(path), connect_timeout_s=1)
        try:
            with pytest.raises(PeerUnavailableError, match="pull: the answer does not decode"):
                await lane.call("Pull", pb.PullRequest(), pb.PullResponse, 5, "pull")
        finally:
            await lane.close()


async def test_no_lane_socket_fails_naming_its_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock.lane"
    lane = Lane(str(path), connect_timeout_s=0.2)
    with pytest.raises(PeerUnavailableError, match=f"no engine lane at {path} within 0.2s"):
        await lane.call("Abort", pb.AbortRequest(), pb.AbortResponse, 1, "abort")


def test_a_file_where_the_lane_goes_is_refused_and_kept(tmp_path: Path) -> None:
    mine = tmp_path / "sc.sock.lane"  # beside sidecar "sc"'s engine socket
    mine.write_text("not a socket")
    fleet = Fleet(tmp_path)
    try:
        with pytest.raises(ChildDiedError, match=r"sc\.sock\.lane \(the engine lane\) exists"):
            fleet.sidecar("sc")
        assert mine.read_text() == "not a socket"
    finally:
        fleet.close()


async def test_a_killed_sidecars_lane_is_replaced_by_the_next(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        first = fleet.sidecar("sc")
        first.stop(signal.SIGKILL)  # leaves both socket files behind
        assert Path(first.ready["engine_lane"]).exists()
        second = fleet.sidecar("sc")
        async with EngineClient(second.ready["engine_address"], engine_id="e-nobody") as client:
            with pytest.raises(NotFoundError):  # answered on the new lane
                await client.abort("req-1")
    finally:
        fleet.close()


def test_a_client_that_stopped_reading_does_not_keep_its_sidecar_from_stopping(
    tmp_path: Path,
) -> None:
    """A hung engine with answers queued on its lane (it sends, it never reads) held the
    sidecar's SIGTERM for as long as it stayed connected: the lane waited for its socket
    to drain without bound, and nothing after it in the shutdown ran."""
    fleet = Fleet(tmp_path)
    try:
        proc = fleet.sidecar("sc")
        # Refused Aborts of a long engine id: answers the client never takes.
        body = pb.AbortRequest(engine_id="E" * 2000, request_id="x").SerializeToString()
        calls = b"".join(
            frame(call, Kind.UNARY, request_payload("Abort", body)) for call in range(1, 6001)
        )
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(proc.ready["engine_lane"])
            client.settimeout(2)  # the sidecar stops reading once its answers back up
            with contextlib.suppress(TimeoutError):
                client.sendall(calls)
            time.sleep(1)  # answered, and stuck in both sockets' buffers
            assert proc.popen.poll() is None
            proc.popen.send_signal(signal.SIGTERM)
            # the shutdown's grace, plus the lane's bounded flush, with room to spare
            assert proc.popen.wait(timeout=30) == 0
    finally:
        fleet.close()


async def test_a_request_over_the_message_limit_is_refused_alone_as_over_grpc(
    tmp_path: Path,
) -> None:
    """limits.max_message_bytes bounds the lane's requests as it bounds gRPC's, and one
    over it is refused by itself, naming the limit: the lane had a fixed 64 MiB frame
    limit past which it closed the connection, with every call and the event watch on
    it. A request no lane takes at all is refused by the client before it is sent."""
    fleet = Fleet(tmp_path)
    try:
        proc = fleet.sidecar("sc", "--limits.max-message-bytes", "65536")
        big = pb.AbortRequest(engine_id="E" * 70_000, request_id="x").SerializeToString()
        small = pb.AbortRequest(engine_id="e-nobody", request_id="x").SerializeToString()
        got, closed = await _exchange(
            proc.ready["engine_lane"],
            frame(1, Kind.UNARY, request_payload("Abort", big)),
            frame(2, Kind.UNARY, request_payload("Abort", small)),
        )
        assert not closed
        statuses = {call: status_pb2.Status.FromString(body) for call, _, body in got}
        assert statuses[1].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert statuses[1].message.startswith("limits.max_message_bytes: a 70")
        assert statuses[2].code == grpc.StatusCode.NOT_FOUND.value[0]  # served after it
        async with EngineClient(proc.ready["engine_address"], engine_id="e-nobody") as client:
            with pytest.raises(LimitExceededError, match="exceeds the lane's"):
                await client.abort("r" * (65 << 20))
            with pytest.raises(NotFoundError):  # the same connection, still up
                await client.abort("req-1")
    finally:
        fleet.close()
