"""A fault-injecting TransferBackend: the same interface as NixlAgent, wrapping one.

Chosen jobs (handles: one chunk, or consecutive small chunks the executor
joined) fail (reported FAILED without being posted) or stall (never
complete, so their stall deadline fires, as a hung transfer's would); all
others go to the real backend. Used by the tests and by the demo's
`--fail-rate`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection, Sequence

from kvxfer.dataplane.adapter import ChunkJob, TransferBackend, TransferStatus
from kvxfer.dataplane.memory import MappedBuffer

_HUNG = TransferStatus.TIMED_OUT
ChunkRule = Callable[[int, ChunkJob], TransferStatus | None]
"""Given the job's sequence number and the job: FAILED, TIMED_OUT (stall) or None (pass)."""


def fail_rate(rate: float, seed: int = 0) -> ChunkRule:
    """Fail each chunk with probability `rate`, reproducibly."""
    rng = random.Random(seed)

    def rule(_: int, __: ChunkJob) -> TransferStatus | None:
        return TransferStatus.FAILED if rng.random() < rate else None

    return rule


def random_faults(fail: float, stall: float, seed: int = 0) -> ChunkRule:
    """Fail each chunk with probability `fail`, else stall it with probability `stall`."""
    rng = random.Random(seed)

    def rule(_: int, __: ChunkJob) -> TransferStatus | None:
        draw = rng.random()
        if draw < fail:
            return TransferStatus.FAILED
        if draw < fail + stall:
            return TransferStatus.TIMED_OUT
        return None

    return rule


def fail_chunks(failing: Collection[int], stalling: Collection[int] = ()) -> ChunkRule:
    """Fail or stall the jobs with these sequence numbers (0-based, in posting order)."""

    def rule(index: int, _: ChunkJob) -> TransferStatus | None:
        if index in failing:
            return TransferStatus.FAILED
        if index in stalling:
            return TransferStatus.TIMED_OUT
        return None

    return rule


class WrappedBackend:
    """A TransferBackend passing every call to the one it wraps: what a backend wrapping
    a real one at the seam (this module's, a test's) leaves as it is."""

    def __init__(self, inner: TransferBackend) -> None:
        self._inner = inner

    @property
    def name(self) -> str:
        return self._inner.name

    async def metadata(self) -> bytes:
        return await self._inner.metadata()

    async def register(self, buffers: Sequence[MappedBuffer]) -> None:
        await self._inner.register(buffers)

    async def deregister(self, buffers: Sequence[MappedBuffer]) -> None:
        await self._inner.deregister(buffers)

    async def add_peer(self, metadata: bytes) -> str:
        return await self._inner.add_peer(metadata)

    async def remove_peer(self, peer: str) -> None:
        await self._inner.remove_peer(peer)

    async def read(self, job: ChunkJob) -> TransferStatus:
        (status,) = await self.post_all([job])
        return status

    def post_all(self, jobs: Sequence[ChunkJob]) -> asyncio.Future[list[TransferStatus]]:
        return self._inner.post_all(jobs)

    async def notify(self, peer: str, message: bytes) -> None:
        await self._inner.notify(peer, message)

    def on_notification(self, callback: Callable[[str, bytes], None]) -> None:
        self._inner.on_notification(callback)

    async def close(self) -> None:
        await self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    @property
    def abandoned(self) -> bool:
        return self._inner.abandoned

    @property
    def alive(self) -> bool:
        return self._inner.alive


class FaultInjectingBackend(WrappedBackend):
    def __init__(self, inner: TransferBackend, rule: ChunkRule) -> None:
        super().__init__(inner)
        self._rule = rule
        self._posted = 0
        self.injected: list[tuple[int, TransferStatus]] = []

    def post_all(self, jobs: Sequence[ChunkJob]) -> asyncio.Future[list[TransferStatus]]:
        """The chunks the rule passes go to the real backend as one batch, now; the
        others fail at once or stall until their deadline."""
        verdicts = [self._verdict(job) for job in jobs]
        passing = [job for job, verdict in zip(jobs, verdicts, strict=True) if verdict is None]
        real = self._inner.post_all(passing) if passing else None
        loop = asyncio.get_running_loop()
        hung = [j.deadline_s for j, v in zip(jobs, verdicts, strict=True) if v is _HUNG]
        hung_until = loop.time() + max(hung, default=0.0)

        async def ended() -> list[TransferStatus]:
            passed = iter(await real if real is not None else ())
            if hung:  # a hung chunk: only its deadline ends it
                await asyncio.sleep(max(0.0, hung_until - loop.time()))
            return [next(passed) if verdict is None else verdict for verdict in verdicts]

        return asyncio.ensure_future(ended())

    def _verdict(self, job: ChunkJob) -> TransferStatus | None:
        index = self._posted
        self._posted += 1
        verdict = self._rule(index, job)
        if verdict is not None:
            self.injected.append((index, verdict))
        return verdict
