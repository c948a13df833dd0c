"""`kvxfer-cli demo`: a whole P/D transfer on this machine, every byte checked.

Starts a prefill sidecar, a decode sidecar and a simulated engine for each
(real processes, loopback gRPC, shared memory, real NIXL), runs K requests
through publish -> pull -> PullDone -> Released, verifies every moved block
in the decode engine's memory against the prefill engine's and, at the end,
every other decode byte against its untouched pattern. With `--fail-rate`
the decode sidecar injects chunk failures through its fault seam and the
demo checks each reported `valid_tokens` against the recompute rule.
Everything is stopped and unlinked on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.demo_reblock import check_token_ranges, source_blocks
from kvxfer.cli.fleet import (
    EngineView,
    Fleet,
    local_fleet,
    metric,
    rss_excluding_shm_bytes,
    run_until_interrupted,
    scrape,
)
from kvxfer.cli.main import EXIT_FAILED, EXIT_OK
from kvxfer.cli.planning import human_bytes
from kvxfer.cli.render import Column, Progress, table
from kvxfer.client.engine import EngineClient
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, GroupKind
from kvxfer.core.planner import (
    GroupPlan,
    full_attention_blocks,
    full_attention_bytes,
    plan_between,
    plan_blocks,
    pool_blocks,
)
from kvxfer.core.recompute import valid_tokens
from kvxfer.core.requests import (
    EngineEvent,
    PullDone,
    PullStatus,
    Pushed,
    Received,
    Released,
    TransferParams,
)
from kvxfer.wire.loops import within

CONCURRENCY = 2
EVENT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Request:
    index: int
    tokens: int
    computed: int


@dataclass
class Outcome:
    request: Request
    done: PullDone
    released: Released | Pushed  # the prefill side's end: Released (pull), Pushed (push)
    pull_start: float  # perf_counter at the Pull call
    pull_end: float  # ... and when PullDone arrived
    exact_bytes: int
    verified: bool
    problems: list[str] = field(default_factory=list)
    moved_by_group: dict[int, int] = field(default_factory=dict)  # bytes verified per group

    @property
    def latency_s(self) -> float:
        return self.pull_end - self.pull_start


def workload(args: argparse.Namespace, block_size: int) -> list[Request]:
    """Prompt lengths log-uniform over the range; a prefix hit reuses a block-aligned
    25-90% of the prompt."""
    rng = random.Random(args.seed)
    low, high = (args.tokens, args.tokens) if args.tokens else args.tokens_range
    requests = []
    for index in range(args.requests):
        tokens = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        computed = 0
        if rng.random() < args.prefix_hit_rate:
            computed = int(tokens * rng.uniform(0.25, 0.9)) // block_size * block_size
        requests.append(Request(index, tokens, computed))
    return requests


# Flags only one engine reads: given to the other, they are refused, never ignored.
SIM_ONLY = (
    "--block-size", "--prefix-hit-rate", "--prefill-order", "--decode-order", "--mode",
    "--push-steps",
)  # fmt: skip
VLLM_ONLY = ("--max-tokens",)


def check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen engine would not read (`args.argv`: as given)."""
    others = SIM_ONLY if args.engine == "vllm" else VLLM_ONLY
    for arg in getattr(args, "argv", ()):
        flag = arg.partition("=")[0]
        if flag in others:
            raise InvalidInputError(
                flag,
                f"not read by --engine {args.engine}"
                + (
                    " (the vLLM connector pulls; its block order comes from the engine)"
                    if args.engine == "vllm"
                    else " (simulated engines decode nothing)"
                ),
            )


def run_demo(args: argparse.Namespace) -> int:
    check_engine_flags(args)
    if args.engine == "vllm":  # vLLM's own config checks the TP sizes, the sidecars the pair
        from kvxfer.cli.vllm_demo import run_vllm  # noqa: PLC0415 (only this engine needs it)

        return run_vllm(args)
    from kvxfer.cli.demo_tp import by_heads, check_tp_args  # noqa: PLC0415

    args.model = args.model or "gpt-oss-20b"
    if by_heads(args):
        check_tp_args(args)
    args.requests = args.requests or 24
    if not args.tokens and not args.tokens_range:
        args.tokens_range = (512, 16384)
    if args.fail_rate and not 0 < args.fail_rate < 1:
        raise InvalidInputError("--fail-rate", f"must be in [0, 1), got {args.fail_rate}")
    if not 0 <= args.prefix_hit_rate <= 1:
        raise InvalidInputError(
            "--prefix-hit-rate", f"must be in [0, 1], got {args.prefix_hit_rate}"
        )
    with local_fleet("kvxfer-demo-", "kvxfer-cli demo") as fleet:
        if by_heads(args):
            from kvxfer.cli.demo_tp import demo_tp  # noqa: PLC0415

            report = run_until_interrupted(demo_tp(args, fleet))
        else:
            report = run_until_interrupted(_demo(args, fleet))
        ok = report["exit_code"] == EXIT_OK
        fleet.keep_logs = not ok
    report.pop("exit_code")
    if args.json:
        print(json.dumps(report))
    elif "tp" in report:
        from kvxfer.cli.demo_tp import summary_tp  # noqa: PLC0415

        print(summary_tp(report))
    else:
        print(_summary(report, args))
    return EXIT_OK if ok else EXIT_FAILED


async def _demo(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    p_block, d_block = _block_sizes(args)
    requests = workload(args, d_block)  # a prefix hit is whole decode blocks
    sizing = _sizing(args.model, (p_block, d_block), max(r.tokens for r in requests))
    with Progress("demo", len(requests), enabled=not args.json) as progress:
        runner, outcomes, d_metrics = await _run(args, fleet, requests, sizing, progress)
    handshake_ms = _handshake_ms(d_metrics)
    whole_ok = runner.check_untouched()
    report = _report(args, runner.de.layout, outcomes, _busy_s(outcomes), handshake_ms, whole_ok)
    report["block_sizes"] = {"prefill": p_block, "decode": d_block}
    report["sidecar_peak_rss_mib"] = {
        name.removeprefix("sidecar "): round(rss / 2**20, 1)
        for name, rss in sorted(runner.peak_rss.items())
    }
    return report


def _block_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """The prefill and decode engines' block sizes (each defaults to --block-size)."""
    return (args.prefill_block_size or args.block_size, args.decode_block_size or args.block_size)


async def _run(
    args: argparse.Namespace,
    fleet: Fleet,
    requests: Sequence[Request],
    sizing: _Sizing,
    progress: Progress,
) -> tuple[_Runner, list[Outcome], str]:
    """Start two sidecars and two engines, then run every request through them; also
    returns the metrics address of the sidecar that initiated the transfers."""
    p_block, d_block = _block_sizes(args)
    progress.note("starting 2 sidecars and 2 engines")
    faults: tuple[str, ...] = ()
    if args.fail_rate:
        faults = ("--faults.fail-rate", str(args.fail_rate), "--faults.seed", str(args.seed),
                  "--transfer.chunk-blocks", "16")  # fmt: skip
    # Faults go where chunks are posted: the decode sidecar reads, the prefill one pushes.
    p_faults, d_faults = (faults, ()) if args.mode == "push" else ((), faults)
    p, d = await asyncio.gather(
        asyncio.to_thread(fleet.sidecar, "p", *p_faults),
        asyncio.to_thread(fleet.sidecar, "d", *d_faults),
    )
    p_args = ("--block-size", str(p_block), *sizing.p_args)
    d_args = ("--block-size", str(d_block), *sizing.d_args, "--seed", "1")
    pe, de = await asyncio.gather(
        asyncio.to_thread(fleet.engine, p, args.model, "prefill", *p_args),
        asyncio.to_thread(fleet.engine, d, args.model, "decode", *d_args),
    )
    runner = _Runner(args, fleet, pe, de, sizing, progress)
    progress.note(f"running {len(requests)} requests")  # tests wait for this line
    async with (
        EngineClient(p.ready["engine_address"], engine_id=pe.engine_id) as p_client,
        EngineClient(d.ready["engine_address"], engine_id=de.engine_id) as d_client,
    ):
        outcomes = await runner.run(requests, p_client, d_client)
    initiator = p if args.mode == "push" else d  # the side that handshakes
    return runner, outcomes, initiator.ready["metrics_address"]


def _busy_s(outcomes: Sequence[Outcome]) -> float:
    """Wall time with at least one pull in flight (the union of the pull intervals)."""
    total, reach = 0.0, -math.inf
    for o in sorted(outcomes, key=lambda o: o.pull_start):
        start = max(o.pull_start, reach)
        if o.pull_end > start:
            total += o.pull_end - start
        reach = max(reach, o.pull_end)
    return total


@dataclass(frozen=True)
class _Sizing:
    p_args: tuple[str, ...]
    d_args: tuple[str, ...]
    pools: Mapping[GroupKind, int]  # prefill blocks one request may need, per group kind
    d_pools: Mapping[GroupKind, int]  # ... and decode blocks


def _sizing(model: str, block_sizes: tuple[int, int], max_tokens: int) -> _Sizing:
    from kvxfer.core.profiles import layout_for_model  # noqa: PLC0415

    p_pools, d_pools = (
        pool_blocks(layout_for_model(model, block_size=size), max_tokens) for size in block_sizes
    )

    def args(pools: Mapping[GroupKind, int], copies: int) -> tuple[str, ...]:
        full, sliding = pools[GroupKind.FULL_ATTENTION], pools[GroupKind.SLIDING_WINDOW]
        chunked = pools[GroupKind.CHUNKED_LOCAL]
        return (
            "--num-blocks", str(full * copies),
            "--sliding-blocks", str(sliding * copies),
            "--chunked-blocks", str(chunked * copies),
            "--state-blocks", str(copies),
        )  # fmt: skip

    return _Sizing(args(p_pools, 1), args(d_pools, CONCURRENCY), p_pools, d_pools)


class _Runner:
    """Drives requests through both engines and checks each one's bytes."""

    def __init__(
        self,
        args: argparse.Namespace,
        fleet: Fleet,
        pe: EngineView,
        de: EngineView,
        sizing: _Sizing,
        progress: Progress,
    ) -> None:
        self.args, self.fleet, self.pe, self.de = args, fleet, pe, de
        self.sizing, self.progress = sizing, progress
        self.layout = pe.layout
        self.rng = random.Random(args.seed + 1)
        self.free_slots = list(range(CONCURRENCY))
        # (tensor, decode block id) -> the prefill block it must now hold (a read-only
        # view: prefill memory does not change during the demo)
        self.written: dict[tuple[str, int], npt.NDArray[np.uint8]] = {}
        self.waiters: dict[tuple[str, str], asyncio.Future[EngineEvent]] = {}
        self.peak_rss: dict[str, int] = {}  # sidecar -> bytes, shared memory excluded

    async def run(
        self, requests: Sequence[Request], p: EngineClient, d: EngineClient
    ) -> list[Outcome]:
        pumps = [asyncio.create_task(self._pump("p", p)), asyncio.create_task(self._pump("d", d))]
        watchdog = asyncio.create_task(self._watch_children())
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(request: Request) -> Outcome:
            async with gate:
                slot = self.free_slots.pop()
                try:
                    return await self._request(request, slot, p, d)
                finally:
                    self.free_slots.append(slot)

        work = asyncio.gather(*(one(r) for r in requests))
        racing: list[asyncio.Future[Any]] = [work, watchdog]
        try:
            done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if watchdog in done:
                work.cancel()
                watchdog.result()  # raises ChildDiedError
            elif work.exception() is not None:
                # A sidecar retires a dead engine at once, so a request may fail before
                # the watchdog looks: the dead process is the cause to report.
                self.fleet.check_alive()
            outcomes = work.result()
        finally:
            # Cancelled (Ctrl-C) or done: stop everything and collect each outcome, so
            # that no task is left pending or with an exception nobody retrieved.
            everything: list[asyncio.Future[Any]] = [work, *pumps, watchdog]
            for future in everything:
                future.cancel()
            await asyncio.gather(*everything, return_exceptions=True)
        return outcomes

    async def _watch_children(self) -> None:
        """Fail fast if a process dies; sample the sidecars' memory under load."""
        while True:
            self.fleet.check_alive()
            for proc in self.fleet.sidecars():
                with contextlib.suppress(OSError, KeyError):
                    rss = rss_excluding_shm_bytes(proc.pid)
                    self.peak_rss[proc.name] = max(self.peak_rss.get(proc.name, 0), rss)
            await asyncio.sleep(0.2)

    async def _pump(self, side: str, client: EngineClient) -> None:
        async for event in client.events():
            future = self.waiters.pop((side, event.request_id), None)
            if future is not None and not future.done():
                future.set_result(event)

    def _expect(self, side: str, request_id: str) -> asyncio.Future[EngineEvent]:
        future: asyncio.Future[EngineEvent] = asyncio.get_running_loop().create_future()
        self.waiters[(side, request_id)] = future
        return future

    async def _request(
        self, request: Request, slot: int, p: EngineClient, d: EngineClient
    ) -> Outcome:
        request_id = f"demo-{request.index}"
        groups = plan_between(self.layout, self.de.layout, request.tokens, request.computed)
        src, dst = self._spans(groups, slot)
        released_f, done_f = self._expect("p", request_id), self._expect("d", request_id)
        start = time.perf_counter()
        if self.args.mode == "push":
            await self._push(request, request_id, src, dst, p, d)
        else:
            params: TransferParams = await p.publish(request_id, request.tokens, src)
            start = time.perf_counter()
            await d.pull(params, dst, request.computed)
        done = await within(done_f, EVENT_TIMEOUT_S)
        end = time.perf_counter()
        released = await within(released_f, EVENT_TIMEOUT_S)
        want = (Received, Pushed) if self.args.mode == "push" else (PullDone, Released)
        assert isinstance(done, want[0]) and isinstance(released, want[1]), (done, released)
        outcome = Outcome(request, done, released, start, end, sum(g.nbytes for g in groups), True)
        # Off the event loop: other pulls' events keep flowing while bytes are compared.
        await asyncio.to_thread(self._verify, outcome, groups, src, dst)
        self.progress.advance(
            f"{request.tokens} tok, {human_bytes(done.bytes_moved)}, {done.status.value}"
        )
        return outcome

    async def _push(
        self,
        request: Request,
        request_id: str,
        src: Sequence[BlockSpan],
        dst: Sequence[BlockSpan],
        p: EngineClient,
        d: EngineClient,
    ) -> None:
        """The decode engine announces its blocks; the prefill engine pushes as its
        prefill "proceeds": tokens_ready rises in --push-steps steps, the last final."""
        params = await d.expect(request_id, request.tokens, dst, request.computed)
        steps = self.args.push_steps
        for step in range(1, steps + 1):
            ready = request.tokens * step // steps
            await p.push(params, src, ready, final=step == steps)

    def _spans(
        self, groups: Sequence[GroupPlan], slot: int
    ) -> tuple[list[BlockSpan], list[BlockSpan]]:
        """Source ids rotate through the prefill pool (different bytes each request, and
        a run breaks where the rotation wraps); destination ids are this request's slot,
        ascending, as a fresh engine's allocator hands them out."""
        src, dst = [], []
        for plan in groups:
            if not plan.blocks:
                continue
            pool, d_pool = self.sizing.pools[plan.group.kind], self.sizing.d_pools[plan.group.kind]
            src_blocks = source_blocks(plan, self.layout.block_size)
            offset = self.rng.randrange(pool)
            src_ids = [(offset + i) % pool for i in range(len(src_blocks))]
            dst_ids = [slot * d_pool + i for i in range(len(plan.blocks))]
            gid = GroupId(plan.group.group_id)
            src.append(BlockSpan(gid, src_blocks.start, tuple(BlockId(b) for b in src_ids)))
            dst.append(BlockSpan(gid, plan.blocks.start, tuple(BlockId(b) for b in dst_ids)))
        return src, dst

    def _verify(
        self,
        outcome: Outcome,
        groups: Sequence[GroupPlan],
        src: Sequence[BlockSpan],
        dst: Sequence[BlockSpan],
    ) -> None:
        done, request = outcome.done, outcome.request
        failed = {g: set(b) for g, b in done.failed_blocks.items()}
        src_by, dst_by = {s.group_id: s for s in src}, {s.group_id: s for s in dst}
        moved = 0
        for plan in groups:
            gid = plan.group.group_id
            lost = failed.get(gid, set())
            if not lost <= set(plan.blocks):
                outcome.problems.append(f"group {gid}: failed blocks outside the plan")
            before = moved
            if plan.tokens is not None:
                size, problems = check_token_ranges(
                    self.pe, self.de, plan, (src_by[gid], dst_by[gid]), lost, self.written
                )
                moved += size
                outcome.problems += problems
            for logical in plan.blocks if plan.tokens is None else ():
                if logical in lost:
                    continue
                s_id, d_id = src_by[gid].block_id(logical), dst_by[gid].block_id(logical)
                for tensor in plan.group.tensors:
                    if not np.array_equal(
                        self.de.block(tensor.name, d_id), self.pe.block(tensor.name, s_id)
                    ):
                        outcome.problems.append(f"{tensor.name} logical block {logical} differs")
                    self.written[(tensor.name, d_id)] = self.pe.block(tensor.name, s_id)
                    moved += tensor.bytes_per_block
            outcome.moved_by_group[gid] = moved - before
        moved_from = {int(g.group.group_id): g.tokens.start for g in groups if g.tokens}
        expected_valid = valid_tokens(
            [g.group for g in groups], request.tokens, request.computed, self.de.layout.block_size,
            done.failed_blocks, moved_from,
        )  # fmt: skip
        if done.valid_tokens != expected_valid:
            outcome.problems.append(
                f"valid_tokens {done.valid_tokens}, the recompute rule says {expected_valid}"
            )
        prefill_saw = (
            outcome.released.bytes_moved
            if isinstance(outcome.released, Pushed)
            else outcome.released.bytes_read
        )
        if done.bytes_moved != moved or prefill_saw != moved:
            outcome.problems.append(f"bytes_moved {done.bytes_moved}, verified {moved}")
        if done.status is PullStatus.OK and failed:
            outcome.problems.append("status ok with failed blocks")
        outcome.verified = not outcome.problems

    def check_untouched(self) -> bool:
        """Every decode byte is its pattern, or the prefill block last pulled into it."""
        return self.de.image_mismatch(self.written) is None


def _handshake_ms(metrics_address: str) -> float:
    samples = scrape(metrics_address)
    count = metric(samples, "kvxfer_handshake_duration_seconds_count")
    total = metric(samples, "kvxfer_handshake_duration_seconds_sum")
    return 1000 * total / count if count else 0.0


def _report(
    args: argparse.Namespace,
    layout: EngineLayout,
    outcomes: Sequence[Outcome],
    busy_s: float,
    handshake_ms: float,
    untouched_ok: bool,
) -> dict[str, Any]:
    moved = sum(o.done.bytes_moved for o in outcomes)
    exact = sum(o.exact_bytes for o in outcomes)
    full = sum(full_attention_bytes(layout, o.request.tokens, o.request.computed) for o in outcomes)
    failures = [o for o in outcomes if o.done.failed_blocks]
    latencies = sorted(o.latency_s * 1000 for o in outcomes)
    verified = sum(o.verified for o in outcomes)
    failed_blocks = sum(len(b) for o in outcomes for b in o.done.failed_blocks.values())
    expected_failures = args.fail_rate > 0
    clean = verified == len(outcomes) and untouched_ok
    exit_code = EXIT_OK if clean and (expected_failures or not failures) else EXIT_FAILED
    if not expected_failures and moved != exact:
        exit_code = EXIT_FAILED
    return {
        "model": args.model,
        "mode": args.mode,
        "requests": len(outcomes),
        "verified_requests": verified,
        "bytes_moved": moved,
        "bytes_exact_minimum": exact,
        "full_attention_bytes": full,
        "throughput_gbps": round(moved / busy_s / 1e9, 3) if busy_s else 0.0,
        "handshake_ms": round(handshake_ms, 3),
        "pull_latency_ms": {
            "p50": round(statistics.median(latencies), 3),
            "p99": round(_percentile(latencies, 0.99), 3),
        },
        "failed_blocks": failed_blocks,
        "untouched_bytes_verified": untouched_ok,
        "per_group": _per_group(layout, outcomes),
        "per_request": [
            {
                "tokens": o.request.tokens,
                "computed_tokens": o.request.computed,
                "bytes_moved": o.done.bytes_moved,
                "status": o.done.status.value,
                "failed_blocks": {str(g): list(b) for g, b in sorted(o.done.failed_blocks.items())},
                "valid_tokens": o.done.valid_tokens,
                "problems": o.problems,
            }
            for o in outcomes
        ],
        "exit_code": exit_code,
    }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)
    return sorted_values[max(index, 0)]


def _per_group(layout: EngineLayout, outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    rows = []
    for group in layout.groups:
        blocks = full_blocks = moved = 0
        for o in outcomes:
            plan = plan_blocks(layout, o.request.tokens, o.request.computed)[group.group_id]
            lost = len(o.done.failed_blocks.get(group.group_id, ()))
            blocks += len(plan.blocks) - lost
            moved += o.moved_by_group.get(group.group_id, 0)
            full_blocks += len(
                full_attention_blocks(
                    group, o.request.tokens, o.request.computed, layout.block_size
                )
            )
        rows.append(
            {
                "group": group.group_id,
                "kind": group.kind.value,
                "sliding_window": group.sliding_window,
                "blocks_moved": blocks,
                "bytes_moved": moved,
                "full_attention_bytes": full_blocks * group.bytes_per_block,
            }
        )
    return rows


def _summary(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"kvxfer demo: {report['requests']} requests of {report['model']} through 2 sidecars, "
        f"{report['mode']} (NIXL over shared memory, every byte checked)",
        "",
    ]
    rows = []
    for row in report["per_group"]:
        window = f" W={row['sliding_window']}" if row["sliding_window"] else ""
        rows.append([
            f"{row['group']} {row['kind']}{window}", str(row["blocks_moved"]),
            human_bytes(row["bytes_moved"]), human_bytes(row["full_attention_bytes"]),
        ])  # fmt: skip
    columns = [Column("group"), Column("blocks moved", "right")]
    lines.append(
        table([*columns, Column("bytes moved", "right"), Column("full attn", "right")], rows)
    )
    moved, exact, full = (
        report["bytes_moved"], report["bytes_exact_minimum"], report["full_attention_bytes"]
    )  # fmt: skip
    saved = 100 * (1 - moved / full) if full else 0.0
    lines += [
        "",
        f"bytes moved     {human_bytes(moved)} (exact minimum {human_bytes(exact)}"
        f"{', equal' if moved == exact else ''}); a full-attention transfer: "
        f"{human_bytes(full)} ({saved:.1f}% saved)",
        f"verified        {report['verified_requests']}/{report['requests']} requests byte for "
        f"byte; untouched decode bytes intact: {report['untouched_bytes_verified']}",
        f"throughput      {report['throughput_gbps']:.2f} GB/s (bytes over the wall time "
        f"with a {report['mode']} in flight)",
        f"{report['mode']} latency    p50 {report['pull_latency_ms']['p50']:.1f} ms, "
        f"p99 {report['pull_latency_ms']['p99']:.1f} ms; handshake {report['handshake_ms']:.1f} ms",
    ]
    rss = ", ".join(f"{k} {v:.0f} MiB" for k, v in report["sidecar_peak_rss_mib"].items())
    lines.append(f"sidecar memory  peak {rss} resident (shared memory excluded)")
    failed = [r for r in report["per_request"] if r["failed_blocks"]]
    lines.append(f"failures        {report['failed_blocks']} blocks in {len(failed)} requests")
    for row in failed[:10]:
        blocks = "; ".join(f"group {g}: {_ranges(b)}" for g, b in row["failed_blocks"].items())
        lines.append(
            f"  {row['tokens']} tokens (held {row['computed_tokens']}): {row['status']}, "
            f"lost {blocks}; resume from token {row['valid_tokens']}"
        )
    if args.fail_rate:
        lines.append(
            f"(--fail-rate {args.fail_rate}: failures injected on purpose; each valid_tokens "
            "was checked against the recompute rule)"
        )
    for row in report["per_request"]:
        for problem in row["problems"]:
            lines.append(f"PROBLEM: request of {row['tokens']} tokens: {problem}")
    return "\n".join(lines)


def _ranges(blocks: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3-5,9'."""
    parts: list[str] = []
    ordered = sorted(blocks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
