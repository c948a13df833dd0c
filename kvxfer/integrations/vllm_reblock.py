"""A decode vLLM whose blocks are larger than its prefill's (docs/vllm.md, "Different
block sizes").

A vLLM-CPU page cannot be cut by tokens: the attention kernel orders each head's keys
and values its own way (the vec kernels store K transposed), so a token range of a
page is no byte range. A whole page is, and a decode page of block size Bd = r * Bp is
exactly as many bytes as r prefill pages of block size Bp. So the decode worker
registers its attention pages with the sidecar *as* r sub-pages of Bp tokens each (the
layout a Bp engine would register, `layout_from_vllm(reblock=r)`), the sidecar moves
whole prefill pages into them (any TP pairing, the exact planner unchanged), and once
every pull of a request ended the worker lays each received page out again (`repack`):
the prefill kernel's order at Bp says where every token's key and value arrived, the
decode kernel's order at Bd where that kernel reads them, both learnt from vLLM's own
kernels (`vllm_kernel.kernel_positions`) when the decode starts, and composed into one
gather of runs (`page_rows`). Sub-pages the planner did not move (before a sliding
window) become zeros, never stale bytes.

The prefill's kernel at Bp and the decode's own probe of it must be the same kernel:
the sub-pages' order goes into the layout's fingerprint (`vllm_kernel.page_order` at
Bp), so a pair whose kernels differ is refused by negotiation, as for equal sizes.

State (Mamba) groups are not touched: a state page holds one request's state whatever
the block size, and moves whole as for equal sizes. Only larger decode blocks (a
multiple of the prefill's), and only on a decode (`kv_consumer`: a page laid out again
after arrival is no page to publish); anything else is refused by name when the
connector starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvxfer._exceptions import InvalidInputError
from kvxfer.core.layout import BlockId, BlockSpan, GroupKind
from kvxfer.core.planner import needed_blocks
from kvxfer.integrations.vllm_kernel import KernelWrite, kernel_positions
from kvxfer.integrations.vllm_layout import NULL_BLOCK, group_shape

FIELD = "kv_connector_extra_config.prefill_block_size"
_BATCH_BYTES = 2 << 20  # pages gathered at once per layer: about what a core's L2 holds


def reblock_ratio(extra: Mapping[str, Any], kv_role: str | None, kv_cache_config: Any) -> int:
    """How many prefill pages one decode page holds (1: the same block size), from
    `prefill_block_size` in the connector's extra config; refused, naming the field,
    where a prefill page cannot be read whole into a decode page."""
    value = extra.get("prefill_block_size")
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(FIELD, f"must be a positive integer, got {value!r}")
    shapes = [
        group_shape(g.kv_cache_spec, f"kv_cache_groups[{i}].kv_cache_spec")
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]
    sizes = {s.block_size for s in shapes if s.kind is not GroupKind.MAMBA}
    if len(sizes) != 1:
        raise InvalidInputError(FIELD, f"needs one attention block size, the engine has {sizes}")
    own = sizes.pop()
    if value == own:
        return 1
    if kv_role != "kv_consumer":
        raise InvalidInputError(
            FIELD, f"only a decode (kv_consumer) reads another block size, not {kv_role}"
        )
    if own % value:
        raise InvalidInputError(
            FIELD,
            f"{value} does not divide this engine's block size {own}: a prefill page must fit "
            "whole in a decode page (give the decode a multiple of the prefill's block size)",
        )
    return own // value


def block_size_hint(exc: Exception, ratio: int) -> str:
    """What to add to a pull refused for block sizes: the setting that reads them."""
    if ".block_size" not in str(exc) or ratio > 1:
        return ""
    return (
        f" (a decode whose block size is a multiple of the prefill's reads its pages with "
        f"{FIELD} set to the prefill's block size)"
    )


def sub_spans(
    spans: Sequence[BlockSpan], kinds: Sequence[GroupKind], ratio: int
) -> tuple[BlockSpan, ...]:
    """The engine's spans in the sub-pages it registered: block b is sub-pages b * ratio
    .. b * ratio + ratio - 1, logical block i logical sub-pages from i * ratio."""
    if ratio == 1:
        return tuple(spans)
    out = []
    for span in spans:
        if kinds[span.group_id] is GroupKind.MAMBA:
            out.append(span)
            continue
        ids = tuple(BlockId(b * ratio + k) for b in span.block_ids for k in range(ratio))
        out.append(BlockSpan(span.group_id, span.first_block * ratio, ids))
    return tuple(out)


def page_rows(
    theirs: torch.Tensor, own: torch.Tensor, *, heads: int, sub: int, ratio: int, size: int
) -> tuple[torch.Tensor, int]:
    """How a decode page is gathered from the `ratio` prefill pages received into it, in
    runs: `(rows, run)` such that, viewing both pages as rows of `run` elements, row j of
    the laid-out page is row `rows[j]` of the received one. `theirs` and `own` are
    `vllm_kernel.kernel_positions` of the prefill's kernel at `sub` tokens and of the
    decode's at `sub * ratio`; `run` is the longest power of two in which both kernels
    keep elements together (32 on the vec kernels: K transposed moves a prefill block's
    tokens of one dimension at once), so the re-layout is one row gather, not one per
    element."""
    block = sub * ratio
    n_sub, n_own = sub * size, block * size
    if theirs.numel() != 2 * n_sub or own.numel() != 2 * n_own:
        raise InvalidInputError("kernel", "kernel positions of another block or head size")
    # Canonical (K or V, token, dim) at the decode's size, and where it sits in each page.
    half = torch.arange(2).view(2, 1, 1)
    token = torch.arange(block).view(1, block, 1)
    dim = torch.arange(size).view(1, 1, size)
    canonical_own = (half * n_own + token * size + dim).reshape(-1)
    canonical_sub = (half * n_sub + (token % sub) * size + dim).reshape(-1)
    page = (token // sub).expand(2, block, size).reshape(-1)  # which received page
    slice_sub, slice_own = 2 * n_sub, 2 * n_own  # one head's elements in each page
    head = torch.arange(heads).view(heads, 1)
    source = torch.empty(heads * slice_own, dtype=torch.int64)
    target = head * slice_own + own[canonical_own].view(1, -1)
    source[target.reshape(-1)] = (
        page.view(1, -1) * heads * slice_sub + head * slice_sub + theirs[canonical_sub].view(1, -1)
    ).reshape(-1)
    run = 1 << 12
    while run > 1:
        if (heads * slice_sub) % run == 0:  # a run never spans two received pages
            runs = source.view(-1, run)
            starts = runs[:, 0]
            if bool((starts % run == 0).all()) and torch.equal(
                runs - starts.view(-1, 1), torch.arange(run).expand_as(runs)
            ):
                break
        run //= 2
    return source.view(-1, run)[:, 0] // run, run


def kernel_rows(
    theirs: KernelWrite,
    own: KernelWrite,
    *,
    heads: int,
    sub: int,
    ratio: int,
    size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, int]:
    """`page_rows` from the kernels themselves: the prefill's write at `sub` tokens and the
    decode's at `sub * ratio` (each probed by `vllm_kernel.kernel_positions`)."""
    at = [
        kernel_positions(write, heads=heads, block_size=block, head_size=size, dtype=dtype)
        for write, block in ((theirs, sub), (own, sub * ratio))
    ]
    return page_rows(at[0], at[1], heads=heads, sub=sub, ratio=ratio, size=size)


@dataclass(frozen=True)
class GroupRepack:
    """One attention group's re-layout: its layers' page tensors and how each decode page
    is gathered from the prefill pages received into it (`page_rows`)."""

    kind: GroupKind
    window: int | None
    chunk: int | None
    caches: tuple[torch.Tensor, ...]  # [num_blocks, heads, Bd, 2 * head_size] each, dense
    rows: torch.Tensor
    run: int


def received_blocks(
    group: GroupRepack,
    block_ids: Sequence[int],
    ratio: int,
    num_tokens: int,
    computed_tokens: int,
    valid_tokens: int,
) -> tuple[list[int], torch.Tensor]:
    """The decode blocks of one group holding received sub-pages, and which of their
    sub-pages were moved (a bool [blocks, ratio]): blocks wholly computed here are left
    alone, and a block at or after `valid_tokens` (recomputed by vLLM) too."""
    block = group.caches[0].shape[2] if group.caches else 0
    sub = block // ratio
    if computed_tokens % max(block, 1):
        raise InvalidInputError("computed_tokens", f"{computed_tokens} is not a whole block")
    moved = needed_blocks(
        group.kind, group.window, num_tokens, computed_tokens, sub, chunk_size=group.chunk
    )
    end = -(-num_tokens // block) if valid_tokens >= num_tokens else valid_tokens // block
    blocks: list[int] = []
    masks: list[list[bool]] = []
    for i in range(computed_tokens // block, min(end, len(block_ids))):
        mask = [i * ratio + k in moved for k in range(ratio)]
        if block_ids[i] != NULL_BLOCK and any(mask):
            blocks.append(int(block_ids[i]))
            masks.append(mask)
    return blocks, torch.tensor(masks, dtype=torch.bool).view(len(blocks), ratio)


def repack(group: GroupRepack, blocks: Sequence[int], moved: torch.Tensor) -> None:
    """Lay out again, in every layer of `group`, decode pages `blocks` that hold `ratio`
    prefill pages each (`moved[i, k]`: sub-page k of block i was received; rows gathered
    from the others become zeros): a row gather per layer, as `page_rows` says, and the
    pages written back in place, a few blocks at a time so that what is gathered stays
    in the CPU's cache until it is written back."""
    if not blocks:
        return
    ids = torch.tensor(list(blocks), dtype=torch.long)
    per_page, ratio = group.rows.numel(), moved.shape[1]
    # A row comes from sub-page rows // (per_page / ratio) of its block.
    lost = ~moved.gather(1, (group.rows // (per_page // ratio)).expand(len(blocks), -1))
    page_bytes = group.caches[0][0].numel() * group.caches[0].element_size() if group.caches else 1
    step = max(1, _BATCH_BYTES // page_bytes)
    for first in range(0, len(blocks), step):
        some, gone = ids[first : first + step], lost[first : first + step]
        index = (some.view(-1, 1) * per_page + group.rows.view(1, -1)).reshape(-1)
        for cache in group.caches:
            pages = cache.view(-1, group.run).index_select(0, index).view(len(some), per_page, -1)
            if bool(gone.any()):
                pages.masked_fill_(gone.unsqueeze(2), 0)
            cache.index_copy_(0, some, pages.view(len(some), *cache.shape[1:]))
