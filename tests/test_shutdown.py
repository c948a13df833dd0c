"""SIGTERM during pulls, over UCX TCP: drains what it must, never unmaps under a transfer.

Real kvxfer-server and engine-sim processes. A prefill sidecar told to stop
while a peer reads from it waits (within its grace period) for the read to
end, so its engine hears `Released(consumed)`, not `unregistered` under a live
read. A decode sidecar told to stop while its pulls hang on a frozen peer
exits cleanly even when the peer wakes up after the decode engine's memory
was released: no agent that could still write there is left running.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc.aio
import pytest
from big_pulls import MODEL, PER_REQUEST, SIZES, TOKENS, reads_under_way, request_spans
from sidecars import (
    DecodeImage,
    being_read,
    engine_link,
    freeze,
    scrape,
    start_engine,
    start_sidecar,
    thaw,
)

from kvxfer.cli.fleet import Proc
from kvxfer.core.requests import PullDone, PullStatus, Released, ReleaseReason
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


async def test_prefill_sigterm_waits_for_the_live_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # a read that takes a while
    p = start_sidecar(tmp_path, "p", "--shutdown-grace-s", "30")
    d = start_sidecar(tmp_path, "d")
    procs = [p, d]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", *SIZES, num_blocks=PER_REQUEST)
        de = start_engine(tmp_path, d, MODEL, "decode", *SIZES, num_blocks=PER_REQUEST)
        procs += [pe, de]
        src, dst = request_spans(0), request_spans(0, reverse=True)
        async with (
            engine_link(p, pe) as (pc, p_events),
            engine_link(d, de) as (dc, d_events),
        ):
            params = await pc.publish("drain-0", TOKENS, src)
            await dc.pull(params, dst, 0)
            await being_read(p, "drain-0")
            p.popen.send_signal(signal.SIGTERM)
            done = await d_events.next(timeout_s=60)
            released = await p_events.next(timeout_s=60)
        assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
        assert isinstance(released, Released), released
        assert released.reason is ReleaseReason.CONSUMED, released
        assert released.bytes_read == done.bytes_moved
        image = DecodeImage(de)
        assert image.expect_pull(pe, src, dst, TOKENS, 0, {}) == done.bytes_moved
        image.check_all()
        assert await asyncio.to_thread(p.popen.wait, 60) == 0
    finally:
        for proc in reversed(procs):
            proc.stop()


async def test_decode_sigterm_with_pulls_hung_on_a_frozen_peer_exits_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    d_args = ("--shutdown-grace-s", "0.5", "--transfer.stall-deadline-s", "1")
    p_args = ("--lease.ttl-s", "60")
    async with reads_under_way(tmp_path, "hung", p_args=p_args, d_args=d_args) as pair:
        freeze(pair.p)
        try:
            pair.d.popen.send_signal(signal.SIGTERM)
            # Past the grace period and the stall deadline: the decode sidecar is
            # releasing its engine's memory and stopping its servers. Wake the peer.
            await asyncio.sleep(1.6)
        finally:
            thaw(pair.p)
        dones = [await pair.d_events.next(timeout_s=30) for _ in range(2)]
        code = await asyncio.to_thread(pair.d.popen.wait, 60)
    assert all(isinstance(x, PullDone) and x.status is not PullStatus.OK for x in dones)
    assert code == 0, f"decode sidecar exited with {code}; log: {pair.d.log}"


async def test_an_engine_that_died_under_an_open_read_is_unlinked_at_shutdown(
    tmp_path: Path,
) -> None:
    """A reader that began a read and vanished keeps the dead engine's memory until its
    lease TTL. A shutdown in between destroys every agent first, so nothing can read
    that memory any more: the engine's shared memory goes with the sidecar, not left
    in /dev/shm until someone cleans it by hand."""
    p = start_sidecar(tmp_path, "p", "--lease.ttl-s", "600", "--shutdown-grace-s", "1")
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", *SIZES, num_blocks=PER_REQUEST)
        src = request_spans(0)
        async with engine_link(p, pe) as (pc, _):
            params = await pc.publish("vanished-reader", TOKENS, src)
        async with grpc.aio.insecure_channel(p.ready["peer_address"]) as channel:
            peer = pb_grpc.PeerServiceStub(channel)
            await peer.BeginRead(
                pb.BeginReadRequest(
                    epoch=params.epoch, tp_rank=params.tp_rank, request_id="vanished-reader"
                )
            )  # and never heartbeats or ends it
        segments = [Path("/dev/shm", name) for name in pe.shm_names()]
        pe.proc.stop(signal.SIGKILL)
        await _engine_exit_seen(p)
        assert all(s.exists() for s in segments), "retired before the read was over"
        p.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(p.popen.wait, 60) == 0
        assert not [s.name for s in segments if s.exists()], f"left behind; log: {p.log}"
    finally:
        p.stop()


async def _engine_exit_seen(sidecar: Proc, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if scrape(sidecar).get(("kvxfer_engine_exits_total", ()), 0) >= 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the sidecar never saw its engine exit; log: {sidecar.log}")
