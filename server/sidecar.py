"""The sidecar's state and operations, free of gRPC: servicers only decode and call.

One `Sidecar` per process owns the registered engines, the lease table
(serving side), the pulls in flight (reading side), the peer links and the
NIXL backend. Engine-facing operations (register, publish, pull, abort,
watch, unregister) are plain async methods raising kvxfer errors; the
peer-facing ones are in `read_side.py` (hello, begin/heartbeat/end read) and
`push_side.py` (Expect, Push, begin/end write).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Sequence

from kvxfer._exceptions import (
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
    ShuttingDownError,
    shown,
)
from kvxfer.core.buffers import BufferHandle
from kvxfer.core.layout import BlockSpan, EngineLayout
from kvxfer.core.planner import full_attention_bytes, plan_transfer
from kvxfer.core.requests import (
    MAX_EPOCH,
    AbortState,
    EngineEvent,
    LeaseExpired,
    Publication,
    PullAccepted,
    PullDone,
    Released,
    ReleaseReason,
    TransferMode,
    TransferParams,
    check_request_id,
)
from kvxfer.dataplane.executor import ExecOptions
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer, unlink_segment
from kvxfer.dataplane.readers import Readers
from kvxfer.dataplane.serving import ServingBackend
from kvxfer.server.admission import Admission, PullGate
from kvxfer.server.callers import Caller, ProcessWatch, identify_caller
from kvxfer.server.engines import (
    Engine,
    EventQueue,
    check_regions_fit,
    check_span_ids_once,
    check_spans_cover,
)
from kvxfer.server.holds import Holds
from kvxfer.server.leases import Lease, LeaseTable, LiveClock
from kvxfer.server.metrics import Metrics
from kvxfer.server.peers import Dialer, PeerLinks
from kvxfer.server.pulls import Pull, PullContext, all_finished, run_pull
from kvxfer.server.push_side import PushSide
from kvxfer.server.read_side import ReadSide
from kvxfer.server.settings import Settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.loops import within

log = logging.getLogger(__name__)


class Sidecar:
    def __init__(
        self, settings: Settings, backend: ServingBackend, metrics: Metrics, readers: Readers
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.epoch = secrets.randbelow(MAX_EPOCH) + 1
        self.sidecar_id = settings.sidecar_id or f"{socket.gethostname()}-{os.getpid()}"
        self.address = settings.advertise_address or settings.peer_address
        self.lane_port = 0  # the peer lane's port once it listens (server/peer_lane.py)
        self.started = time.monotonic()
        self.registration_version = 0
        # Serves peers' reads of our engines' memory (never reads itself), from a child
        # process that is replaced if UCX aborts it (dataplane/serving.py).
        self._backend = backend
        backend.on_replaced(self._serving_agent_replaced)
        self._readers = readers  # read into our engines' memory: agents per peer and engine
        self._engines: dict[str, Engine] = {}
        self._registering: set[int] = set()  # tp ranks whose registration is under way
        self._clock = LiveClock()
        self._leases = LeaseTable(settings.lease.ttl_s, settings.limits.max_leases, self._clock)
        self._pulls: dict[tuple[str, str], Pull] = {}
        self._gate = PullGate(
            settings.limits.max_inflight_pulls_per_peer, settings.limits.max_queued_pulls_per_peer
        )
        self._dialer = Dialer(settings, metrics)
        self.links = PeerLinks(
            settings=settings,
            backend=backend,
            metrics=metrics,
            dialer=self._dialer,
            sidecar_id=self.sidecar_id,
            epoch=self.epoch,
        )
        self.holds = Holds(self.links, settings.lease.ttl_s)  # Hold: queued requests' leases
        self._pull_ctx = PullContext(
            readers=readers,
            links=self.links,
            metrics=metrics,
            options=ExecOptions(
                stall_deadline_s=settings.transfer.stall_deadline_s,
                max_inflight=settings.transfer.max_inflight_chunks,
                handle_blocks=settings.transfer.chunk_blocks,
            ),
            reader_id=self.sidecar_id,
            end_read_patience_s=settings.transfer.end_read_patience_s,
        )
        self.read_side = ReadSide(self)  # Handshake, BeginRead, Heartbeat, EndRead
        self.push_side = PushSide(self)  # Expect, Push, BeginWrite, EndWrite
        self.pushes, self.destinations = self.push_side.pushes, self.push_side.destinations
        self._draining = False
        self._sweeper: asyncio.Task[None] | None = None
        self._idler: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep())
        self._idler = asyncio.create_task(self._close_idle_agents())
        self._readers.start()  # a reading agent ahead of the first pull (readers.py)

    async def _close_idle_agents(self) -> None:
        """Close the reading and writing agents unused for transfer.idle_agent_s, and forget
        the peer addresses no transfer used that long (PeerLinks.forget_idle), looking a
        quarter of that apart (at most a minute): apart from the lease sweep, which a
        closing agent's thread join must not hold up."""
        idle_s = self.settings.transfer.idle_agent_s
        every = min(idle_s / 4, 60.0)
        while True:
            await asyncio.sleep(every)
            try:
                await self._readers.close_idle()
            except Exception:  # a bug must not stop the next rounds
                log.exception("closing idle NIXL agents failed")
            try:
                await self.links.forget_idle(idle_s)
            except Exception:
                log.exception("forgetting idle peers failed")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease.sweep_s)
            self._clock.tick(self.settings.lease.sweep_s)
            try:
                await self._expire_leases()
            except Exception:  # a bug must not stop the next sweeps (leases would never end)
                log.exception("sweeping expired leases failed")
            self._lease_gauges()

    async def _expire_leases(self) -> None:
        """End the leases whose TTL passed: a published one is reported expired; one
        sweep's destination leases go to `Destinations.expired_all` together."""
        pushed: list[Lease] = []
        for lease in self._leases.expire():
            if lease.push:  # handed over together: one kill fences every silent writer
                pushed.append(lease)
                continue
            try:  # one report's bug must not lose the rest of the sweep
                log.info("lease of %s expired unconsumed", lease.request_id)
                self.metrics.expired_leases.inc()
                self._emit(
                    lease.engine_id,
                    LeaseExpired(lease.request_id, time.monotonic() - lease.created),
                )
                self._lease_ended(lease.engine_id)
            except Exception:
                log.exception("reporting the expiry of %s failed", lease.request_id)
        await self.destinations.expired_all(pushed)

    async def shutdown(self, grace_s: float) -> None:
        """Take no new work; within `grace_s`, let our pulls finish and peers finish
        reading what we serve; abort the pulls still running, destroy every NIXL agent,
        and only then release every lease (reported to its engine) and unmap memory."""
        self._draining = True
        end = time.monotonic() + grace_s
        pushes = asyncio.create_task(self.pushes.shutdown(grace_s))
        pending = [p.task for p in self._pulls.values() if p.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for pull in list(self._pulls.values()):
                pull.aborted = True
                pull.cancel.set()
            if late:
                await asyncio.wait(late, timeout=self.settings.transfer.stall_deadline_s + 1)
        await pushes
        await self._drain_reads(end)
        # Memory safety: every agent that could touch our engines' memory (readers write
        # into it, the serving agent reads from it for peers) is destroyed before any of
        # it is unmapped by unregister().
        await self._readers.close()
        await self._backend.close()
        # No agent is left that could touch any engine's memory: a read still open (its
        # reader vanished) is over, so an engine retiring behind it (its process died)
        # needs no more waiting and its memory and shared-memory names go now.
        for engine in self._engines.values():
            if engine.retiring:
                self._leases.drop_engine(engine.engine_id)
                engine.reads_ended.set()
        for engine_id in list(self._engines):
            await self.unregister(engine_id, reads_deadline_s=max(0.0, end - time.monotonic()))
        for task in (self._sweeper, self._idler):
            if task is not None:
                task.cancel()
        await self._dialer.close()

    async def _drain_reads(self, end: float) -> None:
        """Wait until no peer is reading what we serve, or until `end`: releasing a lease
        under a live read would tell our engine to reuse blocks a peer is still reading."""
        while self._leases.reading() and time.monotonic() < end:
            await asyncio.sleep(min(0.02, max(0.0, end - time.monotonic())))
        if self._leases.reading():
            log.warning(
                "shutting down with %d read(s) still in progress: grace period over",
                self._leases.reading(),
            )

    def _serving_agent_replaced(self, reason: str) -> None:
        """Peers must load the new serving agent's metadata before their next read: a new
        registration version makes BeginRead tell them so."""
        self.registration_version += 1
        self.metrics.serving_agent_restarts.inc()
        log.warning("serving agent replaced (%s): readers reload its metadata", reason)

    def _check_open(self) -> None:
        if self._draining:
            raise ShuttingDownError("the sidecar is shutting down and takes no new requests")

    # -- engine side -------------------------------------------------------

    async def register_engine(
        self,
        layout: EngineLayout,
        handles: Sequence[BufferHandle],
        name: str,
        claimed_pid: int | None = None,
    ) -> Engine:
        """Map and register an engine's buffers. Fails whole: a refused call leaves no
        mapping, no NIXL registration and no table entry behind."""
        self._check_open()
        if layout.tp_rank in self._registering:
            raise InvalidInputError(
                "layout.tp_rank", f"another call is registering tp_rank {layout.tp_rank} now"
            )
        self._registering.add(layout.tp_rank)
        try:
            return await self._register(layout, handles, name, claimed_pid)
        finally:
            self._registering.discard(layout.tp_rank)

    async def _register(
        self,
        layout: EngineLayout,
        handles: Sequence[BufferHandle],
        name: str,
        claimed_pid: int | None,
    ) -> Engine:
        self._refuse_live_rank(layout.tp_rank)
        check_regions_fit(layout, list(handles))
        caller = self._identify(claimed_pid)
        await self._free_rank(layout.tp_rank)  # only now: it may retire an engine
        if len(self._engines) >= self.settings.limits.max_engines:
            raise LimitExceededError(
                f"limits.max_engines: {self.settings.limits.max_engines} engines already registered"
            )
        engine_id = f"e-{secrets.token_hex(6)}"
        watch = None
        if caller is not None and caller.pid is not None:
            watch = ProcessWatch(caller.pid, lambda: self._died(engine_id))
        try:
            owner = os.geteuid() if caller is None else caller.uid
            buffers = await self._map_and_register(handles, owner)
        except BaseException:
            if watch is not None:
                watch.close()
            raise
        events = EventQueue(
            self.settings.limits.max_pending_events, self.metrics.events_dropped.inc
        )
        engine = Engine(
            engine_id, name[:128], layout, buffers, events, bind(buffers), caller, watch
        )
        self._engines[engine_id] = engine
        self.registration_version += 1
        self._engine_gauges()
        # The name and model are the engine's words: quoted and cut short (`shown`), so a
        # newline in them cannot forge a log line, nor 5000 characters flood one.
        log.info(
            "registered engine %s (%s, %s, rank %d, %d buffers, process %s)",
            engine_id,
            shown(name),
            shown(layout.model),
            layout.tp_rank,
            len(buffers),
            _describe(caller),
        )
        if watch is not None and watch.exited():
            self._died(engine_id)  # it died while its buffers were being registered
        return engine

    def _refuse_live_rank(self, tp_rank: int) -> None:
        """One engine per TP rank: refuse the rank of an engine whose process is alive."""
        for other in self._engines.values():
            if other.layout.tp_rank != tp_rank or other.retired is not None:
                continue
            if other.watch is not None and other.watch.exited():
                self._died(other.engine_id)  # seen here before the pidfd callback ran
            elif other.watch is not None:
                raise InvalidInputError(
                    "layout.tp_rank",
                    f"an engine with tp_rank {tp_rank} is already registered "
                    f"({other.engine_id}); unregister it first",
                )

    async def _free_rank(self, tp_rank: int) -> None:
        """Wait for the rank's engine to retire: one whose process died, or one whose
        process cannot be watched (TCP, or a pid namespace this sidecar cannot see),
        which this new registration replaces."""
        for other in list(self._engines.values()):
            if other.layout.tp_rank != tp_rank:
                continue
            if other.retired is None:
                self._replace(other)
            assert other.retired is not None
            await asyncio.wait([other.retired], timeout=self.settings.transfer.rpc_timeout_s)
            if not other.retired.done():
                raise InvalidInputError(
                    "layout.tp_rank",
                    f"engine {other.engine_id} of tp_rank {tp_rank} is being retired "
                    f"({other.retiring}) and a peer is still reading its blocks; retry "
                    f"within {self._reads_deadline_s():.0f}s",
                )

    def _replace(self, engine: Engine) -> None:
        reason = "replaced: a new engine registered its tp_rank and its process is unknown"
        log.warning("engine %s %s", engine.engine_id, reason)
        engine.retired = asyncio.create_task(self._retire(engine, reason, None))

    def _identify(self, claimed_pid: int | None) -> Caller | None:
        """The registering process on a unix socket; None over TCP (no credentials)."""
        address = self.settings.engine_address
        if not address.startswith("unix:"):
            return None
        return identify_caller(address.removeprefix("unix:"), claimed_pid)

    async def _map_and_register(
        self, handles: Sequence[BufferHandle], owner_uid: int
    ) -> list[MappedBuffer]:
        mapped: list[MappedBuffer] = []
        registered: list[MappedBuffer] = []
        try:
            for handle in handles:
                mapped.append(open_buffer(handle, owner_uid))
            for buffer in mapped:
                # One at a time, so a refusal leaves a known set to undo (and the undo
                # never deregisters another engine's buffer of the same name).
                await self._backend.register([buffer])
                registered.append(buffer)
        except BaseException:
            # Memory safety: these buffers never reached the engine table, so no peer was
            # given their addresses and no pull planned into them: no NIXL handle can touch
            # them. Deregister first, so NIXL never holds a registration of unmapped memory.
            await self._backend.deregister(registered)
            for buffer in mapped:
                buffer.close()
            raise
        return mapped

    def engine(self, engine_id: str) -> Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            raise NotFoundError(f"engine {shown(engine_id)} is not registered with this sidecar")
        engine.check_live()
        return engine

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    async def publish(
        self, engine_id: str, request_id: str, num_tokens: int, spans: tuple[BlockSpan, ...]
    ) -> TransferParams:
        self._check_open()
        engine = self.engine(engine_id)
        check_request_id(request_id)
        self._check_block_count(spans, "spans")
        check_span_ids_once(engine.layout, spans, "spans")
        check_spans_cover(engine.layout, num_tokens, spans)
        params = TransferParams(
            peer_address=self.address,
            engine_id=engine_id,
            epoch=self.epoch,
            tp_rank=engine.layout.tp_rank,
            request_id=request_id,
            num_tokens=num_tokens,
            spans=spans,
        )
        self._leases.add(engine_id, request_id, num_tokens, spans)
        self._lease_gauges()
        return params

    async def pull(
        self,
        engine_id: str,
        params: TransferParams,
        local_spans: tuple[BlockSpan, ...],
        computed_tokens: int,
    ) -> PullAccepted:
        self._check_open()
        engine = self.engine(engine_id)
        key = (engine_id, params.request_id)
        self._check_not_pulled(key)
        if params.mode is not TransferMode.PULL:
            raise InvalidInputError("params.mode", "push params go to the prefill engine's Push")
        # params.tp_rank is the prefill rank read: rank r with equal TP sizes, one of the
        # decode rank's sources with different ones (negotiation refuses any other).
        self._check_block_count(local_spans, "local_spans")
        self._check_block_count(params.spans, "params.spans")
        admission = self._gate.admit(params.peer_address)
        # Claimed until the pull's task ends (its EndRead too): its link stays linked.
        use = self.links.use(params.peer_address)
        try:
            link, _ = await self.links.link(
                params.peer_address,
                engine_id,
                engine.layout,
                params.epoch,
                params.engine_id,
                params.tp_rank,
            )
            plan = plan_transfer(
                link.layout,
                engine.layout,
                params.spans,
                local_spans,
                params.num_tokens,
                computed_tokens,
                self.settings.transfer.chunk_blocks,
            )
            # Checked again with nothing awaited before the pull is recorded: during the
            # handshake its engine may have begun retiring (the retirement waits only for
            # the pulls it sees), or a second Pull of the request may have been recorded.
            engine.check_live()
            self._check_not_pulled(key)
        except BaseException:
            admission.close()
            use.release()
            raise
        pull = Pull(engine, params, link, plan)
        self._pulls[key] = pull
        pull.task = asyncio.create_task(self._finish_pull(key, pull, admission))
        pull.task.add_done_callback(lambda _: use.release())  # even if it never ran
        try:
            # Its first step runs before this answer is made: with a free slot and a known
            # reader it hands the read to the NIXL thread, and the answer waits for the
            # post (at most POST_WAIT_S), so the copy starts before a lane write competes
            # with building its handle. The engine's connector does not wait for this
            # answer (`SyncEngineClient.pull_soon`); PullDone ends the pull either way.
            await asyncio.sleep(0)
            await pull.posting()
        finally:  # a handler cancelled meanwhile (the caller's deadline): the pull still runs
            full = full_attention_bytes(engine.layout, params.num_tokens, computed_tokens)
            label = self.links.label(params.peer_address)
            self.metrics.full_attention_bytes.labels(label, "read").inc(full)
        return PullAccepted(
            bytes_planned=plan.nbytes,
            full_attention_bytes=full,
            chunks=len(plan.chunks),
            descriptors=sum(c.num_descriptors for c in plan.chunks),
        )

    async def _finish_pull(self, key: tuple[str, str], pull: Pull, admission: Admission) -> None:
        """Wait for a running slot against the peer (queued behind earlier pulls), then
        pull; the slot is held until the read is ended at the peer."""

        def report(done: PullDone) -> None:
            self._forget_pull(key, pull)
            self._emit(pull.engine.engine_id, done)

        try:
            async with admission.slot(pull.leaving):
                pull.slotted = time.monotonic()
                await run_pull(pull, self._pull_ctx, report)
        finally:
            self._forget_pull(key, pull)

    def _check_not_pulled(self, key: tuple[str, str]) -> None:
        if key in self._pulls:
            raise InvalidInputError("params.request_id", f"{key[1]!r} is already being pulled")

    def _forget_pull(self, key: tuple[str, str], pull: Pull) -> None:
        """Once reported, the request may be pulled again (its EndRead still running):
        only this pull's own entry goes, never a later pull's."""
        if self._pulls.get(key) is pull:
            del self._pulls[key]
        pull.finished.set()

    def _check_block_count(self, spans: Sequence[BlockSpan], field: str) -> None:
        total = sum(len(s.block_ids) for s in spans)
        limit = self.settings.limits.max_blocks_per_request
        if total > limit:
            raise LimitExceededError(
                f"{field}: {total} block ids exceed limits.max_blocks_per_request ({limit})"
            )

    async def hold(
        self, engine_id: str, publications: Sequence[Publication]
    ) -> tuple[list[pb.LeaseState.ValueType], float]:
        """Hold: ask each publisher to keep the publications the engine will pull once
        its queue gives them blocks (server/holds.py)."""
        self._check_open()
        engine = self.engine(engine_id)
        limit = self.settings.limits.max_heartbeat_ids
        if len(publications) > limit:
            raise LimitExceededError(
                f"publications: {len(publications)} exceed limits.max_heartbeat_ids ({limit})"
            )
        return await self.holds.hold(engine, publications)

    async def abort(self, engine_id: str, request_id: str) -> AbortState:
        engine = self.engine(engine_id)
        check_request_id(request_id)
        pull = self._pulls.get((engine_id, request_id))
        if pull is not None:
            pull.aborted = True
            pull.cancel.set()
            return AbortState.PULLING
        pushing = self.pushes.abort(engine_id, request_id)
        if pushing is not None:
            return pushing
        if self._leases.get(engine_id, request_id).push:
            state = self.destinations.abort(engine_id, request_id)
            self._lease_gauges()
            return state
        before, released = self._leases.abort(engine.engine_id, request_id)
        if released is not None:
            self._release(released, ReleaseReason.ABORTED, 0)
        self._lease_gauges()
        return AbortState(before.value)

    def watch(self, engine_id: str) -> AsyncIterator[EngineEvent]:
        return self.engine(engine_id).events.watch()

    async def unregister(
        self, engine_id: str, reads_deadline_s: float | None = None
    ) -> tuple[int, int]:
        """Retire an engine: (leases released or aborted, pulls cancelled). Returns once
        its buffers are deregistered; waits for reads of its blocks (at most
        `reads_deadline_s`, default lease TTL + stall deadline). An engine already
        retiring (its process died) is waited for."""
        engine = self._engines.get(engine_id)
        if engine is None:
            raise NotFoundError(f"engine {shown(engine_id)} is not registered with this sidecar")
        if engine.retired is None:
            engine.retired = asyncio.create_task(
                self._retire(engine, "unregistered", reads_deadline_s)
            )
        return await asyncio.shield(engine.retired)

    def _died(self, engine_id: str) -> None:
        """The engine's process exited: retire it in the background (pidfd callback)."""
        engine = self._engines.get(engine_id)
        if engine is None or engine.retired is not None:
            return
        reason = f"process {_describe(engine.caller)} exited"
        log.warning("engine %s: %s; retiring it", engine_id, reason)
        self.metrics.engine_exits.inc()
        engine.retired = asyncio.create_task(self._retire(engine, reason, None, orphaned=True))

    async def _retire(
        self, engine: Engine, reason: str, reads_deadline_s: float | None, orphaned: bool = False
    ) -> tuple[int, int]:
        """Take the engine out: its pulls, leases and reads end, then its memory goes.
        `orphaned`: its process died, so its shared-memory names are unlinked here too."""
        engine.retiring = reason
        if engine.watch is not None:
            engine.watch.close()
        cancelled = await self._cancel_pulls(engine)
        pushes = await self.pushes.cancel_engine(engine.engine_id, self._reads_deadline_s())
        cancelled = -1 if min(cancelled, pushes) < 0 else cancelled + pushes
        released = self._end_leases(engine)
        deadline = self._reads_deadline_s() if reads_deadline_s is None else reads_deadline_s
        await self._wait_reads(engine, deadline)
        del self._engines[engine.engine_id]
        engine.events.close()
        # The agents that read into these buffers are destroyed (readers.py): whatever
        # they posted, even a handle that never ended, can no longer land here.
        readers_gone = await self._readers.close_engine(engine.engine_id)
        if cancelled < 0 or not readers_gone:
            # A pull into these buffers did not end, or its agent would not stop: its
            # NIXL handles may still write here. Leaving the memory mapped and registered
            # is a leak; unmapping would let a late write land in whatever the address
            # holds next.
            log.error("engine %s: a pull did not end; its buffers stay mapped", engine.engine_id)
        else:
            # Memory safety: no pull into these buffers is running and no agent that
            # posted one exists (above), and no peer read of them is in flight (every
            # lease of this engine ended, by EndRead or by its reader's silence past the
            # TTL, which outlasts the reader's stall deadline). So no NIXL handle, ours or
            # a peer's, can touch them: deregister, then unmap.
            await self._backend.deregister(engine.buffers)
            for buffer in engine.buffers:
                buffer.close()
        if orphaned:  # the name only: a mapping kept above stays valid
            unlinked = sum(unlink_segment(buffer) for buffer in engine.buffers)
            log.info("engine %s: unlinked %d shared-memory segment(s)", engine.engine_id, unlinked)
        self.registration_version += 1
        self._engine_gauges()
        self._lease_gauges()
        log.info("engine %s retired (%s)", engine.engine_id, reason)
        return released, max(cancelled, 0)

    def _reads_deadline_s(self) -> float:
        return self.settings.lease.ttl_s + self.settings.transfer.stall_deadline_s

    async def _cancel_pulls(self, engine: Engine) -> int:
        """Abort the engine's pulls and wait until none can touch its memory (their
        PullDone is out; an EndRead to a silent peer may run on); -1 when one would not."""
        pulls = [pull for key, pull in list(self._pulls.items()) if key[0] == engine.engine_id]
        for pull in pulls:
            pull.aborted = True
            pull.cancel.set()
            pull.leaving.set()
        # A pull may be waiting on BeginRead (or a reload) and then its posted chunks.
        transfer = self.settings.transfer
        timeout_s = 2 * (transfer.stall_deadline_s + transfer.rpc_timeout_s) + 5
        if not await all_finished([pull.finished for pull in pulls], timeout_s):
            return -1
        return len(pulls)

    def _end_leases(self, engine: Engine) -> int:
        """Release the engine's held leases now; mark the ones being read aborted, so
        their readers stop (they learn it from their next heartbeat) and end the read.
        Its expected requests are aborted as its own Abort would: Received, not Released
        (a decode engine hears of a push only by Received)."""
        ended = 0
        for lease in self._leases.all():
            if lease.engine_id != engine.engine_id:
                continue
            ended += 1
            if lease.push:
                self.destinations.abort(engine.engine_id, lease.request_id)
                continue
            _, released = self._leases.abort(engine.engine_id, lease.request_id)
            if released is not None:
                self._release(released, ReleaseReason.UNREGISTERED, 0)
        self._lease_gauges()
        return ended

    async def _wait_reads(self, engine: Engine, deadline_s: float) -> None:
        if not self._engine_leases(engine.engine_id):
            return
        try:
            await within(engine.reads_ended.wait(), deadline_s)
        except TimeoutError:
            # The reader kept its lease alive but never ended the read (an alive reader
            # learns of the abort within TTL/3 and ends within its stall deadline). Peers
            # only READ this memory, so a read still posted after the deregistration
            # fails on their side; nothing can write into this process's memory.
            left = self._leases.drop_engine(engine.engine_id)
            # A silent writer may still write here: revoked before the memory goes, by
            # the kill its EndWrite began if there is one (not a second, counted again).
            why = f"engine {engine.engine_id} retires under a push"
            await self.destinations.fence_dropped(left, why)
            log.warning(
                "engine %s: %d reads still open after %.1fs; their readers are presumed gone",
                engine.engine_id,
                len(left),
                deadline_s,
            )

    def _engine_leases(self, engine_id: str) -> list[Lease]:
        return [lease for lease in self._leases.all() if lease.engine_id == engine_id]

    def _lease_ended(self, engine_id: str) -> None:
        """A retiring engine's buffers may go once its last lease has."""
        engine = self._engines.get(engine_id)
        if engine is not None and engine.retiring and not self._engine_leases(engine_id):
            engine.reads_ended.set()

    def _emit(self, engine_id: str, event: EngineEvent) -> None:
        engine = self._engines.get(engine_id)
        if engine is None:
            log.info("event for unregistered engine %s dropped: %s", engine_id, event)
            return
        engine.events.put(event)

    def _release(self, lease: Lease, reason: ReleaseReason, bytes_read: int) -> None:
        self.metrics.released_leases.labels(reason.value).inc()
        self._emit(lease.engine_id, Released(lease.request_id, reason, bytes_read))
        self._lease_ended(lease.engine_id)

    # -- peer side (the operations are in read_side.py and push_side.py) ------

    def serving_engine(self, tp_rank: int) -> Engine:
        for engine in self._engines.values():
            if engine.layout.tp_rank == tp_rank:
                return engine
        ranks = sorted(e.layout.tp_rank for e in self._engines.values())
        raise NotFoundError(
            f"no engine with tp_rank {tp_rank} is registered at {self.address} "
            f"(registered ranks: {ranks or 'none'})"
        )

    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise NotFoundError(
                f"epoch {epoch} is gone: this sidecar restarted and is now epoch {self.epoch}; "
                "requests published before the restart are lost"
            )

    def lease_ttl_s(self) -> float:
        return self._leases.ttl_s

    def leases(self) -> list[tuple[Lease, float]]:
        return [(lease, self._leases.expires_in(lease)) for lease in self._leases.all()]

    def pulls(self) -> list[Pull]:
        return list(self._pulls.values())

    # -- gauges ------------------------------------------------------------

    def _lease_gauges(self) -> None:
        self.metrics.active_leases.set(len(self._leases))
        self.metrics.held_blocks.set(self._leases.held_blocks)

    def _engine_gauges(self) -> None:
        self.metrics.engines.set(len(self._engines))
        self.metrics.registered_bytes.set(sum(e.registered_bytes for e in self._engines.values()))


def _describe(caller: Caller | None) -> str:
    if caller is None:
        return "unknown (TCP)"
    pid = "in another pid namespace" if caller.pid is None else str(caller.pid)
    return f"{pid} (uid {caller.uid})"
