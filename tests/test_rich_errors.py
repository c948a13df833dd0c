"""Errors as google.rpc rich status: what a client without kvxfer's code reads, and
what kvxfer's own client makes of it.

A plain generated stub and grpcio-status's `rpc_status.from_call` (what any
gRPC client has) against real kvxfer-server processes on loopback; then the
same failures through `EngineClient`; then every class of the exception tree
through the wire conversion alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from sidecars import EngineSim, engine_link, spans, start_engine, start_sidecar

from kvxfer import _exceptions as errors
from kvxfer._exceptions import InvalidInputError, KvxferError, NegotiationError, NotFoundError
from kvxfer.cli.fleet import Proc
from kvxfer.client.engine import EngineClient
from kvxfer.core.negotiation import PROTOCOL_VERSION, Mismatch
from kvxfer.server.status import status_for
from kvxfer.v1 import layout_pb2
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.errors import (
    DOMAIN,
    error_status,
    on_the_wire,
    rpc_error,
    trailers_for,
)
from kvxfer.wire.layout import span_to_proto
from kvxfer.wire.sidecar import params_to_proto

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gemma-3-4b-it"


@dataclass
class Pair:
    p: Proc
    pe: EngineSim
    dx: Proc
    dxe: EngineSim  # a decode engine whose KV dtype differs from the prefill's


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("rich")
    procs: list[Proc | EngineSim] = []
    try:
        p = start_sidecar(tmp, "p")
        procs.append(p)
        dx = start_sidecar(tmp, "dx")
        procs.append(dx)
        pe = start_engine(tmp, p, MODEL, "prefill", num_blocks=16)
        procs.append(pe)
        dxe = start_engine(tmp, dx, MODEL, "decode", "--kv-dtype", "float8_e4m3fn", num_blocks=16)
        procs.append(dxe)
        yield Pair(p, pe, dx, dxe)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _details(status: status_pb2.Status) -> dict[str, object]:
    """The status's details by type, as a client with only googleapis' protos has them."""
    out: dict[str, object] = {}
    for detail in status.details:
        for message in (
            error_details_pb2.ErrorInfo(),
            error_details_pb2.BadRequest(),
            error_details_pb2.PreconditionFailure(),
        ):
            if detail.Unpack(message):
                out[type(message).__name__] = message
    return out


def _plain_call(call: grpc.RpcError) -> tuple[status_pb2.Status, dict[str, object]]:
    status = rpc_status.from_call(call)
    assert status is not None, "no grpc-status-details-bin trailer"
    keys = {key for key, _ in call.trailing_metadata() or ()}
    assert not {k for k in keys if k.startswith("kvxfer-")}, keys
    return status, _details(status)


def test_a_field_error_names_the_field_exactly_for_any_client(pair: Pair) -> None:
    name = "é\nlayer"  # echoed back: non-ASCII and a newline survive the binary trailer
    layout = layout_pb2.EngineLayout(regions=[layout_pb2.Region(name=name, buffer="")])
    with grpc.insecure_channel(pair.p.ready["peer_address"]) as channel:
        stub = pb_grpc.PeerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Handshake(
                pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, layout=layout), timeout=20
            )
    status, details = _plain_call(refused.value)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    info, bad = details["ErrorInfo"], details["BadRequest"]
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert isinstance(bad, error_details_pb2.BadRequest)
    assert info.domain == DOMAIN and info.reason == "LAYOUT_ERROR", info
    [violation] = bad.field_violations
    assert name in violation.field and violation.field == info.metadata["field"]
    assert status.message == f"{violation.field}: {violation.description}"


def test_a_refused_body_is_a_field_error_too(pair: Pair) -> None:
    with grpc.insecure_channel(pair.p.ready["peer_address"]) as channel:
        call = channel.unary_unary("/kvxfer.v1.PeerService/BeginRead")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\xff" * 9000, timeout=20)  # over BeginRead's size cap
    _, details = _plain_call(refused.value)
    info = details["ErrorInfo"]
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.reason == "INVALID_INPUT_ERROR"
    assert info.metadata["field"] == "/kvxfer.v1.PeerService/BeginRead"


async def test_a_layout_mismatch_reads_as_violations_and_as_negotiation_error(pair: Pair) -> None:
    local = spans({0: [0, 1], 1: [0, 1]})
    async with engine_link(pair.p, pair.pe) as (prefill, events):
        params = await prefill.publish("mismatch-0", 20, spans({0: [0, 1], 1: [0, 1]}))
        request = pb.PullRequest(
            engine_id=pair.dxe.engine_id,
            params=params_to_proto(params),
            local_spans=[span_to_proto(s) for s in local],
        )
        async with grpc.aio.insecure_channel(pair.dx.ready["engine_address"]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.EngineServiceStub(channel).Pull(request, timeout=20)
        async with EngineClient(pair.dx.ready["engine_address"], engine_id=pair.dxe.engine_id) as d:
            with pytest.raises(NegotiationError) as mapped:
                await d.pull(params, local, 0)
        await prefill.abort(params.request_id)
        await events.next()
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    status, details = _plain_call(refused.value)
    info, failure = details["ErrorInfo"], details["PreconditionFailure"]
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert isinstance(failure, error_details_pb2.PreconditionFailure)
    assert info.reason == "NEGOTIATION_ERROR"
    subjects = {v.subject: v for v in failure.violations}
    assert {v.type for v in failure.violations} == {"LAYOUT_MISMATCH"}
    assert (
        "layout.kv_dtype" in subjects and "float8_e4m3fn" in subjects["layout.kv_dtype"].description
    )
    # kvxfer's client: the same mismatches, field by field, and the same message.
    assert str(mapped.value) == status.message
    assert [m.field for m in mapped.value.mismatches] == [v.subject for v in failure.violations]
    assert all(isinstance(m, Mismatch) and m.hint for m in mapped.value.mismatches)


async def test_the_kvxfer_client_gets_the_class_field_and_message_back(pair: Pair) -> None:
    address = pair.p.ready["engine_address"]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        request = pb.PublishRequest(engine_id=pair.pe.engine_id, request_id="has space")
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.Publish(request, timeout=20)
    async with EngineClient(address, engine_id=pair.pe.engine_id) as client:
        with pytest.raises(InvalidInputError) as mapped:
            await client.publish("has space", 10, spans({0: [1]}))
    _, details = _plain_call(raw.value)
    bad = details["BadRequest"]
    assert isinstance(bad, error_details_pb2.BadRequest)
    [violation] = bad.field_violations
    assert type(mapped.value) is InvalidInputError
    assert (mapped.value.field, mapped.value.detail) == (violation.field, violation.description)
    assert mapped.value.field == "request_id"
    async with EngineClient(address, engine_id="e-nope") as stranger:
        with pytest.raises(NotFoundError, match="e-nope"):
            await stranger.abort("r")


def _every_error() -> list[KvxferError]:
    mismatch = Mismatch("layout.model", "a", "b", "pair engines of one model")
    out: list[KvxferError] = []
    for name in errors.__dict__:
        cls = getattr(errors, name)
        if not (isinstance(cls, type) and issubclass(cls, KvxferError)) or cls is KvxferError:
            continue
        if issubclass(cls, InvalidInputError):
            out.append(cls("groups[2].layers", "layer 7 appears twice"))
        elif cls is NegotiationError:
            out.append(NegotiationError([mismatch]))
        elif cls is errors.BackendCreationError:
            out.append(cls("backends", "NIXL has no backend 'FOO'"))
        else:
            out.append(cls("engine 'e-1' is not registered"))
    return out


def _round_trip(exc: KvxferError, status: status_pb2.Status) -> KvxferError:
    """What a gRPC client makes of `exc` sent as `status` in its call's trailers."""
    trailers = grpc.aio.Metadata(*trailers_for(status))
    failed = grpc.aio.AioRpcError(
        status_for(exc), grpc.aio.Metadata(), trailers, details=status.message
    )
    return rpc_error(failed, "publish at sidecar unix:/x")


@pytest.mark.parametrize("exc", _every_error(), ids=lambda e: type(e).__name__)
def test_every_kvxfer_error_survives_the_wire(exc: KvxferError) -> None:
    back = _round_trip(exc, error_status(exc, status_for(exc)))
    # A LaneUnreachableError (nothing of the call was sent) is true only where it was
    # raised: it arrives as the PeerUnavailableError it is a kind of.
    assert type(back) is on_the_wire(type(exc))
    if isinstance(exc, InvalidInputError):
        assert isinstance(back, InvalidInputError)
        assert (back.field, back.detail, str(back)) == (exc.field, exc.detail, str(exc))
    elif isinstance(exc, NegotiationError):
        assert isinstance(back, NegotiationError)
        assert back.mismatches == exc.mismatches and str(back) == str(exc)
    else:
        assert str(back) == f"publish at sidecar unix:/x: {exc}"


def _huge_error(cls: type[KvxferError]) -> KvxferError:
    """An error of `cls` whose every text is far beyond what gRPC's trailers hold, with
    control characters (percent-encoded in grpc-message, escaped in JSON)."""
    text = "\x00é" * 6000
    if issubclass(cls, InvalidInputError):
        return cls(f"layout.region {text!r}.buffer", text)
    if cls is NegotiationError:
        return NegotiationError([Mismatch(f"layout.{i}", text, text, text) for i in range(300)])
    if cls is errors.BackendCreationError:
        return cls("backends", text)
    return cls(text)


def _trailer_bytes(status: status_pb2.Status) -> int:
    """The trailers' bytes as gRPC counts them against its limits: grpc-message
    percent-encoded, grpc-status-details-bin decoded (each with its key)."""
    message = sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in status.message.encode())
    return len("grpc-message") + message + len("grpc-status-details-bin") + status.ByteSize()


@pytest.mark.parametrize(
    "cls",
    [type(e) for e in _every_error()],
    ids=lambda c: c.__name__,
)
def test_a_status_fits_grpcs_trailers_whatever_its_error_holds(cls: type[KvxferError]) -> None:
    exc = _huge_error(cls)
    status = error_status(exc, status_for(exc))
    assert _trailer_bytes(status) < 7.5 * 1024  # gRPC refuses some beyond 8 KiB, all at 16
    back = _round_trip(exc, status)
    assert type(back) is on_the_wire(type(exc))
    if isinstance(exc, InvalidInputError):
        assert isinstance(back, InvalidInputError)
        assert back.field.startswith("layout.region ") and back.field.endswith(" bytes)")
    if isinstance(exc, NegotiationError):
        assert isinstance(back, NegotiationError) and back.mismatches
        assert back.mismatches[0].field == "layout.0"


def test_a_status_from_grpc_itself_still_maps_by_code(tmp_path: Path) -> None:
    failed = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no route"
    )
    back = rpc_error(failed, f"pull at sidecar unix:{tmp_path}/e.sock")
    assert isinstance(back, errors.PeerUnavailableError) and "unreachable" in str(back)
