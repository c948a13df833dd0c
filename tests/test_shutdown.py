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
import os
import signal
from pathlib import Path

import pytest
from sidecars import DecodeImage, being_read, engine_link, spans, start_engine, start_sidecar

from kvxfer.core.requests import PullDone, PullStatus, Released, ReleaseReason

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "gpt-oss-20b"
B = 16
TOKENS = 32 * 1024
PER_REQUEST = TOKENS // B
WINDOW_BLOCKS = 10  # covers the 128-token window of group 0 at any alignment
SIZES = ("--sliding-blocks", str(2 * WINDOW_BLOCKS))


def request_spans(i: int, *, reverse: bool = False) -> list:
    """Spans of request `i`: every full-attention block, the window's last blocks."""
    ids = list(range(i * PER_REQUEST, (i + 1) * PER_REQUEST))
    window = list(range(i * WINDOW_BLOCKS, (i + 1) * WINDOW_BLOCKS))
    if reverse:
        ids, window = ids[::-1], window[::-1]
    return spans({1: ids}) + spans({0: window}, first=PER_REQUEST - WINDOW_BLOCKS)


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
    p = start_sidecar(tmp_path, "p", "--lease.ttl-s", "60")
    d = start_sidecar(
        tmp_path, "d", "--shutdown-grace-s", "0.5", "--transfer.stall-deadline-s", "1"
    )
    procs = [p, d]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", *SIZES, num_blocks=2 * PER_REQUEST)
        de = start_engine(tmp_path, d, MODEL, "decode", *SIZES, num_blocks=2 * PER_REQUEST)
        procs += [pe, de]
        async with (
            engine_link(p, pe) as (pc, _),
            engine_link(d, de) as (dc, d_events),
        ):
            for i in range(2):
                params = await pc.publish(f"hung-{i}", TOKENS, request_spans(i))
                await dc.pull(params, request_spans(i, reverse=True), 0)
            await being_read(p, "hung-1")
            os.kill(p.pid, signal.SIGSTOP)
            try:
                d.popen.send_signal(signal.SIGTERM)
                # Past the grace period and the stall deadline: the decode sidecar is
                # releasing its engine's memory and stopping its servers. Wake the peer.
                await asyncio.sleep(1.6)
            finally:
                os.kill(p.pid, signal.SIGCONT)
            dones = [await d_events.next(timeout_s=30) for _ in range(2)]
        assert all(isinstance(x, PullDone) and x.status is not PullStatus.OK for x in dones)
        code = await asyncio.to_thread(d.popen.wait, 60)
        assert code == 0, f"decode sidecar exited with {code}; log: {d.log}"
    finally:
        for proc in reversed(procs):
            proc.stop()
