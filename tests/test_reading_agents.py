"""A pair of peer and engine reads through up to `transfer.agents_per_peer` agents.

On one host a NIXL read copies on the thread that posts it, so one agent copies
one pull at a time. `Readers` hands a transfer the pair's first idle agent,
opens another while every open one is busy, and otherwise picks the least busy.
The units drive `Readers` with agents that only count; the end-to-end test
pulls many requests at once from a real prefill sidecar into a real decode
`Sidecar` in this process (real NIXL agents), and checks every byte.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from sidecars import (
    engine_link,
    in_process_sidecar,
    prefill_beside_cache,
    pump,
    scrape,
    spans,
    start_engine,
    start_sidecar,
)

from kvxfer._exceptions import DataPlaneError
from kvxfer.cli.fleet import metric
from kvxfer.core.requests import EngineEvent, PullDone, PullStatus
from kvxfer.dataplane import readers as readers_module
from kvxfer.dataplane.readers import Reader, Readers
from kvxfer.server.settings import load_settings


class _Agent:
    """The part of a TransferBackend `Readers` drives. `gate`, when set, holds every
    agent's peer loading until it is set (a slow open)."""

    made: ClassVar[list[_Agent]] = []
    gate: ClassVar[asyncio.Event | None] = None

    def __init__(self, prefix: str) -> None:
        _Agent.made.append(self)
        self.name = f"{prefix}-{len(_Agent.made)}"
        self.closed = False
        self.alive = True

    async def register(self, buffers: object) -> None:
        pass

    async def add_peer(self, metadata: bytes) -> str:
        if _Agent.gate is not None:
            await _Agent.gate.wait()
        return "peer"

    async def close(self) -> None:
        self.closed = True
        self.alive = False


@pytest.fixture
def agents() -> Any:
    _Agent.made, _Agent.gate = [], None
    return _Agent


async def get(readers: Readers, metadata: bytes = b"v1", engine: str = "e") -> Reader:
    return await readers.get("peer", engine, metadata, [])


async def test_transfers_one_at_a_time_use_one_agent(agents: Any) -> None:
    readers = Readers(agents, per_pair=2)
    for _ in range(5):
        reader = await get(readers)
        readers.done(reader)
    assert len(readers) == 1
    assert reader.busy == 0


async def test_a_second_agent_opens_while_the_first_is_busy_then_the_least_busy_is_used(
    agents: Any,
) -> None:
    readers = Readers(agents, per_pair=2)
    first, second = await get(readers), await get(readers)
    assert first is not second and len(readers) == 2
    third = await get(readers)  # both busy, no room: the least busy (the first, on a tie)
    assert third is first and first.busy == 2 and second.busy == 1
    readers.done(second)
    assert await get(readers) is second  # idle again: taken before a busier one
    assert len(readers) == 2  # never more than per_pair


async def test_transfers_waiting_for_an_agent_to_open_count_as_its_load(agents: Any) -> None:
    """While the second agent opens, the transfers that arrive meanwhile are spread over
    both, instead of all queueing for the one being opened."""
    readers = Readers(agents, per_pair=2)
    first = await get(readers)
    agents.gate = asyncio.Event()
    waiting = [asyncio.create_task(get(readers)) for _ in range(4)]
    await asyncio.sleep(0)  # each has chosen its reader
    agents.gate.set()
    got = await asyncio.gather(*waiting)
    second = next(r for r in got if r is not first)
    assert sorted(r.busy for r in (first, second)) == [2, 3]
    assert sum(r is second for r in got) == 2  # the opening one and one more


async def test_one_agent_per_pair_when_set_to_one(agents: Any) -> None:
    readers = Readers(agents, per_pair=1)
    held = [await get(readers) for _ in range(3)]
    assert len({id(r) for r in held}) == 1 and held[0].busy == 3
    with pytest.raises(ValueError, match="per_pair"):
        Readers(agents, per_pair=0)


async def test_severed_and_stale_agents_are_replaced_and_idle_stale_ones_closed(
    agents: Any,
) -> None:
    readers = Readers(agents, per_pair=2)
    first, second = await get(readers), await get(readers)
    readers.done(first)
    readers.done(second)
    await first.backend.close()  # severed
    assert await get(readers) is second  # the idle, open one before a fresh agent
    fresh = await get(readers)
    assert fresh not in (first, second) and len(readers) == 2
    readers.done(second)
    readers.done(fresh)
    # The peer's metadata changed: the first slot is replaced, and the other, stale and
    # idle, is closed at once (pulls one at a time would never pick it again).
    newer = await get(readers, metadata=b"v2")
    assert newer.metadata == b"v2" and fresh.backend.closed and second.backend.closed
    assert len(readers) == 1


async def test_a_busy_stale_agent_is_not_replaced_while_a_slot_is_free(agents: Any) -> None:
    """Replacing an agent severs the transfers on it: a stale one still reading is left
    to finish while another slot can take the new metadata."""
    readers = Readers(agents, per_pair=2)
    old = await get(readers)  # held: a pull still reading by the old metadata
    new = await get(readers, metadata=b"v2")
    assert new is not old and not old.backend.closed
    readers.done(new)
    readers.done(old)
    assert await get(readers, metadata=b"v2") is new
    assert old.backend.closed  # idle and stale: swept by that get
    with pytest.raises(AssertionError, match="not handed out"):
        readers.done(old)


async def test_no_agent_is_opened_for_an_engine_being_closed_or_after_close(agents: Any) -> None:
    readers = Readers(agents, per_pair=2)
    agents.gate = asyncio.Event()
    opening = asyncio.create_task(get(readers))
    await asyncio.sleep(0)  # it is opening an agent for the engine
    closing = asyncio.create_task(readers.close_engine("e"))
    await asyncio.sleep(0)
    agents.gate.set()
    with pytest.raises(DataPlaneError, match="engine e is going away"):
        await opening
    assert await closing is True
    assert all(agent.closed for agent in agents.made)
    assert await get(readers) is not None  # the engine's id came back: allowed again
    assert await readers.close() is True
    with pytest.raises(DataPlaneError, match="shutting down"):
        await get(readers)


async def test_closing_does_not_wait_forever_for_an_open_that_hangs(
    agents: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open stuck in a NIXL call must not hang unregistering or shutdown: closing
    gives up after OPEN_WAIT_S and says the memory must stay mapped; the open, if it
    ever ends, closes its agent instead of handing it out."""
    monkeypatch.setattr(readers_module, "OPEN_WAIT_S", 0.05)
    readers = Readers(agents, per_pair=2)
    agents.gate = asyncio.Event()
    opening = asyncio.create_task(get(readers))
    await asyncio.sleep(0)
    assert await readers.close_engine("e") is False
    agents.gate.set()
    with pytest.raises(DataPlaneError, match="going away"):
        await opening
    assert all(agent.closed for agent in agents.made)


def test_the_setting_is_bounded_and_two_by_default() -> None:
    assert load_settings([]).transfer.agents_per_peer == 2
    for bad in ("0", "17"):
        with pytest.raises(Exception, match="agents_per_peer"):
            load_settings(["--transfer.agents-per-peer", bad])


MODEL = "llama-3.1-8b"  # one full-attention group
PULLS = 8
BLOCKS = 16  # per pull
NUM_BLOCKS = PULLS * BLOCKS


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_pulls_at_once_from_one_peer_read_through_two_agents_byte_exact(
    tmp_path: Path,
) -> None:
    with prefill_beside_cache(tmp_path, MODEL, NUM_BLOCKS, "agents") as (p, pe, kv):
        layout = pe.layout
        tokens = BLOCKS * layout.block_size
        for region in kv.layout.regions:
            kv.view(region.buffer)[:] = 0xA5
        async with (
            in_process_sidecar("d-agents") as d,
            engine_link(p, pe) as (pc, _),
        ):
            engine = await d.register_engine(kv.layout, kv.buffers, "decode")
            events: asyncio.Queue[EngineEvent] = asyncio.Queue()
            pumping = asyncio.create_task(pump(d.watch(engine.engine_id), events))
            # Source blocks in one order, destination blocks reversed: every pull lands
            # somewhere else than it read from.
            pulls = []
            for i in range(PULLS):
                src = spans({0: range(i * BLOCKS, (i + 1) * BLOCKS)})
                params = await pc.publish(f"r{i}", tokens, src)
                j = PULLS - 1 - i
                dst = tuple(spans({0: range(j * BLOCKS, (j + 1) * BLOCKS)}))
                pulls.append((params, i, j, dst))
            await asyncio.gather(
                *(d.pull(engine.engine_id, params, dst, 0) for params, _, _, dst in pulls)
            )
            done = [await asyncio.wait_for(events.get(), 60) for _ in range(PULLS)]
            pair = [r for key, r in d._readers._readers.items() if key[1] == engine.engine_id]
            busy = [r.busy for r in pair]
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pumping
            for _, i, j, _ in pulls:
                for k in range(BLOCKS):
                    for tensor in layout.groups[0].tensors:
                        want = pe.block(tensor.name, i * BLOCKS + k)
                        got = kv.block(tensor.name, j * BLOCKS + k)
                        assert np.array_equal(got, want), (tensor.name, i, k)
    assert all(isinstance(e, PullDone) and e.status is PullStatus.OK for e in done), done
    assert len(pair) == 2, f"the pulls read through {len(pair)} agent(s), not 2"
    assert busy == [0, 0]


async def test_agents_unused_for_idle_s_are_closed_and_busy_ones_kept(agents: Any) -> None:
    """A peer that went away kept its agents (a thread, a UCX worker, a registration of
    the engine's memory each) until the engine left. Unused for idle_s, they close; one
    still held, or used since, stays; the next transfer opens a fresh one."""
    readers = Readers(agents, per_pair=2, idle_s=0.05)
    held, idle = await get(readers), await get(readers)
    readers.done(idle)
    assert await readers.close_idle() == 0  # nothing has been idle that long yet
    await asyncio.sleep(0.06)
    assert await readers.close_idle() == 1
    assert idle.backend.closed and not held.backend.closed and len(readers) == 1
    readers.done(held)  # its idle time starts now, not when it was opened
    assert await readers.close_idle() == 0
    await asyncio.sleep(0.06)
    assert await readers.close_idle() == 1 and held.backend.closed and len(readers) == 0
    fresh = await get(readers)
    assert fresh not in (held, idle) and not fresh.backend.closed
    readers.done(fresh)
    assert await Readers(agents, per_pair=1).close_idle() == 0  # no idle_s: never


@pytest.mark.e2e
async def test_a_sidecar_closes_the_agents_a_gone_peer_left(tmp_path: Path) -> None:
    """Real sidecars, transfer.idle_agent_s 1: after a pull the decode sidecar holds one
    reading agent; with no pull since, it is closed within a few seconds."""
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d", "--transfer.idle-agent-s", "1")
    procs = [p, d]
    try:
        pe = start_engine(tmp_path, p, "gpt-oss-20b", "prefill", num_blocks=16)
        procs.append(pe)
        de = start_engine(tmp_path, d, "gpt-oss-20b", "decode", num_blocks=16)
        procs.append(de)
        blocks = spans({g.group_id: [0, 1] for g in pe.layout.groups})
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            params = await pc.publish("idle", 32, blocks)
            await dc.pull(params, blocks, 0)
            done = await d_events.next()
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
        assert metric(scrape(d), "kvxfer_reading_agents") == 1
        for _ in range(50):
            await asyncio.sleep(0.1)
            if metric(scrape(d), "kvxfer_reading_agents") == 0:
                break
        assert metric(scrape(d), "kvxfer_reading_agents") == 0
    finally:
        for proc in reversed(procs):
            proc.stop()
