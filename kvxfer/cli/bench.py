"""`kvxfer-cli bench`: kvxfer end to end against raw NIXL, side by side, same buffers.

One run starts a prefill and a decode sidecar and, per model, a prefill and a
decode engine-sim. Every case reads the same planned bytes from the prefill
engine's shared memory into the decode engine's, four ways:

- memcpy:    numpy copies of the planned ranges in this process (the host limit)
- raw:       this process's own NIXL agent reads from the prefill *sidecar's*
             agent with one descriptor per contiguous region range: the ceiling
- per_block: the same agents, one descriptor per (region, block) from prepared
             lists, as vLLM's NIXL connector posts them
- kvxfer:    engine Pull call -> PullDone event, through both sidecars

It reports GB/s (planned bytes over wall time), ratios to the ceiling, the
per-request overhead over raw for small requests and bytes vs a
full-attention transfer. It measures; it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer._exceptions import InvalidInputError, KvxferError, NotFoundError
from kvxfer.cli.admin import fetch_hello
from kvxfer.cli.bench_concurrency import (
    DEFAULT_MAX_GIB,
    Burst,
    PullOnce,
    measure_levels,
    percentile,
    raw_burst,
    threads_cpu_ns,
    tree,
)
from kvxfer.cli.bench_raw import per_block_read, raw_read, split_per_block, whole_descriptors
from kvxfer.cli.bench_table import report_text
from kvxfer.cli.bench_tp import Pairing, PairingRun, measure_pairings, pairings
from kvxfer.cli.fleet import (
    EngineView,
    Fleet,
    Proc,
    local_fleet,
    metric,
    run_until_interrupted,
    scrape,
)
from kvxfer.cli.main import EXIT_OK
from kvxfer.cli.render import Progress
from kvxfer.client.engine import EngineClient
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind
from kvxfer.core.planner import (
    TransferPlan,
    full_attention_bytes,
    plan_blocks,
    plan_transfer,
    pool_blocks,
)
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import PullDone, PullStatus, TransferParams
from kvxfer.dataplane.adapter import THREAD_PREFIX, NixlAgent
from kvxfer.dataplane.descriptors import DescArray
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer
from kvxfer.wire.loops import within
from kvxfer.wire.sidecar import PeerHello

MODELS = ("gpt-oss-20b", "gemma-3-4b-it", "llama-3.1-8b", "qwen3-next-80b-a3b")
# "16" is one block per group: a pull's fixed cost with next to nothing to copy (what
# a host whose reads are short, RDMA, sees of kvxfer); not run unless asked for.
SIZES = {"16": 16, "1k": 1024, "16k": 16384, "128k": 131072}
DEFAULT_SIZES = ("1k", "16k", "128k")
# Rounds per case when --repeat is not given. A 1k round takes a few tens of ms, and
# its overhead is judged at p50 and p99: 100 rounds make a p99 (the 99th of 100)
# instead of the largest of a handful. Larger sizes run a few long rounds.
SMALL_ROUNDS = {"16": 100, "1k": 100}
BLOCK = 16
SHM_BUDGET = 0.6  # of MemAvailable, for both engines of a model together


def memcpy_round(plan: TransferPlan, src: Callable[[str], Any], dst: Callable[[str], Any]) -> float:
    start = time.perf_counter()
    for chunk in plan.chunks:
        for d in chunk.descriptors():
            dst(d.dst_buffer)[d.dst_offset : d.dst_offset + d.length] = src(d.src_buffer)[
                d.src_offset : d.src_offset + d.length
            ]
    return time.perf_counter() - start


Method = Callable[[], Awaitable[float]]


async def run_rounds(methods: dict[str, Method], repeat: int) -> dict[str, list[float]]:
    """Seconds per method for `repeat` rounds, after one warm-up round that is dropped.

    The order rotates every round: on a small shared machine the position in a round
    matters (caches, other processes), and no method should always go last.
    """
    times: dict[str, list[float]] = {name: [] for name in methods}
    order = list(methods)
    for i in range(repeat + 1):
        turn = order[i % len(order) :] + order[: i % len(order)]
        for name in turn:
            elapsed = await methods[name]()
            if i:
                times[name].append(elapsed)
    return times


def summarize(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    """GB/s of each method's median, and kvxfer against raw two ways: the ratio of the
    medians, and per round (raw and kvxfer ran back to back, so a round's ratio cancels
    the drift of a shared machine): min, median, max. The overhead is kvxfer's p50
    (p99) less raw's p50 (p99), each percentile over the rounds (nearest rank)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    p99 = {k: percentile(times[k], 99) for k in ("raw", "kvxfer")}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    rounds = [raw / kvx for raw, kvx in zip(times["raw"], times["kvxfer"], strict=True)]
    return {
        "bytes": nbytes,
        "memcpy_gbps": round(gbps["memcpy"], 3),
        "raw_nixl_gbps": round(gbps["raw"], 3),
        "per_block_gbps": round(gbps["per_block"], 3),
        "kvxfer_gbps": round(gbps["kvxfer"], 3),
        "kvxfer_vs_raw": round(gbps["kvxfer"] / gbps["raw"], 3),
        "kvxfer_vs_raw_rounds": {
            "min": round(min(rounds), 3),
            "median": round(statistics.median(rounds), 3),
            "max": round(max(rounds), 3),
        },
        "per_block_vs_raw": round(gbps["per_block"] / gbps["raw"], 3),
        "raw_ms_p50": round(med["raw"] * 1e3, 3),
        "kvxfer_ms_p50": round(med["kvxfer"] * 1e3, 3),
        "overhead_ms_p50": round((med["kvxfer"] - med["raw"]) * 1e3, 3),
        "rounds": len(rounds),
        "raw_ms_p99": round(p99["raw"] * 1e3, 3),
        "kvxfer_ms_p99": round(p99["kvxfer"] * 1e3, 3),
        "overhead_ms_p99": round((p99["kvxfer"] - p99["raw"]) * 1e3, 3),
        **_hops(med),
    }


def pull_cpu(cpu: dict[str, list[float]]) -> dict[str, float]:
    """p50 of the CPU each place spent between a pull's call and its PullDone, in ms: on
    a host with few cores, work beside the copy (BeginRead at both sidecars, the
    engine's own) waits for the core the copy leaves, so it counts as much as the
    hand-offs before and after it."""
    return {where: round(statistics.median(ms), 3) for where, ms in cpu.items() if ms}


def _hops(med: dict[str, float]) -> dict[str, Any]:
    """The bare hand-offs on a pull's critical path, timed in the same rounds with no
    pull behind them: an engine call the decode sidecar refuses at once (engine ->
    sidecar -> engine, over the bench's engine transport) and a NIXL-thread command
    that does nothing (loop -> thread -> loop). A pull crosses each once: the Pull
    call there, its PullDone back; its chunks to the NIXL thread, their outcome back.
    Their sum is what it pays for crossing processes and threads before any work."""
    if "engine_call" not in med or "nixl_thread" not in med:
        return {}
    call, thread = med["engine_call"] * 1e3, med["nixl_thread"] * 1e3
    return {
        "engine_call_ms_p50": round(call, 3),
        "nixl_thread_ms_p50": round(thread, 3),
        "hops_ms_p50": round(call + thread, 3),
    }


def host_memcpy_gbps(nbytes: int = 256 << 20) -> float:
    a = np.ones(nbytes, np.uint8)
    b = np.zeros(nbytes, np.uint8)
    b[:] = a  # touch
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        b[:] = a
        runs.append(time.perf_counter() - start)
    return nbytes / min(runs) / 1e9


# -- the run -------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelSetup:
    model: str
    sizes: list[str]
    engine_args: tuple[str, ...]
    skipped: list[dict[str, Any]]


def run_bench(args: argparse.Namespace) -> int:
    if not args.concurrency:  # their bursts run only with it: never silently unused
        for flag, value in (
            ("--concurrency-sizes", args.concurrency_sizes),
            ("--concurrency-max-gib", args.concurrency_max_gib),
        ):
            if value is not None:
                raise InvalidInputError(flag, "applies only with --concurrency")
    models = args.models or list(MODELS)
    sizes = args.sizes or (["1k", "16k"] if args.quick else list(DEFAULT_SIZES))
    repeat = args.repeat or (2 if args.quick else 5)
    options = _Options(
        sizes=sizes,
        repeat=repeat,
        rounds=rounds_per_size(sizes, args.repeat, repeat),
        show=not args.json,
        levels=tuple(args.concurrency or ()),
        level_sizes=args.concurrency_sizes or ["1k", "16k"],
        level_rounds=1 if args.quick else 2,
        level_max_bytes=int((args.concurrency_max_gib or DEFAULT_MAX_GIB) * 2**30),
        pairings=tuple(pairings(args.tp or [], args.modes, args.orders or ()))
        if args.tp or args.orders or args.modes != ["pull"]
        else (),
        lane=not args.engine_grpc,
    )
    scope: contextlib.AbstractContextManager[Fleet] = local_fleet(
        "kvxfer-bench-", "kvxfer-cli bench"
    )
    hosts = None
    if args.multihost:
        from kvxfer.cli import bench_multihost as multihost  # noqa: PLC0415

        hosts = multihost.inside()
        if hosts is None:  # make the hosts and run again inside the decode one
            return multihost.run_in_hosts(args.argv)
        scope = multihost.host_fleet(hosts)
    with scope as fleet:
        report = run_until_interrupted(_bench(models, options, fleet))
        if hosts is not None:
            report["multihost"] = multihost.describe(hosts)
    if args.json:
        print(json.dumps(report))
    else:
        print(report_text(report))
    return EXIT_OK


def rounds_per_size(sizes: Sequence[str], repeat: int | None, default: int) -> dict[str, int]:
    """Measured rounds of each size's case: `--repeat` for every size when given, else
    `SMALL_ROUNDS` at the small sizes and `default` (2 with `--quick`, else 5) at the
    others."""
    return {s: repeat or SMALL_ROUNDS.get(s, default) for s in sizes}


@dataclass(frozen=True)
class _Options:
    sizes: Sequence[str]
    repeat: int  # rounds per case of the TP pairings, and of a size `rounds` leaves out
    show: bool
    rounds: Mapping[str, int] = field(default_factory=dict)  # per size of `sizes`
    levels: tuple[int, ...] = ()  # concurrency levels, on the first model only
    level_sizes: Sequence[str] = ("1k",)
    level_rounds: int = 1
    level_max_bytes: int = int(DEFAULT_MAX_GIB * 2**30)
    pairings: tuple[Pairing, ...] = ()  # TP sizes and modes, beside equal TP (bench_tp)
    lane: bool = True  # the engines' calls: the engine lane, or gRPC


async def _bench(models: Sequence[str], options: _Options, fleet: Fleet) -> dict[str, Any]:
    sizes = options.sizes
    setups = [_setup(m, sorted({*sizes, *options.level_sizes}, key=SIZES.__getitem__)
                     if options.levels and m == models[0] else sizes) for m in models]  # fmt: skip
    total = sum(len(s.sizes) for s in setups)
    with Progress("bench", total, enabled=options.show) as progress:
        return await _measure(setups, fleet, progress, options)


async def _measure(
    setups: Sequence[_ModelSetup], fleet: Fleet, progress: Progress, options: _Options
) -> dict[str, Any]:
    sizes, repeat = options.sizes, options.repeat
    progress.note("starting 2 sidecars")
    p, d = await asyncio.gather(
        asyncio.to_thread(fleet.sidecar, "p"), asyncio.to_thread(fleet.sidecar, "d")
    )
    report: dict[str, Any] = {
        "engine_transport": "lane" if options.lane else "grpc",
        "memcpy_gbps": round(host_memcpy_gbps(), 3),
        "cases": [],
        "skipped": [],
        "handshakes": [],
    }
    if options.levels:
        report["concurrency"] = []
    if options.pairings:
        report["pairings"] = []
    agent = NixlAgent("kvxfer-bench")
    try:
        for setup in setups:
            report["skipped"] += setup.skipped
            if not setup.sizes:
                continue
            progress.note(f"starting engines for {setup.model}")
            pe, de = await asyncio.gather(
                asyncio.to_thread(fleet.engine, p, setup.model, "prefill", *setup.engine_args),
                asyncio.to_thread(fleet.engine, d, setup.model, "decode", *setup.engine_args),
            )
            try:
                async with _Case.open(agent, p, d, pe, de, options.lane) as case:
                    report["handshakes"].append(await case.first_pulls())
                    for size in setup.sizes:
                        note = ""
                        if size in sizes:
                            rounds = options.rounds.get(size, repeat)
                            row = await case.measure(SIZES[size], rounds)
                            report["cases"].append(row)
                            note = f"kvxfer/raw {row['kvxfer_vs_raw']:.3f}"
                        if "concurrency" in report and size in options.level_sizes:
                            rows, skipped = await measure_levels(
                                case, SIZES[size], options.levels, options.level_rounds,
                                options.level_max_bytes, {"prefill": p.pid, "decode": d.pid},
                            )  # fmt: skip
                            report["concurrency"] += [{"model": setup.model, **r} for r in rows]
                            report["skipped"] += [{"model": setup.model, **k} for k in skipped]
                            note = f"{len(rows)} concurrency levels"
                        progress.advance(f"{setup.model} {size}: {note}")
            finally:
                await asyncio.gather(
                    asyncio.to_thread(fleet.stop_engine, pe),
                    asyncio.to_thread(fleet.stop_engine, de),
                )
            if options.pairings:
                run = PairingRun(fleet, p, d, agent, BLOCK, setup.engine_args, repeat, run_rounds)
                tokens = [SIZES[s] for s in setup.sizes if s in sizes]
                rows, skipped = await measure_pairings(run, setup.model, tokens, options.pairings)
                report["pairings"] += rows
                report["skipped"] += skipped
                progress.note(f"{setup.model}: {len(rows)} TP pairing cases")
    finally:
        await agent.close()
    report["handshake_ms_p50"] = _median_of(report["handshakes"], "handshake_ms")
    return report


def _median_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _setup(model: str, sizes: Sequence[str]) -> _ModelSetup:
    layout = layout_for_model(model, block_size=BLOCK)
    available = mem_available()
    keep, skipped = [], []
    for size in sizes:
        need = 2 * engine_bytes(layout, SIZES[size])
        if need > SHM_BUDGET * available:
            skipped.append(
                {
                    "model": model,
                    "tokens": SIZES[size],
                    "reason": f"needs {need / 2**30:.1f} GiB of shared memory for both engines, "
                    f"more than {SHM_BUDGET:.0%} of the {available / 2**30:.1f} GiB available",
                }
            )
        else:
            keep.append(size)
    largest = max((SIZES[s] for s in keep), default=BLOCK)
    pools = pool_blocks(layout, largest)
    engine_args = (
        "--block-size", str(BLOCK),
        "--num-blocks", str(pools[GroupKind.FULL_ATTENTION]),
        "--sliding-blocks", str(pools[GroupKind.SLIDING_WINDOW]),
        "--chunked-blocks", str(pools[GroupKind.CHUNKED_LOCAL]),
        "--state-blocks", "1",
    )  # fmt: skip
    return _ModelSetup(model, keep, engine_args, skipped)


def engine_bytes(layout: EngineLayout, tokens: int) -> int:
    """Shared memory one engine needs to hold one request of `tokens`."""
    pools = pool_blocks(layout, tokens)
    return sum(pools[g.kind] * g.bytes_per_block for g in layout.groups)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


class _Case:
    """One model's engines, as seen by both the sidecars and this process's agent."""

    def __init__(
        self, agent: NixlAgent, p: Proc, d: Proc, pe: EngineView, de: EngineView, lane: bool
    ) -> None:
        self.agent, self.p, self.d, self.pe, self.de = agent, p, d, pe, de
        self.local: list[MappedBuffer] = []
        self.writable: dict[str, npt.NDArray[np.uint8]] = {}
        self.peer = ""
        self.second: tuple[NixlAgent, str] | None = None  # `_second_agent`
        self.hello: PeerHello | None = None
        self.ids = 0
        self.p_client = EngineClient(p.ready["engine_address"], engine_id=pe.engine_id, lane=lane)
        self.d_client = EngineClient(d.ready["engine_address"], engine_id=de.engine_id, lane=lane)
        self.waiting: dict[str, asyncio.Future[PullDone]] = {}
        self.pump: asyncio.Task[None] | None = None
        self.usage: dict[str, list[int]] = {}  # processes whose CPU a pull is charged
        self.cpu: dict[str, list[float]] = {}  # ms of CPU per pull, by where it ran

    @classmethod
    def open(
        cls, agent: NixlAgent, p: Proc, d: Proc, pe: EngineView, de: EngineView, lane: bool
    ) -> Any:

        @contextlib.asynccontextmanager
        async def scope() -> Any:
            case = cls(agent, p, d, pe, de, lane)
            await case._start()
            try:
                yield case
            finally:
                await case._stop()

        return scope()

    async def _start(self) -> None:
        handles = [
            BufferHandle(b["name"], MemoryKind.DRAM, b["size_bytes"], shm_name=b["shm_name"])
            for b in self.de.ready["buffers"]
        ]
        self.local = [open_buffer(h) for h in handles]
        await self.agent.register(self.local)
        for h in handles:
            fd = os.open(f"/dev/shm/{h.shm_name}", os.O_RDWR)
            try:
                self.writable[h.name] = np.frombuffer(mmap.mmap(fd, h.size_bytes), np.uint8)
            finally:
                os.close(fd)
        self.hello = await fetch_hello(
            self.p.ready["peer_address"],
            self.de.layout,
            dry_run=False,  # the raw reads need the prefill agent's metadata
            timeout_s=10,
            sidecar_id="kvxfer-bench",
        )
        self.peer = await self.agent.add_peer(self.hello.agent_metadata)
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for event in self.d_client.events():
            future = self.waiting.pop(event.request_id, None)
            if future is not None and isinstance(event, PullDone):
                future.set_result(event)

    async def _stop(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
        await self.p_client.close()
        await self.d_client.close()
        await self.agent.deregister(self.local)
        if self.second is not None:
            await self.second[0].close()  # before the buffers it registered are unmapped
        for buffer in self.local:
            buffer.close()
        self.writable.clear()

    def _spans(self, tokens: int) -> list[BlockSpan]:
        spans = []
        for plan in plan_blocks(self.pe.layout, tokens, 0):
            if plan.blocks:
                ids = tuple(BlockId(i) for i in range(len(plan.blocks)))
                spans.append(BlockSpan(GroupId(plan.group.group_id), plan.blocks.start, ids))
        return spans

    async def measure(self, tokens: int, repeat: int) -> dict[str, Any]:
        assert self.hello is not None
        spans = self._spans(tokens)
        src_layout, dst_layout = self.pe.layout, self.de.layout
        whole = plan_transfer(src_layout, dst_layout, spans, spans, tokens, 0, chunk_blocks=1 << 30)
        local = bind(self.local)
        remote, mine, sizes = whole_descriptors(whole, self.hello.buffers, local)
        block_remote, block_local = split_per_block(remote, mine, sizes)
        # Rounds rotate this order, so each method always follows the same one. The
        # bare hand-offs follow raw: after kvxfer they would share the sidecars with
        # the pull's EndRead, which goes on after its PullDone.
        methods: dict[str, Method] = {
            "memcpy": lambda: asyncio.to_thread(
                memcpy_round, whole, self.pe.view, self.writable.__getitem__
            ),
            "raw": lambda: self.agent.run_on_agent(lambda a: raw_read(a, self.peer, mine, remote)),
            "engine_call": self._engine_call,
            "nixl_thread": self._nixl_thread,
            "per_block": lambda: self.agent.run_on_agent(
                lambda a: per_block_read(a, self.peer, block_local, block_remote)
            ),
            "kvxfer": lambda: self._kvxfer(tokens, spans, whole.nbytes),
        }
        self.usage = {"decode": tree(self.d.pid), "prefill": tree(self.p.pid)}
        self.cpu = {}
        times = await run_rounds(methods, repeat)
        return {
            "model": self.pe.ready["model"],
            "tokens": tokens,
            **summarize(times, whole.nbytes),
            "cpu_ms_per_pull_p50": pull_cpu({k: v[1:] for k, v in self.cpu.items()}),
            "full_attention_bytes": full_attention_bytes(src_layout, tokens, 0),
            "descriptors_raw": len(mine),
            "descriptors_per_block": len(block_local),
        }

    async def _kvxfer(self, tokens: int, spans: list[BlockSpan], nbytes: int) -> float:
        """Seconds from the decode engine's Pull call to its PullDone event."""
        (pull,) = await self._published(tokens, spans, nbytes, 1)
        sidecars = self._sidecars_cpu_ns()
        engine = time.thread_time_ns()  # this loop's thread: the engine's calls and events
        start = time.perf_counter()
        await pull()
        elapsed = time.perf_counter() - start
        used = {"engine_loop": time.thread_time_ns() - engine}
        used |= {k: ns - sidecars[k] for k, ns in self._sidecars_cpu_ns().items()}
        for where, ns in used.items():  # the warm-up round's too, dropped later
            self.cpu.setdefault(where, []).append(ns / 1e6)
        return elapsed

    def _sidecars_cpu_ns(self) -> dict[str, int]:
        """CPU nanoseconds so far of each sidecar, and of the decode sidecar's NIXL
        threads (where a read on one host copies)."""
        decode, copying = threads_cpu_ns(self.usage["decode"], THREAD_PREFIX)
        prefill, _ = threads_cpu_ns(self.usage["prefill"], THREAD_PREFIX)
        return {
            "decode_sidecar": decode,
            "decode_nixl_threads": copying,
            "prefill_sidecar": prefill,
        }

    async def _engine_call(self) -> float:
        """Seconds of an Abort of a request the decode sidecar never saw, refused at
        once (NotFound): a round trip over the engine's transport with as little work at
        the sidecar as any call."""
        start = time.perf_counter()
        with contextlib.suppress(NotFoundError):
            await self.d_client.abort("bench-hop")
        return time.perf_counter() - start

    async def _nixl_thread(self) -> float:
        """Seconds of a command that does nothing, from this loop through an agent's
        NIXL thread and back: the hand-offs a chunk makes to be posted and reported."""
        start = time.perf_counter()
        await self.agent.run_on_agent(lambda _agent: None)
        return time.perf_counter() - start

    async def _published(
        self, tokens: int, spans: list[BlockSpan], nbytes: int, count: int
    ) -> list[PullOnce]:
        """Publish `count` requests at the prefill engine (not timed); each returned call
        pulls one into the decode engine and returns at its PullDone."""
        ids = []
        for _ in range(count):
            self.ids += 1
            ids.append(f"bench-{tokens}-{self.ids}")
        published = await asyncio.gather(*(self.p_client.publish(i, tokens, spans) for i in ids))
        loop = asyncio.get_running_loop()

        def pull_once(params: TransferParams) -> PullOnce:
            async def pull() -> None:
                done: asyncio.Future[PullDone] = loop.create_future()
                self.waiting[params.request_id] = done
                try:
                    await self.d_client.pull(params, spans, 0)
                    event = await within(done, 600)
                finally:
                    self.waiting.pop(params.request_id, None)
                if event.status is not PullStatus.OK or event.bytes_moved != nbytes:
                    raise KvxferError(
                        f"bench pull {params.request_id} ended {event.status.value}: {event.reason}"
                    )

            return pull

        return [pull_once(p) for p in published]

    # -- the concurrency bench's BurstCase -------------------------------------

    def _descriptors(self, tokens: int) -> tuple[list[BlockSpan], int, DescArray, DescArray]:
        assert self.hello is not None
        spans = self._spans(tokens)
        whole = plan_transfer(
            self.pe.layout, self.de.layout, spans, spans, tokens, 0, chunk_blocks=1 << 30
        )
        remote, mine, _ = whole_descriptors(whole, self.hello.buffers, bind(self.local))
        return spans, whole.nbytes, mine, remote

    def pull_bytes(self, tokens: int) -> int:
        return self._descriptors(tokens)[1]

    async def kvxfer_burst(self, tokens: int, level: int) -> list[PullOnce]:
        spans, nbytes, _, _ = self._descriptors(tokens)
        return await self._published(tokens, spans, nbytes, level)

    async def raw_burst(self, tokens: int, level: int, agents: int = 1) -> Burst:
        _, _, mine, remote = self._descriptors(tokens)
        if agents == 1:
            return await self.agent.run_on_agent(
                lambda a: raw_burst(a, self.peer, mine, remote, level)
            )
        second, peer = await self._second_agent()
        start = time.perf_counter()
        halves = await asyncio.gather(
            self.agent.run_on_agent(lambda a: raw_burst(a, self.peer, mine, remote, level // 2)),
            second.run_on_agent(lambda a: raw_burst(a, peer, mine, remote, level - level // 2)),
        )
        latencies = [t for half in halves for t in half.latencies_s]
        return Burst(time.perf_counter() - start, latencies)

    async def _second_agent(self) -> tuple[NixlAgent, str]:
        """A second agent of the bench's, its own thread, with the same buffers and peer
        (for raw NIXL on two agents); made once per case, closed with it."""
        if self.second is None:
            assert self.hello is not None  # `_start` fetched it
            agent = NixlAgent("kvxfer-bench-2")
            try:
                await agent.register(self.local)
                self.second = (agent, await agent.add_peer(self.hello.agent_metadata))
            except BaseException:
                await agent.close()
                raise
        return self.second

    async def first_pulls(self) -> dict[str, Any]:
        """The first pull from this prefill engine (the decode sidecar's handshake with
        it, metadata load and agreement, and its reading agent) against the next one, one
        block each; the handshake's own time from the decode sidecar's metrics."""
        address = self.d.ready["metrics_address"]
        before = await asyncio.to_thread(scrape, address)
        spans, nbytes, _, _ = self._descriptors(BLOCK)
        times = []
        for _ in range(2):
            (pull,) = await self._published(BLOCK, spans, nbytes, 1)
            start = time.perf_counter()
            await pull()
            times.append(time.perf_counter() - start)
        after = await asyncio.to_thread(scrape, address)
        name = "kvxfer_handshake_duration_seconds"
        count = metric(after, f"{name}_count") - metric(before, f"{name}_count")
        total = metric(after, f"{name}_sum") - metric(before, f"{name}_sum")
        return {
            "model": self.pe.ready["model"],
            "handshakes": int(count),
            "handshake_ms": round(1e3 * total / count, 3) if count else None,
            "first_pull_ms": round(times[0] * 1e3, 3),
            "next_pull_ms": round(times[1] * 1e3, 3),
        }
