"""`kvxfer-cli bench --tp 1:2 2:1`: different TP sizes beside equal TP, same model, same
tokens, one run (issue 15, item 5).

Per model and pairing (prefill TP P, decode TP D, transfer mode) the prefill sidecar
gets P engine-sims and the decode sidecar D, one per rank, as in `kvxfer-cli demo
--prefill-tp/--decode-tp`. A request is what the engines do for it there: each prefill
rank publishes it once per decode rank it serves, each decode rank pulls once per
source rank, and the request is done when every pull is; its `valid_tokens` is the
minimum over the pulls (`tp_map.request_valid_tokens`). Timed two ways in alternating
order, one warm-up round dropped:

- raw:    the bench's own NIXL agent posts the same (prefill rank, decode rank)
          descriptors the sidecars plan, one READ handle per pull, all at once, from
          the prefill sidecar's agent into the decode ranks' memory; until the last is done
- kvxfer: every decode rank's Pull calls at once, until the last PullDone

`bytes` is what the plans move, `min_bytes` the exact minimum: every token the decode
ranks need, at each rank's own bytes per token (heads), summed over decode ranks. TP
1 -> 1 is measured the same way so the three sit side by side. Pairings negotiation
would refuse (heads or state that do not split over the ranks) are skipped with
the reason.

`mode` is a case dimension: pull only today; push (WRITE, issue 15 item 3) is refused
by `--modes` (`main.transfer_mode`) until the sidecars do it, and then becomes one more
entry of `main.MODES` and one more branch of `_TpCase` (who posts, and where).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer._exceptions import KvxferError
from kvxfer.cli.admin import fetch_hello
from kvxfer.cli.bench_concurrency import percentile
from kvxfer.cli.bench_raw import raw_posts, whole_descriptors
from kvxfer.cli.fleet import EngineView, Fleet, Proc
from kvxfer.cli.main import MODES
from kvxfer.client.engine import EngineClient
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind
from kvxfer.core.negotiation import find_mismatches
from kvxfer.core.planner import group_blocks, plan_blocks, plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import PullDone, PullStatus
from kvxfer.core.tp_map import pairing_sources, request_valid_tokens
from kvxfer.dataplane.adapter import NixlAgent
from kvxfer.dataplane.descriptors import DescArray
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer
from kvxfer.wire.sidecar import PeerHello

EQUAL = (1, 1)


@dataclass(frozen=True)
class Pairing:
    prefill_tp: int
    decode_tp: int
    mode: str = "pull"

    @property
    def label(self) -> str:
        return f"TP {self.prefill_tp}->{self.decode_tp} {self.mode}"


def pairings(tps: Sequence[tuple[int, int]], modes: Sequence[str]) -> list[Pairing]:
    """Every (TP pairing, mode): equal TP first, so the others sit beside it; no repeats."""
    sizes = list(dict.fromkeys([EQUAL, *tps]))
    return [Pairing(p, d, m) for p, d in sizes for m in dict.fromkeys(modes or MODES)]


def refusal(model: str, pairing: Pairing, block: int) -> str | None:
    """Why negotiation would refuse this pairing (checked before any engine starts)."""
    try:
        prefill = layout_for_model(model, block_size=block, tp_size=pairing.prefill_tp)
        for rank in range(pairing.decode_tp):
            decode = layout_for_model(
                model, block_size=block, tp_size=pairing.decode_tp, tp_rank=rank
            )
            found = [m for m in find_mismatches(decode, prefill) if m.field != "layout.tp_rank"]
            if found:
                return "; ".join(str(m) for m in found[:3])
    except KvxferError as exc:
        return str(exc)
    return None


def min_bytes(layout: EngineLayout, tokens: int) -> int:
    """Bytes of every token this rank needs, at its own bytes per token (a state group:
    its one block)."""
    total = 0
    for group in layout.groups:
        size = layout.block_size_of(group)
        if group.kind is GroupKind.MAMBA:
            total += len(group_blocks(group, tokens, 0, size)) * group.bytes_per_block
        else:
            total += len(group_blocks(group, tokens, 0, 1)) * (group.bytes_per_block // size)
    return total


def summarize_pairing(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    """GB/s of each way's median round, kvxfer against raw as the ratio of the medians
    and per round (min, median, max), and p50/p99 of the rounds."""
    med = {k: statistics.median(v) for k, v in times.items()}
    rounds = [raw / kvx for raw, kvx in zip(times["raw"], times["kvxfer"], strict=True)]

    def ms(name: str, q: float) -> float:
        return round(percentile(times[name], q) * 1e3, 3)

    return {
        "raw_nixl_gbps": round(nbytes / med["raw"] / 1e9, 3),
        "kvxfer_gbps": round(nbytes / med["kvxfer"] / 1e9, 3),
        "kvxfer_vs_raw": round(med["raw"] / med["kvxfer"], 3),
        "kvxfer_vs_raw_rounds": {
            "min": round(min(rounds), 3),
            "median": round(statistics.median(rounds), 3),
            "max": round(max(rounds), 3),
        },
        "raw_ms_p50": ms("raw", 50),
        "raw_ms_p99": ms("raw", 99),
        "kvxfer_ms_p50": ms("kvxfer", 50),
        "kvxfer_ms_p99": ms("kvxfer", 99),
        "overhead_ms_p50": round((med["kvxfer"] - med["raw"]) * 1e3, 3),
    }


Rounds = Callable[
    [dict[str, Callable[[], Awaitable[float]]], int], Awaitable[dict[str, list[float]]]
]


@dataclass(frozen=True)
class PairingRun:
    """What one model's pairings need from the bench: its sidecars, agent and options."""

    fleet: Fleet
    prefill: Proc
    decode: Proc
    agent: NixlAgent
    block: int
    engine_args: tuple[str, ...]  # pool sizes, as for the equal-TP cases
    repeat: int
    rounds: Rounds  # bench.run_rounds: warm-up dropped, order rotated


async def measure_pairings(
    run: PairingRun, model: str, sizes: Sequence[int], wanted: Sequence[Pairing]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per (pairing, size) of `model`, and the pairings skipped with why."""
    rows, skipped = [], []
    for pairing in wanted:
        reason = refusal(model, pairing, run.block)
        if reason is not None:
            skipped.append({"model": model, "pairing": pairing.label, "reason": reason})
            continue
        views = await _engines(run, model, pairing)
        try:
            async with _TpCase.open(run, views) as case:
                for tokens in sizes:
                    row = await case.measure(tokens)
                    rows.append({"model": model, "tokens": tokens, "mode": pairing.mode, **row})
        finally:
            await asyncio.gather(*(asyncio.to_thread(run.fleet.stop_engine, v) for v in views))
    return rows, skipped


async def _engines(run: PairingRun, model: str, pairing: Pairing) -> list[EngineView]:
    """Prefill ranks, then decode ranks, each with its TP size and rank."""
    views = []
    for sidecar, role, size in (
        (run.prefill, "prefill", pairing.prefill_tp),
        (run.decode, "decode", pairing.decode_tp),
    ):
        for rank in range(size):
            tp = ("--tp-size", str(size), "--tp-rank", str(rank))
            views.append(
                await asyncio.to_thread(
                    run.fleet.engine, sidecar, model, role, *run.engine_args, *tp
                )
            )
    return views


@dataclass
class _Rank:
    view: EngineView
    client: EngineClient
    waiting: dict[str, asyncio.Future[PullDone]] = field(default_factory=dict)

    @property
    def layout(self) -> EngineLayout:
        return self.view.layout


@dataclass(frozen=True)
class _Pull:
    source: _Rank
    reader: _Rank
    hello: PeerHello
    peer: str  # the bench agent's name for the prefill sidecar's agent


class _TpCase:
    """One pairing's engines: every rank's client, the decode ranks' memory registered
    with the bench agent, and each (prefill rank, decode rank) it serves."""

    def __init__(self, run: PairingRun, prefill: list[_Rank], decode: list[_Rank]) -> None:
        self.run, self.prefill, self.decode = run, prefill, decode
        self.local: dict[int, list[MappedBuffer]] = {}
        self.pulls: list[_Pull] = []
        self.ids = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, run: PairingRun, views: Sequence[EngineView]) -> AsyncIterator[_TpCase]:
        async with contextlib.AsyncExitStack() as stack:
            ranks = {"prefill": [], "decode": []}  # type: dict[str, list[_Rank]]
            for view in views:
                sidecar = run.prefill if view.ready["role"] == "prefill" else run.decode
                client = EngineClient(sidecar.ready["engine_address"], engine_id=view.engine_id)
                stack.push_async_callback(client.close)
                ranks[view.ready["role"]].append(_Rank(view, client))
            case = cls(run, ranks["prefill"], ranks["decode"])
            pumps = [asyncio.create_task(_pump(r)) for r in case.decode]
            stack.push_async_callback(_cancel, pumps)
            stack.push_async_callback(case._deregister)
            await case._connect()
            yield case

    async def _connect(self) -> None:
        for reader in self.decode:
            handles = [
                BufferHandle(b["name"], MemoryKind.DRAM, b["size_bytes"], shm_name=b["shm_name"])
                for b in reader.view.ready["buffers"]
            ]
            self.local[reader.layout.tp_rank] = [open_buffer(h) for h in handles]
            await self.run.agent.register(self.local[reader.layout.tp_rank])
        peers: dict[bytes, str] = {}
        for reader in self.decode:
            for source in self.prefill:
                if not _serves(source.layout, reader.layout):
                    continue
                hello = await fetch_hello(
                    self.run.prefill.ready["peer_address"], reader.layout, dry_run=False,
                    timeout_s=10, sidecar_id="kvxfer-bench", peer_rank=source.layout.tp_rank,
                )  # fmt: skip
                if hello.agent_metadata not in peers:
                    peers[hello.agent_metadata] = await self.run.agent.add_peer(
                        hello.agent_metadata
                    )
                self.pulls.append(_Pull(source, reader, hello, peers[hello.agent_metadata]))

    async def _deregister(self) -> None:
        for buffers in self.local.values():
            await self.run.agent.deregister(buffers)
            for buffer in buffers:
                buffer.close()

    async def measure(self, tokens: int) -> dict[str, Any]:
        spans = _spans(self.decode[0].layout, tokens)
        posts: list[tuple[str, DescArray, DescArray]] = []
        planned = []
        for pull in self.pulls:
            plan = plan_transfer(
                pull.source.layout, pull.reader.layout, spans, spans, tokens, 0,
                chunk_blocks=1 << 30,
            )  # fmt: skip
            local = bind(self.local[pull.reader.layout.tp_rank])
            remote, mine, _ = whole_descriptors(plan, pull.hello.buffers, local)
            posts.append((pull.peer, mine, remote))
            planned.append(plan.nbytes)
        outcome: dict[str, int] = {}

        async def raw() -> float:
            done = await self.run.agent.run_on_agent(lambda a: raw_posts(a, posts))
            return max(done)

        async def kvxfer() -> float:
            return await self._kvxfer(tokens, spans, planned, outcome)

        times = await self.run.rounds({"raw": raw, "kvxfer": kvxfer}, self.run.repeat)
        nbytes = sum(planned)
        need = sum(min_bytes(r.layout, tokens) for r in self.decode)
        return {
            "prefill_tp": len(self.prefill),
            "decode_tp": len(self.decode),
            "pulls": len(self.pulls),
            "bytes": nbytes,
            "bytes_moved": outcome["bytes_moved"],
            "min_bytes": need,
            "bytes_vs_min": round(outcome["bytes_moved"] / need, 4),
            "descriptors": sum(len(mine) for _, mine, _ in posts),
            "valid_tokens": outcome["valid_tokens"],
            **summarize_pairing(times, nbytes),
        }

    async def _kvxfer(
        self, tokens: int, spans: list[BlockSpan], planned: list[int], outcome: dict[str, int]
    ) -> float:
        """Seconds from the first Pull call to the last PullDone; every pull must end OK
        with its planned bytes. Publishing (each prefill rank once per reader) is not
        timed."""
        self.ids += 1
        params = await asyncio.gather(
            *(p.source.client.publish(_request_id(tokens, self.ids, p), tokens, spans)
              for p in self.pulls)
        )  # fmt: skip
        loop = asyncio.get_running_loop()

        async def one(pull: _Pull, param: Any) -> PullDone:
            done: asyncio.Future[PullDone] = loop.create_future()
            pull.reader.waiting[param.request_id] = done
            try:
                await pull.reader.client.pull(param, spans, 0)
                return await asyncio.wait_for(done, 600)
            finally:
                pull.reader.waiting.pop(param.request_id, None)

        start = time.perf_counter()
        dones = await asyncio.gather(*(one(p, q) for p, q in zip(self.pulls, params, strict=True)))
        elapsed = time.perf_counter() - start
        per_rank: dict[int, int] = {}
        for pull, done, nbytes in zip(self.pulls, dones, planned, strict=True):
            if done.status is not PullStatus.OK or done.bytes_moved != nbytes:
                raise KvxferError(
                    f"bench pull {done.request_id} ended {done.status.value} with "
                    f"{done.bytes_moved} of {nbytes} bytes: {done.reason}"
                )
            rank = pull.reader.layout.tp_rank
            per_rank[rank] = min(per_rank.get(rank, done.valid_tokens), done.valid_tokens)
        outcome["bytes_moved"] = sum(d.bytes_moved for d in dones)
        outcome["valid_tokens"] = request_valid_tokens(per_rank)
        return elapsed


def _request_id(tokens: int, index: int, pull: _Pull) -> str:
    return f"bench-tp-{tokens}-{index}-p{pull.source.layout.tp_rank}-d{pull.reader.layout.tp_rank}"


def _spans(layout: EngineLayout, tokens: int) -> list[BlockSpan]:
    """Block ids from 0 in every group, the same on every rank of both sides (each rank
    has its own memory, and the block size is the same on both sides here)."""
    spans = []
    for plan in plan_blocks(layout, tokens, 0):
        if plan.blocks:
            ids = tuple(BlockId(i) for i in range(len(plan.blocks)))
            spans.append(BlockSpan(GroupId(plan.group.group_id), plan.blocks.start, ids))
    return spans


async def _pump(rank: _Rank) -> None:
    async for event in rank.client.events():
        future = rank.waiting.pop(event.request_id, None)
        if future is not None and isinstance(event, PullDone) and not future.done():
            future.set_result(event)


def _serves(source: EngineLayout, reader: EngineLayout) -> bool:
    """Whether this prefill rank serves this decode rank anything: heads, state byte
    ranges or the latent (equal TP: its own rank)."""
    return source.tp_rank in pairing_sources(source.tp_size, reader)


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Stop the event pumps; bounded, so that a failed case never hangs the bench."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=5)
