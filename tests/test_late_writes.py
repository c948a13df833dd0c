"""A frozen prefill sidecar: what the engines are told must match what happened.

No write after "failed" (UCX over TCP):
Real kvxfer-server and engine-sim processes, UCX over TCP (`UCX_TLS=tcp,self`),
as between two hosts. Two 32k-token gpt-oss-20b pulls start, the prefill
sidecar is frozen with SIGSTOP, the decode engine gets PullDone with failed
blocks after the stall deadline, and then the prefill sidecar is thawed. NIXL
has no cancel: before kvxfer severed the reading agent, every byte of the
"failed" blocks landed within seconds of the thaw. Every byte of the decode
engine must hold, after the thaw, exactly what it held when PullDone came.

Consumed, not expired (UCX's default transports, CMA on one host): the decode
side reads a frozen peer's memory without its help, so the pull succeeds while
its EndRead cannot be answered. The prefill engine must hear that its blocks
were consumed, not that their lease expired.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from big_pulls import MODEL, PER_REQUEST, SIZES, TOKENS, B, reads_under_way, request_spans
from sidecars import being_read, engine_link, freeze, start_engine, start_sidecar, thaw

from kvxfer.core.requests import PullDone, PullStatus, Released, ReleaseReason

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

DEADLINE_S = 2.0
THAW_WAIT_S = 4.0


def _decode_image(engine: object) -> dict[str, npt.NDArray[np.uint8]]:
    return {name: engine.view(name).copy() for name in engine.buffer_names()}  # type: ignore[attr-defined]


async def test_no_byte_lands_after_pulldone_from_a_frozen_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # inherited by the sidecars: a network path
    timing = ("--transfer.stall-deadline-s", str(DEADLINE_S), "--lease.ttl-s", "60")
    async with reads_under_way(tmp_path, "frozen", p_args=timing, d_args=timing) as pair:
        freeze(pair.p)
        frozen_at = time.monotonic()
        try:
            dones = [await pair.d_events.next(timeout_s=60) for _ in range(2)]
            reported_after = time.monotonic() - frozen_at
            at_report = _decode_image(pair.de)
        finally:
            thaw(pair.p)
        await asyncio.sleep(THAW_WAIT_S)
        after_thaw = _decode_image(pair.de)
    assert all(isinstance(done, PullDone) for done in dones)
    failed = [done for done in dones if isinstance(done, PullDone) and done.failed_blocks]
    assert failed, f"the freeze came after both pulls ended: {dones}"
    for done in failed:
        assert done.status in (PullStatus.FAILED, PullStatus.PARTIAL), done
    assert reported_after < DEADLINE_S + 5, f"PullDone {reported_after:.1f}s after the freeze"
    landed = {
        name: int(np.count_nonzero(after_thaw[name] != at_report[name])) for name in at_report
    }
    assert not any(landed.values()), f"bytes landed after PullDone: {landed}"


async def test_a_read_that_finished_while_its_publisher_was_frozen_is_reported_consumed(
    tmp_path: Path,
) -> None:
    ttl = ("--lease.ttl-s", "3", "--transfer.stall-deadline-s", "2")
    p = start_sidecar(tmp_path, "p", *ttl, "--lease.sweep-s", "0.1")
    d = start_sidecar(tmp_path, "d", *ttl, "--transfer.rpc-timeout-s", "1")
    procs = [p, d]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", *SIZES, num_blocks=PER_REQUEST)
        de = start_engine(tmp_path, d, MODEL, "decode", *SIZES, num_blocks=PER_REQUEST)
        procs += [pe, de]

        async with (
            engine_link(p, pe) as (pc, p_events),
            engine_link(d, de) as (dc, d_events),
        ):
            # A first pull connects the decode side's reading agent to the publisher (UCX
            # wire-up needs both sides running); the second one is read during the freeze.
            warm = await pc.publish("warm-up", 64 * B, request_spans(0, blocks=64))
            await dc.pull(warm, request_spans(0, blocks=64), 0)
            assert isinstance(await d_events.next(timeout_s=60), PullDone)
            assert isinstance(await p_events.next(timeout_s=60), Released)
            params = await pc.publish("frozen-cma", TOKENS, request_spans(0))
            await dc.pull(params, request_spans(0, reverse=True), 0)
            await being_read(p, "frozen-cma")
            freeze(p)
            try:
                done = await d_events.next(timeout_s=60)
                await asyncio.sleep(5)  # past the lease TTL, and EndRead times out meanwhile
            finally:
                thaw(p)
            released = await p_events.next(timeout_s=30)
        assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
        assert isinstance(released, Released), f"the prefill engine was told {released}"
        assert released.reason is ReleaseReason.CONSUMED
        assert released.bytes_read == done.bytes_moved
    finally:
        for proc in reversed(procs):
            proc.stop()
