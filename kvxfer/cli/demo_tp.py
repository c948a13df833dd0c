"""`kvxfer-cli demo --prefill-tp P --decode-tp D` with P != D: decode ranks read their
KV heads, and the byte ranges of their state blocks, from every prefill rank holding
them; an mla latent from one rank (docs/planning.md, Different TP sizes).

One prefill and one decode sidecar, an engine-sim per rank on each. What the engines
do, as a real engine would: for each request, each prefill rank publishes it once per
decode rank it serves (each reader gets its own lease, request id
`demo-<i>-p<p>-d<d>`), and each decode rank pulls once per source rank with that rank's
params. The sidecars plan and move only the source's head runs of every token. The
request is complete when all its pulls are done; its `valid_tokens` is the minimum of
the pulls' (`tp_map.request_valid_tokens`). Every decode block is checked head by head
against the prefill ranks' bytes (a state block range by range), and every other
decode byte against its pattern.
Requests run one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.demo import EVENT_TIMEOUT_S, Request, _sizing, workload
from kvxfer.cli.demo_reblock import source_blocks
from kvxfer.cli.fleet import EngineView, Fleet
from kvxfer.cli.main import EXIT_FAILED, EXIT_OK, ORDER_FLAGS, pairing_mismatches
from kvxfer.cli.planning import human_bytes
from kvxfer.client.engine import EngineClient
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind, KVGroup
from kvxfer.core.planner import GroupPlan, plan_between
from kvxfer.core.recompute import valid_tokens
from kvxfer.core.requests import EngineEvent, PullDone, Pushed, Received, Released
from kvxfer.core.tp_map import pairing_sources, request_valid_tokens, served_slices, served_state
from kvxfer.wire.loops import within

Piece = tuple[int, int, int]  # offset in the source unit, in the destination unit, bytes

Images = dict[tuple[str, int], npt.NDArray[np.uint8]]


@dataclass
class _Rank:
    view: EngineView
    client: EngineClient
    events: asyncio.Queue[EngineEvent] = field(default_factory=asyncio.Queue)


def by_heads(args: argparse.Namespace) -> bool:
    """This demo runs here: different TP sizes, or blocks not both token-major."""
    orders = {args.prefill_order, args.decode_order}
    return args.prefill_tp != args.decode_tp or orders != {"token-major"}


def check_tp_args(args: argparse.Namespace) -> None:
    """Refuse, before any process starts, a pairing negotiation would refuse."""
    found = pairing_mismatches(
        args.model,
        (args.prefill_block_size or args.block_size, args.decode_block_size or args.block_size),
        (args.prefill_tp, args.decode_tp),
        (args.prefill_order, args.decode_order),
    )
    if found:
        field = "--decode-tp" if args.prefill_tp != args.decode_tp else "--decode-order"
        raise InvalidInputError(field, "; ".join(str(m) for m in found[:3]))


async def demo_tp(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    p_block = args.prefill_block_size or args.block_size
    d_block = args.decode_block_size or args.block_size
    requests = workload(args, d_block)
    sizing = _sizing(args.model, (p_block, d_block), max(r.tokens for r in requests))
    faults: tuple[str, ...] = ()
    if args.fail_rate:
        faults = ("--faults.fail-rate", str(args.fail_rate), "--faults.seed", str(args.seed),
                  "--transfer.chunk-blocks", "4")  # fmt: skip
    push = args.mode == "push"  # faults go where chunks are posted
    p = await asyncio.to_thread(fleet.sidecar, "p", *(faults if push else ()))
    d = await asyncio.to_thread(fleet.sidecar, "d", *(() if push else faults))
    prefill, decode = [], []
    for rank in range(args.prefill_tp):
        tp = ("--tp-size", str(args.prefill_tp), "--tp-rank", str(rank), "--seed", str(rank + 2))
        p_args = ("--block-size", str(p_block), *sizing.p_args, *tp)
        p_args += ORDER_FLAGS[args.prefill_order]
        prefill.append(await asyncio.to_thread(fleet.engine, p, args.model, "prefill", *p_args))
    for rank in range(args.decode_tp):
        tp = ("--tp-size", str(args.decode_tp), "--tp-rank", str(rank), "--seed", str(rank + 50))
        d_args = ("--block-size", str(d_block), *sizing.d_args, *tp)
        d_args += ORDER_FLAGS[args.decode_order]
        decode.append(await asyncio.to_thread(fleet.engine, d, args.model, "decode", *d_args))
    async with _clients(p.ready, prefill) as p_ranks, _clients(d.ready, decode) as d_ranks:
        runner = _Runner(p_ranks, d_ranks, sizing.pools, random.Random(args.seed + 1), push)
        rows = [await runner.request(r) for r in requests]
    untouched = all(r.view.image_mismatch(runner.images[i]) is None for i, r in enumerate(d_ranks))
    verified = sum(not row["problems"] for row in rows)
    failed = sum(row["failed_blocks"] for row in rows)
    ok = verified == len(rows) and untouched and (args.fail_rate > 0 or failed == 0)
    return {
        "model": args.model,
        "mode": args.mode,
        "tp": {"prefill": args.prefill_tp, "decode": args.decode_tp},
        "orders": {"prefill": args.prefill_order, "decode": args.decode_order},
        "block_sizes": {"prefill": p_block, "decode": d_block},
        "requests": len(rows),
        "verified_requests": verified,
        "pulls": sum(len(row["pulls"]) for row in rows),
        "bytes_moved": sum(pull["bytes_moved"] for row in rows for pull in row["pulls"]),
        "head_bytes_verified": sum(row["bytes_verified"] for row in rows),
        "failed_blocks": failed,
        "untouched_bytes_verified": untouched,
        "per_request": rows,
        "exit_code": EXIT_OK if ok else EXIT_FAILED,
    }


@contextlib.asynccontextmanager
async def _clients(
    ready: dict[str, Any], views: Sequence[EngineView]
) -> AsyncIterator[list[_Rank]]:
    async with contextlib.AsyncExitStack() as stack:
        ranks = []
        for view in views:
            client = await stack.enter_async_context(
                EngineClient(ready["engine_address"], engine_id=view.engine_id)
            )
            ranks.append(_Rank(view, client))
        pumps = [asyncio.create_task(_pump(r)) for r in ranks]
        try:
            yield ranks
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(rank: _Rank) -> None:
    async for event in rank.client.events():
        await rank.events.put(event)


class _Runner:
    def __init__(
        self,
        prefill: list[_Rank],
        decode: list[_Rank],
        pools: Any,
        rng: random.Random,
        push: bool = False,
    ) -> None:
        self.prefill, self.decode, self.pools, self.rng = prefill, decode, pools, rng
        self.push = push  # each decode rank Expects once per source, which pushes
        self.images: list[Images] = [{} for _ in decode]
        self.touched: dict[tuple[str, int], int] = {}  # this decode rank's, this request

    async def request(self, request: Request) -> dict[str, Any]:
        pulls: list[dict[str, Any]] = []
        problems: list[str] = []
        verified, failed = 0, 0
        per_rank: dict[int, int] = {}
        for d_rank in self.decode:
            dst_layout = d_rank.view.layout
            sources = [p for p in self.prefill if _serves(p, d_rank)]
            plans = {
                p.view.layout.tp_rank: plan_between(
                    p.view.layout, dst_layout, request.tokens, request.computed
                )
                for p in sources
            }
            # Each group's spans from a source that moves some of it (one may move none).
            groups = zip(*plans.values(), strict=True)
            first = [next((g for g in each if g.blocks), each[0]) for each in groups]
            src, dst = self._spans(first, sources[0].view.layout.block_size)
            dones = []
            for p_rank in sources:
                rank = p_rank.view.layout.tp_rank
                request_id = f"demo-{request.index}-p{rank}-d{dst_layout.tp_rank}"
                if self.push:
                    params = await d_rank.client.expect(
                        request_id, request.tokens, dst, request.computed
                    )
                    await p_rank.client.push(params, src, request.tokens)
                else:
                    params = await p_rank.client.publish(request_id, request.tokens, src)
                    await d_rank.client.pull(params, dst, request.computed)
            ends = (Received, Pushed) if self.push else (PullDone, Released)
            for p_rank in sources:
                done = await within(d_rank.events.get(), EVENT_TIMEOUT_S)
                released = await within(p_rank.events.get(), EVENT_TIMEOUT_S)
                assert isinstance(done, ends[0]) and isinstance(released, ends[1])
                dones.append(done)
            by_id = {done.request_id: done for done in dones}
            self.touched = {}
            valid = []
            for p_rank in sources:
                rank = p_rank.view.layout.tp_rank
                done = by_id[f"demo-{request.index}-p{rank}-d{dst_layout.tp_rank}"]
                size, found = self._check(
                    request, p_rank.view, d_rank, plans[rank], (src, dst), done
                )
                verified += size
                problems += found
                valid.append(done.valid_tokens)
                failed += sum(len(b) for b in done.failed_blocks.values())
                pulls.append(
                    {
                        "prefill_rank": rank,
                        "decode_rank": dst_layout.tp_rank,
                        "status": done.status.value,
                        "bytes_moved": done.bytes_moved,
                        "failed_blocks": {str(g): list(b) for g, b in done.failed_blocks.items()},
                        "valid_tokens": done.valid_tokens,
                    }
                )
            per_rank[dst_layout.tp_rank] = min(valid)
            problems += _differing(d_rank.view, self.images[dst_layout.tp_rank], self.touched)
        return {
            "tokens": request.tokens,
            "computed_tokens": request.computed,
            "valid_tokens": request_valid_tokens(per_rank),
            "failed_blocks": failed,
            "bytes_verified": verified,
            "pulls": pulls,
            "problems": problems,
        }

    def _spans(
        self, plans: Sequence[GroupPlan], src_block: int
    ) -> tuple[list[BlockSpan], list[BlockSpan]]:
        """The same block ids on every rank of a side (each rank has its own memory);
        source ids rotate through the pool, destination ids ascend from 0."""
        src, dst = [], []
        for plan in plans:
            if not plan.blocks:
                continue
            pool = self.pools[plan.group.kind]
            blocks = source_blocks(plan, src_block)
            offset = self.rng.randrange(pool)
            gid = GroupId(plan.group.group_id)
            src_ids = tuple(BlockId((offset + i) % pool) for i in range(len(blocks)))
            src.append(BlockSpan(gid, blocks.start, src_ids))
            dst_ids = tuple(BlockId(i) for i in range(len(plan.blocks)))
            dst.append(BlockSpan(gid, plan.blocks.start, dst_ids))
        return src, dst

    def _check(
        self,
        request: Request,
        pe: EngineView,
        d_rank: _Rank,
        plans: Sequence[GroupPlan],
        spans: tuple[list[BlockSpan], list[BlockSpan]],
        done: PullDone,
    ) -> tuple[int, list[str]]:
        """This source's heads of every moved token, in the decode blocks that did not
        fail; records the expected images for the final whole-buffer check."""
        de, images = d_rank.view, self.images[d_rank.view.layout.tp_rank]
        src_by, dst_by = ({s.group_id: s for s in side} for side in spans)
        p_size, d_size = pe.layout.block_size, de.layout.block_size
        verified, problems = 0, []
        for plan in plans:
            gid = plan.group.group_id
            lost = set(done.failed_blocks.get(gid, ()))
            state = plan.group.kind is GroupKind.MAMBA
            p_unit, d_unit = (1, 1) if state else (p_size, d_size)  # a state block is whole
            for logical in plan.blocks:
                if logical in lost:
                    continue
                d_id = dst_by[gid].block_id(logical)
                units = range(logical * d_unit, (logical + 1) * d_unit)
                if plan.tokens is not None:
                    units = range(
                        max(plan.tokens.start, units.start), min(plan.tokens.stop, units.stop)
                    )
                for tensor in plan.group.tensors:
                    pieces = _pieces(pe.layout, de.layout, plan.group, tensor.name)
                    want = images.get((tensor.name, d_id))
                    want = de.pattern_block(tensor.name, d_id) if want is None else want
                    for t in units:
                        block = pe.block(tensor.name, src_by[gid].block_id(t // p_unit))
                        for s_at, d_at, size in pieces(t):
                            want[d_at : d_at + size] = block[s_at : s_at + size]
                            verified += size
                    images[(tensor.name, d_id)] = want
                    self.touched[(tensor.name, d_id)] = logical
        if done.bytes_moved != verified:
            problems.append(f"bytes_moved {done.bytes_moved}, verified {verified}")
        moved_from = {int(g.group.group_id): g.tokens.start for g in plans if g.tokens}
        expected = valid_tokens(
            [g.group for g in plans],
            request.tokens,
            request.computed,
            d_size,
            done.failed_blocks,
            moved_from,
        )
        if done.valid_tokens != expected:
            problems.append(f"valid_tokens {done.valid_tokens}, the recompute rule says {expected}")
        return verified, problems


def _differing(de: EngineView, images: Images, touched: dict[tuple[str, int], int]) -> list[str]:
    """Blocks that differ from their expected image once every source's heads landed."""
    return [
        f"{name} decode block {logical} differs"
        for (name, d_id), logical in sorted(touched.items())
        if not np.array_equal(de.block(name, d_id), images[(name, d_id)])
    ]


def _pieces(
    src: EngineLayout, dst: EngineLayout, group: KVGroup, tensor: str
) -> Callable[[int], list[Piece]]:
    """What this source serves of token t (attention: in each side's block, by each side's
    order), or of the state block (t is 0), as (source byte, destination byte, bytes)."""
    if group.kind is GroupKind.MAMBA:
        state = [
            (p.src_at, p.dst_at, p.length) for p in served_state(src, dst, group).get(tensor, [])
        ]
        return lambda t: state
    spec = next(t for t in group.tensors if t.name == tensor)
    src_size, dst_size = src.block_size_of(group), dst.block_size_of(group)
    src_token = src.region_map[tensor].block_bytes // src_size
    dst_token = spec.bytes_per_block // dst_size
    if group.kind is GroupKind.MLA:  # the replicated latent: the whole token
        return lambda t: [(t % src_size * src_token, t % dst_size * dst_token, dst_token)]
    head = dst.head_bytes(group, spec)
    if head is None:  # head-major in an engine's own order: whole heads of equal blocks
        whole = dst.head_block_bytes(group, spec)  # move, checked as rows alike on each side
        assert whole is not None and whole % dst_size == 0
        head = whole // dst_size
    heads = [
        (s, d) for piece in served_slices(src, dst, group)
        for s, d in zip(piece.src_heads, piece.dst_heads, strict=True)
    ]  # fmt: skip

    def at(layout: EngineLayout, size: int, local: int) -> tuple[int, int]:
        """(byte of `local`'s head in a block's first token, bytes to the next token)."""
        if layout.head_major:  # [heads][tokens][head bytes]; whole heads where in own order
            return local * size * head, head
        return local * head, layout.rank_heads(group) * head  # [tokens][heads][head bytes]

    # Token t's pieces are token 0's, each side moved t % its block size rows on.
    first = [(at(src, src_size, s), at(dst, dst_size, d)) for s, d in heads]
    if not first:
        return lambda t: []
    s_row, d_row = first[0][0][1], first[0][1][1]
    base = _merged([(s, d, head) for (s, _), (d, _) in first])
    return lambda t: [(s + t % src_size * s_row, d + t % dst_size * d_row, n) for s, d, n in base]


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Pieces that follow each other on both sides as one (a run of heads of a token in
    token-major blocks on both sides)."""
    out: list[Piece] = []
    for s, d, n in pieces:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def _serves(p_rank: _Rank, d_rank: _Rank) -> bool:
    layout = p_rank.view.layout
    return layout.tp_rank in pairing_sources(layout.tp_size, d_rank.view.layout)


def summary_tp(report: dict[str, Any]) -> str:
    tp, sizes = report["tp"], report["block_sizes"]
    return "\n".join(
        [
            f"{report['model']} ({report['mode']}): prefill TP {tp['prefill']} -> decode TP "
            f"{tp['decode']}, "
            f"blocks {sizes['prefill']} -> {sizes['decode']} tokens, "
            f"{report['orders']['prefill']} -> {report['orders']['decode']}",
            f"{report['verified_requests']}/{report['requests']} requests verified head by "
            f"head ({report['pulls']} {'pushes' if report['mode'] == 'push' else 'pulls'}, "
            f"{human_bytes(report['bytes_moved'])} moved, "
            f"{report['failed_blocks']} failed blocks)",
            f"untouched decode bytes verified: {report['untouched_bytes_verified']}",
        ]
    )
