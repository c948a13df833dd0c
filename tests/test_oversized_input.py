"""Values from the wire far longer than any valid one, at a real sidecar over real gRPC.

A port or pid of thousands of digits must be refused naming its field, not reach
`int()` (which raises a plain ValueError above 4300 digits: INTERNAL). A refused id
of thousands of characters must come back as the error naming its field, not be
echoed into a status too large for gRPC's trailers (the client then sees only
RESOURCE_EXHAUSTED "Stream removed"). Every answer stays a clear status, and the
sidecar serves on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sidecars import OneEngine, one_engine, spans

from kvxfer._exceptions import InvalidInputError, NotFoundError
from kvxfer.client.engine import EngineClient
from kvxfer.client.shm import ShmKVCache
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import check_address
from kvxfer.server.callers import PID_METADATA, claimed_pid
from kvxfer.v1 import layout_pb2
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.layout import layout_to_proto
from kvxfer.wire.sidecar import MAX_BUFFERS, handle_to_proto, params_to_proto

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "llama-3.1-8b"  # one full-attention group
ME = ((PID_METADATA, str(os.getpid())),)  # this process, as an engine claims itself
DIGITS = "1" * 4301  # one past Python's int() limit for decimal strings


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneEngine]:
    with one_engine(tmp_path_factory.mktemp("oversized"), MODEL) as made:
        yield made


def _field_violation(error: grpc.RpcError) -> str:
    """The field a refused call's rich status names (INVALID_ARGUMENT only)."""
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            [violation] = bad.field_violations
            return str(violation.field)
    raise AssertionError(f"no BadRequest in {status}")


async def _still_serves(setup: OneEngine) -> None:
    async with EngineClient(setup.address, engine_id=setup.engine.engine_id) as client:
        params = await client.publish("after-oversized", 32, spans({0: [0, 1]}))
        assert await client.abort(params.request_id) == "held"


def test_a_port_or_pid_of_thousands_of_digits_is_a_field_error() -> None:
    with pytest.raises(InvalidInputError) as port:
        check_address(f"h:{DIGITS}", "params.peer_address")
    assert port.value.field == "params.peer_address"
    # Leading zeros are read as before, however many (only significant digits count).
    assert check_address("h:000080", "x") == "h:000080"
    assert check_address("h:" + "0" * 5000 + "80", "x").endswith("080")
    with pytest.raises(InvalidInputError) as wide:
        check_address("h:0123456", "params.peer_address")
    assert wide.value.field == "params.peer_address"
    assert check_address("h:65535", "x") == "h:65535"
    with pytest.raises(InvalidInputError) as pid:
        claimed_pid([(PID_METADATA, DIGITS)])
    assert pid.value.field == PID_METADATA
    assert claimed_pid([(PID_METADATA, "4194303")]) == (1 << 22) - 1


@pytest.mark.parametrize("method", ["Pull", "Push"])
async def test_a_peer_port_of_thousands_of_digits_is_invalid_argument(
    setup: OneEngine, method: str
) -> None:
    async with EngineClient(setup.address, engine_id=setup.engine.engine_id) as client:
        params = await client.publish(f"digits-{method}", 32, spans({0: [2, 3]}))
        await client.abort(params.request_id)
    wire = params_to_proto(params)
    wire.peer_address = f"h:{DIGITS}"
    request_type = pb.PullRequest if method == "Pull" else pb.PushRequest
    request = request_type(engine_id=setup.engine.engine_id, params=wire)
    async with grpc.aio.insecure_channel(setup.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await getattr(stub, method)(request, timeout=30)
    assert _field_violation(refused.value) == "params.peer_address"
    await _still_serves(setup)


async def test_an_engine_pid_of_thousands_of_digits_is_invalid_argument(setup: OneEngine) -> None:
    cache = ShmKVCache(layout_for_model(MODEL, tp_size=2, tp_rank=1), 4, "oversized")
    try:
        request = pb.RegisterEngineRequest(
            layout=layout_to_proto(cache.layout),
            buffers=[handle_to_proto(h) for h in cache.buffers],
        )
        async with grpc.aio.insecure_channel(setup.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterEngine(request, metadata=((PID_METADATA, DIGITS),), timeout=30)
    finally:
        cache.close()
    assert _field_violation(refused.value) == PID_METADATA
    await _still_serves(setup)


LONG_ID = "x" * 9000 + " "  # refused; echoed whole, its error overflowed gRPC's trailers


async def test_a_long_request_id_is_a_field_error_over_grpc(setup: OneEngine) -> None:
    """Not RESOURCE_EXHAUSTED "Stream removed (received metadata size exceeds hard
    limit)": the request id was echoed, twice, into the status trailers."""
    async with EngineClient(setup.address, engine_id=setup.engine.engine_id, lane=False) as c:
        with pytest.raises(InvalidInputError) as refused:
            await c.publish(LONG_ID, 32, spans({0: [0, 1]}))
    assert refused.value.field == "request_id"
    assert "(9001 characters)" in refused.value.detail and len(str(refused.value)) < 200
    async with grpc.aio.insecure_channel(setup.address) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        request = pb.PublishRequest(engine_id=setup.engine.engine_id, request_id=LONG_ID)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.Publish(request, timeout=30)
    assert _field_violation(raw.value) == "request_id"
    async with EngineClient(setup.address, engine_id="e" * 9000, lane=False) as stranger:
        with pytest.raises(NotFoundError, match=r"\(9000 characters\) is not registered"):
            await stranger.abort("r")
    await _still_serves(setup)


async def test_a_long_name_in_a_field_path_still_fits_the_status(setup: OneEngine) -> None:
    """A region name is part of the field path of its error; whatever a message holds,
    the status is cut to fit (kvxfer.wire.errors.STATUS_BYTES)."""
    name = "r\n" * 6000
    layout = layout_pb2.EngineLayout(regions=[layout_pb2.Region(name=name, buffer="")])
    async with grpc.aio.insecure_channel(setup.sidecar.ready["peer_address"]) as channel:
        stub = pb_grpc.PeerServiceStub(channel)
        request = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, layout=layout)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Handshake(request, timeout=30)
    field = _field_violation(refused.value)
    assert field.startswith("layout.region 'r\n") and field.endswith(" bytes)")
    assert len(field.encode()) <= 256
    await _still_serves(setup)


async def test_an_engine_registering_more_buffers_than_the_limit_is_refused(
    setup: OneEngine,
) -> None:
    """Each buffer is mapped and registered with NIXL: a list without end would walk the
    sidecar toward the kernel's map limit. Refused before any is opened, naming it."""
    cache = ShmKVCache(layout_for_model(MODEL, tp_size=2, tp_rank=1), 4, "too-many")
    try:
        real = [handle_to_proto(h) for h in cache.buffers]
        spare = [pb.BufferHandle(name=f"spare-{i}") for i in range(MAX_BUFFERS)]
        request = pb.RegisterEngineRequest(
            layout=layout_to_proto(cache.layout), buffers=[*real, *spare]
        )
        async with grpc.aio.insecure_channel(setup.address) as channel:
            stub = pb_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RegisterEngine(request, metadata=ME, timeout=30)
    finally:
        cache.close()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _field_violation(refused.value) == "buffers"
    assert f"exceed the limit of {MAX_BUFFERS}" in (refused.value.details() or "")
    await _still_serves(setup)
