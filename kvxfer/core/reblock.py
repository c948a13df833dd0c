"""Different block sizes on the two sides: how a group's blocks map (docs/planning.md,
Different block sizes).

Logical block i of a side with block size B holds tokens [i*B, (i+1)*B). Between a
source of size Bs and a destination of size Bd the planner works in *slices* of
u = gcd(Bs, Bd) tokens: a source block is Bs/u slices, a destination block Bd/u, and
slice k is tokens [k*u, (k+1)*u) on both sides. A contiguous, token-major region of
n blocks of `block_bytes` is then the same memory seen as n*B/u blocks of
`block_bytes*u/B` bytes, so the planner's ordinary run coalescing applies unchanged:
slices consecutive on both sides become one descriptor, whole blocks where both
sides' boundaries line up, byte ranges inside a block where they do not.

A state (mamba) group holds one state per request whatever its block size: it maps
whole, and its bytes must be equal on both sides.
"""

from __future__ import annotations

import enum
import math

from kvxfer._exceptions import PlanError
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupKind, KVGroup, Region


class BlockMapping(enum.StrEnum):
    SAME = "same"  # equal block sizes: block i <- block i, whole
    TOKENS = "tokens"  # different sizes: token ranges, byte ranges inside blocks
    STATE = "state"  # a state group: its one block moves whole
    # Different TP sizes, or blocks ordered differently (token-major against HND, HND of
    # different sizes): this rank's heads, byte ranges inside tokens or blocks
    # (kvxfer/core/tp_map.py, HeadCut); block sizes may differ as well.
    HEADS = "heads"


# Attention kinds whose KV heads are split over TP ranks (an mla latent is replicated).
HEAD_SPLIT_KINDS = frozenset(
    {GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL}
)


def mapping_of(
    local: EngineLayout, group: KVGroup, peer: EngineLayout, other: KVGroup
) -> BlockMapping:
    """How `group` (local) maps to `other` (peer's group of the same id)."""
    if group.kind is GroupKind.MAMBA:
        return BlockMapping.STATE
    if group.kind in HEAD_SPLIT_KINDS and (
        local.tp_size != peer.tp_size or _orders_differ(local, group, peer, other)
    ):
        return BlockMapping.HEADS
    if local.block_size_of(group) == peer.block_size_of(other):
        return BlockMapping.SAME
    return BlockMapping.TOKENS


def _orders_differ(local: EngineLayout, group: KVGroup, peer: EngineLayout, other: KVGroup) -> bool:
    """The two sides order a block's tokens and heads differently (token-major, HND,
    head-major in an engine's own order), or are head-major of different block sizes:
    a whole block, or a token range, of one is then no byte range of the other."""
    if (local.token_major, local.head_major, local.token_rows) != (
        peer.token_major,
        peer.head_major,
        peer.token_rows,
    ):
        return True
    return local.head_major and local.block_size_of(group) != peer.block_size_of(other)


def slicing_problem(layout: EngineLayout, group: KVGroup) -> str | None:
    """Why `group`'s blocks in `layout` cannot be cut into token ranges, or None."""
    size = layout.block_size_of(group)
    # An mla latent is one head: in HND blocks its rows are the block's tokens.
    if not (layout.token_major or (layout.token_rows and group.kind is GroupKind.MLA)):
        return (
            "this layout's pages are not token-major (as vLLM's, whose attention kernel "
            "orders each head's K and V its own way), so a token range is not a byte "
            "range kvxfer can name; run the same block size on both sides"
        )
    for tensor in group.tensors:
        if tensor.bytes_per_block % size:
            return (
                f"tensor '{tensor.name}': {tensor.bytes_per_block} bytes/block is not a "
                f"multiple of the block size {size}"
            )
    return strided_problem(layout, group, "token slices")


def strided_problem(layout: EngineLayout, group: KVGroup, what: str) -> str | None:
    """Why `group`'s regions cannot be seen as one array of `what`: the first strided
    one (blocks with gaps between them), or None."""
    regions = layout.region_map
    for tensor in group.tensors:
        region = regions.get(tensor.name)
        if region is not None and not region.contiguous:
            return (
                f"region '{region.name}' is strided ({region.stride_bytes} bytes between "
                f"blocks of {region.block_bytes}): its {what} are not one array"
            )
    return None


def check_sliceable(
    src: EngineLayout, a: KVGroup, dst: EngineLayout, b: KVGroup, where: str
) -> None:
    """Different block sizes: both sides sliceable by tokens, equal bytes per token."""
    for side, layout, group in (("src", src, a), ("dst", dst, b)):
        problem = slicing_problem(layout, group)
        if problem is not None:
            raise PlanError(f"{where}.block_size", f"{side}: {problem}")
    size_a, size_b = src.block_size_of(a), dst.block_size_of(b)
    if [(t.name, t.bytes_per_block // size_a) for t in a.tensors] != [
        (t.name, t.bytes_per_block // size_b) for t in b.tensors
    ]:
        raise PlanError(
            f"{where}.tensors", "tensor names or bytes per token differ between src and dst"
        )


def moved_tokens(needed: range, num_tokens: int, src_block: int, dst_block: int) -> range:
    """The tokens that move given the `needed` ones: a token moves when both its source
    block and its destination block hold a needed token. With equal sizes that is the
    needed blocks, whole; otherwise it starts at the later of the two blocks holding
    the first needed token and ends at the earlier of the two blocks holding token N-1.
    """
    if not needed:
        return range(0)
    first = needed.start
    start = max(first // src_block * src_block, first // dst_block * dst_block)
    stop = min(-(-num_tokens // src_block) * src_block, -(-num_tokens // dst_block) * dst_block)
    return range(start, stop)


def slice_tokens(src_block: int, dst_block: int) -> int:
    """Tokens per slice: the largest size both sides' block boundaries fall on."""
    return math.gcd(src_block, dst_block)


def slice_region(region: Region, block_size: int, unit: int) -> Region:
    """`region` seen as blocks of `unit` tokens (contiguous and token-major regions
    only: `slicing_problem` said so before the planner got here)."""
    per_block = block_size // unit
    return Region(
        name=region.name,
        buffer=region.buffer,
        offset_bytes=region.offset_bytes,
        num_blocks=region.num_blocks * per_block,
        stride_bytes=region.block_bytes // per_block,
        block_bytes=region.block_bytes // per_block,
    )


def head_region(region: Region, block_size: int, offset: int, length: int) -> Region:
    """`region` seen as one block per token, each narrowed to `length` bytes at `offset`
    inside the token: a run of heads (contiguous, token-major regions only)."""
    token = region.block_bytes // block_size
    return Region(
        name=region.name,
        buffer=region.buffer,
        offset_bytes=region.offset_bytes + offset,
        num_blocks=region.num_blocks * block_size,
        stride_bytes=token,
        block_bytes=length,
    )


def slice_span(
    span: BlockSpan, block_size: int, unit: int, slices: range, spacing: int | None = None
) -> BlockSpan:
    """The slice ids of `slices` (slice k: tokens [k*unit, (k+1)*unit)) in `span`'s blocks.
    Block i's slices are ids [i*spacing, i*spacing + block_size/unit): `spacing` is the
    slices a block holds (the default), or more where a block holds other heads' rows
    between (`planner._row_pairs`)."""
    per_block = block_size // unit
    step = per_block if spacing is None else spacing
    ids = tuple(BlockId(span.block_id(k // per_block) * step + k % per_block) for k in slices)
    return BlockSpan(span.group_id, slices.start, ids)


def row_region(region: Region, block_size: int, head: int, head_bytes: int, unit: int) -> Region:
    """`region`'s rows of head `head` (the rank's own numbering) seen as slices of `unit`
    tokens, the whole region as one array of them (contiguous regions whose blocks hold
    each head's tokens as rows: HND): block i's slices of the head are ids
    [i*spacing, i*spacing + block_size/unit) with spacing block_bytes/slice bytes."""
    size = unit * head_bytes
    offset = head * block_size * head_bytes
    return Region(
        name=region.name,
        buffer=region.buffer,
        offset_bytes=region.offset_bytes + offset,
        num_blocks=(region.num_blocks * region.block_bytes - offset) // size,
        stride_bytes=size,
        block_bytes=size,
    )
