"""Hold (decode side): keep the publications an engine will pull while its queue holds
the requests back (docs/sidecar.md, "Hold").

`Holds.hold` groups an engine's Hold by publisher and asks each (HoldLeases), up to
MAX_ASKING at once, linking with it first where the engine never pulled from it (the
Pull then finds the handshake and agreement done). The whole call gets `HOLD_ASK_S`,
the wait for a slot included: a publisher that does not answer by then (gone,
partitioned, an old sidecar), or was not reached by then because silent ones took the
slots, leaves its publications UNSPECIFIED for the engine to hold again at the next
interval. A Hold therefore never takes much longer than `HOLD_ASK_S` however many
publishers are silent, and the others' leases do not lapse while they are being held.
Publishers already linked are asked first: they answer at once, where a publisher
still to be handshaken is the one likely to be silent. The others are asked in an order
that turns by MAX_ASKING at every Hold, so silent ones cannot keep a live publisher
behind them from one Hold to the next. A handshake, once begun, goes on in the
background, shared with any Pull (`PeerLinks.link`), so a live publisher reached once
is linked, and asked first, from then on. While any publication stays unanswered the
engine is told to hold again within HOLD_ASK_S: its publisher's lease TTL is not known
here, and may be far shorter than this sidecar's own.

A publisher whose layout does not agree with the engine's (NegotiationError) would
refuse the pull as well: its publications are answered UNKNOWN (gone), so the engine
stops holding them rather than asking, and handshaking, again at every interval; the
refusal is logged here, throttled, not by `PeerLinks` at every Hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TypeAlias

from kvxfer._exceptions import KvxferError, NegotiationError, NotFoundError, shown
from kvxfer.core.requests import Publication
from kvxfer.core.throttle import LogThrottle
from kvxfer.server.engines import Engine
from kvxfer.server.peers import PeerLinks
from kvxfer.v1 import sidecar_pb2 as pb

log = logging.getLogger(__name__)

HOLD_ASK_S = 1.0  # the longest one Hold may take to link with and ask its publishers
MAX_ASKING = 32  # publishers asked at once by one Hold
MIN_INTERVAL_S = 0.1  # the soonest an engine is told to hold again, whatever a peer's TTL
WARN_EVERY_S = 60.0  # a publisher that cannot be asked is logged at most this often

State: TypeAlias = "pb.LeaseState.ValueType"
Publisher: TypeAlias = tuple[str, int, str, int]  # address, epoch, engine id, TP rank


class Holds:
    def __init__(self, links: PeerLinks, own_ttl_s: float) -> None:
        self._links = links
        self._own_ttl_s = own_ttl_s
        self._logs = LogThrottle(WARN_EVERY_S)  # by publisher address
        self._turn = 0  # where the unlinked publishers' order starts at the next Hold

    async def hold(
        self, engine: Engine, publications: Sequence[Publication]
    ) -> tuple[list[State], float]:
        """Each publication's LeaseState as its publisher answered (UNSPECIFIED where it
        could not be asked in time), and when to hold again: a third of the shortest lease
        TTL among the publishers asked, at most HOLD_ASK_S while any publication is
        unanswered, at least MIN_INTERVAL_S."""
        states: list[State] = [pb.LEASE_STATE_UNSPECIFIED] * len(publications)
        ttls = [self._own_ttl_s]
        gate = asyncio.Semaphore(MAX_ASKING)
        reached: set[Publisher] = set()

        async def ask(key: Publisher, indices: list[int]) -> None:
            async with gate:
                reached.add(key)
                ids = [publications[i].request_id for i in indices]
                try:
                    answered = await self._ask(engine, key, ids, ttls)
                except KvxferError as exc:
                    self._warn(key[0], engine, str(exc))
                    return
            for i, state in zip(indices, answered, strict=True):
                states[i] = state

        by_publisher = self._by_publisher(publications)
        tasks = {asyncio.ensure_future(ask(k, ix)): k for k, ix in by_publisher.items()}
        if tasks:  # asyncio.wait refuses none
            try:
                _, late = await asyncio.wait(tasks, timeout=HOLD_ASK_S)
            finally:  # also when the Hold itself is cancelled: no ask outlives it
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            self._warn_late([tasks[t] for t in late], reached, engine)
        interval = min(ttls) / 3
        if pb.LEASE_STATE_UNSPECIFIED in states:  # soon again, for a TTL not learned
            interval = min(interval, HOLD_ASK_S)
        return states, max(interval, MIN_INTERVAL_S)

    def _by_publisher(self, publications: Sequence[Publication]) -> dict[Publisher, list[int]]:
        """Each publisher's publications (their indices), those already linked first, the
        others from where the last Hold's turn ended: the gate lets tasks through in the
        order they were made."""
        by_publisher: dict[Publisher, list[int]] = {}
        for i, p in enumerate(publications):
            key = (p.peer_address, p.epoch, p.engine_id, p.tp_rank)
            by_publisher.setdefault(key, []).append(i)
        linked = {
            (link.address, link.epoch, link.hello.engine_id, link.tp_rank)
            for link in self._links.all()
            if not link.stale
        }
        first = [key for key in by_publisher if key in linked]
        others = [key for key in by_publisher if key not in linked]
        if others:
            start = self._turn % len(others)
            others = others[start:] + others[:start]
            self._turn = start + MAX_ASKING
        return {key: by_publisher[key] for key in (*first, *others)}

    async def _ask(
        self, engine: Engine, key: Publisher, ids: list[str], ttls: list[float]
    ) -> list[State]:
        """One publisher's answers for `ids`, its lease TTL added to `ttls`."""
        address, epoch, peer_engine, rank = key
        with self._links.use(address):  # its link is not forgotten under it
            try:
                link, _ = await self._links.link(
                    address, engine.engine_id, engine.layout, epoch, peer_engine, rank, quiet=True
                )
            except NotFoundError:  # no engine of that rank there, nor anything it published
                return [pb.LEASE_STATE_UNKNOWN] * len(ids)
            except NegotiationError as exc:  # its pull would be refused too: stop holding it
                self._warn(address, engine, str(exc))
                return [pb.LEASE_STATE_UNKNOWN] * len(ids)
            if link.epoch != epoch:  # the publisher restarted: nothing of it is held
                return [pb.LEASE_STATE_UNKNOWN] * len(ids)
            answered = await self._links.hold(link, ids)
            ttls.append(link.hello.lease_ttl_s)
            return answered

    def _warn_late(self, late: list[Publisher], reached: set[Publisher], engine: Engine) -> None:
        """Publishers that did not answer in time: each that was asked is named; those
        never reached (the slots were taken all along) are counted, not blamed."""
        for address, *_ in (key for key in late if key in reached):
            self._warn(address, engine, f"no answer within {HOLD_ASK_S:g} s")
        unreached = sum(key not in reached for key in late)
        if unreached and self._logs.due(("unreached", engine.engine_id)) is not None:
            log.warning(
                "hold for engine %s: %d publishers not asked within %g s, %d being asked at "
                "once (logged at most every %g s per engine)",
                shown(engine.engine_id), unreached, HOLD_ASK_S, MAX_ASKING, WARN_EVERY_S,
            )  # fmt: skip

    def _warn(self, address: str, engine: Engine, why: str) -> None:
        if self._logs.due(address) is None:
            return
        log.warning(
            "hold at %s for engine %s: %s (logged at most every %g s per publisher)",
            shown(address), shown(engine.engine_id), why, WARN_EVERY_S,
        )  # fmt: skip
