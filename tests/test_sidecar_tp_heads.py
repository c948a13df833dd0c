"""Different tensor-parallel sizes, end to end: engine-sim ranks on both sides, real
sidecar processes, real NIXL. A decode rank reads its KV heads from every prefill
rank holding them (one pull per source rank, each with that rank's params), and a
prefill rank may serve several decode ranks (one publication per reader).

Every decode byte is checked head by head and token by token against the oracle
(tests/oracle.py): which heads each rank holds and which rank serves each, written
independently of kvxfer/core/tp_map.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from oracle import oracle_head_server, oracle_moved_tokens, oracle_rank_heads
from sidecars import DecodeImage, EngineSim, engine_link, spans, start_engine, start_sidecar

from kvxfer.cli.main import ORDER_FLAGS
from kvxfer.core.requests import PullDone, PullStatus
from kvxfer.core.tp_map import request_valid_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NUM_TOKENS = 70  # 5 blocks of 16, the last one partly filled


def place(engine: EngineSim, held: int, head: int, token: int, local: int) -> int:
    """Byte of (token, local head) inside one of `engine`'s blocks, from its order's
    definition: token-major [block][held][head], head-major [held][block][head] (with
    equal block sizes a head-major block in an engine's own order moves whole heads, so
    placing its rows as HND does checks the same bytes)."""
    size, row = engine.layout.block_size, token % engine.layout.block_size
    if engine.layout.head_major:
        return (local * size + row) * head
    return (row * held + local) * head


def _assemble(
    image: DecodeImage,
    decode: EngineSim,
    prefill: list[EngineSim],
    src_ids: list[int],
    dst_ids: list[int],
) -> int:
    """Check every moved decode block holds, head by head and token by token, the
    serving prefill rank's bytes; record the blocks for the whole-buffer check.
    Returns bytes."""
    layout = decode.layout
    src_tp, src_size = prefill[0].layout.tp_size, prefill[0].layout.block_size
    size = layout.block_size
    checked = 0
    for group in layout.groups:
        heads = group.num_kv_heads
        assert heads is not None
        mine = oracle_rank_heads(heads, layout.tp_size, layout.tp_rank)
        moved = oracle_moved_tokens(group, NUM_TOKENS, 0, src_size, size)
        for tensor in group.tensors:
            head = tensor.bytes_per_block // size // len(mine)
            for logical in sorted({t // size for t in moved}):
                want = decode.pattern_block(tensor.name, dst_ids[logical])
                for h in mine:
                    rank = oracle_head_server(heads, src_tp, h, layout.tp_rank)
                    theirs = oracle_rank_heads(heads, src_tp, rank)
                    for t in sorted(t for t in moved if t // size == logical):
                        source = prefill[rank].block(tensor.name, src_ids[t // src_size])
                        s = place(prefill[rank], len(theirs), head, t, theirs.index(h))
                        d = place(decode, len(mine), head, t, mine.index(h))
                        want[d : d + head] = source[s : s + head]
                        checked += head
                got = decode.block(tensor.name, dst_ids[logical])
                assert np.array_equal(got, want), f"{tensor.name} block {logical} differs"
                image.written[(tensor.name, dst_ids[logical])] = want
    return checked


@pytest.mark.parametrize(
    ("model", "orders", "sizes", "tps"),
    [
        ("llama-3.1-8b", ("token-major",) * 2, (16, 16), (1, 2)),
        ("llama-3.1-8b", ("token-major",) * 2, (16, 16), (2, 1)),
        ("gpt-oss-20b", ("token-major",) * 2, (16, 16), (1, 2)),
        ("gpt-oss-20b", ("token-major",) * 2, (16, 16), (2, 1)),
        # vLLM's CPU pages: each head's bytes for every token of the block together.
        ("gpt-oss-20b", ("head-major",) * 2, (16, 16), (1, 2)),
        ("gpt-oss-20b", ("head-major",) * 2, (16, 16), (2, 1)),
        # Blocks ordered differently (token-major against HND), HND of different sizes:
        # one head at a time, at equal TP sizes too.
        ("gpt-oss-20b", ("token-major", "hnd"), (16, 16), (1, 1)),
        ("llama-3.1-8b", ("hnd", "token-major"), (16, 32), (2, 1)),
        ("gpt-oss-20b", ("hnd", "hnd"), (32, 16), (1, 2)),
        ("llama-3.1-8b", ("hnd", "hnd"), (16, 48), (1, 1)),
    ],
)
async def test_decode_ranks_read_their_heads_from_every_prefill_rank(
    tmp_path: Path,
    model: str,
    orders: tuple[str, str],
    sizes: tuple[int, int],
    tps: tuple[int, int],
) -> None:
    prefill_tp, decode_tp = tps
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d")
    procs = [p, d]
    try:
        prefill, decode = [], []
        for rank in range(prefill_tp):
            tp = ("--tp-size", str(prefill_tp), "--tp-rank", str(rank), "--seed", str(rank + 1))
            args = (*tp, "--block-size", str(sizes[0]), *ORDER_FLAGS[orders[0]])
            prefill.append(start_engine(tmp_path, p, model, "prefill", *args, num_blocks=16))
        for rank in range(decode_tp):
            tp = ("--tp-size", str(decode_tp), "--tp-rank", str(rank), "--seed", str(rank + 7))
            args = (*tp, "--block-size", str(sizes[1]), *ORDER_FLAGS[orders[1]])
            decode.append(start_engine(tmp_path, d, model, "decode", *args, num_blocks=16))
        for side, engines in zip(orders, (prefill, decode), strict=True):
            layout = engines[0].layout
            assert (layout.head_major, layout.token_rows) == (side != "token-major", side == "hnd")
        procs += prefill + decode
        groups = range(len(prefill[0].layout.groups))
        src_ids = [3, 4, 5, 9, 2][: -(-NUM_TOKENS // sizes[0])]
        dst_ids = [8, 1, 2, 3, 11][: -(-NUM_TOKENS // sizes[1])]
        src, dst = spans(dict.fromkeys(groups, src_ids)), spans(dict.fromkeys(groups, dst_ids))
        heads = prefill[0].layout.groups[0].num_kv_heads
        assert heads is not None
        for de in decode:
            rank = de.layout.tp_rank
            sources = sorted(
                {
                    oracle_head_server(heads, prefill_tp, h, rank)
                    for h in oracle_rank_heads(heads, decode_tp, rank)
                }
            )
            valid = {}
            async with engine_link(d, de) as (dc, d_events):
                for source in sources:
                    # One publication per (prefill rank, decode rank): each reader its lease.
                    request_id = f"req-p{source}-d{rank}"
                    async with engine_link(p, prefill[source]) as (pc, _):
                        params = await pc.publish(request_id, NUM_TOKENS, src)
                    assert params.tp_rank == source
                    await dc.pull(params, dst, 0)
                for _ in sources:
                    done = await d_events.next()
                    assert isinstance(done, PullDone), done
                    assert done.status is PullStatus.OK, done.reason
                    valid[done.request_id] = done.valid_tokens
            assert request_valid_tokens(dict(enumerate(valid.values()))) == NUM_TOKENS
            image = DecodeImage(de)
            moved = _assemble(image, de, prefill, src_ids, dst_ids)
            assert moved > 0
            image.check_all()
    finally:
        for proc in reversed(procs):
            proc.stop()
