"""Carry out a TransferPlan: post its chunks, await them, report what was lost.

Each chunk (consecutive logical blocks of one group, all its regions) is
posted as one NIXL handle, or, when chunks handed in together are small,
consecutive ones share a handle while their blocks together fit in
`handle_blocks` (a handle costs the NIXL thread the same to create, post and
release whatever it carries). A failure is narrowed to its handle's chunks'
blocks. At most `max_inflight` handles are posted at once. Every chunk ends
DONE or failed by its stall deadline; the result names the failed blocks per group and the
`valid_tokens` the engine can resume from. With `notify`, the remote agent
then gets that message as a NIXL notification: the request is consumed and
its blocks can go (the sidecar says the same with its EndRead RPC instead,
which also carries the outcome).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer._exceptions import DataPlaneError
from kvxfer.core.planner import DEFAULT_CHUNK_BLOCKS, Chunk, TransferPlan
from kvxfer.core.recompute import valid_tokens
from kvxfer.dataplane.adapter import ChunkJob, TransferBackend, TransferStatus
from kvxfer.dataplane.descriptors import BoundBuffer, chunk_arrays

log = logging.getLogger(__name__)


class RequestStatus(enum.StrEnum):
    OK = "ok"  # every planned block arrived
    PARTIAL = "partial"  # some blocks failed; resume from valid_tokens
    FAILED = "failed"  # nothing usable arrived beyond what was held


@dataclass(frozen=True)
class ExecOptions:
    stall_deadline_s: float = 10.0
    max_inflight: int = 32
    # The most logical blocks one NIXL handle covers (the planner's `chunk_blocks`: a
    # chunk never covers more); consecutive chunks that together fit share a handle.
    handle_blocks: int = DEFAULT_CHUNK_BLOCKS


@dataclass(frozen=True)
class TransferResult:
    status: RequestStatus
    failed_blocks: Mapping[int, tuple[int, ...]]
    valid_tokens: int
    bytes_moved: int
    bytes_planned: int
    duration_s: float
    chunk_statuses: tuple[TransferStatus, ...]
    descriptors: int = 0
    bind_s: float = 0.0  # building every chunk's descriptor arrays, before the first post
    notified: bool = False  # the consumed notification reached NIXL for the remote agent
    # When the loop saw each chunk end (time.monotonic(), plan order; never before it
    # really ended): what a reader holding a lease on its source checks against it.
    ended: tuple[float, ...] = ()


def execute_plan(
    plan: TransferPlan,
    *,
    backend: TransferBackend,
    peer: str,
    local: Mapping[str, BoundBuffer],
    remote: Mapping[str, BoundBuffer],
    block_size: int,
    options: ExecOptions | None = None,
    cancel: asyncio.Event | None = None,
    notify: bytes | None = None,
    posted: asyncio.Future[None] | None = None,
) -> asyncio.Task[TransferResult]:
    """Pull `plan` from `peer` (src = remote, dst = local), begun now: every chunk is
    bound before this returns (a bad address raises here) and handed to the backend,
    all of them at once as one batch when their handles fit in `max_inflight`, else
    each handle as an earlier one ends; await the task for the outcome. Once `cancel`
    is set, chunks not yet handed to the backend end CANCELLED (a batch is handed over
    here, at once); posted ones finish or fail by their deadline.

    `posted` is settled once the NIXL thread is about to post the first chunk, or, when
    none is posted, once the chunks have ended (one at a time: once one has): until then
    that thread needs the GIL to build the handle, and a caller can hold back GIL-heavy
    work.

    With `notify`, once every chunk has ended (done or failed: nothing more will be
    read either way) the message goes to `peer` as a NIXL notification. A peer that
    cannot be told (gone, say) leaves `notified` False; the result stands."""
    options = options or ExecOptions()
    start = time.perf_counter()
    ending: Callable[[], Awaitable[tuple[Sequence[TransferStatus], Sequence[float]]]]
    first = None if posted is None else _first_post(posted)
    # Every chunk bound before any is posted: a bad address raises here.
    handles = handle_jobs(plan.chunks, peer, local, remote, options, on_post=first)
    bind_s = time.perf_counter() - start
    descriptors = sum(len(job.local) for job, _ in handles)
    if len(handles) > options.max_inflight:  # each posted as an earlier one ends
        posting = ChunkPoster(backend, peer, local, remote, options, cancel=cancel, posted=posted)
        posting.post_handles(plan.chunks, handles)

        async def ending() -> tuple[Sequence[TransferStatus], Sequence[float]]:
            statuses = in_plan_order(plan, await posting.wait())
            return statuses, posting.ended()  # handed in in plan order

    else:  # all at once: one hand-off to the NIXL thread and one back for them all
        jobs = [job for job, _ in handles]
        # Handed to the NIXL thread before this returns (none once `cancel` is set).
        batch = None if cancel is not None and cancel.is_set() else backend.post_all(jobs)
        counts = [count for _, count in handles]
        ending = functools.partial(_at_once, counts, batch, posted)

    async def finish() -> TransferResult:
        statuses, ended = await ending()
        notified = notify is not None and await _notify(backend, peer, notify)
        result = summarize(plan, statuses, block_size, start, bind_s, descriptors, notified)
        return dataclasses.replace(result, ended=tuple(ended))

    return asyncio.create_task(finish())


async def _at_once(
    counts: Sequence[int],
    batch: asyncio.Future[list[TransferStatus]] | None,
    posted: asyncio.Future[None] | None,
) -> tuple[list[TransferStatus], list[float]]:
    """The chunks' statuses once their batch has ended, each its handle's (`counts`:
    chunks per handle; no batch: never posted, CANCELLED), and when that was seen (the
    loop hears of a batch once, when its last chunk has ended)."""
    try:
        if batch is None:
            return [TransferStatus.CANCELLED] * sum(counts), [time.monotonic()] * sum(counts)
        statuses = await batch
        ended = [time.monotonic()] * sum(counts)
        return [s for s, count in zip(statuses, counts, strict=True) for _ in range(count)], ended
    finally:  # none was posted, or this was cancelled: nobody is to wait for a post
        if posted is not None and not posted.done():
            posted.set_result(None)


class ChunkPoster:
    """Posts chunks, at most `max_inflight` handles at once, as they are handed in: all at once
    for a pull, as the prefill computes them for a push (`write`: the local buffers are
    the source). A bad address fails the call that hands its chunk in, before any of
    that call's chunks is posted. `posted`: see `execute_plan`."""

    def __init__(
        self,
        backend: TransferBackend,
        peer: str,
        local: Mapping[str, BoundBuffer],
        remote: Mapping[str, BoundBuffer],
        options: ExecOptions,
        *,
        cancel: asyncio.Event | None = None,
        write: bool = False,
        posted: asyncio.Future[None] | None = None,
    ) -> None:
        self._backend, self._peer, self._options = backend, peer, options
        self._local, self._remote, self._write = local, remote, write
        self._cancel = cancel
        self._posted = posted
        self._gate = asyncio.Semaphore(options.max_inflight)
        self._tasks: dict[Chunk, asyncio.Task[TransferStatus]] = {}
        self._handed: list[asyncio.Task[TransferStatus]] = []  # each chunk's, in order
        self._ended: dict[asyncio.Task[TransferStatus], float] = {}
        self.bind_s = 0.0
        self.descriptors = 0

    def post(self, chunks: Sequence[Chunk]) -> None:
        """Bind `chunks` and post them: consecutive ones share a handle while they fit
        (`handle_jobs`), and a chunk's status is its handle's."""
        start = time.perf_counter()
        first = None if self._posted is None else _first_post(self._posted)
        opts = self._options
        handles = handle_jobs(
            chunks, self._peer, self._local, self._remote, opts, self._write, first
        )
        self.bind_s += time.perf_counter() - start
        self.post_handles(chunks, handles)

    def post_handles(
        self, chunks: Sequence[Chunk], handles: Sequence[tuple[ChunkJob, int]]
    ) -> None:
        """Post `chunks`, already bound as `handles` (`handle_jobs` of them, in order)."""
        ahead = iter(chunks)
        for job, count in handles:
            self.descriptors += len(job.local)
            task = asyncio.create_task(self._run(job))
            task.add_done_callback(self._note_end)
            self._handed += [task] * count
            for chunk in itertools.islice(ahead, count):
                self._tasks[chunk] = task

    async def _run(self, job: ChunkJob) -> TransferStatus:
        try:
            async with self._gate:
                if self._cancel is not None and self._cancel.is_set():
                    return TransferStatus.CANCELLED
                return await self._backend.read(job)
        finally:  # a chunk that ended unposted (or a backend that never calls on_post)
            if self._posted is not None and not self._posted.done():
                self._posted.set_result(None)

    def _note_end(self, task: asyncio.Task[TransferStatus]) -> None:
        self._ended[task] = time.monotonic()  # run after the task ended: never early

    def posted(self, chunk: Chunk) -> bool:
        return chunk in self._tasks

    def ended(self) -> list[float]:
        """When the loop saw each chunk handed in end, in the order they were handed in
        (once `wait` has returned: each has)."""
        now = time.monotonic()
        return [self._ended.get(task, now) for task in self._handed]

    async def wait(self) -> dict[Chunk, TransferStatus]:
        """Every posted chunk's status, once each has ended."""
        chunks = list(self._tasks)
        statuses = await asyncio.gather(*(self._tasks[c] for c in chunks))
        return dict(zip(chunks, statuses, strict=True))

    def handed(self) -> list[asyncio.Task[TransferStatus]]:
        """The tasks of the chunks handed in, one per handle: what to wait on, without
        cancelling them (`wait` would cancel them with it), for all of them to end."""
        return list(dict.fromkeys(self._tasks.values()))

    def all_ended(self) -> bool:
        """Every chunk handed in ended with a status: none is still posted, and none has
        an end nobody heard (its task cancelled, or raised), which may still be running
        in NIXL."""
        return all(
            task.done() and not task.cancelled() and task.exception() is None
            for task in self._tasks.values()
        )


def _first_post(future: asyncio.Future[None]) -> Callable[[], None]:
    """The `on_post` of a poster's chunks: the first call, on the NIXL thread, settles
    `future` on its loop; later ones cost nothing."""
    loop, calls = future.get_loop(), itertools.count()

    def settle() -> None:
        if not future.done():
            future.set_result(None)

    def on_post() -> None:
        if next(calls) == 0:  # count() steps atomically under the GIL
            # A closed loop awaits nothing: the chunk is posted regardless.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

    return on_post


def in_plan_order(
    plan: TransferPlan, statuses: Mapping[Chunk, TransferStatus]
) -> list[TransferStatus]:
    """Each chunk's status in the plan's order; a chunk never posted is CANCELLED."""
    return [statuses.get(chunk, TransferStatus.CANCELLED) for chunk in plan.chunks]


def summarize(
    plan: TransferPlan,
    ordered: Sequence[TransferStatus],
    block_size: int,
    start: float,
    bind_s: float = 0.0,
    descriptors: int = 0,
    notified: bool = False,
) -> TransferResult:
    """The outcome of `plan` from its chunks' statuses, in the plan's order (a chunk is
    found by its place: hashing one hashes every run and region of it)."""
    failed: dict[int, list[int]] = {}
    moved = 0
    for chunk, status in zip(plan.chunks, ordered, strict=True):
        if status is TransferStatus.DONE:
            moved += chunk.nbytes
        else:
            failed.setdefault(chunk.group_id, []).extend(chunk.blocks)
    # Nothing failed: every token is valid (the request was checked when it was planned).
    resume = plan.num_tokens
    if failed:
        resume = valid_tokens(
            [g.group for g in plan.groups],
            plan.num_tokens,
            plan.computed_tokens,
            block_size,
            failed,
            plan.moved_from,
        )
    return TransferResult(
        status=_status(failed, resume, plan),
        failed_blocks={g: tuple(sorted(b)) for g, b in failed.items()},
        valid_tokens=resume,
        bytes_moved=moved,
        bytes_planned=plan.nbytes,
        duration_s=time.perf_counter() - start,
        chunk_statuses=tuple(ordered),
        descriptors=descriptors,
        bind_s=bind_s,
        notified=notified,
    )


async def _notify(backend: TransferBackend, peer: str, message: bytes) -> bool:
    try:
        await backend.notify(peer, message)
    except DataPlaneError as exc:
        log.warning("consumed notification to %s not sent: %s", peer, exc)
        return False
    return True


def chunk_job(
    chunk: Chunk,
    peer: str,
    local: Mapping[str, BoundBuffer],
    remote: Mapping[str, BoundBuffer],
    options: ExecOptions,
    write: bool = False,
    on_post: Callable[[], None] | None = None,
) -> ChunkJob:
    """A pull reads the peer's blocks into ours; a push (`write`) writes ours into the
    peer's: the same descriptors, source and destination swapped."""
    pair = chunk.regions[0]
    src_side, dst_side = (local, remote) if write else (remote, local)
    src, dst = chunk_arrays(chunk, src_side, dst_side)
    src_kind, dst_kind = src_side[pair.src.buffer].kind, dst_side[pair.dst.buffer].kind
    deadline = options.stall_deadline_s
    if write:
        return ChunkJob(peer, src, dst, src_kind, dst_kind, deadline, True, on_post)
    return ChunkJob(peer, dst, src, dst_kind, src_kind, deadline, on_post=on_post)


def handle_jobs(
    chunks: Sequence[Chunk],
    peer: str,
    local: Mapping[str, BoundBuffer],
    remote: Mapping[str, BoundBuffer],
    options: ExecOptions,
    write: bool = False,
    on_post: Callable[[], None] | None = None,
) -> list[tuple[ChunkJob, int]]:
    """`chunks`' jobs, consecutive ones joined into one handle while their blocks
    together fit in `options.handle_blocks` and their memory kinds match: (job, how
    many chunks it carries), in order. A pull of a few hundred blocks is then one
    handle whatever its groups, where it was a handle per group."""
    jobs = [chunk_job(c, peer, local, remote, options, write, on_post) for c in chunks]
    kinds = [(job.local_kind, job.remote_kind) for job in jobs]
    return [
        (_joined(jobs[run.start : run.stop]), len(run))
        for run in handle_ranges(chunks, options.handle_blocks, kinds)
    ]


def handle_ranges(
    chunks: Sequence[Chunk], limit: int, kinds: Sequence[object] | None = None
) -> list[range]:
    """Which of `chunks` share a handle: runs of consecutive ones whose blocks together
    fit in `limit` (a chunk larger alone is a run alone) and whose `kinds`, when
    given, are equal."""
    runs: list[range] = []
    start, blocks = 0, 0
    for i, chunk in enumerate(chunks):
        size = len(chunk.blocks)
        if i > start and (
            blocks + size > limit or (kinds is not None and kinds[i] != kinds[start])
        ):
            runs.append(range(start, i))
            start, blocks = i, 0
        blocks += size
    if chunks:
        runs.append(range(start, len(chunks)))
    return runs


def _joined(jobs: Sequence[ChunkJob]) -> ChunkJob:
    if len(jobs) == 1:
        return jobs[0]
    local = np.concatenate([job.local for job in jobs])
    remote = np.concatenate([job.remote for job in jobs])
    return dataclasses.replace(jobs[0], local=local, remote=remote)


def _status(failed: Mapping[int, list[int]], resume: int, plan: TransferPlan) -> RequestStatus:
    if not failed:
        return RequestStatus.OK
    if resume > plan.computed_tokens:
        return RequestStatus.PARTIAL
    return RequestStatus.FAILED
