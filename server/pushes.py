"""The prefill side of a push: WRITE one request into blocks a decode engine announced.

`Pushes.push` is the Push RPC. Its first call for a request links with the
decode sidecar (the same handshake as a pull; the peer must list push among
the modes it accepts), binds the peer's destination lease to this sidecar
(BeginWrite: the decode side is authoritative for the blocks, the params must
match them), plans the request with the same planner as a pull (source: our
engine, destination: the peer's, blocks and failures the destination's) and
starts `_run`. Later calls only raise `tokens_ready` or set `final`: a chunk is
posted as soon as every token its destination blocks hold is ready, state
groups only at `final`, so the transfer overlaps the prefill.

Chunks are WRITEs through an initiating agent of our own per (peer, engine)
(the `Readers` pool of the pull side: the same agent shape, local engine
buffers registered, the peer's serving agent loaded); a failed chunk severs it
before anything is reported (adapter.py). Once every chunk has ended, our
engine hears `Pushed` (its blocks are no longer read) and the peer EndWrite
(its failed blocks, in its own blocks, and the recompute rule's valid_tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxfer._exceptions import InvalidInputError, KvxferError, NotFoundError, PlanError
from kvxfer.core.layout import BlockSpan, EngineLayout, GroupKind
from kvxfer.core.planner import Chunk, TransferPlan, plan_transfer
from kvxfer.core.requests import (
    AbortState,
    EngineEvent,
    PullStatus,
    PushAccepted,
    Pushed,
    TransferMode,
    TransferParams,
)
from kvxfer.dataplane.adapter import TransferStatus
from kvxfer.dataplane.executor import ChunkPoster, ExecOptions, in_plan_order, summarize
from kvxfer.dataplane.readers import Reader, Readers
from kvxfer.server.destinations import check_push_accepted
from kvxfer.server.engines import Engine
from kvxfer.server.metrics import Metrics
from kvxfer.server.peers import PeerLink, PeerLinks
from kvxfer.server.pulls import (
    GiveUp,
    all_failed,
    all_finished,
    check_held,
    end_patiently,
    heartbeat,
    observe,
    outcome,
    outlast,
    stop_heartbeat,
)
from kvxfer.server.settings import Settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.sidecar import failed_to_proto

log = logging.getLogger(__name__)


@dataclass
class Push:
    engine: Engine
    params: TransferParams
    link: PeerLink
    plan: TransferPlan
    ttl_s: float
    local_spans: tuple[BlockSpan, ...] = ()  # the engine's blocks the plan reads
    ready: int = 0  # tokens [0, ready) are computed
    final: bool = False
    started: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    lease_lost: bool = False
    posted: int = 0
    task: asyncio.Task[None] | None = None
    # False once a chunk posted by the agent this push wrote with ended without
    # completing, or a chunk's end went unheard: its bytes may still reach the decode
    # side (EndWrite says so).
    settled: bool = True
    why: str = ""  # why it was stopped
    # Set once its Pushed is out: every chunk it posted has ended, also when its task was
    # cancelled or raised (`_drain`; only chunk tasks cancelled themselves, as at event
    # loop teardown, go unheard, and retiring destroys the engine's agents before it
    # unmaps). What its task does after, EndWrite, uses no engine memory.
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def request_id(self) -> str:
        return self.params.request_id

    def update(self, tokens_ready: int, final: bool) -> None:
        if tokens_ready < self.ready:
            raise InvalidInputError(
                "tokens_ready",
                f"{tokens_ready} is below the {self.ready} an earlier call said were ready",
            )
        self.ready, self.final = tokens_ready, self.final or final
        self.changed.set()

    def stop(self, why: str = "aborted during the push") -> None:
        self.aborted, self.why = True, why
        self.cancel.set()
        self.changed.set()


def chunk_ready(chunk: Chunk, dst: EngineLayout, num_tokens: int, ready: int, final: bool) -> bool:
    """A chunk may go once every token its destination blocks hold is computed (tokens
    [0, ready) are); a state group (the state after the last token) only when the
    prefill is final."""
    if final or ready >= num_tokens:
        return True
    group = dst.group(chunk.group_id)
    if group.kind is GroupKind.MAMBA or not chunk.blocks:
        return False
    size = dst.block_size_of(group)
    return min(chunk.blocks[-1] * size + size, num_tokens) <= ready


def _plan(
    src: EngineLayout,
    dst: EngineLayout,
    local_spans: tuple[BlockSpan, ...],
    params: TransferParams,
    computed_tokens: int,
    chunk_blocks: int,
) -> TransferPlan:
    """The pull's plan, with its span errors named as the Push call's fields."""
    try:
        return plan_transfer(
            src, dst, local_spans, params.spans, params.num_tokens, computed_tokens, chunk_blocks
        )
    except PlanError as exc:
        field = exc.field.replace("src_spans", "local_spans").replace("dst_spans", "params.spans")
        raise PlanError(field, exc.detail) from exc


@dataclass
class _Starting:
    """A push being started: its params, the readiness its calls so far said, and
    whether its engine aborted it meanwhile (answered PUSHING: it stops once recorded)."""

    params: TransferParams
    local_spans: tuple[BlockSpan, ...]
    ready: int = 0
    final: bool = False
    aborted: bool = False
    task: asyncio.Future[Push] | None = None


def _check_same(
    held: TransferParams,
    spans: tuple[BlockSpan, ...],
    params: TransferParams,
    local_spans: tuple[BlockSpan, ...],
) -> None:
    """A later call for a push must name what its first did: the push reads the blocks
    its first call named, and would silently ignore others."""
    if held != params:
        raise InvalidInputError(
            "params", f"differ from the params {params.request_id!r} is being pushed with"
        )
    if spans != local_spans:
        raise InvalidInputError(
            "local_spans", f"differ from the blocks {params.request_id!r} is being pushed from"
        )


def _retrieved(task: asyncio.Future[Push]) -> None:
    """A start whose caller went away: its error was ended at the peer already."""
    if not task.cancelled() and task.exception() is not None:
        log.info("push start ended after its caller left: %s", task.exception())


async def _first(*events: asyncio.Event, timeout_s: float | None = None) -> bool:
    """Wait for the first of `events`; False when `timeout_s` passed first."""
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for wait in waits:
            wait.cancel()


async def _drain(push: Push, poster: ChunkPoster, patience_s: float, cancelled: bool) -> None:
    """Posting or waiting raised, or the push was cancelled: chunks it posted before may
    still be writing from our engine's blocks into the peer's. Nothing may be reported
    until each has ended (its stall deadline ends it); the ones not yet handed to NIXL
    end CANCELLED, unposted. A cancellation (`cancelled`: the caller's) is passed on
    only after that, or `patience_s` after it came (only a NIXL thread stuck in a call
    ends no chunk by then, and the sidecar's exit must not wait for that: the push is
    then not settled, and the decode side revokes our access before it reports)."""
    push.cancel.set()
    what = "a cancelled push's chunks"
    await outlast(poster.handed(), GiveUp(), patience_s, cancelled=cancelled, what=what)


class Pushes:
    """The pushes this sidecar's engines are making, by (engine id, request id)."""

    def __init__(
        self,
        *,
        settings: Settings,
        links: PeerLinks,
        writers: Readers,
        metrics: Metrics,
        writer_id: str,
        emit: Callable[[str, EngineEvent], None],
    ) -> None:
        self._settings = settings
        self._links = links
        self._writers = writers
        self._metrics = metrics
        self._writer_id = writer_id
        self._emit = emit
        self._pushes: dict[tuple[str, str], Push] = {}
        # Pushes being started (linking, BeginWrite): a call for one meanwhile (the engine
        # sent its next readiness, or retried after a deadline) waits for that start, and
        # what the calls said so far is applied as the push is recorded (`_Starting`).
        self._starting: dict[tuple[str, str], _Starting] = {}
        self._options = ExecOptions(
            stall_deadline_s=settings.transfer.stall_deadline_s,
            max_inflight=settings.transfer.max_inflight_chunks,
            handle_blocks=settings.transfer.chunk_blocks,
        )

    def __len__(self) -> int:
        return len(self._pushes)

    def all(self) -> list[Push]:
        return list(self._pushes.values())

    async def push(
        self,
        engine: Engine,
        params: TransferParams,
        local_spans: tuple[BlockSpan, ...],
        tokens_ready: int,
        final: bool,
    ) -> PushAccepted:
        if tokens_ready > params.num_tokens:
            raise InvalidInputError(
                "tokens_ready", f"{tokens_ready} exceeds params.num_tokens {params.num_tokens}"
            )
        key = (engine.engine_id, params.request_id)
        push = self._pushes.get(key)
        if push is None:
            starting = self._starting.get(key)
            if starting is None:
                starting = _Starting(params, local_spans)
                # Shielded: an engine's deadline cancelling this call must not cut the start
                # between BeginWrite and the push that ends the write (the push then runs
                # on, and ends by itself a lease TTL after the engine's last call).
                starting.task = asyncio.ensure_future(
                    self._start(engine, params, local_spans, starting)
                )
                starting.task.add_done_callback(_retrieved)
                starting.task.add_done_callback(lambda _: self._starting.pop(key, None))
                self._starting[key] = starting
            else:
                _check_same(starting.params, starting.local_spans, params, local_spans)
            # Calls during the start have no order among themselves: the readiest counts.
            starting.ready = max(starting.ready, tokens_ready)
            starting.final = starting.final or final
            assert starting.task is not None
            push = await asyncio.shield(starting.task)
        else:
            _check_same(push.params, push.local_spans, params, local_spans)
            push.update(tokens_ready, final)
        await asyncio.sleep(0)  # let the run post what became ready: the reply counts it
        return PushAccepted(
            bytes_planned=push.plan.nbytes, chunks=len(push.plan.chunks), chunks_posted=push.posted
        )

    async def _start(
        self,
        engine: Engine,
        params: TransferParams,
        local_spans: tuple[BlockSpan, ...],
        starting: _Starting,
    ) -> Push:
        """Link, BeginWrite and plan, then run the push in its own task; the peer's address
        is claimed until that task ends (its EndWrite too), or until the start fails."""
        use = self._links.use(params.peer_address)
        try:
            push = await self._begin(engine, params, local_spans, starting)
        except BaseException:
            use.release()
            raise
        assert push.task is not None
        push.task.add_done_callback(lambda _: use.release())  # even if it never ran
        return push

    async def _begin(
        self,
        engine: Engine,
        params: TransferParams,
        local_spans: tuple[BlockSpan, ...],
        starting: _Starting,
    ) -> Push:
        if params.mode is not TransferMode.PUSH:
            raise InvalidInputError(
                "params.mode", "pull params go to the decode engine's Pull, not to Push"
            )
        check_push_accepted(self._settings, "params.mode")
        link, _ = await self._links.link(
            params.peer_address,
            engine.engine_id,
            engine.layout,
            params.epoch,
            params.engine_id,
            params.tp_rank,
            push=True,
        )
        if TransferMode.PUSH not in link.hello.modes:
            modes = ",".join(sorted(m.value for m in link.hello.modes))
            raise InvalidInputError(
                "params.mode",
                f"peer {params.peer_address} does not accept pushes (its transfer.modes is "
                f"{modes}): have the decode engine pull",
            )
        if link.epoch != params.epoch:
            raise NotFoundError(
                f"the decode sidecar restarted: params are from epoch {params.epoch}, "
                f"peer {params.peer_address} is now epoch {link.epoch}; the request it "
                "expected is gone"
            )
        begun = await self._links.begin_write(link, params.request_id, self._writer_id)
        try:
            check_held(params, begun)
            if begun.registration_version != link.hello.registration_version:
                await self._links.reload(link, engine.layout)
            plan = _plan(engine.layout, link.layout, local_spans, params, begun.computed_tokens,
                         self._settings.transfer.chunk_blocks)  # fmt: skip
            engine.check_live()  # it may have begun retiring during the awaits above
        except BaseException as exc:  # the decode engine hears why its blocks are free
            await self._end_write(link, params.request_id, aborted=True, detail=str(exc))
            raise
        push = Push(engine, params, link, plan, begun.lease_ttl_ms / 1000, local_spans)
        # What the calls so far said, before a later call can find the push and say more,
        # and an abort among them before its run can post anything: it ends as aborted.
        push.update(starting.ready, starting.final)
        if starting.aborted:
            push.stop()
        key = (engine.engine_id, params.request_id)
        self._pushes[key] = push
        push.task = asyncio.create_task(self._finish(key, push))
        return push

    async def _finish(self, key: tuple[str, str], push: Push) -> None:
        peer = self._links.label(push.params.peer_address)
        self._metrics.active.start()
        try:
            done = await self._transfer(push, peer)
        except asyncio.CancelledError:
            done = self._all_failed(push, PullStatus.ABORTED, "the sidecar shut down")
        except Exception as exc:  # a bug must still end in Pushed, never a silent hang
            log.exception("push %s failed unexpectedly", push.request_id)
            done = self._all_failed(push, PullStatus.FAILED, f"internal error: {exc}")
        finally:
            self._metrics.active.stop()
            if self._pushes.get(key) is push:
                del self._pushes[key]
            push.finished.set()
        # Every chunk has ended (failed ones severed their agent; on the exceptional paths
        # too: `_drain`): our blocks are free.
        self._emit(push.engine.engine_id, done)
        observe(push.plan, done, self._metrics, peer, "write")
        if not push.lease_lost:
            await self._end_write(
                push.link, push.request_id, aborted=push.aborted, done=done, settled=push.settled
            )

    async def _transfer(self, push: Push, peer: str) -> Pushed:
        try:
            writer = await self._writers.get(
                push.link.address,
                push.engine.engine_id,
                push.link.hello.agent_metadata,
                push.engine.buffers,
            )
        except KvxferError as exc:
            return self._all_failed(push, PullStatus.FAILED, f"no NIXL agent to write with: {exc}")
        try:
            return await self._write(push, peer, writer)
        finally:
            self._writers.done(writer)

    async def _write(self, push: Push, peer: str, writer: Reader) -> Pushed:
        poster = ChunkPoster(
            writer.backend,
            writer.peer,
            push.engine.bound,
            push.link.hello.buffers,
            self._options,
            cancel=push.cancel,
            write=True,
        )
        start = time.perf_counter()
        renewing = asyncio.create_task(heartbeat(push, self._links, push.ttl_s))
        try:
            await self._post_as_ready(push, poster)
            # Shielded: cancelling this push must not cancel the chunks' own tasks, whose
            # ends `_drain` waits for.
            statuses = await asyncio.shield(poster.wait())
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            await _drain(push, poster, self._options.stall_deadline_s + 1, cancelled)
            raise
        finally:
            await stop_heartbeat(renewing)
            # Settled only when every chunk it posted is known to have ended, complete: the
            # decode side revokes our access otherwise, before its engine hears the end.
            push.settled = poster.all_ended() and not writer.backend.abandoned
        result = summarize(
            push.plan,
            in_plan_order(push.plan, statuses),
            push.link.layout.block_size,
            start,
            poster.bind_s,
            poster.descriptors,
        )
        if TransferStatus.DISCONNECTED in result.chunk_statuses:
            self._links.invalidate(push.link)
        self._metrics.descriptors.labels(peer).inc(result.descriptors)
        for chunk_status in result.chunk_statuses:
            self._metrics.chunks.labels(peer, chunk_status.value).inc()
        if push.lease_lost:
            return self._all_failed(push, PullStatus.FAILED, "the decode side's lease ended")
        done = outcome(result, push.request_id, push.started, push.why if push.aborted else None,
                       Pushed)  # fmt: skip
        assert isinstance(done, Pushed)
        return done

    async def _post_as_ready(self, push: Push, poster: ChunkPoster) -> None:
        """Post chunks as their tokens become ready, until all are posted and the engine
        said `final` (so a later call never finds the push gone), or until cancelled."""
        dst = push.link.layout
        while not push.cancel.is_set():
            push.changed.clear()
            n, r, final = push.plan.num_tokens, push.ready, push.final
            ready = [
                c
                for c in push.plan.chunks
                if not poster.posted(c) and chunk_ready(c, dst, n, r, final)
            ]
            if ready:
                poster.post(ready)
                push.posted += len(ready)
            if push.posted == len(push.plan.chunks) and push.final:
                return
            # The heartbeat cancels on its own. An engine that stops calling holds the
            # decode engine's blocks: after a lease TTL without a call, the push ends.
            if not await _first(push.changed, push.cancel, timeout_s=push.ttl_s):
                push.stop(
                    f"the prefill engine made no Push call for {push.ttl_s:g} s (the "
                    "decode side's lease TTL) before final: its blocks are given back"
                )

    def _all_failed(self, push: Push, status: PullStatus, reason: str) -> Pushed:
        done = all_failed(
            push.plan,
            push.link.layout.block_size,
            push.request_id,
            push.started,
            status,
            reason,
            Pushed,
        )
        assert isinstance(done, Pushed)
        return done

    async def _end_write(
        self,
        link: PeerLink,
        request_id: str,
        *,
        aborted: bool,
        done: Pushed | None = None,
        detail: str = "",
        settled: bool = True,
    ) -> None:
        request = pb.EndWriteRequest(
            epoch=link.epoch,
            tp_rank=link.tp_rank,
            request_id=request_id,
            reason=pb.RELEASE_REASON_ABORTED if aborted else pb.RELEASE_REASON_CONSUMED,
            settled=settled,
        )
        if done is not None:
            request.failed_blocks.extend(failed_to_proto(done.failed_blocks))
            request.bytes_written = done.bytes_moved
            request.valid_tokens = done.valid_tokens
            request.detail = done.reason
        else:  # ended before any chunk: the decode side hears nothing moved
            request.valid_tokens = 0
            request.detail = f"the writer could not start: {detail}"[:1024]
        await end_patiently(
            lambda: self._links.end_write(link, request),
            f"ending write of {request_id} at {link.address}",
            self._settings.transfer.end_read_patience_s,
        )

    def running(self, engine_id: str, request_id: str) -> bool:
        return (engine_id, request_id) in self._pushes

    def abort(self, engine_id: str, request_id: str) -> AbortState | None:
        """PUSHING for a push running or still starting (linking, BeginWrite: it would
        otherwise start after the abort was answered, and read the engine's blocks after
        the engine was told nothing was): it stops, and Pushed says how it ended. A start
        that fails ends with the Push call's error instead."""
        key = (engine_id, request_id)
        push = self._pushes.get(key)
        if push is not None:
            push.stop()
            return AbortState.PUSHING
        starting = self._starting.get(key)
        if starting is not None:
            starting.aborted = True
            return AbortState.PUSHING
        return None

    async def cancel_engine(self, engine_id: str, timeout_s: float) -> int:
        """Abort the engine's pushes and wait until none can read its memory (their
        Pushed is out; an EndWrite to a silent peer may run on); -1 when one would not."""
        pushes = [push for (owner, _), push in list(self._pushes.items()) if owner == engine_id]
        for push in pushes:
            push.stop()
        if not await all_finished([push.finished for push in pushes], timeout_s):
            return -1
        return len(pushes)

    async def shutdown(self, grace_s: float) -> None:
        pending = [p.task for p in self._pushes.values() if p.task is not None]
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=grace_s)
        for push in list(self._pushes.values()):
            push.stop()
        if late:
            with contextlib.suppress(Exception):
                await asyncio.wait(late, timeout=self._settings.transfer.stall_deadline_s + 1)
