"""Pulls beyond the running limit wait for a slot instead of being refused.

The gate alone (server/admission.py), then real sidecars: with one running
slot against the prefill sidecar and two queued, a frozen prefill sidecar
holds the first pull in BeginRead; the next two are accepted and wait, the
fourth is refused naming both limits, and after the thaw all three accepted
pulls end OK with their bytes checked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sidecars import (
    DecodeImage,
    engine_link,
    freeze,
    pd_sidecars,
    scrape,
    spans,
    start_engine,
    start_sidecar,
    thaw,
)

from kvxfer._exceptions import LimitExceededError
from kvxfer.cli.fleet import metric
from kvxfer.core.requests import AbortState, PullDone, PullStatus, Released, ReleaseReason
from kvxfer.server.admission import PullGate

MODEL = "gpt-oss-20b"
TOKENS = 64  # 4 blocks of 16
FROZEN_S = 0.3  # how long the publisher stays frozen with pulls running and queued


def blocks_at(first: int) -> list:
    ids = list(range(first, first + 4))
    return spans({0: ids, 1: ids})


def test_the_gate_admits_running_plus_queued_and_refuses_beyond() -> None:
    gate = PullGate(running=2, queued=1)
    admitted = [gate.admit("p:1") for _ in range(3)]
    with pytest.raises(LimitExceededError, match=r"max_inflight_pulls_per_peer \(2\).*max_queued"):
        gate.admit("p:1")
    other = gate.admit("q:1")  # another peer has its own slots
    assert gate.admitted("p:1") == 3 and gate.waiting("p:1") == 1
    admitted[0].close()
    admitted[0].close()  # closing twice leaves once
    assert gate.admitted("p:1") == 2
    gate.admit("p:1")
    for admission in [*admitted[1:], other]:
        admission.close()
    assert gate.admitted("q:1") == 0


async def test_queued_pulls_run_in_arrival_order_within_the_running_limit() -> None:
    gate = PullGate(running=1, queued=3)
    order: list[int] = []
    release = asyncio.Event()

    async def pull(i: int) -> None:
        async with gate.admit("p:1").slot(asyncio.Event()):
            order.append(i)
            if i == 0:
                await release.wait()

    tasks = [asyncio.create_task(pull(i)) for i in range(4)]
    while not order:
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert order == [0], "a queued pull ran while the only slot was held"
    assert gate.waiting("p:1") == 3
    release.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3]
    assert gate.admitted("p:1") == 0


def test_the_gate_rejects_impossible_limits() -> None:
    with pytest.raises(ValueError, match="running must be >= 1"):
        PullGate(running=0, queued=1)


@pytest.mark.e2e
@pytest.mark.timeout(180)
async def test_pulls_beyond_the_running_limit_queue_and_complete(tmp_path: Path) -> None:
    limits = (
        "--limits.max-inflight-pulls-per-peer", "1",
        "--limits.max-queued-pulls-per-peer", "2",
        "--transfer.rpc-timeout-s", "60",
    )  # fmt: skip
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d", *limits)
    pe = start_engine(tmp_path, p, MODEL, "prefill")
    de = start_engine(tmp_path, d, MODEL, "decode")
    image = DecodeImage(de)
    try:
        async with (
            engine_link(p, pe) as (p_client, _),
            engine_link(d, de) as (d_client, d_events),
        ):
            # A first pull links the sidecars, so the Pulls below need no handshake.
            warm = await p_client.publish("warm", TOKENS, blocks_at(0))
            await d_client.pull(warm, blocks_at(0), 0)
            done = await d_events.next(timeout_s=60)
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
            image.expect_pull(pe, blocks_at(0), blocks_at(0), TOKENS, 0, {})
            published = [
                await p_client.publish(f"q{i}", TOKENS, blocks_at(4 * i)) for i in (1, 2, 3)
            ]
            refused = await p_client.publish("q4", TOKENS, blocks_at(16))
            freeze(p)  # the running pull waits in BeginRead; nothing can finish
            try:
                for i, params in enumerate(published, start=1):
                    await d_client.pull(params, blocks_at(4 * i), 0)
                with pytest.raises(LimitExceededError, match="max_queued_pulls_per_peer"):
                    await d_client.pull(refused, blocks_at(16), 0)
                await asyncio.sleep(FROZEN_S)  # q1 in BeginRead, q2 and q3 queued behind it
            finally:
                thaw(p)
            dones = [await d_events.next(timeout_s=60) for _ in published]
        assert sorted(e.request_id for e in dones if isinstance(e, PullDone)) == ["q1", "q2", "q3"]
        for event in dones:
            assert isinstance(event, PullDone) and event.status is PullStatus.OK, event
            i = int(event.request_id[1:])
            image.expect_pull(pe, blocks_at(4 * i), blocks_at(4 * i), TOKENS, 0, {})
        image.check_all()
        # Where their time went: q1 waited FROZEN_S at least in BeginRead, q2 and q3 as
        # long at least for a running slot; every pull (warm too) read once.
        phases = scrape(d)

        def spent(phase: str, what: str = "sum") -> float:
            return metric(phases, f"kvxfer_pull_phase_duration_seconds_{what}", phase=phase)

        assert spent("read", "count") == spent("queued", "count") == 4
        assert spent("begin_read") >= FROZEN_S
        assert spent("queued") >= 2 * FROZEN_S
    finally:
        for proc in (de, pe, d, p):
            proc.stop()


async def test_a_cancelled_queued_pull_goes_on_without_a_slot() -> None:
    """A retiring engine's queued pull must not wait behind reads that hold their slots
    (through an EndRead to a silent peer): once its cancel is set it goes on, holding
    none, and leaves the gate; the slots and the queue order stay right."""
    gate = PullGate(running=1, queued=3)
    held, release = asyncio.Event(), asyncio.Event()
    cancels = [asyncio.Event() for _ in range(3)]
    ran: list[str] = []

    async def holder() -> None:
        async with gate.admit("p:1").slot(asyncio.Event()):
            held.set()
            await release.wait()
        ran.append("holder")

    async def queued(i: int) -> None:
        async with gate.admit("p:1").slot(cancels[i]):
            ran.append(f"{i} {'cancelled' if cancels[i].is_set() else 'ran'}")

    first = asyncio.create_task(holder())
    await held.wait()
    waiting = [asyncio.create_task(queued(i)) for i in range(3)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert gate.waiting("p:1") == 3
    cancels[1].set()
    await asyncio.wait_for(waiting[1], 5)
    assert ran == ["1 cancelled"] and gate.admitted("p:1") == 3
    # A slot released in the same turn as a waiter's cancel goes to the next waiter.
    release.set()
    cancels[0].set()
    await asyncio.wait_for(asyncio.gather(first, *waiting), 5)
    assert ran[1:] in (["holder", "0 cancelled", "2 ran"], ["holder", "2 ran", "0 cancelled"])
    assert gate.admitted("p:1") == 0
    async with gate.admit("p:1").slot(asyncio.Event()):  # the one slot is free again
        pass


@pytest.mark.parametrize("turns", range(5))
async def test_a_queued_pull_whose_task_is_cancelled_leaks_no_slot(turns: int) -> None:
    """Cancelled while it waits, just as its slot is handed to it, or once it has it:
    the slot goes on to the pull queued behind it."""
    gate = PullGate(running=1, queued=2)
    held, release, third_ran = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with gate.admit("p:1").slot(asyncio.Event()):
            held.set()
            await release.wait()

    async def cancelled() -> None:
        async with gate.admit("p:1").slot(asyncio.Event()):
            await asyncio.sleep(3600)

    async def third() -> None:
        async with gate.admit("p:1").slot(asyncio.Event()):
            third_ran.set()

    first = asyncio.create_task(holder())
    await held.wait()
    waiter = asyncio.create_task(cancelled())
    for _ in range(5):
        await asyncio.sleep(0)
    behind = asyncio.create_task(third())
    for _ in range(5):
        await asyncio.sleep(0)
    assert gate.waiting("p:1") == 2
    release.set()
    for _ in range(turns):  # the holder releases, the slot is handed on, taken
        await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.wait_for(third_ran.wait(), 5)  # a leaked slot would leave it waiting
    await asyncio.gather(first, waiter, behind, return_exceptions=True)
    assert gate.admitted("p:1") == 0


async def test_an_engines_abort_of_a_queued_pull_frees_the_publishers_blocks(
    tmp_path: Path,
) -> None:
    """Only a retiring engine's queued pull ends without beginning; one its engine
    aborts still begins when its slot comes, to end the read as aborted: the publisher
    hears Released (aborted) and frees the blocks, not a lease expiry 30 s later."""
    one_slot = ("--limits.max-inflight-pulls-per-peer", "1")
    stalling = ("--faults.stall-rate", "1", "--transfer.stall-deadline-s", "3")
    with pd_sidecars(tmp_path, MODEL, d_args=(*one_slot, *stalling)) as pair:
        async with (
            engine_link(pair.p, pair.pe) as (p_client, p_events),
            engine_link(pair.d, pair.de) as (d_client, d_events),
        ):
            for i, request_id in enumerate(("running", "queued")):
                params = await p_client.publish(request_id, TOKENS, blocks_at(4 * i))
                await d_client.pull(params, blocks_at(4 * i), 0)
            assert await d_client.abort("queued") is AbortState.PULLING
            dones = {e.request_id: e for e in [await d_events.next(30) for _ in range(2)]}
            released = {e.request_id: e for e in [await p_events.next(30) for _ in range(2)]}
    assert dones["queued"].status is PullStatus.ABORTED, dones
    assert released["queued"] == Released("queued", ReleaseReason.ABORTED), released
    assert isinstance(released["running"], Released), released
