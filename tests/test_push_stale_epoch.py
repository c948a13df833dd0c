"""Push params from before the decode sidecar restarted.

A pull refuses params whose epoch is not the publisher's current one before it
begins anything there (pulls.py: "the publisher restarted"). A push must do the
same: after the decode sidecar restarted (same address, new epoch) and its
engine expected the same request id again, params of the old epoch name blocks
that no longer exist. They must be refused, leaving the new expectation to its
own writer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecars import engine_link, free_port, spans, start_engine, start_sidecar

from kvxfer._exceptions import KvxferError
from kvxfer.core.layout import BlockSpan
from kvxfer.core.requests import PullStatus, Pushed, Received

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gpt-oss-20b"
B = 16
TOKENS = 100


def _blocks(first: int) -> list[BlockSpan]:
    ids = list(range(first, first + -(-TOKENS // B)))
    return spans({0: ids, 1: ids})


async def test_stale_push_params_do_not_touch_the_restarted_decode_sides_request(
    tmp_path: Path,
) -> None:
    port = free_port()
    p = start_sidecar(tmp_path, "p", "--lease.ttl-s", "30")
    procs: list[object] = [p]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill")
        procs.append(pe)
        d = start_sidecar(tmp_path, "d", "--lease.ttl-s", "30", peer_port=port)
        de = start_engine(tmp_path, d, MODEL, "decode")
        async with engine_link(d, de) as (dc, _):
            stale = await dc.expect("again", TOKENS, _blocks(0))
        de.stop()
        d.stop()
        d2 = start_sidecar(tmp_path, "d2", "--lease.ttl-s", "30", peer_port=port)
        procs.append(d2)
        de2 = start_engine(tmp_path, d2, MODEL, "decode")
        procs.append(de2)
        async with (
            engine_link(p, pe) as (pc, p_events),
            engine_link(d2, de2) as (
                dc2,
                d_events,
            ),
        ):
            fresh = await dc2.expect("again", TOKENS, _blocks(20))
            assert fresh.epoch != stale.epoch
            with pytest.raises(KvxferError):  # today: params (spans differ), after BeginWrite
                await pc.push(stale, _blocks(40), TOKENS)
            # The new expectation is untouched: its own params push it (today: NotFound,
            # the stale writer's BeginWrite bound it and its abort ended it).
            await pc.push(fresh, _blocks(40), TOKENS)
            received = await d_events.next(timeout_s=30)
            pushed = await p_events.next(timeout_s=30)
        assert isinstance(received, Received), received
        assert received.status is PullStatus.OK, received
        assert isinstance(pushed, Pushed)
    finally:
        for proc in reversed(procs):
            proc.stop()  # type: ignore[attr-defined]
