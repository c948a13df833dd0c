"""No write after failed, for push, when the writer's own push ends exceptionally.

A push whose task raises (a bug in posting or waiting) or is cancelled may still
have chunks posted, WRITEs the decode side's serving agent has not finished. The
prefill engine must not hear `Pushed` while one of them may still read its
blocks, and the decode engine must not hear `Received` while one may still land.

The prefill sidecar runs in this process (a real `Sidecar`, real NIXL agents and
serving agent), so that its writing agent can be wrapped at the TransferBackend
seam; the decode sidecar and engine are real processes. UCX goes over TCP and
the decode side's serving-agent child is frozen: the first chunks' WRITEs stay
in flight until their stall deadline. Then the push ends exceptionally; once
the child is thawed, every byte of the decode engine must still hold what it held
when `Received` came.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from sidecars import (
    engine_link,
    in_process_sidecar,
    process_tree,
    pump,
    spans,
    start_engine,
    start_sidecar,
)

from kvxfer.cli.fleet import EngineView as EngineSim
from kvxfer.client.shm import shm_kv_cache
from kvxfer.core.layout import BlockSpan
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import EngineEvent, PullStatus, Pushed, Received
from kvxfer.dataplane.adapter import AgentOptions, ChunkJob, NixlAgent, TransferStatus
from kvxfer.dataplane.faults import FaultInjectingBackend
from kvxfer.server.sidecar import Sidecar

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gpt-oss-20b"
B = 16
TOKENS = 64 * B
DEADLINE_S = 2.0
THAW_WAIT_S = 4.0
TIMING = ("--transfer.stall-deadline-s", str(DEADLINE_S), "--lease.ttl-s", "60")


class WatchedWriter(FaultInjectingBackend):
    """The prefill sidecar's real writing agent. `in_flight` counts chunks the real agent
    has not ended (a waiter that gave up does not end them); once `armed`, a chunk
    raises instead of being posted, as a bug in the data plane would."""

    def __init__(self, inner: NixlAgent) -> None:
        super().__init__(inner, lambda _index, _job: None)
        self.armed = False
        self.started = 0
        self.in_flight = 0

    async def read(self, job: ChunkJob) -> TransferStatus:
        if self.armed:
            raise RuntimeError("injected: posting this chunk raised")
        self.started += 1
        self.in_flight += 1
        posted = asyncio.ensure_future(super().read(job))
        posted.add_done_callback(self._ended)
        return await asyncio.shield(posted)

    def _ended(self, _: object) -> None:
        self.in_flight -= 1


def _blocks(first: int) -> tuple[BlockSpan, ...]:
    ids = list(range(first, first + TOKENS // B))
    return tuple(spans({0: ids, 1: ids[::-1]}))


def _image(engine: EngineSim) -> dict[str, npt.NDArray[np.uint8]]:
    return {name: engine.view(name).copy() for name in engine.buffer_names()}


def prefill_sidecar(
    writers: list[WatchedWriter],
) -> contextlib.AbstractAsyncContextManager[Sidecar]:
    """The pushing sidecar in this process: its writing agents are watched."""

    def writer(prefix: str) -> WatchedWriter:
        writers.append(WatchedWriter(NixlAgent(prefix, AgentOptions())))
        return writers[-1]

    return in_process_sidecar("p-in-test", "--transfer.chunk-blocks", "8", *TIMING, readers=writer)


@pytest.mark.parametrize("ending", ["raises", "cancelled-posting", "cancelled-waiting"])
async def test_a_push_ending_exceptionally_reports_only_once_nothing_it_posted_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # this process's agents and the sidecars'
    d = start_sidecar(tmp_path, "d", *TIMING)
    procs: list[object] = [d]
    writers: list[WatchedWriter] = []
    children: list[int] = []
    layout = layout_for_model(MODEL)
    try:
        de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=256)
        procs.append(de)
        children = [pid for pid in process_tree(d.pid) if pid != d.pid]
        assert children, "the decode sidecar has no serving-agent child"
        with shm_kv_cache(layout, 256, prefix=f"kvxfer-unsettled-{os.getpid()}") as kv:
            for buffer in kv.buffers:
                kv.view(buffer.name)[:] = 0xAB  # not the decode engine's pattern
            async with (
                prefill_sidecar(writers) as p,
                engine_link(d, de) as (dc, d_events),
            ):
                engine = await p.register_engine(kv.layout, kv.buffers, "prefill")
                p_events: asyncio.Queue[EngineEvent] = asyncio.Queue()
                pumping = asyncio.create_task(pump(p.watch(engine.engine_id), p_events))

                # Warm up the link, the writing agent and its UCX connection to the child.
                warm = await dc.expect("warm", TOKENS, _blocks(0))
                await p.push_side.push(engine.engine_id, warm, _blocks(64), TOKENS, True)
                assert isinstance(await d_events.next(timeout_s=60), Received)
                assert isinstance(await asyncio.wait_for(p_events.get(), 60), Pushed)
                # Its writer was handed back (readers.py counts it busy until then).
                assert [r.busy for r in p._readers._readers.values()] == [0]
                for pid in children:  # the target stalls; the decode sidecar answers
                    os.kill(pid, signal.SIGSTOP)
                params = await dc.expect("unsettled", TOKENS, _blocks(64))
                # The first 16 full-attention blocks are ready: two chunks, whose WRITEs
                # stall at the frozen child.
                await p.push_side.push(engine.engine_id, params, _blocks(128), 16 * B, False)
                async with asyncio.timeout(10):
                    while not sum(w.started for w in writers):
                        await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)  # every chunk handed in has started
                (running,) = p.pushes.all()
                assert running.task is not None
                if ending == "raises":
                    for writer in writers:
                        writer.armed = True
                    await p.push_side.push(engine.engine_id, params, _blocks(128), TOKENS, True)
                elif ending == "cancelled-posting":
                    running.task.cancel()
                else:
                    await p.push_side.push(engine.engine_id, params, _blocks(128), TOKENS, True)
                    await asyncio.sleep(0.2)  # the run now waits for its chunks
                    running.task.cancel()
                pushed = await asyncio.wait_for(p_events.get(), 60)
                in_flight_at_pushed = sum(w.in_flight for w in writers)
                busy_at_pushed = [r.busy for r in p._readers._readers.values()]
                received = await d_events.next(timeout_s=60)
                at_report = _image(de)
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                await asyncio.sleep(THAW_WAIT_S)
                after_thaw = _image(de)
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pumping
        assert isinstance(pushed, Pushed), pushed
        assert pushed.status is not PullStatus.OK, pushed
        assert in_flight_at_pushed == 0, f"Pushed with {in_flight_at_pushed} chunk(s) posted"
        assert not any(busy_at_pushed), f"writers still counted busy: {busy_at_pushed}"
        assert isinstance(received, Received), received
        assert received.failed_blocks, received
        landed = {
            name: int(np.count_nonzero(after_thaw[name] != at_report[name])) for name in at_report
        }
        assert not any(landed.values()), f"bytes landed after Received: {landed}"
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for proc in reversed(procs):
            proc.stop()  # type: ignore[attr-defined]
