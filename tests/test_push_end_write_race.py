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

One kill covers every write it fences. An engine retiring under a push revokes
before its memory goes when a write of it has not ended by the deadline; a
revocation already begun for that write (its EndWrite's, cancelled or still
running) fences it, and the retirement waits for that one instead of killing the
agent that replaced it. Writes that end together (two writers giving up at once)
share one kill too, and so do writers that go silent together: their leases expire
in one sweep, and one kill fences them all (a lease nobody began writing needs none,
and is not held up by it). `kvxfer_push_revocations` counts kills, not the callers
that waited for one.

The lease table and the destinations are the real ones (for a retirement and for
the sweeper, a real `Sidecar` in this process); the serving agent is a fake whose
revocation lasts until the test ends it, as a slow kill and reap would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import pytest
from sidecars import spans

from kvxfer._exceptions import DataPlaneError, LeaseError
from kvxfer.client.shm import shm_kv_cache
from kvxfer.core.layout import EngineLayout
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import AbortState, EngineEvent, PullStatus, Received, ReleaseReason
from kvxfer.dataplane.descriptors import BoundBuffer
from kvxfer.dataplane.memory import MappedBuffer
from kvxfer.dataplane.readers import Readers
from kvxfer.server.destinations import Destinations, WriteEnd
from kvxfer.server.engines import Engine, EventQueue
from kvxfer.server.leases import Lease, LeaseTable
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import load_settings
from kvxfer.server.sidecar import Sidecar

pytestmark = pytest.mark.timeout(30)

MODEL = "gpt-oss-20b"  # group 0 slides over 128 tokens, group 1 is full attention
TOKENS = 100  # 7 blocks of 16 in each group
TTL_S = 5.0


@dataclass
class SlowRevoke:
    """A ServingBackend whose `revoke` returns only once `done` is set; the first
    `failures` revocations raise instead (the agent could not be killed)."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    revoking: asyncio.Event = field(default_factory=asyncio.Event)
    revocations: int = 0
    failures: int = 0

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
        if self.failures:
            self.failures -= 1
            raise DataPlaneError(f"cannot kill the serving agent ({reason})")
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
        await self.destinations.expired_all(self.leases.expire())


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


def _begun(decode: Decode, request_id: str = "r") -> WriteEnd:
    """Expect a request, begin its write; the EndWrite of a writer whose last full-
    attention chunk failed (and that could not say it settled)."""
    ids = list(range(7))
    destinations, engine = decode.destinations, decode.engine
    destinations.expect(engine, request_id, TOKENS, tuple(spans({0: ids, 1: ids})), 0)
    return _gave_up(destinations.begin_write(engine, request_id, "writer").read_token)


def _gave_up(token: str) -> WriteEnd:
    return WriteEnd(
        writer="writer",
        token=token,
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


async def test_the_sweeper_fences_a_silent_writer_with_a_cancelled_end_writes_kill(
    decode: Decode,
) -> None:
    """One writer's EndWrite was cancelled while the agent is killed; the other writer
    is silent. Both leases expire in one sweep while that kill runs: it fences both,
    whichever of them the sweep finds first."""
    end = _begun(decode)
    _begun(decode, "silent")
    await _cancelled_mid_revocation(decode, end)
    decode.clock[0] += 2 * TTL_S
    sweeping = asyncio.create_task(decode.sweep())
    await asyncio.sleep(0.05)
    assert not decode.events, "a lease was reported before the revocation ended"
    decode.backend.done.set()
    await sweeping
    assert decode.backend.revocations == 1, "the sweeper killed the agent that replaced it"
    assert sorted(_failed_revoked(decode.events)) == ["r", "silent"]
    assert not decode.leases.all()


async def test_a_cancelled_sweep_still_reports_once_the_kill_returned(decode: Decode) -> None:
    """Nothing but the sweep that expired the leases reports them (kept in the table,
    ending, they are passed over by the next sweeps), so it does even when it is
    cancelled while the agent is killed."""
    _begun(decode, "r")
    _begun(decode, "s")
    decode.clock[0] += 2 * TTL_S
    sweeping = asyncio.create_task(decode.sweep())
    await decode.backend.revoking.wait()
    sweeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sweeping
    assert not decode.events, "a lease was reported before the revocation ended"
    decode.backend.done.set()
    await asyncio.sleep(0.05)
    assert decode.backend.revocations == 1
    assert sorted(_failed_revoked(decode.events)) == ["r", "s"]


def _failed_revoked(events: Sequence[EngineEvent]) -> list[str]:
    """The requests of `events`, each a write reported failed after the revocation."""
    requests = []
    for event in events:
        assert isinstance(event, Received), event
        assert event.status is PullStatus.FAILED and "revoked" in event.reason, event
        requests.append(event.request_id)
    return requests


async def test_writes_that_end_together_share_one_kill(decode: Decode) -> None:
    ends = {r: _begun(decode, r) for r in ("r", "s")}
    first = asyncio.create_task(decode.destinations.end_write(decode.engine, "r", ends["r"]))
    await decode.backend.revoking.wait()
    # The other writer gives up while the agent is killed: that kill fences its chunks
    # too (none can land once it returns); a second would kill the agent replacing it.
    second = asyncio.create_task(decode.destinations.end_write(decode.engine, "s", ends["s"]))
    await asyncio.sleep(0.05)
    assert not second.done(), "the end was reported before the revocation ended"
    decode.backend.done.set()
    assert list(await asyncio.gather(first, second)) == [96, 96]
    assert decode.backend.revocations == 1
    assert len(decode.events) == 2, decode.events
    assert not decode.leases.all()


# -- an engine retiring under a push: its revocation and the leases' ---------


@dataclass
class DecodeSidecar:
    sidecar: Sidecar
    backend: SlowRevoke
    engine: Engine

    def expect(self, request_id: str) -> None:
        ids = list(range(7))
        push = self.sidecar.push_side
        push.expect(self.engine.engine_id, request_id, TOKENS, tuple(spans({0: ids, 1: ids})), 0)

    def begun(self, request_id: str = "r") -> WriteEnd:
        """`_begun`, through the sidecar (its lease table, its engine)."""
        self.expect(request_id)
        push, epoch = self.sidecar.push_side, self.sidecar.epoch
        return _gave_up(push.begin_write(epoch, 0, request_id, "writer").read_token)

    def end_write(self, end: WriteEnd, request_id: str = "r") -> asyncio.Task[int]:
        push, epoch = self.sidecar.push_side, self.sidecar.epoch
        return asyncio.create_task(push.end_write(epoch, 0, request_id, end))

    def retire(self) -> asyncio.Task[tuple[int, int]]:
        """Unregister the engine; the write has not ended by the (short) deadline."""
        return asyncio.create_task(self.sidecar.unregister(self.engine.engine_id, 0.05))

    def counted(self) -> float | None:
        return self.sidecar.metrics.registry.get_sample_value("kvxfer_push_revocations_total")


def _no_agents(prefix: str) -> NoReturn:
    raise AssertionError("a destination lease needs no reading or writing agent")


def _retiring() -> contextlib.AbstractAsyncContextManager[DecodeSidecar]:
    return _decode_sidecar("--lease.ttl-s", str(TTL_S), "--transfer.stall-deadline-s", "1")


@contextlib.asynccontextmanager
async def _decode_sidecar(*flags: str) -> AsyncIterator[DecodeSidecar]:
    """A real sidecar in this process with one decode engine; its sweeper not started."""
    settings = load_settings(
        [
            "--peer-address", "127.0.0.1:9",  # never served: peers are this test
            "--engine-address", "127.0.0.1:0",
            "--insecure-engine-tcp",
            *flags,
        ]
    )  # fmt: skip
    backend = SlowRevoke()
    sidecar = Sidecar(settings, backend, Metrics(), Readers(_no_agents, per_pair=1))
    with shm_kv_cache(layout_for_model(MODEL), 8, prefix=f"kvxfer-retire-{os.getpid()}") as kv:
        engine = await sidecar.register_engine(kv.layout, kv.buffers, "decode")
        try:
            yield DecodeSidecar(sidecar, backend, engine)
        finally:
            backend.done.set()
            await sidecar.shutdown(0.0)


async def _retires_after_the_kill(retiring: DecodeSidecar, ended: asyncio.Task[int] | None) -> None:
    """The engine retires while the revocation its write began is still under way: the
    memory goes only once that kill returned, and no second kill is made for it."""
    retired = retiring.retire()
    await asyncio.sleep(0.3)  # well past the retirement's deadline
    assert not retired.done(), "the engine's memory went before the revocation returned"
    retiring.backend.done.set()
    await retired
    if ended is not None:
        await asyncio.gather(ended, return_exceptions=True)  # its lease went with the engine
    assert retiring.backend.revocations == 1, "the retirement killed the agent again"
    assert retiring.counted() == 1


async def test_an_engine_retiring_while_an_end_write_revokes_waits_for_that_kill() -> None:
    async with _retiring() as retiring:
        ended = retiring.end_write(retiring.begun())
        await retiring.backend.revoking.wait()
        await _retires_after_the_kill(retiring, ended)


async def test_an_engine_retiring_under_two_writes_kills_once_for_both() -> None:
    """One writer's EndWrite revokes; the other never ends. The kill under way fences
    the silent writer's WRITEs too (none posted before it returns can land)."""
    async with _retiring() as retiring:
        retiring.begun("silent")
        ended = retiring.end_write(retiring.begun("r"), "r")
        await retiring.backend.revoking.wait()
        await _retires_after_the_kill(retiring, ended)


async def test_an_engine_retiring_after_a_cancelled_end_write_waits_for_its_kill() -> None:
    async with _retiring() as retiring:
        first = retiring.end_write(retiring.begun())
        await retiring.backend.revoking.wait()
        first.cancel()  # the writer's deadline passed during the kill; it runs on
        with pytest.raises(asyncio.CancelledError):
            await first
        await _retires_after_the_kill(retiring, None)


async def test_an_engine_retiring_after_its_writer_was_revoked_kills_no_more() -> None:
    async with _retiring() as retiring:
        first = retiring.end_write(retiring.begun())
        await retiring.backend.revoking.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        retiring.backend.done.set()
        await asyncio.sleep(0.05)  # the kill returned; the writer never retried
        assert retiring.backend.revocations == 1
        await retiring.retire()
        assert retiring.backend.revocations == 1, "the retirement killed the agent again"
        assert retiring.counted() == 1


async def test_an_engine_retiring_under_a_silent_writer_revokes_once() -> None:
    async with _retiring() as retiring:
        retiring.begun()  # the writer never ends
        retiring.backend.done.set()
        await retiring.retire()
        assert retiring.backend.revocations == 1
        assert retiring.counted() == 1


# -- the sidecar's sweeper: the writers silent together, one kill -------------

SWEPT_TTL_S = 0.3
SWEEP_S = 0.6  # above the TTL: the first sweep finds every lease begun before it expired


def _sweeping() -> contextlib.AbstractAsyncContextManager[DecodeSidecar]:
    return _decode_sidecar(
        "--lease.ttl-s", str(SWEPT_TTL_S),
        "--lease.sweep-s", str(SWEEP_S),
        "--transfer.stall-deadline-s", "0.1",
    )  # fmt: skip


@dataclass
class Watched:
    """The engine's events as its watcher gets them."""

    events: list[EngineEvent] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, count: int) -> list[EngineEvent]:
        async with asyncio.timeout(5):
            while len(self.events) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.events


@contextlib.asynccontextmanager
async def _watched(swept: DecodeSidecar) -> AsyncIterator[Watched]:
    watched = Watched()

    async def watch() -> None:
        async for event in swept.sidecar.watch(swept.engine.engine_id):
            watched.events.append(event)
            watched.arrived.set()

    watching = asyncio.create_task(watch())
    try:
        yield watched
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


async def _kill_under_way(swept: DecodeSidecar, watched: Watched, reported: int = 0) -> None:
    """Start the sweeper; once its kill is under way, `reported` events are out (none of
    a lease the kill fences)."""
    swept.sidecar.start()
    await swept.backend.revoking.wait()
    await asyncio.sleep(0.05)
    assert len(watched.events) == reported, "a write was reported before the kill returned"


async def test_writers_silent_together_are_fenced_by_one_kill() -> None:
    """Both leases expire in one sweep: one kill fences both writers, counted once (a
    kill each would kill the agent that replaced the first, for nothing)."""
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.begun("r")
        swept.begun("s")
        await _kill_under_way(swept, watched)
        swept.backend.done.set()
        assert sorted(_failed_revoked(await watched.until(2))) == ["r", "s"]
        await asyncio.sleep(0.05)  # time for a second kill to show
        assert swept.backend.revocations == 1, "the agent that replaced the first was killed"
        assert swept.counted() == 1


async def test_a_lease_nobody_began_writing_expires_without_waiting_for_the_kill() -> None:
    """It needs no fence: reported at once, in the sweep whose kill fences the other."""
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.begun("silent")
        swept.expect("held")
        await _kill_under_way(swept, watched, reported=1)
        (held,) = watched.events
        assert isinstance(held, Received) and held.request_id == "held", held
        assert held.status is PullStatus.FAILED and "began writing" in held.reason, held
        swept.backend.done.set()
        assert _failed_revoked((await watched.until(2))[1:]) == ["silent"]
        assert swept.backend.revocations == 1
        assert swept.counted() == 1


async def test_a_writer_silent_alone_is_fenced_by_one_kill() -> None:
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.begun("r")
        await _kill_under_way(swept, watched)
        swept.backend.done.set()
        assert _failed_revoked(await watched.until(1)) == ["r"]
        assert swept.backend.revocations == 1
        assert swept.counted() == 1


async def test_a_kill_that_failed_is_tried_again_before_its_lease_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A WRITE of the writer it was to fence may still land: its lease is not reported
    (its engine keeps the blocks) and stays in the table, and the next sweep kills
    again; only once that kill returned is it reported, the failed kill not counted."""
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.backend.failures = 1
        swept.begun("unfenced")
        swept.sidecar.start()
        await swept.backend.revoking.wait()  # the first kill, failing
        swept.backend.revoking.clear()
        await swept.backend.revoking.wait()  # the next sweep's, under way
        assert swept.backend.revocations == 2
        assert watched.events == [], "reported before any kill fenced its writer"
        swept.backend.done.set()
        assert _failed_revoked(await watched.until(1)) == ["unfenced"]
        assert swept.counted() == 1, "a kill that failed was counted"
        assert "'unfenced' expired, but remote access could not be revoked" in caplog.text


async def test_an_engine_retiring_under_the_sweepers_kill_keeps_its_memory_until_it_returned() -> (
    None
):
    """The swept lease stays in the table while its writer is fenced: the retirement
    sees it and joins that kill (not a second), and the memory goes only after it."""
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.begun("silent")
        await _kill_under_way(swept, watched)
        retired = swept.retire()
        await asyncio.sleep(0.3)  # past its 0.05 s reads deadline
        assert not retired.done(), "the engine's memory went before the sweeper's kill returned"
        swept.backend.done.set()
        await retired
        assert swept.backend.revocations == 1
        assert swept.counted() == 1


async def test_a_sweep_that_raised_does_not_stop_the_next(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with _sweeping() as swept, _watched(swept) as watched:
        expire = swept.sidecar._leases.expire
        calls = 0

        def broken_once() -> list[Lease]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in a sweep")
            return expire()

        monkeypatch.setattr(swept.sidecar._leases, "expire", broken_once)
        swept.backend.done.set()
        swept.begun("r")
        swept.sidecar.start()
        assert _failed_revoked(await watched.until(1)) == ["r"]
        assert calls >= 2 and "sweeping expired leases failed" in caplog.text


# -- a swept lease, kept in the table while its writer is fenced ---------------


@dataclass
class FailsLate(SlowRevoke):
    """A kill that runs until `done` is set and then fails (the first `late_failures`)."""

    late_failures: int = 0

    async def revoke(self, reason: str) -> None:
        self.revocations += 1
        self.revoking.set()
        await self.done.wait()
        if self.late_failures:
            self.late_failures -= 1
            raise DataPlaneError(f"cannot kill the serving agent ({reason})")


async def test_a_writers_heartbeat_during_the_sweepers_kill_is_not_told_to_go_on() -> None:
    """Its lease is being expired: the heartbeat hears it is gone (as it did when the
    sweeper took the lease out of the table first), not HELD, and renews nothing."""
    async with _sweeping() as swept, _watched(swept) as watched:
        end = swept.begun("silent")
        await _kill_under_way(swept, watched)
        beat = swept.sidecar.read_side.heartbeat
        states = beat(swept.sidecar.epoch, 0, ["silent"], "writer", [end.token])
        swept.backend.done.set()
        assert _failed_revoked(await watched.until(1)) == ["silent"]
        assert states == [None], f"a lease being expired was answered {states}"


async def test_a_retirement_that_joined_a_sweepers_kill_that_failed_kills_again_itself() -> None:
    """The engine's reads deadline passed while the sweeper's kill ran: it dropped the
    lease and joined that kill. The kill fails: the retirement must fence the writer
    with a kill of its own, not fail for good (its engine left registered and half
    retired, an Unregister answering that error forever)."""
    async with _sweeping() as swept, _watched(swept) as watched:
        backend = swept.backend = FailsLate(late_failures=1)
        swept.sidecar._backend = swept.sidecar.destinations._backend = backend
        swept.begun("silent")
        await _kill_under_way(swept, watched)
        retired = swept.retire()
        await asyncio.sleep(0.3)  # past its 0.05 s deadline: dropped, joined the kill
        assert not retired.done(), "the engine's memory went before the kill returned"
        backend.done.set()  # the kill returns, failing
        (outcome,) = await asyncio.gather(retired, return_exceptions=True)
        assert not isinstance(outcome, BaseException), f"the retirement failed: {outcome!r}"
        assert swept.engine.engine_id not in {e.engine_id for e in swept.sidecar.engines()}
        assert backend.revocations == 2


async def test_an_end_write_after_the_sweepers_failed_kill_fences_and_reports_once() -> None:
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.backend.failures = 1
        end = swept.begun("r")
        swept.sidecar.start()
        await swept.backend.revoking.wait()  # the sweeper's kill, failing
        await asyncio.sleep(0.05)
        ended = swept.end_write(end, "r")  # gave up, unsettled: kills again itself
        await asyncio.sleep(0.05)
        assert not ended.done() and watched.events == []
        swept.backend.done.set()
        assert await ended == 96
        await asyncio.sleep(2 * SWEEP_S)  # later sweeps do not report it again
        (received,) = watched.events
        assert isinstance(received, Received) and received.status is PullStatus.PARTIAL
        assert swept.backend.revocations == 2


async def test_an_abort_during_the_sweepers_kill_is_answered_writing_and_reported_once() -> None:
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.begun("silent")
        await _kill_under_way(swept, watched)
        state = await swept.sidecar.abort(swept.engine.engine_id, "silent")
        assert state is AbortState.WRITING
        swept.backend.done.set()
        assert _failed_revoked(await watched.until(1)) == ["silent"]
        await asyncio.sleep(SWEEP_S)
        assert len(watched.events) == 1 and swept.backend.revocations == 1


async def test_a_long_retirement_after_a_failed_kill_waits_for_the_next_sweeps() -> None:
    async with _sweeping() as swept, _watched(swept) as watched:
        swept.backend.failures = 1
        swept.begun("silent")
        swept.sidecar.start()
        await swept.backend.revoking.wait()  # the first kill, failing at once
        swept.backend.revoking.clear()
        retired = asyncio.create_task(swept.sidecar.unregister(swept.engine.engine_id, 5.0))
        await swept.backend.revoking.wait()  # the next sweep's
        await asyncio.sleep(0.05)
        assert not retired.done(), "the engine's memory went before any kill fenced"
        swept.backend.done.set()
        await retired
        assert _failed_revoked(watched.events) == ["silent"]
        assert swept.backend.revocations == 2
