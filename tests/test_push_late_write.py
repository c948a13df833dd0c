"""No write after failed, for push, when the *target* stalls (UCX over TCP).

A pull's late-write guard works because the reader owns the destination memory:
destroying its own agent ends what it posted. A push inverts that: the bytes
land at the decode side's serving agent, which performs the put over UCX TCP.
Severing the writer's agent does not recall bytes already handed to the kernel
(the writer's send queue, the target's receive queue). Here the decode
sidecar's serving-agent child is frozen mid-push: the writer's chunk times out,
it severs, sends EndWrite, and the decode engine hears `Received` with failed
blocks. Then the child is thawed: every byte of the decode engine must still
hold what it held when `Received` came.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from big_pulls import MODEL, PER_REQUEST, SIZES, TOKENS, B, request_spans
from sidecars import engine_link, process_tree, start_engine, start_sidecar

from kvxfer.core.requests import Pushed, Received

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

DEADLINE_S = 2.0
THAW_WAIT_S = 5.0


def _image(engine: object) -> dict[str, npt.NDArray[np.uint8]]:
    return {name: engine.view(name).copy() for name in engine.buffer_names()}  # type: ignore[attr-defined]


async def test_no_byte_lands_after_received_when_the_serving_agent_stalls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # inherited by the sidecars: a network path
    timing = ("--transfer.stall-deadline-s", str(DEADLINE_S), "--lease.ttl-s", "60")
    p = start_sidecar(tmp_path, "p", *timing)
    procs: list[object] = [p]
    try:
        d = start_sidecar(tmp_path, "d", *timing)
        procs.append(d)
        pe = start_engine(tmp_path, p, MODEL, "prefill", *SIZES, num_blocks=2 * PER_REQUEST)
        procs.append(pe)
        de = start_engine(tmp_path, d, MODEL, "decode", *SIZES, num_blocks=2 * PER_REQUEST)
        procs.append(de)
        children = [pid for pid in process_tree(d.pid) if pid != d.pid]
        assert children, "the decode sidecar has no serving-agent child"
        async with engine_link(p, pe) as (pc, p_events), engine_link(d, de) as (dc, d_events):
            # Warm up: the link, the writer's agent and its UCX connection to the child.
            warm = await dc.expect("warm", 64 * B, request_spans(0, blocks=64))
            await pc.push(warm, request_spans(0, blocks=64), 64 * B, final=True)
            assert isinstance(await d_events.next(timeout_s=60), Received)
            assert isinstance(await p_events.next(timeout_s=60), Pushed)
            for pid in children:  # the target stalls; the decode sidecar itself answers
                os.kill(pid, signal.SIGSTOP)
            try:
                params = await dc.expect("late", TOKENS, request_spans(1, reverse=True))
                frozen_at = time.monotonic()
                await pc.push(params, request_spans(1), TOKENS, final=True)
                received = await d_events.next(timeout_s=60)
                at_report = _image(de)
                reported_after = time.monotonic() - frozen_at
            finally:
                for pid in children:  # revoked children are gone: nothing to wake
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(THAW_WAIT_S)
            after_thaw = _image(de)
        assert isinstance(received, Received), received
        assert received.failed_blocks, f"the push ended before the stall: {received}"
        assert reported_after < 30, reported_after
        landed = {
            name: int(np.count_nonzero(after_thaw[name] != at_report[name])) for name in at_report
        }
        assert not any(landed.values()), f"bytes landed after Received: {landed}"
    finally:
        for proc in reversed(procs):
            proc.stop()  # type: ignore[attr-defined]
