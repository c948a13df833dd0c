"""Whether vLLM-CPU's attention kernel keeps each KV head inside its own slice of a page.

A pairing of different TP sizes moves a run of heads as one byte range of each block
(`EngineLayout.head_major`). That holds for vLLM-CPU's pages only if the kernel that
writes them (`cpu_attn_reshape_and_cache`, one implementation per ISA: vec, vec16,
amx, neon, ...) puts every byte of head h inside `page[block, h]`. What it does inside
that slice is its own: here the vec kernels store K transposed (a head's K is head_size
rows of block_size tokens), so a token range of a head is not one or two byte ranges,
and kvxfer never cuts vLLM pages by tokens (different block sizes are refused).

The worker checks the containment on the kernel its engine will use, once, on a scratch
page, before it calls its pages head-major; anything it cannot check is not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# The kernel's write: (key, value, key_cache, value_cache, slot_mapping), where key and
# value are [tokens, heads, head_size] and the caches the two halves of a page viewed
# as [num_blocks, heads, block_size, head_size] each (vLLM's CPU backend's view).
KernelWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_BLOCKS = 3  # the write goes to block 1; blocks 0 and 2 must stay untouched


def heads_stay_apart(
    write: KernelWrite, *, heads: int, block_size: int, head_size: int, dtype: torch.dtype
) -> bool:
    """Write a full block through `write` with head h's keys all h+1 and its values all
    -(h+1), and check that `page[1, h]` then holds exactly block_size * head_size of each
    and nothing else, and that the blocks around it stay zero."""
    if heads > 256:  # the codes must be exact in bf16/fp16
        return False
    cache = torch.zeros(_BLOCKS, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(_BLOCKS, heads, 2 * block_size, head_size).chunk(2, dim=2)
    code = (torch.arange(heads, dtype=torch.float32) + 1).view(1, heads, 1)
    key = code.expand(block_size, heads, head_size).to(dtype).contiguous()
    value = (-code).expand(block_size, heads, head_size).to(dtype).contiguous()
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.long)
    write(key, value, key_cache, value_cache, slots)
    per_plane = block_size * head_size
    for h in range(heads):
        inside = cache[1, h].float()
        if (
            int((inside == h + 1).sum()) != per_plane
            or int((inside == -(h + 1)).sum()) != per_plane
        ):
            return False
    return not (cache[0].any() or cache[2].any())


def cpu_kernel_write(spec: Any, dtype: torch.dtype, kv_cache_dtype: str) -> KernelWrite | None:
    """vLLM-CPU's own write for pages of `spec`, through the ISA its CPU backend picks for
    them; None where that backend or its op is not there to ask."""
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415 (only in the vLLM venv)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415
    except ImportError as exc:  # not vLLM-CPU, or a vLLM that moved them
        log.info("cannot check vLLM's attention kernel: %s", exc)
        return None
    isa = _get_attn_isa(dtype, int(spec.block_size), int(spec.head_size), kv_cache_dtype)

    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


def kernel_keeps_heads_apart(spec: Any, tensor: torch.Tensor, kv_cache_dtype: str) -> bool:
    """The check `pages_are_head_major` makes for one attention group: vLLM-CPU's kernel
    for these pages, probed with `heads_stay_apart`."""
    write = cpu_kernel_write(spec, tensor.dtype, kv_cache_dtype)
    if write is None:
        return False
    try:
        return heads_stay_apart(
            write,
            heads=int(spec.num_kv_heads),
            block_size=int(spec.block_size),
            head_size=int(spec.head_size),
            dtype=tensor.dtype,
        )
    except (RuntimeError, ValueError, TypeError) as exc:  # the op refused the probe
        log.info("vLLM's attention kernel refused the probe: %s", exc)
        return False
