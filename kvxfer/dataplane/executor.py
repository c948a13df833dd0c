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
import enum
import logging
import time
from collections.abc import Mapping
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


async def execute_plan(
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
) -> TransferResult:
    """Pull `plan` from `peer` (src = remote, dst = local). Once `cancel` is set, chunks
    not yet posted end CANCELLED; posted ones finish or fail by their deadline.

    With `notify`, once every chunk has ended (done or failed: nothing more will be
    read either way) the message goes to `peer` as a NIXL notification. A peer that
    cannot be told (gone, say) leaves `notified` False; the result stands."""
    options = options or ExecOptions()
    start = time.perf_counter()
    # Bind every chunk before posting any: a bad address fails the request up front.
    jobs = [(chunk, _job(chunk, peer, local, remote, options)) for chunk in plan.chunks]
    bound = time.perf_counter()
    gate = asyncio.Semaphore(options.max_inflight)

    async def run(job: ChunkJob) -> TransferStatus:
        async with gate:
            if cancel is not None and cancel.is_set():
                return TransferStatus.CANCELLED
            return await backend.read(job)

    statuses = await asyncio.gather(*(run(job) for _, job in jobs))
    failed: dict[int, list[int]] = {}
    moved = 0
    for (chunk, _), status in zip(jobs, statuses, strict=True):
        if status is TransferStatus.DONE:
            moved += chunk.nbytes
        else:
            failed.setdefault(chunk.group_id, []).extend(chunk.blocks)
    notified = notify is not None and await _notify(backend, peer, notify)
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
        chunk_statuses=tuple(statuses),
        descriptors=sum(len(job.local) for _, job in jobs),
        bind_s=bound - start,
        notified=notified,
    )


async def _notify(backend: TransferBackend, peer: str, message: bytes) -> bool:
    try:
        await backend.notify(peer, message)
    except DataPlaneError as exc:
        log.warning("consumed notification to %s not sent: %s", peer, exc)
        return False
    return True


def _job(
    chunk: Chunk,
    peer: str,
    local: Mapping[str, BoundBuffer],
    remote: Mapping[str, BoundBuffer],
    options: ExecOptions,
) -> ChunkJob:
    src, dst = chunk_arrays(chunk, remote, local)
    pair = chunk.regions[0]
    return ChunkJob(
        peer=peer,
        local=dst,
        remote=src,
        local_kind=local[pair.dst.buffer].kind,
        remote_kind=remote[pair.src.buffer].kind,
        deadline_s=options.stall_deadline_s,
    )


def _status(failed: Mapping[int, list[int]], resume: int, plan: TransferPlan) -> RequestStatus:
    if not failed:
        return RequestStatus.OK
    if resume > plan.computed_tokens:
        return RequestStatus.PARTIAL
    return RequestStatus.FAILED
