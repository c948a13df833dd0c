"""When a push may post a chunk (server/pushes.py `chunk_ready`), against a token-by-token
oracle: every token the chunk's destination blocks hold must be computed; a state group
waits for the end of the prefill."""

from __future__ import annotations

import itertools

import pytest

from kvxfer.core.layout import GroupId, GroupKind
from kvxfer.core.planner import Chunk
from kvxfer.core.profiles import layout_for_model
from kvxfer.server.pushes import chunk_ready


def _oracle(kind: GroupKind, blocks: range, size: int, n: int, ready: int, final: bool) -> bool:
    if final or ready >= n:
        return True
    if kind is GroupKind.MAMBA:
        return False
    tokens = [t for b in blocks for t in range(b * size, (b + 1) * size) if t < n]
    return all(t < ready for t in tokens)


@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("block_size", [16, 48])
def test_a_chunk_is_ready_once_every_token_it_holds_is(model: str, block_size: int) -> None:
    layout = layout_for_model(model, block_size=block_size)
    n = 5 * block_size - 7  # the last block is partly filled
    last = -(-n // block_size)
    for group, first, count in itertools.product(layout.groups, range(last), (1, 2, 3)):
        blocks = range(first, min(first + count, last))
        if group.kind is GroupKind.MAMBA:
            blocks = range(1)
        chunk = Chunk(GroupId(group.group_id), blocks, (), ())
        size = layout.block_size_of(group)
        for ready, final in itertools.product(range(n + 1), (False, True)):
            want = _oracle(group.kind, blocks, size, n, ready, final)
            got = chunk_ready(chunk, layout, n, ready, final)
            assert got == want, (group.kind, blocks, ready, final)
