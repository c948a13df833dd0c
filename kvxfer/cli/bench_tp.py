"""`kvxfer-cli bench --tp 1:2 2:1`: different TP sizes beside equal TP, same model, same
tokens, one run (issue 15, item 5).

Per model and pairing (prefill TP P, decode TP D, transfer mode) the prefill sidecar
gets P engine-sims and the decode sidecar D, one per rank, as in `kvxfer-cli demo
--prefill-tp/--decode-tp`. A request is what the engines do for it there, one transfer
per (prefill rank, decode rank) a source serves:

- pull: each prefill rank Publishes it once per decode rank it serves, each decode rank
        Pulls once per source rank; done at the last PullDone
- push: each decode rank Expects it once per source rank, each source Pushes its blocks
        (one final Push: the bench has no prefill to overlap); done at the last Received

Its `valid_tokens` is the minimum over the transfers (`tp_map.request_valid_tokens`).
Timed two ways in alternating order, one warm-up round dropped:

- raw:    the bench's own NIXL agent posts the same (prefill rank, decode rank)
          descriptors the sidecars plan, one handle per transfer, all at once, until
          the last is done. Pull: READ from the prefill sidecar's agent into the decode
          ranks' memory (registered with the bench agent). Push: WRITE from the prefill
          ranks' memory (registered with the bench agent) into the decode sidecar's agent
- kvxfer: every Pull (push: Push) call at once, until the last PullDone (Received); the
          announcements (Publish, Expect) are not timed

`bytes` is what the plans move, `min_bytes` the exact minimum: every token the decode
ranks need, at each rank's own bytes per token (heads), summed over decode ranks. TP
1 -> 1 is measured the same way so the pairings sit side by side, and each mode is one
more row of a pairing (`mode`). Pairings negotiation would refuse (heads or state that
do not split over the ranks) are skipped with the reason.
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
from kvxfer.cli.main import MODES, ORDER_FLAGS, pairing_mismatches
from kvxfer.client.engine import EngineClient
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind
from kvxfer.core.planner import group_blocks, plan_blocks, plan_transfer
from kvxfer.core.requests import PullDone, PullStatus, Pushed, Received, TransferParams
from kvxfer.core.tp_map import pairing_sources, request_valid_tokens
from kvxfer.dataplane.adapter import NixlAgent
from kvxfer.dataplane.descriptors import DescArray
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer
from kvxfer.wire.loops import within
from kvxfer.wire.sidecar import PeerHello

EQUAL = (1, 1)
TOKEN_MAJOR = ("token-major", "token-major")


@dataclass(frozen=True)
class Pairing:
    prefill_tp: int
    decode_tp: int
    mode: str = "pull"
    orders: tuple[str, str] = TOKEN_MAJOR  # each side's block order (ORDERS)

    @property
    def label(self) -> str:
        orders = "" if self.orders == TOKEN_MAJOR else f" {self.orders[0]}->{self.orders[1]}"
        return f"TP {self.prefill_tp}->{self.decode_tp}{orders} {self.mode}"


def pairings(
    tps: Sequence[tuple[int, int]],
    modes: Sequence[str],
    orders: Sequence[tuple[str, str]] = (),
) -> list[Pairing]:
    """Every (TP pairing, block orders, mode): equal TP and token-major blocks first, so
    the others sit beside it; no repeats."""
    sizes = list(dict.fromkeys([EQUAL, *tps]))
    kinds = list(dict.fromkeys([TOKEN_MAJOR, *orders]))
    return [
        Pairing(p, d, m, o) for p, d in sizes for o in kinds for m in dict.fromkeys(modes or MODES)
    ]


def refusal(model: str, pairing: Pairing, block: int) -> str | None:
    """Why negotiation would refuse this pairing (checked before any engine starts)."""
    try:
        tps = (pairing.prefill_tp, pairing.decode_tp)
        found = pairing_mismatches(model, (block, block), tps, pairing.orders)
    except KvxferError as exc:
        return str(exc)
    return "; ".join(str(m) for m in found[:3]) or None


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
            async with _TpCase.open(run, views, pairing.mode) as case:
                for tokens in sizes:
                    row = await case.measure(tokens)
                    rows.append(
                        {
                            "model": model,
                            "tokens": tokens,
                            "mode": pairing.mode,
                            "orders": "->".join(pairing.orders),
                            **row,
                        }
                    )
        finally:
            await asyncio.gather(*(asyncio.to_thread(run.fleet.stop_engine, v) for v in views))
    return rows, skipped


async def _engines(run: PairingRun, model: str, pairing: Pairing) -> list[EngineView]:
    """Prefill ranks, then decode ranks, each with its TP size and rank."""
    views = []
    for sidecar, role, size, order in (
        (run.prefill, "prefill", pairing.prefill_tp, pairing.orders[0]),
        (run.decode, "decode", pairing.decode_tp, pairing.orders[1]),
    ):
        for rank in range(size):
            tp = ("--tp-size", str(size), "--tp-rank", str(rank), *ORDER_FLAGS[order])
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

    def awaiting(self, request_id: str) -> asyncio.Future[PullDone]:
        """This rank's end event of `request_id`, once the event pump sees it."""
        future: asyncio.Future[PullDone] = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        return future


@dataclass(frozen=True)
class _Pair:
    """One (prefill rank, decode rank) transfer of a request, and the raw baseline's
    way to it: the sidecar agent on the far side of the bench agent and its buffers."""

    source: _Rank
    reader: _Rank
    hello: PeerHello  # pull: the prefill sidecar's (source rank); push: the decode one's
    peer: str  # the bench agent's name for that sidecar's agent


class _TpCase:
    """One pairing's engines: every rank's client, and each (prefill rank, decode rank)
    it serves. Pull and push differ only in who posts and where: the bench agent holds
    the posting side's memory (pull: the decode ranks', READ from the prefill sidecar's
    agent; push: the prefill ranks', WRITE into the decode sidecar's agent), and the
    engines announce and start the other way round (Publish + Pull, Expect + Push)."""

    def __init__(
        self, run: PairingRun, prefill: list[_Rank], decode: list[_Rank], mode: str
    ) -> None:
        self.run, self.prefill, self.decode = run, prefill, decode
        self.push = mode == "push"
        self.local: dict[int, list[MappedBuffer]] = {}  # the posting side's, by TP rank
        self.pairs: list[_Pair] = []
        self.ids = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, run: PairingRun, views: Sequence[EngineView], mode: str
    ) -> AsyncIterator[_TpCase]:
        async with contextlib.AsyncExitStack() as stack:
            ranks = {"prefill": [], "decode": []}  # type: dict[str, list[_Rank]]
            for view in views:
                sidecar = run.prefill if view.ready["role"] == "prefill" else run.decode
                client = EngineClient(sidecar.ready["engine_address"], engine_id=view.engine_id)
                stack.push_async_callback(client.close)
                ranks[view.ready["role"]].append(_Rank(view, client))
            case = cls(run, ranks["prefill"], ranks["decode"], mode)
            pumps = [asyncio.create_task(_pump(r)) for r in case.prefill + case.decode]
            stack.push_async_callback(_cancel, pumps)
            stack.push_async_callback(case._deregister)
            await case._connect()
            yield case

    async def _connect(self) -> None:
        posting = self.prefill if self.push else self.decode
        for rank in posting:
            handles = [
                BufferHandle(b["name"], MemoryKind.DRAM, b["size_bytes"], shm_name=b["shm_name"])
                for b in rank.view.ready["buffers"]
            ]
            self.local[rank.layout.tp_rank] = [open_buffer(h) for h in handles]
            await self.run.agent.register(self.local[rank.layout.tp_rank])
        peers: dict[bytes, str] = {}
        for reader in self.decode:
            for source in self.prefill:
                if not _serves(source.layout, reader.layout):
                    continue
                far, asking, rank = (
                    (self.run.decode, source, reader) if self.push
                    else (self.run.prefill, reader, source)
                )  # fmt: skip
                hello = await fetch_hello(
                    far.ready["peer_address"], asking.layout, dry_run=False, timeout_s=10,
                    sidecar_id="kvxfer-bench", peer_rank=rank.layout.tp_rank,
                )  # fmt: skip
                if hello.agent_metadata not in peers:
                    peers[hello.agent_metadata] = await self.run.agent.add_peer(
                        hello.agent_metadata
                    )
                self.pairs.append(_Pair(source, reader, hello, peers[hello.agent_metadata]))

    async def _deregister(self) -> None:
        for buffers in self.local.values():
            await self.run.agent.deregister(buffers)
            for buffer in buffers:
                buffer.close()

    def _posts(self, tokens: int, spans: list[BlockSpan]) -> tuple[list[Post], list[int]]:
        """Each pair's (peer, local, remote) descriptors as the sidecars plan them, and
        its planned bytes."""
        posts, planned = [], []
        for pair in self.pairs:
            plan = plan_transfer(
                pair.source.layout, pair.reader.layout, spans, spans, tokens, 0,
                chunk_blocks=1 << 30,
            )  # fmt: skip
            if self.push:
                mine = bind(self.local[pair.source.layout.tp_rank])
                local, remote, _ = whole_descriptors(plan, mine, pair.hello.buffers)
            else:
                mine = bind(self.local[pair.reader.layout.tp_rank])
                remote, local, _ = whole_descriptors(plan, pair.hello.buffers, mine)
            posts.append((pair.peer, local, remote))
            planned.append(plan.nbytes)
        return posts, planned

    async def measure(self, tokens: int) -> dict[str, Any]:
        spans = _spans(self.decode[0].layout, tokens)
        posts, planned = self._posts(tokens, spans)
        op = "WRITE" if self.push else "READ"
        outcome: dict[str, int] = {}

        async def raw() -> float:
            done = await self.run.agent.run_on_agent(lambda a: raw_posts(a, posts, op))
            return max(done)

        async def kvxfer() -> float:
            return await self._kvxfer(tokens, spans, planned, outcome)

        times = await self.run.rounds({"raw": raw, "kvxfer": kvxfer}, self.run.repeat)
        nbytes = sum(planned)
        need = sum(min_bytes(r.layout, tokens) for r in self.decode)
        return {
            "prefill_tp": len(self.prefill),
            "decode_tp": len(self.decode),
            "pulls": len(self.pairs),
            "bytes": nbytes,
            "bytes_moved": outcome["bytes_moved"],
            "min_bytes": need,
            "bytes_vs_min": round(outcome["bytes_moved"] / need, 4),
            "descriptors": sum(len(local) for _, local, _ in posts),
            "valid_tokens": outcome["valid_tokens"],
            **summarize_pairing(times, nbytes),
        }

    async def _kvxfer(
        self, tokens: int, spans: list[BlockSpan], planned: list[int], outcome: dict[str, int]
    ) -> float:
        """Seconds from the first Pull (push: Push) call to the last PullDone (Received);
        every transfer must end OK with its planned bytes. The announcements (pull: each
        prefill rank Publishes once per reader; push: each decode rank Expects once per
        source, as it does when it allocates, before the prefill ends) are not timed; a
        push's Pushed at the prefill rank is checked after the clock stops."""
        self.ids += 1
        ids = [_request_id(tokens, self.ids, p) for p in self.pairs]
        params = await asyncio.gather(
            *(p.reader.client.expect(i, tokens, spans) if self.push
              else p.source.client.publish(i, tokens, spans)
              for p, i in zip(self.pairs, ids, strict=True))
        )  # fmt: skip
        pushed = [p.source.awaiting(i) for p, i in zip(self.pairs, ids, strict=True) if self.push]

        async def one(pair: _Pair, param: TransferParams) -> PullDone:
            done = pair.reader.awaiting(param.request_id)
            try:
                if self.push:
                    await pair.source.client.push(param, spans, tokens, final=True)
                else:
                    await pair.reader.client.pull(param, spans, 0)
                return await within(done, 600)
            finally:
                pair.reader.waiting.pop(param.request_id, None)

        start = time.perf_counter()
        dones = await asyncio.gather(*(one(p, q) for p, q in zip(self.pairs, params, strict=True)))
        elapsed = time.perf_counter() - start
        ends = await within(asyncio.gather(*pushed), 600)
        per_rank: dict[int, int] = {}
        for pair, done, nbytes in zip(self.pairs, dones, planned, strict=True):
            _check(done, Received if self.push else PullDone, nbytes)
            rank = pair.reader.layout.tp_rank
            per_rank[rank] = min(per_rank.get(rank, done.valid_tokens), done.valid_tokens)
        for end, nbytes in zip(ends, planned if self.push else [], strict=True):
            _check(end, Pushed, nbytes)
        outcome["bytes_moved"] = sum(d.bytes_moved for d in dones)
        outcome["valid_tokens"] = request_valid_tokens(per_rank)
        return elapsed


Post = tuple[str, DescArray, DescArray]  # (peer, local, remote): bench_raw.raw_posts


def _check(event: PullDone, kind: type[PullDone], nbytes: int) -> None:
    """A transfer's end event: of its mode's kind, OK, with its planned bytes."""
    if not isinstance(event, kind) or event.status is not PullStatus.OK:
        raise KvxferError(
            f"bench transfer {event.request_id} ended {type(event).__name__} "
            f"{event.status.value}: {event.reason}"
        )
    if event.bytes_moved != nbytes:
        raise KvxferError(
            f"bench transfer {event.request_id} moved {event.bytes_moved} of {nbytes} bytes"
        )


def _request_id(tokens: int, index: int, pair: _Pair) -> str:
    return f"bench-tp-{tokens}-{index}-p{pair.source.layout.tp_rank}-d{pair.reader.layout.tp_rank}"


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
    """Hand each end event (PullDone, Received, Pushed) to whoever awaits it; a pull's
    Released at the prefill rank has no taker."""
    async for event in rank.client.events():
        if not isinstance(event, PullDone):
            continue
        future = rank.waiting.pop(event.request_id, None)
        if future is not None and not future.done():
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
