"""A decode vLLM whose block size is not its prefill's (docs/vllm.md, "Different block
sizes").

A vLLM-CPU page cannot be cut by tokens: the attention kernel orders each head's keys
and values its own way (the vec kernels store K transposed), so a token range of a
page is no byte range. A whole page is, and a decode page of block size Bd = r * Bp is
exactly as many bytes as r prefill pages of block size Bp. So the decode worker
registers its attention pages with the sidecar *as* r sub-pages of Bp tokens each (the
layout a Bp engine would register, `layout_from_vllm(reblock=r)`), the sidecar moves
whole prefill pages into them (any TP pairing, the exact planner unchanged), and once
every pull of a request ended the worker lays each received page out again
(`repack_steps`):
the prefill kernel's order at Bp says where every token's key and value arrived, the
decode kernel's order at Bd where that kernel reads them, both learnt from vLLM's own
kernels (`vllm_kernel.kernel_positions`) when the decode starts, and composed into one
gather of runs (`unit_rows`). Sub-pages the planner did not move (before a sliding
window) become zeros, never stale bytes.

The prefill's kernel at Bp and the decode's own probe of it must be the same kernel:
the sub-pages' order goes into the layout's fingerprint (`vllm_kernel.page_order` at
Bp), so a pair whose kernels differ is refused by negotiation, as for equal sizes.

A decode with smaller blocks (Bp = r * Bd), or with a block size neither dividing nor
divided by the prefill's (64 and 96), cannot take a prefill page into one of its own; it
stages it (see "staging pages" below) and lays out lcm(Bp, Bd) tokens at a time. State
(Mamba) groups are not touched either way: a state page holds one request's state
whatever the block size, and moves whole as for equal sizes. Only on a decode
(`kv_consumer`: a page laid out again after arrival is no page to publish); anything
else is refused by name when the connector starts.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvxfer._exceptions import InvalidInputError
from kvxfer.core.layout import BlockId, BlockSpan, GroupKind
from kvxfer.core.planner import needed_blocks
from kvxfer.integrations.vllm_kernel import KernelWrite, kernel_positions
from kvxfer.integrations.vllm_layout import group_shape
from kvxfer.integrations.vllm_params import NULL_BLOCK

FIELD = "kv_connector_extra_config.prefill_block_size"
_WINDOWED = (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
_BATCH_BYTES = 2 << 20  # pages gathered at once per layer: about what a core's L2 holds


@dataclass(frozen=True)
class BlockRatio:
    """A decode's attention block size against its prefill's (`reblock_ratio`)."""

    own: int  # this engine's attention block size (0: it has no attention group)
    source: int  # the prefill's

    @property
    def grow(self) -> int:
        """Prefill pages per decode page where the decode's holds whole prefill pages
        (read as sub-pages, then laid out again in place); else 1."""
        return self.own // self.source if self.own > self.source and self.nests else 1

    @property
    def differs(self) -> bool:
        """The two engines' block sizes differ (`prefill_block_size` set to another)."""
        return self.source != self.own

    @property
    def nests(self) -> bool:
        """One block size divides the other."""
        return self.own % self.source == 0 or self.source % self.own == 0

    @property
    def staged(self) -> bool:
        """Prefill pages go to staging pages first: smaller decode blocks, or sizes that
        do not nest."""
        return self.differs and self.grow == 1

    @property
    def unit(self) -> tuple[int, int]:
        """Prefill pages and decode pages that hold the same tokens, lcm(source, own) of
        them: what a staged lay-out takes at a time."""
        lcm = math.lcm(self.source, self.own)
        return lcm // self.source, lcm // self.own


def reblock_ratio(
    extra: Mapping[str, Any], kv_role: str | None, kv_cache_config: Any, prefix_caching: bool
) -> BlockRatio:
    """The decode's block size against the prefill's, from `prefill_block_size` in the
    connector's extra config (absent: the same); refused, naming the field, where vLLM's
    prefix cache would keep a page that is not whole: with a sliding window (or chunked
    local attention) and decode blocks that do not each lie in one prefill block, the
    decode page where the window starts holds only the tokens of the prefill blocks
    that moved, zeros before them, and the prefix cache would hand it to a later
    request as a full block."""
    value = extra.get("prefill_block_size")
    if value is None:
        return BlockRatio(1, 1)
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
        return BlockRatio(own, own)
    if kv_role != "kv_consumer":
        raise InvalidInputError(
            FIELD, f"only a decode (kv_consumer) reads another block size, not {kv_role}"
        )
    windowed = {s.kind.value for s in shapes if s.kind in _WINDOWED}
    if windowed and prefix_caching and value % own:
        raise InvalidInputError(
            FIELD,
            f"with {', '.join(sorted(windowed))} layers, the decode page where a window "
            "starts arrives in part, and vLLM's prefix cache would keep it as whole: turn "
            "prefix caching off on this decode (--no-enable-prefix-caching) or run the "
            "prefill's block size",
        )
    return BlockRatio(own, value)


def resumable(kinds: Sequence[GroupKind], same_size: bool) -> bool:
    """Whether vLLM can resume a partly failed pull where its valid tokens end: one group
    (vLLM 0.32 takes block failures for one group only), and no window unless both
    engines have one block size. Otherwise the sidecar counts valid tokens in prefill
    blocks that the decode's blocks do not mirror: a resume may land at an earlier decode
    block's start, whose window reaches before what moved, or the window may reach
    tokens that moved into staging but had no decode block to land in (vLLM's null
    blocks before the window). The request is then recomputed whole."""
    return len(kinds) == 1 and (same_size or kinds[0] is GroupKind.FULL_ATTENTION)


def block_size_hint(exc: Exception, configured: bool) -> str:
    """What to add to a pull refused for block sizes: the setting that reads them (unless
    `configured` already)."""
    if ".block_size" not in str(exc) or configured:
        return ""
    return (
        f" (a decode of another block size than the prefill's reads its pages with "
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


def unit_rows(
    theirs: torch.Tensor,
    own: torch.Tensor,
    *,
    heads: int,
    source_block: int,
    target_block: int,
    size: int,
) -> tuple[torch.Tensor, int]:
    """How pages written at `target_block` tokens are gathered from pages written at
    `source_block`, a unit of lcm(source_block, target_block) tokens at a time: the
    unit's source pages side by side (as received) and its target pages side by side.
    Returns `(rows, run)` such that, seeing both as rows of `run` elements, target row j
    is source row `rows[j]`. `theirs` and `own` are `vllm_kernel.kernel_positions` of the
    kernels writing each; `run` is the longest power of two both keep together (32
    elements on the vec kernels, 512 on amx), so a re-layout is one row gather, not one
    per element."""
    unit = math.lcm(source_block, target_block)
    n_source, n_target = source_block * size, target_block * size
    if theirs.numel() != 2 * n_source or own.numel() != 2 * n_target:
        raise InvalidInputError("kernel", "kernel positions of another block or head size")
    half = torch.arange(2).view(2, 1, 1)
    token = torch.arange(unit).view(1, unit, 1)
    dim = torch.arange(size).view(1, 1, size)

    def place(positions: torch.Tensor, block: int) -> torch.Tensor:
        """Each (K/V, token, dim) of the unit's element in its side's pages, per head."""
        slice_ = 2 * block * size  # one head's elements in a page
        at = positions[(half * block * size + (token % block) * size + dim).reshape(-1)]
        page = (token // block).expand(2, unit, size).reshape(-1)
        head = torch.arange(heads).view(heads, 1)
        return (page.view(1, -1) * heads * slice_ + head * slice_ + at.view(1, -1)).reshape(-1)

    source = torch.empty(heads * 2 * unit * size, dtype=torch.int64)
    source[place(own, target_block)] = place(theirs, source_block)
    page_elements = heads * 2 * math.gcd(source_block, target_block) * size
    run = 1 << 12
    while run > 1:
        if page_elements % run == 0:  # a run never spans two pages of either side
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
    source_block: int,
    target_block: int,
    size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, int]:
    """`unit_rows` from the kernels themselves: the prefill's write at `source_block`
    tokens and the decode's at `target_block` (each probed by
    `vllm_kernel.kernel_positions`)."""
    at = [
        kernel_positions(write, heads=heads, block_size=block, head_size=size, dtype=dtype)
        for write, block in ((theirs, source_block), (own, target_block))
    ]
    return unit_rows(at[0], at[1], heads=heads, source_block=source_block,
                     target_block=target_block, size=size)  # fmt: skip


@dataclass(frozen=True)
class GroupRepack:
    """One attention group's re-layout: its layers' page tensors and how each decode page
    is gathered from the prefill pages received into it (`unit_rows`)."""

    kind: GroupKind
    window: int | None
    chunk: int | None
    caches: tuple[torch.Tensor, ...]  # [num_blocks, heads, Bd, 2 * head_size] each, dense
    rows: torch.Tensor
    run: int
    # With staging (`BlockRatio.staged`): each layer's staging pages, [pages, heads, Bp,
    # 2 * size].
    stages: tuple[torch.Tensor, ...] = ()


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


def repack_steps(group: GroupRepack, blocks: Sequence[int], moved: torch.Tensor) -> Iterator[int]:
    """Lay out again, in every layer of `group`, decode pages `blocks` that hold `ratio`
    prefill pages each (`moved[i, k]`: sub-page k of block i was received; rows gathered
    from the others become zeros): a row gather per layer, as `unit_rows` says, and the
    pages written back in place, a few blocks at a time so that what is gathered stays
    in the CPU's cache until it is written back. Yields the bytes of each such step, so
    that a caller can spread the work over several engine steps."""
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
            yield len(some) * page_bytes


def repack(group: GroupRepack, blocks: Sequence[int], moved: torch.Tensor) -> None:
    """`repack_steps`, all at once."""
    for _ in repack_steps(group, blocks, moved):
        pass


# ---- staging pages: whole prefill pages, then laid out into the decode's blocks ----
#
# Where a decode block does not hold whole prefill pages (smaller decode blocks, Bp = r *
# Bd, or sizes that do not nest, 64 and 96), a prefill page cannot land in the decode's
# pages, whose blocks are wherever vLLM put them. So such a decode registers, for its
# attention layers, staging pages of the prefill's size (`layout_from_vllm(staging=)`),
# pulls whole prefill pages into some it takes from a pool, and lays them out into its
# blocks (`unstage_steps`) before vLLM hears the request was received: lcm(Bp, Bd) tokens
# at a time, the a = lcm / Bp prefill pages and b = lcm / Bd decode blocks holding them.

STAGING_FIELD = "kv_connector_extra_config.staging_tokens"


def staging_pages(
    extra: Mapping[str, Any], max_model_len: int, source_block: int, attention_groups: int
) -> int:
    """How many staging pages the decode keeps (each held in every attention layer): the
    `staging_tokens` of the extra config (default `max_model_len`: one longest request
    at a time) in pages of the prefill's size, per attention group; refused, naming the
    field, where not even the longest request would fit (it would wait for ever)."""
    value = extra.get("staging_tokens", max_model_len)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(STAGING_FIELD, f"must be a positive integer, got {value!r}")
    if value < max_model_len:
        raise InvalidInputError(
            STAGING_FIELD,
            f"{value} tokens cannot stage one request of max_model_len {max_model_len}",
        )
    return (-(-value // source_block) + 1) * attention_groups


class StagingPool:
    """Staging page ids free for pulls; a pull takes all it needs or none. Pages given
    back go to the end of the line: the least recently used are taken first."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self._free = collections.deque(range(pages))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def give(self, ids: Sequence[int]) -> None:
        self._free.extend(ids)


def staged_units(
    block_ids: Sequence[int],
    staged: Sequence[int],
    first: int,
    source: int,
    own: int,
    num_tokens: int,
    computed_tokens: int,
    valid_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lay-out of one group's staging pages, a unit of lcm(source, own) tokens at a
    time (`BlockRatio.unit`: a prefill pages, b decode blocks): `(sources, targets)`, a
    long [units, a] of the staging pages holding each unit's prefill blocks and a long
    [units, b] of the decode blocks each unit's parts go to, -1 where none. `staged[k]`
    holds the prefill's logical block `first + k`. A decode block gets nothing where it
    was computed here, is vLLM's null block, lies past the prompt or at or after
    `valid_tokens` (recomputed by vLLM), or holds no token of a staged page; where it
    holds tokens of a prefill block that did not move (before a window, past the
    prompt), those become zeros (`unstage_steps`)."""
    lcm = math.lcm(source, own)
    a, b = lcm // source, lcm // own
    held = {first + k: int(page) for k, page in enumerate(staged)}
    end = -(-num_tokens // own) if valid_tokens >= num_tokens else valid_tokens // own
    end, low = min(end, len(block_ids)), -(-computed_tokens // own)
    sources: list[list[int]] = []
    targets: list[list[int]] = []
    units = range(first // a, (first + len(staged) - 1) // a + 1) if staged else range(0)
    for u in units:
        row = []
        for i in range(u * b, u * b + b):
            # Decode block i holds tokens of prefill blocks i * own // source .. last.
            last = ((i + 1) * own - 1) // source
            keep = low <= i < end and block_ids[i] != NULL_BLOCK
            keep = keep and any(p in held for p in range(i * own // source, last + 1))
            row.append(int(block_ids[i]) if keep else -1)
        if any(t >= 0 for t in row):
            sources.append([held.get(u * a + p, -1) for p in range(a)])
            targets.append(row)
    return (
        torch.tensor(sources, dtype=torch.long).view(len(sources), a),
        torch.tensor(targets, dtype=torch.long).view(len(targets), b),
    )


def unstage_steps(
    group: GroupRepack, sources: torch.Tensor, targets: torch.Tensor
) -> Iterator[int]:
    """Lay out the staging pages `sources` of every layer of `group` into the decode
    blocks `targets` (`staged_units`), as `unit_rows` says, a few decode blocks at a time:
    only the rows of the blocks written are gathered, so a unit of many blocks (a large
    lcm) costs what its written blocks hold. Rows from a prefill block that did not move
    become zeros. Yields the bytes of each step (see `repack_steps`)."""
    units, parts = (targets >= 0).nonzero(as_tuple=True)  # every decode block to write
    if not len(units):
        return
    a, b = sources.shape[1], targets.shape[1]
    per_page = group.rows.numel() // a
    rows = group.rows.view(b, -1)  # the rows of each decode block of a unit
    page, within = rows // per_page, rows % per_page  # where each comes from
    block_bytes = group.caches[0][0].numel() * group.caches[0].element_size()
    step = max(1, _BATCH_BYTES // block_bytes)
    for first in range(0, len(units), step):
        u, q = units[first : first + step], parts[first : first + step]
        from_page = sources[u.view(-1, 1), page[q]]  # [blocks, rows]: each row's page
        lost = from_page < 0
        index = (from_page.clamp(min=0) * per_page + within[q]).reshape(-1)
        into = targets[u, q]
        for stage, cache in zip(group.stages, group.caches, strict=True):
            out = stage.view(-1, group.run).index_select(0, index).view(len(u), rows.shape[1], -1)
            if bool(lost.any()):
                out.masked_fill_(lost.unsqueeze(2), 0)
            cache.index_copy_(0, into, out.view(len(u), *cache.shape[1:]))
            yield len(u) * block_bytes


def staged_spans(
    spans: Sequence[BlockSpan], staged: Mapping[int, tuple[int, Sequence[int]]]
) -> tuple[BlockSpan, ...]:
    """The engine's spans with each attention group's replaced by its staging pages
    (`staged`: group id -> (first logical prefill block, page ids))."""
    out = []
    for span in spans:
        if span.group_id not in staged:
            out.append(span)
            continue
        first, ids = staged[span.group_id]
        out.append(BlockSpan(span.group_id, first, tuple(BlockId(b) for b in ids)))
    return tuple(out)
