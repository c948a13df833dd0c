"""Real NIXL, two agents in two processes, shared-memory regions of real profiles.

Source and destination are filled with distinct known patterns; after a pull
exactly the planned (tensor, block) ranges of the destination must hold the
source's bytes and every other destination byte must be untouched. The
expected state is computed from the token-level oracle, not from the planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import random
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVarTuple, Unpack

import numpy as np
import pytest
from nixl_peer import LocalSide, SourcePeer
from oracle import oracle_blocks, oracle_valid_tokens

from kvxfer.client.shm import ShmKVCache
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind
from kvxfer.core.planner import plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.dataplane.adapter import ChunkJob, NixlAgent, TransferBackend, TransferStatus
from kvxfer.dataplane.executor import (
    ExecOptions,
    RequestStatus,
    chunk_job,
    execute_plan,
    handle_ranges,
)
from kvxfer.dataplane.faults import FaultInjectingBackend, fail_chunks

pytestmark = pytest.mark.nixl

BLOCK = 16
NUM_BLOCKS = 96  # attention blocks per group: up to 1536 tokens
STATE_BLOCKS = 3


def fill(cache: ShmKVCache, seed: int) -> None:
    """A byte pattern with period 251 (prime, so it never lines up with a block)."""
    pattern = ((np.arange(251) * 131 + seed) % 251).astype(np.uint8)
    for i, handle in enumerate(cache.buffers):
        view = cache.view(handle.name)
        view[:] = np.resize(np.roll(pattern, i), view.size)


def spans(layout: EngineLayout, rng: random.Random, num_tokens: int) -> list[BlockSpan]:
    """Ids from logical block 0: shuffled runs, so some coalesce and some do not."""
    out = []
    for group in layout.groups:
        if group.kind is GroupKind.MAMBA:
            ids = [rng.randrange(STATE_BLOCKS)]
        else:
            pieces, start = [], 0
            while start < NUM_BLOCKS:
                length = rng.randint(1, 9)
                pieces.append(list(range(start, min(start + length, NUM_BLOCKS))))
                start += length
            rng.shuffle(pieces)
            ids = [b for piece in pieces for b in piece][: -(-num_tokens // BLOCK)]
        out.append(BlockSpan(GroupId(group.group_id), 0, tuple(BlockId(b) for b in ids)))
    return out


def expected_after(
    src: ShmKVCache,
    dst_before: dict[str, np.ndarray],
    layout: EngineLayout,
    src_spans: list[BlockSpan],
    dst_spans: list[BlockSpan],
    num_tokens: int,
    computed: int,
    lost: dict[int, set[int]] | None = None,
) -> dict[str, np.ndarray]:
    expected = {name: view.copy() for name, view in dst_before.items()}
    for group, s_span, d_span in zip(layout.groups, src_spans, dst_spans, strict=True):
        for block in oracle_blocks(group, num_tokens, computed, BLOCK):
            if lost and block in lost.get(group.group_id, set()):
                continue
            for tensor in group.tensors:
                s_reg = src.layout.region_map[tensor.name]
                d_reg = layout.region_map[tensor.name]
                s_off = s_reg.block_offset(s_span.block_ids[block])
                d_off = d_reg.block_offset(d_span.block_ids[block])
                size = tensor.bytes_per_block
                expected[d_reg.buffer][d_off : d_off + size] = src.view(s_reg.buffer)[
                    s_off : s_off + size
                ]
    return expected


class Pair:
    def __init__(self, model: str) -> None:
        layout = layout_for_model(model, block_size=BLOCK)
        self.src = ShmKVCache(layout, NUM_BLOCKS, "t-src", STATE_BLOCKS)
        self.dst = ShmKVCache(layout, NUM_BLOCKS, "t-dst", STATE_BLOCKS)
        fill(self.src, seed=3)
        self.peer = SourcePeer(self.src.buffers)

    def close(self) -> None:
        self.peer.stop()
        self.src.close()
        self.dst.close()


@pytest.fixture(
    params=["gpt-oss-20b", "gemma-3-4b-it", "qwen3-next-80b-a3b", "jamba-mini-1.5", "llama-3.1-8b"]
)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()


# (N, C): no hit aligned / unaligned, partial hit aligned / unaligned, full hit
REQUESTS = [(1536, 0), (1201, 0), (1536, 1024), (1499, 1200), (777, 777), (17, 16)]


async def test_pull_moves_exactly_the_planned_bytes(pair: Pair) -> None:
    rng = random.Random(7)
    async with LocalSide(pair.dst.buffers) as local:
        peer = await local.backend.add_peer(pair.peer.metadata)
        for num_tokens, computed in REQUESTS:
            fill(pair.dst, seed=rng.randrange(1000))
            before = {h.name: pair.dst.view(h.name).copy() for h in pair.dst.buffers}
            src_spans = spans(pair.src.layout, rng, num_tokens)
            dst_spans = spans(pair.dst.layout, rng, num_tokens)
            plan = plan_transfer(
                pair.src.layout,
                pair.dst.layout,
                src_spans,
                dst_spans,
                num_tokens,
                computed,
                chunk_blocks=32,
            )
            result = await local.pull(plan, peer, pair.peer.buffers, BLOCK)
            assert result.status is RequestStatus.OK
            assert result.valid_tokens == num_tokens and not result.failed_blocks
            assert result.bytes_moved == plan.nbytes == result.bytes_planned
            want = expected_after(
                pair.src, before, pair.dst.layout, src_spans, dst_spans, num_tokens, computed
            )
            for name, view in want.items():
                got = pair.dst.view(name)
                assert np.array_equal(got, view), f"{name}: {(got != view).sum()} bytes differ"
            if computed < num_tokens:
                assert any(not np.array_equal(want[n], before[n]) for n in want)


async def test_consumed_request_notifies_the_remote_agent() -> None:
    p = Pair("gemma-3-4b-it")
    try:
        src_spans = spans(p.src.layout, random.Random(4), 700)
        plan = plan_transfer(p.src.layout, p.dst.layout, src_spans, src_spans, 700, 0)
        async with LocalSide(p.dst.buffers) as local:
            peer = await local.backend.add_peer(p.peer.metadata)
            result = await execute_plan(
                plan,
                backend=local.backend,
                peer=peer,
                local=local.buffers,
                remote=p.peer.buffers,
                block_size=BLOCK,
                notify=b"consumed req-7",
            )
            assert result.status is RequestStatus.OK and result.notified
            deadline = time.monotonic() + 10
            while b"consumed req-7" not in p.peer.notes():
                assert time.monotonic() < deadline, "the source agent never got the notification"
                await asyncio.sleep(0.05)
            assert p.peer.notes() == [b"consumed req-7"]
    finally:
        p.close()


@pytest.mark.parametrize(
    "model", ["gpt-oss-20b", "qwen3-next-80b-a3b", "gemma-3-4b-it", "jamba-mini-1.5"]
)
@pytest.mark.parametrize("max_inflight", [1, 64], ids=["one-at-a-time", "one-batch"])
async def test_injected_chunk_failures_match_the_recompute_oracle(
    model: str, max_inflight: int
) -> None:
    p = Pair(model)
    shared = 0  # handles carrying more than one chunk
    try:
        rng = random.Random(11)
        for failing in ({0}, {1, 3}, {2}, set(range(40))):
            fill(p.dst, seed=5)
            before = {h.name: p.dst.view(h.name).copy() for h in p.dst.buffers}
            num_tokens, computed = 1445, 512
            src_spans = spans(p.src.layout, rng, num_tokens)
            dst_spans = spans(p.dst.layout, rng, num_tokens)
            plan = plan_transfer(
                p.src.layout,
                p.dst.layout,
                src_spans,
                dst_spans,
                num_tokens,
                computed,
                chunk_blocks=16,
            )
            # A failed handle loses the blocks of every chunk it carries: consecutive
            # chunks (of one group or two) that fit in 32 blocks together share one.
            handles = handle_ranges(plan.chunks, 32)
            shared += sum(len(h) > 1 for h in handles)
            lost: dict[int, set[int]] = {}
            for index in failing & set(range(len(handles))):
                for chunk in plan.chunks[handles[index].start : handles[index].stop]:
                    lost.setdefault(chunk.group_id, set()).update(chunk.blocks)
            async with LocalSide(p.dst.buffers) as local:
                backend = FaultInjectingBackend(local.backend, fail_chunks(failing))
                peer = await backend.add_peer(p.peer.metadata)
                result = await execute_plan(
                    plan,
                    backend=backend,
                    peer=peer,
                    local=local.buffers,
                    remote=p.peer.buffers,
                    block_size=BLOCK,
                    options=ExecOptions(max_inflight=max_inflight, handle_blocks=32),
                )
            assert (len(plan.chunks) <= max_inflight) == (max_inflight > 1), "the other path"
            assert {g: set(b) for g, b in result.failed_blocks.items()} == lost
            assert result.valid_tokens == oracle_valid_tokens(
                p.src.layout.groups, num_tokens, computed, BLOCK, lost
            )
            want = expected_after(
                p.src, before, p.dst.layout, src_spans, dst_spans, num_tokens, computed, lost
            )
            for name, view in want.items():
                assert np.array_equal(p.dst.view(name), view), name
        assert shared, "no handle carried two chunks"
    finally:
        p.close()


async def test_stalled_chunk_fails_at_its_deadline() -> None:
    p = Pair("llama-3.1-8b")
    try:
        src_spans = spans(p.src.layout, random.Random(1), 1000)
        plan = plan_transfer(
            p.src.layout, p.dst.layout, src_spans, src_spans, 1000, 0, chunk_blocks=16
        )
        async with LocalSide(p.dst.buffers) as local:
            backend = FaultInjectingBackend(local.backend, fail_chunks((), stalling={2}))
            peer = await backend.add_peer(p.peer.metadata)
            start = time.monotonic()
            result = await execute_plan(
                plan,
                backend=backend,
                peer=peer,
                local=local.buffers,
                remote=p.peer.buffers,
                block_size=BLOCK,
                options=ExecOptions(stall_deadline_s=0.5, handle_blocks=16),
            )
            assert 0.5 <= time.monotonic() - start < 5
        assert result.chunk_statuses[2] is TransferStatus.TIMED_OUT
        assert result.failed_blocks == {0: tuple(range(32, 48))}
        assert result.valid_tokens == 32 * BLOCK
        assert result.status is RequestStatus.PARTIAL
    finally:
        p.close()


class _Watching:
    """The real backend, noting at each chunk's end whether `posted` was settled."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.posted: asyncio.Future[None] | None = None
        self.settled_by_then: list[bool] = []

    async def read(self, job: Any) -> TransferStatus:
        status: TransferStatus = await self._inner.read(job)
        self.settled_by_then.append(self.posted is not None and self.posted.done())
        return status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_posted_settles_as_the_first_chunk_is_posted_and_never_hangs() -> None:
    """What a pull's BeginRead waits for (server/pulls.py): settled by the NIXL thread
    as it posts the first chunk, long before the read ends; by whichever chunk posts
    first when the first stalls; and by the chunks' end when none is posted."""
    p = Pair("llama-3.1-8b")
    try:
        src_spans = spans(p.src.layout, random.Random(2), 1000)
        plan = plan_transfer(p.src.layout, p.dst.layout, src_spans, src_spans, 1000, 0, 4)
        assert len(plan.chunks) >= 16
        loop = asyncio.get_running_loop()
        async with LocalSide(p.dst.buffers) as local:
            peer = await local.backend.add_peer(p.peer.metadata)

            def read(backend: object, options: ExecOptions, **more: object) -> tuple:
                posted: asyncio.Future[None] = loop.create_future()
                task = execute_plan(
                    plan, backend=backend, peer=peer, local=local.buffers,
                    remote=p.peer.buffers, block_size=BLOCK, options=options, posted=posted,
                    **more,
                )  # fmt: skip
                assert not posted.done()
                return posted, task

            watching = _Watching(local.backend)
            posted, task = read(watching, ExecOptions(max_inflight=1, handle_blocks=4))
            watching.posted = posted
            await asyncio.wait_for(posted, 10)
            assert not task.done()  # 15 more chunks to post, one at a time
            assert (await task).status is RequestStatus.OK
            assert watching.settled_by_then == [True] * len(plan.chunks)  # before any ended

            stalling = FaultInjectingBackend(local.backend, fail_chunks((), stalling={0}))
            posted, task = read(stalling, ExecOptions(stall_deadline_s=5, handle_blocks=4))
            await asyncio.wait_for(posted, 2)  # chunk 1 posts; chunk 0 ends in 5 s
            assert (await task).chunk_statuses[0] is TransferStatus.TIMED_OUT

            cancel = asyncio.Event()
            cancel.set()
            posted, task = read(local.backend, ExecOptions(), cancel=cancel)
            assert (await task).status is RequestStatus.FAILED
            assert posted.done()
            # Windowed, two chunks to a handle: none is posted, every chunk CANCELLED.
            one_by_one = ExecOptions(max_inflight=1, handle_blocks=8)
            posted, task = read(local.backend, one_by_one, cancel=cancel)
            result = await task
            assert set(result.chunk_statuses) == {TransferStatus.CANCELLED}
            assert len(result.chunk_statuses) == len(plan.chunks)
            assert result.bytes_moved == 0 and posted.done()
    finally:
        p.close()


@pytest.mark.parametrize("max_inflight", [4, 256], ids=["windowed", "one-batch"])
async def test_killed_peer_fails_pending_chunks_and_severs_only_its_agent(
    max_inflight: int,
) -> None:
    """Kill the source during a large pull: every chunk ends (done or failed) within the
    deadline, failed blocks and valid_tokens follow the rule, the agent that read from
    it is severed (closed: nothing it posted can land any more), and a fresh agent on
    the same buffers pulls from another peer."""
    layout = layout_for_model("llama-3.1-8b", block_size=BLOCK)
    big_blocks = 1024  # 2 MiB per block: 2 GiB per side
    src = ShmKVCache(layout, big_blocks, "kill-src")
    dst = ShmKVCache(layout, big_blocks, "kill-dst")
    other = Pair("llama-3.1-8b")
    peer_proc = SourcePeer(src.buffers)
    try:
        ids = tuple(BlockId(b) for b in range(big_blocks))
        span = [BlockSpan(GroupId(0), 0, ids)]
        num_tokens = big_blocks * BLOCK
        plan = plan_transfer(src.layout, dst.layout, span, span, num_tokens, 0, chunk_blocks=8)
        async with LocalSide(dst.buffers + other.dst.buffers) as local:
            peer = await local.backend.add_peer(peer_proc.metadata)
            deadline = 3.0
            task = execute_plan(  # begun at once: a task
                plan,
                backend=local.backend,
                peer=peer,
                local=local.buffers,
                remote=peer_proc.buffers,
                block_size=BLOCK,
                # Two 8-block chunks to a handle: a failed handle fails both.
                options=ExecOptions(
                    stall_deadline_s=deadline, max_inflight=max_inflight, handle_blocks=16
                ),
                notify=b"consumed",
            )
            await asyncio.sleep(0.3)
            peer_proc.kill()
            killed_at = time.monotonic()
            result = await asyncio.wait_for(task, timeout=60)
            assert time.monotonic() - killed_at < deadline  # measured: about 0.03 s
            assert result.status is not RequestStatus.OK, "the kill came after the pull ended"
            assert not result.notified  # nobody left to tell, and no exception either
            failed = set(result.failed_blocks.get(0, ()))
            assert failed, result.chunk_statuses
            statuses = list(result.chunk_statuses)
            assert statuses[0::2] == statuses[1::2]  # each handle's two chunks alike
            assert all(b // 16 * 16 in failed and b // 16 * 16 + 15 in failed for b in failed)
            assert result.valid_tokens == oracle_valid_tokens(
                layout.groups, num_tokens, 0, BLOCK, {0: failed}
            )
            assert (
                result.bytes_moved == plan.nbytes - len(failed) * layout.groups[0].bytes_per_block
            )
            assert local.backend.closed
            assert await _thread_ended(local.backend)
            if max_inflight >= len(plan.chunks) // 2:
                # One batch: the kill failed a handle, and once that severed the agent no
                # later one was posted (CANCELLED, every one after the first).
                failing = {TransferStatus.DISCONNECTED, TransferStatus.FAILED}
                assert failing & set(statuses), statuses
                cancelled = TransferStatus.CANCELLED
                unposted = statuses.index(cancelled) if cancelled in statuses else len(statuses)
                assert set(statuses[unposted:]) <= {cancelled}, statuses
            # A fresh agent on the same buffers reads from another peer.
            async with LocalSide(other.dst.buffers) as fresh:
                other_peer = await fresh.backend.add_peer(other.peer.metadata)
                small = spans(other.src.layout, random.Random(2), 800)
                plan2 = plan_transfer(other.src.layout, other.dst.layout, small, small, 800, 0)
                result2 = await fresh.pull(plan2, other_peer, other.peer.buffers, BLOCK)
                assert result2.status is RequestStatus.OK
    finally:
        peer_proc.kill()
        other.close()
        src.close()
        dst.close()


async def test_a_read_given_up_on_mid_copy_leaves_the_agent_serving() -> None:
    """Cancel the task awaiting a pull while its chunk is copying: the agent's thread
    must outlive the chunk it can no longer report (its future was cancelled with the
    task) and serve the next read. A thread that died on it would leave every later
    call unanswered."""
    layout = layout_for_model("llama-3.1-8b", block_size=BLOCK)
    big_blocks = 512  # 2 MiB per block: 1 GiB per side, tens of ms to copy
    src = ShmKVCache(layout, big_blocks, "cancel-src")
    dst = ShmKVCache(layout, big_blocks, "cancel-dst")
    peer_proc = SourcePeer(src.buffers)
    try:
        span = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(big_blocks)))]
        whole = plan_transfer(
            src.layout, dst.layout, span, span, big_blocks * BLOCK, 0, chunk_blocks=big_blocks
        )
        small = plan_transfer(src.layout, dst.layout, span, span, BLOCK, 0)
        async with LocalSide(dst.buffers) as local:
            peer = await local.backend.add_peer(peer_proc.metadata)
            task = asyncio.ensure_future(local.pull(whole, peer, peer_proc.buffers, BLOCK))
            await asyncio.sleep(0.01)
            assert not task.done(), "the copy ended before it could be given up on"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.5)  # the copy ends and the thread reports it to nobody
            assert local.backend.alive
            result = await asyncio.wait_for(
                local.pull(small, peer, peer_proc.buffers, BLOCK), timeout=10
            )
            assert result.status is RequestStatus.OK
    finally:
        peer_proc.stop()
        src.close()
        dst.close()


async def _thread_ended(backend: TransferBackend) -> bool:
    """A severed agent's thread ends on its own, just after it has reported its chunks
    (their memory was deregistered before that: `alive` says when nothing at all of it
    runs any more)."""
    for _ in range(100):
        if not backend.alive:
            return True
        await asyncio.sleep(0.05)
    return False


@contextlib.asynccontextmanager
async def _batch_of_gpt_oss(
    backend: TransferBackend | None = None, **job: Any
) -> AsyncIterator[tuple[Pair, list[ChunkJob], LocalSide]]:
    """A gpt-oss-20b pair, the jobs of a 1000-token plan of 8-block chunks between it
    (`job`: more ChunkJob fields), and the reading side they are for (on `backend`)."""
    p = Pair("gpt-oss-20b")
    try:
        src_spans = spans(p.src.layout, random.Random(4), 1000)
        plan = plan_transfer(p.src.layout, p.dst.layout, src_spans, src_spans, 1000, 0, 8)
        async with LocalSide(p.dst.buffers, backend) as local:
            peer = await local.backend.add_peer(p.peer.metadata)
            jobs = [
                chunk_job(c, peer, local.buffers, p.peer.buffers, ExecOptions(), **job)
                for c in plan.chunks
            ]
            assert len(jobs) >= 4
            yield p, jobs, local
    finally:
        p.close()


async def test_a_batch_reports_each_chunk_in_order_and_a_closed_agent_posts_none() -> None:
    """`post_all`, the one hand-off of a pull's chunks: each chunk's status comes back
    in the order the chunks went in. A chunk NIXL will not create (a remote range the
    peer never registered) fails alone, nothing of it posted, so the agent is not
    severed and its neighbours land; on a closed agent every chunk ends CANCELLED."""
    async with _batch_of_gpt_oss() as (p, jobs, local):
        good, bad = jobs[0], 2
        local_ranges = [job.local for job in jobs]
        remote = jobs[bad].remote.copy()
        remote[:, 0] += np.uint64(1 << 40)  # nowhere the peer registered
        jobs[bad] = dataclasses.replace(jobs[bad], remote=remote)
        fill(p.dst, seed=9)
        before = {h.name: p.dst.view(h.name).copy() for h in p.dst.buffers}

        statuses = await local.backend.post_all(jobs)

        want = [TransferStatus.DONE] * len(jobs)
        want[bad] = TransferStatus.FAILED
        assert statuses == want
        assert not local.backend.closed and not local.backend.abandoned
        assert await local.backend.post_all([]) == []
        await local.backend.close()
        assert await local.backend.post_all([good, good]) == [TransferStatus.CANCELLED] * 2
        views = {int(local.buffers[h.name].address): h.name for h in p.dst.buffers}
        for index, ranges in enumerate(local_ranges):  # the failed chunk's bytes untouched
            for address, length, _ in ranges.tolist():
                base = max(a for a in views if a <= address)
                at = slice(address - base, address - base + length)
                name = views[base]
                same = np.array_equal(p.dst.view(name)[at], before[name][at])
                assert same == (index == bad), (index, name, at)


async def test_a_bug_mid_batch_severs_the_agent_before_the_batch_is_reported() -> None:
    """An exception while a batch is being posted (a bug; here the second chunk's
    `on_post` raises) neither escapes the NIXL thread nor ends the batch while chunks
    posted before it could still land: the agent is severed first. The chunk ends
    FAILED, the ones after it CANCELLED, unposted, and the one before it DONE or, if
    NIXL had not seen it complete yet, SEVERED."""
    posts = itertools.count()

    def on_post() -> None:
        if next(posts) == 1:
            raise RuntimeError("a bug in a post's callback")

    async with _batch_of_gpt_oss(on_post=on_post) as (_, jobs, local):
        statuses = await asyncio.wait_for(local.backend.post_all(jobs), 10)
        assert statuses[0] in (TransferStatus.DONE, TransferStatus.SEVERED)
        assert statuses[1] is TransferStatus.FAILED
        assert set(statuses[2:]) == {TransferStatus.CANCELLED}
        assert local.backend.closed and local.backend.abandoned
        assert await _thread_ended(local.backend)


class _NixlFaking:
    """The real nixl agent, except for the state it reports for chosen handles (by
    creation order): "PROC" for ever (a hung transfer: only its deadline ends it) or
    "ERR". Those handles are real and posted like the rest, and like every NIXL handle
    each holds a reference to the agent's C++ object."""

    def __init__(self, agent: Any, states: dict[int, str]) -> None:
        self._agent = agent
        self._states = states
        self._created = 0
        self._faked: dict[int, str] = {}  # id(handle) -> its state; until it is released

    def initialize_xfer(self, *args: Any) -> Any:
        handle = self._agent.initialize_xfer(*args)
        if self._created in self._states:
            self._faked[id(handle)] = self._states[self._created]
        self._created += 1
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        return self._faked.get(id(handle)) or str(self._agent.check_xfer_state(handle))

    def release_xfer_handle(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)
        self._faked.pop(id(handle), None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class _FaultyNixl(NixlAgent):
    """A NixlAgent on a `_NixlFaking` agent; `binding` refers (weakly) to the C++ agent,
    whose UCX workers and endpoints are what a late write needs."""

    def __init__(self, states: dict[int, str]) -> None:
        self._states = states
        self.binding: weakref.ref[Any] | None = None
        super().__init__("dst")

    def _create_agent(self) -> Any:
        agent = super()._create_agent()
        self.binding = weakref.ref(agent.agent)
        return _NixlFaking(agent, self._states)


_Ts = TypeVarTuple("_Ts")


class _HearingLoop(asyncio.SelectorEventLoop):
    """Notes, at the moment a thread hands this loop the outcome of `watched` (which
    `asyncio.wrap_future` does with `call_soon_threadsafe(set_state, future, ...)`),
    whether the C++ agent `binding` refers to was gone by then."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: asyncio.Future[Any] | None = None
        self.binding: weakref.ref[Any] | None = None
        self.agent_gone: list[bool] = []

    def call_soon_threadsafe(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        if args and args[0] is self.watched and self.binding is not None:
            self.agent_gone.append(self.binding() is None)
        return super().call_soon_threadsafe(callback, *args, context=context)


_LONG_S = 60.0
_FAILURES = {
    # chunk 0 hangs until its deadline; chunk 1 hangs past it (SEVERED with it)
    "timed-out": ({0: "PROC", 1: "PROC"}, {0: 0.3}, False),
    # chunk 0 hangs; NIXL says chunk 1 failed as it is posted
    "failed-at-post": ({0: "PROC", 1: "ERR"}, {}, False),
    # chunk 0 hangs; chunk 1's on_post raises (a bug) after its handle was created
    "bug-at-post": ({0: "PROC"}, {}, True),
    # both chunks hang when the agent is closed
    "closed": ({0: "PROC", 1: "PROC"}, {}, False),
}
_REPORTED = {
    "timed-out": [TransferStatus.TIMED_OUT, TransferStatus.SEVERED],
    "failed-at-post": [TransferStatus.SEVERED, TransferStatus.FAILED],
    "bug-at-post": [TransferStatus.SEVERED, TransferStatus.FAILED],
    "closed": [TransferStatus.CANCELLED, TransferStatus.CANCELLED],
}


@pytest.mark.parametrize("how", list(_FAILURES))
def test_no_transfer_handle_keeps_the_agent_alive_when_its_failure_is_reported(
    how: str,
) -> None:
    """When the NIXL thread hands the loop a failed (or cancelled) batch, the C++ agent
    must be destroyed already: every NIXL handle holds it, so a handle still referenced
    anywhere (the severed chunks, the list of failed ones) would keep its UCX worker
    and endpoints alive while the engine is told it may reuse the blocks."""
    states, deadlines, bug = _FAILURES[how]
    posts = itertools.count()

    def on_post() -> None:
        if bug and next(posts) == 1:
            raise RuntimeError("a bug in a post's callback")

    async def main(loop: _HearingLoop) -> list[TransferStatus]:
        backend = _FaultyNixl(states)
        async with _batch_of_gpt_oss(backend, on_post=on_post) as (_, jobs, local):
            # Two chunks: the batch is reported as the second one ends.
            two = [
                dataclasses.replace(job, deadline_s=deadlines.get(index, _LONG_S))
                for index, job in enumerate(jobs[:2])
            ]
            assert backend.binding is not None and backend.binding() is not None
            loop.binding = backend.binding
            loop.watched = batch = local.backend.post_all(two)
            if how == "closed":
                await local.backend.close()
            statuses = await asyncio.wait_for(batch, 10)
            assert local.backend.closed and local.backend.abandoned
            assert await _thread_ended(local.backend)
        return statuses

    with asyncio.Runner(loop_factory=_HearingLoop) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, _HearingLoop)
        statuses = runner.run(main(loop))
    assert statuses == _REPORTED[how]
    assert loop.agent_gone == [True], "the failure was reported with the NIXL agent alive"
