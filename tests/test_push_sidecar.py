"""Push between real sidecar processes: refusals by mode, wire validation by field,
abort on both sides, and a decode engine's blocks checked byte for byte.

P (prefill) pushes into D (decode, accepts push) and is refused by DP (decode,
`--transfer.modes pull`). Chunks never fail here; failures are test_push_e2e's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import pytest
from oracle import oracle_valid_tokens
from sidecars import (
    DecodeImage,
    EngineSim,
    Events,
    Proc,
    engine_link,
    scrape,
    spans,
    start_engine,
    start_sidecar,
)

from kvxfer._exceptions import InvalidInputError, NotFoundError
from kvxfer.cli.fleet import BIN, metric
from kvxfer.client import EngineClient
from kvxfer.core.requests import (
    AbortState,
    PullStatus,
    Pushed,
    Received,
    TransferMode,
)
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.sidecar import hello_from_proto, hello_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gpt-oss-20b"
B = 16
CLI = str(BIN / "kvxfer-cli")
LEASE = ("--lease.ttl-s", "3", "--transfer.stall-deadline-s", "2")


@dataclass
class Pair:
    p: Proc
    pe: EngineSim
    d: Proc
    de: EngineSim
    dp: Proc
    dpe: EngineSim
    image: DecodeImage


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp: Path = tmp_path_factory.mktemp("push")
    procs: list[Proc | EngineSim] = []
    try:
        p = start_sidecar(tmp, "p", *LEASE, "--transfer.chunk-blocks", "4")
        procs.append(p)
        d = start_sidecar(tmp, "d", *LEASE, "--limits.max-calls-per-peer", "2")
        procs.append(d)
        dp = start_sidecar(tmp, "dp", *LEASE, "--transfer.modes", "pull")
        procs.append(dp)
        pe = start_engine(tmp, p, MODEL, "prefill")
        procs.append(pe)
        de = start_engine(tmp, d, MODEL, "decode")
        procs.append(de)
        dpe = start_engine(tmp, dp, MODEL, "decode")
        procs.append(dpe)
        yield Pair(p, pe, d, de, dp, dpe, DecodeImage(de))
    finally:
        for proc in reversed(procs):
            proc.stop()


def _blocks(tokens: int, first: int) -> list:
    ids = list(range(first, first + -(-tokens // B)))
    return spans({0: ids, 1: ids[::-1]})


async def test_progressive_push_writes_exactly_the_needed_blocks(pair: Pair) -> None:
    tokens, computed = 900, 256
    src, dst = _blocks(tokens, 10), _blocks(tokens, 0)
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = await d.expect("progressive", tokens, dst, computed)
        assert params.mode is TransferMode.PUSH
        assert params.peer_address == pair.d.ready["peer_address"]
        first = await p.push(params, src, 300, final=False)
        assert first.chunks > 2 and first.chunks_posted < first.chunks  # not all ready
        await p.push(params, src, 600, final=False)
        with pytest.raises(InvalidInputError, match="tokens_ready"):
            await p.push(params, src, 500, final=False)  # readiness never goes back
        await p.push(params, src, tokens, final=True)
        received = await d_events.next()
        pushed = await p_events.next()
    assert isinstance(received, Received) and received.status is PullStatus.OK, received
    assert isinstance(pushed, Pushed) and pushed.status is PullStatus.OK
    assert received.valid_tokens == tokens and received.failed_blocks == {}
    moved = pair.image.expect_pull(pair.pe, src, dst, tokens, computed, {})
    pair.image.check_all()
    assert received.bytes_moved == pushed.bytes_moved == moved


HOLD_S = 0.3  # how long BeginWrite goes unanswered for a push "still starting"


@contextlib.contextmanager
def _begin_write_held(pair: Pair) -> Iterator[None]:
    """The decode sidecar frozen: a push started meanwhile waits in BeginWrite, so calls
    sent during it find it still starting, however fast the machine answers."""
    os.kill(pair.d.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pair.d.pid, signal.SIGCONT)


async def test_calls_for_a_push_still_starting_wait_for_its_start(pair: Pair) -> None:
    """The engine's next readiness (or a retry after a deadline) sent while its first call
    still links and begins the write: it joins that push instead of beginning a second
    write, which the decode side refuses, losing `final` and with it the whole push."""
    tokens = 300
    src, dst = _blocks(tokens, 30), _blocks(tokens, 30)
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = await d.expect("sent-at-once", tokens, dst)
        with _begin_write_held(pair):  # every call arrives while the push is starting
            calls = [
                asyncio.ensure_future(p.push(params, src, 100, final=False)),
                asyncio.ensure_future(p.push(params, src, tokens, final=True)),
                # sent at once: no order, not going back
                asyncio.ensure_future(p.push(params, src, 200, final=False)),
            ]
            await asyncio.sleep(HOLD_S)
        answers = await asyncio.gather(*calls)
        assert len({a.bytes_planned for a in answers}) == 1 and answers[0].bytes_planned > 0
        received = await d_events.next()
        pushed = await p_events.next()
    assert isinstance(received, Received) and received.status is PullStatus.OK, received
    assert isinstance(pushed, Pushed) and pushed.status is PullStatus.OK, pushed
    moved = pair.image.expect_pull(pair.pe, src, dst, tokens, 0, {})
    pair.image.check_all()
    assert received.bytes_moved == moved


async def test_a_push_whose_engine_stops_calling_gives_the_blocks_back(pair: Pair) -> None:
    """The writer's heartbeat keeps the decode side's lease alive, so a prefill engine
    that hangs before `final` would hold the decode engine's blocks for ever: a lease
    TTL after its last call the push ends, and both engines hear why (no revocation:
    what was posted completed)."""
    tokens = 900
    src, dst = _blocks(tokens, 10), _blocks(tokens, 0)
    revocations = ("kvxfer_push_revocations_total", ())
    before = scrape(pair.d).get(revocations, 0)
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = await d.expect("hung-prefill", tokens, dst)
        await p.push(params, src, 300, final=False)  # and never again
        received = await d_events.next(timeout_s=30)
        pushed = await p_events.next(timeout_s=30)
    assert isinstance(received, Received) and received.status is PullStatus.ABORTED, received
    assert "no Push call" in received.reason, received.reason
    assert isinstance(pushed, Pushed) and pushed.status is PullStatus.ABORTED, pushed
    assert received.failed_blocks and received.valid_tokens < tokens
    assert scrape(pair.d).get(revocations, 0) == before
    # What was ready went, byte for byte; every other block is reported failed.
    moved = pair.image.expect_pull(pair.pe, src, dst, tokens, 0, received.failed_blocks)
    pair.image.check_all()
    assert moved == received.bytes_moved > 0


async def test_push_to_a_pull_only_peer_is_refused_naming_the_setting(pair: Pair) -> None:
    async with (
        engine_link(pair.p, pair.pe) as (p, _),
        engine_link(pair.dp, pair.dpe) as (dp, _),
        engine_link(pair.d, pair.de) as (d, _),
    ):
        with pytest.raises(InvalidInputError, match=r"transfer\.modes") as refused:
            await dp.expect("to-pull-only", 100, _blocks(100, 0))
        assert refused.value.field == "mode"
        # Params that name the pull-only peer (say, it restarted with other settings):
        params = await d.expect("redirected", 100, _blocks(100, 40))
        forged = dataclasses.replace(params, peer_address=pair.dp.ready["peer_address"])
        with pytest.raises(InvalidInputError, match=r"does not accept pushes.*transfer\.modes"):
            await p.push(forged, _blocks(100, 0), 100)
        assert await d.abort("redirected") is AbortState.EXPECTED


async def test_wire_validation_names_each_field(pair: Pair) -> None:
    async with (
        engine_link(pair.p, pair.pe) as (p, _),
        engine_link(pair.d, pair.de) as (d, d_events),
        engine_link(pair.dp, pair.dpe) as (dp, _),
    ):
        with pytest.raises(InvalidInputError, match="request_id"):
            await d.expect("has space", 100, _blocks(100, 0))
        with pytest.raises(InvalidInputError, match="computed_tokens"):
            await d.expect("c", 100, _blocks(100, 0), 200)
        # Refused by the planner's bounds before anything is held (named as sent).
        with pytest.raises(InvalidInputError, match=r"^num_tokens: must be at most "):
            await d.expect("huge", 1 << 41, _blocks(100, 0))
        await d.expect("huge", 100, _blocks(100, 0))  # the id was never held
        assert await d.abort("huge") is AbortState.EXPECTED
        dropped = await d_events.next()
        assert isinstance(dropped, Received) and dropped.request_id == "huge"
        with pytest.raises(InvalidInputError, match=r"spans\[1\].group_id"):
            await d.expect("dup", 100, spans({0: [1]}) + spans({0: [2]}))
        with pytest.raises(InvalidInputError, match=r"spans\[0\]"):
            await d.expect("short", 1000, _blocks(100, 0))
        params = await d.expect("valid", 100, _blocks(100, 60))
        with pytest.raises(InvalidInputError, match="tokens_ready"):
            await p.push(params, _blocks(100, 0), 101)
        with pytest.raises(InvalidInputError, match=r"^local_spans\[group 0\]"):
            await p.push(params, _blocks(30, 0), 100)  # too short for 100 tokens
        # The write had begun: it is ended, and the decode engine hears why.
        ended = await d_events.next()
        assert isinstance(ended, Received) and ended.status is PullStatus.ABORTED
        assert "local_spans" in ended.reason
        assert set(ended.failed_blocks) == {0, 1} and ended.valid_tokens == 0
        params = await d.expect("valid-again", 100, _blocks(100, 60))
        pull_params = dataclasses.replace(params, mode=TransferMode.PULL)
        with pytest.raises(InvalidInputError, match=r"params\.mode"):
            await p.push(pull_params, _blocks(100, 0), 100)
        with pytest.raises(InvalidInputError, match=r"params\.mode"):
            await dp.pull(params, _blocks(100, 0), 0)  # push params are not pulled
        assert await d.abort("valid-again") is AbortState.EXPECTED
        aborted = await d_events.next()
        assert isinstance(aborted, Received) and aborted.status is PullStatus.ABORTED
        with pytest.raises(NotFoundError):
            await p.push(params, _blocks(100, 0), 100)  # no longer expected


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_abort_from_either_side_during_a_push(pair: Pair, side: str) -> None:
    """Either engine aborts while the writer waits for readiness. Decode: the writer
    hears it by heartbeat; prefill: its own push stops. The write is ended as aborted,
    and only then does the decode engine hear Received."""
    request_id = f"abort-{side}"
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = await d.expect(request_id, 800, _blocks(800, 60))
        await p.push(params, _blocks(800, 0), 0, final=False)
        if side == "decode":
            assert await d.abort(request_id) is AbortState.WRITING
        else:
            assert await p.abort(request_id) is AbortState.PUSHING
        pushed = await p_events.next()
        received = await d_events.next()
    assert isinstance(pushed, Pushed) and pushed.status is PullStatus.ABORTED
    assert isinstance(received, Received) and received.status is PullStatus.ABORTED
    assert received.valid_tokens == 0 and received.bytes_moved == 0
    pair.image.check_all()  # nothing was written


async def test_a_later_call_naming_other_blocks_is_refused_naming_them(pair: Pair) -> None:
    """The push reads the blocks its first call named; a later call naming others was
    taken as a readiness update, and its blocks silently ignored."""
    request_id = "other-blocks"
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = await d.expect(request_id, 300, _blocks(300, 60))
        await p.push(params, _blocks(300, 0), 0, final=False)
        with pytest.raises(InvalidInputError) as refused:
            await p.push(params, _blocks(300, 20), 300, final=True)
        assert refused.value.field == "local_spans"
        assert await p.abort(request_id) is AbortState.PUSHING
        pushed = await p_events.next()
        received = await d_events.next()
    assert isinstance(pushed, Pushed) and pushed.status is PullStatus.ABORTED
    assert isinstance(received, Received) and received.status is PullStatus.ABORTED
    pair.image.check_all()  # nothing was written


async def test_an_abort_while_the_push_is_starting_stops_it_before_any_write(
    pair: Pair,
) -> None:
    """The engine aborts right after its first (final) Push call, while the push still
    links and begins the write: the abort was answered NOT_FOUND and the push then wrote
    every block from memory the engine had been told nothing was reading. Now it is
    PUSHING, the push stops as it is recorded, and both engines hear it aborted."""
    request_id = "abort-starting"
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = await d.expect(request_id, 800, _blocks(800, 60))
        with _begin_write_held(pair):  # the Abort reaches the sidecar before BeginWrite's answer
            pushing = asyncio.create_task(p.push(params, _blocks(800, 0), 800, final=True))
            await asyncio.sleep(HOLD_S)
            assert await p.abort(request_id) is AbortState.PUSHING
        accepted = await pushing
        pushed = await p_events.next()
        received = await d_events.next()
    assert accepted.chunks_posted == 0
    assert isinstance(pushed, Pushed) and pushed.status is PullStatus.ABORTED, pushed
    assert isinstance(received, Received) and received.status is PullStatus.ABORTED
    assert received.bytes_moved == 0
    pair.image.check_all()  # nothing was written


async def test_an_expected_request_nobody_writes_fails_at_its_ttl(pair: Pair) -> None:
    async with engine_link(pair.d, pair.de) as (d, d_events):
        await d.expect("never-written", 300, _blocks(300, 100))
        received = await d_events.next(timeout_s=15)
    assert isinstance(received, Received) and received.status is PullStatus.FAILED
    assert "no prefill sidecar began writing" in received.reason
    assert received.valid_tokens == 0 and set(received.failed_blocks) == {0, 1}
    await asyncio.sleep(0)


async def test_an_engine_that_unregisters_hears_its_expected_requests_aborted(
    tmp_path: Path,
) -> None:
    """As its own Abort would say (Received, aborted), not as for a publication it made
    (Released, unregistered): a decode engine hears of a push only by Received."""
    d = start_sidecar(tmp_path, "d")
    de = start_engine(tmp_path, d, MODEL, "decode")
    try:
        async with EngineClient(d.ready["engine_address"], engine_id=de.engine_id) as client:
            events = Events(client)
            await events.watching(_blocks(1, 100))  # else it may reach d after the engine left
            await client.expect("expected", 64, _blocks(64, 0))
            await client.unregister()
            heard = await events.next(timeout_s=10)
            await events.close()
        released = metric(scrape(d), "kvxfer_released_leases_total", reason="unregistered")
    finally:
        de.stop()
        d.stop()
    assert isinstance(heard, Received) and heard.status is PullStatus.ABORTED, heard
    assert heard.request_id == "expected" and set(heard.failed_blocks) == {0, 1}
    assert released == 0  # it published nothing


def test_handshake_cli_shows_the_agreed_mode(pair: Pair) -> None:
    def handshake(peer: Proc, mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CLI, "handshake", "--peer", peer.ready["peer_address"], "--layout", MODEL,
             "--mode", mode],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    agreed = handshake(pair.d, "push")
    assert agreed.returncode == 0, agreed.stderr
    assert "mode push agreed (peer's transfer.modes: pull, push)" in agreed.stdout
    refused = handshake(pair.dp, "push")
    assert refused.returncode != 0
    assert "mode push REFUSED" in refused.stdout and "transfer.modes" in refused.stdout
    assert handshake(pair.dp, "pull").returncode == 0


async def test_end_write_is_validated_by_field_and_capped_by_the_decode_side(pair: Pair) -> None:
    """A writer speaking the peer protocol directly: every EndWrite field is checked,
    only its writer (token) may end it, and the decode side's recompute rule bounds
    the valid_tokens a writer claims."""
    tokens = 200
    async with engine_link(pair.d, pair.de) as (d, d_events):
        await d.expect("end-write", tokens, _blocks(tokens, 100), 0)
        async with grpc.aio.insecure_channel(pair.d.ready["peer_address"]) as channel:
            peer = pb_grpc.PeerServiceStub(channel)
            hello = hello_from_proto(
                await peer.Handshake(
                    hello_request(pair.de.layout, epoch=1, sidecar_id="w", dry_run=True)
                ),
                dry_run=True,
            )
            assert TransferMode.PUSH in hello.modes
            with pytest.raises(grpc.aio.AioRpcError, match="published"):
                await peer.BeginRead(
                    pb.BeginReadRequest(epoch=hello.epoch, request_id="end-write", reader_id="r")
                )  # a destination lease is never read
            begun = await peer.BeginWrite(
                pb.BeginWriteRequest(epoch=hello.epoch, request_id="end-write", writer_id="w")
            )
            assert begun.num_tokens == tokens and begun.write_token

            def end(**fields: object) -> pb.EndWriteRequest:
                base: dict[str, object] = {
                    "epoch": hello.epoch, "request_id": "end-write",
                    "write_token": begun.write_token, "reason": pb.RELEASE_REASON_CONSUMED,
                    "valid_tokens": tokens,
                }  # fmt: skip
                return pb.EndWriteRequest(**{**base, **fields})  # type: ignore[arg-type]

            bad = [
                (end(reason=pb.RELEASE_REASON_UNREGISTERED), "reason"),
                (end(bytes_written=1 << 40), "bytes_written"),
                (end(valid_tokens=tokens + 1), "valid_tokens"),
                (end(failed_blocks=[pb.GroupBlocks(group_id=1, logical_blocks=[99])]),
                 "failed_blocks"),
                (end(failed_blocks=[pb.GroupBlocks(group_id=7, logical_blocks=[0])]),
                 "failed_blocks"),
                (end(failed_blocks=[pb.GroupBlocks(group_id=1, logical_blocks=[2, 2])]),
                 r"failed_blocks\[0\]\.logical_blocks"),
                (end(write_token="not-the-token"), "write_token"),
                (end(epoch=hello.epoch + 1), "epoch"),
            ]  # fmt: skip
            for request, field in bad:
                with pytest.raises(grpc.aio.AioRpcError, match=field):
                    await peer.EndWrite(request)
            # A writer claiming everything valid although block 2 of the full-attention
            # group failed: the decode side's rule answers (the sliding-window group
            # moved only the window's blocks, so nothing before them is valid: 0).
            reply = await peer.EndWrite(
                end(failed_blocks=[pb.GroupBlocks(group_id=1, logical_blocks=[2])])
            )
        received = await d_events.next()
    want = oracle_valid_tokens(pair.de.layout.groups, tokens, 0, B, {1: [2]})
    assert reply.valid_tokens == want < tokens
    assert isinstance(received, Received) and received.status is PullStatus.FAILED
    assert received.valid_tokens == want and received.failed_blocks == {1: (2,)}


async def test_a_burst_of_pushes_beyond_the_peers_call_limit_all_land(pair: Pair) -> None:
    """D runs 2 calls at once per client (`--limits.max-calls-per-peer 2`). Sixteen
    pushes started at once (a BeginWrite each, heartbeats, an EndWrite) all land byte
    for byte: D's PeerService handlers answer without suspending, so one client's calls
    do not pile up there, and none is refused (were an EndWrite refused, P would try
    it again: `end_patiently`)."""
    tokens, n = 64, 16
    src = _blocks(tokens, 10)
    dsts = [_blocks(tokens, 60 + 4 * i) for i in range(n)]
    async with (
        engine_link(pair.p, pair.pe) as (p, p_events),
        engine_link(pair.d, pair.de) as (d, d_events),
    ):
        params = [await d.expect(f"burst-{i}", tokens, dsts[i]) for i in range(n)]
        await asyncio.gather(*(p.push(x, src, tokens, final=True) for x in params))
        received = {e.request_id: e for e in [await d_events.next() for _ in range(n)]}
        pushed = [await p_events.next() for _ in range(n)]
    assert sorted(received) == sorted(f"burst-{i}" for i in range(n))
    for i in range(n):
        event = received[f"burst-{i}"]
        assert isinstance(event, Received) and event.status is PullStatus.OK, event
        moved = pair.image.expect_pull(pair.pe, src, dsts[i], tokens, 0, {})
        assert event.bytes_moved == moved
    assert all(isinstance(e, Pushed) and e.status is PullStatus.OK for e in pushed), pushed
    pair.image.check_all()
