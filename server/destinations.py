"""The decode side of a push: destination leases and the end of each write.

The decode engine announces the blocks one request may be written into
(`expect`); they are held under a destination lease in the sidecar's lease
table (`Lease.push`), with the same TTL, heartbeats and write token as a read
has. A prefill sidecar binds the lease to itself (`begin_write`), WRITEs
through our serving agent, and ends with `end_write`, which reports the
blocks that failed in our engine's blocks.

No write after failed: the engine hears `Received` only when no byte can land
in its blocks any more. After EndWrite, the writer has ended every chunk (and
severed its agent on the first failed one: adapter.py), but a chunk it gave up
on may still be queued to our serving agent, which puts it into our memory: a
write that ends with failed or aborted blocks and is not `settled` is fenced
by killing the serving agent every peer writes through (`ServingBackend.revoke`)
before it is reported. So is a writer that goes silent past the TTL (it may
still have WRITEs posted) (docs/dataplane.md, Push: what that costs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvxfer._exceptions import InvalidInputError, LeaseError, NotFoundError, PlanError
from kvxfer.core.layout import BlockSpan, EngineLayout
from kvxfer.core.planner import check_groups_request, plan_blocks
from kvxfer.core.recompute import valid_tokens
from kvxfer.core.requests import (
    AbortState,
    EngineEvent,
    PullStatus,
    Received,
    ReleaseReason,
    TransferMode,
    check_request_id,
)
from kvxfer.dataplane.serving import ServingBackend
from kvxfer.server.engines import Engine, check_span_ids_once
from kvxfer.server.leases import Lease, LeaseState, LeaseTable, check_reader
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import Settings

log = logging.getLogger(__name__)


def check_push_accepted(settings: Settings, field: str = "mode") -> None:
    if TransferMode.PUSH not in settings.transfer.modes:
        modes = ",".join(m.value for m in settings.transfer.modes)
        raise InvalidInputError(
            field,
            f"this sidecar does not take part in pushes (transfer.modes is {modes}); "
            "pull instead, or add push to transfer.modes",
        )


def needed_blocks(layout: EngineLayout, num_tokens: int, computed: int) -> dict[int, range]:
    return {p.group.group_id: p.blocks for p in plan_blocks(layout, num_tokens, computed)}


def expected_blocks(layout: EngineLayout, lease: Lease) -> dict[int, tuple[int, ...]]:
    """The logical blocks per group a push of the lease's request writes (none omitted)."""
    needed = needed_blocks(layout, lease.num_tokens, lease.computed_tokens)
    return {group_id: tuple(blocks) for group_id, blocks in needed.items() if blocks}


def check_spans_hold(
    layout: EngineLayout, num_tokens: int, computed: int, spans: tuple[BlockSpan, ...]
) -> None:
    """The announced spans must hold every block a push of the request writes."""
    by_group: dict[int, tuple[int, BlockSpan]] = {s.group_id: (i, s) for i, s in enumerate(spans)}
    for group_id, blocks in needed_blocks(layout, num_tokens, computed).items():
        if not blocks:
            continue
        found = by_group.get(group_id)
        if found is None:
            raise InvalidInputError(
                f"spans[group {group_id}]",
                f"missing; {num_tokens} tokens ({computed} held) need logical blocks "
                f"{blocks.start}..{blocks.stop - 1}",
            )
        i, span = found
        if not (span.first_block <= blocks.start and blocks.stop <= span.end_block):
            raise InvalidInputError(
                f"spans[{i}]",
                f"covers logical blocks {span.first_block}..{span.end_block - 1} of group "
                f"{group_id}; the push writes {blocks.start}..{blocks.stop - 1}",
            )


@dataclass(frozen=True)
class WriteEnd:
    """What a writer's EndWrite says (validated by `Destinations.end_write`)."""

    writer: str  # the caller's identity
    token: str
    reason: ReleaseReason
    failed: Mapping[int, tuple[int, ...]]  # in our engine's logical blocks
    bytes_written: int
    valid_tokens: int  # the writer's recompute rule
    detail: str
    settled: bool = False  # the writer says nothing it posted can still land


class Destinations:
    def __init__(
        self,
        *,
        settings: Settings,
        leases: LeaseTable,
        backend: ServingBackend,
        metrics: Metrics,
        emit: Callable[[str, EngineEvent], None],
        ended: Callable[[str], None],
        layout_of: Callable[[str], EngineLayout | None],
    ) -> None:
        self._settings = settings
        self._leases = leases
        self._backend = backend
        self._metrics = metrics
        self._emit = emit
        self._ended = ended  # a lease of this engine ended (a retiring engine waits on it)
        self._layout_of = layout_of
        self._killing: asyncio.Future[None] | None = None  # the latest kill (`_kill`)

    def expect(
        self,
        engine: Engine,
        request_id: str,
        num_tokens: int,
        spans: tuple[BlockSpan, ...],
        computed_tokens: int,
    ) -> Lease:
        check_push_accepted(self._settings)
        check_request_id(request_id)
        layout = engine.layout
        check_span_ids_once(layout, spans, "spans")
        try:
            check_groups_request(layout.groups, num_tokens, computed_tokens, layout.block_size)
        except PlanError as exc:
            field = "num_tokens" if "num_tokens" in exc.field else "computed_tokens"
            raise InvalidInputError(field, exc.detail) from exc
        check_spans_hold(layout, num_tokens, computed_tokens, spans)
        return self._leases.add(
            engine.engine_id,
            request_id,
            num_tokens,
            spans,
            push=True,
            computed_tokens=computed_tokens,
        )

    def begin_write(self, engine: Engine, request_id: str, writer: str) -> Lease:
        check_push_accepted(self._settings)
        return self._leases.begin_read(
            engine.engine_id, check_request_id(request_id), writer, push=True
        )

    async def end_write(self, engine: Engine, request_id: str, end: WriteEnd) -> int:
        """End a write; the engine hears `Received` once no byte can land any more: at
        once when the writer's chunks all completed or never left it (`settled`), else
        after our serving agent is revoked (a chunk the writer gave up on may still be
        queued to it, and would land after the report). Returns the valid_tokens the
        engine was told."""
        reason, failed, bytes_written = end.reason, end.failed, end.bytes_written
        writer_valid, detail = end.valid_tokens, end.detail
        if reason not in (ReleaseReason.CONSUMED, ReleaseReason.ABORTED):
            raise InvalidInputError(
                "reason", f"a writer ends a write as consumed or aborted, not {reason.value}"
            )
        lease = self._leases.get(engine.engine_id, check_request_id(request_id))
        if not lease.push:
            raise NotFoundError(f"request {request_id!r} is not expected here (it is published)")
        layout = engine.layout
        held = lease.held_bytes(layout)
        if bytes_written > held:
            raise InvalidInputError(
                "bytes_written",
                f"{bytes_written} exceeds the {held} bytes request {request_id!r} expects",
            )
        if writer_valid > lease.num_tokens:
            raise InvalidInputError(
                "valid_tokens", f"{writer_valid} exceeds the {lease.num_tokens} tokens expected"
            )
        needed = expected_blocks(layout, lease)
        if not failed and not bytes_written and needed:
            # "Nothing failed" from a write that moved nothing the request needs: every
            # block it needed is failed (an authenticated writer is trusted for what it
            # wrote, as for the bytes themselves, but not for an empty claim).
            failed = needed
        try:  # checks every failed block is one the push writes, in our blocks
            ours = valid_tokens(
                layout.groups, lease.num_tokens, lease.computed_tokens, layout.block_size, failed
            )
        except PlanError as exc:
            raise InvalidInputError("failed_blocks", exc.detail) from exc
        check_reader(lease, end.writer, end.token)  # before anything is revoked for it
        if lease.ending:  # a retry while its first call revokes, or the sweeper: it reports
            raise LeaseError(
                f"request {request_id!r} is being ended (remote access is being revoked, "
                "for an earlier EndWrite of its writer or its lease's expiry), which reports it"
            )
        gave_up = failed or reason is ReleaseReason.ABORTED or lease.state is LeaseState.ABORTED
        if gave_up and not end.settled:
            await self._revoke(lease, f"the writer of {request_id!r} gave up on chunks")
        lease = self._leases.end_read(engine.engine_id, request_id, end.writer, end.token)
        aborted = reason is ReleaseReason.ABORTED or lease.state is LeaseState.ABORTED
        if aborted and not bytes_written and not end.failed:  # nothing was written
            self._fail_all(lease, PullStatus.ABORTED, detail or "the writer aborted")
            return lease.computed_tokens
        # The writer's rule knows where a block moved from (other block sizes); ours
        # bounds it, so a writer can never claim more than its failures leave valid.
        valid = max(lease.computed_tokens, min(writer_valid, ours))
        status = _status(aborted, bool(failed), valid, lease.computed_tokens)
        self._metrics.bytes_received.inc(bytes_written)
        self._report(lease, status, failed, valid, bytes_written, detail)
        return valid

    async def _revoke(self, lease: Lease, why: str) -> None:
        """Revoke with the lease marked ending: while we wait, the sweeper must not expire
        it (it would revoke again and report it failed, and this EndWrite's outcome would
        be lost) nor a retried EndWrite revoke again (the agent that replaced this one)."""
        lease.ending = True
        try:
            await self._fence(lease, why)
        finally:  # cancelled (the writer's call gave up): the lease expires as usual
            lease.ending = False

    async def _fence(self, lease: Lease, why: str) -> None:
        """Return once remote access was revoked after the lease's writer gave up: by the
        revocation begun for it earlier if there is one (its EndWrite was cancelled while
        the agent was killed and reaped: that kill fences every chunk the writer gave up
        on, and a second would only kill the agent that replaced it), else a new one.
        Shielded: a cancelled caller leaves the kill to finish for whoever ends the lease."""
        await self._fence_all([lease], why)

    async def fence_dropped(self, leases: Iterable[Lease], why: str) -> None:
        """Leases taken out of the table while their writes may still land (an engine
        retires under a writer that never ended): return once no WRITE posted for any
        of them can land. One revocation fences them all, and one already begun for a
        lease (its EndWrite's, cancelled or still running) is waited for, not repeated."""
        dropped = [lease for lease in leases if lease.push]
        try:
            await self._fence_all(dropped, why)
        except Exception:  # a kill it joined (the sweeper's, an EndWrite's) failed
            log.exception("revoking remote access (%s) failed: killing once more", why)
            await self._fence_all(dropped, why)  # a new kill: a failed one fences nothing

    async def _fence_all(self, leases: list[Lease], why: str) -> None:
        """Record on each lease not yet fenced the kill that fences it (the one under
        way, else a new one), then wait for every lease's kill, shielded."""
        for lease in leases:
            if not _fences(lease.revocation):
                lease.revocation = self._kill(why)
        kills = dict.fromkeys(lease.revocation for lease in leases if lease.revocation)
        for kill in kills:
            await asyncio.shield(kill)

    def _kill(self, why: str) -> asyncio.Future[None]:
        """The kill of the serving agent under way, else a new one. A kill not yet
        returned fences every WRITE posted before it returns, whoever needs it now (two
        writers giving up together; the sweeper or a retirement while another lease's
        kill runs): a second would only kill the agent that replaced it, or the dying
        one again, and count a revocation that did not happen."""
        kill = self._killing
        if kill is not None and not kill.done():
            log.info("revoking remote access (%s): joins the kill under way", why)
            return kill
        kill = self._killing = asyncio.ensure_future(self._revoke_agent(why))
        return kill

    async def _revoke_agent(self, why: str) -> None:
        """Kill the serving agent every peer writes through, counted: no WRITE posted
        before this returns can land any more."""
        await self._backend.revoke(why)
        self._metrics.push_revocations.inc()

    async def expired_all(self, leases: Iterable[Lease]) -> None:
        """Destination leases whose TTL passed without heartbeat or EndWrite (one sweep's),
        each reported failed: at once when nobody began writing it; else only once every
        peer's access was revoked (its writer may still have WRITEs posted), by one kill
        for all of them, or the one already begun for a lease (`_fence_all`): a kill each
        would kill the agents that replaced the first, and count revocations that fence
        nothing. Those stay in the table, marked ending, until fenced (`LeaseTable.expire`):
        an engine retiring meanwhile waits for the fence before its memory goes.

        Shielded: a cancelled sweep still reports them once the kill returned. When the
        kill fails they are not reported (a WRITE may still land) and stay in the table,
        no longer ending: the next sweep fences them again, and a retirement fences them
        itself. Logged, never raised (after a cancelled sweep nothing awaits this)."""
        begun: list[Lease] = []
        for lease in leases:
            if lease.state is LeaseState.HELD:
                self._expire(lease, "no prefill sidecar began writing it within the lease TTL")
            else:
                begun.append(lease)
        if begun:
            await asyncio.shield(self._fence_expired(begun))

    async def _fence_expired(self, leases: list[Lease]) -> None:
        ids = ", ".join(repr(lease.request_id) for lease in leases)
        writers = "the writer" if len(leases) == 1 else "the writers"
        try:
            await self._fence_all(leases, f"{writers} of {ids} went silent")
        except BaseException as exc:
            # A WRITE posted before may still land: better blocks held than written into
            # after their engine reused them. Back in the table as they were, expired:
            # the next sweep kills again (an EndWrite may end one first, revoking itself).
            for lease in leases:
                lease.ending = lease.swept = False
            if not isinstance(exc, Exception):
                raise
            log.exception(
                "expected requests %s expired, but remote access could not be revoked: "
                "not reported; fenced again by the next sweep",
                ids,
            )
            return
        for lease in leases:
            if self._leases.discard(lease):  # else its engine retired, fencing it meanwhile
                self._expire(
                    lease,
                    "its writer went silent past the lease TTL; remote access was revoked first",
                )

    def _expire(self, lease: Lease, why: str) -> None:
        log.warning("expected request %s failed: %s", lease.request_id, why)
        try:
            self._fail_all(lease, PullStatus.FAILED, why)
        except Exception:  # one report's bug must not lose the rest of the sweep's
            log.exception("reporting expected request %s failed", lease.request_id)

    def abort(self, engine_id: str, request_id: str) -> AbortState:
        """The decode engine aborts an expected request: released at once when nobody
        writes it; else marked, and reported once its writer ends or goes silent."""
        before, released = self._leases.abort(engine_id, request_id)
        if released is not None:
            self._fail_all(released, PullStatus.ABORTED, "aborted before any write began")
            return AbortState.EXPECTED
        if before is LeaseState.ABORTED:
            return AbortState.ABORTED
        return AbortState.WRITING

    def _fail_all(self, lease: Lease, status: PullStatus, why: str) -> None:
        # No byte of this request was reported moved: every block it expected is failed.
        layout = self._layout_of(lease.engine_id)
        failed = expected_blocks(layout, lease) if layout else {}
        self._report(lease, status, failed, lease.computed_tokens, 0, why)

    def _report(
        self,
        lease: Lease,
        status: PullStatus,
        failed: Mapping[int, tuple[int, ...]],
        valid: int,
        moved: int,
        detail: str,
    ) -> None:
        self._emit(
            lease.engine_id,
            Received(
                request_id=lease.request_id,
                status=status,
                failed_blocks=dict(failed),
                valid_tokens=valid,
                bytes_moved=moved,
                duration_s=time.monotonic() - lease.created,
                reason=detail,
            ),
        )
        self._ended(lease.engine_id)


def _fences(revocation: asyncio.Future[None] | None) -> bool:
    """Whether a lease's revocation fences its writer's writes: under way, or returned
    (a failed or cancelled one does not: the lease needs another)."""
    if revocation is None:
        return False
    return not revocation.done() or not (
        revocation.cancelled() or revocation.exception() is not None
    )


def _status(aborted: bool, failed: bool, valid: int, computed: int) -> PullStatus:
    if aborted:
        return PullStatus.ABORTED
    if not failed:
        return PullStatus.OK
    return PullStatus.PARTIAL if valid > computed else PullStatus.FAILED
