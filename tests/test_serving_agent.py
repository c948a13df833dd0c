"""The serving agent dies, the sidecar does not: UCX may abort the process that serves
peers' reads (software RMA over TCP, docs/reliability.md); that process is a child of
the sidecar, which replaces it and keeps its pid, epoch, engines and leases.

Here the child is killed with SIGABRT (what UCX's fatal error handler raises) between
two pulls on one host; the next pull must reload the new agent's metadata and move
every byte. The multi-host tier covers the real triggers (a link down mid-pull, a
frozen and thawed publisher)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from sidecars import (
    DecodeImage,
    engine_link,
    process_tree,
    scrape,
    spans,
    start_engine,
    start_sidecar,
)

from kvxfer.cli.fleet import Proc, metric
from kvxfer.core.requests import PullDone, PullStatus, Released

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"
TOKENS = 160  # ten blocks of 16


async def restarts_reach(sidecar: Proc, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(scrape(sidecar), "kvxfer_serving_agent_restarts_total") < count:
        assert time.monotonic() < deadline, f"no serving agent restart within {timeout_s} s"
        await asyncio.sleep(0.05)


# A terminal's Ctrl-C or hangup, or a SIGTERM to the process group, is the sidecar's to
# act on: none of them may end the serving agent, which ends when the sidecar closes it
# (it ignores them; UCX then takes SIGHUP over for its debug handler).
SIDECARS_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM}


def ignored_signals(pid: int) -> set[int]:
    """The signals that do not act as by default on process `pid` (ignored or caught)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    mask = 0
    for key in ("SigIgn:", "SigCgt:"):
        mask |= int(next(x for x in status if x.startswith(key)).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


async def test_a_dead_serving_agent_is_replaced_and_the_sidecar_keeps_serving(
    tmp_path: Path,
) -> None:
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d")
    pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=32)
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=32)
    image = DecodeImage(de)
    src = spans({g.group_id: range(10) for g in pe.layout.groups})
    try:
        children = process_tree(p.pid)[1:]
        assert len(children) == 1, f"one serving agent process under the sidecar: {children}"
        assert ignored_signals(children[0]) >= SIDECARS_SIGNALS
        async with engine_link(p, pe) as (pc, p_events), engine_link(d, de) as (dc, d_events):
            for request_id, dst_first in (("before", 10), ("after", 20)):
                params = await pc.publish(request_id, TOKENS, src)
                assert params.epoch == p.ready["epoch"], "the prefill sidecar restarted"
                dst = spans(
                    {g.group_id: range(dst_first, dst_first + 10) for g in pe.layout.groups}
                )
                await dc.pull(params, dst, 0)
                done = await d_events.next()
                assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
                assert isinstance(await p_events.next(), Released)
                image.expect_pull(pe, src, dst, TOKENS, 0, {})
                if request_id == "before":
                    os.kill(children[0], signal.SIGABRT)
                    await restarts_reach(p, 1)
        image.check_all()
        assert p.popen.poll() is None, "the sidecar died with its serving agent"
        replaced = process_tree(p.pid)[1:]
        assert len(replaced) == 1 and replaced != children, replaced
        assert ignored_signals(replaced[0]) >= SIDECARS_SIGNALS
    finally:
        for proc in (pe, de, p, d):
            proc.stop()
