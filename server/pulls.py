"""One pull, from accepted to PullDone (decode side; docs/architecture.md, "A request's life").

`run_pull` is the background half of `Pull`: begin the read at the serving
sidecar (which checks the lease and is authoritative for the published
spans), keep the lease alive by heartbeat, execute the plan through the data
plane, end the read (consumed or aborted) and report the outcome. Anything
the peer refuses or loses becomes failed blocks and a `valid_tokens` from
the recompute rule, never an exception that escapes the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvxfer._exceptions import (
    DataPlaneError,
    InvalidInputError,
    KvxferError,
)
from kvxfer.core.planner import TransferPlan
from kvxfer.core.recompute import valid_tokens
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.dataplane.adapter import TransferStatus
from kvxfer.dataplane.executor import ExecOptions, TransferResult, execute_plan, summarize
from kvxfer.dataplane.readers import Reader, Readers
from kvxfer.server.engines import Engine
from kvxfer.server.metrics import Metrics
from kvxfer.server.peers import TRY_AGAIN, PeerLink, PeerLinks
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.layout import spans_from_proto

log = logging.getLogger(__name__)
T = TypeVar("T")
POST_WAIT_S = 0.005  # the longest BeginRead waits for the read's first post
# A cancelled pull tries EndRead once, for at most this long. Only the sidecar's loop
# going away cancels one (Sidecar.shutdown aborts its pulls and waits a while; asyncio
# then cancels what is left and waits for it, without a deadline), so this is added to
# the exit. A peer that answers at all answers in milliseconds; the lease of one that
# does not expires there on its TTL.
CANCELLED_END_READ_S = 1.0


class LeaseWatch:
    """Until when the publisher surely holds a begun read's lease, as far as the reader
    can know: its TTL after the latest BeginRead or Heartbeat it answered, counted from
    when that call was sent (the publisher renews on receipt, never earlier). Past
    `held_until` the lease may have lapsed there and its engine reused the blocks, so a
    chunk seen ending later may have read anything: its blocks fail, and no chunk is
    posted any more. Nothing is undone after that: a late answer renews nothing."""

    def __init__(self, ttl_s: float, sent: float) -> None:
        """`sent`: when the BeginRead that answered `ttl_s` was sent (time.monotonic())."""
        self.ttl_s = ttl_s
        self.held_until = sent + ttl_s
        self.lapsed = False
        self._timer: asyncio.TimerHandle | None = None

    def renewed(self, sent: float) -> None:
        """A call sent at `sent` (time.monotonic()) was answered: the lease was held."""
        if not self.lapsed:
            self.held_until = max(self.held_until, sent + self.ttl_s)

    def watch(self, stop: asyncio.Event) -> None:
        """Set `stop` once the lease may have lapsed, unless `unwatch` came first (the
        read is over). A timer, re-armed as renewals move `held_until`: no task per pull."""
        left = self.held_until - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self.watch, stop)
            return
        self.lapsed = True
        stop.set()

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def confirmed(self, result: TransferResult) -> tuple[TransferStatus, ...]:
        """Each chunk's status, CANCELLED where it was seen ending past `held_until`."""
        return tuple(
            status if end <= self.held_until else TransferStatus.CANCELLED
            for status, end in zip(result.chunk_statuses, result.ended, strict=True)
        )

    def lapse_reason(self) -> str:
        return (
            f"the publisher's lease may have lapsed: no BeginRead or Heartbeat was answered "
            f"within its TTL ({self.ttl_s:g} s), so blocks read after that are not trusted"
        )


@dataclass
class GiveUp:
    """When a cancelled transfer stops waiting for its posted chunks: set at its first
    cancellation, and kept for every later wait of the same transfer."""

    at: float | None = None
    gave_up: bool = False


async def outlast(
    tasks: Sequence[asyncio.Future[Any]],
    give_up: GiveUp,
    patience_s: float,
    *,
    cancelled: bool,
    what: str,
) -> None:
    """Wait until every one of `tasks` (posted chunks, or a read of them) has ended,
    without cancelling them: NIXL could not stop them. Cancelling this wait (or
    `cancelled`: the caller was) is passed on once they have ended, or `patience_s`
    after the transfer was first cancelled (only a NIXL thread stuck in a call ends no
    chunk by then, and the sidecar's exit must not wait for that)."""
    while running := [task for task in tasks if not task.done()]:
        if cancelled and give_up.at is None:
            give_up.at = time.monotonic() + patience_s
        left = None if give_up.at is None or not cancelled else give_up.at - time.monotonic()
        if left is not None and left <= 0:
            if not give_up.gave_up:
                log.error("%s did not end within its stall deadline", what)
                give_up.gave_up = True
            break
        try:
            await asyncio.wait(running, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


@dataclass
class Pull:
    engine: Engine
    params: TransferParams
    link: PeerLink
    plan: TransferPlan
    started: float = field(default_factory=time.monotonic)
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    # Its engine is retiring: it stops waiting for a slot and begins nothing (an engine's
    # own Abort only cancels: a queued pull still begins, to end the read as aborted, so
    # the publisher frees the blocks at once instead of at the lease's expiry).
    leaving: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    lease_lost: bool = False
    # Set once BeginRead was answered: from then on the publisher holds the lease for
    # this reader, and its engine's blocks, until EndRead or the lease's TTL, so every
    # way out of the pull ends the read (`run_pull`), a bug's and a cancellation's too.
    read_begun: bool = False
    task: asyncio.Task[None] | None = None
    reading: asyncio.Task[TransferResult] | None = None  # its read, once chunks are handed on
    # Settled once the NIXL thread posts the read begun beside BeginRead (`posting`).
    posted: asyncio.Future[None] | None = None
    # Cancelled, it waits for its read until then, once for all its waits (`_ended`).
    give_up: GiveUp = field(default_factory=GiveUp)
    renewing: asyncio.Task[None] | None = None  # its heartbeat, cancelled once read
    result: TransferResult | None = None  # the executed read, for its metrics
    slotted: float | None = None  # when it got its running slot (monotonic)
    begin_read_s: float | None = None  # its BeginRead, call to answer
    # Set once its PullDone is out: every chunk it posted has ended (on the exceptional
    # paths, a cancelled task or an internal error, one may still be posted; retiring
    # destroys the engine's agents before it unmaps). What its task does after, EndRead,
    # uses no engine memory.
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    async def posting(self) -> None:
        """Until the NIXL thread has posted the read begun beside BeginRead (at most
        POST_WAIT_S; at once when none was begun): until then that thread needs the GIL
        to build its handle, and the loop's own work, a gRPC call or a lane write, would
        hold it up."""
        if self.posted is not None:
            await asyncio.wait((self.posted,), timeout=POST_WAIT_S)


@dataclass(frozen=True)
class PullContext:
    readers: Readers
    links: PeerLinks
    metrics: Metrics
    options: ExecOptions
    reader_id: str
    end_read_patience_s: float = 300.0


async def run_pull(pull: Pull, ctx: PullContext, report: Callable[[PullDone], None]) -> None:
    """Carry out the pull; `report` gets its PullDone as soon as the outcome is known,
    before the read is ended at the serving side (one round trip off the engine's path).
    A read BeginRead began is ended whatever the outcome, as aborted unless it was read:
    also when the pull failed unexpectedly or was cancelled."""
    peer = ctx.links.label(pull.params.peer_address)
    ctx.metrics.active.start()
    ctx.metrics.inflight_pulls.labels(peer).inc()
    cancelled = False
    try:
        done = await _transfer(pull, ctx)
    except asyncio.CancelledError:
        cancelled = pull.aborted = True
        done = _all_failed(pull, PullStatus.ABORTED, "the sidecar shut down during the pull")
    except Exception as exc:  # a bug must still end in a PullDone, never a silent hang
        log.exception("pull %s failed unexpectedly", pull.request_id)
        pull.aborted = True  # and a begun read still ends at once, not at the lease's TTL
        done = _all_failed(pull, PullStatus.FAILED, f"internal error: {exc}")
    finally:
        ctx.metrics.inflight_pulls.labels(peer).dec()
        ctx.metrics.active.stop()
    report(done)  # first: the engine is waiting for it, the metrics are not
    await asyncio.sleep(0)  # and the event goes out before the metrics and EndRead run
    observe(pull.plan, done, ctx.metrics, peer, "read")
    _observe_phases(pull, ctx.metrics, peer)
    if pull.result is not None:
        _observe_read(pull.result, done, ctx.metrics, peer)
    if pull.renewing is not None:
        await stop_heartbeat(pull.renewing)  # cancelled already: it renews no more
    if pull.read_begun:
        await _end_read(pull, ctx, done, cancelled=cancelled)


async def _transfer(pull: Pull, ctx: PullContext) -> PullDone:
    """The outcome; `pull.read_begun` says whether the read must be ended.

    The NIXL read starts while BeginRead is in flight, so its round trip to the
    publisher overlaps the copy instead of preceding it. Until BeginRead answers, the
    blocks are still held by their publication (a publication the publisher released
    makes BeginRead fail); what was read is trusted only once BeginRead confirms the
    lease, and a refused or mismatched read fails every block. Whatever the outcome,
    even when this is cancelled or fails unexpectedly, it is known only once every
    posted chunk has ended (NIXL cannot cancel one), so nothing lands in a block
    reported failed."""
    link, params = pull.link, pull.params
    if pull.leaving.is_set():  # its engine began retiring while it waited for a slot
        return _all_failed(pull, PullStatus.ABORTED, "its engine is going away")
    if link.epoch != params.epoch:
        return _all_failed(
            pull,
            PullStatus.FAILED,
            f"the publisher restarted: params are from epoch {params.epoch}, "
            f"peer {params.peer_address} is now epoch {link.epoch}",
        )
    posted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    # Without a reader (the peer's metadata may have changed: BeginRead says so) the
    # read waits for BeginRead.
    with contextlib.suppress(KvxferError):
        pull.reading = _execute(pull, ctx, await _reader(pull, ctx), posted)
        pull.posted = posted
    try:
        return await _begin(pull, ctx)
    except BaseException as exc:  # cancelled, or a bug: the read begun beside BeginRead ends first
        pull.cancel.set()  # chunks not yet posted are not posted
        if pull.reading is not None:
            cancelled = isinstance(exc, asyncio.CancelledError)
            with contextlib.suppress(Exception):
                await _ended(pull, ctx, cancelled=cancelled)
        raise


async def _begin(pull: Pull, ctx: PullContext) -> PullDone:
    """Begin the read at the publisher and, once it is begun, keep its lease alive and
    watch it while the read runs."""
    await pull.posting()  # BeginRead's gRPC call would hold up the post
    asked = time.monotonic()
    try:
        begun = await ctx.links.begin_read(pull.link, pull.request_id, ctx.reader_id)
    except KvxferError as exc:
        return await _refused(pull, ctx, str(exc))
    finally:
        pull.begin_read_s = time.monotonic() - asked
    pull.read_begun = True
    lease = LeaseWatch(begun.lease_ttl_ms / 1000, asked)
    renewing = asyncio.create_task(heartbeat(pull, ctx.links, lease.ttl_s, lease.renewed))
    try:
        lease.watch(pull.cancel)
        return await _read(pull, ctx, begun, lease)
    finally:
        lease.unwatch()
        # Cancelled at once (the lease is ours until EndRead), awaited after PullDone.
        renewing.cancel()
        pull.renewing = renewing


async def _read(
    pull: Pull, ctx: PullContext, begun: pb.BeginReadResponse, lease: LeaseWatch
) -> PullDone:
    """The outcome of a begun read (ended as aborted unless it was read)."""
    link = pull.link
    try:
        check_held(pull.params, begun)
    except KvxferError as exc:
        pull.aborted = True  # the read was begun: end it as aborted to free the lease
        return await _refused(pull, ctx, str(exc))
    # PullDone goes out only after this returns: by then every chunk that failed has
    # severed its agent (adapter.py), so no byte can land in a block reported failed.
    result = None if pull.reading is None else await _ended(pull, ctx)
    stale = begun.registration_version != link.hello.registration_version
    if result is None or stale:
        # Not read yet, or read by the publisher's old registrations: (re)load its
        # metadata and read by the new ones, unless the lease may have lapsed or the pull
        # was cancelled (its engine may be retiring: no agent may register its memory now).
        if lease.lapsed and not pull.aborted:
            pull.aborted = True
            return _all_failed(pull, PullStatus.FAILED, lease.lapse_reason())
        if pull.cancel.is_set():
            pull.aborted = True
            return _all_failed(pull, PullStatus.ABORTED, "aborted during the pull")
        try:
            if stale:
                await ctx.links.reload(link, pull.engine.layout)
            pull.reading = _execute(pull, ctx, await _reader(pull, ctx))
        except KvxferError as exc:  # binding its chunks too: the read is ended, as aborted
            pull.aborted = True
            return _all_failed(pull, PullStatus.FAILED, str(exc))
        result = await _ended(pull, ctx)
    if TransferStatus.DISCONNECTED in result.chunk_statuses:
        ctx.links.invalidate(link)
    pull.result = result
    return _from_result(pull, result, lease)


async def _ended(pull: Pull, ctx: PullContext, *, cancelled: bool = False) -> TransferResult:
    """The pull's read's result, once every chunk it posted has ended (each does by its
    stall deadline); a cancellation, this wait's or `cancelled`, is passed on as
    `outlast` says, with one give-up time for all the pull's waits."""
    reading = pull.reading
    assert reading is not None
    patience_s = ctx.options.stall_deadline_s + 1
    await outlast(
        [reading], pull.give_up, patience_s, cancelled=cancelled, what="a cancelled pull's read"
    )
    return reading.result()


def _observe_phases(pull: Pull, metrics: Metrics, peer: str) -> None:
    """The phases the pull went through (a pull refused before its slot has none)."""
    phases = metrics.pull_phase_duration
    if pull.slotted is not None:
        phases.labels(peer, "queued").observe(pull.slotted - pull.started)
    if pull.begin_read_s is not None:
        phases.labels(peer, "begin_read").observe(pull.begin_read_s)
    if pull.result is not None:
        phases.labels(peer, "read").observe(pull.result.duration_s)


def _observe_read(result: TransferResult, done: PullDone, metrics: Metrics, peer: str) -> None:
    metrics.post_duration.labels(peer).observe(result.bind_s)
    metrics.descriptors.labels(peer).inc(result.descriptors)
    metrics.transfer_descriptors.labels(peer).observe(result.descriptors)
    metrics.transfer_bytes.labels(peer).observe(done.bytes_moved)
    for status in result.chunk_statuses:
        metrics.chunks.labels(peer, status.value).inc()


async def _reader(pull: Pull, ctx: PullContext) -> Reader:
    """The reading agent from the link's peer into the pull's engine."""
    link, engine = pull.link, pull.engine
    try:
        return await ctx.readers.get(
            link.address, engine.engine_id, link.hello.agent_metadata, engine.buffers
        )
    except KvxferError as exc:
        raise DataPlaneError(f"no NIXL agent to read with: {exc}") from exc


def _execute(
    pull: Pull, ctx: PullContext, reader: Reader, posted: asyncio.Future[None] | None = None
) -> asyncio.Task[TransferResult]:
    """The read of the pull's plan, its chunks bound and handed on before this returns;
    `reader` is the pull's until the read has ended."""
    try:
        reading = execute_plan(
            pull.plan,
            backend=reader.backend,
            peer=reader.peer,
            local=pull.engine.bound,
            remote=pull.link.hello.buffers,
            block_size=pull.engine.layout.block_size,
            options=ctx.options,
            cancel=pull.cancel,
            posted=posted,
        )
    except BaseException:
        ctx.readers.done(reader)
        raise
    reading.add_done_callback(lambda _: ctx.readers.done(reader))
    return reading


async def _refused(pull: Pull, ctx: PullContext, reason: str) -> PullDone:
    """Every block failed, reported once the read begun beside BeginRead has ended."""
    pull.cancel.set()  # chunks not yet posted are not posted
    if pull.reading is not None:
        with contextlib.suppress(Exception):
            await _ended(pull, ctx)
    return _all_failed(pull, PullStatus.FAILED, reason)


def check_held(params: TransferParams, begun: pb.BeginReadResponse | pb.BeginWriteResponse) -> None:
    """The router's params must match what the peer holds, id for id (what it published
    for a pull, what its engine announced for a push)."""
    what = "published" if isinstance(begun, pb.BeginReadResponse) else "announced"
    spans = spans_from_proto(begun.spans, f"{what}.spans")
    if begun.num_tokens != params.num_tokens or spans != params.spans:
        raise InvalidInputError(
            "params",
            f"num_tokens or spans differ from what {params.peer_address} {what} for "
            f"{params.request_id!r} ({what} num_tokens={begun.num_tokens})",
        )


class Renewed(Protocol):
    """What a heartbeat loop keeps alive: a pull's read or a push's write."""

    link: PeerLink
    cancel: asyncio.Event
    aborted: bool
    lease_lost: bool

    @property
    def request_id(self) -> str: ...


async def heartbeat(
    transfer: Renewed,
    links: PeerLinks,
    ttl_s: float,
    renewed: Callable[[float], None] | None = None,
) -> None:
    """Renew the peer's lease every TTL/3 until cancelled; a lease the peer aborted or
    no longer holds cancels the transfer. `renewed` hears when each heartbeat the peer
    answered holding the lease was sent. A failed one is tried again at the next beat:
    what a lease that lapses meanwhile means is the caller's to watch (LeaseWatch)."""
    interval = max(ttl_s / 3, 0.05)
    while True:
        await asyncio.sleep(interval)
        sent = time.monotonic()
        try:
            state = await links.heartbeat(transfer.link, transfer.request_id)
        except KvxferError as exc:
            log.warning("heartbeat for %s failed: %s", transfer.request_id, exc)
            continue
        if renewed is not None and state in (pb.LEASE_STATE_HELD, pb.LEASE_STATE_ABORTED):
            renewed(sent)
        if state == pb.LEASE_STATE_ABORTED:
            transfer.aborted = True
            transfer.cancel.set()
        elif state != pb.LEASE_STATE_HELD:
            # The peer no longer holds the blocks: nothing moved can be trusted.
            transfer.lease_lost = True
            transfer.cancel.set()
            return


async def all_finished(events: Sequence[asyncio.Event], timeout_s: float) -> bool:
    """Wait until every event is set; False when `timeout_s` passed first."""
    if not events:
        return True
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        _, late = await asyncio.wait(waits, timeout=timeout_s)
        return not late
    finally:
        for wait in waits:
            wait.cancel()


async def stop_heartbeat(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _end_read(pull: Pull, ctx: PullContext, done: PullDone, *, cancelled: bool) -> None:
    """Tell the publisher the begun read ended (consumed or aborted): patiently, or, when
    the pull was cancelled, in one try of at most CANCELLED_END_READ_S."""
    if pull.lease_lost:
        return
    if pull.reading is not None and not pull.reading.done():
        # Its read was given up on (a cancelled pull's: `_ended`) with a chunk that may
        # still be posted: ending the read would let the publisher's engine reuse the
        # blocks under it. The lease expires there on its TTL instead.
        return
    reason = pb.RELEASE_REASON_ABORTED if pull.aborted else pb.RELEASE_REASON_CONSUMED
    request = pb.EndReadRequest(
        epoch=pull.link.epoch,
        tp_rank=pull.link.tp_rank,
        request_id=pull.request_id,
        reason=reason,
        bytes_read=done.bytes_moved,
    )
    what = f"ending read of {pull.request_id} at {pull.link.address}"
    if not cancelled:
        await end_patiently(
            lambda: ctx.links.end_read(pull.link, request), what, ctx.end_read_patience_s
        )
        return
    try:
        async with asyncio.timeout(CANCELLED_END_READ_S):
            await end_patiently(lambda: ctx.links.end_read(pull.link, request), what, 0.0)
    except TimeoutError:
        log.warning(
            "%s: no answer within %g s; the lease expires there", what, CANCELLED_END_READ_S
        )


async def end_patiently(call: Callable[[], Awaitable[T]], what: str, patience_s: float) -> T | None:
    """Retry `call` while the peer cannot be reached or runs too many of our calls at
    once (BusyError, its `limits.max_calls_per_peer`): a stalled or frozen peer answers later, and
    its lease clock stops while it is frozen (LiveClock), so without the retry it would
    report the finished transfer as expired. Only a definite answer, or `patience_s`,
    ends this (None: no answer)."""
    give_up = time.monotonic() + patience_s
    pause = 0.25
    while True:
        try:
            return await call()
        except TRY_AGAIN as exc:
            if time.monotonic() + pause > give_up:
                log.warning("%s: %s", what, exc)
                return None  # its lease expires there on its own
            log.info("%s: %s; retrying in %.2f s", what, exc, pause)
        except KvxferError as exc:  # a definite answer: the lease is gone or refused
            log.warning("%s: %s", what, exc)
            return None
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


def _from_result(pull: Pull, result: TransferResult, lease: LeaseWatch) -> PullDone:
    if pull.lease_lost:
        return _all_failed(pull, PullStatus.FAILED, "the publisher's lease ended during the read")
    aborted = "aborted during the pull" if pull.aborted else None
    statuses = lease.confirmed(result)
    if statuses == result.chunk_statuses:
        return outcome(result, pull.request_id, pull.started, aborted)
    # Read past the point the lease may have lapsed: only what ended before it stands.
    block_size = pull.engine.layout.block_size
    trusted = summarize(pull.plan, statuses, block_size, time.perf_counter())
    done = outcome(trusted, pull.request_id, pull.started, aborted)
    return done if aborted else dataclasses.replace(done, reason=lease.lapse_reason())


def outcome(
    result: TransferResult,
    request_id: str,
    started: float,
    aborted: str | None,
    kind: type[PullDone] = PullDone,
) -> PullDone:
    """What the engine hears of an executed plan (PullDone, or Pushed for a push):
    aborted with `aborted` as the reason when it was, else the chunks' verdict."""
    status, reason = PullStatus(result.status.value), ""
    if aborted is not None:
        status, reason = PullStatus.ABORTED, aborted
    elif result.failed_blocks:
        reasons = sorted({s.value for s in result.chunk_statuses if s is not TransferStatus.DONE})
        reason = "chunks " + ", ".join(reasons)
    return kind(
        request_id=request_id,
        status=status,
        failed_blocks=result.failed_blocks,
        valid_tokens=result.valid_tokens,
        bytes_moved=result.bytes_moved,
        duration_s=time.monotonic() - started,
        reason=reason,
    )


def _all_failed(pull: Pull, status: PullStatus, reason: str) -> PullDone:
    return all_failed(
        pull.plan, pull.engine.layout.block_size, pull.request_id, pull.started, status, reason
    )


def all_failed(
    plan: TransferPlan,
    block_size: int,
    request_id: str,
    started: float,
    status: PullStatus,
    reason: str,
    kind: type[PullDone] = PullDone,
) -> PullDone:
    """Every planned block failed: nothing moved (valid_tokens from the recompute rule,
    in the destination's blocks, of which `block_size` is the layout's)."""
    failed: Mapping[int, tuple[int, ...]] = {
        g.group.group_id: tuple(g.blocks) for g in plan.groups if g.blocks
    }
    resume = valid_tokens(
        [g.group for g in plan.groups], plan.num_tokens, plan.computed_tokens, block_size, failed
    )
    return kind(
        request_id=request_id,
        status=status if failed or status is PullStatus.ABORTED else PullStatus.FAILED,
        failed_blocks=failed,
        valid_tokens=resume,
        bytes_moved=0,
        duration_s=time.monotonic() - started,
        reason=reason,
    )


def observe(
    plan: TransferPlan, done: PullDone, metrics: Metrics, peer: str, direction: str
) -> None:
    """A finished transfer's metrics; `direction` is read (pull) or write (push)."""
    moved_by_kind: dict[str, int] = {}
    failed = {g: set(b) for g, b in done.failed_blocks.items()}
    kinds = {g.group.group_id: g.group.kind.value for g in plan.groups}
    for chunk in plan.chunks:  # a chunk arrives or fails whole (one NIXL handle)
        if not failed.get(chunk.group_id, set()) & set(chunk.blocks):
            kind = kinds[chunk.group_id]
            moved_by_kind[kind] = moved_by_kind.get(kind, 0) + chunk.nbytes
    for group_plan in plan.groups:
        group = group_plan.group
        if group.group_id in failed:
            metrics.failed_blocks.labels(peer, group.kind.value).inc(len(failed[group.group_id]))
    for kind, nbytes in moved_by_kind.items():
        metrics.bytes_moved.labels(peer, kind, direction).inc(nbytes)
    metrics.requests.labels(peer, done.status.value).inc()
    metrics.transfer_duration.labels(peer, done.status.value).observe(done.duration_s)
    if done.valid_tokens < plan.num_tokens:
        metrics.truncations.labels(peer).inc()
