"""Real kvxfer-server and engine-sim processes for end-to-end tests, and byte checks.

`start_sidecar` / `start_engine` run the installed console scripts and wait
for their JSON ready line. `EngineSim` maps the engine's shared memory
read-only so a test can compare destination blocks with source blocks and
check that every other destination byte still holds the decode pattern; the
blocks that must move come from the token-level oracle, not the planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc.aio
import numpy as np
import numpy.typing as npt
from oracle import oracle_blocks

from kvxfer.cli.fleet import EngineView as EngineSim
from kvxfer.cli.fleet import Fleet, Proc, Samples
from kvxfer.cli.fleet import scrape as scrape_metrics
from kvxfer.client.engine import EngineClient
from kvxfer.client.shm import ShmKVCache, shm_kv_cache
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.requests import AbortState, EngineEvent, Received
from kvxfer.dataplane.adapter import AgentOptions, NixlAgent
from kvxfer.dataplane.readers import BackendFactory, Readers
from kvxfer.dataplane.serving import ServingAgent
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import load_settings
from kvxfer.server.sidecar import Sidecar
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.lane import Kind, read_frame


def start_sidecar(tmp: Path, name: str, *args: str, peer_port: int = 0) -> Proc:
    return Fleet(tmp).sidecar(name, *args, peer_port=peer_port)


def start_engine(
    tmp: Path, sidecar: Proc, model: str, role: str, *args: str, num_blocks: int = 128
) -> EngineSim:
    extra = ("--num-blocks", str(num_blocks), "--state-blocks", "4", *args)
    return Fleet(tmp).engine(sidecar, model, role, *extra)


@dataclass
class PdSidecars:
    """A prefill sidecar `p` and a decode sidecar `d` with one engine each; `procs` are
    stopped in order when the pair ends (a test may add its own)."""

    p: Proc
    d: Proc
    pe: EngineSim
    de: EngineSim
    procs: list[Proc | EngineSim]


@contextlib.contextmanager
def pd_sidecars(
    tmp: Path, model: str, p_args: Sequence[str] = (), d_args: Sequence[str] = ()
) -> Iterator[PdSidecars]:
    procs: list[Proc | EngineSim] = []
    try:
        p = start_sidecar(tmp, "p", *p_args)
        procs.insert(0, p)
        d = start_sidecar(tmp, "d", *d_args)
        procs.insert(0, d)
        pe = start_engine(tmp, p, model, "prefill")
        procs.insert(0, pe)
        de = start_engine(tmp, d, model, "decode")
        procs.insert(0, de)
        yield PdSidecars(p, d, pe, de, procs)
    finally:
        for proc in procs:
            proc.stop()


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spans(group_ids: Mapping[int, Sequence[int]], first: int = 0) -> list[BlockSpan]:
    return [
        BlockSpan(GroupId(g), first, tuple(BlockId(b) for b in ids)) for g, ids in group_ids.items()
    ]


@dataclass
class DecodeImage:
    """What every byte of the decode engine's buffers must hold: its pattern, plus the
    blocks earlier verified pulls wrote."""

    engine: EngineSim
    written: dict[tuple[str, int], npt.NDArray[np.uint8]] = field(default_factory=dict)

    def expect_pull(
        self,
        source: EngineSim,
        src_spans: Sequence[BlockSpan],
        dst_spans: Sequence[BlockSpan],
        num_tokens: int,
        computed: int,
        failed: Mapping[int, Sequence[int]],
    ) -> int:
        """Check the moved blocks (oracle's choice, minus `failed`) equal the source's;
        record them; return the bytes that moved."""
        layout = source.layout
        by_group_src = {s.group_id: s for s in src_spans}
        by_group_dst = {s.group_id: s for s in dst_spans}
        moved_bytes = 0
        for group in layout.groups:
            lost = set(failed.get(group.group_id, ()))
            for logical in sorted(oracle_blocks(group, num_tokens, computed, layout.block_size)):
                if logical in lost:
                    continue
                src_id = by_group_src[group.group_id].block_id(logical)
                dst_id = by_group_dst[group.group_id].block_id(logical)
                for tensor in group.tensors:
                    want = source.block(tensor.name, src_id)
                    got = self.engine.block(tensor.name, dst_id)
                    assert np.array_equal(got, want), (
                        f"{tensor.name} logical block {logical} (dst id {dst_id}) differs"
                    )
                    self.written[(tensor.name, dst_id)] = want.copy()
                    moved_bytes += tensor.bytes_per_block
        return moved_bytes

    def accept_failed(
        self, dst_spans: Sequence[BlockSpan], failed: Mapping[int, Sequence[int]]
    ) -> None:
        """Blocks reported failed hold whatever arrived before the report (a read runs
        beside its BeginRead): take them as they are now, so `check_all` then checks
        that nothing else was written and nothing lands in them later."""
        by_group = {s.group_id: s for s in dst_spans}
        for group in self.engine.layout.groups:
            for logical in failed.get(group.group_id, ()):
                block = by_group[group.group_id].block_id(logical)
                for tensor in group.tensors:
                    self.written[(tensor.name, block)] = self.engine.block(
                        tensor.name, block
                    ).copy()

    def check_all(self) -> None:
        """Every byte of every decode buffer: pattern, or a recorded pulled block."""
        problem = self.engine.image_mismatch(self.written)
        assert problem is None, problem


WATCH_PROBE = "watch-probe"


class Events:
    """Collects an engine's events in the background for the length of a test.

    The watch reaches the sidecar some time after this starts it, perhaps after the
    test's next calls. Until then the sidecar holds the engine's events for it, but only
    while the engine is registered: an engine that retires first takes its events with
    it, and the watch is refused. A test that makes its engine go away awaits `watching`
    first."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._queue: asyncio.Queue[EngineEvent | Exception] = asyncio.Queue()
        self._failure: Exception | None = None  # the watch's, until `next` raised it
        self._task = asyncio.create_task(self._pump(client))

    async def _pump(self, client: EngineClient) -> None:
        try:
            async for event in client.events():
                await self._queue.put(event)
        except Exception as exc:  # the watch refused or broken
            self._failure = exc
            await self._queue.put(exc)  # `next` raises it at once, not at its timeout

    async def watching(self, blocks: Sequence[BlockSpan]) -> None:
        """Return once the sidecar watches this engine's events. Only an event can show
        it: `blocks` (logical block 0 of every group) expected for one token and aborted
        at once, heard as Received(aborted) (its sidecar must take part in pushes). The
        first event: await this before any other."""
        await self._client.expect(WATCH_PROBE, 1, blocks)
        assert await self._client.abort(WATCH_PROBE) is AbortState.EXPECTED
        heard = await self.next()
        assert isinstance(heard, Received) and heard.request_id == WATCH_PROBE, heard

    async def next(self, timeout_s: float = 20.0) -> EngineEvent:
        """The next event; what ended the watch, if it failed (not a timeout later)."""
        got = await asyncio.wait_for(self._queue.get(), timeout_s)
        if isinstance(got, Exception):
            self._failure = None
            raise got
        return got

    def pending(self) -> int:
        """Events (or the watch's failure) not yet taken by `next`."""
        return self._queue.qsize()

    async def close(self) -> None:
        """Stop watching; raises the watch's failure if `next` did not."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._failure is not None:
            raise self._failure


@contextlib.asynccontextmanager
async def engine_link(
    sidecar: Proc, engine: EngineSim
) -> AsyncIterator[tuple[EngineClient, Events]]:
    async with EngineClient(sidecar.ready["engine_address"], engine_id=engine.engine_id) as client:
        events = Events(client)
        try:
            yield client, events
        finally:
            await events.close()


async def unregister(sidecar: Proc, engine: EngineSim) -> None:
    """Unregister `engine` over a link of its own; returns once its memory is unmapped
    (or, when a transfer would not end, left mapped)."""
    async with EngineClient(sidecar.ready["engine_address"], engine_id=engine.engine_id) as c:
        await c.unregister()


async def exchange(
    connection: Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    *frames: bytes,
    half_close: bool = False,
    wait_s: float = 0.5,
) -> tuple[list[tuple[int, Kind, bytes]], bool]:
    """Send raw bytes to a lane (engine or peer) over `connection`, then read what
    comes back for up to `wait_s`: the frames, and whether the sidecar closed it."""
    reader, writer = await connection
    got: list[tuple[int, Kind, bytes]] = []
    try:
        for raw in frames:
            writer.write(raw)
        await writer.drain()
        if half_close:
            writer.write_eof()
        try:
            while (item := await asyncio.wait_for(read_frame(reader), wait_s)) is not None:
                got.append(item)
        except TimeoutError:
            return got, False
        return got, True
    finally:
        writer.close()


def scrape(sidecar: Proc) -> Samples:
    """One real scrape of the sidecar's /metrics."""
    return scrape_metrics(sidecar.ready["metrics_address"])


async def being_read(sidecar: Proc, request_id: str, timeout_s: float = 30.0) -> None:
    """Wait until a peer has begun reading `request_id` from this (prefill) sidecar:
    a Pull is accepted before its BeginRead reaches the peer."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(sidecar.ready["engine_address"]) as channel:
        admin = pb_grpc.AdminServiceStub(channel)
        while time.monotonic() < deadline:
            status = await admin.GetStatus(pb.GetStatusRequest(), timeout=5)
            if any(lease.request_id == request_id and lease.reading for lease in status.leases):
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"no peer began reading {request_id!r} within {timeout_s} s")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it (a sidecar and its serving agent)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, ()))
    return tree


def freeze(sidecar: Proc) -> None:
    """SIGSTOP the sidecar with its serving-agent process, as a paused pod or a stalled
    host freezes both (a sidecar is two processes: docs/dataplane.md)."""
    for pid in process_tree(sidecar.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)


def thaw(sidecar: Proc) -> None:
    for pid in process_tree(sidecar.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@dataclass
class OneEngine:
    """A sidecar with one simulated prefill engine registered (`one_engine`)."""

    fleet: Fleet
    sidecar: Proc
    engine: EngineSim

    @property
    def address(self) -> str:
        return str(self.sidecar.ready["engine_address"])


@contextlib.contextmanager
def one_engine(directory: Path, model: str, num_blocks: int = 16) -> Iterator[OneEngine]:
    """A sidecar process and one engine-sim of `model` on it, stopped on the way out."""
    fleet = Fleet(directory)
    try:
        sidecar = fleet.sidecar("s")
        engine = fleet.engine(sidecar, model, "prefill", "--num-blocks", str(num_blocks))
        yield OneEngine(fleet, sidecar, engine)
    finally:
        fleet.close()


@contextlib.contextmanager
def prefill_beside_cache(
    tmp: Path, model: str, num_blocks: int, name: str, *args: str
) -> Iterator[tuple[Proc, EngineSim, ShmKVCache]]:
    """A prefill sidecar process (`args`) with one engine-sim of `model`, and a KV cache of
    the same layout in this process's shared memory, for an `in_process_sidecar` to
    register as its decode engine; all stopped and unlinked on the way out."""
    procs: list[Proc | EngineSim] = []
    try:
        p = start_sidecar(tmp, "p", *args)
        procs.append(p)
        pe = start_engine(tmp, p, model, "prefill", num_blocks=num_blocks)
        procs.append(pe)
        with shm_kv_cache(pe.layout, num_blocks, prefix=f"kvxfer-{name}-{os.getpid()}") as kv:
            yield p, pe, kv
    finally:
        for proc in reversed(procs):
            proc.stop()


@contextlib.asynccontextmanager
async def in_process_sidecar(
    name: str, *args: str, readers: BackendFactory | None = None
) -> AsyncIterator[Sidecar]:
    """A real `Sidecar` in the test's own process (real NIXL agents, a serving agent, an
    engine port on loopback TCP), so that a test can reach a seam inside it; `readers`
    makes its reading or writing agents (plain NixlAgents by default)."""
    settings = load_settings(
        [
            "--peer-address", "127.0.0.1:0",
            "--engine-address", "127.0.0.1:0",
            "--insecure-engine-tcp",
            "--sidecar-id", name,
            *args,
        ]
    )  # fmt: skip
    backend = ServingAgent(name)
    await backend.start()
    factory = readers or (lambda prefix: NixlAgent(prefix, AgentOptions()))
    sidecar = Sidecar(
        settings, backend, Metrics(), Readers(factory, per_pair=settings.transfer.agents_per_peer)
    )
    sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.shutdown(1.0)


async def pump(events: AsyncIterator[EngineEvent], into: asyncio.Queue[EngineEvent]) -> None:
    """Forward an in-process sidecar's events for an engine into a queue."""
    async for event in events:
        await into.put(event)
