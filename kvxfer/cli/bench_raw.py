"""Raw NIXL, the bench's baselines: run on the bench agent's thread (the agent object
is NIXL's own, handed in by `NixlAgent.run_on_agent`; nothing here imports nixl)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer._exceptions import KvxferError
from kvxfer.core.buffers import BoundBuffer
from kvxfer.core.planner import TransferPlan
from kvxfer.dataplane.descriptors import DescArray, chunk_arrays


def _wait(agent: Any, handle: Any) -> None:
    while (state := agent.check_xfer_state(handle)) == "PROC":
        pass
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise KvxferError(f"raw NIXL transfer ended {state}")


def raw_read(agent: Any, peer: str, local: DescArray, remote: DescArray) -> float:
    """One READ handle over coalesced descriptors; seconds from create to done."""
    start = time.perf_counter()
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer
    )
    agent.transfer(handle)
    _wait(agent, handle)
    return time.perf_counter() - start


def per_block_read(agent: Any, peer: str, local: DescArray, remote: DescArray) -> float:
    """Prepared per-block lists (prepared once per peer by a connector, so not timed),
    then one make_prepped_xfer with every index."""
    local_list = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
    remote_list = agent.prep_xfer_dlist(peer, remote, "DRAM")
    indices = np.arange(len(local), dtype=np.int32)
    start = time.perf_counter()
    handle = agent.make_prepped_xfer("READ", local_list, indices, remote_list, indices)
    agent.transfer(handle)
    _wait(agent, handle)
    elapsed = time.perf_counter() - start
    agent.release_dlist_handle(local_list)
    agent.release_dlist_handle(remote_list)
    return elapsed


def handle_setup(
    agent: Any,
    peer: str,
    chunks: Sequence[tuple[DescArray, DescArray]],
    block_local: DescArray,
    block_remote: DescArray,
) -> dict[str, float]:
    """What it costs NIXL to set a request's handles up, transferring nothing (seconds):

    - coalesced: kvxfer's way, per request: descriptor lists and a handle per chunk
      from its coalesced (src, dst) arrays
    - prepped:   the prepared-list way, per request: one make_prepped_xfer over every
      (region, block) index of lists prepared beforehand
    - prep_once: preparing those per-block lists (once per peer and registration)
    """
    start = time.perf_counter()
    for src, dst in chunks:
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(dst, "DRAM"), agent.get_xfer_descs(src, "DRAM"), peer
        )
        agent.release_xfer_handle(handle)
    coalesced = time.perf_counter() - start
    start = time.perf_counter()
    local_list = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_local, "DRAM")
    remote_list = agent.prep_xfer_dlist(peer, block_remote, "DRAM")
    prep_once = time.perf_counter() - start
    indices = np.arange(len(block_local), dtype=np.int32)
    start = time.perf_counter()
    handle = agent.make_prepped_xfer("READ", local_list, indices, remote_list, indices)
    agent.release_xfer_handle(handle)
    prepped = time.perf_counter() - start
    agent.release_dlist_handle(local_list)
    agent.release_dlist_handle(remote_list)
    return {"coalesced": coalesced, "prepped": prepped, "prep_once": prep_once}


def split_per_block(
    src: DescArray, dst: DescArray, block_bytes: Sequence[int]
) -> tuple[DescArray, DescArray]:
    """Cut each coalesced descriptor into block-sized ones."""
    out_s, out_d = [], []
    for (s_addr, length, s_dev), (d_addr, _, d_dev), size in zip(
        src, dst, block_bytes, strict=True
    ):
        offsets = np.arange(int(length) // size, dtype=np.uint64) * np.uint64(size)
        out_s.append(_blocks(s_addr + offsets, size, int(s_dev)))
        out_d.append(_blocks(d_addr + offsets, size, int(d_dev)))
    return np.concatenate(out_s), np.concatenate(out_d)


def _blocks(addresses: DescArray, size: int, device: int) -> DescArray:
    count = len(addresses)
    columns = [addresses, np.full(count, size, np.uint64), np.full(count, device, np.uint64)]
    return np.stack(columns, axis=1)


def whole_descriptors(
    plan: TransferPlan, src: dict[str, BoundBuffer], dst: dict[str, BoundBuffer]
) -> tuple[DescArray, DescArray, list[int]]:
    """Coalesced (src, dst) descriptors of a plan planned as one chunk per group, and
    each descriptor's block size."""
    pieces = [chunk_arrays(c, src, dst) for c in plan.chunks]
    sizes = []
    for chunk, (s, _) in zip(plan.chunks, pieces, strict=True):
        per_region = len(s) // len(chunk.regions)
        sizes += [pair.src.block_bytes for pair in chunk.regions for _ in range(per_region)]
    return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]), sizes


def raw_posts(
    agent: Any, posts: Sequence[tuple[str, DescArray, DescArray]], op: str = "READ"
) -> list[float]:
    """`op` (READ: remote into local; WRITE: local into remote) handles over (peer,
    local, remote) descriptors, created and posted one after the other, then polled
    until every one is done: each one's seconds from the start, in the order they
    finished."""
    start = time.perf_counter()
    pending = []
    try:
        for peer, local, remote in posts:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer,
            )
            agent.transfer(handle)
            pending.append(handle)
    except Exception as exc:  # NIXL's own errors (a peer that went away): the bench's report
        raise KvxferError(f"raw NIXL could not post a {op}: {type(exc).__name__}: {exc}") from exc
    done: list[float] = []
    while pending:
        still = []
        for handle in pending:
            state = agent.check_xfer_state(handle)
            if state == "PROC":
                still.append(handle)
                continue
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise KvxferError(f"raw NIXL transfer ended {state}")
            done.append(time.perf_counter() - start)
        pending = still
    return done
