"""Brute-force, token-level oracles, written independently of kvxfer.core.

They work from the definitions, one token at a time, and share no code with
the planner or the recompute rule: a bug in one is not a bug in both.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from itertools import accumulate

from kvxfer.core.layout import GroupKind, KVGroup


def attended_cached_positions(group: KVGroup, num_tokens: int) -> Sequence[int]:
    """Cached positions the decode step at position N reads in this group."""
    if group.kind is GroupKind.SLIDING_WINDOW:
        window = group.sliding_window
        assert window is not None
        # Position N attends to p with N - p < W, i.e. the W positions ending at N.
        return range(max(0, num_tokens - window + 1), num_tokens)
    if group.kind is GroupKind.CHUNKED_LOCAL:
        chunk = group.chunk_size
        assert chunk is not None
        # Position N attends to the earlier positions of its own chunk, one at a time.
        return [p for p in range(num_tokens) if p // chunk == num_tokens // chunk]
    if group.kind is GroupKind.MLA:
        # An MLA layer's latent stands for K and V of every earlier position.
        return list(range(num_tokens))
    assert group.kind is GroupKind.FULL_ATTENTION, group.kind
    return range(num_tokens)


def own_block_size(group: KVGroup, layout_block_size: int) -> int:
    """A group sized apart from its layout (vLLM's hybrid manager) uses its own size."""
    return layout_block_size if group.block_size is None else group.block_size


def oracle_blocks(group: KVGroup, num_tokens: int, computed: int, block_size: int) -> set[int]:
    """Logical blocks holding at least one needed token the destination lacks."""
    block_size = own_block_size(group, block_size)
    if computed == num_tokens:
        return set()
    if group.kind is GroupKind.MAMBA:
        return {0}
    needed = [p for p in attended_cached_positions(group, num_tokens) if p >= computed]
    return {p // block_size for p in needed}


def oracle_valid_tokens(
    groups: Sequence[KVGroup],
    num_tokens: int,
    computed: int,
    block_size: int,
    failed: Mapping[int, Collection[int]],
) -> int:
    """Try every s from N down to C against a per-token validity map of each group."""
    invalid_prefix: dict[int, list[int]] = {}
    mamba_ok = True
    for group in groups:
        lost = set(failed.get(group.group_id, ()))
        if group.kind is GroupKind.MAMBA:
            mamba_ok = mamba_ok and not lost
            continue
        moved = oracle_blocks(group, num_tokens, computed, block_size)
        valid = bytearray(num_tokens)
        # The destination holds what its own next step at C reads.
        for t in attended_cached_positions(group, computed):
            valid[t] = 1
        for t in range(computed, num_tokens):
            block = t // own_block_size(group, block_size)
            if block in moved and block not in lost:
                valid[t] = 1
        invalid_prefix[group.group_id] = [0, *accumulate(1 - v for v in valid)]

    def invalid_in(group_id: int, lo: int, hi: int) -> int:
        prefix = invalid_prefix[group_id]
        return prefix[hi] - prefix[lo]

    # Walking the tokens: a new chunk of S begins at every S-th token.
    chunk_starts: dict[int, list[int]] = {}
    for group in groups:
        if group.chunk_size is not None and group.chunk_size not in chunk_starts:
            starts = [0]
            for t in range(1, num_tokens + 1):
                starts.append(t if t % group.chunk_size == 0 else starts[-1])
            chunk_starts[group.chunk_size] = starts

    has_mamba = any(g.kind is GroupKind.MAMBA for g in groups)
    for s in range(num_tokens, computed, -1):
        if has_mamba and not (s == num_tokens and mamba_ok):
            continue
        ok = True
        for group in groups:
            if group.kind is GroupKind.FULL_ATTENTION or group.kind is GroupKind.MLA:
                ok = invalid_in(group.group_id, 0, s) == 0
            elif group.kind is GroupKind.SLIDING_WINDOW:
                assert group.sliding_window is not None
                ok = invalid_in(group.group_id, max(0, s - group.sliding_window + 1), s) == 0
            elif group.kind is GroupKind.CHUNKED_LOCAL:
                chunk = group.chunk_size
                assert chunk is not None
                ok = invalid_in(group.group_id, chunk_starts[chunk][s], s) == 0
            if not ok:
                break
        if ok:
            return s
    return computed


def oracle_layer_blocks(
    layers: Sequence[tuple[str, int | None]],
    cache_of: Sequence[int],
    num_tokens: int,
    computed: int,
    block_size: int,
) -> set[tuple[int, int]]:
    """(caching layer, logical block) pairs the step at N reads and the destination lacks.

    Layer i is ("full", None) or ("sliding", W) and reads its KV from layer cache_of[i]'s
    cache (itself, or an earlier layer whose KV it shares). Token by token: layer i reads
    position p when p < N and, if sliding, N - p < W."""
    if computed == num_tokens:
        return set()
    reads: set[tuple[int, int]] = set()
    for layer, (kind, window) in enumerate(layers):
        for p in range(computed, num_tokens):
            if kind == "full" or (window is not None and num_tokens - p < window):
                reads.add((cache_of[layer], p // block_size))
    return reads


def oracle_moved_tokens(
    group: KVGroup, num_tokens: int, computed: int, src_block: int, dst_block: int
) -> set[int]:
    """Tokens a transfer between block sizes src_block and dst_block moves, token by token:
    a token moves when its source block and its destination block each hold a token the
    destination needs (tokens past N-1 ride along inside the last blocks)."""
    if computed == num_tokens:
        return set()
    needed = [p for p in attended_cached_positions(group, num_tokens) if p >= computed]
    src_needed = {p // src_block for p in needed}
    dst_needed = {p // dst_block for p in needed}
    end = num_tokens + max(src_block, dst_block)
    return {t for t in range(end) if t // src_block in src_needed and t // dst_block in dst_needed}


def oracle_valid_tokens_moved(
    groups: Sequence[KVGroup],
    num_tokens: int,
    computed: int,
    block_size: int,
    failed: Mapping[int, Collection[int]],
    moved: Mapping[int, Collection[int]],
) -> int:
    """`oracle_valid_tokens` when exactly the tokens `moved[g]` arrived in group g's
    (destination) blocks that did not fail: a token is valid when the destination held
    it before or it moved in a block that did not fail. Tries every s from N down."""
    has_mamba = any(g.kind is GroupKind.MAMBA for g in groups)
    mamba_ok = not any(failed.get(g.group_id) for g in groups if g.kind is GroupKind.MAMBA)
    valid: dict[int, set[int]] = {}
    for group in groups:
        if group.kind is GroupKind.MAMBA:
            continue
        size = own_block_size(group, block_size)
        lost = set(failed.get(group.group_id, ()))
        held = set(attended_cached_positions(group, computed))
        arrived = {t for t in moved.get(group.group_id, ()) if t // size not in lost}
        valid[group.group_id] = held | arrived
    prefix = {
        gid: [0, *accumulate(int(t not in ok) for t in range(num_tokens))]
        for gid, ok in valid.items()
    }

    def whole(group: KVGroup, s: int) -> bool:
        """Every position the step at s reads in `group` is valid."""
        positions = attended_cached_positions(group, s)
        if isinstance(positions, range) and positions.step == 1:
            counts = prefix[group.group_id]
            return counts[positions.stop] == counts[positions.start]
        return all(p in valid[group.group_id] for p in positions)

    for s in range(num_tokens, computed, -1):
        if has_mamba and not (s == num_tokens and mamba_ok):
            continue
        if all(whole(g, s) for g in groups if g.kind is not GroupKind.MAMBA):
            return s
    return computed


def oracle_rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """Global KV heads rank `rank` of `tp_size` holds, head by head from the definition:
    H >= T gives rank r the heads h with floor(h*T/H) = r; H < T gives every rank one
    head, rank r the head floor(r*H/T) (each head on T/H consecutive ranks)."""
    if num_kv_heads >= tp_size:
        return [h for h in range(num_kv_heads) if h * tp_size // num_kv_heads == rank]
    return [rank * num_kv_heads // tp_size]


def oracle_head_server(num_kv_heads: int, src_tp: int, head: int, reader: int) -> int:
    """The prefill rank decode rank `reader` reads `head` from: of the ranks holding it,
    in rank order, number `reader` mod their count."""
    holders = [p for p in range(src_tp) if head in oracle_rank_heads(num_kv_heads, src_tp, p)]
    return holders[reader % len(holders)]
