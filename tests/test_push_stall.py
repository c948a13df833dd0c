"""No write after failed, for push: a writer that goes silent mid-push.

A real decode sidecar D and engine DE; the writer is this test, speaking the
peer protocol (Handshake, BeginWrite) and writing with a real NIXL agent of its
own, as a prefill sidecar's initiating agent does. It writes one block (the path
works: the sentinel lands), then stops heartbeating. D must report the request
failed only after revoking remote access: once DE hears `Received`, a WRITE the
same writer posts later (it "resumes" with what it loaded before) must not land.
Without the revocation, that late WRITE lands (the serving agent still serves).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc.aio
import numpy as np
import pytest
from sidecars import (
    EngineSim,
    engine_link,
    scrape,
    spans,
    start_engine,
    start_sidecar,
    unregister,
)

from kvxfer.client.shm import ShmKVCache, shm_kv_cache
from kvxfer.core.buffers import BoundBuffer, MemoryKind
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import PullStatus, Received
from kvxfer.dataplane.adapter import ChunkJob, NixlAgent, TransferStatus
from kvxfer.dataplane.memory import bind, open_buffer
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.sidecar import PeerHello, hello_from_proto, hello_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "gpt-oss-20b"
TENSOR = "layer.0.k"  # a full-attention tensor (group 1 is layer.1's)


async def _begin_write(
    peer: pb_grpc.PeerServiceStub, de: EngineSim, request_id: str
) -> tuple[PeerHello, pb.BeginWriteResponse]:
    """Handshake with the decode sidecar as a writer would, and begin the write."""
    request = hello_request(de.layout, epoch=1, sidecar_id="w", dry_run=False)
    hello = hello_from_proto(await peer.Handshake(request), dry_run=False)
    begun = await peer.BeginWrite(
        pb.BeginWriteRequest(epoch=hello.epoch, tp_rank=0, request_id=request_id, writer_id="w")
    )
    return hello, begun


def _writes(
    src: ShmKVCache, local: dict[str, BoundBuffer], de: EngineSim, hello: PeerHello, name: str
) -> Callable[[int, int], ChunkJob]:
    """A WRITE of one block of TENSOR, from a source block into a block of `de`'s."""
    s = next(r for r in src.layout.regions if r.name == TENSOR)
    t = de.regions[TENSOR]

    def job(src_block: int, dst_block: int) -> ChunkJob:
        here = local[s.buffer].address + s.block_offset(src_block)
        there = hello.buffers[t.buffer].address + t.block_offset(dst_block)
        return ChunkJob(
            peer=name,
            local=np.array([[here, t.block_bytes, 0]], dtype=np.uint64),
            remote=np.array([[there, t.block_bytes, 0]], dtype=np.uint64),
            local_kind=MemoryKind.DRAM,
            remote_kind=MemoryKind.DRAM,
            deadline_s=5.0,
            write=True,
        )

    return job


async def test_a_silent_writer_is_revoked_before_the_failure_is_reported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = start_sidecar(tmp_path, "d", "--lease.ttl-s", "2", "--transfer.stall-deadline-s", "1")
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=32)
    agent = NixlAgent("late-writer")
    try:
        with shm_kv_cache(layout_for_model(MODEL), num_blocks=4, prefix="kvxfer-late") as src:
            src.block(TENSOR, 0)[:] = 0xAB
            src.block(TENSOR, 1)[:] = 0xCD
            mapped = [open_buffer(h) for h in src.buffers]
            await agent.register(mapped)
            async with engine_link(d, de) as (client, events):
                ids = list(range(8))
                await client.expect("stalled", 100, spans({0: ids, 1: ids}))
                async with grpc.aio.insecure_channel(d.ready["peer_address"]) as channel:
                    peer = pb_grpc.PeerServiceStub(channel)
                    hello, _ = await _begin_write(peer, de, "stalled")
                name = await agent.add_peer(hello.agent_metadata)
                job = _writes(src, bind(mapped), de, hello, name)
                assert await agent.read(job(0, 2)) is TransferStatus.DONE
                assert (de.block(TENSOR, 2) == 0xAB).all(), "the writer's path works"
                before = de.block(TENSOR, 3).copy()
                # Silent from here: no heartbeat, no EndWrite.
                received = await events.next(timeout_s=30)
                assert isinstance(received, Received), received
                assert received.status is PullStatus.FAILED and received.valid_tokens == 0
                assert "revoked" in received.reason
                # The writer resumes with what it loaded: nothing may land any more.
                late = await agent.read(job(1, 3))
                assert late is not TransferStatus.DONE
                assert np.array_equal(de.block(TENSOR, 3), before), "a late write landed"
            for buffer in mapped:
                buffer.close()
    finally:
        await agent.close()
        de.stop()
        d.stop()


async def test_an_engine_retiring_under_a_writer_that_never_ends_revokes_and_counts_it(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """The writer keeps its lease alive (Heartbeat) but never ends the write, so the
    lease never expires: only the engine's retirement can end it. Retiring waits for
    the write to end (lease TTL + stall deadline), then revokes remote access before
    the memory goes, and `kvxfer_push_revocations` counts that revocation too."""
    d = start_sidecar(tmp_path, "d", "--lease.ttl-s", "2", "--transfer.stall-deadline-s", "1")
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=32)
    revocations = ("kvxfer_push_revocations_total", ())
    agent = NixlAgent("stubborn-writer")
    beating: asyncio.Task[None] | None = None
    try:
        with shm_kv_cache(layout_for_model(MODEL), num_blocks=4, prefix="kvxfer-late") as src:
            src.block(TENSOR, 0)[:] = 0xAB
            mapped = [open_buffer(h) for h in src.buffers]
            await agent.register(mapped)
            async with engine_link(d, de) as (client, _):
                ids = list(range(8))
                await client.expect("stubborn", 100, spans({0: ids, 1: ids}))
            async with grpc.aio.insecure_channel(d.ready["peer_address"]) as channel:
                peer = pb_grpc.PeerServiceStub(channel)
                hello, begun = await _begin_write(peer, de, "stubborn")
                name = await agent.add_peer(hello.agent_metadata)
                job = _writes(src, bind(mapped), de, hello, name)
                beat = pb.HeartbeatRequest(
                    epoch=hello.epoch,
                    tp_rank=0,
                    request_ids=["stubborn"],
                    read_tokens=[begun.write_token],
                )

                async def keep_beating() -> None:  # keeps the lease, whatever it is told
                    while True:
                        await peer.Heartbeat(beat)
                        await asyncio.sleep(0.3)

                beating = asyncio.create_task(keep_beating())
                assert await agent.read(job(0, 2)) is TransferStatus.DONE
                assert (de.block(TENSOR, 2) == 0xAB).all(), "the writer's path works"
                before = scrape(d).get(revocations, 0)
                await unregister(d, de)  # returns once the engine's memory is let go
                assert scrape(d).get(revocations, 0) == before + 1
                # Revoked and let go: what the writer loaded before reaches nothing.
                untouched = de.block(TENSOR, 3).copy()
                assert await agent.read(job(0, 3)) is not TransferStatus.DONE
                assert np.array_equal(de.block(TENSOR, 3), untouched), "a late write landed"
            for buffer in mapped:
                buffer.close()
    finally:
        if beating is not None:
            beating.cancel()
        await agent.close()
        de.stop()
        d.stop()


async def test_late_end_writes_revoke_nothing_more(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One revocation per lease that needs one, and none for an EndWrite that arrives
    after its lease ended: the retry of an unsettled EndWrite that already revoked and
    reported, and the EndWrite of a writer whose lease the sweeper already expired and
    revoked. Each more would kill the serving agent every other peer writes through."""
    d = start_sidecar(tmp_path, "d", "--lease.ttl-s", "2", "--transfer.stall-deadline-s", "1")
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=32)
    revocations = ("kvxfer_push_revocations_total", ())
    restarts = ("kvxfer_serving_agent_restarts_total", ())
    try:
        async with engine_link(d, de) as (client, events):
            ids = list(range(8))
            await client.expect("ended", 100, spans({0: ids, 1: ids}))
            await client.expect("silent", 100, spans({0: ids[:7], 1: ids[:7]}))
            async with grpc.aio.insecure_channel(d.ready["peer_address"]) as channel:
                peer = pb_grpc.PeerServiceStub(channel)
                request = hello_request(de.layout, epoch=1, sidecar_id="w", dry_run=False)
                hello = hello_from_proto(await peer.Handshake(request), dry_run=False)

                async def begin(request_id: str) -> str:
                    begun = await peer.BeginWrite(
                        pb.BeginWriteRequest(
                            epoch=hello.epoch, tp_rank=0, request_id=request_id, writer_id="w"
                        )
                    )
                    return begun.write_token

                def end(request_id: str, token: str) -> pb.EndWriteRequest:
                    return pb.EndWriteRequest(  # gave up, and cannot say it settled
                        epoch=hello.epoch,
                        tp_rank=0,
                        request_id=request_id,
                        write_token=token,
                        reason=pb.RELEASE_REASON_ABORTED,
                        settled=False,
                        detail="chunks timed_out",
                    )

                tokens = {r: await begin(r) for r in ("ended", "silent")}
                before = scrape(d)
                await peer.EndWrite(end("ended", tokens["ended"]), timeout=30)
                received = await events.next(timeout_s=30)
                assert isinstance(received, Received) and received.request_id == "ended"
                assert received.status is PullStatus.ABORTED, received
                assert scrape(d).get(revocations, 0) == before.get(revocations, 0) + 1
                # Its answer was lost: the writer retries, and finds the lease gone.
                with pytest.raises(grpc.aio.AioRpcError) as retried:
                    await peer.EndWrite(end("ended", tokens["ended"]), timeout=30)
                assert retried.value.code() is grpc.StatusCode.NOT_FOUND, retried.value
                # The other writer is silent: the sweeper revokes and reports it ...
                received = await events.next(timeout_s=30)
                assert isinstance(received, Received) and received.request_id == "silent"
                assert received.status is PullStatus.FAILED and "revoked" in received.reason
                # ... and its EndWrite, late, finds the lease gone too.
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await peer.EndWrite(end("silent", tokens["silent"]), timeout=30)
                assert late.value.code() is grpc.StatusCode.NOT_FOUND, late.value
            expected = before.get(restarts, 0) + 2
            for _ in range(100):  # the second replacement is noticed after the report
                if scrape(d).get(restarts, 0) >= expected:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # time for a needless third kill to show
            after = scrape(d)
            assert after.get(revocations, 0) == before.get(revocations, 0) + 2
            assert after.get(restarts, 0) == expected, "a serving agent was killed needlessly"
    finally:
        de.stop()
        d.stop()
