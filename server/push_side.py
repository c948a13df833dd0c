"""The sidecar's push operations (docs/sidecar.md, Push), kept out of sidecar.py.

`PushSide` belongs to one `Sidecar` (`sidecar.push_side`; the servicers call it):
its methods only validate, count and delegate, to `Pushes` (the prefill side:
writing our engines' blocks into a peer's) and `Destinations` (the decode side:
peers writing into blocks our engines announced), which it builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxfer.core.layout import BlockSpan
from kvxfer.core.requests import PushAccepted, TransferMode, TransferParams
from kvxfer.server.destinations import Destinations, WriteEnd
from kvxfer.server.leases import Lease
from kvxfer.server.pushes import Pushes

if TYPE_CHECKING:
    from kvxfer.server.sidecar import Sidecar


class PushSide:
    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar
        self.pushes, self.destinations = _parts(sidecar)

    def expect(
        self,
        engine_id: str,
        request_id: str,
        num_tokens: int,
        spans: tuple[BlockSpan, ...],
        computed_tokens: int,
    ) -> TransferParams:
        """Hold `spans` of the engine for a peer to push `request_id` into."""
        self._sidecar._check_open()
        engine = self._sidecar.engine(engine_id)
        self._sidecar._check_block_count(spans, "spans")
        self.destinations.expect(engine, request_id, num_tokens, spans, computed_tokens)
        self._sidecar._lease_gauges()
        return TransferParams(
            self._sidecar.address, engine_id, self._sidecar.epoch, engine.layout.tp_rank,
            request_id, num_tokens, spans, TransferMode.PUSH,
        )  # fmt: skip

    async def push(
        self,
        engine_id: str,
        params: TransferParams,
        local_spans: tuple[BlockSpan, ...],
        tokens_ready: int,
        final: bool,
    ) -> PushAccepted:
        if not self.pushes.running(engine_id, params.request_id):
            self._sidecar._check_open()  # a running push may finish while we drain
        engine = self._sidecar.engine(engine_id)
        self._sidecar._check_block_count(local_spans, "local_spans")
        self._sidecar._check_block_count(params.spans, "params.spans")
        return await self.pushes.push(engine, params, local_spans, tokens_ready, final)

    def begin_write(self, epoch: int, tp_rank: int, request_id: str, writer: str) -> Lease:
        self._sidecar.check_epoch(epoch)
        return self.destinations.begin_write(
            self._sidecar.serving_engine(tp_rank), request_id, writer
        )

    async def end_write(self, epoch: int, tp_rank: int, request_id: str, end: WriteEnd) -> int:
        self._sidecar.check_epoch(epoch)
        engine = self._sidecar.serving_engine(tp_rank)
        valid = await self.destinations.end_write(engine, request_id, end)
        self._sidecar._lease_gauges()
        return valid


def _parts(sidecar: Sidecar) -> tuple[Pushes, Destinations]:
    pushes = Pushes(
        settings=sidecar.settings,
        links=sidecar.links,
        writers=sidecar._readers,  # the same agents per (peer, engine): readers.py
        metrics=sidecar.metrics,
        writer_id=sidecar.sidecar_id,
        emit=sidecar._emit,
    )
    destinations = Destinations(
        settings=sidecar.settings,
        leases=sidecar._leases,
        backend=sidecar._backend,
        metrics=sidecar.metrics,
        emit=sidecar._emit,
        ended=sidecar._lease_ended,
        layout_of=lambda e: sidecar._engines[e].layout if e in sidecar._engines else None,
    )
    return pushes, destinations
