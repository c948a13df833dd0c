"""Fuzz tier: hostile request bodies at every RPC of a real running sidecar.

Every RPC of EngineService, PeerService and AdminService (taken from the proto
descriptors, so a new RPC is fuzzed without editing this file) gets generated,
mutated and raw-byte request bodies (tests/fuzz_bodies.py) through a generic
gRPC call with identity serializers. For each body: the status is never
UNKNOWN or INTERNAL (bad input gets a clear code), and the sidecar's log
(its captured stderr) gains no traceback. Afterwards the fuzzed sidecar must
still complete a real, byte-checked pull.

The sidecars run in a network namespace with loopback only, so a fuzzed
`params.peer_address` can reach nothing outside it; the test reaches the TCP
peer port through a unix-socket forwarder (tests/unix_forward.py).

Each (RPC, address, kind of body) is its own test, so that today's failure on
undecodable bodies does not hide what generated, well-formed ones find.
Budget: KVXFER_TEST_FUZZ_EXAMPLES bodies per test (default 150: 42 tests, about a
minute in all). The longer documented run (docs/reliability.md):
    KVXFER_TEST_FUZZ_EXAMPLES=2000 .venv/bin/pytest tests/test_fuzz.py
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import netns
import pytest
from fuzz_bodies import KINDS, Vocabulary, bodies
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from netns import Host
from oracle import oracle_blocks
from sidecars import DecodeImage, EngineSim, engine_link, spans

from kvxfer.cli.fleet import Proc, spawn
from kvxfer.client.engine import SyncEngineClient
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.requests import PullDone, PullStatus, Released
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.layout import layout_to_proto, span_to_proto
from kvxfer.wire.sidecar import params_to_proto

EXAMPLES = int(os.environ.get("KVXFER_TEST_FUZZ_EXAMPLES", "150"))
MODEL = "gpt-oss-20b"
B = 16
NUM_BLOCKS = 256
ENGINE_ARGS = ("--model", MODEL, "--num-blocks", str(NUM_BLOCKS), "--state-blocks", "1")
BAD_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
UNARY_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 0.5  # a valid WatchEvents streams until cancelled

_WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120 + EXAMPLES)]
if _WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=f"fuzz tier (isolated namespace): {_WHY_NOT}"))


@dataclass(frozen=True)
class Target:
    service: str
    method: str
    request: Descriptor
    streaming: bool
    port: str  # "engine" (unix socket) or "peer" (TCP, through the forwarder)

    @property
    def path(self) -> str:
        return f"/kvxfer.v1.{self.service}/{self.method}"

    def __str__(self) -> str:
        return f"{self.port}:{self.service}.{self.method}"


def _targets() -> list[Target]:
    ports = {"EngineService": ("engine",), "PeerService": ("peer",)}
    found = []
    for service in pb.DESCRIPTOR.services_by_name.values():
        for port in ports.get(service.name, ("engine", "peer")):  # AdminService: both
            for method in service.methods:
                streaming = method.server_streaming
                found.append(Target(service.name, method.name, method.input_type, streaming, port))
    return found


# Unregister last: a fuzzed one may unregister the engines the other RPCs look up.
TARGETS = sorted(_targets(), key=lambda t: t.method == "Unregister")


@dataclass
class FuzzFleet:
    tmp: Path
    host: Host
    p: Proc
    pe: EngineSim
    d: Proc
    de: EngineSim
    peer_address: str  # unix socket forwarded to p's peer port
    vocabulary: Vocabulary


def _vocabulary(p: Proc, pe: EngineSim, d: Proc, de: EngineSim) -> Vocabulary:
    """Real ids, epochs and messages, so that fuzzed requests get past the first lookup:
    held requests to read, and one near-valid request of every type (mutated too)."""
    client = SyncEngineClient(p.ready["engine_address"], engine_id=pe.engine_id)
    try:
        held = [client.publish(f"fuzz-held-{i}", 100 + i, spans({0: range(7), 1: range(7)}))
                for i in range(3)]  # fmt: skip
    finally:
        client.close()
    epoch, ids = p.ready["epoch"], [h.request_id for h in held]
    layout = layout_to_proto(pe.layout)
    local = [span_to_proto(s) for s in spans({0: range(7, 14), 1: range(7, 14)})]
    buffer = pb.BufferHandle(
        name=pe.buffer_names()[0], kind=pb.MEMORY_KIND_DRAM, size_bytes=1 << 20,
        shm_name="kvxfer-fuzz-no-such-segment",
    )  # fmt: skip
    requests = [
        pb.RegisterEngineRequest(layout=layout, buffers=[buffer], engine_name="fuzz"),
        pb.PublishRequest(
            engine_id=pe.engine_id,
            request_id="fuzz-new",
            num_tokens=100,
            spans=[span_to_proto(s) for s in held[0].spans],
        ),
        # p pulling from itself (issue 10: INTERNAL from NIXL)
        pb.PullRequest(engine_id=pe.engine_id, params=params_to_proto(held[0]), local_spans=local),
        pb.AbortRequest(engine_id=pe.engine_id, request_id=ids[1]),
        pb.WatchEventsRequest(engine_id=pe.engine_id),
        pb.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, sidecar_id="fuzz", layout=layout, dry_run=True
        ),
        pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, sidecar_id="fuzz", layout=layout),
        pb.BeginReadRequest(epoch=epoch, request_id=ids[2]),
        pb.HeartbeatRequest(epoch=epoch, request_ids=ids),
        pb.EndReadRequest(epoch=epoch, request_id=ids[2], reason=pb.RELEASE_REASON_CONSUMED),
    ]  # no Unregister: the engines must stay registered for the other RPCs to get far
    known: dict[str, list[Message]] = {
        "kvxfer.v1.EngineLayout": [layout, layout_to_proto(de.layout)],
        "kvxfer.v1.TransferParams": [params_to_proto(h) for h in held],
        "kvxfer.v1.BlockSpan": [span_to_proto(s) for s in held[0].spans],
    }
    for request in requests:
        known.setdefault(request.DESCRIPTOR.full_name, []).append(request)
    return Vocabulary(
        strings=(
            pe.engine_id,
            de.engine_id,
            *ids,
            p.ready["peer_address"],
            d.ready["peer_address"],
            pe.buffer_names()[0],
        ),
        ints=(epoch, d.ready["epoch"], 100, 7, 128),
        messages=known,
    )


@contextlib.contextmanager
def running_fleet(tmp: Path) -> Iterator[FuzzFleet]:
    """Sidecars p and d with an engine each, in a loopback-only namespace; p's peer
    port forwarded to a unix socket."""
    with netns.isolated_host() as host:
        procs: list[Proc | EngineSim] = []
        try:
            # Held requests outlive the tier, so BeginRead and friends find them throughout.
            p = netns.start_sidecar(tmp, host, "p", "--lease.ttl-s", "900")
            procs.append(p)
            d = netns.start_sidecar(tmp, host, "d")
            procs.append(d)
            pe = netns.start_engine(tmp, host, p, "prefill", *ENGINE_ARGS)
            procs.append(pe)
            de = netns.start_engine(tmp, host, d, "decode", *ENGINE_ARGS)
            procs.append(de)
            forward = host.run([sys.executable, str(Path(__file__).with_name("unix_forward.py")),
                                str(tmp / "p-peer.sock"), p.ready["peer_address"]])  # fmt: skip
            forwarder = spawn("forwarder", forward, tmp / "forwarder.log")
            procs.append(forwarder)
            yield FuzzFleet(
                tmp, host, p, pe, d, de, forwarder.ready["address"], _vocabulary(p, pe, d, de)
            )
        finally:
            for proc in reversed(procs):
                with contextlib.suppress(OSError):
                    proc.stop()


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzFleet]:
    with running_fleet(tmp_path_factory.mktemp("fuzz")) as fleet:
        yield fleet


def call(channel: grpc.Channel, target: Target, body: bytes) -> tuple[grpc.StatusCode, str]:
    """Send `body` as the request, as bytes (identity serializers); the final status."""
    try:
        if target.streaming:
            stream = channel.unary_stream(target.path)(body, timeout=STREAM_TIMEOUT_S)
            for _ in stream:
                break
            stream.cancel()
        else:
            channel.unary_unary(target.path)(body, timeout=UNARY_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


class LogTail:
    """What a process wrote to its log since the last look."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size

    def new_text(self) -> str:
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        self.offset += len(data)
        return data.decode(errors="replace")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_hostile_bodies_get_a_clear_status_and_no_traceback(
    fuzz: FuzzFleet, target: Target, kind: str
) -> None:
    address = fuzz.p.ready["engine_address"] if target.port == "engine" else fuzz.peer_address
    log = LogTail(fuzz.p.log)

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example],
    )  # fmt: skip
    @given(bodies(target.request, fuzz.vocabulary, kind))
    def one_body(body: bytes) -> None:
        code, details = call(channel, target, body)
        fuzz.p.check_alive()
        assert code not in BAD_CODES, f"{target} got {code.name} {details!r} for {kind} {body!r}"
        logged = log.new_text()
        assert "Traceback" not in logged, f"{target}, {kind} {body!r} logged:\n{logged[-3000:]}"

    with grpc.insecure_channel(address) as channel:
        one_body()


async def test_the_fuzzed_sidecar_still_completes_a_real_pull(fuzz: FuzzFleet) -> None:
    """After every RPC was fuzzed, fresh engines on the same sidecars move bytes."""
    fuzz.p.check_alive()
    fuzz.d.check_alive()
    for engine in (fuzz.pe, fuzz.de):  # fuzzed Unregister calls may have unregistered them
        engine.stop()
    # Rank 1 of 2: the fuzzer began reads of rank 0's published blocks and never ended
    # them, so rank 0 stays retiring (its memory still being read) until their lease TTL.
    rank = ("--tp-size", "2", "--tp-rank", "1")
    pe = netns.start_engine(fuzz.tmp, fuzz.host, fuzz.p, "prefill", *ENGINE_ARGS, *rank)
    de = netns.start_engine(fuzz.tmp, fuzz.host, fuzz.d, "decode", *ENGINE_ARGS, *rank)
    try:
        tokens = 1000
        count = -(-tokens // B)
        src = spans({0: range(count), 1: range(count)})
        dst = spans({0: range(count, 2 * count), 1: range(2 * count, 3 * count)})
        async with (
            engine_link(fuzz.p, pe) as (p, p_events),
            engine_link(fuzz.d, de) as (d, d_events),
        ):
            params = await p.publish("after-fuzz", tokens, src)
            await d.pull(params, dst, 0)
            done = await d_events.next(timeout_s=60)
            released = await p_events.next(timeout_s=60)
        assert isinstance(done, PullDone) and done.status is PullStatus.OK, done
        assert isinstance(released, Released) and released.request_id == "after-fuzz"
        image = DecodeImage(de)
        moved = image.expect_pull(pe, src, dst, tokens, 0, {})
        image.check_all()
        layout = pe.layout  # rank 1 of 2: half the heads of the full model
        exact = sum(len(oracle_blocks(g, tokens, 0, B)) * g.bytes_per_block for g in layout.groups)
        assert done.bytes_moved == moved == exact
    finally:
        pe.stop()
        de.stop()
