"""A prefill sidecar told to stop while one of its pushes waits for readiness.

Shutdown gives transfers in flight the grace period to finish. A progressive
push can only finish if its engine may still say how far the prefill got: a
Push call that only raises `tokens_ready` (or sets `final`) for a push already
running takes no new work and should be accepted while draining. Refused, the
push waits the whole grace for a `final` that cannot arrive and then ends aborted.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from sidecars import engine_link, spans, start_engine, start_sidecar

from kvxfer._exceptions import InvalidInputError, ShuttingDownError
from kvxfer.core.layout import BlockSpan
from kvxfer.core.requests import PullStatus, Received

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gpt-oss-20b"
B = 16
TOKENS = 800


def _blocks(first: int) -> list[BlockSpan]:
    ids = list(range(first, first + -(-TOKENS // B)))
    return spans({0: ids, 1: ids})


async def test_a_running_push_may_finish_during_the_grace_period(tmp_path: Path) -> None:
    p = start_sidecar(tmp_path, "p", "--shutdown-grace-s", "20")
    procs: list[object] = [p]
    try:
        d = start_sidecar(tmp_path, "d")
        procs.append(d)
        pe = start_engine(tmp_path, p, MODEL, "prefill")
        procs.append(pe)
        de = start_engine(tmp_path, d, MODEL, "decode")
        procs.append(de)
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            params = await dc.expect("draining", TOKENS, _blocks(0))
            await pc.push(params, _blocks(60), 0, final=False)
            p.popen.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
            while True:  # until draining: new work (a publish) is refused
                try:
                    await pc.publish("probe", 1, [])
                except ShuttingDownError:
                    break
                except InvalidInputError:
                    await asyncio.sleep(0.01)
            await pc.push(params, _blocks(60), TOKENS, final=True)
            received = await d_events.next(timeout_s=60)
        assert isinstance(received, Received), received
        assert received.status is PullStatus.OK, received
    finally:
        for proc in reversed(procs):
            proc.stop()  # type: ignore[attr-defined]
