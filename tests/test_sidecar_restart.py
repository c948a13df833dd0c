"""The prefill sidecar restarts between two pulls: a new epoch, a fresh handshake, the
stale NIXL agent dropped, params from before the restart refused, and no crash."""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecars import DecodeImage, engine_link, free_port, scrape, spans, start_engine, start_sidecar

from kvxfer.cli.fleet import metric
from kvxfer.core.requests import PullDone, PullStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "qwen3-next-80b-a3b"  # full attention + Mamba-style state groups


async def test_prefill_restart_between_pulls(tmp_path: Path) -> None:
    port = free_port()
    d = start_sidecar(tmp_path, "d")
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=64)
    # Its peer lane on a port of its own each time (as with lane.port 0), so that the
    # old lane port is certain to refuse after the restart.
    lane_ports = (str(free_port()), str(free_port()))
    p = start_sidecar(tmp_path, "p", "--lane.port", lane_ports[0], peer_port=port)
    pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=64)
    image = DecodeImage(de)
    groups = pe.layout.groups

    def blocks(offset: int, state: int) -> dict[int, list[int]]:
        """Ten attention blocks from `offset`; state block `state` for Mamba groups."""
        return {
            g.group_id: [state] if g.kind.value == "mamba" else list(range(offset, offset + 10))
            for g in groups
        }

    try:
        first = blocks(0, 0)
        stale_params = None
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            params = await pc.publish("before", 150, spans(first))
            stale_params = await pc.publish("published-before-restart", 150, spans(first))
            dst = spans(blocks(20, 1))
            await dc.pull(params, dst, 0)
            done = await d_events.next()
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done.reason
            image.expect_pull(pe, spans(first), dst, 150, 0, {})
        old_epoch = p.ready["epoch"]
        pe.stop()
        assert p.stop() == 0
        # The same sidecar id, as a StatefulSet pod gets back its name (KVXFER_SIDECAR_ID).
        p = start_sidecar(tmp_path, "p", "--lane.port", lane_ports[1], peer_port=port)
        pe = start_engine(tmp_path, p, MODEL, "prefill", "--seed", "9", num_blocks=64)
        assert p.ready["epoch"] != old_epoch
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            # Params from the old instance: refused as lost, not read from the new one.
            assert stale_params is not None
            await dc.pull(
                stale_params,
                spans({g: range(30, 40) if len(ids) > 1 else [1] for g, ids in first.items()}),
                0,
            )
            stale = await d_events.next()
            assert isinstance(stale, PullDone) and stale.status is PullStatus.FAILED
            assert "restarted" in stale.reason
            # Its old peer lane port refused; the call went to the peer port, which
            # answers for the peer as it is now.
            assert metric(scrape(d), "kvxfer_peer_lane_unreachable_total") == 1
            params = await pc.publish("after", 150, spans(first))
            dst = spans(blocks(40, 3))
            await dc.pull(params, dst, 0)
            done = await d_events.next()
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done.reason
            image.expect_pull(pe, spans(first), dst, 150, 0, {})
        # The new handshake named the new lane port, and the read after took it.
        begun = metric(scrape(p), "kvxfer_peer_calls_total", method="BeginRead", transport="lane")
        assert begun == 1
        image.check_all()
        samples = scrape(d)
        peer = "p"  # one series across the restart: the label is the peer's identity
        assert metric(samples, "kvxfer_peer_epoch_changes_total", peer=peer) == 1
        assert metric(samples, "kvxfer_handshakes_total", peer=peer, result="ok") == 2
        assert metric(samples, "kvxfer_peer_epoch", peer=peer) == float(p.ready["epoch"])
    finally:
        for proc in (pe, p, de, d):
            proc.stop()
