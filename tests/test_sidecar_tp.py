"""Equal tensor-parallel sizes: each rank registers its own regions with its pod's
sidecar, and decode rank r pulls from prefill rank r."""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecars import DecodeImage, engine_link, spans, start_engine, start_sidecar

from kvxfer.core.requests import PullDone, PullStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"


async def test_decode_rank_r_pulls_from_prefill_rank_r(tmp_path: Path) -> None:
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d")
    procs = [p, d]
    try:
        ranks = []
        for rank in (0, 1):
            tp = ("--tp-size", "2", "--tp-rank", str(rank), "--seed", str(rank))
            pe = start_engine(tmp_path, p, MODEL, "prefill", *tp, num_blocks=32)
            de = start_engine(tmp_path, d, MODEL, "decode", *tp, num_blocks=32)
            procs += [pe, de]
            ranks.append((pe, de))
        assert ranks[0][0].layout.tp_rank == 0 and ranks[1][0].layout.tp_rank == 1
        for rank, (pe, de) in enumerate(ranks):
            src, dst = spans({0: range(8)}), spans({0: range(10, 18)})
            async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
                params = await pc.publish(f"tp-{rank}", 120, src)
                assert params.tp_rank == rank
                await dc.pull(params, dst, 0)
                done = await d_events.next()
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done.reason
            image = DecodeImage(de)
            image.expect_pull(pe, src, dst, 120, 0, {})
            image.check_all()
    finally:
        for proc in reversed(procs):
            proc.stop()
