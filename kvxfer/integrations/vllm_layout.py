"""vLLM's own KV cache description -> kvxfer's `EngineLayout` (docs/vllm.md).

The engine is the source of truth: this reads vLLM's `KVCacheConfig` (the
groups, their specs and block sizes, and `kv_cache_tensors`, which place
every layer's pages in one backing allocation) and never a config.json.

It imports neither vLLM nor torch: specs are recognised by class name along
their MRO, so tests feed plain dataclasses shaped like vLLM's, and a vLLM
version that renames a spec class is refused by name instead of guessed at.

What it maps, as vLLM 0.32 lays the cache out on CPU:
- `FullAttentionSpec` -> full_attention (also with `sliding_window` set: that
  is a window layer run with the hybrid manager off, which keeps every block);
- `SlidingWindowSpec` -> sliding_window with its window in tokens;
- `ChunkedLocalAttentionSpec` -> chunked_local with its `attention_chunk_size`
  (a `FullAttentionSpec` carrying `attention_chunk_size` is, like the window
  case, the hybrid manager off: full_attention);
- `MambaSpec` (Mamba, GDN, ...) -> mamba: one state page per block, either one
  opaque region per layer or, given `states` (`vllm_state.packed_states`), one region
  per state tensor (conv, ssm, ...) carrying its cut over TP ranks;
- MLA (`MLAAttentionSpec`: kvxfer has the mla kind, but no vLLM run of an MLA
  model has been checked through the connector here), cross-attention and
  anything else -> refused by name.
Each layer is one region: layer l of a `KVCacheTensor` starts at
`offset + l * layer_stride` in the backing allocation, block b at
`+ b * block_stride`, and a block moves the content of its page,
`real_page_size_bytes` (K and V fused in one page for attention, every state
tensor of the layer packed from the page's start for Mamba), not the padding
that makes every group's page one size.
Layers of different groups share bytes (the groups overlay one pool), which
regions allow. Block 0 is vLLM's null block: it never holds a request's KV,
so spans never include it (see `spans_from_block_ids`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import (
    BlockId,
    BlockSpan,
    EngineLayout,
    GroupId,
    GroupKind,
    KVGroup,
    Region,
    StateShard,
    TensorSpec,
)
from kvxfer.integrations.vllm_params import NULL_BLOCK
from kvxfer.integrations.vllm_state import StateTensor, layer_index

_REFUSED = ("MLAAttentionSpec", "CrossAttentionSpec")


@dataclass(frozen=True)
class GroupShape:
    """What one vLLM group is, in kvxfer's terms, before any address exists."""

    kind: GroupKind
    window: int | None
    block_size: int
    page_bytes: int
    dtype: str
    chunk: int | None = None


def _class_names(spec: object) -> list[str]:
    return [cls.__name__ for cls in type(spec).__mro__]


def is_state_spec(spec: object) -> bool:
    """A Mamba/GDN state group's spec (no attention kernel writes its pages)."""
    return "MambaSpec" in _class_names(spec)


def group_shape(spec: Any, where: str) -> GroupShape:
    """Classify one group's spec; refuse what kvxfer does not model, by name."""
    names = _class_names(spec)
    if names[0] == "UniformTypeKVCacheSpecs":
        raise LayoutError(where, "UniformTypeKVCacheSpecs (mixed layer specs in one group)")
    refused = next((n for n in names if n in _REFUSED), None)
    if refused is not None:
        raise LayoutError(where, f"{refused} is not supported by kvxfer yet")
    # A page may be padded to one size for every group (the hybrid manager shares one
    # pool); the content sits at the page's start, so only that much moves.
    page = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
    block_size = int(spec.block_size)
    if "MambaSpec" in names:
        speculative = int(getattr(spec, "num_speculative_blocks", 0) or 0)
        if speculative:
            # vLLM then keeps a request's running state `speculative` blocks before its
            # last, the blocks after it scratch: the last block (what moves) is not it.
            raise LayoutError(
                f"{where}.num_speculative_blocks",
                f"{speculative}: under speculative decoding vLLM keeps the state before "
                "scratch blocks kvxfer does not tell apart yet; run without "
                "--speculative-config",
            )
        # The state dtypes go into the fingerprint: the same cut in other dtypes is other bytes.
        dtypes = [str(d).removeprefix("torch.") for d in getattr(spec, "dtypes", ())]
        return GroupShape(GroupKind.MAMBA, None, block_size, page, ",".join(dtypes) or "opaque")
    dtype = str(spec.dtype).removeprefix("torch.")
    if "SlidingWindowSpec" in names:
        window = int(spec.sliding_window)
        return GroupShape(GroupKind.SLIDING_WINDOW, window, block_size, page, dtype)
    if "ChunkedLocalAttentionSpec" in names:
        chunk = int(spec.attention_chunk_size)
        return GroupShape(GroupKind.CHUNKED_LOCAL, None, block_size, page, dtype, chunk)
    if "FullAttentionSpec" in names:
        return GroupShape(GroupKind.FULL_ATTENTION, None, block_size, page, dtype)
    raise LayoutError(where, f"unknown vLLM KV cache spec {names[0]}")


def _layer_places(kv_cache_config: Any) -> dict[str, tuple[int, int]]:
    """layer name -> (offset of its block 0 in the allocation, block stride)."""
    places: dict[str, tuple[int, int]] = {}
    for index, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        for position, layer in enumerate(tensor.layers):
            if layer in places:
                raise LayoutError(f"kv_cache_tensors[{index}]", f"layer {layer} placed twice")
            offset = int(tensor.offset) + position * int(tensor.layer_stride)
            places[layer] = (offset, int(tensor.block_stride))
    return places


def layout_from_vllm(
    kv_cache_config: Any,
    *,
    buffer: str,
    base_offset: int,
    model: str,
    tp_size: int = 1,
    tp_rank: int = 0,
    num_kv_heads: int | None = None,
    head_major: bool = False,
    kernels: Sequence[str | None] | None = None,
    states: Mapping[int, Sequence[StateTensor]] | None = None,
    reblock: int = 1,
    staging: Staging | None = None,
) -> EngineLayout:
    """The layout of one vLLM worker whose backing allocation starts at
    `base_offset` inside the registered buffer `buffer`.

    `num_kv_heads` is the model's KV head count (all ranks), set on every attention
    group; `head_major` says every attention page is `[heads][block_size][2 *
    head_size]` (vLLM's CPU pages, which the worker checks on the tensors): with both,
    a pairing of different TP sizes cuts each block into head runs. `kernels` names each
    group's attention kernel and page order (None for a state group), so that two
    engines whose kernels lay a page out differently do not agree. `states` gives, per
    state group, the tensors packed in its page with their cuts over TP ranks: each
    becomes a region of its own, `<layer>.<suffix>`, which a pairing of different TP
    sizes reads in byte ranges (without it a state page is one opaque region).
    `reblock` > 1 registers every attention page as that many whole sub-pages of
    block_size / reblock tokens, the pages of the prefill this decode reads
    (`vllm_reblock`); `kernels` then name the kernel at that sub-page size. `staging`
    (a decode whose blocks do not hold whole prefill pages) registers every attention
    layer's staging pages, of the prefill's size, in place of its own pages; `kernels` then name
    the kernel at the prefill's size."""
    groups: list[KVGroup] = []
    regions: list[Region] = []
    shapes: list[GroupShape] = []
    places = _layer_places(kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks)
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        where = f"kv_cache_groups[{gid}]"
        shape = _sub_pages(
            group_shape(group.kv_cache_spec, f"{where}.kv_cache_spec"), reblock, where
        )
        staged = staging is not None and shape.kind is not GroupKind.MAMBA
        if staged:
            assert staging is not None
            per_token, rest = divmod(shape.page_bytes, shape.block_size)
            if rest:
                raise LayoutError(f"{where}.kv_cache_spec", "a page is no whole bytes per token")
            shape = replace(
                shape, block_size=staging.block_size, page_bytes=per_token * staging.block_size
            )
        shapes.append(shape)
        blocks = num_blocks if shape.kind is GroupKind.MAMBA else num_blocks * reblock
        packed = _packed(shape, (states or {}).get(gid), where)
        tensors: list[TensorSpec] = []
        for position, layer in enumerate(group.layer_names):
            if layer not in places:
                raise LayoutError(f"{where}.layer_names", f"{layer} has no kv_cache_tensor")
            offset, stride = places[layer]
            if blocks != num_blocks:
                if stride != shape.page_bytes * reblock:
                    raise LayoutError(
                        f"{where}.layer_names",
                        f"{layer}'s pages are {stride} bytes apart, not {reblock} sub-pages "
                        f"of {shape.page_bytes}: they cannot be read as a smaller block size",
                    )
                stride = shape.page_bytes
            index = layer_index(layer, position)
            for name, at, nbytes, shard in _pieces(layer, shape, packed):
                tensors.append(TensorSpec(name, index, nbytes, shard))
                if staged:
                    assert staging is not None
                    regions.append(staging.region(name, nbytes))
                    continue
                regions.append(
                    Region(name, buffer, base_offset + offset + at, blocks, stride, nbytes)
                )
        groups.append(
            KVGroup(
                group_id=GroupId(gid),
                kind=shape.kind,
                sliding_window=shape.window,
                layers=tuple(t.layer for t in tensors),
                tensors=tuple(tensors),
                block_size=shape.block_size,
                chunk_size=shape.chunk,
                num_kv_heads=None if shape.kind is GroupKind.MAMBA else num_kv_heads,
            )
        )
    attention = [s for s in shapes if s.kind is not GroupKind.MAMBA]
    if head_major and num_kv_heads is not None:
        # A run of heads is cut by kvxfer's count of the heads a rank holds; a page that
        # holds another count (a model whose layers differ) is not cut that way.
        head_major = all(
            int(g.kv_cache_spec.num_kv_heads) == max(1, num_kv_heads // tp_size)
            for g, s in zip(kv_cache_config.kv_cache_groups, shapes, strict=True)
            if s.kind is not GroupKind.MAMBA
        )
    block_size = attention[0].block_size if attention else shapes[0].block_size
    dtypes = {s.dtype for s in attention}
    if len(dtypes) > 1:
        raise LayoutError("kv_cache_groups", f"mixed attention dtypes {sorted(dtypes)}")
    kv_dtype = dtypes.pop() if dtypes else "bfloat16"
    return EngineLayout(
        model=model,
        fingerprint=_fingerprint(model, shapes, groups, tp_size, kernels),
        kv_dtype=kv_dtype,
        block_size=block_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        groups=tuple(groups),
        regions=tuple(regions),
        token_major=False,  # each head's K and V in the kernel's order: no token ranges
        head_major=head_major,
    )


@dataclass(frozen=True)
class Staging:
    """Where a decode that stages its prefill's pages keeps them (`vllm_reblock`): layer
    `layers[k]`'s `pages` pages of `page_bytes` each, one after another from
    `base_offset + k * pages * page_bytes` in the registered buffer `buffer`; each holds
    `block_size` tokens, the prefill's block size."""

    buffer: str
    base_offset: int
    pages: int
    block_size: int
    page_bytes: int
    layers: tuple[str, ...]

    def region(self, layer: str, page_bytes: int) -> Region:
        if layer not in self.layers or page_bytes != self.page_bytes:
            raise LayoutError("staging", f"{layer}: no staging pages of {page_bytes} bytes")
        start = self.base_offset + self.layers.index(layer) * self.pages * self.page_bytes
        return Region(layer, self.buffer, start, self.pages, page_bytes, page_bytes)


def attention_layers(kv_cache_config: Any) -> tuple[str, ...]:
    """Every attention layer, group by group (the order staging pages are kept in)."""
    return tuple(
        layer
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if group_shape(g.kv_cache_spec, f"kv_cache_groups[{i}].kv_cache_spec").kind
        is not GroupKind.MAMBA
        for layer in g.layer_names
    )


def _sub_pages(shape: GroupShape, reblock: int, where: str) -> GroupShape:
    """An attention group's pages seen as `reblock` sub-pages each (`layout_from_vllm`)."""
    if reblock == 1 or shape.kind is GroupKind.MAMBA:
        return shape
    if reblock < 1 or shape.block_size % reblock or shape.page_bytes % reblock:
        raise LayoutError(
            f"{where}.kv_cache_spec",
            f"a page of {shape.block_size} tokens does not split into {reblock} sub-pages",
        )
    return replace(
        shape, block_size=shape.block_size // reblock, page_bytes=shape.page_bytes // reblock
    )


def _packed(
    shape: GroupShape, packed: Sequence[StateTensor] | None, where: str
) -> Sequence[StateTensor] | None:
    if packed is None:
        return None
    if shape.kind is not GroupKind.MAMBA:
        raise LayoutError(where, "state tensors given for a group that holds no state")
    if sum(t.nbytes for t in packed) != shape.page_bytes:
        raise LayoutError(
            f"{where}.kv_cache_spec",
            f"its state tensors hold {sum(t.nbytes for t in packed)} bytes, its page "
            f"{shape.page_bytes}",
        )
    return packed


def _pieces(
    layer: str, shape: GroupShape, packed: Sequence[StateTensor] | None
) -> list[tuple[str, int, int, StateShard | None]]:
    """(region name, offset in the page, bytes, cut) of each tensor of `layer`'s page."""
    if packed is None:
        return [(layer, 0, shape.page_bytes, None)]
    return [(f"{layer}.{t.suffix}", t.offset, t.nbytes, t.shard) for t in packed]


def pages_are_head_major(
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    heads_apart: Callable[[Any, Any], bool] | None = None,
) -> bool:
    """Whether every attention layer's tensor is `[num_blocks, heads, block_size, 2 *
    head_size]` and dense inside a block (vLLM 0.32's pages: per head, the block's K
    half then its V half, each in the kernel's own order): a run of heads is then one
    byte range of a block. Checked on the tensors vLLM hands the worker, never assumed:
    anything else (a kernel block size that splits the block, a packed or quantized
    page, K and V of different head sizes) is not head-major, and different TP sizes
    are refused for it by name. `heads_apart(spec, tensor)`, when given, must also say
    that the kernel writing the group's pages keeps every head inside its own slice
    (`vllm_kernel.kernel_keeps_heads_apart`)."""
    num_blocks = int(kv_cache_config.num_blocks)
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if "MambaSpec" in _class_names(spec):
            continue
        heads, size, block = int(spec.num_kv_heads), int(spec.head_size), int(spec.block_size)
        if int(getattr(spec, "head_size_v", None) or size) != size:
            return False
        if getattr(spec, "num_head_slots", None) not in (None, heads):
            return False
        if getattr(spec, "state_content_bytes", None) is not None:  # a packed page
            return False
        quant = getattr(spec, "kv_quant_mode", None)  # vLLM's IntEnum: str() gives "0"
        if quant is not None and getattr(quant, "name", quant) != "NONE":
            return False
        page = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
        for layer in group.layer_names:
            tensor = kv_caches.get(layer)
            if tensor is None or tuple(tensor.shape) != (num_blocks, heads, block, 2 * size):
                return False
            if tuple(tensor.stride())[1:] != (block * 2 * size, 2 * size, 1):
                return False
            if tensor.element_size() * heads * block * 2 * size != page:  # the bytes, too
                return False
        first = kv_caches[group.layer_names[0]] if group.layer_names else None
        if heads_apart is not None and first is not None and not heads_apart(spec, first):
            return False
    return True


def _fingerprint(
    model: str,
    shapes: Sequence[GroupShape],
    groups: Sequence[KVGroup],
    tp_size: int,
    kernels: Sequence[str | None] | None,
) -> str:
    """Same model and same cache shape on both sides -> same fingerprint, whatever the
    TP size where the head count is known: an attention page then counts per head.
    `kernels` (each group's attention kernel and the order it writes a page in,
    `vllm_kernel.KernelFacts.name`) tell apart pages of the same shape whose bytes mean
    different things."""
    described = [
        [s.kind.value, s.window, s.chunk, s.block_size, _page(s, g, tp_size), s.dtype, _names(g)]
        for s, g in zip(shapes, groups, strict=True)
    ]
    if kernels is not None:
        for row, kernel in zip(described, kernels, strict=True):
            row.append(kernel)
    text = json.dumps([model, described], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _page(shape: GroupShape, group: KVGroup, tp_size: int) -> object:
    """A group's page bytes, per head (with the model's head count) where it is known; a
    state page cut over TP ranks by its cuts, which are the same on every TP size."""
    cuts = [
        (t.name.rsplit(".", 1)[-1], t.shard)
        for t in group.tensors
        if t.layer == group.tensors[0].layer and t.shard is not None
    ]
    if cuts:
        return [
            [name, cut.rows, [[s.heads, s.head_bytes] for s in cut.segments]] for name, cut in cuts
        ]
    if group.num_kv_heads is None:
        return shape.page_bytes
    return [group.num_kv_heads, shape.page_bytes // max(1, group.num_kv_heads // tp_size)]


def _names(group: KVGroup) -> list[str]:
    return [t.name for t in group.tensors]


def group_kinds(kv_cache_config: Any) -> tuple[GroupKind, ...]:
    """The kind of every group, for code that has the config but no layout (the scheduler)."""
    return tuple(
        group_shape(g.kv_cache_spec, f"kv_cache_groups[{i}].kv_cache_spec").kind
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )


def spans_from_block_ids(
    kinds: Sequence[GroupKind], block_ids: Sequence[Iterable[int]]
) -> tuple[BlockSpan, ...]:
    """One span per group from vLLM's per-group block id lists.

    List index i is logical block i. Leading null blocks (vLLM puts them where
    a sliding window dropped blocks) are cut: the span starts at the first
    real block. A Mamba group's state is its last real block, which is
    kvxfer's logical block 0. A group with no real block gets an empty span.
    """
    if len(block_ids) != len(kinds):
        raise LayoutError("block_ids", f"{len(block_ids)} lists for {len(kinds)} groups")
    spans: list[BlockSpan] = []
    for gid, ids in enumerate(block_ids):
        listed = [int(b) for b in ids]
        if kinds[gid] is GroupKind.MAMBA:
            state = [b for b in listed if b != NULL_BLOCK][-1:]
            spans.append(BlockSpan(GroupId(gid), 0, tuple(BlockId(b) for b in state)))
            continue
        first = next((i for i, b in enumerate(listed) if b != NULL_BLOCK), len(listed))
        tail = listed[first:]
        if NULL_BLOCK in tail:
            raise LayoutError(
                f"block_ids[{gid}]",
                f"null block inside the request's blocks at {first + tail.index(NULL_BLOCK)}",
            )
        spans.append(BlockSpan(GroupId(gid), first, tuple(BlockId(b) for b in tail)))
    return tuple(spans)
