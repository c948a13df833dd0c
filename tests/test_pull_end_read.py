"""A read BeginRead began is ended at the publisher on every way out of a decode pull.

Once BeginRead is answered, the publisher holds the lease for this reader, and
its engine's blocks, until EndRead or the lease's TTL. The publisher here is a
real prefill sidecar process with a real engine-sim; the decode sidecar runs in
this process (a real `Sidecar`, real NIXL agents and serving agent), so that a
step of its pull after BeginRead can be made to go wrong at a seam of
`kvxfer.server.pulls`: a bug raises, or the pull's task is cancelled while it
waits for its read. Either way the decode engine hears its PullDone as before,
and the prefill engine hears `Released(aborted)` at once. The TTL is 60 s:
within the test's wait nothing but an EndRead releases the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from sidecars import engine_link, in_process_sidecar, prefill_beside_cache, pump, spans

from kvxfer.core.requests import (
    EngineEvent,
    PullDone,
    PullStatus,
    Released,
    ReleaseReason,
)
from kvxfer.server import pulls

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"  # one full-attention group
NUM_BLOCKS = 16
BLOCKS = 8
TTL = ("--lease.ttl-s", "60")
RELEASE_WAIT_S = 20.0  # well within the TTL, far beyond an EndRead's round trip


def _inject(monkeypatch: pytest.MonkeyPatch, ending: str) -> asyncio.Event:
    """Make the pull go wrong after BeginRead answered; the event is set once a pull
    waiting for its read may be cancelled."""
    waiting = asyncio.Event()
    if ending == "raises":

        def from_result(*_: Any) -> PullDone:
            raise RuntimeError("injected: a bug once the read was done")

        monkeypatch.setattr(pulls, "_from_result", from_result)
        return waiting
    real_ended = pulls._ended

    async def ended(pull: pulls.Pull, ctx: pulls.PullContext, *, cancelled: bool = False) -> Any:
        if not cancelled:  # the begun read's wait: it lasts until the task is cancelled
            waiting.set()
            await asyncio.Event().wait()
        return await real_ended(pull, ctx, cancelled=cancelled)

    monkeypatch.setattr(pulls, "_ended", ended)
    return waiting


@pytest.mark.parametrize("ending", ["raises", "cancelled"])
async def test_a_begun_read_is_ended_at_once_when_its_pull_goes_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    waiting = _inject(monkeypatch, ending)
    with prefill_beside_cache(tmp_path, MODEL, NUM_BLOCKS, "endread", *TTL) as (p, pe, kv):
        tokens = BLOCKS * pe.layout.block_size
        async with (
            in_process_sidecar("d-in-test", *TTL) as d,
            engine_link(p, pe) as (pc, p_events),
        ):
            engine = await d.register_engine(kv.layout, kv.buffers, "decode")
            d_events: asyncio.Queue[EngineEvent] = asyncio.Queue()
            pumping = asyncio.create_task(pump(d.watch(engine.engine_id), d_events))
            params = await pc.publish(f"r-{ending}", tokens, spans({0: range(BLOCKS)}))
            dst = tuple(spans({0: range(NUM_BLOCKS - BLOCKS, NUM_BLOCKS)}))
            await d.pull(engine.engine_id, params, dst, 0)
            if ending == "cancelled":
                await asyncio.wait_for(waiting.wait(), 30)
                (pull,) = d.pulls()
                assert pull.task is not None
                pull.task.cancel()
            done = await asyncio.wait_for(d_events.get(), 30)
            try:
                released = await p_events.next(timeout_s=RELEASE_WAIT_S)
            except TimeoutError:
                released = None
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pumping
    assert isinstance(done, PullDone) and done.request_id == params.request_id, done
    assert done.failed_blocks == {0: tuple(range(BLOCKS))}, done
    if ending == "raises":
        assert done.status is PullStatus.FAILED, done
        assert done.reason.startswith("internal error: injected"), done
    else:
        assert done.status is PullStatus.ABORTED, done
    assert released is not None, (
        f"the publisher's lease was not released within {RELEASE_WAIT_S} s of PullDone: "
        "the read was not ended"
    )
    assert isinstance(released, Released) and released.request_id == params.request_id
    assert released.reason is ReleaseReason.ABORTED, released
