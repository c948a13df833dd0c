"""gRPC failures as kvxfer errors, on the calling side of every RPC.

The serving side maps kvxfer errors to status codes (`kvxfer.server.servicers`);
this is the inverse, so engines and the CLI catch the same exception tree as
library users. A negotiation failure comes back whole: its mismatches travel as
JSON in the `kvxfer-mismatches` trailer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio

from kvxfer._exceptions import (
    DataPlaneError,
    InvalidInputError,
    KvxferError,
    LayoutError,
    LeaseError,
    LimitExceededError,
    NegotiationError,
    NotFoundError,
    PeerDisconnectedError,
    PeerUnavailableError,
    PermissionDeniedError,
    PlanError,
    ProfileError,
    RegistrationError,
    ShuttingDownError,
    TransferError,
)
from kvxfer.core.negotiation import Mismatch

T = TypeVar("T")
MISMATCH_TRAILER = "kvxfer-mismatches"
ERROR_TRAILER = "kvxfer-error"  # the kvxfer exception class the server raised
FIELD_TRAILER = "kvxfer-field"  # its field, for InvalidInputError and subclasses
_BY_NAME: dict[str, type[KvxferError]] = {
    cls.__name__: cls
    for cls in (
        LimitExceededError,
        NotFoundError,
        LeaseError,
        PeerUnavailableError,
        ShuttingDownError,
        DataPlaneError,
        RegistrationError,
        PeerDisconnectedError,
        TransferError,
        PermissionDeniedError,
    )
}
_INPUT_BY_NAME: dict[str, type[InvalidInputError]] = {
    cls.__name__: cls for cls in (InvalidInputError, LayoutError, PlanError, ProfileError)
}


async def guarded(what: str, rpc: Callable[[], Awaitable[T]]) -> T:
    """Await one RPC; a failure becomes the kvxfer error its status stands for."""
    try:
        return await rpc()
    except grpc.aio.AioRpcError as exc:
        raise rpc_error(exc, what) from exc


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> KvxferError:
    """A failed RPC as the kvxfer error its status code stands for; `what` says which
    call against which address."""
    code, detail = exc.code(), exc.details() or ""
    trailers = {
        key: value for key, value in exc.trailing_metadata() or () if isinstance(value, str)
    }
    mismatches = _mismatches(trailers.get(MISMATCH_TRAILER))
    if mismatches:
        return NegotiationError(mismatches)
    name = trailers.get(ERROR_TRAILER, "")
    if name in _INPUT_BY_NAME:
        field = trailers.get(FIELD_TRAILER, what)
        return _INPUT_BY_NAME[name](field, detail.removeprefix(f"{field}: "))
    if name in _BY_NAME:
        return _BY_NAME[name](f"{what}: {detail}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return PeerUnavailableError(f"{what}: unreachable ({code.name}: {detail})")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(f"{what}: {detail}")
    if code is grpc.StatusCode.NOT_FOUND:
        return NotFoundError(f"{what}: {detail}")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return LeaseError(f"{what}: {detail}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return LimitExceededError(f"{what}: {detail}")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = detail.partition(": ")
        return InvalidInputError(field, message) if message else InvalidInputError(what, detail)
    return PeerUnavailableError(f"{what}: {code.name}: {detail}")


def _mismatches(trailer: str | None) -> list[Mismatch]:
    if not trailer:
        return []
    try:
        return [Mismatch(**item) for item in json.loads(trailer)]
    except (TypeError, ValueError):
        return []
