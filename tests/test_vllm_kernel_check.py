"""`vllm_kernel.heads_stay_apart`, the connector's check of vLLM's attention kernel
before it calls its pages head-major, against kernels written here: the layout vLLM-CPU
documents (and its vec kernel's transposed K) pass; a kernel that mixes heads, strays
into another block or writes half a head does not. The real kernels are checked in
tests/test_vllm_page_interior.py."""

from __future__ import annotations

import pytest
import torch

from kvxfer.integrations.vllm_kernel import KernelFacts, heads_stay_apart, kernel_facts, page_order

HEADS, BLOCK, HEAD = 4, 32, 16


def rows(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """Token t's K at row t of the K half (the reference layout)."""
    blocks, offsets = slots // key_cache.shape[2], slots % key_cache.shape[2]
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def transposed(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """K stored as head_size rows of block_size tokens, as vLLM-CPU's vec kernel does."""
    size = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, size)
        flat = key_cache[block].reshape(key_cache.shape[1], -1)  # a view: same storage
        flat.view(key_cache.shape[1], key_cache.shape[3], size)[:, :, offset] = key[i]
        value_cache[block, :, offset] = value[i]


def swapped(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """Heads 0 and 1 trade places."""
    order = [1, 0, *range(2, key.shape[1])]
    rows(key[:, order], value[:, order], key_cache, value_cache, slots)


def strays(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """Right, plus one element into the block before."""
    rows(key, value, key_cache, value_cache, slots)
    key_cache[0, 0, 0, 0] = 1


def half(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """Keys only."""
    rows(key, torch.zeros_like(value), key_cache, value_cache, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("write", "apart"),
    [(rows, True), (transposed, True), (swapped, False), (strays, False), (half, False)],
)
def test_heads_stay_apart(write, apart: bool, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    got = heads_stay_apart(write, heads=HEADS, block_size=BLOCK, head_size=HEAD, dtype=dtype)
    assert got is apart


def test_more_heads_than_codes_is_not_checked() -> None:
    assert not heads_stay_apart(rows, heads=257, block_size=BLOCK, head_size=HEAD,
                                dtype=torch.float32)  # fmt: skip


def test_page_order_names_where_a_kernel_puts_each_value() -> None:
    """The same kernel gets the same name on every call (any host), another order
    another name: what keeps engines on different kernels from pairing."""
    order = {
        name: page_order(write, block_size=BLOCK, head_size=HEAD, dtype=torch.bfloat16)
        for name, write in (("rows", rows), ("transposed", transposed), ("again", rows))
    }
    assert order["rows"] == order["again"] != order["transposed"]
    assert order["rows"] != page_order(rows, block_size=BLOCK, head_size=HEAD, dtype=torch.float32)


def test_without_vllm_no_kernel_is_named_and_no_page_is_head_major() -> None:
    """kvxfer's own venv has no vLLM: nothing to ask, so nothing is claimed."""
    spec = type("Spec", (), {"block_size": BLOCK, "head_size": HEAD, "num_kv_heads": HEADS})()
    facts = kernel_facts(spec, torch.zeros(1, HEADS, BLOCK, 2 * HEAD), "auto")
    assert facts == KernelFacts(None, False, None) and facts.name is None
