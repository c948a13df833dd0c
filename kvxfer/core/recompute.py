"""Where an engine can resume after a partly failed pull (docs/planning.md, The rules).

`valid_tokens` is the largest s with C <= s <= N such that, for every group
at once, the KV the engine needs to continue from s is valid:

- full_attention and mla need tokens [0, s);
- sliding_window needs tokens [max(0, s-W+1), s);
- chunked_local needs tokens [floor(s/S)*S, s) (the tokens of s's own chunk);
- mamba needs its state at exactly s: at C (held locally) or at N (moved, not failed).

Valid KV is what the destination held before the pull (what its own next
step at C reads: [0, C) for full attention, [max(0, C-W+1), C) for sliding
window, [floor(C/S)*S, C) for chunked local) plus the moved blocks that did
not fail. s = C always qualifies. Work is proportional to the number of
failed blocks, not to N.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence

from kvxfer._exceptions import PlanError
from kvxfer.core.layout import GroupKind, KVGroup, group_block_size
from kvxfer.core.planner import check_groups_request, group_blocks

Intervals = list[tuple[int, int]]  # sorted, disjoint, non-adjacent half-open [a, b)


def valid_tokens(
    groups: Sequence[KVGroup],
    num_tokens: int,
    computed_tokens: int,
    block_size: int,
    failed: Mapping[int, Collection[int]],
    moved_from: Mapping[int, int] | None = None,
) -> int:
    """The token the engine resumes from: it recomputes [result, N).

    `block_size` is the layout's; a group with its own `block_size` uses that. The
    blocks are the reader's. `moved_from` gives, for a group whose source has another
    block size, the first token that moved (`GroupPlan.tokens`): the reader's first
    moved block may then hold valid KV only from that token on."""
    check_groups_request(groups, num_tokens, computed_tokens, block_size)
    _check_failed(groups, num_tokens, computed_tokens, block_size, failed)
    if not any(failed.values()):
        return num_tokens
    resume = num_tokens
    local: list[tuple[KVGroup, Intervals]] = []
    for group in groups:
        if group.kind is GroupKind.MAMBA:
            if failed.get(group.group_id):
                return computed_tokens
            continue
        size = group_block_size(group, block_size)
        first = (moved_from or {}).get(group.group_id, 0)
        valid = _valid(group, num_tokens, computed_tokens, size, failed.get(group.group_id), first)
        if group.kind in (GroupKind.FULL_ATTENTION, GroupKind.MLA):
            resume = min(resume, _first_invalid(valid, num_tokens))
        else:
            local.append((group, valid))
    resume = _settle_windows(resume, computed_tokens, local)
    has_mamba = any(g.kind is GroupKind.MAMBA for g in groups)
    if resume <= computed_tokens or (has_mamba and resume < num_tokens):
        return computed_tokens
    return resume


def _check_failed(
    groups: Sequence[KVGroup],
    num_tokens: int,
    computed_tokens: int,
    block_size: int,
    failed: Mapping[int, Collection[int]],
) -> None:
    by_id: dict[int, KVGroup] = {g.group_id: g for g in groups}
    for group_id, blocks in failed.items():
        group = by_id.get(group_id)
        if group is None:
            raise PlanError("failed_blocks", f"unknown group {group_id}")
        moved = group_blocks(
            group, num_tokens, computed_tokens, group_block_size(group, block_size)
        )
        stray = sorted(b for b in blocks if b not in moved)
        if stray:
            raise PlanError(
                f"failed_blocks[{group_id}]", f"blocks {stray[:8]} were not part of the transfer"
            )


def _valid(
    group: KVGroup,
    num_tokens: int,
    computed_tokens: int,
    block_size: int,
    failed: Collection[int] | None,
    first_moved: int = 0,
) -> Intervals:
    """Token intervals of this group holding valid KV after the pull."""
    held_from = _reach_start(group, computed_tokens)
    pieces: Intervals = [(held_from, computed_tokens)] if computed_tokens > held_from else []
    moved = group_blocks(group, num_tokens, computed_tokens, block_size)
    start = moved.start
    for block in [*sorted(set(failed or ())), moved.stop]:
        if block > start:
            lo = max(start * block_size, first_moved)
            pieces.append((lo, min(block * block_size, num_tokens)))
        start = block + 1
    return _merge(pieces)


def _reach_start(group: KVGroup, position: int) -> int:
    """First cached token the step at `position` reads in this attention group."""
    if group.kind is GroupKind.SLIDING_WINDOW:
        assert group.sliding_window is not None
        return max(0, position - group.sliding_window + 1)
    if group.kind is GroupKind.CHUNKED_LOCAL:
        assert group.chunk_size is not None
        return position // group.chunk_size * group.chunk_size
    return 0


def _merge(pieces: Intervals) -> Intervals:
    merged: Intervals = []
    for a, b in sorted(pieces):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def _first_invalid(valid: Intervals, num_tokens: int) -> int:
    """First token of [0, N) without valid KV (N if there is none)."""
    if valid and valid[0][0] == 0:
        return min(valid[0][1], num_tokens)
    return 0


def _last_invalid(valid: Intervals, lo: int, hi: int) -> int | None:
    """Largest token t in [lo, hi) without valid KV, or None."""
    if hi <= lo:
        return None
    starts = [a for a, _ in valid]
    i = bisect.bisect_right(starts, hi - 1) - 1
    if i < 0 or valid[i][1] <= hi - 1:
        return hi - 1  # hi-1 itself is not covered
    candidate = valid[i][0] - 1  # intervals are non-adjacent, so this one is invalid
    return candidate if candidate >= lo else None


def _settle_windows(resume: int, floor: int, local: Sequence[tuple[KVGroup, Intervals]]) -> int:
    """Lower `resume` until the reach of every sliding-window and chunked group before
    it is whole.

    If the reach [lo(s), s) holds an invalid token t, no s' in (t, s] can work: a
    window [s'-W+1, s') and a chunk [floor(s'/S)*S, s') (s' is in s's chunk, as
    t is) hold t as well. So the next candidate is t itself.
    """
    changed = True
    while changed and resume > floor:
        changed = False
        for group, valid in local:
            bad = _last_invalid(valid, _reach_start(group, resume), resume)
            if bad is not None:
                resume, changed = bad, True
    return resume
