"""Different tensor-parallel sizes: which prefill rank serves which KV heads of a
decode rank (docs/planning.md, Different TP sizes). Pure.

Standard attention splits a layer's KV heads over the TP ranks: with H heads and
T ranks, rank r holds heads [r*H/T, (r+1)*H/T) when T divides H, and when H < T
(T a multiple of H) each head is replicated on T/H consecutive ranks, rank r
holding head r // (T/H). A decode rank needs its own heads; each comes from a
prefill rank holding it. Where a head is replicated on the prefill side, decode
readers are spread over its replicas (decode rank d reads replica d mod R), so
one prefill rank is not read by every decode rank.

Negotiation and the planner use it for groups whose blocks map by heads
(`reblock.BlockMapping.HEADS`): `split_problem` says why a side cannot be split,
`served_slices` what one decode rank reads from one prefill rank.

Inside a token-major block a rank's token is its heads one after another, so a
run of heads read from one prefill rank is one byte range of each token:
`HeadSlice.byte_range` says which. An MLA latent is the same on every rank (any
rank serves); a state group sharded by heads would map the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer._exceptions import LayoutError, PlanError
from kvxfer.core.layout import EngineLayout, KVGroup, check_int
from kvxfer.core.reblock import slicing_problem


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


def split_problem(layout: EngineLayout, group: KVGroup) -> str | None:
    """Why `group`'s tokens in `layout` cannot be cut into heads, or None."""
    if group.num_kv_heads is None:
        return (
            "the layout does not carry the group's KV head count (num_kv_heads), so a "
            "token cannot be cut into heads"
        )
    problem = slicing_problem(layout, group)
    if problem is not None:
        return problem
    for tensor in group.tensors:
        if layout.head_bytes(group, tensor) is None:
            return (
                f"tensor '{tensor.name}': a token's bytes do not split into the "
                f"{layout.rank_heads(group)} heads this rank holds"
            )
    return None


def served_slices(src: EngineLayout, dst: EngineLayout, group: KVGroup) -> tuple[HeadSlice, ...]:
    """The head runs decode rank `dst.tp_rank` reads from prefill rank `src.tp_rank`
    (empty when that rank serves it none of `group`'s heads)."""
    if group.num_kv_heads is None:
        raise LayoutError(f"groups[{group.group_id}].num_kv_heads", "unset; needed to split heads")
    return tuple(
        s
        for s in head_sources(group.num_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank)
        if s.src_rank == src.tp_rank
    )


def source_ranks(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> tuple[int, ...]:
    """The prefill ranks decode rank `dst_rank` reads, in order."""
    return tuple(sorted({s.src_rank for s in head_sources(num_kv_heads, src_tp, dst_tp, dst_rank)}))


def check_head_split(
    src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup, where: str
) -> None:
    """Different TP sizes: both sides cut into heads, the same head count and head bytes,
    and the source rank serves the destination rank some heads (the planner's
    precondition; negotiation explains refusals in detail)."""
    for side, layout, group in (("src", src, a), ("dst", dst, b)):
        problem = split_problem(layout, group)
        if problem is not None:
            raise PlanError(f"{where}.num_kv_heads", f"{side}: {problem}")
    if a.num_kv_heads != b.num_kv_heads:
        raise PlanError(
            f"{where}.num_kv_heads", f"src has {a.num_kv_heads} KV heads, dst {b.num_kv_heads}"
        )
    if [(t.name, src.head_bytes(a, t)) for t in a.tensors] != [
        (t.name, dst.head_bytes(b, t)) for t in b.tensors
    ]:
        raise PlanError(f"{where}.tensors", "tensor names or bytes per head differ")
    if not served_slices(src, dst, b):
        raise PlanError(
            "tp_rank",
            f"prefill rank {src.tp_rank} of {src.tp_size} holds none of decode rank "
            f"{dst.tp_rank}'s heads (of {dst.tp_size})",
        )
