"""EndWrite against the lease sweeper, and against its own retry (server/destinations.py).

An EndWrite whose writer gave up on chunks revokes the serving agent before the
decode engine hears the end: an await during which the lease is still in the
table. Nothing else may end that lease meanwhile. The sweeper would revoke again
and report the write failed, losing the writer's outcome (its EndWrite then finds
no lease); a retried EndWrite (the writer's first answer lost) would pass the
writer check and revoke a second time, killing the serving agent that replaced the
first one with every transfer through it. Nor may a retried EndWrite or the
sweeper revoke again when the first EndWrite's call was cancelled while it revoked
(its writer's deadline passed during a slow kill and reap): that kill goes on, and
they wait for it.

The lease table and the destinations are the real ones; the serving agent is a
fake whose revocation lasts until the test ends it, as a slow kill and reap would.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from sidecars import spans

from kvxfer._exceptions import LeaseError
from kvxfer.client.shm import shm_kv_cache
from kvxfer.core.layout import EngineLayout
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import EngineEvent, PullStatus, Received, ReleaseReason
from kvxfer.dataplane.descriptors import BoundBuffer
from kvxfer.dataplane.memory import MappedBuffer
from kvxfer.server.destinations import Destinations, WriteEnd
from kvxfer.server.engines import Engine, EventQueue
from kvxfer.server.leases import LeaseTable
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import load_settings

pytestmark = pytest.mark.timeout(30)

MODEL = "gpt-oss-20b"  # group 0 slides over 128 tokens, group 1 is full attention
TOKENS = 100  # 7 blocks of 16 in each group
TTL_S = 5.0


@dataclass
class SlowRevoke:
    """A ServingBackend whose `revoke` returns only once `done` is set."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    revoking: asyncio.Event = field(default_factory=asyncio.Event)
    revocations: int = 0

    @property
    def name(self) -> str:
        return "slow-revoke"

    async def served(self, names: Sequence[str]) -> tuple[bytes, dict[str, BoundBuffer]]:
        return b"", {}

    async def register(self, buffers: Sequence[MappedBuffer]) -> None:
        pass

    async def deregister(self, buffers: Sequence[MappedBuffer]) -> None:
        pass

    async def add_peer(self, metadata: bytes) -> str:
        return "peer"

    async def remove_peer(self, peer: str) -> None:
        pass

    def on_replaced(self, callback: Callable[[str], None]) -> None:
        pass

    async def revoke(self, reason: str) -> None:
        self.revocations += 1
        self.revoking.set()
        await self.done.wait()

    async def close(self) -> None:
        pass


@dataclass
class Decode:
    clock: list[float]
    leases: LeaseTable
    backend: SlowRevoke
    destinations: Destinations
    engine: Engine
    events: list[EngineEvent]

    async def sweep(self) -> None:
        """What the sidecar's sweeper does with expired destination leases."""
        for lease in self.leases.expire():
            await self.destinations.expired(lease)


@pytest.fixture
def decode() -> Iterator[Decode]:
    with shm_kv_cache(layout_for_model(MODEL), 8, prefix=f"kvxfer-race-{os.getpid()}") as kv:
        yield _decode(kv.layout)  # a layout with regions; its memory is never touched


def _decode(layout: EngineLayout) -> Decode:
    clock = [0.0]
    leases = LeaseTable(TTL_S, 8, lambda: clock[0])
    backend = SlowRevoke()
    events: list[EngineEvent] = []
    destinations = Destinations(
        settings=load_settings([]),
        leases=leases,
        backend=backend,
        metrics=Metrics(),
        emit=lambda _engine, event: events.append(event),
        ended=lambda _engine: None,
        layout_of=lambda _engine: layout,
    )
    engine = Engine("e-decode", "decode", layout, [], EventQueue(16, lambda: None))
    return Decode(clock, leases, backend, destinations, engine, events)


def _begun(decode: Decode) -> WriteEnd:
    """Expect a request, begin its write; the EndWrite of a writer whose last full-
    attention chunk failed (and that could not say it settled)."""
    ids = list(range(7))
    decode.destinations.expect(decode.engine, "r", TOKENS, tuple(spans({0: ids, 1: ids})), 0)
    lease = decode.destinations.begin_write(decode.engine, "r", "writer")
    return WriteEnd(
        writer="writer",
        token=lease.read_token,
        reason=ReleaseReason.CONSUMED,
        failed={1: (6,)},
        bytes_written=1,
        valid_tokens=96,
        detail="chunks timed_out",
        settled=False,
    )


def _the_writers_outcome(events: list[EngineEvent]) -> None:
    assert len(events) == 1, events
    (received,) = events
    assert isinstance(received, Received), received
    assert (received.status, received.valid_tokens) == (PullStatus.PARTIAL, 96), received
    assert received.failed_blocks == {1: (6,)}, received


async def test_the_sweeper_leaves_a_write_being_ended_to_its_end_write(decode: Decode) -> None:
    end = _begun(decode)
    ending = asyncio.create_task(decode.destinations.end_write(decode.engine, "r", end))
    await decode.backend.revoking.wait()
    decode.clock[0] += 2 * TTL_S  # the lease's TTL passes while the agent is revoked
    sweeping = asyncio.create_task(decode.sweep())
    await asyncio.sleep(0.05)
    decode.backend.done.set()
    ended, swept = await asyncio.gather(ending, sweeping, return_exceptions=True)
    assert ended == 96, ended
    assert swept is None, swept
    assert decode.backend.revocations == 1
    _the_writers_outcome(decode.events)
    assert not decode.leases.all()


async def test_a_retried_end_write_does_not_revoke_again(decode: Decode) -> None:
    end = _begun(decode)
    first = asyncio.create_task(decode.destinations.end_write(decode.engine, "r", end))
    await decode.backend.revoking.wait()
    retry = asyncio.create_task(decode.destinations.end_write(decode.engine, "r", end))
    await asyncio.sleep(0.05)
    decode.backend.done.set()
    answered, retried = await asyncio.gather(first, retry, return_exceptions=True)
    assert answered == 96, answered
    assert isinstance(retried, LeaseError), retried
    assert decode.backend.revocations == 1
    _the_writers_outcome(decode.events)
    assert not decode.leases.all()


async def _cancelled_mid_revocation(decode: Decode, end: WriteEnd) -> None:
    """The writer's first EndWrite revokes, and its call is cancelled meanwhile (its
    deadline passed during a slow kill and reap; gRPC and the lane cancel the handler):
    the kill is under way all the same."""
    first = asyncio.create_task(decode.destinations.end_write(decode.engine, "r", end))
    await decode.backend.revoking.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_an_end_write_retried_after_its_cancelled_call_does_not_revoke_again(
    decode: Decode,
) -> None:
    end = _begun(decode)
    await _cancelled_mid_revocation(decode, end)
    retry = asyncio.create_task(decode.destinations.end_write(decode.engine, "r", end))
    await asyncio.sleep(0.05)
    assert not retry.done(), "the end was reported before the revocation ended"
    assert not decode.events
    decode.backend.done.set()
    assert await retry == 96
    assert decode.backend.revocations == 1, "the retry killed the agent that replaced it"
    _the_writers_outcome(decode.events)
    assert not decode.leases.all()


async def test_the_sweeper_waits_for_a_cancelled_end_writes_revocation(decode: Decode) -> None:
    end = _begun(decode)
    await _cancelled_mid_revocation(decode, end)
    decode.clock[0] += 2 * TTL_S  # the writer gave up retrying: the lease expires
    sweeping = asyncio.create_task(decode.sweep())
    await asyncio.sleep(0.05)
    assert not sweeping.done(), "the lease was reported before the revocation ended"
    assert not decode.events
    decode.backend.done.set()
    await sweeping
    assert decode.backend.revocations == 1, "the sweeper killed the agent that replaced it"
    (received,) = decode.events
    assert isinstance(received, Received), received
    assert received.status is PullStatus.FAILED and "revoked" in received.reason, received
    assert not decode.leases.all()
