"""What an agreement between different TP sizes lists for the handshake and the
engine: which prefill rank serves which heads (`HeadRead`) and which byte ranges of a
state block (`StateRead`) to the decode rank (kvxfer/core/tp_map.py has the rules).
Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.core.layout import EngineLayout, KVGroup
from kvxfer.core.tp_map import head_sources, state_pieces


@dataclass(frozen=True)
class HeadRead:
    """Heads [start, stop) of prefill rank `src_rank` land on this rank's heads
    `dst_heads` (each side numbers its own heads from 0)."""

    src_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]


@dataclass(frozen=True)
class StateRead:
    """Bytes [dst_at, dst_at + length) of this rank's block of every `tensor` state tensor
    come from bytes at `src_at` of prefill rank `src_rank`'s."""

    tensor: str
    src_rank: int
    src_at: int
    dst_at: int
    length: int


def head_reads(local: EngineLayout, group: KVGroup, peer: EngineLayout) -> tuple[HeadRead, ...]:
    """Different TP sizes: the runs of this rank's heads and the prefill rank of each."""
    assert group.num_kv_heads is not None  # negotiation refused it otherwise
    return tuple(
        HeadRead(
            s.src_rank,
            (s.src_heads.start, s.src_heads.stop),
            (s.dst_heads.start, s.dst_heads.stop),
        )
        for s in head_sources(group.num_kv_heads, peer.tp_size, local.tp_size, local.tp_rank)
    )


def state_reads(local: EngineLayout, group: KVGroup, peer: EngineLayout) -> tuple[StateRead, ...]:
    """Different TP sizes: the pieces of the first tensor of each suffix (every layer of a
    group is cut alike in the models kvxfer reads; the planner cuts each on its own)."""
    if local.tp_size == peer.tp_size:
        return ()
    seen: dict[str, StateRead] = {}
    reads: list[StateRead] = []
    for tensor in group.tensors:
        suffix = tensor.name.rsplit(".", 1)[-1]
        if suffix in seen or tensor.shard is None:
            continue
        pieces = state_pieces(tensor.shard, peer.tp_size, local.tp_size, local.tp_rank)
        found = [StateRead(suffix, p.src_rank, p.src_at, p.dst_at, p.length) for p in pieces]
        seen[suffix] = found[0]
        reads += found
    return tuple(reads)
