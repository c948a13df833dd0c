"""The sidecar's state and operations, free of gRPC: servicers only decode and call.

One `Sidecar` per process owns the registered engines, the lease table
(serving side), the pulls in flight (reading side), the peer links and the
NIXL backend. Engine-facing operations (register, publish, pull, abort,
watch, unregister) and peer-facing ones (hello, begin/heartbeat/end read)
are plain async methods raising kvxfer errors.
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
)
from kvxfer.core.buffers import BufferHandle
from kvxfer.core.layout import BlockSpan, EngineLayout
from kvxfer.core.negotiation import PROTOCOL_VERSION, SUPPORTED_PROTOCOLS
from kvxfer.core.planner import check_span_ids, full_attention_bytes, plan_transfer
from kvxfer.core.requests import (
    MAX_EPOCH,
    EngineEvent,
    LeaseExpired,
    PullAccepted,
    PullDone,
    Released,
    ReleaseReason,
    TransferParams,
    check_request_id,
)
from kvxfer.dataplane.adapter import TransferBackend
from kvxfer.dataplane.executor import ExecOptions
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer
from kvxfer.server.engines import Engine, EventQueue, check_regions_fit
from kvxfer.server.leases import Lease, LeaseState, LeaseTable
from kvxfer.server.metrics import Metrics
from kvxfer.server.peers import Dialer, PeerLinks
from kvxfer.server.pulls import Pull, PullContext, run_pull
from kvxfer.server.settings import Settings
from kvxfer.wire.sidecar import PeerHello

log = logging.getLogger(__name__)
# Unregistering is the publisher's business; a reader only consumes or gives up.
_READER_REASONS = frozenset({ReleaseReason.CONSUMED, ReleaseReason.ABORTED})


class Sidecar:
    def __init__(self, settings: Settings, backend: TransferBackend, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.epoch = secrets.randbelow(MAX_EPOCH) + 1
        self.sidecar_id = settings.sidecar_id or f"{socket.gethostname()}-{os.getpid()}"
        self.address = settings.advertise_address or settings.peer_address
        self.started = time.monotonic()
        self.registration_version = 0
        self._backend = backend
        self._engines: dict[str, Engine] = {}
        self._leases = LeaseTable(settings.lease.ttl_s, settings.limits.max_leases, time.monotonic)
        self._pulls: dict[tuple[str, str], Pull] = {}
        self._dialer = Dialer(settings)
        self.links = PeerLinks(
            settings=settings,
            backend=backend,
            metrics=metrics,
            dialer=self._dialer,
            sidecar_id=self.sidecar_id,
            epoch=self.epoch,
        )
        self._pull_ctx = PullContext(
            backend=backend,
            links=self.links,
            metrics=metrics,
            options=ExecOptions(
                stall_deadline_s=settings.transfer.stall_deadline_s,
                max_inflight=settings.transfer.max_inflight_chunks,
            ),
            reader_id=self.sidecar_id,
        )
        self._draining = False
        self._sweeper: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease.sweep_s)
            for lease in self._leases.expire():
                log.info("lease of %s expired unconsumed", lease.request_id)
                self.metrics.expired_leases.inc()
                self._emit(
                    lease.engine_id,
                    LeaseExpired(lease.request_id, time.monotonic() - lease.created),
                )
            self._lease_gauges()

    async def shutdown(self, grace_s: float) -> None:
        """Take no new work, let pulls finish for `grace_s`, abort the rest, release every
        lease (reported to its engine) and deregister every buffer."""
        self._draining = True
        pending = [p.task for p in self._pulls.values() if p.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for pull in list(self._pulls.values()):
                pull.aborted = True
                pull.cancel.set()
            if late:
                await asyncio.wait(late, timeout=self.settings.transfer.stall_deadline_s + 1)
        for engine_id in list(self._engines):
            await self.unregister(engine_id)
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self._dialer.close()

    def _check_open(self) -> None:
        if self._draining:
            raise ShuttingDownError("the sidecar is shutting down and takes no new requests")

    # -- engine side -------------------------------------------------------

    async def register_engine(
        self, layout: EngineLayout, handles: Sequence[BufferHandle], name: str
    ) -> Engine:
        self._check_open()
        if len(self._engines) >= self.settings.limits.max_engines:
            raise LimitExceededError(
                f"limits.max_engines: {self.settings.limits.max_engines} engines already registered"
            )
        for other in self._engines.values():
            if other.layout.tp_rank == layout.tp_rank:
                raise InvalidInputError(
                    "layout.tp_rank",
                    f"an engine with tp_rank {layout.tp_rank} is already registered "
                    f"({other.engine_id}); unregister it first",
                )
        check_regions_fit(layout, list(handles))
        buffers: list[MappedBuffer] = []
        try:
            for handle in handles:
                buffers.append(open_buffer(handle))
            await self._backend.register(buffers)
        except BaseException:
            for buffer in buffers:
                buffer.close()
            raise
        engine_id = f"e-{secrets.token_hex(6)}"
        events = EventQueue(
            self.settings.limits.max_pending_events, self.metrics.events_dropped.inc
        )
        engine = Engine(engine_id, name[:128], layout, buffers, events, bind(buffers))
        self._engines[engine_id] = engine
        self.registration_version += 1
        self._engine_gauges()
        log.info(
            "registered engine %s (%s, %s, rank %d, %d buffers)",
            engine_id,
            name,
            layout.model,
            layout.tp_rank,
            len(buffers),
        )
        return engine

    def engine(self, engine_id: str) -> Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            raise NotFoundError(f"engine {engine_id!r} is not registered with this sidecar")
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
        seen: set[int] = set()
        for i, span in enumerate(spans):
            if span.group_id in seen:
                raise InvalidInputError(f"spans[{i}].group_id", f"group {span.group_id} repeats")
            seen.add(span.group_id)
            check_span_ids(engine.layout, span, f"spans[{i}]")
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
        if key in self._pulls:
            raise InvalidInputError(
                "params.request_id", f"{params.request_id!r} is already being pulled"
            )
        if params.tp_rank != engine.layout.tp_rank:
            raise InvalidInputError(
                "params.tp_rank",
                f"params are for rank {params.tp_rank}, "
                f"this engine is rank {engine.layout.tp_rank}",
            )
        self._check_block_count(local_spans, "local_spans")
        self._check_block_count(params.spans, "params.spans")
        self._check_peer_limit(params.peer_address)
        link, _ = await self.links.link(
            params.peer_address, engine_id, engine.layout, params.epoch, params.engine_id
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
        full = full_attention_bytes(engine.layout, params.num_tokens, computed_tokens)
        self.metrics.full_attention_bytes.labels(self.links.label(params.peer_address), "read").inc(
            full
        )
        pull = Pull(engine, params, link, plan)
        self._pulls[key] = pull
        pull.task = asyncio.create_task(self._finish_pull(key, pull))
        return PullAccepted(
            bytes_planned=plan.nbytes,
            full_attention_bytes=full,
            chunks=len(plan.chunks),
            descriptors=sum(c.num_descriptors for c in plan.chunks),
        )

    async def _finish_pull(self, key: tuple[str, str], pull: Pull) -> None:
        def report(done: PullDone) -> None:
            self._pulls.pop(key, None)
            self._emit(pull.engine.engine_id, done)

        try:
            await run_pull(pull, self._pull_ctx, report)
        finally:
            self._pulls.pop(key, None)

    def _check_block_count(self, spans: Sequence[BlockSpan], field: str) -> None:
        total = sum(len(s.block_ids) for s in spans)
        limit = self.settings.limits.max_blocks_per_request
        if total > limit:
            raise LimitExceededError(
                f"{field}: {total} block ids exceed limits.max_blocks_per_request ({limit})"
            )

    def _check_peer_limit(self, address: str) -> None:
        running = sum(1 for p in self._pulls.values() if p.params.peer_address == address)
        limit = self.settings.limits.max_inflight_pulls_per_peer
        if running >= limit:
            raise LimitExceededError(
                f"limits.max_inflight_pulls_per_peer: {running} pulls from {address} in flight"
            )

    async def abort(self, engine_id: str, request_id: str) -> str:
        engine = self.engine(engine_id)
        check_request_id(request_id)
        pull = self._pulls.get((engine_id, request_id))
        if pull is not None:
            pull.aborted = True
            pull.cancel.set()
            return "pulling"
        before, released = self._leases.abort(engine.engine_id, request_id)
        if released is not None:
            self._release(released, ReleaseReason.ABORTED, 0)
        self._lease_gauges()
        return before.value

    def watch(self, engine_id: str) -> AsyncIterator[EngineEvent]:
        return self.engine(engine_id).events.watch()

    async def unregister(self, engine_id: str) -> tuple[int, int]:
        engine = self.engine(engine_id)
        cancelled = 0
        for key, pull in list(self._pulls.items()):
            if key[0] == engine_id and pull.task is not None:
                pull.aborted = True
                pull.cancel.set()
                cancelled += 1
                await asyncio.wait([pull.task], timeout=self.settings.transfer.stall_deadline_s + 1)
        leases = self._leases.drop_engine(engine_id)
        for lease in leases:
            self._release(lease, ReleaseReason.UNREGISTERED, 0)
        del self._engines[engine_id]
        engine.events.close()
        await self._backend.deregister(engine.buffers)
        for buffer in engine.buffers:
            buffer.close()
        self.registration_version += 1
        self._engine_gauges()
        self._lease_gauges()
        return len(leases), cancelled

    def _emit(self, engine_id: str, event: EngineEvent) -> None:
        engine = self._engines.get(engine_id)
        if engine is None:
            log.info("event for unregistered engine %s dropped: %s", engine_id, event)
            return
        engine.events.put(event)

    def _release(self, lease: Lease, reason: ReleaseReason, bytes_read: int) -> None:
        self.metrics.released_leases.labels(reason.value).inc()
        self._emit(lease.engine_id, Released(lease.request_id, reason, bytes_read))

    # -- peer side ---------------------------------------------------------

    async def hello(self, protocol_version: int, layout: EngineLayout, dry_run: bool) -> PeerHello:
        self._check_open()
        if protocol_version not in SUPPORTED_PROTOCOLS:
            raise InvalidInputError(
                "protocol_version",
                f"peer speaks protocol {protocol_version}, this sidecar speaks "
                f"{sorted(SUPPORTED_PROTOCOLS)}; upgrade the older sidecar",
            )
        engine = self._serving_engine(layout.tp_rank)
        return PeerHello(
            protocol_version=PROTOCOL_VERSION,
            epoch=self.epoch,
            engine_id=engine.engine_id,
            sidecar_id=self.sidecar_id,
            layout=engine.layout,
            buffers={} if dry_run else dict(engine.bound),
            agent_metadata=b"" if dry_run else await self._backend.metadata(),
            lease_ttl_s=self.settings.lease.ttl_s,
            registration_version=self.registration_version,
        )

    def _serving_engine(self, tp_rank: int) -> Engine:
        for engine in self._engines.values():
            if engine.layout.tp_rank == tp_rank:
                return engine
        ranks = sorted(e.layout.tp_rank for e in self._engines.values())
        raise NotFoundError(
            f"no engine with tp_rank {tp_rank} is registered at {self.address} "
            f"(registered ranks: {ranks or 'none'})"
        )

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise NotFoundError(
                f"epoch {epoch} is gone: this sidecar restarted and is now epoch {self.epoch}; "
                "requests published before the restart are lost"
            )

    def begin_read(self, epoch: int, tp_rank: int, request_id: str, reader: str) -> Lease:
        """Begin `reader`'s read of a published request; the lease's read token goes back
        to it alone. Unpublished requests are NotFound: a lease is the only way in."""
        self._check_epoch(epoch)
        engine = self._serving_engine(tp_rank)
        return self._leases.begin_read(engine.engine_id, check_request_id(request_id), reader)

    def heartbeat(
        self,
        epoch: int,
        tp_rank: int,
        request_ids: Sequence[str],
        reader: str,
        tokens: Sequence[str],
    ) -> list[LeaseState | None]:
        limit = self.settings.limits.max_heartbeat_ids
        if len(request_ids) > limit:
            raise LimitExceededError(
                f"request_ids: {len(request_ids)} ids exceed limits.max_heartbeat_ids ({limit})"
            )
        if len(tokens) != len(request_ids):
            raise InvalidInputError(
                "read_tokens", f"{len(tokens)} tokens for {len(request_ids)} request ids"
            )
        for i, request_id in enumerate(request_ids):
            check_request_id(request_id, f"request_ids[{i}]")
        if epoch != self.epoch:
            return [None] * len(request_ids)
        engine = self._serving_engine(tp_rank)
        return self._leases.renew(engine.engine_id, request_ids, reader, tokens)

    def end_read(
        self,
        epoch: int,
        tp_rank: int,
        request_id: str,
        reason: ReleaseReason,
        bytes_read: int,
        *,
        reader: str,
        token: str,
    ) -> None:
        if reason not in _READER_REASONS:
            raise InvalidInputError(
                "reason", f"a reader ends a read as consumed or aborted, not {reason.value}"
            )
        self._check_epoch(epoch)
        engine = self._serving_engine(tp_rank)
        lease = self._leases.get(engine.engine_id, check_request_id(request_id))
        held = sum(
            len(s.block_ids) * engine.layout.group(s.group_id).bytes_per_block for s in lease.spans
        )
        if bytes_read > held:
            raise InvalidInputError(
                "bytes_read", f"{bytes_read} exceeds the {held} bytes request {request_id!r} holds"
            )
        lease = self._leases.end_read(engine.engine_id, request_id, reader, token)
        if lease.state is LeaseState.ABORTED:
            reason = ReleaseReason.ABORTED
        self.metrics.bytes_served.inc(bytes_read)
        self._release(lease, reason, bytes_read)
        self._lease_gauges()

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
