"""Leases on published requests: the serving side's promise to keep blocks intact.

A published request is held until the reader says it is done (`end_read`),
an engine aborts it, or its lease expires. A reader renews the lease by
heartbeat while its pull runs. A block is never released while a read of it
is in flight: aborting a request that is being read only marks it, and the
release happens when the reader ends its read (it learns of the abort from
its next heartbeat) or stops heartbeating for a whole TTL (it is presumed
gone, and its stall deadline, which is shorter than the TTL, has ended every
read it posted).

The table is plain synchronous code over an injected clock, so it is tested
without sleeping; the sidecar sweeps it on a timer.


Reads are bound to their reader: `begin_read` records the caller's identity
(its certificate's name with mTLS, `anonymous` without) and hands back a
random read token; heartbeats and the end of the read must come from the same
identity with the same token, so another client can neither end (steal) nor
renew (pin) a read it did not begin.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvxfer._exceptions import (
    InvalidInputError,
    LeaseError,
    LimitExceededError,
    NotFoundError,
    PermissionDeniedError,
)
from kvxfer.core.layout import BlockSpan, EngineLayout

log = logging.getLogger(__name__)


class LiveClock:
    """Monotonic seconds that do not count time this process was stopped (SIGSTOP, a
    paused VM, a host that stalled). Leases run on it: a lease ends when its reader was
    not heard from for its TTL while we could have heard it. On wall time, every lease
    whose reader finished during a freeze (its EndRead timed out meanwhile) would be
    reported expired on thaw, though its blocks were read; on this clock the reader's
    retried EndRead arrives first and the engine hears `consumed`."""

    def __init__(self) -> None:
        self._stopped_s = 0.0
        self._last = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self._stopped_s

    def tick(self, expected_s: float) -> None:
        """Called by a loop that sleeps `expected_s` between calls: a call much later than
        that means the process did not run in between."""
        now = time.monotonic()
        late = now - self._last - expected_s
        if late > max(1.0, expected_s):
            self._stopped_s += late
            log.warning("this process did not run for %.1f s: leases are extended by it", late)
        self._last = now


class LeaseState(enum.StrEnum):
    HELD = "held"  # published, nobody reading
    READING = "reading"  # a reader began and has not ended
    ABORTED = "aborted"  # aborted while being read: released when the read ends


@dataclass
class Lease:
    engine_id: str
    request_id: str
    num_tokens: int
    spans: tuple[BlockSpan, ...]
    created: float
    expires: float
    state: LeaseState = LeaseState.HELD
    reader: str = ""  # who began the read
    read_token: str = ""  # the secret that read's heartbeats and end must present
    # A destination lease (push): blocks the decode engine announced for a writer; the
    # reader fields are then the writer's (READING: being written).
    push: bool = False
    computed_tokens: int = 0
    # Remote access is being revoked before the lease is reported, by its writer's
    # EndWrite or by the sweeper (`swept`): nothing else ends the lease meanwhile (the
    # sweeper passes it over; an EndWrite is refused).
    ending: bool = False
    # Expired by the sweeper, kept until its writer is fenced: no longer the writer's
    # (its heartbeat hears it gone, and renews nothing).
    swept: bool = False
    # The revocation of remote access that fences its writer's given-up chunks (begun
    # for it, or a kill under way it joined): it runs on when the call that began it is
    # cancelled, and what ends the lease after (a retried EndWrite, the sweeper, its
    # engine's retirement) waits for it instead of killing the agent that replaced it.
    revocation: asyncio.Future[None] | None = None

    @property
    def blocks(self) -> int:
        return sum(len(s.block_ids) for s in self.spans)

    def held_bytes(self, layout: EngineLayout) -> int:
        """Bytes of every block the lease holds, in `layout` (its engine's): the most a
        reader can have read or a writer written."""
        return sum(len(s.block_ids) * layout.group(s.group_id).bytes_per_block for s in self.spans)


class LeaseTable:
    def __init__(self, ttl_s: float, max_leases: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._max = max_leases
        self._clock = clock
        self._leases: dict[tuple[str, str], Lease] = {}
        self._held_blocks = 0  # kept as leases come and go: read on every publish

    def __len__(self) -> int:
        return len(self._leases)

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    @property
    def held_blocks(self) -> int:
        return self._held_blocks

    def reading(self) -> int:
        """Leases a peer has begun reading and not ended: their blocks are in use."""
        return sum(1 for lease in self._leases.values() if lease.state is LeaseState.READING)

    def add(
        self,
        engine_id: str,
        request_id: str,
        num_tokens: int,
        spans: tuple[BlockSpan, ...],
        *,
        push: bool = False,
        computed_tokens: int = 0,
    ) -> Lease:
        key = (engine_id, request_id)
        if key in self._leases:
            what = "expected" if self._leases[key].push else "published"
            raise InvalidInputError(
                "request_id", f"request {request_id!r} is already {what} and held"
            )
        if len(self._leases) >= self._max:
            raise LimitExceededError(
                f"limits.max_leases: {self._max} requests already held; "
                "consume, abort or let them expire first"
            )
        now = self._clock()
        lease = Lease(engine_id, request_id, num_tokens, spans, now, now + self.ttl_s)
        lease.push, lease.computed_tokens = push, computed_tokens
        self._leases[key] = lease
        self._held_blocks += lease.blocks
        return lease

    def get(self, engine_id: str, request_id: str) -> Lease:
        lease = self._leases.get((engine_id, request_id))
        if lease is None:
            raise NotFoundError(
                f"request {request_id!r} is not held here (never published, "
                "already consumed, aborted or expired)"
            )
        return lease

    def begin_read(
        self, engine_id: str, request_id: str, reader: str, *, push: bool = False
    ) -> Lease:
        """Start `reader`'s read (or, `push`, its write of an expected request); the
        lease's `read_token` goes back to it alone. A read never begins on a destination
        lease, nor a write on a published one."""
        lease = self.get(engine_id, request_id)
        if lease.push != push:
            raise NotFoundError(
                f"request {request_id!r} is not {'expected' if push else 'published'} here "
                f"(it is {'expected for a push' if lease.push else 'published for a pull'})"
            )
        if lease.state is LeaseState.ABORTED:
            who = "decode engine" if push else "publisher"
            raise LeaseError(f"request {request_id!r} was aborted by its {who}")
        if lease.state is LeaseState.READING:
            raise LeaseError(
                f"request {request_id!r} is already being {'written' if push else 'read'}"
            )
        lease.state = LeaseState.READING
        lease.reader, lease.read_token = reader, secrets.token_hex(16)
        lease.expires = self._clock() + self.ttl_s
        return lease

    def renew(
        self, engine_id: str, request_ids: Sequence[str], reader: str, tokens: Sequence[str]
    ) -> list[LeaseState | None]:
        """Extend each of `reader`'s reads by a TTL; None for requests no longer held.
        Checked whole before anything is renewed: one foreign id refuses the call."""
        leases = [self._leases.get((engine_id, request_id)) for request_id in request_ids]
        for lease, token in zip(leases, tokens, strict=True):
            if lease is not None:
                check_reader(lease, reader, token)
        leases = [None if lease is not None and lease.swept else lease for lease in leases]
        now = self._clock()
        for lease in leases:
            if lease is not None:
                lease.expires = now + self.ttl_s
        return [None if lease is None else lease.state for lease in leases]

    def hold(
        self, engine_id: str, request_ids: Sequence[str], max_hold_s: float
    ) -> list[LeaseState | None]:
        """Keep each published request nobody reads yet for another TTL, but never past
        `max_hold_s` after it was published (a would-be reader waiting for its engine's
        blocks). None for requests not held or not published (a destination lease); a
        request being read is its reader's to renew and keeps its expiry."""
        now = self._clock()
        states: list[LeaseState | None] = []
        for request_id in request_ids:
            lease = self._leases.get((engine_id, request_id))
            if lease is None or lease.push:
                states.append(None)
                continue
            if lease.state is LeaseState.HELD:
                lease.expires = max(
                    lease.expires, min(now + self.ttl_s, lease.created + max_hold_s)
                )
            states.append(lease.state)
        return states

    def end_read(self, engine_id: str, request_id: str, reader: str, token: str) -> Lease:
        lease = self.get(engine_id, request_id)
        check_reader(lease, reader, token)
        return self._remove((engine_id, request_id))

    def abort(self, engine_id: str, request_id: str) -> tuple[LeaseState, Lease | None]:
        """Abort a held request: (its state before, the lease if released right away)."""
        lease = self.get(engine_id, request_id)
        before = lease.state
        if lease.state is LeaseState.HELD:
            return before, self._remove((engine_id, request_id))
        lease.state = LeaseState.ABORTED
        return before, None

    def expire(self) -> list[Lease]:
        """The leases whose TTL passed, taken out of the table; but a destination lease
        whose write began stays in it, marked ending, until its writer is fenced
        (`Destinations.expired_all`, then `discard`): an engine retiring meanwhile still
        sees it, and its memory waits for that fence."""
        now = self._clock()
        due = [
            (key, lease)
            for key, lease in self._leases.items()
            if lease.expires <= now and not lease.ending
        ]
        expired = []
        for key, lease in due:
            if lease.push and lease.state is not LeaseState.HELD:
                lease.ending = lease.swept = True
                expired.append(lease)
            else:
                expired.append(self._remove(key))
        return expired

    def discard(self, lease: Lease) -> bool:
        """Take `lease` out of the table if it is still there (a retirement may have
        dropped it meanwhile): whether it was."""
        key = (lease.engine_id, lease.request_id)
        if self._leases.get(key) is not lease:
            return False
        self._remove(key)
        return True

    def drop_engine(self, engine_id: str) -> list[Lease]:
        gone = [key for key in self._leases if key[0] == engine_id]
        return [self._remove(key) for key in gone]

    def _remove(self, key: tuple[str, str]) -> Lease:
        lease = self._leases.pop(key)
        self._held_blocks -= lease.blocks
        return lease

    def expires_in(self, lease: Lease) -> float:
        return max(0.0, lease.expires - self._clock())


def check_reader(lease: Lease, reader: str, token: str) -> None:
    what, who, doing = ("write", "writer", "written") if lease.push else ("read", "reader", "read")
    if lease.state is LeaseState.HELD:
        raise PermissionDeniedError(
            f"request {lease.request_id!r} has no {what} of yours to renew or end"
        )
    # compare_digest: the token is a secret, its comparison must not leak a prefix by timing
    # (as bytes: compare_digest refuses str with non-ASCII characters, which a client sends)
    given = token.encode(errors="surrogateescape")
    if lease.reader != reader or not hmac.compare_digest(lease.read_token.encode(), given):
        raise PermissionDeniedError(
            f"request {lease.request_id!r} is being {doing} by another {who} "
            f"(identity or {what}_token differs)"
        )
