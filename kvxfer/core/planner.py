"""Which KV blocks a request must move, and the descriptors that move them.

The rules (docs/planning.md, The rules), with N prompt tokens held by the
source, C tokens the destination already holds, block size B, window W:

- full_attention: tokens [C, N) -> logical blocks floor(C/B) .. ceil(N/B)-1
- mla: as full attention (a latent layer reads every cached token)
- sliding_window: the next decode step at position N attends to [N-W+1, N],
  so the cached tokens needed are [max(C, N-W+1, 0), N). Computed from N: a
  fixed cdiv(W, B) can miss a block, cdiv(W, B)+1 often moves one too many.
- chunked_local: the next step at position N reads the cached tokens of its own
  chunk of S tokens, [max(C, floor(N/S)*S), N) (nothing when N starts a chunk).
- mamba: the single state block (logical block 0) unless C == N.

`plan_transfer` turns that into chunks of consecutive logical blocks of one
group; inside a chunk, runs of block ids consecutive on both sides become one
descriptor per region (when both regions are contiguous). Every span and id
is validated against the regions before any descriptor exists. The planner
is address-free: descriptors carry buffer names and byte offsets, and the
data plane binds them to registered memory.

When the two sides' block sizes differ (kvxfer/core/reblock.py), the plan's
blocks are the destination's, the moved tokens of each attention group are a
token range (`GroupPlan.tokens`), and runs are made of token slices of
gcd(Bs, Bd) tokens, so whole blocks still coalesce where boundaries line up.

When the two sides' TP sizes differ (kvxfer/core/tp_map.py), a plan is one source
rank's share: each attention token's run of heads it holds, each state block's byte
ranges it holds (`tp_map.state_pieces`, coalesced), and nothing of a group it serves
none of (that group's plan is empty; another source rank's plan moves it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvxfer._exceptions import LayoutError, PlanError
from kvxfer.core.identity import IdentityMemo
from kvxfer.core.layout import (
    MAX_TOKENS,
    BlockSpan,
    EngineLayout,
    GroupId,
    GroupKind,
    KVGroup,
    Region,
    group_block_size,
)
from kvxfer.core.reblock import (
    BlockMapping,
    check_sliceable,
    head_region,
    mapping_of,
    moved_tokens,
    row_region,
    slice_region,
    slice_span,
    slice_tokens,
)
from kvxfer.core.tp_map import (
    HeadCut,
    StatePiece,
    check_head_split,
    check_serves,
    check_state_split,
    head_cut,
    head_unit_bytes,
    holds_rows,
    mla_server,
    row_tokens,
    served_slices,
    served_state,
)

DEFAULT_CHUNK_BLOCKS = 1024  # 16k tokens at B=16; see docs/dataplane.md "Chunks"


def check_request(num_tokens: int, computed_tokens: int, block_size: int) -> None:
    """Raise PlanError unless 1 <= N <= MAX_TOKENS, 0 <= C <= N and C is a multiple of B
    or N."""
    for name, value in (("num_tokens", num_tokens), ("computed_tokens", computed_tokens)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(name, f"must be an integer, got {value!r}")
    if num_tokens < 1:
        raise PlanError("num_tokens", f"must be at least 1, got {num_tokens}")
    if num_tokens > MAX_TOKENS:  # no request may be longer (TransferParams)
        raise PlanError("num_tokens", f"must be at most {MAX_TOKENS}, got {num_tokens}")
    if not 0 <= computed_tokens <= num_tokens:
        raise PlanError(
            "computed_tokens", f"must be in [0, num_tokens={num_tokens}], got {computed_tokens}"
        )
    if computed_tokens % block_size and computed_tokens != num_tokens:
        raise PlanError(
            "computed_tokens",
            f"must be a multiple of block_size {block_size} or equal num_tokens "
            f"{num_tokens}, got {computed_tokens}",
        )


def check_groups_request(
    groups: Sequence[KVGroup], num_tokens: int, computed_tokens: int, block_size: int
) -> None:
    """`check_request` against the block size of every attention group (a Mamba group
    holds one state whatever its block size, so it does not constrain C)."""
    sizes = {group_block_size(g, block_size) for g in groups if g.kind is not GroupKind.MAMBA}
    for size in sorted(sizes) or [block_size]:
        check_request(num_tokens, computed_tokens, size)


def needed_blocks(
    kind: GroupKind,
    window: int | None,
    num_tokens: int,
    computed_tokens: int,
    block_size: int,
    *,
    chunk_size: int | None = None,
) -> range:
    """Logical blocks of one group that must move (empty when nothing does).
    `window` is a sliding_window group's, `chunk_size` a chunked_local group's."""
    if computed_tokens >= num_tokens:
        return range(0)
    if kind is GroupKind.MAMBA:
        return range(1)
    end = -(-num_tokens // block_size)
    if kind in (GroupKind.FULL_ATTENTION, GroupKind.MLA):
        return range(computed_tokens // block_size, end)
    if kind is GroupKind.CHUNKED_LOCAL:
        if chunk_size is None:
            raise PlanError("chunk_size", "required to plan a chunked_local group")
        first_token = max(computed_tokens, num_tokens // chunk_size * chunk_size)
    else:
        if window is None:
            raise PlanError("sliding_window", "required to plan a sliding_window group")
        first_token = max(computed_tokens, num_tokens - window + 1, 0)
    if first_token >= num_tokens:
        return range(0)  # W == 1, or N starts a chunk: the next step reads no cached token
    return range(first_token // block_size, end)


def group_blocks(group: KVGroup, num_tokens: int, computed_tokens: int, block_size: int) -> range:
    """`needed_blocks` of `group` (block_size: the group's own, see block_size_of)."""
    return needed_blocks(
        group.kind,
        group.sliding_window,
        num_tokens,
        computed_tokens,
        block_size,
        chunk_size=group.chunk_size,
    )


@dataclass(frozen=True)
class GroupPlan:
    """What moves for one group: its logical blocks (the reader's) and their bytes.

    `tokens` is set when the two sides' block sizes differ: the token range that moves,
    which may start or end inside a block (docs/planning.md, Different block sizes);
    `moved_bytes` is then what those tokens weigh."""

    group: KVGroup
    blocks: range
    tokens: range | None = None
    moved_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        if self.moved_bytes is not None:
            return self.moved_bytes
        return len(self.blocks) * self.group.bytes_per_block


def plan_blocks(
    layout: EngineLayout, num_tokens: int, computed_tokens: int
) -> tuple[GroupPlan, ...]:
    """The exact blocks of every group for one request."""
    check_groups_request(layout.groups, num_tokens, computed_tokens, layout.block_size)
    return tuple(
        GroupPlan(
            group, group_blocks(group, num_tokens, computed_tokens, layout.block_size_of(group))
        )
        for group in layout.groups
    )


def full_attention_blocks(
    group: KVGroup, num_tokens: int, computed_tokens: int, block_size: int
) -> range:
    """The blocks of `group` a transfer treating it as full attention would move
    (Mamba state stays one block; an mla group is read as full attention anyway)."""
    kind = GroupKind.MAMBA if group.kind is GroupKind.MAMBA else GroupKind.FULL_ATTENTION
    return needed_blocks(kind, None, num_tokens, computed_tokens, block_size)


def full_attention_bytes(layout: EngineLayout, num_tokens: int, computed_tokens: int) -> int:
    """Bytes moved if every sliding-window group were treated as full attention."""
    check_groups_request(layout.groups, num_tokens, computed_tokens, layout.block_size)
    return sum(
        len(full_attention_blocks(g, num_tokens, computed_tokens, layout.block_size_of(g)))
        * g.bytes_per_block
        for g in layout.groups
    )


def pool_blocks(layout: EngineLayout, max_tokens: int) -> dict[GroupKind, int]:
    """The most blocks one request of up to `max_tokens` can need in a group of each kind:
    what an engine's pool must hold per request in flight."""
    attention = [g for g in layout.groups if g.kind is not GroupKind.MAMBA]
    sizes = [layout.block_size_of(g) for g in attention] or [layout.block_size]
    full = max(-(-max_tokens // size) for size in sizes)
    windows = [(g.sliding_window, layout.block_size_of(g)) for g in attention if g.sliding_window]
    # W - 1 cached tokens starting anywhere in a block span at most cdiv(W - 1 + B - 1, B)
    # blocks; at least one block so an engine can be sized at all (W == 1 needs none).
    sliding = max((max(1, -(-(w + b - 2) // b)) for w, b in windows), default=1)
    chunks = [(g.chunk_size, layout.block_size_of(g)) for g in attention if g.chunk_size]
    # At most S - 1 cached tokens from a chunk start kS, which lies at most B - gcd(S, B)
    # tokens into its block: an upper bound, reached when some kS + S - 1 <= max_tokens.
    chunked = max(
        (max(1, -(-(s - 1 + b - math.gcd(s, b)) // b)) for s, b in chunks),
        default=1,
    )
    return {
        GroupKind.FULL_ATTENTION: full,
        GroupKind.MLA: full,
        GroupKind.SLIDING_WINDOW: min(full, sliding),
        GroupKind.CHUNKED_LOCAL: min(full, chunked),
        GroupKind.MAMBA: 1,
    }


@dataclass(frozen=True)
class Descriptor:
    """One contiguous copy: `length` bytes from src buffer+offset to dst buffer+offset."""

    src_buffer: str
    src_offset: int
    dst_buffer: str
    dst_offset: int
    length: int


@dataclass(frozen=True)
class Run:
    """`count` blocks whose ids are consecutive on both sides."""

    src_block: int
    dst_block: int
    count: int


@dataclass(frozen=True)
class RegionPair:
    """The same tensor on both sides."""

    src: Region
    dst: Region

    @property
    def coalescable(self) -> bool:
        return self.src.contiguous and self.dst.contiguous


@dataclass(frozen=True)
class Chunk:
    """Consecutive logical blocks of one group, all its regions: one NIXL handle."""

    group_id: GroupId
    blocks: range
    runs: tuple[Run, ...]
    regions: tuple[RegionPair, ...]

    @property
    def nbytes(self) -> int:
        return self.units * sum(pair.src.block_bytes for pair in self.regions)

    @property
    def units(self) -> int:
        """Blocks the runs cover (token slices when the block sizes differ, see
        `reblock.slice_region`); `len(blocks)` when they are the same."""
        return sum(run.count for run in self.runs)

    @property
    def num_descriptors(self) -> int:
        """How many descriptors `descriptors()` yields: one per run, or one per block
        for a region pair that is strided on either side."""
        coalesced = sum(1 for pair in self.regions if pair.coalescable)
        return coalesced * len(self.runs) + (len(self.regions) - coalesced) * self.units

    def descriptors(self) -> Iterator[Descriptor]:
        """Region-major: one descriptor per (region, run), or per block where strided."""
        for pair in self.regions:
            size = pair.src.block_bytes
            for run in self.runs:
                pieces = [run] if pair.coalescable else _split_run(run)
                for piece in pieces:
                    yield Descriptor(
                        src_buffer=pair.src.buffer,
                        src_offset=pair.src.offset_bytes + piece.src_block * pair.src.stride_bytes,
                        dst_buffer=pair.dst.buffer,
                        dst_offset=pair.dst.offset_bytes + piece.dst_block * pair.dst.stride_bytes,
                        length=piece.count * size,
                    )


def _split_run(run: Run) -> list[Run]:
    return [Run(run.src_block + i, run.dst_block + i, 1) for i in range(run.count)]


@dataclass(frozen=True)
class TransferPlan:
    num_tokens: int
    computed_tokens: int
    groups: tuple[GroupPlan, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def moved_from(self) -> dict[int, int]:
        """First moved token of each group sliced by tokens (for `valid_tokens`)."""
        return {g.group.group_id: g.tokens.start for g in self.groups if g.tokens}


def plan_transfer(
    src: EngineLayout,
    dst: EngineLayout,
    src_spans: Sequence[BlockSpan],
    dst_spans: Sequence[BlockSpan],
    num_tokens: int,
    computed_tokens: int,
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
) -> TransferPlan:
    """Plan one request from the source (prefill) to the destination (decode).

    Logical blocks, chunks and failures are the destination's (the reader's); the
    source spans are in the source's own blocks, which may be sized differently."""
    if chunk_blocks < 1:
        raise PlanError("chunk_blocks", f"must be at least 1, got {chunk_blocks}")
    pairs = _layout_pairs(src, dst)
    groups = plan_between(src, dst, num_tokens, computed_tokens)
    src_by_group = _spans_by_group(src_spans, "src_spans", len(src.groups))
    dst_by_group = _spans_by_group(dst_spans, "dst_spans", len(dst.groups))
    chunks: list[Chunk] = []
    for group_plan in groups:
        if group_plan.blocks:
            chunks += _group_chunks(
                src, dst, group_plan, pairs[group_plan.group.group_id],
                src_by_group, dst_by_group, chunk_blocks,
            )  # fmt: skip
    return TransferPlan(num_tokens, computed_tokens, groups, tuple(chunks))


# Per pair of layouts (by identity, `IdentityMemo`): both checked to have the same
# shape, and every group's region pairs. Each group's pairs are also known by their
# own identity, for binding (`kept_pairs`); both memos start over together.
_PAIRS: IdentityMemo[tuple[tuple[RegionPair, ...], ...]] = IdentityMemo(256)
_KEPT: IdentityMemo[bool] = IdentityMemo(None)  # bounded by _PAIRS: cleared with it


def _layout_pairs(src: EngineLayout, dst: EngineLayout) -> tuple[tuple[RegionPair, ...], ...]:
    """Every group's region pairs, by group id, once `_check_same_shape` passed (a pair
    that fails is checked, and fails, every time)."""
    known = _PAIRS.get(src, dst)
    if known is not None:
        return known
    _check_same_shape(src, dst)
    pairs = tuple(_region_pairs(src, dst, group) for group in dst.groups)
    if _PAIRS.full:
        _KEPT.clear()  # _PAIRS starts over with this put
    for group_pairs in pairs:
        _KEPT.put(True, group_pairs)
    return _PAIRS.put(pairs, src, dst)


def kept_pairs(pairs: tuple[RegionPair, ...]) -> bool:
    """Whether a chunk's `regions` are a group's pairs as kept for its layout pair, the
    same object in every plan between those layouts (region pairs cut by tokens or
    heads, or split by state, are built for each plan)."""
    return _KEPT.get(pairs) is not None


def plan_between(
    src: EngineLayout, dst: EngineLayout, num_tokens: int, computed_tokens: int
) -> tuple[GroupPlan, ...]:
    """`plan_blocks` of the destination, with the moved token range of every group whose
    block size differs between the sides (C is the destination's, so it is checked
    against the destination's block sizes)."""
    plans = plan_blocks(dst, num_tokens, computed_tokens)
    out = []
    for plan, src_group in zip(plans, src.groups, strict=True):
        group = plan.group
        mapping = mapping_of(dst, group, src, src_group)
        if _state_split(src, dst, group):
            served = served_state(src, dst, group)
            moved = sum(p.length for pieces in served.values() for p in pieces)
            blocks = plan.blocks if moved else range(0)
            out.append(GroupPlan(group, blocks, None, len(blocks) * moved))
            continue
        if (
            group.kind is GroupKind.MLA
            and src.tp_size != dst.tp_size
            and src.tp_rank != mla_server(src.tp_size, dst)
        ):
            out.append(GroupPlan(group, range(0)))  # the latent comes from one rank
            continue
        if mapping is BlockMapping.HEADS and not served_slices(src, dst, group):
            out.append(GroupPlan(group, range(0)))  # another source rank serves it
            continue
        cut = head_cut(src, src_group, dst, group) if mapping is BlockMapping.HEADS else None
        if cut is HeadCut.BLOCK:  # whole blocks, equal sizes
            per_block = _served_bytes(src, dst, group, per_block=True)
            out.append(GroupPlan(group, plan.blocks, None, len(plan.blocks) * per_block))
            continue
        if mapping not in (BlockMapping.TOKENS, BlockMapping.HEADS):
            out.append(plan)
            continue
        needed = group_blocks(group, num_tokens, computed_tokens, 1)
        tokens = moved_tokens(
            needed, num_tokens, src.block_size_of(src_group), dst.block_size_of(group)
        )
        per_token = group.bytes_per_block // dst.block_size_of(group)
        if mapping is BlockMapping.HEADS:  # this source's heads of each token
            per_token = _served_bytes(src, dst, group, per_block=False)
        out.append(GroupPlan(group, plan.blocks, tokens, len(tokens) * per_token))
    return tuple(out)


def _group_chunks(
    src: EngineLayout,
    dst: EngineLayout,
    plan: GroupPlan,
    pairs: tuple[RegionPair, ...],
    src_by_group: Mapping[int, BlockSpan],
    dst_by_group: Mapping[int, BlockSpan],
    chunk_blocks: int,
) -> list[Chunk]:
    gid = plan.group.group_id
    src_size, dst_size = src.block_size_of(src.group(gid)), dst.block_size_of(plan.group)
    tokens = plan.tokens
    src_blocks = plan.blocks
    if tokens is not None:
        src_blocks = range(tokens.start // src_size, -(-tokens.stop // src_size))
    src_span = _covering_span(src_by_group, gid, src_blocks, "src_spans")
    dst_span = _covering_span(dst_by_group, gid, plan.blocks, "dst_spans")
    _check_ids(src_span, src_blocks, [p.src for p in pairs], "src_spans")
    _check_ids(dst_span, plan.blocks, [p.dst for p in pairs], "dst_spans")
    chunks = []
    unit = slice_tokens(src_size, dst_size)
    spacing: tuple[int | None, int | None] = (None, None)  # slice ids per block, each side
    if _state_split(src, dst, plan.group):
        pairs = _state_pairs(pairs, served_state(src, dst, plan.group), plan.group)
    elif mapping_of(dst, plan.group, src, src.group(gid)) is BlockMapping.HEADS:
        cut = head_cut(src, src.group(gid), dst, plan.group)
        if cut is HeadCut.BLOCK:  # a run of heads is one byte range of each block
            pairs = _head_pairs(src, dst, plan.group)
        elif cut is HeadCut.TOKEN:  # ... of each token
            unit, pairs = 1, _head_pairs(src, dst, plan.group)
        else:  # one head at a time, `unit` of its tokens a byte range on both sides
            unit = row_tokens(src, src.group(gid), dst, plan.group)
            pairs = _row_pairs(src, dst, plan.group, unit)
            spacing = (
                _row_spacing(src, src.group(gid), unit),
                _row_spacing(dst, plan.group, unit),
            )
    elif tokens is not None:
        pairs = tuple(
            RegionPair(slice_region(p.src, src_size, unit), slice_region(p.dst, dst_size, unit))
            for p in pairs
        )
    for start in range(plan.blocks.start, plan.blocks.stop, chunk_blocks):
        blocks = range(start, min(start + chunk_blocks, plan.blocks.stop))
        if tokens is None:
            runs = _runs(src_span, dst_span, blocks)
        else:
            lo, hi = (
                max(tokens.start, blocks.start * dst_size),
                min(tokens.stop, blocks.stop * dst_size),
            )
            slices = range(lo // unit, hi // unit)
            runs = _runs(
                slice_span(src_span, src_size, unit, slices, spacing[0]),
                slice_span(dst_span, dst_size, unit, slices, spacing[1]),
                slices,
            )
        chunks.append(Chunk(GroupId(gid), blocks, runs, pairs))
    return chunks


def _served_bytes(src: EngineLayout, dst: EngineLayout, group: KVGroup, *, per_block: bool) -> int:
    """Bytes of `group` the source rank serves the destination rank per block (heads
    cut from whole head-major blocks) or per token."""
    heads = sum(len(piece.dst_heads) for piece in served_slices(src, dst, group))
    unit = dst.head_block_bytes if per_block else dst.head_bytes
    return sum(heads * (unit(group, t) or 0) for t in group.tensors)


def _head_pairs(src: EngineLayout, dst: EngineLayout, group: KVGroup) -> tuple[RegionPair, ...]:
    """Different TP sizes: every tensor's regions narrowed on each side to the run of
    heads this source serves the destination (tp_map): inside every token, seen one
    token per block, when blocks are token-major; inside every block when head-major."""
    src_group = src.group(group.group_id)
    src_size, dst_size = src.block_size_of(src_group), dst.block_size_of(group)
    out = []
    for pair, tensor in zip(_region_pairs(src, dst, group), group.tensors, strict=True):
        head = head_unit_bytes(dst, group, tensor)
        assert head is not None  # check_head_split said so
        for piece in served_slices(src, dst, group):
            src_at, dst_at, length = piece.byte_range(head)
            if dst.head_major:
                narrowed = RegionPair(
                    _narrow(pair.src, src_at, length),
                    _narrow(pair.dst, dst_at, length),
                )
            else:
                narrowed = RegionPair(
                    head_region(pair.src, src_size, src_at, length),
                    head_region(pair.dst, dst_size, dst_at, length),
                )
            out.append(narrowed)
    return tuple(out)


def _row_pairs(
    src: EngineLayout, dst: EngineLayout, group: KVGroup, unit: int
) -> tuple[RegionPair, ...]:
    """Blocks cut one head at a time (`HeadCut.ROWS`): for every tensor and every head
    this source serves the destination, each side's region seen as that head's slices
    of `unit` tokens: the head's rows of HND blocks (`row_region`), or the head's bytes
    of each token of token-major ones (`head_region`, one token per slice)."""
    src_group = src.group(group.group_id)
    out = []
    for pair, tensor in zip(_region_pairs(src, dst, group), group.tensors, strict=True):
        head = dst.head_bytes(group, tensor)
        assert head is not None  # check_head_split said so
        for piece in served_slices(src, dst, group):
            for s, d in zip(piece.src_heads, piece.dst_heads, strict=True):
                out.append(
                    RegionPair(
                        _row_view(src, src_group, pair.src, s, head, unit),
                        _row_view(dst, group, pair.dst, d, head, unit),
                    )
                )
    return tuple(out)


def _row_view(
    layout: EngineLayout, group: KVGroup, region: Region, head: int, head_bytes: int, unit: int
) -> Region:
    size = layout.block_size_of(group)
    if holds_rows(layout, group):
        return row_region(region, size, head, head_bytes, unit)
    return head_region(region, size, head * head_bytes, head_bytes)  # unit is one token


def _row_spacing(layout: EngineLayout, group: KVGroup, unit: int) -> int | None:
    """Slice ids between one block's first slice of a head and the next block's, where
    blocks hold each head's rows (`_row_view`); None: the slices a block holds."""
    if not holds_rows(layout, group):
        return None
    return layout.rank_heads(group) * layout.block_size_of(group) // unit


def _state_split(src: EngineLayout, dst: EngineLayout, group: KVGroup) -> bool:
    """A state group between different TP sizes: cut into byte ranges (tp_map)."""
    return group.kind is GroupKind.MAMBA and src.tp_size != dst.tp_size


def _state_pairs(
    pairs: Sequence[RegionPair], served: Mapping[str, Sequence[StatePiece]], group: KVGroup
) -> tuple[RegionPair, ...]:
    """Every state tensor's regions narrowed to each byte range this source serves."""
    out = []
    for pair, tensor in zip(pairs, group.tensors, strict=True):
        for piece in served.get(tensor.name, ()):
            out.append(
                RegionPair(
                    _narrow(pair.src, piece.src_at, piece.length),
                    _narrow(pair.dst, piece.dst_at, piece.length),
                )
            )
    return tuple(out)


def _narrow(region: Region, offset: int, length: int) -> Region:
    """`region` with each block narrowed to `length` bytes at `offset` inside it."""
    return Region(
        name=region.name,
        buffer=region.buffer,
        offset_bytes=region.offset_bytes + offset,
        num_blocks=region.num_blocks,
        stride_bytes=region.stride_bytes,
        block_bytes=length,
    )


def _check_same_shape(src: EngineLayout, dst: EngineLayout) -> None:
    """The planner's own precondition; negotiation explains mismatches in detail."""
    if len(src.groups) != len(dst.groups):
        raise PlanError("groups", f"src has {len(src.groups)} groups, dst has {len(dst.groups)}")
    for a, b in zip(src.groups, dst.groups, strict=True):
        where = f"groups[{a.group_id}]"
        if (a.kind, a.sliding_window, a.chunk_size) != (b.kind, b.sliding_window, b.chunk_size):
            raise PlanError(
                where,
                f"src is {a.kind.value} (window {a.sliding_window}, chunk {a.chunk_size}), "
                f"dst is {b.kind.value} (window {b.sliding_window}, chunk {b.chunk_size})",
            )
        mapping = mapping_of(dst, b, src, a)
        if _state_split(src, dst, b):
            check_state_split(src, a, dst, b, where)
        elif mapping is BlockMapping.HEADS:
            check_head_split(src, a, dst, b, where)
        elif mapping is BlockMapping.TOKENS:
            check_sliceable(src, a, dst, b, where)
        elif [(t.name, t.bytes_per_block) for t in a.tensors] != [
            (t.name, t.bytes_per_block) for t in b.tensors
        ]:
            raise PlanError(f"{where}.tensors", "tensor names or sizes differ between src and dst")
    if not src.regions or not dst.regions:
        raise PlanError("regions", "both layouts must have registered regions to plan a transfer")
    check_serves(src, dst)  # equal TP sizes: rank r reads rank r


def _spans_by_group(spans: Sequence[BlockSpan], name: str, num_groups: int) -> dict[int, BlockSpan]:
    by_group: dict[int, BlockSpan] = {}
    for i, span in enumerate(spans):
        if not 0 <= span.group_id < num_groups:
            raise PlanError(f"{name}[{i}].group_id", f"unknown group {span.group_id}")
        if span.group_id in by_group:
            raise PlanError(f"{name}[{i}].group_id", f"group {span.group_id} appears twice")
        by_group[span.group_id] = span
    return by_group


def _covering_span(
    spans: Mapping[int, BlockSpan], group_id: int, blocks: range, name: str
) -> BlockSpan:
    span = spans.get(group_id)
    where = f"{name}[group {group_id}]"
    if span is None:
        raise PlanError(where, f"missing; logical blocks {_fmt(blocks)} must move")
    if span.first_block > blocks.start or span.end_block < blocks.stop:
        covered = _fmt(range(span.first_block, span.end_block))
        raise PlanError(where, f"covers logical blocks {covered}, needs {_fmt(blocks)}")
    return span


def _fmt(blocks: range) -> str:
    return f"{blocks.start}..{blocks.stop - 1}" if blocks else "none"


def _region_pairs(src: EngineLayout, dst: EngineLayout, group: KVGroup) -> tuple[RegionPair, ...]:
    src_regions, dst_regions = src.region_map, dst.region_map
    return tuple(RegionPair(src_regions[t.name], dst_regions[t.name]) for t in group.tensors)


def _check_ids(span: BlockSpan, blocks: range, regions: Sequence[Region], name: str) -> None:
    """Every id the plan touches must exist in every region of the group."""
    ids = span.block_ids[blocks.start - span.first_block : blocks.stop - span.first_block]
    highest = max(ids)
    for region in regions:
        if highest >= region.num_blocks:
            logical = blocks.start + ids.index(highest)
            raise PlanError(
                f"{name}[group {span.group_id}].block_ids",
                f"block {highest} (logical block {logical}) out of range for region "
                f"'{region.name}' ({region.num_blocks} blocks)",
            )


def _runs(src: BlockSpan, dst: BlockSpan, blocks: range) -> tuple[Run, ...]:
    """Maximal runs of logical blocks whose ids are consecutive on both sides."""
    runs: list[Run] = []
    src_ids = src.block_ids[blocks.start - src.first_block : blocks.stop - src.first_block]
    dst_ids = dst.block_ids[blocks.start - dst.first_block : blocks.stop - dst.first_block]
    start_s, start_d, count = src_ids[0], dst_ids[0], 1
    for s, d in zip(src_ids[1:], dst_ids[1:], strict=True):
        if s == start_s + count and d == start_d + count:
            count += 1
            continue
        runs.append(Run(start_s, start_d, count))
        start_s, start_d, count = s, d, 1
    runs.append(Run(start_s, start_d, count))
    return tuple(runs)


def check_span_ids(layout: EngineLayout, span: BlockSpan, name: str) -> None:
    """Validate every id of a span against its group's regions (used at publish time)."""
    try:
        group = layout.group(span.group_id)
    except LayoutError as exc:
        raise PlanError(f"{name}.group_id", exc.detail) from exc
    if not span.block_ids:
        return
    regions = layout.region_map
    _check_ids(
        span,
        range(span.first_block, span.end_block),
        [regions[t.name] for t in group.tensors],
        name,
    )
