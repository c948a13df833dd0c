"""`kvxfer-cli engine-sim`: a simulated engine for tests, the demo and trying kvxfer by hand.

It allocates a model profile's KV regions in shared memory, fills every
buffer with a known pattern (`kvxfer.client.patterns`, salted by role, seed
and buffer index), registers them with its sidecar and stays up until
SIGTERM or SIGINT, then unregisters and unlinks its segments. Its first
stdout line is JSON: engine id, epoch, the sidecar's peer address, and the
buffers and regions, so a driver can publish, pull and verify bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal

from kvxfer._exceptions import InvalidInputError, KvxferError, RegistrationError
from kvxfer.cli.main import layout_from_args
from kvxfer.client.engine import EngineClient
from kvxfer.client.patterns import fill, salt_for
from kvxfer.client.shm import SHM_DIR, ShmKVCache, shm_kv_cache


def run_engine_sim(args: argparse.Namespace) -> int:
    layout = layout_from_args(args, args.model)
    with contextlib.ExitStack() as stack:
        try:
            cache = stack.enter_context(
                shm_kv_cache(
                    layout,
                    args.num_blocks,
                    prefix=f"kvxfer-{args.role}",
                    num_state_blocks=args.state_blocks,
                    num_sliding_blocks=args.sliding_blocks,
                    num_chunked_blocks=args.chunked_blocks,
                )
            )
        except RegistrationError as exc:  # the segments do not fit in this host's memory
            raise InvalidInputError("--num-blocks", f"{exc} (fewer blocks would fit)") from exc
        _check_fits(cache)
        for index, handle in enumerate(cache.buffers):
            fill(cache.view(handle.name), salt_for(args.role, args.seed, index))
        return asyncio.run(_serve(args, cache))


def _check_fits(cache: ShmKVCache) -> None:
    """Shared memory is sized before it is used: filling segments larger than the space
    left would end this process with SIGBUS halfway, not with an error."""
    needed = sum(handle.size_bytes for handle in cache.buffers)
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if needed > free:
        raise InvalidInputError(
            "--num-blocks",
            f"the KV cache takes {needed} bytes of shared memory, and {SHM_DIR} has "
            f"{free} free (fewer blocks would fit)",
        )


async def _serve(args: argparse.Namespace, cache: ShmKVCache) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with EngineClient(args.sidecar) as client:
        name = args.name or f"{args.role}-{os.getpid()}"
        registration = await client.register(cache.layout, cache.buffers, name=name)
        ready = {
            "engine_id": registration.engine_id,
            "epoch": registration.epoch,
            "peer_address": registration.peer_address,
            "role": args.role,
            "seed": args.seed,
            "model": args.model,
            "kv_dtype": args.kv_dtype,
            "block_size": args.block_size,
            "tp_size": args.tp_size,
            "tp_rank": args.tp_rank,
            "head_major": cache.layout.head_major,
            "token_rows": cache.layout.token_rows,
            "num_blocks": args.num_blocks,
            "state_blocks": args.state_blocks,
            "sliding_blocks": args.sliding_blocks or args.num_blocks,
            "chunked_blocks": args.chunked_blocks or args.num_blocks,
            "pid": os.getpid(),
            "buffers": [dataclasses.asdict(h) | {"kind": h.kind.value} for h in cache.buffers],
            "regions": [dataclasses.asdict(r) for r in cache.layout.regions],
        }
        print(json.dumps(ready, default=str), flush=True)
        await stop.wait()
        try:
            await client.unregister()
        except KvxferError as exc:  # the sidecar may be gone first; the segments still go
            print(f"kvxfer-cli engine-sim: unregister: {exc}", flush=True)
    return 0
