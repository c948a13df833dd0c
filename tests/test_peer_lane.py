"""The peer lane (server/peer_lane.py): a reader's per-request calls over framed TCP
instead of gRPC, through the peer port's gate, with the same errors.

Real kvxfer-server processes: pulls between two of them (which transport their
BeginRead and EndRead took, from the serving side's `kvxfer_peer_calls_total`),
and raw lane clients speaking to one as an anonymous or junk-sending client would.
The mTLS side is in test_peer_security.py.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
from google.protobuf.message import Message
from google.rpc import status_pb2
from sidecars import DecodeImage, engine_link, exchange, pd_sidecars, scrape, spans

from kvxfer._exceptions import (
    InvalidInputError,
    KvxferError,
    LaneUnreachableError,
    NotFoundError,
    PeerUnavailableError,
    PermissionDeniedError,
)
from kvxfer.cli.fleet import ChildDiedError, Fleet, Proc, metric
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.server import peers
from kvxfer.server.lane import LaneContext, LaneListener
from kvxfer.server.peer_lane import common_name
from kvxfer.server.peers import Dialer, PeerLink
from kvxfer.server.settings import load_settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.errors import guarded
from kvxfer.wire.lane import HEADER, Kind, frame, read_frame, request_payload
from kvxfer.wire.lane_client import MAX_CALL_ID, Lane
from kvxfer.wire.layout import layout_to_proto
from kvxfer.wire.sidecar import hello_from_proto, hello_to_proto

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gemma-3-4b-it"
BLOCKS = {0: list(range(8)), 1: list(range(8))}


def _calls(sidecar: Proc, method: str, transport: str) -> float:
    return metric(scrape(sidecar), "kvxfer_peer_calls_total", method=method, transport=transport)


async def _settled(sidecar: Proc, method: str, transport: str, count: int) -> None:
    """Wait until `sidecar` served `count` `method` calls over `transport` (EndRead goes
    out after PullDone)."""
    deadline = time.monotonic() + 10
    while _calls(sidecar, method, transport) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert _calls(sidecar, method, transport) == count


def _lane(sidecar: Proc) -> Lane:
    """An anonymous client of `sidecar`'s peer lane (no TLS: it serves on loopback)."""
    port = sidecar.ready["peer_lane_port"]

    async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    return Lane(f"127.0.0.1:{port}", 5, opener=opener, name="peer lane")


@pytest.mark.parametrize(
    ("p_args", "d_args", "transport"),
    [
        ((), (), "lane"),
        (("--no-lane.enabled",), (), "grpc"),  # the publisher offers no lane
        ((), ("--no-lane.enabled",), "grpc"),  # the reader does not use lanes
    ],
    ids=["lane", "publisher-off", "reader-off"],
)
async def test_a_pull_begins_and_ends_its_read_on_the_lane_unless_a_side_turned_it_off(
    tmp_path: Path, p_args: tuple[str, ...], d_args: tuple[str, ...], transport: str
) -> None:
    with pd_sidecars(tmp_path, MODEL, p_args, d_args) as pd:
        assert (pd.p.ready["peer_lane_port"] == 0) == bool(p_args)
        async with engine_link(pd.p, pd.pe) as (pc, _), engine_link(pd.d, pd.de) as (dc, events):
            params = await pc.publish("lane-1", 100, spans(BLOCKS))
            await dc.pull(params, spans(BLOCKS), 0)
            done = await events.next()
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done.reason
        DecodeImage(pd.de).expect_pull(pd.pe, spans(BLOCKS), spans(BLOCKS), 100, 0, {})
        other = "grpc" if transport == "lane" else "lane"
        await _settled(pd.p, "EndRead", transport, 1)
        assert _calls(pd.p, "BeginRead", transport) == 1
        assert _calls(pd.p, "BeginRead", other) == _calls(pd.p, "EndRead", other) == 0
        assert _calls(pd.p, "Handshake", "grpc") == 1  # always gRPC: it names the lane


@pytest.fixture
async def published(tmp_path: Path) -> AsyncIterator[tuple[Proc, TransferParams]]:
    fleet = Fleet(tmp_path)
    try:
        p = fleet.sidecar("p")
        pe = fleet.engine(p, MODEL, "prefill", "--num-blocks", "32", "--state-blocks", "4")
        async with engine_link(p, pe) as (client, _):
            yield p, await client.publish("bound", 100, spans(BLOCKS))
    finally:
        fleet.close()


async def test_the_lane_binds_reads_and_refuses_as_grpc_does(
    published: tuple[Proc, TransferParams],
) -> None:
    p, params = published
    ids = {"epoch": params.epoch, "tp_rank": params.tp_rank}
    lane = _lane(p)
    channel = grpc.aio.insecure_channel(p.ready["peer_address"])
    stub = pb_grpc.PeerServiceStub(channel)

    async def both(
        method: str, request: object, reply: type, grpc_call: Callable[[], Awaitable[object]]
    ) -> tuple[BaseException | None, BaseException | None]:
        """What each transport raised for the same call (None: it answered)."""
        raised: list[BaseException | None] = []
        for call in (
            lambda: lane.call(method, request, reply, 5, method),  # type: ignore[arg-type]
            lambda: guarded(method, grpc_call),
        ):
            try:
                await call()
                raised.append(None)
            except KvxferError as exc:
                raised.append(exc)
        return raised[0], raised[1]

    try:
        # Nobody reads it yet: an anonymous heartbeat must not pin the lease, on either.
        beat = pb.HeartbeatRequest(**ids, request_ids=["bound"], read_tokens=[""])
        on_lane, on_grpc = await both("Heartbeat", beat, pb.HeartbeatResponse,
                                      lambda: stub.Heartbeat(beat))  # fmt: skip
        assert isinstance(on_lane, PermissionDeniedError) and isinstance(on_grpc, type(on_lane))
        missing = pb.BeginReadRequest(**ids, request_id="never-published")
        on_lane, on_grpc = await both("BeginRead", missing, pb.BeginReadResponse,
                                      lambda: stub.BeginRead(missing))  # fmt: skip
        assert isinstance(on_lane, NotFoundError) and isinstance(on_grpc, NotFoundError)
        assert "never-published" in str(on_lane)

        begun = await lane.call(
            "BeginRead", pb.BeginReadRequest(**ids, request_id="bound"), pb.BeginReadResponse, 5,
            "begin read",
        )  # fmt: skip
        assert len(begun.read_token) == 32 and begun.num_tokens == 100
        end = pb.EndReadRequest(**ids, request_id="bound", reason=pb.RELEASE_REASON_CONSUMED,
                                read_token="f" * 32)  # fmt: skip
        with pytest.raises(PermissionDeniedError):  # not the reader's token
            await lane.call("EndRead", end, pb.EndReadResponse, 5, "end read")
        beat.read_tokens[0] = begun.read_token
        renewed = await lane.call("Heartbeat", beat, pb.HeartbeatResponse, 5, "heartbeat")
        assert list(renewed.states) == [pb.LEASE_STATE_HELD]
        end.read_token = begun.read_token
        await lane.call("EndRead", end, pb.EndReadResponse, 5, "end read")
        assert _calls(p, "BeginRead", "lane") == 2 and _calls(p, "BeginRead", "grpc") == 1
    finally:
        await lane.close()
        await channel.close()
    assert "Traceback" not in p.log_text()


def _exchange(port: int, raw: bytes, wait_s: float = 5) -> Awaitable[tuple[list[Any], bool]]:
    return exchange(asyncio.open_connection("127.0.0.1", port), raw, wait_s=wait_s)


async def test_bad_requests_are_refused_by_method_and_junk_closes_only_its_connection(
    published: tuple[Proc, TransferParams],
) -> None:
    p, _ = published
    port = p.ready["peer_lane_port"]
    lane = _lane(p)
    try:
        too_large = pb.BeginReadRequest(request_id="x" * 5000)  # BeginRead may use 4 KiB
        before = metric(scrape(p), "kvxfer_refusals_total", reason="too_large")
        with pytest.raises(InvalidInputError, match=r"PeerService/BeginRead.*exceed the 4096"):
            await lane.call("BeginRead", too_large, pb.BeginReadResponse, 5, "begin read")
        assert metric(scrape(p), "kvxfer_refusals_total", reason="too_large") == before + 1
        # The lane serves the per-request calls; the handshake (and anything else) is not.
        with pytest.raises(KvxferError, match=r"not 'Handshake'"):
            await lane.call("Handshake", pb.HandshakeRequest(), pb.HandshakeResponse, 5, "h")
        undecodable = frame(3, Kind.UNARY, request_payload("EndRead", b"\xff\xff\xff"))
        ((call_id, kind, _),), closed = await _exchange(port, undecodable, wait_s=1)
        assert (call_id, kind, closed) == (3, Kind.ERROR, False)
        for junk in (
            HEADER.pack(4 << 20, 1, Kind.UNARY),  # a frame no peer request can need
            HEADER.pack(0, 1, 99),  # no such kind
            frame(1, Kind.REPLY),  # an answer's kind, from the client
            frame(0, Kind.UNARY, request_payload("EndRead", b"")),  # the connection's id
        ):
            got, closed = await _exchange(port, junk)
            assert got == [] and closed, junk
        with pytest.raises(NotFoundError):  # still serving, on the same lane client
            await lane.call(
                "BeginRead", pb.BeginReadRequest(request_id="nobody"), pb.BeginReadResponse, 5,
                "begin read",
            )  # fmt: skip
    finally:
        await lane.close()
    assert "Traceback" not in p.log_text()


async def test_a_connection_beyond_the_lane_limit_is_turned_away_and_its_peer_uses_grpc(
    tmp_path: Path,
) -> None:
    with pd_sidecars(tmp_path, MODEL, ("--limits.max-lane-connections", "1")) as pd:
        nobody = pb.BeginReadRequest(request_id="nobody")
        held, refused = _lane(pd.p), _lane(pd.p)
        try:
            with pytest.raises(NotFoundError):  # served: it holds the one connection
                await held.call("BeginRead", nobody, pb.BeginReadResponse, 5, "begin read")
            with pytest.raises(
                LaneUnreachableError,  # none of its calls ran: a caller may call again
                match=r"refused: limits\.max_lane_connections: the peer lane serves at most 1",
            ):
                await refused.call("BeginRead", nobody, pb.BeginReadResponse, 5, "begin read")
            assert metric(scrape(pd.p), "kvxfer_refusals_total", reason="too_many_connections") == 1
            assert _calls(pd.p, "BeginRead", "lane") == 1

            # A peer turned away reads all the same, its calls over gRPC.
            async with (
                engine_link(pd.p, pd.pe) as (pc, _),
                engine_link(pd.d, pd.de) as (dc, events),
            ):
                params = await pc.publish("over-grpc", 100, spans(BLOCKS))
                await dc.pull(params, spans(BLOCKS), 0)
                done = await events.next()
                assert isinstance(done, PullDone) and done.status is PullStatus.OK, done.reason
            DecodeImage(pd.de).expect_pull(pd.pe, spans(BLOCKS), spans(BLOCKS), 100, 0, {})
            await _settled(pd.p, "EndRead", "grpc", 1)
            assert _calls(pd.p, "BeginRead", "grpc") == 1 and _calls(pd.p, "BeginRead", "lane") == 1
            assert metric(scrape(pd.d), "kvxfer_peer_lane_unreachable_total") == 1
            assert "its calls go over gRPC for now" in pd.d.log_text()

            # The connection served still is; once it closes, the next is served.
            with pytest.raises(NotFoundError):
                await held.call("BeginRead", nobody, pb.BeginReadResponse, 5, "begin read")
            await held.close()
            deadline = time.monotonic() + 10
            while True:
                try:
                    await refused.call("BeginRead", nobody, pb.BeginReadResponse, 5, "b")
                except LaneUnreachableError:  # the closed one may not have ended there yet
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                except NotFoundError:
                    break
            # Turned away, and never closing: the sidecar's shutdown closes it.
            _, lingering = await asyncio.open_connection("127.0.0.1", pd.p.ready["peer_lane_port"])
        finally:
            await held.close()
            await refused.close()
        lingering.close()
        assert "turned away" in pd.p.log_text() and "Traceback" not in pd.p.log_text()


# A Heartbeat whose answer (an error naming its 1 MiB request id) is about 2 MiB.
ECHOED = request_payload(
    "Heartbeat",
    pb.HeartbeatRequest(request_ids=["x" * (1 << 20)], read_tokens=[""]).SerializeToString(),
)


def _raw_client() -> socket.socket:
    """A lane client whose kernel takes a few KiB of answers at most until it reads."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    return s


async def test_a_client_that_reads_no_answers_is_cut_off_and_others_are_served(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    try:
        # A few calls at once, so that without the deadline this holds some 32 MiB, not 1 GiB.
        p = fleet.sidecar("p", "--transfer.rpc-timeout-s", "2", "--limits.max-calls-per-peer", "16")
        loop = asyncio.get_running_loop()
        nobody = pb.BeginReadRequest(request_id="nobody")
        lane = _lane(p)
        with _raw_client() as s:
            await loop.sock_connect(s, ("127.0.0.1", p.ready["peer_lane_port"]))

            async def call_until_cut_off() -> None:
                for call_id in itertools.count(1):
                    await loop.sock_sendall(s, frame(call_id, Kind.UNARY, ECHOED))

            calling = asyncio.create_task(call_until_cut_off())
            try:
                await asyncio.sleep(0.5)  # its answers pile up, unread
                with pytest.raises(NotFoundError):  # another client is served meanwhile
                    await lane.call("BeginRead", nobody, pb.BeginReadResponse, 5, "begin read")
                # Not read while its answers wait unsent, and cut off once none of them
                # is taken for transfer.rpc_timeout_s (without that: blocked forever).
                with pytest.raises(ConnectionError):
                    await asyncio.wait_for(calling, 30)
                with pytest.raises(NotFoundError):
                    await lane.call("BeginRead", nobody, pb.BeginReadResponse, 5, "begin read")
            finally:
                calling.cancel()
                await lane.close()
        log = p.log_text()
        assert "its client read none of its answers" in log and "for 2s" in log
        assert metric(scrape(p), "kvxfer_peer_lane_stalled_total") == 1
        assert "Traceback" not in log
    finally:
        fleet.close()


class _LargeAnswers(LaneListener):
    """A lane (the peer lane's connection code) whose every call is answered with 2 MiB:
    errors no longer echo a request's values whole, and no peer call answers that much
    without a publishing engine behind it."""

    name = "large-answer lane"
    drain_deadline_s = 1.0

    async def decode(self, method: str, body: bytes, stream: bool) -> Any:
        return None

    async def unary(self, method: str, request: Any, context: LaneContext) -> Message:
        return pb.BeginReadResponse(read_token="x" * (2 << 20))


async def test_a_client_reading_its_answers_slowly_gets_them_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lane = _LargeAnswers()
    lane._server = await asyncio.start_server(lane._accept, "127.0.0.1", 0)
    port = lane._server.sockets[0].getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        calls = 8  # 16 MiB of answers: far more than the kernels' buffers between them
        with _raw_client() as s:
            await loop.sock_connect(s, ("127.0.0.1", port))
            ask = request_payload("BeginRead", b"")
            raw = b"".join(frame(i, Kind.UNARY, ask) for i in range(1, calls + 1))
            calling = asyncio.create_task(loop.sock_sendall(s, raw))
            received = bytearray()

            async def receive(size: int) -> None:
                target = len(received) + size
                while len(received) < target:
                    chunk = await asyncio.wait_for(loop.sock_recv(s, 1 << 20), 10)
                    assert chunk, "the lane closed the connection"
                    received.extend(chunk)

            # 64 KiB every half second, for eight times the deadline: slow, never stopped.
            for _ in range(16):
                await asyncio.sleep(0.5)
                await receive(64 << 10)
            answered: list[tuple[int, Kind]] = []
            offset = 0
            while len(answered) < calls:
                if len(received) - offset < HEADER.size:
                    await receive(HEADER.size)
                    continue
                length, call_id, kind = HEADER.unpack_from(received, offset)
                if len(received) - offset < HEADER.size + length:
                    await receive(HEADER.size + length - (len(received) - offset))
                    continue
                answered.append((call_id, Kind(kind)))
                offset += HEADER.size + length
            await calling
        assert answered == [(i, Kind.REPLY) for i in range(1, calls + 1)]
        assert "read none of its answers" not in caplog.text
    finally:
        await lane.close()


async def test_a_peer_lane_nobody_serves_fails_the_call_as_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        dialer = Dialer(load_settings([]))
        try:
            lane = await dialer.lane("127.0.0.1:7500", port)
            with pytest.raises(
                PeerUnavailableError,
                match=rf"cannot connect to the peer lane at 127\.0\.0\.1:{port}",
            ):
                await lane.call("BeginRead", pb.BeginReadRequest(), pb.BeginReadResponse, 1, "b")
        finally:
            await dialer.close()


def test_a_taken_lane_port_stops_the_sidecar_naming_the_setting(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(
                ChildDiedError,
                match=rf"lane\.port: cannot serve the peer lane on 127\.0\.0\.1:{port}",
            ):
                fleet.sidecar("p", "--lane.port", str(port))
        finally:
            fleet.close()


def test_an_advertised_sidecar_needs_a_fixed_lane_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_ADVERTISE_ADDRESS", "p-0.kvxfer-prefill:7500")
    with pytest.raises(InvalidInputError, match=r"lane\.port: peers dial the peer lane"):
        load_settings([])
    assert load_settings(["--lane.port", "7501"]).lane.port == 7501
    assert not load_settings(["--no-lane.enabled"]).lane.enabled


def test_a_handshake_naming_no_tcp_port_is_refused_by_field() -> None:
    layout = layout_to_proto(layout_for_model(MODEL, tp_size=1, tp_rank=0, block_size=16))
    hello = pb.HandshakeResponse(epoch=1, layout=layout, lane_port=70000)
    with pytest.raises(InvalidInputError, match=r"handshake\.lane_port: 70000 is not a TCP port"):
        hello_from_proto(hello, dry_run=True)
    hello.lane_port = 7501
    assert hello_to_proto(hello_from_proto(hello, dry_run=True)).lane_port == 7501


async def _answering_server() -> tuple[asyncio.Server, list[int]]:
    """A lane server that answers every call at once (an empty REPLY) and records the
    call ids it saw."""
    seen: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (got := await read_frame(reader)) is not None:
            seen.append(got[0])
            writer.write(frame(got[0], Kind.REPLY))
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), seen


async def test_call_ids_wrap_within_a_frames_u32_and_skip_none() -> None:
    server, seen = await _answering_server()
    port = server.sockets[0].getsockname()[1]

    async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port)

    lane = Lane("test", 5, opener=opener, name="peer lane")
    lane._last_id = MAX_CALL_ID - 2  # as after 2**32 - 3 calls
    try:
        for _ in range(4):
            await lane.call("EndRead", pb.EndReadRequest(), pb.EndReadResponse, 5, "end read")
    finally:
        await lane.close()
        server.close()
    assert seen == [MAX_CALL_ID - 1, MAX_CALL_ID, 1, 2]


async def test_a_refusal_of_the_connection_counts_only_as_its_first_frame() -> None:
    """An ERROR on call id 0 first: none of the calls ran (LaneUnreachableError, which a
    caller may send again over gRPC). After an answer a call may have run: the frame
    breaks the framing, and the waiting call is unavailable, never 'not sent'."""
    answer = pb.HandshakeResponse()  # the first call's reply: any message will do
    status = status_pb2.Status(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        message="limits.max_lane_connections: full",
    )

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if late:
                got = await read_frame(reader)
                assert got is not None
                writer.write(frame(got[0], Kind.REPLY, answer.SerializeToString()))
                await read_frame(reader)  # the second call: taken, never answered
            writer.write(frame(0, Kind.ERROR, status.SerializeToString()))
            await reader.read()
        finally:
            writer.close()

    for late in (False, True):
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def opener(port: int = port) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", port)

        lane = Lane("test", 5, opener=opener, name="peer lane")
        try:
            if late:
                await lane.call("EndRead", pb.EndReadRequest(), pb.HandshakeResponse, 5, "first")
            with pytest.raises(PeerUnavailableError) as failed:
                await lane.call("EndRead", pb.EndReadRequest(), pb.EndReadResponse, 5, "call")
            assert isinstance(failed.value, LaneUnreachableError) is not late
            assert ("not first" if late else "refused: limits.max_lane_connections") in str(
                failed.value
            )
        finally:
            await lane.close()
            server.close()
            await server.wait_closed()


async def test_callers_waiting_for_a_connect_that_fails_fail_with_it_not_in_turn() -> None:
    attempts = 0

    async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.3)
        raise LaneUnreachableError("cannot connect to the peer lane at 10.0.0.9:7501")

    lane = Lane("10.0.0.9:7501", 5, opener=opener, name="peer lane")
    start = time.monotonic()
    calls = [
        lane.call("BeginRead", pb.BeginReadRequest(), pb.BeginReadResponse, 5, "begin read")
        for _ in range(8)
    ]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, LaneUnreachableError) and "10.0.0.9:7501" in str(o) for o in outcomes)
    assert attempts == 1 and time.monotonic() - start < 1.5  # not 8 x 0.3 s in turn


def test_a_caller_is_its_certificates_first_common_name_as_over_grpc() -> None:
    subject = ((("commonName", "kvxfer-d"),), (("organizationName", "x"),),
               (("commonName", "aaa-other"),))  # fmt: skip
    assert common_name({"subject": subject}) == (b"kvxfer-d",)
    assert common_name({"subject": ((("organizationName", "x"),),)}) == ()
    assert common_name(None) == ()


async def test_a_lane_nobody_answers_hands_its_calls_to_grpc_and_is_retried_ever_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peers, "LANE_RETRY_S", 0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        layout = layout_to_proto(layout_for_model(MODEL, tp_size=1, tp_rank=0, block_size=16))
        hello = hello_from_proto(
            pb.HandshakeResponse(epoch=1, layout=layout, lane_port=port), dry_run=True
        )
        link = PeerLink("127.0.0.1:7500", 0, hello, "agent")
        dialer = Dialer(load_settings([]))
        lanes, grpc_calls = 0, 0
        real_lane = dialer.lane

        async def counted_lane(address: str, lane_port: int) -> Lane:
            nonlocal lanes
            lanes += 1
            return await real_lane(address, lane_port)

        class Stub:  # stands in for the gRPC stub: the peer port answers
            async def EndRead(self, request: object, timeout: float) -> pb.EndReadResponse:
                nonlocal grpc_calls
                grpc_calls += 1
                return pb.EndReadResponse()

        monkeypatch.setattr(dialer, "lane", counted_lane)
        monkeypatch.setattr(dialer, "stub", lambda address: Stub())

        async def call() -> None:
            reply = await dialer.call_peer(
                link, "EndRead", pb.EndReadRequest(), pb.EndReadResponse, "e"
            )
            assert isinstance(reply, pb.EndReadResponse)

        try:
            # The lane refuses: these calls go over gRPC, and the four that waited on
            # the one refused connect pause the lane once, not four times.
            await asyncio.gather(*(call() for _ in range(4)))
            assert (lanes, grpc_calls) == (4, 4)
            await call()  # within the pause: straight to gRPC
            assert (lanes, grpc_calls) == (4, 5)
            await asyncio.sleep(0.25)
            await call()  # tried again after 0.2 s, refused again: the pause doubles
            assert (lanes, grpc_calls) == (5, 6)
            await asyncio.sleep(0.25)
            await call()
            assert (lanes, grpc_calls) == (5, 7)
        finally:
            await dialer.close()
