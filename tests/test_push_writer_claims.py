"""What the decode side believes of a writer's EndWrite.

The decode sidecar cannot see which of its blocks a writer wrote: it trusts the
writer's failed_blocks. An authenticated but buggy writer that ends a write
CONSUMED with no failed blocks, having written nothing (bytes_written 0), makes
the decode engine hear `Received` OK with every token valid: it decodes from
blocks that hold whatever they held before. The claim contradicts itself (0
bytes for blocks that need many), and the decode side could refuse it.
"""

from __future__ import annotations

import grpc.aio
import pytest
from sidecars import engine_link, spans, start_engine, start_sidecar

from kvxfer.core.requests import PullStatus, Received
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.sidecar import hello_from_proto, hello_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "gpt-oss-20b"


async def test_a_writer_claiming_ok_for_blocks_it_never_wrote_is_not_believed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = start_sidecar(tmp_path, "d", "--lease.ttl-s", "30")
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=32)
    try:
        async with engine_link(d, de) as (client, events):
            ids = list(range(8))
            await client.expect("claimed", 100, spans({0: ids, 1: ids}))
            async with grpc.aio.insecure_channel(d.ready["peer_address"]) as channel:
                peer = pb_grpc.PeerServiceStub(channel)
                request = hello_request(de.layout, epoch=1, sidecar_id="w", dry_run=True)
                hello = hello_from_proto(await peer.Handshake(request), dry_run=True)
                begun = await peer.BeginWrite(
                    pb.BeginWriteRequest(
                        epoch=hello.epoch, tp_rank=0, request_id="claimed", writer_id="w"
                    )
                )
                # No WRITE was ever posted.
                await peer.EndWrite(
                    pb.EndWriteRequest(
                        epoch=hello.epoch,
                        tp_rank=0,
                        request_id="claimed",
                        write_token=begun.write_token,
                        reason=pb.RELEASE_REASON_CONSUMED,
                        bytes_written=0,
                        valid_tokens=100,
                    )
                )
            received = await events.next(timeout_s=30)
        assert isinstance(received, Received), received
        assert received.bytes_moved == 0
        assert received.status is not PullStatus.OK or received.valid_tokens == 0, received
    finally:
        de.stop()
        d.stop()
