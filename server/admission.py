"""Admission of pulls per peer: a bounded number run, a bounded number more wait.

A burst of pulls against one peer (a decode engine admitting a batch) is
queued, not refused: up to `limits.max_inflight_pulls_per_peer` run at once
and up to `limits.max_queued_pulls_per_peer` more wait for a slot, in the
order they arrived. Only a pull beyond both is refused, with
LimitExceededError naming the limits. Bounding the running ones bounds the
calls this sidecar makes to one peer at once (each running pull has at most a
BeginRead or Heartbeat and an EndRead outstanding), which keeps it under the
peer's `limits.max_calls_per_peer`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from kvxfer._exceptions import LimitExceededError


@dataclass
class _Peer:
    slots: asyncio.Semaphore
    admitted: int = 0  # running and waiting


@dataclass
class Admission:
    """One admitted pull: hold `slot()` while it runs; `close()` if it never runs."""

    gate: PullGate
    address: str
    closed: bool = field(default=False)

    @asynccontextmanager
    async def slot(self, cancel: asyncio.Event) -> AsyncIterator[None]:
        """Wait for a running slot (FIFO) and hold it, or, once `cancel` is set first,
        go on holding none (a retiring engine's pull then ends at once: it does not wait
        behind reads that hold their slots through an EndRead to a silent peer); then
        leave the gate."""
        slots = self.gate.peer(self.address).slots
        held = False
        try:
            if not slots.locked():  # a free slot is taken at once, without a loop turn
                held = await slots.acquire()
            elif not cancel.is_set():
                held = await _acquire_unless(slots, cancel)
            yield
        finally:
            if held:
                slots.release()
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.gate.leave(self.address)


async def _acquire_unless(slots: asyncio.Semaphore, cancel: asyncio.Event) -> bool:
    """Wait for a slot (FIFO) or for `cancel`, whichever comes first: True when the slot
    was taken (then the caller releases it)."""
    acquiring = asyncio.ensure_future(slots.acquire())
    cancelled = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({acquiring, cancelled}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this call was cancelled: a slot already taken goes back
        if acquiring.done():
            slots.release()
        raise
    finally:
        cancelled.cancel()
        if not acquiring.done():
            acquiring.cancel()  # a slot it is given meanwhile goes to the next waiter
    return acquiring.done()


class PullGate:
    def __init__(self, running: int, queued: int) -> None:
        if running < 1 or queued < 0:
            raise ValueError(f"running must be >= 1 and queued >= 0, not {running}, {queued}")
        self._running = running
        self._queued = queued
        self._peers: dict[str, _Peer] = {}

    def admit(self, address: str) -> Admission:
        """Admit one pull against `address`, or refuse it when the queue is full."""
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _Peer(asyncio.Semaphore(self._running))
        if peer.admitted >= self._running + self._queued:
            raise LimitExceededError(
                f"limits.max_inflight_pulls_per_peer ({self._running}) and "
                f"limits.max_queued_pulls_per_peer ({self._queued}): "
                f"{peer.admitted} pulls from {address} running or waiting"
            )
        peer.admitted += 1
        return Admission(self, address)

    def peer(self, address: str) -> _Peer:
        return self._peers[address]

    def leave(self, address: str) -> None:
        peer = self._peers[address]
        peer.admitted -= 1
        if not peer.admitted:  # addresses come from params: keep no entry per idle one
            del self._peers[address]

    def admitted(self, address: str) -> int:
        peer = self._peers.get(address)
        return peer.admitted if peer is not None else 0

    def waiting(self, address: str) -> int:
        """Admitted pulls against `address` not yet running."""
        return max(0, self.admitted(address) - self._running)
