"""An engine retires while its transfer's EndRead (EndWrite) waits on a frozen peer.

The retirement waits until no pull can touch the engine's memory, then unmaps it. It
used to wait for each pull's whole task, which after the PullDone goes on ending the
read at the publisher, patiently (`transfer.end_read_patience_s`, 300 s by default)
while the publisher does not answer. So an engine that retired while its publisher
was frozen or gone (a common reason for an engine to go) waited out the retirement's
deadline, was reported "a pull did not end", and its buffers stayed mapped for good,
although every chunk of the pull had ended. Here the decode sidecar's chunks stall
(fault injection) so the pull is still running when the prefill sidecar is frozen
and the decode engine unregisters: the pull's chunks fail at their deadline, its
EndRead cannot reach the publisher, and the engine must retire with its memory freed.
A prefill engine's push is the same with EndWrite, toward a frozen decode sidecar.
A pull queued for a slot against that publisher (the running ones hold theirs through
their EndRead) must not keep the retirement waiting either: it ends at once, aborted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from sidecars import engine_link, freeze, pd_sidecars, spans, thaw, unregister

from kvxfer.cli.fleet import Proc
from kvxfer.core.requests import PullDone, PullStatus, Pushed

pytestmark = [pytest.mark.e2e, pytest.mark.nixl, pytest.mark.timeout(120)]

MODEL = "gpt-oss-20b"
TOKENS = 64  # 4 blocks of 16
BLOCKS = spans({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
PROBE = spans({0: [8], 1: [8]})  # to see the engine's event watch on (`Events.watching`)
STALL_S = 4.0  # the transferring sidecar's stall deadline: every chunk fails at it
STALLING = ("--faults.stall-rate", "1", "--transfer.stall-deadline-s", str(STALL_S))


def assert_retired_and_freed(sidecar: Proc, engine_id: str) -> None:
    log = sidecar.log_text()
    assert f"engine {engine_id} retired" in log, log[-3000:]
    assert "did not end" not in log, log[-3000:]  # else its buffers stayed mapped
    sidecar.check_alive()


async def test_an_engine_retires_while_its_pulls_end_read_waits_on_a_frozen_peer(
    tmp_path: Path,
) -> None:
    with pd_sidecars(tmp_path, MODEL, d_args=STALLING) as pair:
        p, d, de = pair.p, pair.d, pair.de
        async with (
            engine_link(p, pair.pe) as (p_client, _),
            engine_link(d, de) as (d_client, d_events),
        ):
            await d_events.watching(PROBE)  # before the engine may go
            params = await p_client.publish("r", TOKENS, BLOCKS)
            pulling = time.monotonic()
            await d_client.pull(params, BLOCKS, 0)
            await asyncio.sleep(1.0)  # BeginRead answered: the read is begun at p
            assert d_events.pending() == 0, "the pull ended before its chunks' deadline"
            freeze(p)
            try:
                await unregister(d, de)
                retired_after = time.monotonic() - pulling
                done = await d_events.next(timeout_s=5)
            finally:
                thaw(p)
        assert isinstance(done, PullDone) and done.status is PullStatus.ABORTED, done
        assert_retired_and_freed(d, de.engine_id)
        print(f"retired {retired_after:.1f} s after the pull began")


async def test_an_engine_retires_while_its_pushs_end_write_waits_on_a_frozen_peer(
    tmp_path: Path,
) -> None:
    with pd_sidecars(tmp_path, MODEL, p_args=STALLING) as pair:
        p, d, pe = pair.p, pair.d, pair.pe
        async with (
            engine_link(d, pair.de) as (d_client, _),
            engine_link(p, pe) as (p_client, p_events),
        ):
            await p_events.watching(PROBE)
            params = await d_client.expect("r", TOKENS, BLOCKS)
            await p_client.push(params, BLOCKS, TOKENS)  # BeginWrite answered
            await asyncio.sleep(1.0)
            assert p_events.pending() == 0, "the push ended before its chunks' deadline"
            freeze(d)
            try:
                await unregister(p, pe)
                done = await p_events.next(timeout_s=5)
            finally:
                thaw(d)
        assert isinstance(done, Pushed) and done.status is PullStatus.ABORTED, done
        assert_retired_and_freed(p, pe.engine_id)


async def test_a_queued_pull_does_not_hold_up_its_engines_retirement(tmp_path: Path) -> None:
    one_slot = ("--limits.max-inflight-pulls-per-peer", "1")
    with pd_sidecars(tmp_path, MODEL, d_args=(*STALLING, *one_slot)) as pair:
        p, d, de = pair.p, pair.d, pair.de
        async with (
            engine_link(p, pair.pe) as (p_client, _),
            engine_link(d, de) as (d_client, d_events),
        ):
            await d_events.watching(PROBE)
            for request_id in ("running", "queued"):
                params = await p_client.publish(request_id, TOKENS, BLOCKS)
                await d_client.pull(params, BLOCKS, 0)
            await asyncio.sleep(1.0)  # "running" has its slot and is begun at p
            freeze(p)
            try:
                await unregister(d, de)
                done = {e.request_id: e for e in [await d_events.next(5), await d_events.next(5)]}
            finally:
                thaw(p)
        assert done["queued"].status is PullStatus.ABORTED, done
        assert done["queued"].reason == "its engine is going away", done
        assert done["running"].status is PullStatus.ABORTED, done
        assert_retired_and_freed(d, de.engine_id)
