"""A decode vLLM whose blocks are larger than its prefill's (docs/vllm.md, "Different
block sizes").

A vLLM-CPU page cannot be cut by tokens: the attention kernel orders each head's keys
and values its own way (the vec kernels store K transposed), so a token range of a
page is no byte range. A whole page is, and a decode page of block size Bd = r * Bp is
exactly as many bytes as r prefill pages of block size Bp. So the decode worker
registers its attention pages with the sidecar *as* r sub-pages of Bp tokens each (the
layout a Bp engine would register, `layout_from_vllm(reblock=r)`), the sidecar moves
whole prefill pages into them (any TP pairing, the exact planner unchanged), and once
every pull of a request ended the worker lays each received page out again with vLLM's
own kernel (`repack`): the prefill kernel's order at Bp, learnt from that kernel
(`vllm_kernel.kernel_positions`), gives every token's key and value back, and the
decode's kernel at Bd writes them where it reads them. Sub-pages the planner did not
move (before a sliding window) are written as zeros, never as stale bytes.

The prefill's kernel at Bp and the decode's own probe of it must be the same kernel:
the sub-pages' order goes into the layout's fingerprint (`vllm_kernel.page_order` at
Bp), so a pair whose kernels differ is refused by negotiation, as for equal sizes.

Only larger decode blocks (a multiple of the prefill's), only on a decode
(`kv_consumer`: a page re-laid out after arrival is no page to publish), and not yet
with state (Mamba) groups; each is refused by name when the connector starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvxfer._exceptions import InvalidInputError
from kvxfer.core.layout import BlockId, BlockSpan, GroupKind
from kvxfer.core.planner import needed_blocks
from kvxfer.integrations.vllm_kernel import KernelWrite
from kvxfer.integrations.vllm_layout import NULL_BLOCK, group_shape

FIELD = "kv_connector_extra_config.prefill_block_size"


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
    if any(s.kind is GroupKind.MAMBA for s in shapes):
        raise InvalidInputError(FIELD, "not supported with state (Mamba) groups yet")
    return own // value


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


@dataclass(frozen=True)
class GroupRepack:
    """One attention group's re-layout: its layers' page tensors, where the prefill's
    kernel puts each key and value at the sub-page size, and the decode's own write."""

    kind: GroupKind
    window: int | None
    chunk: int | None
    caches: tuple[torch.Tensor, ...]  # [num_blocks, heads, Bd, 2 * head_size] each
    positions: torch.Tensor  # vllm_kernel.kernel_positions of the prefill's kernel at Bp
    write: KernelWrite  # the decode's kernel at Bd


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
    prefill pages each (`moved[i, k]`: sub-page k of block i was received; the others
    become zeros): every key and value read back through the prefill kernel's
    positions, then written through the decode's kernel at its own block size."""
    if not blocks:
        return
    ratio = moved.shape[1]
    ids = torch.tensor(list(blocks), dtype=torch.long)
    keep = moved.view(len(blocks), ratio, 1, 1, 1, 1)
    for cache in group.caches:
        num_blocks, heads, block, fused = cache.shape
        size, sub = fused // 2, block // ratio
        raw = cache.index_select(0, ids).reshape(len(blocks), ratio, heads, 2 * sub * size)
        canon = raw.index_select(3, group.positions).view(len(blocks), ratio, heads, 2, sub, size)
        canon = canon.masked_fill(~keep, 0)
        # [blocks, ratio, heads, sub, size] -> tokens in order, [tokens, heads, size]
        key = canon[:, :, :, 0].permute(0, 1, 3, 2, 4).reshape(-1, heads, size).contiguous()
        value = canon[:, :, :, 1].permute(0, 1, 3, 2, 4).reshape(-1, heads, size).contiguous()
        slots = (ids.view(-1, 1) * block + torch.arange(block)).reshape(-1)
        key_cache, value_cache = cache.view(num_blocks, heads, 2 * block, size).chunk(2, dim=2)
        group.write(key, value, key_cache, value_cache, slots)
