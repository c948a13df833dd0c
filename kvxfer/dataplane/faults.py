"""A fault-injecting TransferBackend: the same interface as NixlAgent, wrapping one.

Chosen chunks fail (reported FAILED without being posted) or stall (never
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

ChunkRule = Callable[[int, ChunkJob], TransferStatus | None]
"""Given the chunk's sequence number and job: FAILED, TIMED_OUT (stall) or None (pass)."""


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
    """Fail or stall the chunks with these sequence numbers (0-based, in posting order)."""

    def rule(index: int, _: ChunkJob) -> TransferStatus | None:
        if index in failing:
            return TransferStatus.FAILED
        if index in stalling:
            return TransferStatus.TIMED_OUT
        return None

    return rule


class FaultInjectingBackend:
    def __init__(self, inner: TransferBackend, rule: ChunkRule) -> None:
        self._inner = inner
        self._rule = rule
        self._posted = 0
        self.injected: list[tuple[int, TransferStatus]] = []

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
        index = self._posted
        self._posted += 1
        verdict = self._rule(index, job)
        if verdict is None:
            return await self._inner.read(job)
        self.injected.append((index, verdict))
        if verdict is TransferStatus.TIMED_OUT:
            await asyncio.sleep(job.deadline_s)  # a hung chunk: only its deadline ends it
        return verdict

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
    def abandoned(self) -> bool:  # an injected failure was never posted
        return self._inner.abandoned

    @property
    def alive(self) -> bool:
        return self._inner.alive
