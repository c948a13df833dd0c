"""A decode vLLM with larger blocks than its prefill's (vllm_reblock), without vLLM: the
kernels here are torch writers with vLLM-CPU's write signature that order a page as its
kernels do (K transposed, or token rows), the seam the real kernel plugs into
(tests/test_vllm_page_interior.py runs vLLM's own)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_vllm_layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    gemma3_config,
)

from kvxfer._exceptions import InvalidInputError, LayoutError, NegotiationError
from kvxfer.core.layout import BlockId, BlockSpan, GroupId, GroupKind
from kvxfer.core.negotiation import negotiate
from kvxfer.core.requests import PullDone, PullStatus
from kvxfer.integrations import vllm_reblock
from kvxfer.integrations.vllm_kernel import KernelWrite, kernel_positions
from kvxfer.integrations.vllm_layout import Staging, attention_layers, layout_from_vllm
from kvxfer.integrations.vllm_params import load_errors
from kvxfer.integrations.vllm_reblock import (
    GroupRepack,
    StagingPool,
    block_size_hint,
    kernel_rows,
    reblock_ratio,
    received_blocks,
    repack,
    resumable,
    staged_spans,
    staged_units,
    staging_pages,
    sub_spans,
    unstage_steps,
)

HEADS, SIZE = 2, 8


def transposed(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """K stored as [head_size][block_size] per head (vLLM-CPU's vec kernels), V as rows."""
    block = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, block)
        for h in range(key.shape[1]):
            key_cache[b, h].view(-1).view(key.shape[2], block)[:, t] = key[i, h]
            value_cache[b, h, t] = value[i, h]


def rows(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """Every token's K and V as a row of its half."""
    block = key_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, block)
        key_cache[b, :, t] = key[i]
        value_cache[b, :, t] = value[i]


def halves(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """A broken kernel: keeps only the first half of every key."""
    rows(key, value, key_cache, value_cache, slots)
    key_cache[..., key.shape[2] // 2 :] = 0


def write(kernel: KernelWrite, cache: torch.Tensor, kv: torch.Tensor, first_slot: int) -> None:
    """`kv` ([tokens, 2, heads, size]) into `cache` from `first_slot` on, through `kernel`."""
    blocks, heads, block, fused = cache.shape
    k, v = cache.view(blocks, heads, 2 * block, fused // 2).chunk(2, dim=2)
    slots = torch.arange(first_slot, first_slot + kv.shape[0])
    kernel(kv[:, 0].contiguous(), kv[:, 1].contiguous(), k, v, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positions_are_learnt_from_the_kernel(dtype: torch.dtype) -> None:
    for block in (16, 32):  # 16 * 8 = 128 keys: one digit of 200; 32 * 8: two
        n = block * SIZE
        at = kernel_positions(
            transposed, heads=HEADS, block_size=block, head_size=SIZE, dtype=dtype
        )
        t, d = torch.arange(block).view(-1, 1), torch.arange(SIZE).view(1, -1)
        assert torch.equal(at[:n].view(block, SIZE), d * block + t)  # K transposed
        assert torch.equal(at[n:], torch.arange(n, 2 * n))  # V rows
        plain = kernel_positions(rows, heads=HEADS, block_size=block, head_size=SIZE, dtype=dtype)
        assert torch.equal(plain, torch.arange(2 * n))


def swapped(key, value, key_cache, value_cache, slots) -> None:  # type: ignore[no-untyped-def]
    """A broken kernel: writes head h's keys and values into head h+1's slice."""
    rows(key.roll(1, dims=1), value.roll(1, dims=1), key_cache, value_cache, slots)


def test_a_kernel_that_loses_values_or_mixes_heads_is_refused() -> None:
    with pytest.raises(LayoutError, match="mixes the heads"):
        kernel_positions(swapped, heads=HEADS, block_size=16, head_size=SIZE, dtype=torch.float32)
    with pytest.raises(LayoutError, match="exactly"):
        kernel_positions(halves, heads=HEADS, block_size=16, head_size=SIZE, dtype=torch.float32)
    with pytest.raises(LayoutError, match="exactly"):  # fp8 cannot hold the digits
        kernel_positions(
            rows, heads=HEADS, block_size=16, head_size=SIZE, dtype=torch.float8_e4m3fn
        )


def _group(kind: GroupKind, caches: list[torch.Tensor], sub: int, window: int | None = None):  # type: ignore[no-untyped-def]
    ratio = caches[0].shape[2] // sub
    rows, run = kernel_rows(transposed, transposed, heads=HEADS, source_block=sub,
                            target_block=sub * ratio, size=SIZE, dtype=caches[0].dtype)  # fmt: skip
    return GroupRepack(kind, window, None, tuple(caches), rows, run)


@pytest.mark.parametrize(
    ("ratio", "decode_kernel", "batch"),
    [(2, transposed, 2 << 20), (4, transposed, 2 << 20), (2, rows, 2 << 20), (4, transposed, 1)],
)
def test_prefill_pages_read_whole_are_laid_out_as_the_decode_writes_them(
    ratio: int, decode_kernel: KernelWrite, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill pages (B=16, K transposed) copied byte for byte into decode pages of 16 *
    ratio tokens, then repacked, equal the decode kernel writing the same KV itself."""
    monkeypatch.setattr(vllm_reblock, "_BATCH_BYTES", batch)  # 1: one block per step
    sub, tokens = 16, 16 * ratio * 3 - 5  # three decode blocks, the last not full
    gen = torch.Generator().manual_seed(ratio)
    kv = torch.randn(tokens, 2, HEADS, SIZE, generator=gen).to(torch.bfloat16)
    prefill = torch.zeros(3 * ratio + 1, HEADS, sub, 2 * SIZE, dtype=torch.bfloat16)
    write(transposed, prefill, kv, sub)  # prefill blocks 1 .. 3 * ratio
    decode = torch.full((5, HEADS, sub * ratio, 2 * SIZE), float("nan"), dtype=torch.bfloat16)
    ids = [4, 2, 3]  # decode block ids of logical blocks 0, 1, 2
    for i, b in enumerate(ids):  # what the sidecar moves: whole pages into sub-pages
        pages = prefill[1 + i * ratio : 1 + (i + 1) * ratio]
        decode[b].view(-1).copy_(pages.reshape(-1))
    rows, run = kernel_rows(transposed, decode_kernel, heads=HEADS, source_block=sub,
                            target_block=sub * ratio, size=SIZE, dtype=torch.bfloat16)  # fmt: skip
    # K transposed on both sides moves a sub-page's tokens of one dimension at once; into
    # token rows, every element goes its own way.
    assert run == (16 if decode_kernel is transposed else 1)
    group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, (decode,), rows, run)
    blocks, moved = received_blocks(group, ids, ratio, tokens, 0, tokens)
    assert blocks == ids and bool(moved.all())
    repack(group, blocks, moved)
    want = torch.zeros_like(decode)
    padded = torch.cat([kv, torch.zeros(3 * sub * ratio - tokens, 2, HEADS, SIZE,
                                        dtype=kv.dtype)])  # fmt: skip
    for i, b in enumerate(ids):
        write(decode_kernel, want, padded[i * sub * ratio : (i + 1) * sub * ratio], b * sub * ratio)
    # The prefill's last page holds zeros past the prompt, as `padded` does.
    for b in ids:
        assert torch.equal(decode[b], want[b]), b
    assert decode[0].isnan().all() and decode[1].isnan().all()  # other blocks untouched


def test_sub_pages_before_a_window_become_zeros_never_stale_bytes() -> None:
    ratio, sub, window, tokens = 4, 16, 20, 128  # the window needs tokens 109.. only
    decode = torch.full((3, HEADS, sub * ratio, 2 * SIZE), 7.0)
    group = _group(GroupKind.SLIDING_WINDOW, [decode], sub, window)
    blocks, moved = received_blocks(group, [1, 2], ratio, tokens, 0, tokens)
    # Sub-pages 6 and 7 (tokens 96..127) moved: only decode block 2 (logical 1) changes.
    assert blocks == [2] and moved.tolist() == [[False, False, True, True]]
    repack(group, blocks, moved)
    k, v = decode.view(3, HEADS, 2, sub * ratio, SIZE)[2].unbind(1)  # transposed K
    assert not k.view(HEADS, SIZE, sub * ratio)[..., :32].any()  # sub-pages 0, 1: zeros
    assert not v[:, :32].any()
    assert bool((v[:, 32:] == 7.0).all()) and bool((decode[1] == 7.0).all())


def test_computed_blocks_and_blocks_vllm_recomputes_are_left_alone() -> None:
    decode = torch.zeros(8, HEADS, 64, 2 * SIZE)
    group = _group(GroupKind.FULL_ATTENTION, [decode], 16)
    ids = [5, 6, 7, 3]
    # 64 tokens computed here, 250 tokens, 150 valid: blocks 1 (64..127) only.
    blocks, moved = received_blocks(group, ids, 4, 250, 64, 150)
    assert blocks == [6] and bool(moved.all())
    blocks, _ = received_blocks(group, ids, 4, 250, 64, 250)
    assert blocks == [6, 7, 3]
    with pytest.raises(InvalidInputError, match="computed_tokens"):
        received_blocks(group, ids, 4, 250, 16, 250)


def test_spans_and_failures_are_told_in_the_engines_blocks() -> None:
    kinds = [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]
    spans = (
        BlockSpan(GroupId(0), 2, (BlockId(5), BlockId(9))),
        BlockSpan(GroupId(1), 0, (BlockId(4),)),
    )
    full, state = sub_spans(spans, kinds, 2)
    assert (full.first_block, full.block_ids) == (4, (10, 11, 18, 19))
    assert state == spans[1]
    done = PullDone("r", PullStatus.PARTIAL, {0: (5,)}, 48, 0, 0.0)
    # Registered sub-pages of 16 tokens, 2 per block: token 48 is sub-page 3 (block 1),
    # failed sub-page 5 is block 2.
    assert load_errors(done, [[7, 8, 9, 10]], 16, 32) == {8, 9}
    # Registered 64-token staging pages into 16-token blocks: token 48 is block 3, and
    # failed staging page 1 (tokens 64..127) fails blocks 4 to 7.
    ids = [[10 + i for i in range(9)]]
    failed = PullDone("r", PullStatus.PARTIAL, {0: (1,)}, 48, 0, 0.0)
    assert load_errors(failed, ids, 64, 16) == {13, 14, 15, 16, 17}
    # A local prefix of 32 tokens (blocks 10, 11), pulled from prefill block 0, which
    # failed: vLLM resumes at the prefix's end, and never hears of the blocks it shares.
    lost = PullDone("r", PullStatus.FAILED, {0: (0,)}, 0, 0, 0.0)
    assert load_errors(lost, ids, 64, 16, computed_tokens=32) == {12, 13}


def _plain(block: int, window: int | None = None, blocks: int = 64) -> KVCacheConfig:
    page = HEADS * block * 2 * SIZE * 2
    spec = (
        FullAttentionSpec(block, page)
        if window is None
        else SlidingWindowSpec(block, page, sliding_window=window)
    )
    layers = ["model.layers.0.self_attn.attn"]
    return KVCacheConfig(
        blocks, [KVCacheTensor(page * blocks, layers, page * blocks, page)],
        [KVCacheGroupSpec(layers, spec)],
    )  # fmt: skip


def test_the_decode_registers_what_a_prefill_of_the_smaller_size_registers() -> None:
    small = layout_from_vllm(_plain(32, blocks=256), buffer="p", base_offset=0, model="m",
                             kernels=["vec:abc"])  # fmt: skip
    big = layout_from_vllm(_plain(128), buffer="d", base_offset=64, model="m",
                           kernels=["vec:abc"], reblock=4)  # fmt: skip
    assert big.fingerprint == small.fingerprint and big.block_size == 32
    region = big.regions[0]
    assert (region.num_blocks, region.stride_bytes, region.block_bytes) == (256, 2048, 2048)
    alone = layout_from_vllm(
        _plain(128), buffer="d", base_offset=64, model="m", kernels=["vec:abc"]
    )
    assert alone.fingerprint != small.fingerprint  # without it, the sizes differ
    gemma = layout_from_vllm(gemma3_config(), buffer="g", base_offset=0, model="g", reblock=4)
    assert [big_g.block_size for big_g in gemma.groups] == [32, 32]
    assert gemma.region_map["model.layers.0.self_attn.attn"].num_blocks == 4 * 16384


def test_pages_that_are_not_whole_sub_pages_are_refused() -> None:
    config = _plain(64)
    padded = KVCacheConfig(
        config.num_blocks,
        [KVCacheTensor(1 << 20, config.kv_cache_groups[0].layer_names, 1 << 14, 8192)],
        config.kv_cache_groups,
    )
    with pytest.raises(LayoutError, match="bytes apart"):
        layout_from_vllm(padded, buffer="d", base_offset=0, model="m", reblock=2)
    with pytest.raises(LayoutError, match="does not split"):
        layout_from_vllm(_plain(64), buffer="d", base_offset=0, model="m", reblock=3)


@pytest.mark.parametrize(
    ("value", "role", "match"),
    [
        ("32", "kv_consumer", "positive integer"),
        (True, "kv_consumer", "positive integer"),
        (0, "kv_consumer", "positive integer"),
        (32, "kv_producer", "only a decode"),
    ],
)
def test_a_prefill_block_size_that_cannot_work_is_refused_naming_the_field(
    value: object, role: str, match: str
) -> None:
    with pytest.raises(InvalidInputError, match=match) as caught:
        reblock_ratio({"prefill_block_size": value}, role, _plain(128), True)
    assert caught.value.field == "kv_connector_extra_config.prefill_block_size"


def test_the_ratio_and_state_groups() -> None:
    assert reblock_ratio({}, "kv_producer", _plain(128), True).grow == 1
    assert reblock_ratio({"prefill_block_size": 128}, "kv_both", _plain(128), True).grow == 1
    assert reblock_ratio({"prefill_block_size": 32}, "kv_consumer", _plain(128), True).grow == 4
    smaller = reblock_ratio({"prefill_block_size": 256}, "kv_consumer", _plain(64), True)
    assert (smaller.grow, smaller.staged, smaller.unit) == (1, True, (1, 4))
    # Sizes that do not nest are staged, either way: lcm(96, 64) = 192 tokens, three
    # prefill pages into two decode blocks, or the reverse.
    for value, own, unit in ((96, 64, (2, 3)), (64, 96, (3, 2)), (48, 128, (8, 3))):
        odd = reblock_ratio({"prefill_block_size": value}, "kv_consumer", _plain(own), True)
        assert (odd.grow, odd.staged, odd.nests, odd.unit) == (1, True, False, unit)
    same = reblock_ratio({}, "kv_consumer", _plain(64), True)
    assert not same.staged and same.grow == 1
    assert smaller.differs and not same.differs
    hybrid = _plain(128)
    hybrid.kv_cache_groups.append(
        KVCacheGroupSpec(["model.layers.1.linear_attn"], MambaSpec(128, 4096))
    )
    # A state page is one request's state whatever the block size: it moves whole.
    assert reblock_ratio({"prefill_block_size": 32}, "kv_consumer", hybrid, True).grow == 4


def test_a_window_with_prefix_caching_is_refused_and_recomputes_whole() -> None:
    """The decode page where a window starts arrives in part (zeros before what moved):
    vLLM's prefix cache would hand it to a later request as whole, and a resume at its
    start would read them."""
    window = _plain(128, window=48)
    with pytest.raises(InvalidInputError, match="prefix caching") as caught:
        reblock_ratio({"prefill_block_size": 32}, "kv_consumer", window, True)
    assert caught.value.field == "kv_connector_extra_config.prefill_block_size"
    assert reblock_ratio({"prefill_block_size": 32}, "kv_consumer", window, False).grow == 4
    assert (
        reblock_ratio({"prefill_block_size": 32}, "kv_consumer", gemma3_config(), False).grow == 4
    )
    with pytest.raises(InvalidInputError, match="sliding_window"):
        reblock_ratio({"prefill_block_size": 32}, "kv_consumer", gemma3_config(), True)
    # Sizes that do not nest: a decode block may straddle the window's first prefill block.
    for value, own in ((96, 64), (64, 96)):
        with pytest.raises(InvalidInputError, match="prefix caching"):
            reblock_ratio({"prefill_block_size": value}, "kv_consumer", _plain(own, 48), True)
        reblock_ratio({"prefill_block_size": value}, "kv_consumer", _plain(own, 48), False)
    # Smaller decode blocks each lie in one prefill block: whole or not there at all.
    assert reblock_ratio({"prefill_block_size": 128}, "kv_consumer", _plain(32, 48), True).staged
    full, sliding = [GroupKind.FULL_ATTENTION], [GroupKind.SLIDING_WINDOW]
    assert resumable(full, False) and resumable(sliding, True)
    assert not resumable(sliding, False)  # vLLM would resume where its window did not move
    assert not resumable([GroupKind.SLIDING_WINDOW, GroupKind.FULL_ATTENTION], True)
    # Staged 64 -> 32, window 301, 400 tokens: vLLM's null blocks end at token 96, the
    # pull staged prefill block 1 (tokens 64..127) and block 6 failed. The sidecar counts
    # 384 tokens valid, yet tokens 84..95 of that window had no decode block to land in.
    done = PullDone("r", PullStatus.PARTIAL, {0: (6,)}, 384, 0, 0.0)
    ids = [[0, 0, 0, *range(103, 116)]]
    assert load_errors(done, ids, 64, 32) == {112, 113}  # what it would resume at, so:
    assert not resumable(sliding, False)  # 64 -> 32 is not one size: recomputed whole


def test_a_hybrid_decode_splits_its_attention_pages_and_keeps_its_state_pages() -> None:
    state_page = 3 * 32768
    layers = ["model.layers.0.linear_attn", "model.layers.1.self_attn.attn"]
    config = KVCacheConfig(
        100, [KVCacheTensor(state_page * 100, layers, state_page * 100, state_page)],
        [KVCacheGroupSpec(layers[1:], FullAttentionSpec(320, state_page)),
         KVCacheGroupSpec(layers[:1], MambaSpec(1024, state_page, state_bytes=68608))],
    )  # fmt: skip
    layout = layout_from_vllm(config, buffer="d", base_offset=0, model="q", reblock=2)
    attention, state = layout.region_map[layers[1]], layout.region_map[layers[0]]
    assert (attention.num_blocks, attention.block_bytes) == (200, state_page // 2)
    assert (state.num_blocks, state.stride_bytes, state.block_bytes) == (100, state_page, 68608)
    assert [layout.block_size_of(g) for g in layout.groups] == [160, 1024]
    kinds = [GroupKind.FULL_ATTENTION, GroupKind.MAMBA]
    spans = sub_spans(
        (BlockSpan(GroupId(0), 0, (BlockId(7),)), BlockSpan(GroupId(1), 0, (BlockId(9),))), kinds, 2
    )
    assert [s.block_ids for s in spans] == [(14, 15), (9,)]


def test_a_decode_without_the_setting_is_refused_and_told_what_to_set() -> None:
    prefill = layout_from_vllm(_plain(32, blocks=256), buffer="p", base_offset=0, model="m")
    decode = layout_from_vllm(_plain(64, blocks=128), buffer="d", base_offset=0, model="m")
    with pytest.raises(NegotiationError) as caught:
        negotiate(decode, prefill)
    assert "layout.groups[0].block_size" in str(caught.value)
    assert "prefill_block_size" in block_size_hint(caught.value, False)
    assert block_size_hint(caught.value, True) == ""  # set already: the hint would mislead
    reblocked = layout_from_vllm(_plain(64, blocks=128), buffer="d", base_offset=0, model="m",
                                 reblock=2)  # fmt: skip
    assert negotiate(reblocked, prefill).block_size == 32


# ---- smaller decode blocks: staging pages -------------------------------------------


def test_staging_pages_hold_the_longest_request_or_are_refused() -> None:
    # Default: max_model_len tokens in pages of the prefill's size, one spare, per group.
    assert staging_pages({}, 1000, 128, 2) == (8 + 1) * 2
    assert staging_pages({"staging_tokens": 4096}, 1000, 128, 1) == 33
    for bad in (0, "4096", True, 999):
        with pytest.raises(InvalidInputError) as caught:
            staging_pages({"staging_tokens": bad}, 1000, 128, 1)
        assert caught.value.field == "kv_connector_extra_config.staging_tokens"
    pool = StagingPool(4)
    first = pool.take(3)
    assert first == [0, 1, 2] and pool.take(2) is None and pool.free == 1
    pool.give(first)
    # The least recently given back come first: a late write lands in an idle page.
    assert pool.take(4) == [3, 0, 1, 2] and pool.free == 0


@pytest.mark.parametrize(
    ("source", "block", "decode_kernel"),
    [(32, 16, transposed), (64, 16, rows), (48, 32, transposed), (32, 48, rows),
     (80, 48, transposed), (16, 16 * 3, rows)],
)  # fmt: skip
@pytest.mark.parametrize("case", ["prefix", "window"])
def test_staged_prefill_pages_are_laid_out_into_the_decode_blocks(
    source: int, block: int, decode_kernel: KernelWrite, case: str
) -> None:
    """Prefill pages (K transposed) staged whole, then laid out into the decode's blocks
    wherever vLLM put them, lcm(source, block) tokens at a time, equal the decode kernel
    writing the same KV itself: r times smaller blocks, and sizes that do not nest. A
    decode block computed here, or holding no staged token, is left alone; a decode
    block's tokens from a prefill block that did not move (before a window) are zeros."""
    tokens = 3 * source + 5
    gen = torch.Generator().manual_seed(source * block)
    kv = torch.randn(tokens, 2, HEADS, SIZE, generator=gen).to(torch.bfloat16)
    count, pulled_end = -(-tokens // block), -(-tokens // source)
    prefill = torch.zeros(pulled_end, HEADS, source, 2 * SIZE, dtype=torch.bfloat16)
    write(transposed, prefill, kv, 0)
    # What moved: from the prefill block holding the first token not computed here (a
    # prefix of one decode block), or from prefill block 2 on (a window).
    computed = block if case == "prefix" else 0
    first = computed // source if case == "prefix" else 2
    pages = list(range(2 * (pulled_end - first), 0, -2))  # staging pages, in no order
    # Pages no pull took hold what an earlier one left.
    stage = torch.full((2 * pulled_end + 1, HEADS, source, 2 * SIZE), 5.0, dtype=torch.bfloat16)
    for k, page in enumerate(pages):
        stage[page] = prefill[first + k]
    ids = list(range(count + 20, 20, -1))  # decode blocks, in no order
    decode = torch.full((count + 21, HEADS, block, 2 * SIZE), float("nan"), dtype=torch.bfloat16)
    rows_, run = kernel_rows(transposed, decode_kernel, heads=HEADS, source_block=source,
                             target_block=block, size=SIZE, dtype=torch.bfloat16)  # fmt: skip
    group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, (decode,), rows_, run, (stage,))
    sources, targets = staged_units(ids, pages, first, source, block, tokens, computed, tokens)
    for _ in unstage_steps(group, sources, targets):
        pass
    # The oracle, token by token: the KV of every token that moved, zeros elsewhere.
    moved = torch.zeros(count * block, dtype=torch.bool)
    moved[first * source : tokens] = True
    padded = torch.zeros(count * block, 2, HEADS, SIZE, dtype=kv.dtype)
    padded[:tokens] = kv
    padded[~moved] = 0
    want = torch.zeros_like(decode)
    for i, b in enumerate(ids):
        write(decode_kernel, want, padded[i * block : (i + 1) * block], b * block)
        laid = i >= computed // block and bool(moved[i * block : (i + 1) * block].any())
        if laid:
            assert torch.equal(decode[b], want[b]), (i, b)
        else:
            assert decode[b].isnan().all(), (i, b)
    assert sorted(int(t) for t in targets.reshape(-1) if t >= 0) == sorted(
        b
        for i, b in enumerate(ids)
        if i >= computed // block and bool(moved[i * block : (i + 1) * block].any())
    )
    # A partial pull: vLLM recomputes from the block holding valid token 40 on.
    _, targets = staged_units(ids, pages, first, source, block, tokens, computed, 40)
    assert sorted(int(t) for t in targets.reshape(-1) if t >= 0) == sorted(
        b
        for i, b in enumerate(ids[: 40 // block])
        if i >= computed // block and bool(moved[i * block : (i + 1) * block].any())
    )


_ROWS: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}


@given(
    source=st.sampled_from([16, 32, 48, 64, 80, 96]),
    block=st.sampled_from([16, 32, 48, 64, 96, 128]),
    data=st.data(),
)
def test_staged_units_lay_out_every_moved_token_and_nothing_else(
    source: int, block: int, data: st.DataObject
) -> None:
    """Against a token-by-token oracle, for any pair of sizes, prompt, local prefix, first
    prefill block moved (a window), valid tokens and null blocks: a decode block is
    written exactly when it is past the prefix, before the resume point, not null and
    holds a moved token; every token it holds is then that token's KV, or zeros where
    its prefill block did not move or it lies past the prompt."""
    tokens = data.draw(st.integers(1, 5 * max(source, block)), label="tokens")
    computed = block * data.draw(st.integers(0, (tokens - 1) // block), label="computed blocks")
    last = -(-tokens // source)
    first = data.draw(st.integers(computed // source, last - 1), label="first moved")
    valid = data.draw(st.sampled_from([tokens, data.draw(st.integers(0, tokens))]), label="valid")
    count = -(-tokens // block)
    nulls = data.draw(st.integers(0, first * source // block), label="null blocks")
    ids = [0] * nulls + list(range(2 * count, 2 * count - (count - nulls), -1))
    pages = data.draw(st.permutations(range(2 * (last - first))), label="pages")[: last - first]
    # Every element of every token's key and value its own number (float32 holds them
    # exactly): a token, K and V, a head or a dimension out of place shows.
    kv = torch.arange(1, last * source * 2 * HEADS * SIZE + 1, dtype=torch.float32)
    kv = kv.view(-1, 2, HEADS, SIZE)
    kv[tokens:] = 0
    prefill = torch.zeros(last, HEADS, source, 2 * SIZE)
    write(rows, prefill, kv, 0)
    stage = torch.full((2 * (last - first), HEADS, source, 2 * SIZE), -5.0)
    for k, page in enumerate(pages):
        stage[page] = prefill[first + k]
    decode = torch.full((2 * count + 1, HEADS, block, 2 * SIZE), -7.0)
    key = (source, block)
    if key not in _ROWS:
        _ROWS[key] = kernel_rows(rows, transposed, heads=HEADS, source_block=source,
                                 target_block=block, size=SIZE, dtype=torch.float32)  # fmt: skip
    group = GroupRepack(GroupKind.FULL_ATTENTION, None, None, (decode,), *_ROWS[key], (stage,))
    sources, targets = staged_units(ids, pages, first, source, block, tokens, computed, valid)
    for _ in unstage_steps(group, sources, targets):
        pass
    end = count if valid >= tokens else valid // block
    moved = torch.zeros(count * block, dtype=torch.bool)
    moved[first * source : last * source] = True
    want = kv.new_zeros(count * block, 2, HEADS, SIZE)
    want[: min(tokens, count * block)] = kv[: min(tokens, count * block)]
    want[~moved] = 0
    written = set()
    for i, b in enumerate(ids):
        span = slice(i * block, (i + 1) * block)
        if computed // block <= i < end and b != 0 and bool(moved[span].any()):
            written.add(b)
            got = torch.zeros(1, HEADS, block, 2 * SIZE)
            write(transposed, got, want[span].contiguous(), 0)
            assert torch.equal(decode[b], got[0]), (i, b)
    untouched = [b for b in range(len(decode)) if b not in written]
    assert bool((decode[untouched] == -7.0).all())
    assert sorted(int(t) for t in targets.reshape(-1) if t >= 0) == sorted(written)


def test_the_decode_registers_staging_pages_as_a_prefill_of_the_larger_size_does() -> None:
    big = layout_from_vllm(_plain(128, blocks=64), buffer="p", base_offset=0, model="m",
                           kernels=["vec:abc"])  # fmt: skip
    config = _plain(32, blocks=256)
    layers = attention_layers(config)
    staging = Staging("stage", 4096, 10, 128, 8192, layers)
    small = layout_from_vllm(config, buffer="d", base_offset=0, model="m", kernels=["vec:abc"],
                             staging=staging)  # fmt: skip
    assert small.fingerprint == big.fingerprint and small.block_size == 128
    region = small.regions[0]
    assert (region.buffer, region.offset_bytes, region.num_blocks) == ("stage", 4096, 10)
    assert region.stride_bytes == region.block_bytes == 8192
    spans = staged_spans((BlockSpan(GroupId(0), 4, (BlockId(9),)),), {0: (1, [7, 2])})
    assert (spans[0].first_block, spans[0].block_ids) == (1, (7, 2))
