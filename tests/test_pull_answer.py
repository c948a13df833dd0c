"""When the decode sidecar answers Pull, and what a cancelled Pull call leaves behind.

Pull is answered once the NIXL thread has posted the read's first chunk (at most
`POST_WAIT_S` later), so that the answer's write does not compete with building the
handle. The engine's connector does not wait for that answer. A Pull call cancelled
while it waits (the caller's deadline) has already started the pull: it still runs to
its PullDone, and it is still counted in kvxfer_full_attention_bytes.

The decode sidecar runs in this process (a real `Sidecar`, real NIXL agents), with its
reading agents wrapped at the TransferBackend seam so that their posts can be held
back; the prefill sidecar and engine are real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from sidecars import engine_link, in_process_sidecar, pump, spans, start_engine, start_sidecar

from kvxfer.client.shm import shm_kv_cache
from kvxfer.core.layout import BlockSpan
from kvxfer.core.planner import full_attention_bytes
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import EngineEvent, PullDone, PullStatus
from kvxfer.dataplane.adapter import AgentOptions, ChunkJob, NixlAgent, TransferStatus
from kvxfer.dataplane.faults import WrappedBackend
from kvxfer.server import pulls

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "gpt-oss-20b"
B = 16
TOKENS = 8 * B
HOLD_S = 0.4  # how long a held-back read waits before its chunks go to the NIXL thread


class HeldBackReader(WrappedBackend):
    """A real reading agent whose reads, once `held`, reach the NIXL thread only
    `HOLD_S` after they were handed in (as a slow handle build would)."""

    def __init__(self, inner: NixlAgent) -> None:
        super().__init__(inner)
        self.held = False

    def post_all(self, jobs: Sequence[ChunkJob]) -> asyncio.Future[list[TransferStatus]]:
        if not self.held:
            return super().post_all(jobs)

        async def later() -> list[TransferStatus]:
            await asyncio.sleep(HOLD_S)
            return await super(HeldBackReader, self).post_all(jobs)

        return asyncio.ensure_future(later())


def _blocks(first: int) -> tuple[BlockSpan, ...]:
    ids = list(range(first, first + TOKENS // B))
    return tuple(spans({0: ids, 1: ids}))


def _full_attention_counted(sidecar: object) -> float:
    counter = sidecar.metrics.full_attention_bytes  # type: ignore[attr-defined]
    return sum(
        sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


@pytest.mark.parametrize("cancelled", [False, True], ids=["answered", "cancelled"])
async def test_pull_is_answered_after_the_post_and_a_cancelled_call_still_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cancelled: bool
) -> None:
    monkeypatch.setattr(pulls, "POST_WAIT_S", 5.0)  # the handler waits for the held post
    readers: list[HeldBackReader] = []

    def reader(prefix: str) -> HeldBackReader:
        readers.append(HeldBackReader(NixlAgent(prefix, AgentOptions())))
        return readers[-1]

    layout = layout_for_model(MODEL)
    p = start_sidecar(tmp_path, "p")
    procs: list[object] = [p]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=32)
        procs.append(pe)
        with shm_kv_cache(layout, 32, prefix=f"kvxfer-answer-{os.getpid()}") as kv:
            async with (
                in_process_sidecar("d-in-test", readers=reader) as d,
                engine_link(p, pe) as (pc, _),
            ):
                engine = await d.register_engine(kv.layout, kv.buffers, "decode")
                events: asyncio.Queue[EngineEvent] = asyncio.Queue()
                pumping = asyncio.create_task(pump(d.watch(engine.engine_id), events))
                # Warm: the link, the reader and its connection, posted at once.
                warm = await pc.publish("warm", TOKENS, _blocks(0))
                await d.pull(engine.engine_id, warm, _blocks(0), 0)
                done = await asyncio.wait_for(events.get(), 60)
                assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
                assert readers
                before = _full_attention_counted(d)

                for held in readers:
                    held.held = True
                params = await pc.publish("held", TOKENS, _blocks(8))
                loop = asyncio.get_running_loop()
                asked = loop.time()
                call = asyncio.create_task(d.pull(engine.engine_id, params, _blocks(8), 0))
                if cancelled:
                    await asyncio.sleep(HOLD_S / 4)
                    assert not call.done(), "Pull was answered before its read was posted"
                    call.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await call
                else:
                    accepted = await call
                    waited = loop.time() - asked
                    assert accepted.bytes_planned > 0
                    assert waited >= HOLD_S * 0.9, f"answered {waited:.3f} s after the call"
                done = await asyncio.wait_for(events.get(), 60)
                counted = _full_attention_counted(d) - before
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pumping
        assert isinstance(done, PullDone), done
        assert done.request_id == "held"
        assert done.status is PullStatus.OK, done  # the pull ran, cancelled call or not
        assert done.bytes_moved > 0
        assert counted == full_attention_bytes(layout, TOKENS, 0)
    finally:
        for proc in reversed(procs):
            proc.stop()  # type: ignore[attr-defined]
