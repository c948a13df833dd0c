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

from kvxfer.core.requests import PullDone, PullStatus
from kvxfer.core.tp_map import request_valid_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NUM_TOKENS = 70  # 5 blocks of 16, the last one partly filled


def _assemble(
    image: DecodeImage,
    decode: EngineSim,
    prefill: list[EngineSim],
    src_ids: list[int],
    dst_ids: list[int],
) -> int:
    """Check every moved decode block holds, head by head, the serving prefill rank's
    bytes of each token; record the blocks for the whole-buffer check. Returns bytes."""
    layout = decode.layout
    checked = 0
    for group in layout.groups:
        heads = group.num_kv_heads
        assert heads is not None
        mine = oracle_rank_heads(heads, layout.tp_size, layout.tp_rank)
        src_tp = prefill[0].layout.tp_size
        size = layout.block_size
        moved = oracle_moved_tokens(group, NUM_TOKENS, 0, size, size)
        for tensor in group.tensors:
            dst_token = tensor.bytes_per_block // size
            head = dst_token // len(mine)
            for logical in sorted({t // size for t in moved}):
                want = decode.pattern_block(tensor.name, dst_ids[logical])
                for h in mine:
                    rank = oracle_head_server(heads, src_tp, h, layout.tp_rank)
                    theirs = oracle_rank_heads(heads, src_tp, rank)
                    source = prefill[rank].block(tensor.name, src_ids[logical])
                    if layout.head_major:  # head h: every token of the block, together
                        whole = head * size
                        s, d = theirs.index(h) * whole, mine.index(h) * whole
                        want[d : d + whole] = source[s : s + whole]
                        checked += whole
                        continue
                    src_token = head * len(theirs)
                    for t in range(logical * size, (logical + 1) * size):
                        s = t % size * src_token + theirs.index(h) * head
                        d = t % size * dst_token + mine.index(h) * head
                        want[d : d + head] = source[s : s + head]
                        checked += head
                got = decode.block(tensor.name, dst_ids[logical])
                assert np.array_equal(got, want), f"{tensor.name} block {logical} differs"
                image.written[(tensor.name, dst_ids[logical])] = want
    return checked


@pytest.mark.parametrize(
    ("model", "order"),
    [
        ("llama-3.1-8b", "token-major"),
        ("gpt-oss-20b", "token-major"),
        # vLLM's CPU pages: each head's bytes for every token of the block together.
        ("gpt-oss-20b", "head-major"),
    ],
)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
async def test_decode_ranks_read_their_heads_from_every_prefill_rank(
    tmp_path: Path, model: str, order: str, prefill_tp: int, decode_tp: int
) -> None:
    major = ("--head-major",) if order == "head-major" else ()
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d")
    procs = [p, d]
    try:
        prefill, decode = [], []
        for rank in range(prefill_tp):
            tp = ("--tp-size", str(prefill_tp), "--tp-rank", str(rank), "--seed", str(rank + 1))
            prefill.append(start_engine(tmp_path, p, model, "prefill", *tp, *major, num_blocks=16))
        for rank in range(decode_tp):
            tp = ("--tp-size", str(decode_tp), "--tp-rank", str(rank), "--seed", str(rank + 7))
            decode.append(start_engine(tmp_path, d, model, "decode", *tp, *major, num_blocks=16))
        assert all(e.layout.head_major == bool(major) for e in prefill + decode)
        procs += prefill + decode
        groups = range(len(prefill[0].layout.groups))
        src_ids, dst_ids = [3, 4, 5, 9, 2], [8, 1, 2, 3, 11]
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
