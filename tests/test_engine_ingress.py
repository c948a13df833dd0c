"""The engine socket as an attack surface and a failure point (issue 10, engine side).

Real kvxfer-server and engine-sim processes, real NIXL. A refused RegisterEngine
leaves no trace; shared memory is opened without following symlinks and only
when the caller owns it; names match whole; Publish must cover its tokens; a
second sidecar cannot take over a live engine socket; a SIGKILLed engine is
retired (only after the reads of its blocks end) and its restart registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from sidecars import OneEngine, one_engine, scrape, spans

from kvxfer._exceptions import InvalidInputError, RegistrationError
from kvxfer.cli.fleet import BIN, ChildDiedError, EngineView, Fleet, Proc, metric, spawn
from kvxfer.client.engine import EngineClient
from kvxfer.client.shm import ShmKVCache
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import check_address, check_request_id
from kvxfer.server.main import flag_insecure_listeners
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import Settings, is_loopback
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.layout import layout_to_proto
from kvxfer.wire.sidecar import handle_to_proto

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"  # one full-attention group
CYCLES = int(os.environ.get("KVXFER_TEST_INGRESS_CYCLES", "3"))  # kill/restart cycles
B = 16
ME = (("kvxfer-engine-pid", str(os.getpid())),)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneEngine]:
    with one_engine(tmp_path_factory.mktemp("ingress"), MODEL) as made:
        yield made


@pytest.fixture
def rank1() -> Iterator[ShmKVCache]:
    """A second engine's KV (TP rank 1), allocated by this test process."""
    cache = ShmKVCache(layout_for_model(MODEL, tp_size=2, tp_rank=1), 4, "ingress")
    try:
        yield cache
    finally:
        cache.close()


async def test_failed_register_leaves_no_nixl_registration(
    setup: OneEngine, rank1: ShmKVCache
) -> None:
    spec = setup.engine.ready["buffers"][0]
    taken = BufferHandle(spec["name"], MemoryKind.DRAM, spec["size_bytes"], spec["shm_name"])
    async with EngineClient(setup.address) as client:
        # rank 1's own buffers register with NIXL, then the name the rank-0 engine
        # already registered is refused: the whole call must be undone.
        with pytest.raises(RegistrationError, match="already registered"):
            await client.register(rank1.layout, [*rank1.buffers, taken])
        registration = await client.register(rank1.layout, rank1.buffers)
        assert registration.engine_id
        await client.unregister()
    samples = scrape(setup.sidecar)
    assert metric(samples, "kvxfer_registered_engines") == 1


async def test_an_engine_name_cannot_forge_or_flood_a_log_line(
    setup: OneEngine, rank1: ShmKVCache
) -> None:
    """The name an engine registers with was logged as it came: a newline in it began a
    line of the engine's choosing, and 5000 characters went whole into the log."""
    forged = "2026-01-01 00:00:00,000 INFO kvxfer.server: FORGED"
    async with EngineClient(setup.address) as client:
        registration = await client.register(rank1.layout, rank1.buffers, f"x\n{forged}" * 100)
        await client.unregister()
    lines = setup.sidecar.log.read_text().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    (line,) = [line for line in lines if f"registered engine {registration.engine_id}" in line]
    assert "'x\\n2026-01-01" in line and "(5200 characters)" in line and len(line) < 400


async def test_publish_must_cover_its_tokens(setup: OneEngine) -> None:
    async with EngineClient(setup.address, engine_id=setup.engine.engine_id) as client:
        with pytest.raises(InvalidInputError, match=r"^spans\[0\]: covers logical blocks 0\.\.1"):
            await client.publish("huge", 10**6, spans({0: [0, 1]}))
        with pytest.raises(InvalidInputError, match=r"^spans: empty"):
            await client.publish("nothing", 100, [])
        with pytest.raises(InvalidInputError, match=r"^spans\[0\].*needs logical block 6"):
            await client.publish("short", 100, spans({0: [0, 1, 2]}))
        params = await client.publish("exact", 100, spans({0: range(7)}))
        assert await client.abort(params.request_id) == "held"


async def _raw_register(address: str, request: pb.RegisterEngineRequest) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RegisterEngine(request, metadata=ME, timeout=30)
    return refused.value


def _request(cache: ShmKVCache, **changes: object) -> pb.RegisterEngineRequest:
    first = dataclasses.replace(cache.buffers[0], **changes)  # type: ignore[arg-type]
    handles = [handle_to_proto(first), *(handle_to_proto(h) for h in cache.buffers[1:])]
    return pb.RegisterEngineRequest(layout=layout_to_proto(cache.layout), buffers=handles)


async def test_shared_memory_names_must_be_plain_owned_files(
    setup: OneEngine, rank1: ShmKVCache, tmp_path: Path
) -> None:
    size = rank1.buffers[0].size_bytes
    secret = tmp_path / "root-only"
    secret.write_bytes(b"s" * size)
    secret.chmod(0o600)
    link = Path("/dev/shm") / f"ingress-link-{os.getpid()}"
    foreign = Path("/dev/shm") / f"ingress-foreign-{os.getpid()}"
    link.symlink_to(secret)
    foreign.write_bytes(bytes(size))
    os.chown(foreign, 12345, 12345)
    try:
        for shm_name, why in (
            (link.name, "is a symbolic link"),
            (foreign.name, "owned by uid 12345"),
        ):
            refused = await _raw_register(setup.address, _request(rank1, shm_name=shm_name))
            assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert why in (refused.details() or "")
        for shm_name in (".", "..", rank1.buffers[0].shm_name + "\n"):
            request = _request(rank1)
            request.buffers[0].shm_name = shm_name
            refused = await _raw_register(setup.address, request)
            assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "shm_name" in (refused.details() or "")
        beyond = await _raw_register(setup.address, _request(rank1, offset_bytes=size))
        assert beyond.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "offset_bytes + size_bytes" in (beyond.details() or "")
        stranger = _request(rank1)
        async with grpc.aio.insecure_channel(setup.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as lie:
                await stub.RegisterEngine(stranger, metadata=(("kvxfer-engine-pid", "1"),))
        assert "process 1 is not connected" in (lie.value.details() or "")
    finally:
        link.unlink()
        foreign.unlink()
    # Nothing of the refused calls stayed: the real buffers still register.
    async with EngineClient(setup.address) as client:
        await client.register(rank1.layout, rank1.buffers)
        await client.unregister()


def test_a_second_sidecar_cannot_take_a_live_engine_socket(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        first = fleet.sidecar("same")
        with pytest.raises(ChildDiedError, match=r"same\.sock is served by another live"):
            fleet.sidecar("same")
        fleet.engine(first, MODEL, "prefill", "--num-blocks", "4")  # the first still serves
        first.stop(signal.SIGKILL)  # leaves a stale socket file behind
        assert Path(first.ready["engine_address"].removeprefix("unix:")).exists()
        fleet.sidecar("same")  # a stale socket is replaced
    finally:
        fleet.close()


def test_tcp_engine_address_needs_the_insecure_flag(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        with pytest.raises(ChildDiedError, match="insecure-engine-tcp"):
            fleet.sidecar("tcp", "--engine-address", "127.0.0.1:0")
        loud = fleet.sidecar("loud", "--engine-address", "127.0.0.1:0", "--insecure-engine-tcp")
        assert "INSECURE: EngineService on TCP" in loud.log_text()
        samples = scrape(loud)
        for service in ("engine", "metrics"):  # loopback: warned, not exposed
            assert ("kvxfer_insecure_listeners", (("service", service),)) in samples
            assert metric(samples, "kvxfer_insecure_listeners", service=service) == 0
    finally:
        fleet.close()


def test_listeners_beyond_loopback_are_flagged() -> None:
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.9.9.9", "[::1]", "localhost"))
    assert not any(is_loopback(a) for a in ("0.0.0.0", "[::]", "10.0.0.1", "example"))
    settings = Settings(
        engine_address="0.0.0.0:7600", insecure_engine_tcp=True, metrics_address="[::]:9400"
    )
    metrics = Metrics()
    flag_insecure_listeners(settings, metrics)
    for service in ("engine", "metrics"):
        assert (
            metrics.registry.get_sample_value("kvxfer_insecure_listeners", {"service": service})
            == 1
        )


async def _until_metric(sidecar: Proc, name: str, value: float) -> None:
    """Wait (bounded) until the sidecar has acted on something it learns asynchronously."""
    for _ in range(200):
        if metric(scrape(sidecar), name) == value:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never reached {value}")


async def test_a_killed_engine_is_retired_after_its_reads_and_can_register_again(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    try:
        sidecar = fleet.sidecar("s", "--transfer.rpc-timeout-s", "1")
        engine = fleet.engine(sidecar, MODEL, "prefill", "--num-blocks", "16")
        async with (
            EngineClient(sidecar.ready["engine_address"], engine_id=engine.engine_id) as client,
            grpc.aio.insecure_channel(sidecar.ready["peer_address"]) as channel,
        ):
            held = await client.publish("held", 32, spans({0: [0, 1]}))
            read = await client.publish("read", 32, spans({0: [2, 3]}))
            peer = pb_grpc.PeerServiceStub(channel)
            key = {"epoch": read.epoch, "tp_rank": 0}
            token = (await peer.BeginRead(pb.BeginReadRequest(**key, request_id="read"))).read_token
            engine.proc.popen.send_signal(signal.SIGKILL)
            engine.proc.popen.wait(30)
            await _until_metric(sidecar, "kvxfer_engine_exits_total", 1)
            # The reader learns of the abort from its heartbeat; the held lease is gone.
            beat = await peer.Heartbeat(
                pb.HeartbeatRequest(**key, request_ids=["read", "held"], read_tokens=[token, ""])
            )
            assert list(beat.states) == [pb.LEASE_STATE_ABORTED, pb.LEASE_STATE_UNKNOWN]
            with pytest.raises(ChildDiedError, match="being retired"):
                fleet.engine(sidecar, MODEL, "prefill", "--num-blocks", "16")
            await peer.EndRead(
                pb.EndReadRequest(
                    **key, request_id="read", reason=pb.RELEASE_REASON_ABORTED, read_token=token
                )
            )
            assert held.request_id == "held"
        again = fleet.engine(sidecar, MODEL, "prefill", "--num-blocks", "16")
        assert again.engine_id != engine.engine_id
        samples = scrape(sidecar)
        assert metric(samples, "kvxfer_engine_exits_total") == 1
        assert metric(samples, "kvxfer_registered_engines") == 1
        assert metric(samples, "kvxfer_active_leases") == 0
    finally:
        fleet.close()


def test_an_engine_the_sidecar_cannot_see_is_replaced_by_its_restart(tmp_path: Path) -> None:
    """The pod case: sidecar and engine in different pid namespaces. SO_PEERCRED gives
    the engine's uid but pid 0, so its death cannot be watched; its restart replaces it."""
    fleet = Fleet(tmp_path)
    argv = [
        "unshare", "--pid", "--mount-proc", "--kill-child=SIGTERM",
        str(BIN / "kvxfer-server"),
        "--peer-address", "127.0.0.1:0",
        "--engine-address", f"unix:{tmp_path / 'ns.sock'}",
        "--metrics-address", "127.0.0.1:0",
    ]  # fmt: skip
    sidecar = spawn("sidecar ns", argv, tmp_path / "ns.log")
    fleet.procs.append(sidecar)
    try:
        first = fleet.engine(sidecar, MODEL, "prefill", "--num-blocks", "4")
        first.proc.popen.send_signal(signal.SIGKILL)
        first.proc.popen.wait(30)
        second = fleet.engine(sidecar, MODEL, "prefill", "--num-blocks", "4")
        assert second.engine_id != first.engine_id
        assert "in another pid namespace" in sidecar.log_text()
        assert f"engine {first.engine_id} replaced" in sidecar.log_text()
        assert metric(scrape(sidecar), "kvxfer_registered_engines") == 1
    finally:
        # unshare does not pass SIGTERM on: stop the sidecar itself, then unshare ends.
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{sidecar.pid}/task/{sidecar.pid}/children").read_text()
            for pid in children.split():
                os.kill(int(pid), signal.SIGTERM)
        fleet.close()


async def test_kill_restart_cycles_leave_no_lease_mapping_or_registration(
    tmp_path: Path,
) -> None:
    """SIGKILL the engine CYCLES times (KVXFER_TEST_INGRESS_CYCLES for a longer run), each time
    with requests published, every other time with one of them being read: the dead
    engine's memory stays mapped until the read ends, every restart registers, and the
    sidecar keeps no lease, mapping or engine of the dead processes."""
    fleet = Fleet(tmp_path)
    try:
        sidecar = fleet.sidecar("s")
        dead: list[EngineView] = []
        async with grpc.aio.insecure_channel(sidecar.ready["peer_address"]) as channel:
            peer = pb_grpc.PeerServiceStub(channel)
            for cycle in range(CYCLES + 1):
                engine = fleet.engine(sidecar, MODEL, "prefill", "--num-blocks", "8")
                if cycle == CYCLES:
                    await _publish_two(sidecar, engine, cycle)
                    break
                await _kill_while_published(sidecar, engine, peer, cycle, reading=cycle % 2 == 1)
                dead.append(engine)
        samples = scrape(sidecar)
        assert metric(samples, "kvxfer_registered_engines") == 1
        assert metric(samples, "kvxfer_active_leases") == 2  # the live engine's only
        maps = Path(f"/proc/{sidecar.pid}/maps").read_text()
        for engine in dead:
            for name in engine.shm_names():
                assert name not in maps, f"the sidecar still maps dead engine's {name}"
                # Nobody else can unlink what a killed engine created: the sidecar does.
                assert not (Path("/dev/shm") / name).exists(), f"dead engine's {name} leaked"
    finally:
        fleet.close()


async def _publish_two(sidecar: Proc, engine: EngineView, cycle: int) -> int:
    async with EngineClient(sidecar.ready["engine_address"], engine_id=engine.engine_id) as c:
        for i in range(2):
            params = await c.publish(f"c{cycle}-{i}", 32, spans({0: [2 * i, 2 * i + 1]}))
    return params.epoch


async def _kill_while_published(
    sidecar: Proc, engine: EngineView, peer: pb_grpc.PeerServiceStub, cycle: int, reading: bool
) -> None:
    key = {"epoch": await _publish_two(sidecar, engine, cycle), "tp_rank": 0}
    token = ""
    if reading:
        begun = await peer.BeginRead(pb.BeginReadRequest(**key, request_id=f"c{cycle}-0"))
        token = begun.read_token
    engine.proc.popen.send_signal(signal.SIGKILL)
    engine.proc.popen.wait(30)
    await _until_metric(sidecar, "kvxfer_engine_exits_total", cycle + 1)
    if not reading:
        return
    maps = Path(f"/proc/{sidecar.pid}/maps").read_text()
    assert all(name in maps for name in engine.shm_names()), "unmapped under a read"
    beat = await peer.Heartbeat(
        pb.HeartbeatRequest(**key, request_ids=[f"c{cycle}-0"], read_tokens=[token])
    )
    assert list(beat.states) == [pb.LEASE_STATE_ABORTED]
    end = pb.EndReadRequest(
        **key, request_id=f"c{cycle}-0", reason=pb.RELEASE_REASON_ABORTED, read_token=token
    )
    await peer.EndRead(end)


def test_names_and_addresses_match_as_a_whole() -> None:
    """A `$` pattern accepts a trailing newline; these checks must not."""
    with pytest.raises(InvalidInputError, match="request_id"):
        check_request_id("req-1\n")
    with pytest.raises(InvalidInputError, match="bad host"):
        check_address("localhost\n:7500", "peer_address")
    for name in ("seg\n", ".", ".."):
        with pytest.raises(InvalidInputError, match="shm_name"):
            BufferHandle("b", MemoryKind.DRAM, 4096, shm_name=name)
    with pytest.raises(InvalidInputError, match="port"):
        check_address("localhost:\u0661\u0662", "peer_address")  # Arabic-Indic digits
