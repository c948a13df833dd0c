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
`HeadSlice.byte_range` says which. Inside a head-major block (vLLM's CPU pages) a
head holds every token of the block, so the run is one byte range of the block
(`head_unit_bytes`); both sides must then order blocks alike, at equal block sizes
(`pair_split_problem`). An mla latent is read whole from one rank
(`mla_server`). A state tensor (`layout.StateShard`) is rows of segments, each
split over the ranks like KV heads: `state_pieces` says which byte ranges of a
decode rank's state block come from which prefill rank. A unit replicated on the
prefill side (Mamba-2's single B/C group) is read from the lowest replica the decode
rank already reads for the tensor's split segments, so replication never adds a
source.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvxfer._exceptions import LayoutError, PlanError
from kvxfer.core.layout import (
    MAX_TP_SIZE,
    EngineLayout,
    GroupKind,
    KVGroup,
    StateShard,
    TensorSpec,
    check_int,
)
from kvxfer.core.reblock import HEAD_SPLIT_KINDS, slicing_problem, strided_problem


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads rank `rank` of `tp_size` holds."""
    check_int("num_kv_heads", num_kv_heads, 1, 1 << 16)
    check_int("tp_size", tp_size, 1, MAX_TP_SIZE)
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
    if not layout.head_major and not layout.token_major:
        return (
            "this layout's blocks are in the engine's own order (neither token-major nor "
            "head-major), so a head is no byte range kvxfer can name; such blocks pair "
            "only with their own order, block size and TP size"
        )
    if not layout.head_major:
        problem = slicing_problem(layout, group)
        if problem is not None:
            return problem
    unit = "a head-major block's" if layout.head_major else "a token's"
    for tensor in group.tensors:
        if head_unit_bytes(layout, group, tensor) is None:
            return (
                f"tensor '{tensor.name}': {unit} bytes do not split into the "
                f"{layout.rank_heads(group)} heads this rank holds"
            )
    return None


class HeadCut(enum.StrEnum):
    """How a group mapped by heads is cut into byte ranges (docs/planning.md)."""

    BLOCK = "block"  # both head-major alike, equal block sizes: a run of heads per block
    TOKEN = "token"  # both token-major: a run of heads is one byte range of each token
    # Any other pair (token-major against HND, HND of different block sizes): one head at
    # a time, `row_tokens` of its tokens one byte range on both sides.
    ROWS = "rows"


def head_cut(src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup) -> HeadCut:
    """How `a` (source) and `b` (destination), mapped by heads, are cut."""
    if not src.head_major and not dst.head_major:
        return HeadCut.TOKEN
    if (
        src.head_major
        and dst.head_major
        and src.token_rows == dst.token_rows
        and src.block_size_of(a) == dst.block_size_of(b)
    ):
        return HeadCut.BLOCK
    return HeadCut.ROWS


def holds_rows(layout: EngineLayout, group: KVGroup) -> bool:
    """A head's tokens are consecutive rows of this side's blocks: HND blocks, or
    token-major ones whose rank holds a single head (then a token is one head)."""
    return layout.token_rows or (layout.token_major and layout.rank_heads(group) == 1)


def row_tokens(src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup) -> int:
    """Tokens of one head that are one byte range on both sides (`HeadCut.ROWS`): the
    gcd of the block sizes where both sides hold a head's tokens as rows, else one."""
    if holds_rows(src, a) and holds_rows(dst, b):
        return math.gcd(src.block_size_of(a), dst.block_size_of(b))
    return 1


def pair_split_problem(src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup) -> str | None:
    """Why the two sides' blocks, each cut into heads, cannot be cut to meet, or None.
    A run of heads is one byte range of a token (token-major) or of a head-major block;
    between two orders, or head-major blocks of different sizes, heads move a token
    range at a time, which needs each side to name a token of a head: token-major or
    HND blocks can, head-major ones in an engine's own order (vLLM's CPU pages) cannot.
    The source is the prefill side, the destination the decode side."""
    if head_cut(src, a, dst, b) is not HeadCut.ROWS:
        return None
    sizes = f"{src.block_size_of(a)} (prefill) and {dst.block_size_of(b)} (decode)"
    for side, layout, other in (("prefill", src, dst), ("decode", dst, src)):
        if not layout.head_major or layout.token_rows:
            continue
        if other.head_major and not other.token_rows:  # the same order, sizes differ
            return (
                f"head-major blocks of {sizes} tokens: a head holds every token of its "
                "block in the engine's own order, so a token range of it is no byte range "
                "kvxfer can name; run the same block size on both sides, or register HND "
                "blocks (token_rows)"
            )
        theirs = "HND (token rows)" if other.head_major else "token-major"
        return (
            f"the {side} side's blocks are head-major (a head's bytes for every token of "
            f"the block, in the engine's own order), the other side's {theirs}: a token "
            "of a head is no byte range there, so the two cannot be cut to meet; run "
            "both sides in the same order and block size, or register HND blocks "
            "(token_rows)"
        )
    return None


def rows_problem(src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup) -> str | None:
    """Why heads cut a token range at a time (`HeadCut.ROWS`) cannot be named as byte
    ranges on a side whose order allows it (strided pages, bytes that do not split), or
    None."""
    if head_cut(src, a, dst, b) is not HeadCut.ROWS:
        return None
    for side, layout, group in (("prefill", src, a), ("decode", dst, b)):
        problem = _rows_problem(layout, group)
        if problem is not None:
            return f"heads move a token range at a time, but on the {side} side {problem}"
    return None


def _rows_problem(layout: EngineLayout, group: KVGroup) -> str | None:
    """Why a head's token rows in `layout`'s blocks are not byte ranges kvxfer can name."""
    for tensor in group.tensors:
        if layout.head_bytes(group, tensor) is None:
            heads = layout.rank_heads(group)
            return f"tensor '{tensor.name}' does not split into {heads} heads of whole tokens"
    return strided_problem(layout, group, "head rows")


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
    problem = pair_split_problem(src, a, dst, b)
    if problem is not None:
        raise PlanError(f"{where}.block_size", problem)
    problem = rows_problem(src, a, dst, b)
    if problem is not None:
        raise PlanError(f"{where}.tensors", problem)

    # Whole head-major blocks compare a head's bytes over a block, anything else a token's.
    whole = head_cut(src, a, dst, b) is HeadCut.BLOCK
    per_head = head_unit_bytes if whole else EngineLayout.head_bytes
    if [(t.name, per_head(src, a, t)) for t in a.tensors] != [
        (t.name, per_head(dst, b, t)) for t in b.tensors
    ]:
        raise PlanError(f"{where}.tensors", "tensor names or bytes per head differ")


def head_unit_bytes(layout: EngineLayout, group: KVGroup, tensor: TensorSpec) -> int | None:
    """Bytes of one head in the unit a head run is cut from: a token of a token-major
    block, a whole head-major block."""
    if layout.head_major:
        return layout.head_block_bytes(group, tensor)
    return layout.head_bytes(group, tensor)


def check_state_split(
    src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup, where: str
) -> None:
    """Different TP sizes, a state group: both sides say how every tensor is cut, the
    same tensors and the same cut (the planner's precondition)."""
    for side, group in (("src", a), ("dst", b)):
        problem = state_problem(group)
        if problem is not None:
            raise PlanError(f"{where}.tensors", f"{side}: {problem}")
    if [(t.name, t.shard) for t in a.tensors] != [(t.name, t.shard) for t in b.tensors]:
        raise PlanError(f"{where}.tensors", "tensor names or state cuts (shard) differ")


def check_serves(src: EngineLayout, dst: EngineLayout) -> None:
    """The source rank serves the destination rank something (different TP sizes)."""
    if src.tp_rank not in pairing_sources(src.tp_size, dst):
        raise PlanError(
            "tp_rank",
            f"prefill rank {src.tp_rank} of {src.tp_size} holds none of decode rank "
            f"{dst.tp_rank}'s heads or state (of {dst.tp_size})",
        )


@dataclass(frozen=True)
class StatePiece:
    """`length` bytes at `src_at` of prefill rank `src_rank`'s state block land at `dst_at`
    of the decode rank's (offsets inside one block of one tensor)."""

    src_rank: int
    src_at: int
    dst_at: int
    length: int


@functools.lru_cache(maxsize=1024)
def state_pieces(
    shard: StateShard, src_tp: int, dst_tp: int, dst_rank: int
) -> tuple[StatePiece, ...]:
    """Every byte of decode rank `dst_rank`'s block of a state tensor cut as `shard`,
    with the prefill rank it comes from: grouped by prefill rank, in decode order, runs
    contiguous on both sides coalesced."""
    row = _row_pieces(shard, src_tp, dst_tp, dst_rank)
    src_row, dst_row = shard.row_bytes(src_tp), shard.row_bytes(dst_tp)
    pieces = [
        StatePiece(p.src_rank, r * src_row + p.src_at, r * dst_row + p.dst_at, p.length)
        for r in range(shard.rows)
        for p in row
    ]
    out: list[StatePiece] = []
    for rank in sorted({p.src_rank for p in pieces}):
        out += _coalesce(p for p in pieces if p.src_rank == rank)
    return tuple(out)


def _coalesce(pieces: Iterable[StatePiece]) -> list[StatePiece]:
    out: list[StatePiece] = []
    for p in sorted(pieces, key=lambda p: p.dst_at):
        last = out[-1] if out else None
        if last and last.src_at + last.length == p.src_at and last.dst_at + last.length == p.dst_at:
            out[-1] = StatePiece(p.src_rank, last.src_at, last.dst_at, last.length + p.length)
        else:
            out.append(p)
    return out


def _row_pieces(shard: StateShard, src_tp: int, dst_tp: int, dst_rank: int) -> list[StatePiece]:
    """One row's pieces: split segments by intersecting rank ranges, then replicated
    units from a replica this decode rank already reads where there is one."""
    pieces: list[StatePiece] = []
    replicated: list[tuple[int, int, int, int]] = []  # (segment, unit, src_at, dst_at)
    src_at = dst_at = 0
    for index, segment in enumerate(shard.segments):
        heads, size = segment.heads, segment.head_bytes
        mine = rank_heads(heads, dst_tp, dst_rank)
        if heads >= src_tp:
            per = heads // src_tp
            for rank in range(mine.start // per, (mine.stop - 1) // per + 1):
                lo, hi = max(mine.start, rank * per), min(mine.stop, (rank + 1) * per)
                at = src_at + (lo - rank * per) * size
                pieces.append(
                    StatePiece(rank, at, dst_at + (lo - mine.start) * size, (hi - lo) * size)
                )
        else:
            replicated += [(index, h, src_at, dst_at + i * size) for i, h in enumerate(mine)]
        src_at += max(1, heads // src_tp) * size
        dst_at += max(1, heads // dst_tp) * size
    read = {p.src_rank for p in pieces}
    for index, unit, at, to in replicated:
        heads = shard.segments[index].heads
        replicas = src_tp // heads
        holders = set(range(unit * replicas, (unit + 1) * replicas)) & read
        rank = min(holders) if holders else serving_rank(heads, src_tp, unit, dst_rank)
        pieces.append(StatePiece(rank, at, to, shard.segments[index].head_bytes))
    return pieces


def state_problem(group: KVGroup) -> str | None:
    """Why `group`'s state cannot be cut over TP ranks, or None."""
    for tensor in group.tensors:
        if tensor.shard is None:
            return (
                f"tensor '{tensor.name}': the layout does not say how it is cut over TP "
                "ranks (shard)"
            )
    return None


def served_state(
    src: EngineLayout, dst: EngineLayout, group: KVGroup
) -> dict[str, list[StatePiece]]:
    """Per tensor, the pieces prefill rank `src.tp_rank` serves decode rank `dst.tp_rank`
    (only tensors it serves something)."""
    out: dict[str, list[StatePiece]] = {}
    for tensor in group.tensors:
        if tensor.shard is None:
            raise LayoutError(f"groups[{group.group_id}].tensors['{tensor.name}'].shard", "unset")
        pieces = state_pieces(tensor.shard, src.tp_size, dst.tp_size, dst.tp_rank)
        mine = [p for p in pieces if p.src_rank == src.tp_rank]
        if mine:
            out[tensor.name] = mine
    return out


def group_sources(src_tp: int, dst: EngineLayout, group: KVGroup) -> set[int]:
    """The prefill ranks (of `src_tp`) decode rank `dst.tp_rank` reads for `group`."""
    if src_tp == dst.tp_size:
        return {dst.tp_rank}
    if group.kind is GroupKind.MLA:
        return {mla_server(src_tp, dst)}
    if group.kind in HEAD_SPLIT_KINDS:
        if group.num_kv_heads is None:
            return set()
        return set(source_ranks(group.num_kv_heads, src_tp, dst.tp_size, dst.tp_rank))
    return {
        p.src_rank
        for t in group.tensors
        if t.shard is not None
        for p in state_pieces(t.shard, src_tp, dst.tp_size, dst.tp_rank)
    }


def mla_server(src_tp: int, dst: EngineLayout) -> int:
    """The prefill rank decode rank `dst.tp_rank` reads an mla latent from: it is the
    same on every rank, so the lowest rank it reads for its other groups, else
    rank d mod Tp (spreading latent-only readers over the prefill ranks)."""
    others: set[int] = set()
    for group in dst.groups:
        if group.kind is not GroupKind.MLA:
            others |= group_sources(src_tp, dst, group)
    return min(others) if others else dst.tp_rank % src_tp


def pairing_sources(src_tp: int, dst: EngineLayout) -> tuple[int, ...]:
    """The prefill ranks decode rank `dst.tp_rank` reads, over all its groups."""
    ranks: set[int] = set()
    for group in dst.groups:
        ranks |= group_sources(src_tp, dst, group)
    return tuple(sorted(ranks))
