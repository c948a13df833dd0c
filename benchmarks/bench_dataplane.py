"""Data-plane benchmark, in process: execute_plan vs raw NIXL vs per-block vs memcpy.

The data plane alone (two processes, no sidecars, no gRPC); `kvxfer-cli bench`
measures kvxfer end to end through both sidecars. The raw and per-block
methods are shared with it (`kvxfer.cli.bench`, `kvxfer.cli.bench_raw`).

One run, the same two processes and the same shared-memory buffers for every
method, so the ratios are side by side:

- memcpy:    numpy copy of the same planned bytes inside one process (host limit)
- raw:       one NIXL READ handle, one descriptor per contiguous region range (the ceiling)
- per_block: one descriptor per (region, block), from prepared descriptor lists,
             as vLLM's NIXL connector posts them
- kvxfer:    execute_plan: chunked handles, coalesced descriptors, deadlines, result

Usage: .venv/bin/python benchmarks/bench_dataplane.py [--models ...] [--sizes 1k 16k 128k]
       [--repeat R] [--json]
This is a script, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nixl_peer import LocalSide, SourcePeer

from kvxfer.cli.bench import (
    SHM_BUDGET,
    Method,
    engine_bytes,
    mem_available,
    memcpy_round,
    run_rounds,
    summarize,
)
from kvxfer.cli.bench_raw import (
    handle_setup,
    per_block_read,
    raw_read,
    split_per_block,
    whole_descriptors,
)
from kvxfer.cli.bench_table import rounds_text
from kvxfer.client.shm import ShmKVCache
from kvxfer.core.layout import BlockId, BlockSpan, GroupId, GroupKind
from kvxfer.core.planner import DEFAULT_CHUNK_BLOCKS, plan_blocks, plan_transfer
from kvxfer.core.profiles import layout_for_model
from kvxfer.dataplane.adapter import NixlAgent
from kvxfer.dataplane.descriptors import chunk_arrays
from kvxfer.dataplane.executor import ExecOptions, execute_plan

SIZES = {"1k": 1024, "16k": 16384, "128k": 131072}
BLOCK = 16


async def bench_case(
    model: str, tokens: int, repeat: int, options: ExecOptions, chunk_blocks: int
) -> dict[str, Any]:
    layout = layout_for_model(model, block_size=BLOCK)
    need = 2 * engine_bytes(layout, tokens)
    if need > SHM_BUDGET * mem_available():
        return {"model": model, "tokens": tokens, "skipped": f"needs {need / 2**30:.1f} GiB"}
    groups = plan_blocks(layout, tokens, 0)
    sliding = max(
        (len(g.blocks) for g in groups if g.group.kind is GroupKind.SLIDING_WINDOW), default=1
    )
    num_blocks = -(-tokens // BLOCK)
    src = ShmKVCache(layout, num_blocks, "bench-src", 1, sliding)
    dst = ShmKVCache(layout, num_blocks, "bench-dst", 1, sliding)
    spans = [
        BlockSpan(
            GroupId(g.group.group_id),
            g.blocks.start,
            tuple(BlockId(b) for b in range(len(g.blocks))),
        )
        for g in groups
        if g.blocks
    ]
    plan = plan_transfer(src.layout, dst.layout, spans, spans, tokens, 0, chunk_blocks)
    whole = plan_transfer(src.layout, dst.layout, spans, spans, tokens, 0, chunk_blocks=1 << 30)
    for cache in (src, dst):  # pre-touch every page: first-touch faults are not transfer cost
        for handle in cache.buffers:
            cache.view(handle.name)[:] = 1
    peer_proc = SourcePeer(src.buffers)
    try:
        async with LocalSide(dst.buffers) as side:
            assert isinstance(side.backend, NixlAgent)
            agent = side.backend
            peer = await agent.add_peer(peer_proc.metadata)
            remote_bases, local_bases = peer_proc.buffers, side.buffers
            remote, local, sizes = whole_descriptors(whole, remote_bases, local_bases)
            block_remote, block_local = split_per_block(remote, local, sizes)
            binds: list[float] = []

            async def kvxfer() -> float:
                start = time.perf_counter()
                result = await execute_plan(
                    plan,
                    backend=agent,
                    peer=peer,
                    local=local_bases,
                    remote=remote_bases,
                    block_size=BLOCK,
                    options=options,
                )
                elapsed = time.perf_counter() - start
                assert result.bytes_moved == plan.nbytes, result
                binds.append(result.bind_s)
                return elapsed

            methods: dict[str, Method] = {
                "memcpy": lambda: asyncio.to_thread(memcpy_round, whole, src.view, dst.view),
                "raw": lambda: agent.run_on_agent(lambda a: raw_read(a, peer, local, remote)),
                "per_block": lambda: agent.run_on_agent(
                    lambda a: per_block_read(a, peer, block_local, block_remote)
                ),
                "kvxfer": kvxfer,
            }
            times = await run_rounds(methods, repeat)
            chunks = [chunk_arrays(c, remote_bases, local_bases) for c in plan.chunks]
            setup = await agent.run_on_agent(
                lambda a: handle_setup(a, peer, chunks, block_local, block_remote)
            )
    finally:
        peer_proc.stop()
        src.close()
        dst.close()
    return {
        "model": model,
        "tokens": tokens,
        **summarize(times, plan.nbytes),
        "descriptors_raw": len(local),
        "descriptors_per_block": len(block_local),
        "chunks_kvxfer": len(plan.chunks),
        "bind_ms_p50": statistics.median(binds[1:]) * 1e3,
        "setup_coalesced_ms": setup["coalesced"] * 1e3,
        "setup_prepped_ms": setup["prepped"] * 1e3,
        "prep_once_ms": setup["prep_once"] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["gpt-oss-20b", "gemma-3-4b-it", "llama-3.1-8b", "qwen3-next-80b-a3b"],
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--chunk-blocks", type=int, default=DEFAULT_CHUNK_BLOCKS)
    parser.add_argument("--max-inflight", type=int, default=ExecOptions().max_inflight)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for size in args.sizes:
            options = ExecOptions(max_inflight=args.max_inflight)
            row = asyncio.run(
                bench_case(model, SIZES[size], args.repeat, options, args.chunk_blocks)
            )
            rows.append(row)
            if "skipped" in row:
                print(f"{model} {size}: skipped, {row['skipped']} of shared memory", flush=True)
                continue
            if not args.json:
                print(
                    f"{model:20s} {size:>5s} {row['bytes'] / 2**20:9.1f} MiB  "
                    f"memcpy {row['memcpy_gbps']:5.2f}  raw {row['raw_nixl_gbps']:5.2f}  "
                    f"per-block {row['per_block_gbps']:5.2f}  kvxfer {row['kvxfer_gbps']:5.2f} GB/s"
                    f"\n    kvxfer/raw {row['kvxfer_vs_raw']:.3f}, per round {rounds_text(row)}"
                    f"  per-block/raw {row['per_block_vs_raw']:.3f}  overhead p50 "
                    f"{row['overhead_ms_p50']:+.2f} ms (binding {row['bind_ms_p50']:.2f} ms)"
                    f"\n    handle setup per request: coalesced {row['setup_coalesced_ms']:.2f} ms"
                    f" in {row['chunks_kvxfer']} handles; prepared lists "
                    f"{row['setup_prepped_ms']:.2f} ms + {row['prep_once_ms']:.2f} ms once",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"cases": rows}))


if __name__ == "__main__":
    main()
