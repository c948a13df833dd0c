"""gRPC failures as kvxfer errors, on the calling side of every RPC.

The serving side maps kvxfer errors to status codes (`kvxfer.server.servicers`);
this is the inverse, so engines and the CLI catch the same exception tree as
library users. A negotiation failure comes back whole: its mismatches travel as
JSON in the `kvxfer-mismatches` trailer.
"""

from __future__ import annotations

import json

import grpc
import grpc.aio

from kvxfer._exceptions import (
    InvalidInputError,
    KvxferError,
    LeaseError,
    LimitExceededError,
    NegotiationError,
    NotFoundError,
    PeerUnavailableError,
)
from kvxfer.core.negotiation import Mismatch

MISMATCH_TRAILER = "kvxfer-mismatches"


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> KvxferError:
    """A failed RPC as the kvxfer error its status code stands for; `what` says which
    call against which address."""
    code, detail = exc.code(), exc.details() or ""
    mismatches = _mismatches(exc)
    if mismatches:
        return NegotiationError(mismatches)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return PeerUnavailableError(f"{what}: unreachable ({code.name}: {detail})")
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


def _mismatches(exc: grpc.aio.AioRpcError) -> list[Mismatch]:
    for key, value in exc.trailing_metadata() or ():
        if key == MISMATCH_TRAILER:
            try:
                return [Mismatch(**item) for item in json.loads(value)]
            except (TypeError, ValueError):
                return []
    return []
