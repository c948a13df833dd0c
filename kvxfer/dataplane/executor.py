"""Carry out a TransferPlan: post its chunks, await them, report what was lost.

Each chunk (consecutive logical blocks of one group, all its regions) is one
NIXL handle, so a failure is narrowed to its chunk's blocks. At most
`max_inflight` chunks are posted at once. Every chunk ends DONE or failed by
its stall deadline; the result names the failed blocks per group and the
`valid_tokens` the engine can resume from. With `notify`, the remote agent
then gets that message as a NIXL notification: the request is consumed and
its blocks can go (the sidecar says the same with its EndRead RPC instead,
which also carries the outcome).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from kvxfer._exceptions import DataPlaneError
from kvxfer.core.planner import Chunk, TransferPlan
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
    all of them at once as one batch when they fit in `max_inflight`, else each as an
    earlier one ends; await the task for the outcome. Once `cancel` is set, chunks not
    yet handed to the backend end CANCELLED (a batch is handed over here, at once);
    posted ones finish or fail by their deadline.

    `posted` is settled once the NIXL thread is about to post the first chunk, or, when
    none is posted, once the chunks have ended (one at a time: once one has): until then
    that thread needs the GIL to build the handle, and a caller can hold back GIL-heavy
    work.

    With `notify`, once every chunk has ended (done or failed: nothing more will be
    read either way) the message goes to `peer` as a NIXL notification. A peer that
    cannot be told (gone, say) leaves `notified` False; the result stands."""
    options = options or ExecOptions()
    start = time.perf_counter()
    ending: Callable[[], Awaitable[Sequence[TransferStatus]]]
    if len(plan.chunks) > options.max_inflight:  # each posted as an earlier one ends
        posting = ChunkPoster(backend, peer, local, remote, options, cancel=cancel, posted=posted)
        posting.post(plan.chunks)  # binds every chunk before posting any
        bind_s, descriptors = posting.bind_s, posting.descriptors

        async def ending() -> Sequence[TransferStatus]:
            return in_plan_order(plan, await posting.wait())

    else:  # all at once: one hand-off to the NIXL thread and one back for them all
        first = None if posted is None else _first_post(posted)
        jobs = [chunk_job(c, peer, local, remote, options, on_post=first) for c in plan.chunks]
        bind_s, descriptors = time.perf_counter() - start, sum(len(j.local) for j in jobs)
        # Handed to the NIXL thread before this returns (none once `cancel` is set).
        batch = None if cancel is not None and cancel.is_set() else backend.post_all(jobs)
        ending = functools.partial(_at_once, len(jobs), batch, posted)

    async def finish() -> TransferResult:
        statuses = await ending()
        notified = notify is not None and await _notify(backend, peer, notify)
        return summarize(plan, statuses, block_size, start, bind_s, descriptors, notified)

    return asyncio.create_task(finish())


async def _at_once(
    count: int,
    batch: asyncio.Future[list[TransferStatus]] | None,
    posted: asyncio.Future[None] | None,
) -> list[TransferStatus]:
    """The chunks' statuses once their batch has ended (None: never posted, CANCELLED)."""
    try:
        return [TransferStatus.CANCELLED] * count if batch is None else await batch
    finally:  # none was posted, or this was cancelled: nobody is to wait for a post
        if posted is not None and not posted.done():
            posted.set_result(None)


class ChunkPoster:
    """Posts chunks, at most `max_inflight` at once, as they are handed in: all at once
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
        self.bind_s = 0.0
        self.descriptors = 0

    def post(self, chunks: Sequence[Chunk]) -> None:
        start = time.perf_counter()
        first = None if self._posted is None else _first_post(self._posted)
        jobs = [
            (
                c,
                chunk_job(
                    c, self._peer, self._local, self._remote, self._options, self._write, first
                ),
            )
            for c in chunks
        ]
        self.bind_s += time.perf_counter() - start
        for chunk, job in jobs:
            self.descriptors += len(job.local)
            self._tasks[chunk] = asyncio.create_task(self._run(job))

    async def _run(self, job: ChunkJob) -> TransferStatus:
        try:
            async with self._gate:
                if self._cancel is not None and self._cancel.is_set():
                    return TransferStatus.CANCELLED
                return await self._backend.read(job)
        finally:  # a chunk that ended unposted (or a backend that never calls on_post)
            if self._posted is not None and not self._posted.done():
                self._posted.set_result(None)

    def posted(self, chunk: Chunk) -> bool:
        return chunk in self._tasks

    async def wait(self) -> dict[Chunk, TransferStatus]:
        """Every posted chunk's status, once each has ended."""
        chunks = list(self._tasks)
        statuses = await asyncio.gather(*(self._tasks[c] for c in chunks))
        return dict(zip(chunks, statuses, strict=True))


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


def _status(failed: Mapping[int, list[int]], resume: int, plan: TransferPlan) -> RequestStatus:
    if not failed:
        return RequestStatus.OK
    if resume > plan.computed_tokens:
        return RequestStatus.PARTIAL
    return RequestStatus.FAILED
