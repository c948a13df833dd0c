"""Different tensor-parallel sizes: which prefill rank serves which KV heads of a
decode rank (docs/planning.md, Different TP sizes). Pure; not wired into
negotiation or the planner yet, which still refuse different TP sizes.

Standard attention splits a layer's KV heads over the TP ranks: with H heads and
T ranks, rank r holds heads [r*H/T, (r+1)*H/T) when T divides H, and when H < T
(T a multiple of H) each head is replicated on T/H consecutive ranks, rank r
holding head r // (T/H). A decode rank needs its own heads; each comes from a
prefill rank holding it. Where a head is replicated on the prefill side, decode
readers are spread over its replicas (decode rank d reads replica d mod R), so
one prefill rank is not read by every decode rank.

Inside a token-major block a rank's token is its heads one after another, so a
run of heads read from one prefill rank is one byte range of each token:
`HeadSlice.byte_range` says which. An MLA latent is the same on every rank (any
rank serves); a state group sharded by heads would map the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import check_int


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads rank `rank` of `tp_size` holds."""
    check_int("num_kv_heads", num_kv_heads, 1, 1 << 16)
    check_int("tp_size", tp_size, 1, 1 << 12)
    check_int("tp_rank", rank, 0, tp_size - 1)
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise LayoutError(
                "tp_size", f"{num_kv_heads} KV heads do not split evenly over {tp_size} ranks"
            )
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise LayoutError(
            "tp_size", f"{tp_size} ranks do not replicate {num_kv_heads} KV heads evenly"
        )
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def serving_rank(num_kv_heads: int, src_tp: int, head: int, reader: int) -> int:
    """The prefill rank decode rank `reader` reads global `head` from."""
    if num_kv_heads >= src_tp:
        return head // (num_kv_heads // src_tp)
    replicas = src_tp // num_kv_heads
    return head * replicas + reader % replicas


@dataclass(frozen=True)
class HeadSlice:
    """Heads `dst_heads` of the decode rank (its own numbering, from 0) come from heads
    `src_heads` of prefill rank `src_rank` (that rank's numbering)."""

    src_rank: int
    src_heads: range
    dst_heads: range

    def byte_range(self, head_bytes: int) -> tuple[int, int, int]:
        """(offset in a prefill token, offset in a decode token, length) in bytes."""
        return (
            self.src_heads.start * head_bytes,
            self.dst_heads.start * head_bytes,
            len(self.dst_heads) * head_bytes,
        )


def head_sources(
    num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int
) -> tuple[HeadSlice, ...]:
    """What decode rank `dst_rank` reads, as maximal runs of heads from one prefill rank."""
    mine = rank_heads(num_kv_heads, dst_tp, dst_rank)
    slices: list[HeadSlice] = []
    for local, head in enumerate(mine):
        rank = serving_rank(num_kv_heads, src_tp, head, dst_rank)
        src_local = head - rank_heads(num_kv_heads, src_tp, rank).start
        last = slices[-1] if slices else None
        if last and last.src_rank == rank and last.src_heads.stop == src_local:
            slices[-1] = HeadSlice(
                rank,
                range(last.src_heads.start, src_local + 1),
                range(last.dst_heads.start, local + 1),
            )
        else:
            slices.append(HeadSlice(rank, range(src_local, src_local + 1), range(local, local + 1)))
    return tuple(slices)


def request_valid_tokens(per_rank: dict[int, int]) -> int:
    """One `valid_tokens` for a request pulled by several decode ranks: every rank must
    resume at the same token, so the engine resumes where the worst rank can."""
    if not per_rank:
        raise LayoutError("valid_tokens", "no decode rank reported")
    return min(per_rank.values())
