"""Hold (decode side): keep the publications an engine will pull while its queue holds
the requests back (docs/sidecar.md, "Hold").

`Holds.hold` groups an engine's Hold by publisher and asks each at once
(HoldLeases), linking with it first where the engine never pulled from it (the
Pull then finds the handshake and agreement done). Each publisher gets at most
`HOLD_ASK_S`: one that does not answer by then (gone, partitioned, an old
sidecar) leaves its publications UNSPECIFIED for the engine to hold again at the
next interval, and never delays the answers for the others, whose leases would
otherwise lapse while they are being held. Its handshake, if one was begun, goes
on in the background, shared with any Pull (`PeerLinks.link`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TypeAlias

from kvxfer._exceptions import KvxferError, NotFoundError, shown
from kvxfer.core.requests import Publication
from kvxfer.core.throttle import LogThrottle
from kvxfer.server.engines import Engine
from kvxfer.server.peers import PeerLinks
from kvxfer.v1 import sidecar_pb2 as pb

log = logging.getLogger(__name__)

HOLD_ASK_S = 1.0  # the longest one publisher may take to link and answer one Hold
MAX_ASKING = 32  # publishers asked at once by one Hold
MIN_INTERVAL_S = 0.1  # the soonest an engine is told to hold again, whatever a peer's TTL
WARN_EVERY_S = 60.0  # a publisher that cannot be asked is logged at most this often

State: TypeAlias = "pb.LeaseState.ValueType"


class Holds:
    def __init__(self, links: PeerLinks, own_ttl_s: float) -> None:
        self._links = links
        self._own_ttl_s = own_ttl_s
        self._logs = LogThrottle(WARN_EVERY_S)  # by publisher address

    async def hold(
        self, engine: Engine, publications: Sequence[Publication]
    ) -> tuple[list[State], float]:
        """Each publication's LeaseState as its publisher answered (UNSPECIFIED where it
        could not be asked in time), and when to hold again: a third of the shortest lease
        TTL among the publishers asked, at least MIN_INTERVAL_S."""
        by_publisher: dict[tuple[str, int, str, int], list[int]] = {}
        for i, p in enumerate(publications):
            key = (p.peer_address, p.epoch, p.engine_id, p.tp_rank)
            by_publisher.setdefault(key, []).append(i)
        states: list[State] = [pb.LEASE_STATE_UNSPECIFIED] * len(publications)
        ttls = [self._own_ttl_s]
        gate = asyncio.Semaphore(MAX_ASKING)

        async def ask(key: tuple[str, int, str, int], indices: list[int]) -> None:
            address, epoch, peer_engine, rank = key
            ids = [publications[i].request_id for i in indices]
            try:
                async with gate, asyncio.timeout(HOLD_ASK_S):
                    link, _ = await self._links.link(
                        address, engine.engine_id, engine.layout, epoch, peer_engine, rank
                    )
                    if link.epoch != epoch:  # the publisher restarted: nothing of it is held
                        answered: list[State] = [pb.LEASE_STATE_UNKNOWN] * len(ids)
                    else:
                        ttls.append(link.hello.lease_ttl_s)
                        answered = await self._links.hold(link, ids)
            except NotFoundError:  # no engine of that rank there, nor anything it published
                answered = [pb.LEASE_STATE_UNKNOWN] * len(ids)
            except (KvxferError, TimeoutError) as exc:
                self._warn(address, engine, exc)
                return
            for i, state in zip(indices, answered, strict=True):
                states[i] = state

        await asyncio.gather(*(ask(key, indices) for key, indices in by_publisher.items()))
        return states, max(min(ttls) / 3, MIN_INTERVAL_S)

    def _warn(self, address: str, engine: Engine, exc: BaseException) -> None:
        if self._logs.due(address) is None:
            return
        why = str(exc) or f"no answer within {HOLD_ASK_S:g} s"
        log.warning(
            "hold at %s for engine %s: %s (logged at most every %g s per publisher)",
            shown(address), shown(engine.engine_id), why, WARN_EVERY_S,
        )  # fmt: skip
