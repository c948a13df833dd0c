"""What a decode of another block size than its prefill's pays to lay received pages out
again (kvxfer/integrations/vllm_reblock.py), on vLLM-CPU's own kernels.

Per model shape and prompt length: the pages of one request (every attention layer,
prefill pages of `--prefill-block` tokens moved in whole, as the sidecar moves them:
as sub-pages of decode pages `--decode-block` tokens long where those hold whole
prefill pages, else into staging pages) laid out again by `repack` or `unstage_steps`,
against, in the same run on the
same pages, a plain copy of those bytes (`torch.Tensor.copy_`, the least any re-layout
could cost) and the decode's kernel writing the same keys and values itself from
canonical tensors (what vLLM pays to store the KV it computes). Reported per case: the
median of `--repeat` runs of each, GB/s of page bytes, and the ratios side by side.

    make vllm-venv install
    .venv-vllm/bin/python benchmarks/bench_vllm_reblock.py --tokens 1024 4096
    .venv-vllm/bin/python benchmarks/bench_vllm_reblock.py --prefill-block 96 --decode-block 64

Prints one JSON object per case.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvxfer.core.layout import GroupKind
from kvxfer.integrations.vllm_reblock import (
    GroupRepack,
    kernel_rows,
    received_blocks,
    repack,
    staged_units,
    unstage_steps,
)

# (layers, KV heads, head size) from shared/models' public configs.
SHAPES = {
    "llama-3.1-8b": (32, 8, 128),
    "gemma-3-4b-it": (34, 4, 256),
    "gpt-oss-20b": (24, 8, 64),
}


def kernel(isa: str) -> Callable[..., None]:
    def write(*args: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(*args, isa)

    return write


def median_s(run: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def case(model: str, tokens: int, source: int, block: int, dtype: torch.dtype, repeat: int) -> dict:
    """Prefill pages of `source` tokens into decode blocks of `block`: read as sub-pages
    where `block` is a multiple of `source`, else staged whole and laid out."""
    layers, heads, size = SHAPES[model]
    staged = block % source != 0
    unit = math.lcm(source, block)
    pages = -(-tokens // unit) * unit // source  # whole units: every block whole
    blocks, tokens = pages * source // block, pages * source  # the request's decode blocks
    own = kernel(_get_attn_isa(dtype, block, size))
    theirs = kernel(_get_attn_isa(dtype, source, size))
    caches = tuple(torch.randn(blocks + 1, heads, block, 2 * size).to(dtype) for _ in range(layers))
    rows, run = kernel_rows(
        theirs, own, heads=heads, source_block=source, target_block=block, size=size, dtype=dtype
    )
    ids = list(range(1, blocks + 1))
    if staged:
        stages = tuple(torch.randn(pages, heads, source, 2 * size).to(dtype) for _ in range(layers))
        group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, caches, rows, run, stages)
        order, into = staged_units(ids, list(range(pages)), 0, source, block, tokens, 0, tokens)

        def work() -> None:
            for _ in unstage_steps(group, order, into):
                pass

        copied = stages
    else:
        group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, caches, rows, run)
        chosen, moved = received_blocks(group, ids, block // source, tokens, 0, tokens)

        def work() -> None:
            repack(group, chosen, moved)

        copied = caches
    spare = [torch.empty_like(c) for c in copied]
    key = torch.randn(blocks * block, heads, size).to(dtype)
    slots = torch.arange(block, (blocks + 1) * block)

    def copy() -> None:
        for c, s in zip(copied, spare, strict=True):
            s.copy_(c)

    def direct() -> None:
        for c in caches:
            kc, vc = c.view(blocks + 1, heads, 2 * block, size).chunk(2, dim=2)
            own(key, key, kc, vc, slots)

    nbytes = sum(c[1:].numel() * c.element_size() for c in caches)
    out = {
        "model": model, "tokens": tokens, "prefill_block": source, "decode_block": block,
        "staged": staged, "dtype": str(dtype).removeprefix("torch."),
        "isas": [_get_attn_isa(dtype, source, size), _get_attn_isa(dtype, block, size)],
        "page_bytes": nbytes, "run": run,
    }  # fmt: skip
    for name, run in (("repack", work), ("copy", copy), ("kernel_write", direct)):
        run()  # warm
        seconds = median_s(run, repeat)
        out[f"{name}_ms"] = round(seconds * 1000, 3)
        out[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 2)
    out["repack_over_copy"] = round(out["repack_ms"] / out["copy_ms"], 2)
    out["repack_over_kernel_write"] = round(out["repack_ms"] / out["kernel_write_ms"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--prefill-block", type=int, default=32)
    parser.add_argument(
        "--decode-block",
        type=int,
        default=128,
        help="not a multiple of --prefill-block: prefill pages staged whole, then laid out",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core, as the decode worker's thread has
    for model in args.models:
        for tokens in args.tokens:
            row = case(model, tokens, args.prefill_block, args.decode_block,
                       getattr(torch, args.dtype), args.repeat)  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
