"""A decode sidecar forgets the peer addresses no transfer used for transfer.idle_agent_s.

Prefill pods come back under new addresses; a long-lived decode sidecar kept a link,
a loaded NIXL agent, a gRPC channel and a lane for every one that ever existed
(server/peers.py, `PeerLinks.forget_idle`). Real sidecar processes on loopback with
`transfer.idle_agent_s` 1: after a pull the prefill address is forgotten (ListPeers,
`kvxfer_peers`, the log), and the next pull handshakes again and moves the right
bytes; a pull held in BeginRead by a frozen publisher keeps its address past the idle
time; a publisher that restarts (same address, new epoch) while its address is
forgotten is counted as restarted once when linked again (under its own label, or
under `other` when another peer took the only one), and not again when it comes back
with the epoch it had. Then a real `Sidecar` in this process (real NIXL agents,
serving agent and gRPC), where a pull arrives while the address is being forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
from sidecars import (
    DecodeImage,
    EngineSim,
    Events,
    engine_link,
    free_port,
    freeze,
    in_process_sidecar,
    prefill_beside_cache,
    pump,
    scrape,
    spans,
    start_engine,
    start_sidecar,
    thaw,
)

from kvxfer.cli.fleet import Proc, metric
from kvxfer.client.engine import EngineClient
from kvxfer.core.requests import EngineEvent, PullDone, PullStatus, Released
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gpt-oss-20b"
TOKENS = 64  # 4 blocks of 16
IDLE = ("--transfer.idle-agent-s", "1")
FORGET_WAIT_S = 10.0  # idle 1 s, looked for every 0.25 s: ample on a loaded machine
FROZEN_S = 3.0  # the publisher stays frozen three idle times with a pull in BeginRead


def blocks_at(first: int) -> list:
    ids = list(range(first, first + 4))
    return spans({0: ids, 1: ids})


async def peers_of(sidecar: Proc) -> list[pb.PeerInfo]:
    """The sidecar's links, as `kvxfer-cli peers` lists them (AdminService.ListPeers)."""
    async with grpc.aio.insecure_channel(sidecar.ready["engine_address"]) as channel:
        admin = pb_grpc.AdminServiceStub(channel)
        return list((await admin.ListPeers(pb.ListPeersRequest(), timeout=5)).peers)


async def forgotten(sidecar: Proc, address: str, timeout_s: float = FORGET_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(peer.address == address for peer in await peers_of(sidecar)):
            return True
        await asyncio.sleep(0.1)
    return False


def handshakes_ok(sidecar: Proc) -> float:
    return metric(scrape(sidecar), "kvxfer_handshakes_total", result="ok")


@contextlib.contextmanager
def pd_pair(
    tmp_path: Path, *decode_flags: str
) -> Iterator[tuple[Proc, EngineSim, Proc, EngineSim]]:
    """A prefill sidecar and engine, a decode sidecar (with `decode_flags`) and engine:
    (p, pe, d, de), stopped on the way out."""
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d", *IDLE, *decode_flags)
    procs = [p, d]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=16)
        procs.append(pe)
        de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=16)
        procs.append(de)
        yield p, pe, d, de
    finally:
        for proc in reversed(procs):
            proc.stop()


async def pull_checked(
    pc: EngineClient, dc: EngineClient, d_events: Events, image: DecodeImage, pe: EngineSim,
    request_id: str, src: int, dst: int,
) -> None:  # fmt: skip
    """Publish a request at prefill blocks `src`.., pull it into decode blocks `dst`..,
    and expect it OK with exactly its bytes (checked by `image.check_all`)."""
    params = await pc.publish(request_id, TOKENS, blocks_at(src))
    await dc.pull(params, blocks_at(dst), 0)
    done = await d_events.next()
    assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
    image.expect_pull(pe, blocks_at(src), blocks_at(dst), TOKENS, 0, {})


async def test_an_idle_peer_is_forgotten_and_linked_again_by_the_next_pull(
    tmp_path: Path,
) -> None:
    with pd_pair(tmp_path) as (p, pe, d, de):
        image, address = DecodeImage(de), p.ready["peer_address"]
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            await pull_checked(pc, dc, d_events, image, pe, "first", 0, 0)
            assert [peer.address for peer in await peers_of(d)] == [address]
            assert metric(scrape(d), "kvxfer_peers") == 1
            assert handshakes_ok(d) == 1

            assert await forgotten(d, address), f"{address} still linked after idle 1 s"
            assert metric(scrape(d), "kvxfer_peers") == 0
            assert f"forgot peer {address}: no transfer used it for 1 s" in d.log_text()

            await pull_checked(pc, dc, d_events, image, pe, "second", 4, 8)
            assert handshakes_ok(d) == 2  # the forgotten address was handshaken again
            assert [peer.address for peer in await peers_of(d)] == [address]
            assert metric(scrape(d), "kvxfer_peers") == 1
        image.check_all()


@pytest.mark.parametrize("label", ["p", "other"])
async def test_a_restart_while_forgotten_is_counted_once_when_linked_again(
    tmp_path: Path, label: str
) -> None:
    """The publisher restarts (same peer address, new epoch) while the decode sidecar
    has its address forgotten: the next pull's handshake counts the restart
    (kvxfer_peer_epoch_changes) and logs both epochs, once; the address forgotten again
    and linked with the same epoch counts nothing more. `other`: the decode sidecar has
    one peer label, which a publisher "q" pulled from first takes; "p" is counted under
    `other`."""
    port = free_port()
    p = start_sidecar(tmp_path, "p", peer_port=port)
    d = start_sidecar(tmp_path, "d", *IDLE, "--limits.max-peer-labels", "1")
    procs: list[Proc | EngineSim] = [p, d]
    try:
        pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=16)
        de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=16)
        procs += [pe, de]
        image, address = DecodeImage(de), p.ready["peer_address"]
        if label == "other":
            q = start_sidecar(tmp_path, "q")
            procs.append(q)
            qe = start_engine(tmp_path, q, MODEL, "prefill", num_blocks=16)
            procs.append(qe)
            async with engine_link(q, qe) as (qc, _), engine_link(d, de) as (dc, d_events):
                await pull_checked(qc, dc, d_events, image, qe, "from-q", 0, 12)
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            await pull_checked(pc, dc, d_events, image, pe, "before", 0, 0)
        assert await forgotten(d, address), f"{address} still linked after idle 1 s"

        old_epoch = p.ready["epoch"]
        pe.stop()
        assert p.stop() == 0
        p = start_sidecar(tmp_path, "p", peer_port=port)  # the same id, as a pod restarted
        procs.append(p)
        pe = start_engine(tmp_path, p, MODEL, "prefill", "--seed", "9", num_blocks=16)
        procs.append(pe)
        new_epoch = p.ready["epoch"]
        assert p.ready["peer_address"] == address and new_epoch != old_epoch

        def restarts() -> float:
            samples = scrape(d)
            total = metric(samples, "kvxfer_peer_epoch_changes_total")
            counted = metric(samples, "kvxfer_peer_epoch_changes_total", peer=label)
            assert counted == total  # under its label, nowhere else
            return counted

        said = f"peer {address} restarted while forgotten (epoch {old_epoch} -> {new_epoch})"
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            await pull_checked(pc, dc, d_events, image, pe, "after", 4, 4)
            assert restarts() == 1
            assert said in d.log_text()
            assert await forgotten(d, address), f"{address} still linked after idle 1 s"
            await pull_checked(pc, dc, d_events, image, pe, "same-epoch", 8, 8)
        assert restarts() == 1
        assert d.log_text().count(f"peer {address} restarted") == 1
        assert handshakes_ok(d) == (3 if label == "p" else 4)
        image.check_all()
    finally:
        for proc in reversed(procs):
            proc.stop()


async def test_an_address_with_pulls_in_flight_is_kept_past_the_idle_time(
    tmp_path: Path,
) -> None:
    """One pull waits in BeginRead at a frozen publisher, a second waits for its running
    slot behind it: neither calls the peer for three idle times, and the address stays
    linked; after the thaw both end OK, and only then is the address forgotten."""
    limits = (
        "--limits.max-inflight-pulls-per-peer", "1",
        "--transfer.rpc-timeout-s", "60",
    )  # fmt: skip
    with pd_pair(tmp_path, *limits) as (p, pe, d, de):
        image, address = DecodeImage(de), p.ready["peer_address"]
        async with engine_link(p, pe) as (pc, p_events), engine_link(d, de) as (dc, d_events):
            await pull_checked(pc, dc, d_events, image, pe, "warm", 0, 0)
            assert isinstance(await p_events.next(), Released)  # its EndRead is done
            published = [await pc.publish(f"q{i}", TOKENS, blocks_at(4 * i)) for i in (1, 2)]
            freeze(p)
            try:
                for i, params in enumerate(published, start=1):
                    await dc.pull(params, blocks_at(4 * i), 0)
                await asyncio.sleep(FROZEN_S)
                kept = await peers_of(d)
            finally:
                thaw(p)
            assert [peer.address for peer in kept] == [address], kept
            assert "forgot peer" not in d.log_text()
            dones = [await d_events.next(timeout_s=60) for _ in published]
            for event in dones:
                assert isinstance(event, PullDone) and event.status is PullStatus.OK, event
                i = int(event.request_id[1:])
                image.expect_pull(pe, blocks_at(4 * i), blocks_at(4 * i), TOKENS, 0, {})
            assert handshakes_ok(d) == 1
            assert await forgotten(d, address), f"{address} still linked after its pulls"
        image.check_all()


async def test_a_pull_during_the_forgetting_handshakes_anew_once_it_is_done(
    tmp_path: Path,
) -> None:
    """The address is forgotten from the decode sidecar's own loop while a Pull arrives:
    its links are gone at once, so the pull handshakes, after the old NIXL agent is
    removed and the channel closed, and reads through a freshly loaded agent."""
    ttl = ("--lease.ttl-s", "60")
    with prefill_beside_cache(tmp_path, "llama-3.1-8b", 16, "forget", *ttl) as (p, pe, kv):
        address, tokens = p.ready["peer_address"], 4 * pe.layout.block_size
        async with (
            in_process_sidecar("d-in-test", *ttl) as d,
            engine_link(p, pe) as (pc, p_events),
        ):
            engine = await d.register_engine(kv.layout, kv.buffers, "decode")
            d_events: asyncio.Queue[EngineEvent] = asyncio.Queue()
            pumping = asyncio.create_task(pump(d.watch(engine.engine_id), d_events))
            try:
                outcomes = []
                for i, request in enumerate(("before", "during")):
                    params = await pc.publish(request, tokens, spans({0: range(4 * i, 4 * i + 4)}))
                    if request == "during":
                        forgetting = asyncio.create_task(d.links.forget_idle(0.0))
                        await asyncio.sleep(0)  # its links are gone; it awaits the removal
                        assert d.links.all() == []
                    await d.pull(engine.engine_id, params, tuple(spans({0: range(4)})), 0)
                    outcomes.append(await asyncio.wait_for(d_events.get(), 30))
                    assert isinstance(await p_events.next(), Released)
                assert await forgetting == 1
            finally:
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pumping
            handshakes = d.metrics.registry.get_sample_value(
                "kvxfer_handshakes_total", {"peer": "p", "result": "ok"}
            )
            (link,) = d.links.all()
            assert link.address == address and not link.stale
    for done in outcomes:
        assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
        assert not done.failed_blocks, done
    assert handshakes == 2
