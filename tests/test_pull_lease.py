"""A decode pull's read and its lease at the publisher (server/pulls.py `run_pull`).

The pull runs in this process against a real NIXL agent serving real shared
memory from a child process (tests/nixl_peer.py), through a real `Readers` and
a real `PeerLinks` over gRPC on loopback. Two seams are faked, for fault
injection only: the publisher's PeerService (`Publisher`: answers BeginRead as a
sidecar would, and its heartbeats can be made to hang, as a partitioned control
network or a stalled publisher leaves them) and, around the real agent, a data
plane that is slow to read chosen chunks (`SlowPlane`: a chunk handed to it is
read to the end whatever becomes of its waiter, as NIXL reads a posted handle).

What must hold:
- once the publisher may have let the lease lapse (no BeginRead or Heartbeat
  answered within its TTL, counted from when it was sent: its engine may reuse
  the blocks), the pull posts no more chunks and reports every block not read
  before then as failed, never OK, and only after every posted chunk ended;
- a pull whose task is cancelled reports only once every posted chunk ended;
- a begun read is always ended at the publisher (EndRead), also when its
  chunks cannot be bound after BeginRead or its task is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import numpy as np
import pytest
from nixl_peer import SourcePeer

from kvxfer.client.shm import ShmKVCache
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.planner import plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.dataplane.adapter import ChunkJob, NixlAgent, TransferBackend, TransferStatus
from kvxfer.dataplane.executor import ExecOptions
from kvxfer.dataplane.faults import WrappedBackend
from kvxfer.dataplane.memory import bind, open_buffer
from kvxfer.dataplane.readers import Readers
from kvxfer.server.engines import Engine, EventQueue
from kvxfer.server.metrics import Metrics
from kvxfer.server.peers import Dialer, PeerLink, PeerLinks
from kvxfer.server.pulls import Pull, PullContext, run_pull
from kvxfer.server.settings import load_settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.layout import span_to_proto
from kvxfer.wire.sidecar import PeerHello

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

MODEL = "llama-3.1-8b"  # one full-attention group: a failed block fails its tokens only
B = 16
BLOCKS = 32
TOKENS = BLOCKS * B
EPOCH = 9
SRC = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in reversed(range(BLOCKS))))]
DST = [BlockSpan(GroupId(0), 0, tuple(BlockId(b) for b in range(BLOCKS)))]


class Publisher(pb_grpc.PeerServiceServicer):
    """The publisher's PeerService: BeginRead answers what was published, with its TTL,
    once `beginning` is set; Heartbeat answers HELD, or hangs while `answering` is clear
    (the caller's deadline ends it); EndRead is recorded."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.beginning, self.answering = asyncio.Event(), asyncio.Event()
        self.beginning.set()
        self.answering.set()
        self.begun = asyncio.Event()  # a BeginRead arrived
        self.ended: list[pb.EndReadRequest] = []

    async def BeginRead(
        self, request: pb.BeginReadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.BeginReadResponse:
        self.begun.set()
        await self.beginning.wait()
        return pb.BeginReadResponse(
            num_tokens=TOKENS,
            spans=[span_to_proto(s) for s in SRC],
            lease_ttl_ms=round(self.ttl_s * 1000),
            registration_version=1,
            read_token="token",
        )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HeartbeatResponse:
        await self.answering.wait()
        return pb.HeartbeatResponse(states=[pb.LEASE_STATE_HELD] * len(request.request_ids))

    async def EndRead(
        self, request: pb.EndReadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EndReadResponse:
        self.ended.append(request)
        return pb.EndReadResponse()


class SlowPlane(WrappedBackend):
    """A TransferBackend around a real agent that hands the batches it is given from the
    `slow_from`-th chunk on to that agent only once `go` is set. A batch handed in is read
    to its end whatever becomes of the future returned for it (cancelling that future
    cancels nobody's read, as with NIXL); `ended` counts the chunks read to their end."""

    def __init__(self, inner: NixlAgent, slow_from: int) -> None:
        super().__init__(inner)
        self.slow_from = slow_from
        self.go = asyncio.Event()
        self.handed = 0
        self.ended = 0
        self._reads: set[asyncio.Task[None]] = set()

    def post_all(self, jobs: Sequence[ChunkJob]) -> asyncio.Future[list[TransferStatus]]:
        slow = self.handed + len(jobs) > self.slow_from
        self.handed += len(jobs)
        answer: asyncio.Future[list[TransferStatus]] = asyncio.get_running_loop().create_future()

        async def read() -> None:
            if slow:
                await self.go.wait()
            statuses = await self._inner.post_all(jobs)
            self.ended += len(jobs)
            if not answer.done():
                answer.set_result(statuses)

        task = asyncio.create_task(read())
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)
        return answer

    async def close(self) -> None:
        self.go.set()
        if self._reads:
            await asyncio.wait(self._reads)
        await self._inner.close()


@dataclass
class Source:
    cache: ShmKVCache
    peer: SourcePeer


@pytest.fixture(scope="module")
def source() -> Iterator[Source]:
    cache = ShmKVCache(layout_for_model(MODEL, block_size=B), BLOCKS, "t-lease-src", 1)
    for i, handle in enumerate(cache.buffers):
        view = cache.view(handle.name)
        view[:] = np.resize(((np.arange(251) * 131 + i) % 251).astype(np.uint8), view.size)
    peer = SourcePeer(cache.buffers)
    yield Source(cache, peer)
    peer.stop()
    cache.close()


@dataclass
class Decode:
    """One pull of all BLOCKS from `publisher` into a fresh decode engine."""

    publisher: Publisher
    plane: list[SlowPlane]
    pull: Pull
    ctx: PullContext
    dst: ShmKVCache
    reports: list[tuple[PullDone, int]] = field(default_factory=list)

    def report(self, done: PullDone) -> None:
        """A PullDone, with how many chunks had been read to their end by then."""
        self.reports.append((done, self.plane[0].ended if self.plane else 0))

    def moved_equal_source(self, source: ShmKVCache, failed: Sequence[int]) -> None:
        for logical in sorted(set(range(BLOCKS)) - set(failed)):
            for tensor in self.dst.layout.groups[0].tensors:
                want = source.block(tensor.name, SRC[0].block_id(logical))
                got = self.dst.block(tensor.name, DST[0].block_id(logical))
                assert np.array_equal(got, want), f"{tensor.name} block {logical} differs"


@contextlib.asynccontextmanager
async def decode(
    source: Source,
    *,
    ttl_s: float,
    slow_from: int,
    chunk_blocks: int = BLOCKS,
    max_inflight: int = 32,
    hello_buffers: Callable[[dict[str, Any]], dict[str, Any]] = lambda b: b,
) -> AsyncIterator[Decode]:
    publisher = Publisher(ttl_s)
    server = grpc.aio.server()
    pb_grpc.add_PeerServiceServicer_to_server(publisher, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    settings = load_settings(["--transfer.rpc-timeout-s", "5"], environ={})
    dialer = Dialer(settings)
    links = PeerLinks(settings=settings, backend=None, metrics=Metrics(),  # type: ignore[arg-type]
                      dialer=dialer, sidecar_id="decode", epoch=7)  # fmt: skip
    planes: list[SlowPlane] = []

    def agent(name: str) -> TransferBackend:
        planes.append(SlowPlane(NixlAgent(name), slow_from))
        return planes[-1]

    readers = Readers(agent, per_pair=1)
    layout = source.cache.layout
    dst = ShmKVCache(layout_for_model(MODEL, block_size=B), BLOCKS, "t-lease-dst", 1)
    mapped = [open_buffer(h) for h in dst.buffers]
    engine = Engine("decode", "decode", dst.layout, mapped, EventQueue(16, lambda: None))
    engine.bound = bind(mapped)
    hello = PeerHello(PROTOCOL_VERSION, EPOCH, "prefill", "p", layout,
                      hello_buffers(dict(source.peer.buffers)), source.peer.metadata,
                      ttl_s, 1)  # fmt: skip
    params = TransferParams(address, "prefill", EPOCH, 0, "r1", TOKENS, tuple(SRC))
    plan = plan_transfer(layout, dst.layout, SRC, DST, TOKENS, 0, chunk_blocks)
    options = ExecOptions(stall_deadline_s=10, max_inflight=max_inflight, handle_blocks=1)
    pull = Pull(engine, params, PeerLink(address, 0, hello, "prefill-agent"), plan)
    ctx = PullContext(readers, links, Metrics(), options, "decode")
    try:
        yield Decode(publisher, planes, pull, ctx, dst)
    finally:
        publisher.beginning.set()
        publisher.answering.set()
        await readers.close()
        await dialer.close()
        await server.stop(None)
        for buffer in mapped:
            buffer.close()
        dst.close()


async def test_a_read_that_outlives_its_unrenewed_lease_fails_its_blocks(source: Source) -> None:
    """Every heartbeat hangs (a partitioned control network); the one batch of chunks
    is read only after the publisher's TTL: the publisher may have expired the lease
    and reused the blocks, so none of them may be reported as read."""
    ttl_s = 0.6
    async with decode(source, ttl_s=ttl_s, slow_from=0) as d:
        d.publisher.answering.clear()
        task = asyncio.create_task(run_pull(d.pull, d.ctx, d.report))
        await asyncio.wait_for(d.publisher.begun.wait(), 30)
        await asyncio.sleep(ttl_s + 0.3)
        d.plane[0].go.set()
        await asyncio.wait_for(task, 30)
    [(done, ended)] = d.reports
    assert d.plane[0].ended == ended == 1, "reported before the read ended"
    assert done.status is PullStatus.FAILED, done
    assert done.failed_blocks == {0: tuple(range(BLOCKS))}, done
    assert (done.valid_tokens, done.bytes_moved) == (0, 0), done
    assert "lease may have lapsed" in done.reason, done
    assert [e.request_id for e in d.publisher.ended] == ["r1"], "the read was not ended"


async def test_chunks_stop_at_the_lease_and_only_those_read_before_it_stand(
    source: Source,
) -> None:
    """More handles than may be in flight: they are posted one by one as earlier ones
    end. The first four are read at once; the fifth only after the lease may have
    lapsed. The blocks of the first four stand (and hold the source's bytes), the fifth's
    fail with every later one, and no chunk is posted after the lapse."""
    ttl_s, chunk_blocks, fast = 0.8, 2, 4
    async with decode(
        source, ttl_s=ttl_s, slow_from=fast, chunk_blocks=chunk_blocks, max_inflight=1
    ) as d:
        d.publisher.answering.clear()
        task = asyncio.create_task(run_pull(d.pull, d.ctx, d.report))
        await asyncio.wait_for(d.publisher.begun.wait(), 30)
        begun = time.monotonic()
        await asyncio.sleep(ttl_s + 0.3)
        plane = d.plane[0]
        assert plane.ended == fast, f"{plane.ended} chunks read within {time.monotonic() - begun}"
        plane.go.set()
        await asyncio.wait_for(task, 30)
        [(done, _)] = d.reports
        read = fast * chunk_blocks
        assert plane.handed == fast + 1, f"{plane.handed} posted, {fast + 1} before the lapse"
        assert done.status is PullStatus.PARTIAL, done
        assert done.failed_blocks == {0: tuple(range(read, BLOCKS))}, done
        assert done.valid_tokens == read * B, done
        assert done.bytes_moved == read * source.cache.layout.groups[0].bytes_per_block, done
        d.moved_equal_source(source.cache, done.failed_blocks[0])


async def test_a_renewed_lease_reads_to_the_end(source: Source) -> None:
    """The same slow read with heartbeats answered: the lease holds, the pull is OK."""
    ttl_s = 0.6
    async with decode(source, ttl_s=ttl_s, slow_from=0) as d:
        task = asyncio.create_task(run_pull(d.pull, d.ctx, d.report))
        await asyncio.wait_for(d.publisher.begun.wait(), 30)
        await asyncio.sleep(2 * ttl_s)
        d.plane[0].go.set()
        await asyncio.wait_for(task, 30)
        [(done, _)] = d.reports
        assert done.status is PullStatus.OK, done
        d.moved_equal_source(source.cache, ())
    assert [e.reason for e in d.publisher.ended] == [pb.RELEASE_REASON_CONSUMED]


@pytest.mark.parametrize("in_beginread", [True, False], ids=["in-beginread", "begun"])
async def test_a_cancelled_pull_reports_once_its_posted_chunks_ended(
    source: Source, in_beginread: bool
) -> None:
    """The pull's task is cancelled (the sidecar's loop going away) while its one batch
    is posted and being read, BeginRead still unanswered or answered: NIXL goes on
    reading into the engine's blocks, so the PullDone that lets the engine reuse them
    waits until the read has ended."""
    async with decode(source, ttl_s=30, slow_from=0) as d:
        if in_beginread:
            d.publisher.beginning.clear()
        task = asyncio.create_task(run_pull(d.pull, d.ctx, d.report))
        await asyncio.wait_for(d.publisher.begun.wait(), 30)
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.5)
        assert not d.reports, f"PullDone while a chunk was still posted: {d.reports}"
        d.plane[0].go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
    [(done, ended)] = d.reports
    assert ended == 1, "reported before the read ended"
    assert done.status is PullStatus.ABORTED, done
    # A read BeginRead began is ended (aborted), so the publisher frees its blocks now.
    expected = [] if in_beginread else [pb.RELEASE_REASON_ABORTED]
    assert [e.reason for e in d.publisher.ended] == expected


async def test_a_read_whose_chunks_cannot_be_bound_after_beginread_is_ended(
    source: Source,
) -> None:
    """The publisher's registration does not cover the published blocks (its buffer is
    smaller than the layout says): binding fails before BeginRead and again after it.
    The read was begun, so it is ended (aborted) at once, not left to expire there."""

    def shrunk(buffers: dict[str, Any]) -> dict[str, Any]:
        name = next(iter(buffers))
        buffers[name] = dataclasses.replace(buffers[name], size_bytes=1)
        return buffers

    async with decode(source, ttl_s=30, slow_from=BLOCKS, hello_buffers=shrunk) as d:
        await asyncio.wait_for(run_pull(d.pull, d.ctx, d.report), 30)
    [(done, _)] = d.reports
    assert done.status is PullStatus.FAILED, done
    assert "internal error" not in done.reason, done
    assert done.failed_blocks == {0: tuple(range(BLOCKS))}, done
    assert [e.reason for e in d.publisher.ended] == [pb.RELEASE_REASON_ABORTED]
