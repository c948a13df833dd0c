"""End to end: real kvxfer-server and engine-sim processes, gRPC on loopback, real NIXL.

One prefill sidecar P serves a gpt-oss-20b engine (sliding window + full
attention). Decode sidecars pull from it: D (plain), DF (fault injection:
chunks fail or stall) and DX (float8 KV, to be refused). Every pull is
checked byte for byte against the token-level oracle, and the whole decode
buffer against its pattern. Tests share the fleet; each one's checks hold
whatever ran before it (the metrics test measures deltas around its own
pulls), and the last one shuts everything down.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from oracle import oracle_blocks, oracle_valid_tokens
from sidecars import (
    DecodeImage,
    EngineSim,
    Proc,
    engine_link,
    scrape,
    spans,
    start_engine,
    start_sidecar,
)

from kvxfer._exceptions import (
    InvalidInputError,
    NegotiationError,
    NotFoundError,
    RegistrationError,
)
from kvxfer.cli.fleet import BIN, Samples, metric, rss_excluding_shm_bytes
from kvxfer.client.engine import EngineClient, SyncEngineClient
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.layout import Region
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import (
    AbortState,
    LeaseExpired,
    PullDone,
    PullStatus,
    Released,
    ReleaseReason,
)
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gpt-oss-20b"
B = 16
NUM_BLOCKS = 256
LEASE = ("--lease.ttl-s", "3", "--transfer.stall-deadline-s", "2")


@dataclass
class Fleet:
    tmp: Path
    p: Proc
    pe: EngineSim
    d: Proc
    de: EngineSim
    df: Proc
    dfe: EngineSim
    image: DecodeImage
    fault_image: DecodeImage
    ids: Iterator[int] = field(default_factory=itertools.count)
    p_blocks: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(NUM_BLOCKS)))
    d_next: int = 0
    df_next: int = 0

    def request_id(self, tag: str) -> str:
        return f"{tag}-{next(self.ids)}"

    def src(self, count: int) -> list:
        ids = [next(self.p_blocks) for _ in range(count)]
        return spans({0: ids, 1: ids[::-1]})

    def dst(self, count: int, *, faulty: bool = False) -> list:
        start = self.df_next if faulty else self.d_next
        assert start + count <= NUM_BLOCKS, "the test fleet ran out of decode blocks"
        ids = list(range(start, start + count))
        if faulty:
            self.df_next += count
        else:
            self.d_next += count
        # Group 1 gets a scattered order, so runs break and descriptors are not trivial.
        return spans({0: ids, 1: ids[1::2] + ids[0::2]})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    procs: list[Proc | EngineSim] = []
    try:
        p = start_sidecar(tmp, "p", *LEASE)
        procs.append(p)
        d = start_sidecar(tmp, "d", *LEASE)
        procs.append(d)
        df = start_sidecar(
            tmp, "df", *LEASE, "--faults.fail-rate", "0.3", "--faults.stall-rate", "0.3",
            "--faults.seed", "7", "--transfer.chunk-blocks", "4", "--event-loop", "asyncio",
            "--gil-switch-interval-s", "0.002",
        )  # fmt: skip
        procs.append(df)
        pe = start_engine(tmp, p, MODEL, "prefill", num_blocks=NUM_BLOCKS)
        procs.append(pe)
        de = start_engine(tmp, d, MODEL, "decode", num_blocks=NUM_BLOCKS)
        procs.append(de)
        dfe = start_engine(tmp, df, MODEL, "decode", "--seed", "3", num_blocks=NUM_BLOCKS)
        procs.append(dfe)
        yield Fleet(tmp, p, pe, d, de, df, dfe, DecodeImage(de), DecodeImage(dfe))
    finally:
        for proc in reversed(procs):
            proc.stop()


def needed(tokens: int) -> int:
    return -(-tokens // B)


async def _pull_once(
    fleet: Fleet, tag: str, tokens: int, computed: int, *, faulty: bool = False
) -> tuple[PullDone, Released, list, list]:
    decode, engine = (fleet.df, fleet.dfe) if faulty else (fleet.d, fleet.de)
    count = needed(tokens)
    src, dst = fleet.src(count), fleet.dst(count, faulty=faulty)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(decode, engine) as (
            d,
            d_events,
        ),
    ):
        params = await p.publish(fleet.request_id(tag), tokens, src)
        accepted = await d.pull(params, dst, computed)
        done = await d_events.next()
        released = await p_events.next()
    assert isinstance(done, PullDone) and done.request_id == params.request_id
    assert isinstance(released, Released) and released.request_id == params.request_id
    layout = fleet.pe.layout
    exact = sum(
        len(oracle_blocks(g, tokens, computed, B)) * g.bytes_per_block for g in layout.groups
    )
    assert accepted.bytes_planned == exact
    return done, released, src, dst


@pytest.mark.parametrize(
    ("tag", "tokens", "computed"),
    [("no-hit", 600, 0), ("aligned", 512, 0), ("partial-hit", 1000, 256)],
)
async def test_pull_moves_exactly_the_needed_blocks(
    fleet: Fleet, tag: str, tokens: int, computed: int
) -> None:
    done, released, src, dst = await _pull_once(fleet, tag, tokens, computed)
    assert done.status is PullStatus.OK, done.reason
    assert done.failed_blocks == {} and done.valid_tokens == tokens
    moved = fleet.image.expect_pull(fleet.pe, src, dst, tokens, computed, {})
    fleet.image.check_all()
    assert done.bytes_moved == moved
    assert released.reason is ReleaseReason.CONSUMED and released.bytes_read == moved


def test_sidecars_run_the_event_loop_they_are_set_to(fleet: Fleet) -> None:
    """uvloop by default, asyncio when told (the faulty decode pulls on it), and the ready
    line says which."""
    assert fleet.p.ready["event_loop"] == fleet.d.ready["event_loop"] == "uvloop"
    assert fleet.df.ready["event_loop"] == "asyncio"


def test_sidecars_run_with_the_gil_switch_interval_they_are_set_to(fleet: Fleet) -> None:
    """0.1 ms by default (a NIXL thread waiting for the GIL beside a busy loop then waits
    that long, not Python's 5 ms), another when told, and the ready line says which."""
    assert fleet.p.ready["gil_switch_interval_s"] == fleet.d.ready["gil_switch_interval_s"]
    assert fleet.d.ready["gil_switch_interval_s"] == pytest.approx(0.0001)
    assert fleet.df.ready["gil_switch_interval_s"] == pytest.approx(0.002)


def test_sidecars_freeze_their_start_up_heap_before_they_are_ready(fleet: Fleet) -> None:
    """What start-up left (tens of thousands of objects: modules, gRPC, protobuf) is out
    of the cyclic GC's sight, so a full collection does not stall pulls by scanning it."""
    for sidecar in (fleet.p, fleet.d, fleet.df):
        assert sidecar.ready["frozen_objects"] > 10_000, sidecar.ready


async def test_full_prefix_hit_moves_nothing_and_releases(fleet: Fleet) -> None:
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(fleet.d, fleet.de) as (d, d_events),
    ):
        params = await p.publish(fleet.request_id("full-hit"), 640, fleet.src(needed(640)))
        accepted = await d.pull(params, [], 640)
        done = await d_events.next()
        released = await p_events.next()
    assert accepted.bytes_planned == 0 and accepted.chunks == 0
    assert isinstance(done, PullDone) and done.status is PullStatus.OK
    assert done.bytes_moved == 0 and done.valid_tokens == 640
    assert isinstance(released, Released) and released.reason is ReleaseReason.CONSUMED
    fleet.image.check_all()


async def test_abort_before_pull_releases_and_fails_the_pull(fleet: Fleet) -> None:
    count = needed(400)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(fleet.d, fleet.de) as (d, d_events),
    ):
        params = await p.publish(fleet.request_id("abort-before"), 400, fleet.src(count))
        assert await p.abort(params.request_id) is AbortState.HELD
        released = await p_events.next()
        assert isinstance(released, Released) and released.reason is ReleaseReason.ABORTED
        dst = fleet.dst(count)
        await d.pull(params, dst, 0)
        done = await d_events.next()
    assert isinstance(done, PullDone) and done.status is PullStatus.FAILED
    assert "not held" in done.reason and done.bytes_moved == 0
    assert done.valid_tokens == 0
    assert set(done.failed_blocks) == {0, 1}
    # The read ran beside the refused BeginRead: what it wrote into the blocks now
    # reported failed is theirs to recompute. Nothing else was written, and nothing
    # lands after the report.
    fleet.image.accept_failed(dst, done.failed_blocks)
    await asyncio.sleep(0.3)
    fleet.image.check_all()


async def test_abort_during_pull_from_decode_side(fleet: Fleet) -> None:
    count = needed(1024)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(fleet.df, fleet.dfe) as (d, d_events),
    ):
        params = await p.publish(fleet.request_id("abort-d"), 1024, fleet.src(count))
        await d.pull(params, fleet.dst(count, faulty=True), 0)
        await asyncio.sleep(0.3)  # chunks are stalling now (fault seam)
        assert await d.abort(params.request_id) is AbortState.PULLING
        done = await d_events.next()
        released = await p_events.next()
    assert isinstance(done, PullDone) and done.status is PullStatus.ABORTED
    assert isinstance(released, Released) and released.reason is ReleaseReason.ABORTED


async def test_abort_during_pull_from_prefill_side(fleet: Fleet) -> None:
    """P aborts while D reads: the blocks stay held until D, told by its heartbeat,
    ends the read; then P releases."""
    count = needed(1024)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(fleet.df, fleet.dfe) as (d, d_events),
    ):
        params = await p.publish(fleet.request_id("abort-p"), 1024, fleet.src(count))
        await d.pull(params, fleet.dst(count, faulty=True), 0)
        await asyncio.sleep(0.3)
        assert await p.abort(params.request_id) is AbortState.READING
        assert p_events.pending() == 0  # not released while the read is in flight
        done = await d_events.next()
        released = await p_events.next()
    assert isinstance(done, PullDone) and done.status is PullStatus.ABORTED
    assert isinstance(released, Released) and released.reason is ReleaseReason.ABORTED


async def test_injected_chunk_failures_report_what_the_oracle_predicts(fleet: Fleet) -> None:
    tokens, computed = 1200, 256
    done, released, src, dst = await _pull_once(fleet, "faults", tokens, computed, faulty=True)
    assert done.status in (PullStatus.PARTIAL, PullStatus.FAILED) and done.failed_blocks
    groups = fleet.pe.layout.groups
    assert done.valid_tokens == oracle_valid_tokens(groups, tokens, computed, B, done.failed_blocks)
    for group_id, blocks in done.failed_blocks.items():
        assert set(blocks) <= oracle_blocks(groups[group_id], tokens, computed, B)
    moved = fleet.fault_image.expect_pull(fleet.pe, src, dst, tokens, computed, done.failed_blocks)
    assert done.bytes_moved == moved == released.bytes_read


async def test_lease_expiry_is_reported_and_the_late_pull_fails(fleet: Fleet) -> None:
    count = needed(300)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(fleet.d, fleet.de) as (d, d_events),
    ):
        params = await p.publish(fleet.request_id("expire"), 300, fleet.src(count))
        expired = await p_events.next(timeout_s=10)
        assert isinstance(expired, LeaseExpired) and expired.request_id == params.request_id
        assert expired.held_s >= 3.0
        dst = fleet.dst(count)
        await d.pull(params, dst, 0)
        done = await d_events.next()
    assert isinstance(done, PullDone) and done.status is PullStatus.FAILED
    fleet.image.accept_failed(dst, done.failed_blocks)
    await asyncio.sleep(0.3)
    fleet.image.check_all()


async def test_mismatched_layout_is_refused_on_a_real_pull(fleet: Fleet) -> None:
    dx = start_sidecar(fleet.tmp, "dx")
    dxe = start_engine(fleet.tmp, dx, MODEL, "decode", "--kv-dtype", "float8_e4m3fn", num_blocks=64)
    try:
        async with engine_link(fleet.p, fleet.pe) as (p, p_events), engine_link(dx, dxe) as (d, _):
            params = await p.publish(fleet.request_id("mismatch"), 100, fleet.src(7))
            with pytest.raises(NegotiationError) as refused:
                await d.pull(params, spans({0: range(7), 1: range(7)}), 0)
            assert await p.abort(params.request_id) is AbortState.HELD
            await p_events.next()
    finally:
        dxe.stop()
        dx.stop()
    fields = {m.field for m in refused.value.mismatches}
    assert "layout.kv_dtype" in fields
    assert "layout.kv_dtype" in str(refused.value)


async def test_bad_input_is_refused_by_field_and_the_sidecar_keeps_serving(fleet: Fleet) -> None:
    address = fleet.p.ready["engine_address"]
    async with EngineClient(address, engine_id=fleet.pe.engine_id) as p:
        with pytest.raises(InvalidInputError, match="request_id"):
            await p.publish("has space", 10, fleet.src(1))
        with pytest.raises(InvalidInputError, match=r"spans\[0\].*block_ids.*out of range"):
            await p.publish(fleet.request_id("range"), 10, spans({0: [NUM_BLOCKS + 5]}))
        with pytest.raises(InvalidInputError, match=r"spans\[1\].group_id"):
            await p.publish(fleet.request_id("dup"), 10, spans({0: [1]}) + spans({0: [2]}))
        with pytest.raises(InvalidInputError, match=r"layout\.tp_rank.*already registered"):
            await p.register(fleet.pe.layout, [])
        rank1 = layout_for_model(MODEL, tp_size=2, tp_rank=1)
        regions = [Region(t.name, "b", 0, 1, t.bytes_per_block, t.bytes_per_block)
                   for g in rank1.groups for t in g.tensors]  # fmt: skip
        small = BufferHandle("b", MemoryKind.DRAM, 4096, shm_name="kvxfer-no-such-segment")
        with pytest.raises(InvalidInputError, match=r"layout\.regions\['layer\.0\.k'\]"):
            await p.register(rank1.with_regions(regions), [small])
        big = BufferHandle("b", MemoryKind.DRAM, 1 << 24, shm_name="kvxfer-no-such-segment")
        with pytest.raises(RegistrationError, match="kvxfer-no-such-segment"):
            await p.register(rank1.with_regions(regions), [big])
        async with EngineClient(address, engine_id="e-nope") as stranger:
            with pytest.raises(NotFoundError, match="e-nope"):
                await stranger.abort("r")
    async with grpc.aio.insecure_channel(fleet.d.ready["engine_address"]) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Pull(pb.PullRequest(engine_id=fleet.de.engine_id))
        assert missing.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (missing.value.details() or "").startswith("params: missing")
    # A peer's claims are checked too: it cannot report more bytes than the request holds.
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        grpc.aio.insecure_channel(fleet.p.ready["peer_address"]) as channel,
    ):
        params = await p.publish(fleet.request_id("peer-claims"), 32, fleet.src(2))
        peer = pb_grpc.PeerServiceStub(channel)
        key = {"epoch": params.epoch, "tp_rank": 0, "request_id": params.request_id}
        token = (await peer.BeginRead(pb.BeginReadRequest(**key))).read_token
        with pytest.raises(grpc.aio.AioRpcError) as overclaim:
            claim = pb.EndReadRequest(
                **key, reason=pb.RELEASE_REASON_CONSUMED, bytes_read=1 << 40, read_token=token
            )
            await peer.EndRead(claim)
        assert overclaim.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (overclaim.value.details() or "").startswith("bytes_read:")
        await peer.EndRead(
            pb.EndReadRequest(**key, reason=pb.RELEASE_REASON_ABORTED, read_token=token)
        )
        released = await p_events.next()
        assert isinstance(released, Released) and released.request_id == params.request_id
    status = _cli("status", "--sidecar", address, "--json")  # still serving
    assert status.returncode == 0 and json.loads(status.stdout)["engines"]


def test_sync_client_publish_abort_and_events(fleet: Fleet) -> None:
    client = SyncEngineClient(fleet.p.ready["engine_address"], engine_id=fleet.pe.engine_id)
    try:
        params = client.publish(fleet.request_id("sync"), 64, fleet.src(4))
        assert params.epoch == fleet.p.ready["epoch"] and params.tp_rank == 0
        assert client.abort(params.request_id) == "held"
        events = client.events(timeout_s=10)
        released = next(events)
        events.close()
    finally:
        client.close()
    assert isinstance(released, Released) and released.request_id == params.request_id
    assert released.reason is ReleaseReason.ABORTED


async def test_engine_socket_is_private_and_health_and_reflection_answer(fleet: Fleet) -> None:
    socket_path = fleet.p.ready["engine_address"].removeprefix("unix:")
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    for address in (fleet.p.ready["peer_address"], fleet.p.ready["engine_address"]):
        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            for version in ("v1", "v1alpha"):
                names, files = await _reflect(channel, version)
                assert {"kvxfer.v1.AdminService", *REFLECTION} <= names, (version, names)
                engine = address.startswith("unix:")
                want = "kvxfer.v1.EngineService" if engine else "kvxfer.v1.PeerService"
                assert want in names
                # What `grpcurl describe` asks next: the file holding a service.
                assert {"grpc/reflection/v1/reflection.proto", "kvxfer/v1/sidecar.proto"} <= files


REFLECTION = {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


async def _reflect(channel: grpc.aio.Channel, version: str) -> tuple[set[str], set[str]]:
    """A reflection client of either version: the messages are the same bytes under
    both package names, so v1alpha's generated classes encode and decode v1's."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")] + [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        for symbol in ("grpc.reflection.v1.ServerReflection", "kvxfer.v1.AdminService")
    ]
    names: set[str] = set()
    files: set[str] = set()
    async for answer in call(iter(requests), timeout=5):
        names |= {s.name for s in answer.list_services_response.service}
        for raw in answer.file_descriptor_response.file_descriptor_proto:
            files.add(descriptor_pb2.FileDescriptorProto.FromString(raw).name)
    return names, files


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kvxfer-cli"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def _config_variant(tmp: Path, name: str, **changes: object) -> str:
    repo_models = Path(__file__).resolve().parents[1] / "kvxfer" / "profiles"
    config = json.loads((repo_models / f"{MODEL}.json").read_text())
    text = config.get("text_config", config)
    text.update(changes)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_cli_handshake_dry_run(fleet: Fleet) -> None:
    peer = fleet.p.ready["peer_address"]
    ok = _cli("handshake", "--peer", peer, "--layout", MODEL, "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["compatible"] is True and report["mismatches"] == []
    assert report["peer"]["engine_id"] == fleet.pe.engine_id
    assert report["peer"]["epoch"] == fleet.p.ready["epoch"]
    assert report["peer"]["protocol_version"] == PROTOCOL_VERSION
    kinds = [g["kind"] for g in report["agreement"]["groups"]]
    assert kinds == ["sliding_window", "full_attention"]
    text = _cli("handshake", "--peer", peer, "--layout", MODEL)
    assert text.returncode == 0 and "compatible" in text.stdout


@pytest.mark.parametrize(
    ("variant", "field"),
    [
        ("model", "layout.fingerprint"),
        ("dtype", "layout.kv_dtype"),
        ("window", "layout.groups[0].sliding_window"),
        ("missing-group", "layout.groups[1]"),
    ],
)
def test_cli_handshake_names_each_mismatch(fleet: Fleet, variant: str, field: str) -> None:
    args = ["--layout", MODEL]
    if variant == "model":
        args = ["--layout", "gemma-3-4b-it"]
    elif variant == "dtype":
        args += ["--kv-dtype", "float8_e4m3fn"]
    elif variant == "window":
        args = ["--layout", _config_variant(fleet.tmp, "w256", sliding_window=256)]
    else:
        args = ["--layout", _config_variant(fleet.tmp, "full", layer_types=["full_attention"] * 24)]
    result = _cli("handshake", "--peer", fleet.p.ready["peer_address"], *args, "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["compatible"] is False and report["agreement"] is None
    by_field = {m["field"]: m for m in report["mismatches"]}
    assert field in by_field, sorted(by_field)
    assert all(m["hint"] for m in report["mismatches"])
    assert by_field[field]["local"] != by_field[field]["peer"]


def test_cli_handshake_shows_the_block_size_mapping(fleet: Fleet) -> None:
    """A decode layout of 48-token blocks against the prefill's 16: agreed, by tokens."""
    peer = fleet.p.ready["peer_address"]
    result = _cli("handshake", "--peer", peer, "--layout", MODEL, "--block-size", "48", "--json")
    assert result.returncode == 0, result.stderr
    agreement = json.loads(result.stdout)["agreement"]
    assert (agreement["block_size"], agreement["peer_block_size"]) == (48, 16)
    assert {(g["block_mapping"], g["slice_tokens"]) for g in agreement["groups"]} == {
        ("tokens", 16)
    }
    text = _cli("handshake", "--peer", peer, "--layout", MODEL, "--block-size", "48").stdout
    assert "block size 48 <- peer's 16" in text
    assert "48-token blocks <- peer's 16-token blocks by token ranges" in text


def test_cli_handshake_unreachable_peer_names_the_address() -> None:
    result = _cli("handshake", "--peer", "127.0.0.1:9", "--layout", MODEL)
    assert result.returncode == 3  # unreachable (docs/cli.md), not incompatible (1)
    assert "127.0.0.1:9" in result.stderr and "unreachable" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_status_and_peers(fleet: Fleet) -> None:
    status = _cli("status", "--sidecar", fleet.p.ready["engine_address"], "--json")
    assert status.returncode == 0, status.stderr
    body = json.loads(status.stdout)
    assert [e["engine_id"] for e in body["engines"]] == [fleet.pe.engine_id]
    assert body["leases"] == [] and body["epoch"] == fleet.p.ready["epoch"]
    peers = _cli("peers", "--sidecar", fleet.d.ready["peer_address"], "--json")
    assert peers.returncode == 0, peers.stderr
    (link,) = json.loads(peers.stdout)["peers"]
    assert link["address"] == fleet.p.ready["peer_address"]
    assert link["epoch"] == fleet.p.ready["epoch"] and link["agent_loaded"] is True
    # Dry runs never add a peer on the serving side.
    assert (
        json.loads(_cli("peers", "--sidecar", fleet.p.ready["peer_address"], "--json").stdout)[
            "peers"
        ]
        == []
    )


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


async def test_metrics_count_what_this_test_did(fleet: Fleet) -> None:
    """Counters move by exactly what this test does (deltas around its own pulls), so
    the check holds whichever tests ran before it."""
    peer = fleet.p.ready["sidecar_id"]  # the peer label is its identity, not its address
    d0, p0, df0 = scrape(fleet.d), scrape(fleet.p), scrape(fleet.df)
    done, _, src, dst = await _pull_once(fleet, "metrics-ok", 600, 0)
    assert done.status is PullStatus.OK, done.reason
    moved = fleet.image.expect_pull(fleet.pe, src, dst, 600, 0, {})
    faulty, _, _, _ = await _pull_once(fleet, "metrics-faults", 600, 0, faulty=True)
    assert faulty.failed_blocks, "30% of chunks fail on df: some blocks must have failed"
    count = needed(100)
    async with (
        engine_link(fleet.p, fleet.pe) as (p, p_events),
        engine_link(fleet.d, fleet.de) as (d, d_events),
    ):
        aborted = await p.publish(fleet.request_id("metrics-abort"), 100, fleet.src(count))
        assert await p.abort(aborted.request_id) is AbortState.HELD
        assert isinstance(await p_events.next(), Released)
        expired = await p.publish(fleet.request_id("metrics-expire"), 100, fleet.src(count))
        assert isinstance(await p_events.next(timeout_s=10), LeaseExpired)
        for params in (aborted, expired):
            dst = fleet.dst(count)
            await d.pull(params, dst, 0)
            late = await d_events.next()
            assert isinstance(late, PullDone) and late.status is PullStatus.FAILED
            fleet.image.accept_failed(dst, late.failed_blocks)
    d1, p1, df1 = scrape(fleet.d), scrape(fleet.p), scrape(fleet.df)
    assert _delta(d0, d1, "kvxfer_bytes_moved_total", direction="read") == moved
    assert _delta(d0, d1, "kvxfer_requests_total", result="ok") == 1
    assert _delta(d0, d1, "kvxfer_requests_total", result="failed") == 2  # aborted, expired
    assert _delta(d0, d1, "kvxfer_full_attention_bytes_total", peer=peer) > moved
    # One handshake with P however many pulls went to it, in this test or before.
    assert metric(d1, "kvxfer_handshakes_total", peer=peer, result="ok") == 1
    assert metric(d1, "kvxfer_inflight_pulls") == 0
    # Pulls one at a time from P read through one agent (two where pulls overlapped).
    assert metric(d1, "kvxfer_reading_agents") in (1, 2)
    assert _delta(d0, d1, "kvxfer_transfer_active_seconds_total") > 0
    assert metric(p1, "kvxfer_active_leases") == 0 and metric(p1, "kvxfer_held_blocks") == 0
    assert _delta(p0, p1, "kvxfer_expired_leases_total") == 1
    assert _delta(p0, p1, "kvxfer_released_leases_total", reason="consumed") == 2  # d and df
    assert _delta(p0, p1, "kvxfer_released_leases_total", reason="aborted") == 1
    assert metric(df1, "kvxfer_fault_injection") == 1
    lost = sum(len(blocks) for blocks in faulty.failed_blocks.values())
    assert _delta(df0, df1, "kvxfer_failed_blocks_total") == lost
    fleet.image.check_all()


def test_sidecar_memory_stays_small(fleet: Fleet) -> None:
    for proc in (fleet.p, fleet.d, fleet.df):
        rss = rss_excluding_shm_bytes(proc.pid)
        print(f"{proc.ready['sidecar_id']}: {rss / 2**20:.1f} MiB resident, shm excluded")
        assert rss < 150 * 2**20
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the sidecar must not load torch"


def test_graceful_shutdown_leaves_nothing_behind(fleet: Fleet) -> None:
    shm = [b["shm_name"] for e in (fleet.pe, fleet.de, fleet.dfe) for b in e.ready["buffers"]]
    assert all(os.path.exists(f"/dev/shm/{name}") for name in shm)
    for engine in (fleet.de, fleet.dfe, fleet.pe):
        assert engine.stop() == 0
    for sidecar in (fleet.d, fleet.df, fleet.p):
        assert sidecar.stop(signal.SIGTERM) == 0
        assert "stopped" in sidecar.log_text()
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in shm)
