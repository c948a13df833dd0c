"""Peer links and their metrics: what a refused, silent or overlapping peer leaves behind.

`PeerLinks` against real gRPC endpoints on loopback: a TCP listener that
accepts and never answers (a hung peer), and real sidecar processes. The NIXL
backend is a fake at its seam that records agents added (a refused peer must
add none); the throughput clock runs on a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import grpc.aio
import pytest
from prometheus_client import generate_latest
from sidecars import engine_link, scrape, spans, start_engine, start_sidecar

from kvxfer._exceptions import DataPlaneError, NegotiationError, PeerUnavailableError
from kvxfer.core.layout import EngineLayout
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.profiles import layout_for_model
from kvxfer.dataplane.adapter import TransferBackend
from kvxfer.server import peers
from kvxfer.server.guard import PeerPortGuard, client_host
from kvxfer.server.lane import LaneContext
from kvxfer.server.metrics import ActiveClock, Metrics
from kvxfer.server.peer_lane import grpc_peer
from kvxfer.server.peers import Dialer, PeerLinks
from kvxfer.server.settings import load_settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.loops import within

MODEL = "gemma-3-4b-it"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_active_seconds_advance_while_pulls_overlap() -> None:
    """Overlapping pulls that never all finish at once: the counter advances anyway."""
    clock = Clock()
    active = ActiveClock(clock)
    active.start()
    clock.now += 5
    active.start()  # a second pull begins before the first ends
    assert active.seconds() == 5
    active.stop()
    clock.now += 3
    assert active.seconds() == 8  # still one in flight: 8 s of wall time so far
    active.stop()
    clock.now += 100  # idle time does not count
    assert active.seconds() == 8


def test_active_seconds_are_exported_at_each_scrape() -> None:
    metrics = Metrics()
    metrics.active.start()
    first = _sample(metrics, "kvxfer_transfer_active_seconds_total")
    time.sleep(0.01)
    assert _sample(metrics, "kvxfer_transfer_active_seconds_total") > first
    metrics.active.stop()


def _sample(metrics: Metrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


class RecordingBackend:
    """The NIXL seam, recording agents added and removed; a test here never transfers."""

    def __init__(self) -> None:
        self.added: list[bytes] = []
        self.removed: list[str] = []

    async def add_peer(self, metadata: bytes) -> str:
        self.added.append(metadata)
        return f"agent-{len(self.added)}"

    async def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)


@pytest.fixture
def hung_peer() -> Iterator[str]:
    """A peer that accepts TCP and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def _links(metrics: Metrics, backend: RecordingBackend, *flags: str) -> PeerLinks:
    settings = load_settings(["--transfer.rpc-timeout-s", "1", *flags], environ={})
    return PeerLinks(
        settings=settings,
        backend=cast(TransferBackend, backend),
        metrics=metrics,
        dialer=Dialer(settings),
        sidecar_id="test",
        epoch=7,
    )


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _total(metrics: Metrics, name: str, **labels: str) -> float:
    """The sum of `name` over every sample whose labels include `labels`."""
    return sum(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def test_pulls_to_a_hung_peer_share_one_handshake(hung_peer: str) -> None:
    """Three pulls to a peer that never answers: one handshake attempt, whose failure
    all three get, instead of three attempts queued one timeout after another."""
    metrics, backend = Metrics(), RecordingBackend()
    links = _links(metrics, backend)
    layout = layout_for_model(MODEL)
    calls = [links.link(hung_peer, f"e-{i}", layout, 1, "e-p") for i in range(3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, PeerUnavailableError) for r in results), results
    assert _total(metrics, "kvxfer_handshakes_total", result="error") == 1
    assert backend.added == []


async def test_unknown_addresses_fold_into_one_label() -> None:
    """Params naming many addresses that never answer add no series per address."""
    metrics, backend = Metrics(), RecordingBackend()
    links = _links(metrics, backend, "--transfer.rpc-timeout-s", "0.2")
    layout = layout_for_model(MODEL)
    closed = [_closed_port() for _ in range(20)]
    for port in closed:
        with pytest.raises(PeerUnavailableError):
            await links.link(f"127.0.0.1:{port}", "e-1", layout, 1, "e-p")
    text = generate_latest(metrics.registry).decode()
    assert not any(f":{port}" in text for port in closed)
    assert _value(metrics, "kvxfer_handshakes_total", peer="other", result="error") == 20


async def test_addresses_named_by_bad_params_go_in_one_sweep_and_a_claimed_one_stays() -> None:
    """Pulls naming addresses that never answer each leave a channel and a last use
    behind; one sweep lets them all go (and the read tokens kept for them), in one pass
    over each map, while an address a transfer still claims stays."""
    metrics, backend = Metrics(), RecordingBackend()
    links = _links(metrics, backend, "--transfer.rpc-timeout-s", "0.2")
    layout = layout_for_model(MODEL)
    closed = [f"127.0.0.1:{_closed_port()}" for _ in range(30)]
    for address in closed:
        with links.use(address), pytest.raises(PeerUnavailableError):
            await links.link(address, "e-1", layout, 1, "e-p")
    for i, address in enumerate(closed):  # reads that ended without EndRead
        links._read_tokens[(address, 0, f"r-{i}")] = f"t-{i}"
    claimed = links.use(closed[0])
    assert await links.forget_idle(0.0) == 0  # none had a link or an agent
    assert set(links._last_used) == {closed[0]}
    assert {key[0] for key in links._read_tokens} == {closed[0]}
    assert not links._forgetting
    claimed.release()
    await links.forget_idle(0.0)
    assert not links._last_used and not links._read_tokens
    await links._dialer.close()


async def test_a_forgotten_peer_keeps_its_metric_label(hung_peer: str) -> None:
    """A peer with a label of its own idles out and is forgotten, then stops answering:
    its handshake error still counts under its name, not under "other"."""
    metrics = Metrics()
    links = _links(metrics, RecordingBackend())
    links._name_peer(hung_peer, "p")  # what its earlier successful handshake left
    links.use(hung_peer).release()
    await links.forget_idle(0.0)
    with links.use(hung_peer), pytest.raises(PeerUnavailableError):
        await links.link(hung_peer, "e-1", layout_for_model(MODEL), 1, "e-p")
    assert _value(metrics, "kvxfer_handshakes_total", peer="p", result="error") == 1
    assert _value(metrics, "kvxfer_handshakes_total", peer="other", result="error") == 0
    await links._dialer.close()


class RestartingPeer:
    """What a peer's handshake answers (`PeerLinks.hello`), under the epoch it is at:
    set `epoch` to restart it, `down` to have its handshakes fail, `sidecar_id` to be
    another peer. Its agent's metadata names the epoch."""

    def __init__(self, layout: EngineLayout) -> None:
        self.layout, self.epoch, self.down, self.sidecar_id = layout, 1, False, "p"

    async def hello(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise PeerUnavailableError("injected: the peer is restarting")
        return SimpleNamespace(
            layout=self.layout, protocol_version=PROTOCOL_VERSION, epoch=self.epoch,
            engine_id="e-p", agent_metadata=b"%d" % self.epoch, sidecar_id=self.sidecar_id,
            lane_port=0,
        )  # fmt: skip


def _restarting(
    monkeypatch: pytest.MonkeyPatch, backend: RecordingBackend, label: str = "p"
) -> tuple[Metrics, PeerLinks, RestartingPeer]:
    """Links over `backend` whose every handshake reaches one `RestartingPeer`, whose
    metric `label` is its identity "p", or "other" (the one label is taken by "x")."""
    metrics = Metrics()
    links = _links(metrics, backend, "--limits.max-peer-labels", "1")
    if label == "other":
        links._name_peer("127.0.0.1:9", "x")  # what its handshake left
    peer = RestartingPeer(layout_for_model(MODEL))
    monkeypatch.setattr(links, "hello", peer.hello)
    return metrics, links, peer


@pytest.mark.parametrize("label", ["p", "other"])
async def test_a_restart_while_forgotten_counts_once_and_the_same_epoch_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, label: str
) -> None:
    """Forgetting an address dropped the epoch its agent was loaded with, so a peer that
    restarted meanwhile was linked again uncounted. Its last epoch is kept: back with
    another one, the restart counts and is logged once (the old agent was removed when
    forgotten, and is not removed again); back with the same one, nothing counts. A peer
    folded into "other" keeps it too (not its identity), its restart counted there."""
    backend = RecordingBackend()
    metrics, links, peer = _restarting(monkeypatch, backend, label)
    layout, address = peer.layout, "127.0.0.1:1"

    async def linked() -> None:
        with links.use(address):
            await links.link(address, "e-1", layout, peer.epoch, "e-p")

    async def forgotten() -> None:
        links.use(address).release()
        assert await links.forget_idle(0.0) == 1

    def restarts() -> float:
        assert _total(metrics, "kvxfer_peer_epoch_changes_total") == _value(
            metrics, "kvxfer_peer_epoch_changes_total", peer=label
        )  # counted under its label, nowhere else
        return _value(metrics, "kvxfer_peer_epoch_changes_total", peer=label)

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="kvxfer.server.peers"):
        await linked()
        await forgotten()
        assert (address in links._identities) == (label == "p")
        await linked()  # the same epoch: no restart
        assert restarts() == 0 and logged() == []
        await forgotten()
        peer.epoch = 2
        await linked()
        assert restarts() == 1
        assert logged() == [f"peer {address} restarted while forgotten (epoch 1 -> 2)"]
        await linked()
        await forgotten()
        await linked()  # back with epoch 2 again
        assert restarts() == 1 and len(logged()) == 1
    assert backend.removed == ["agent-1", "agent-2", "agent-3"]  # one per forgetting
    await links._dialer.close()


@pytest.mark.parametrize("label", ["p", "other"])
async def test_an_address_forgotten_again_before_it_is_linked_keeps_its_epoch(
    monkeypatch: pytest.MonkeyPatch, label: str
) -> None:
    """A pull to a forgotten peer that is restarting fails its handshake, and the address
    idles out again with no agent loaded: the epoch kept from before stays, so the
    restart still counts once the peer is back."""
    metrics, links, peer = _restarting(monkeypatch, RecordingBackend(), label)
    layout, address = peer.layout, "127.0.0.1:1"
    with links.use(address):
        await links.link(address, "e-1", layout, peer.epoch, "e-p")
    links.use(address).release()
    await links.forget_idle(0.0)
    peer.down = True
    with links.use(address), pytest.raises(PeerUnavailableError):
        await links.link(address, "e-1", layout, peer.epoch, "e-p")
    await links.forget_idle(0.0)
    peer.down, peer.epoch = False, 2
    with links.use(address):
        await links.link(address, "e-1", layout, peer.epoch, "e-p")
    assert _value(metrics, "kvxfer_peer_epoch_changes_total", peer=label) == 1
    await links._dialer.close()


class FailingLoad(RecordingBackend):
    """Loading an agent fails while `failing` is set."""

    failing = False

    async def add_peer(self, metadata: bytes) -> str:
        if self.failing:
            raise DataPlaneError("injected: the agent's metadata did not load")
        return await super().add_peer(metadata)


async def test_a_restart_whose_new_agent_fails_to_load_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old agent is removed as the restart is seen; the new one fails to load. The
    next handshake loads it, without removing the old one again or counting again."""
    backend = FailingLoad()
    metrics, links, peer = _restarting(monkeypatch, backend)
    layout, address = peer.layout, "127.0.0.1:1"
    with links.use(address):
        await links.link(address, "e-1", layout, peer.epoch, "e-p")
        peer.epoch, backend.failing = 2, True
        with pytest.raises(DataPlaneError):
            await links.link(address, "e-1", layout, peer.epoch, "e-p")
        backend.failing = False
        await links.link(address, "e-1", layout, peer.epoch, "e-p")
    assert _value(metrics, "kvxfer_peer_epoch_changes_total", peer="p") == 1
    assert backend.removed == ["agent-1"]
    assert links._nixl_peers[address] == (2, "agent-2")
    await links._dialer.close()


class SlowRemoval(RecordingBackend):
    """Removing an agent takes a while, as the serving agent's round trip does: two
    handshakes with one address interleave there."""

    async def remove_peer(self, peer: str) -> None:
        await asyncio.sleep(0.05)
        await super().remove_peer(peer)


async def test_two_ranks_seeing_one_restart_count_it_and_remove_the_agent_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both TP ranks of a restarted peer handshake at once: one restart, one removal of
    the old agent, and both links on the new one."""
    backend = SlowRemoval()
    metrics, links, peer = _restarting(monkeypatch, backend)
    layout, address = peer.layout, "127.0.0.1:1"
    with links.use(address):
        for rank in (0, 1):
            await links.link(address, "e-1", layout, peer.epoch, "e-p", rank)
        old = links._nixl_peers[address][1]
        peer.epoch = 2
        both = await asyncio.gather(
            *(links.link(address, "e-1", layout, peer.epoch, "e-p", rank) for rank in (0, 1))
        )
    assert _value(metrics, "kvxfer_peer_epoch_changes_total", peer="p") == 1
    assert backend.removed == [old]
    assert links._nixl_peers[address][0] == 2
    assert [link.hello.epoch for link, _ in both] == [2, 2]
    assert backend.added[2:] == [b"2", b"2"]  # the new agent, loaded by each rank
    await links._dialer.close()


async def test_epochs_kept_for_forgotten_addresses_are_bounded() -> None:
    """A peer with a metric label of its own keeps its epoch when forgotten with its
    identity, and at most limits.max_peer_labels addresses do: a labelled peer that came
    back under many addresses keeps those of its latest. One folded into "other" keeps
    its epoch apart, without its identity."""
    links = _links(Metrics(), RecordingBackend(), "--limits.max-peer-labels", "2")

    async def forget(address: str, identity: str, epoch: int) -> None:
        links._name_peer(address, identity)  # what its handshake left
        links._nixl_peers[address] = (epoch, f"agent-{epoch}")
        links.use(address).release()
        assert await links.forget_idle(0.0) == 1

    for i in range(4):  # one peer, "p", under four addresses in turn
        await forget(f"127.0.0.1:{i}", "p", i)
    links._name_peer("127.0.0.1:9", "x")  # the second and last label
    await forget("127.0.0.1:10", "q", 10)
    assert links.label("127.0.0.1:10") == "other"
    assert links._forgotten_epochs == {"127.0.0.1:2": 2, "127.0.0.1:3": 3}
    assert links._forgotten_others == {"127.0.0.1:10": 10}
    # The identities of the addresses it left go with their epochs: not one kept per
    # address a pod ever had. The two latest still count under "p".
    assert [links.label(f"127.0.0.1:{i}") for i in range(4)] == ["other", "other", "p", "p"]
    assert set(links._identities) == {"127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:9"}
    await links._dialer.close()


async def test_epochs_kept_for_forgotten_other_peers_are_bounded_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many peers folded into "other" forgotten one after another: the latest
    _MAX_FORGOTTEN_OTHERS keep their epochs (and no identity), the oldest dropped first,
    and none takes the place of the labelled peer's identity and epoch. A restart is
    counted for a kept address, under "other", not for a dropped one."""
    metrics, links, peer = _restarting(monkeypatch, RecordingBackend(), "other")
    labelled, bound = "127.0.0.1:9", peers._MAX_FORGOTTEN_OTHERS
    addresses = [f"10.0.{i // 256}.{i % 256}:1" for i in range(bound + 1)]
    for address in [labelled, *addresses]:
        links._nixl_peers[address] = (1, "agent")  # what its handshake left
        if address != labelled:
            links._name_peer(address, f"o-{address}")
        links.use(address).release()
        assert await links.forget_idle(0.0) == 1
    assert set(links._identities) == {labelled}

    def restarts(label: str) -> float:
        return _value(metrics, "kvxfer_peer_epoch_changes_total", peer=label)

    peer.epoch = 2
    dropped, oldest_kept = addresses[:2]
    for address, counted in ((dropped, 0), (oldest_kept, 1)):
        with links.use(address):
            await links.link(address, "e-1", peer.layout, peer.epoch, "e-p")
        assert restarts("other") == counted
    # The latest are kept still (the one linked again no longer), the labelled one too.
    assert list(links._forgotten_others) == addresses[2:]
    assert links._forgotten_epochs == {labelled: 1}
    peer.sidecar_id = "x"
    with links.use(labelled):
        await links.link(labelled, "e-1", peer.layout, peer.epoch, "e-p")
    assert restarts("x") == 1
    await links._dialer.close()


async def test_an_address_in_use_again_keeps_its_identity_when_its_epoch_is_dropped() -> None:
    """A forgotten address a pull claims again is no longer forgotten: pushed out of
    the kept epochs by later ones, it keeps the identity its handshake is giving it."""
    links = _links(Metrics(), RecordingBackend(), "--limits.max-peer-labels", "1")
    links._name_peer("127.0.0.1:0", "p")
    links._nixl_peers["127.0.0.1:0"] = (1, "agent-1")
    links.use("127.0.0.1:0").release()
    await links.forget_idle(0.0)
    claim = links.use("127.0.0.1:0")  # a pull to it: its handshake is under way
    links._name_peer("127.0.0.1:1", "p")
    links._nixl_peers["127.0.0.1:1"] = (2, "agent-2")
    links.use("127.0.0.1:1").release()
    links._last_used["127.0.0.1:1"] = 0.0  # idle, unlike the claimed one
    await links.forget_idle(1.0)
    assert links._forgotten_epochs == {"127.0.0.1:1": 2}
    assert links.label("127.0.0.1:0") == "p"
    claim.release()
    await links._dialer.close()


class StuckRemoval(RecordingBackend):
    """`remove_peer` waits, as the serving agent's does behind its lock while an engine
    registers its buffers or a serving child is being replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def remove_peer(self, peer: str) -> None:
        await self.release.wait()


async def test_a_pull_to_an_address_being_forgotten_waits_at_most_the_rpc_timeout(
    hung_peer: str,
) -> None:
    backend = StuckRemoval()
    metrics = Metrics()
    links = _links(metrics, backend, "--transfer.rpc-timeout-s", "0.3")
    links._nixl_peers[hung_peer] = (1, "agent-old")
    links.use(hung_peer).release()
    sweep = asyncio.create_task(links.forget_idle(0.0))
    await asyncio.sleep(0)  # the sweep is removing the old agent, and stays stuck there
    try:
        with links.use(hung_peer), pytest.raises(PeerUnavailableError, match="still being let go"):
            await within(links.link(hung_peer, "e-1", layout_for_model(MODEL), 1, "e-p"), 10)
        assert _total(metrics, "kvxfer_handshakes_total", result="error") == 1
    finally:
        backend.release.set()
        await sweep
    assert not links._forgetting
    await links._dialer.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_peer_loads_no_agent_and_counts_no_ok(tmp_path: Path) -> None:
    p = start_sidecar(tmp_path, "p")
    pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=16)
    dx = start_sidecar(tmp_path, "dx")
    dxe = start_engine(tmp_path, dx, MODEL, "decode", "--kv-dtype", "float8_e4m3fn", num_blocks=16)
    try:
        async with engine_link(p, pe) as (pc, _), engine_link(dx, dxe) as (dc, _):
            blocks = {g.group_id: [0, 1] for g in pe.layout.groups}
            params = await pc.publish("refused", 32, spans(blocks))
            for _ in range(2):
                with pytest.raises(NegotiationError):
                    await dc.pull(params, spans(blocks), 0)
        samples = scrape(dx)
        results = {
            dict(labels)["result"]: value
            for (name, labels), value in samples.items()
            if name == "kvxfer_handshakes_total"
        }
        assert results == {"refused": 2}
        assert samples[("kvxfer_peers", ())] == 0
        peer = p.ready["peer_address"]  # never handshook: no series of its own
        assert not [key for key in samples if ("peer", peer) in key[1]]
    finally:
        for proc in (dxe, dx, pe, p):
            proc.stop()


async def test_a_quiet_link_leaves_a_refused_negotiation_to_its_caller_to_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Hold links quietly (it logs refusals itself, throttled, since it asks again at
    every interval); a pull still logs its own, also when it joined a handshake a quiet
    caller started."""
    links = _links(Metrics(), RecordingBackend())
    layout = layout_for_model(MODEL)

    async def hello(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.05)  # long enough for a second caller to join
        other = layout_for_model("gpt-oss-20b")
        return SimpleNamespace(layout=other, protocol_version=PROTOCOL_VERSION)

    monkeypatch.setattr(links, "hello", hello)

    def logged() -> int:
        return sum("disagree" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="kvxfer.server.peers"):
        with pytest.raises(NegotiationError):
            await links.link("127.0.0.1:1", "e-1", layout, 1, "e-p", quiet=True)
        assert logged() == 0
        with pytest.raises(NegotiationError):
            await links.link("127.0.0.1:1", "e-1", layout, 1, "e-p")
        assert logged() == 1
        quiet = links.link("127.0.0.1:1", "e-1", layout, 1, "e-p", quiet=True)
        pull = links.link("127.0.0.1:1", "e-1", layout, 1, "e-p")
        results = await asyncio.gather(quiet, pull, return_exceptions=True)
        assert all(isinstance(r, NegotiationError) for r in results), results
        assert logged() == 2  # one handshake, logged once: for the pull that joined it


class FakeContext:
    """The slice of grpc.aio.ServicerContext the peer-port guard reads."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return self._peer

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()
    ) -> None:
        raise AbortedError(code, details)


class AbortedError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code = code


async def test_calls_per_client_are_bounded() -> None:
    """One client host may run limits.max_calls_per_peer calls at once; another host is
    not affected, and a finished call frees its slot."""
    release = asyncio.Event()

    async def slow(request: object, context: object) -> str:
        await release.wait()
        return "done"

    settings = load_settings(["--limits.max-calls-per-peer", "2"], environ={})
    guard = PeerPortGuard(settings, Metrics())
    method = "/kvxfer.v1.PeerService/BeginRead"

    async def continuation(details: object) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.unary_unary_rpc_method_handler(cast(Any, slow), lambda b: b, lambda r: r)

    details = cast(grpc.HandlerCallDetails, type("D", (), {"method": method})())
    handler = await guard.intercept_service(continuation, details)
    assert handler is not None and handler.unary_unary is not None
    call = cast(Any, handler.unary_unary)
    a = FakeContext("ipv4:10.0.0.1:5000")
    running = [asyncio.create_task(call(b"", a)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(AbortedError) as refused:
        await call(b"", FakeContext("ipv4:10.0.0.1:5001"))
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    other = asyncio.create_task(call(b"", FakeContext("ipv4:10.0.0.2:5000")))
    release.set()
    assert await asyncio.gather(*running, other) == ["done"] * 3
    assert await call(b"", a) == "done"


async def test_the_peer_gate_counts_a_clients_grpc_and_lane_calls_together() -> None:
    """limits.max_calls_per_peer bounds a client's calls on both transports together,
    at the gate both go through (`PeerPortGuard.run`; test_peer_lane shows the lane's
    calls reaching it), the client known by the address gRPC's `peer()` spells and the
    lane spells alike (`grpc_peer`)."""
    release = asyncio.Event()

    async def slow(request: object, context: object) -> str:
        await release.wait()
        return "done"

    metrics = Metrics()
    settings = load_settings(["--limits.max-calls-per-peer", "2"], environ={})
    guard = PeerPortGuard(settings, metrics)
    method = "/kvxfer.v1.PeerService/BeginRead"
    request = pb.BeginReadRequest(request_id="r")

    assert grpc_peer(("10.0.0.1", 5001)) == "ipv4:10.0.0.1:5001"  # as gRPC's peer()
    assert grpc_peer(("fd00::1", 5001, 0, 0)) == "ipv6:[fd00::1]:5001"
    # gRPC's own peer() percent-encodes an IPv6 host's brackets: the same host still
    assert client_host("ipv6:%5Bfd00::1%5D:5000") == client_host(grpc_peer(("fd00::1", 5001)))
    assert client_host("ipv4:10.0.0.1:5000") == "ipv4:10.0.0.1"

    def on(transport: str, port: int) -> Any:
        context = LaneContext(peer=f"ipv4:10.0.0.1:{port}")  # one host, new connections
        return guard.run(method, request, cast(Any, context), slow, transport=transport)

    running = [asyncio.create_task(on("grpc", 5000)), asyncio.create_task(on("lane", 5001))]
    await asyncio.sleep(0)
    for transport in ("lane", "grpc"):
        with pytest.raises(grpc.aio.AbortError) as refused:
            await on(transport, 5002)
        status = cast(Any, refused.value).status
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "limits.max_calls_per_peer: 2 calls from ipv4:10.0.0.1" in status.message
    release.set()
    assert await asyncio.gather(*running) == ["done"] * 2
    assert await on("lane", 5003) == "done"  # slots freed on both
    counted = {t: metrics.peer_calls.labels("BeginRead", t)._value.get() for t in ("grpc", "lane")}
    assert counted == {"grpc": 1, "lane": 2}
    assert metrics.refusals.labels("too_many_calls")._value.get() == 2


async def test_the_peers_gauge_counts_links_not_found_stale(tmp_path: Path) -> None:
    """kvxfer_peers was set at each handshake from every address ever linked, so peers
    that went away (pods replaced under new addresses) counted for ever. It is counted at
    each scrape, without the links found stale."""
    p = start_sidecar(tmp_path, "p")
    pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=16)
    try:
        metrics = Metrics()
        links = _links(metrics, RecordingBackend())
        layout = layout_for_model(MODEL)
        assert _sample(metrics, "kvxfer_peers") == 0
        link, _ = await links.link(
            p.ready["peer_address"], "e-1", layout, pe.ready["epoch"], pe.engine_id
        )
        assert _sample(metrics, "kvxfer_peers") == 1
        links.invalidate(link)  # a transfer found it gone
        assert _sample(metrics, "kvxfer_peers") == 0
    finally:
        pe.stop()
        p.stop()
