"""What peers do with the requests this sidecar's engines publish (docs/sidecar.md,
Reads), kept out of sidecar.py: the handshake's hello and a read's begin, heartbeats
and end, checked field by field against the lease table.

`ReadSide` belongs to one `Sidecar` (`sidecar.read_side`; the PeerService servicer
calls it), as `PushSide` does for writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvxfer._exceptions import InvalidInputError, LimitExceededError, NotFoundError
from kvxfer.core.buffers import BoundBuffer
from kvxfer.core.negotiation import PROTOCOL_VERSION, SUPPORTED_PROTOCOLS
from kvxfer.core.requests import ReleaseReason, check_request_id
from kvxfer.server.leases import Lease, LeaseState
from kvxfer.wire.sidecar import PeerHello

if TYPE_CHECKING:
    from kvxfer.server.sidecar import Sidecar

# Unregistering is the publisher's business; a reader only consumes or gives up.
_READER_REASONS = frozenset({ReleaseReason.CONSUMED, ReleaseReason.ABORTED})


class ReadSide:
    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    async def hello(self, protocol_version: int, tp_rank: int, dry_run: bool) -> PeerHello:
        """What a pulling sidecar learns of this side's engine of rank `tp_rank`."""
        self._sidecar._check_open()
        if protocol_version not in SUPPORTED_PROTOCOLS:
            raise InvalidInputError(
                "protocol_version",
                f"peer speaks protocol {protocol_version}, this sidecar speaks "
                f"{sorted(SUPPORTED_PROTOCOLS)}; upgrade the older sidecar",
            )
        engine = self._sidecar.serving_engine(tp_rank)
        # Read before the metadata: if the serving agent is replaced meanwhile, the peer
        # holds an older version than ours and reloads at its next BeginRead.
        version = self._sidecar.registration_version
        metadata, buffers = b"", dict[str, BoundBuffer]()
        if not dry_run:  # the serving agent's addresses, not ours
            metadata, buffers = await self._sidecar._backend.served(
                [b.name for b in engine.buffers]
            )
        return PeerHello(
            protocol_version=PROTOCOL_VERSION,
            epoch=self._sidecar.epoch,
            engine_id=engine.engine_id,
            sidecar_id=self._sidecar.sidecar_id,
            layout=engine.layout,
            buffers=buffers,
            agent_metadata=metadata,
            lease_ttl_s=self._sidecar.settings.lease.ttl_s,
            registration_version=version,
            modes=frozenset(self._sidecar.settings.transfer.modes),
            lane_port=self._sidecar.lane_port,
        )

    def begin_read(self, epoch: int, tp_rank: int, request_id: str, reader: str) -> Lease:
        """Begin `reader`'s read of a published request; the lease's read token goes back
        to it alone. Unpublished requests are NotFound: a lease is the only way in."""
        self._sidecar.check_epoch(epoch)
        engine = self._sidecar.serving_engine(tp_rank)
        return self._sidecar._leases.begin_read(
            engine.engine_id, check_request_id(request_id), reader
        )

    def heartbeat(
        self,
        epoch: int,
        tp_rank: int,
        request_ids: Sequence[str],
        reader: str,
        tokens: Sequence[str],
    ) -> list[LeaseState | None]:
        self._check_count(request_ids)
        if len(tokens) != len(request_ids):
            raise InvalidInputError(
                "read_tokens", f"{len(tokens)} tokens for {len(request_ids)} request ids"
            )
        engine_id = self._serving_engine_of(epoch, tp_rank, request_ids)
        if engine_id is None:
            return [None] * len(request_ids)
        return self._sidecar._leases.renew(engine_id, request_ids, reader, tokens)

    def hold(self, epoch: int, tp_rank: int, request_ids: Sequence[str]) -> list[LeaseState | None]:
        """HoldLeases: keep published requests a reader will read once its engine has
        blocks for them (LeaseTable.hold); None for each when `epoch` is not ours."""
        self._check_count(request_ids)
        engine_id = self._serving_engine_of(epoch, tp_rank, request_ids)
        if engine_id is None:
            return [None] * len(request_ids)
        max_hold_s = self._sidecar.settings.lease.max_hold_s
        return self._sidecar._leases.hold(engine_id, request_ids, max_hold_s)

    def _check_count(self, request_ids: Sequence[str]) -> None:
        """Heartbeat and HoldLeases carry at most limits.max_heartbeat_ids ids."""
        limit = self._sidecar.settings.limits.max_heartbeat_ids
        if len(request_ids) > limit:
            raise LimitExceededError(
                f"request_ids: {len(request_ids)} ids exceed limits.max_heartbeat_ids ({limit})"
            )

    def _serving_engine_of(
        self, epoch: int, tp_rank: int, request_ids: Sequence[str]
    ) -> str | None:
        """The engine whose leases `request_ids` name, each id checked; None when `epoch`
        is not ours (nothing the caller names is held here)."""
        for i, request_id in enumerate(request_ids):
            check_request_id(request_id, f"request_ids[{i}]")
        if epoch != self._sidecar.epoch:
            return None
        return self._sidecar.serving_engine(tp_rank).engine_id

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
        self._sidecar.check_epoch(epoch)
        engine = self._sidecar.serving_engine(tp_rank)
        lease = self._sidecar._leases.get(engine.engine_id, check_request_id(request_id))
        if lease.push:
            raise NotFoundError(f"request {request_id!r} is expected for a push: EndWrite it")
        held = lease.held_bytes(engine.layout)
        if bytes_read > held:
            raise InvalidInputError(
                "bytes_read", f"{bytes_read} exceeds the {held} bytes request {request_id!r} holds"
            )
        lease = self._sidecar._leases.end_read(engine.engine_id, request_id, reader, token)
        if lease.state is LeaseState.ABORTED:
            reason = ReleaseReason.ABORTED
        self._sidecar.metrics.bytes_served.inc(bytes_read)
        self._sidecar._release(lease, reason, bytes_read)
        self._sidecar._lease_gauges()
