"""How a failed call ends: the one table from kvxfer errors to gRPC status codes.

`abort_with` ends a call with the error's status code, its message (which names
the field or entity) and the google.rpc rich status built by
`kvxfer.wire.errors.error_status` (ErrorInfo, BadRequest, PreconditionFailure
in `grpc-status-details-bin`). Anything that is not a kvxfer error is logged
and answered INTERNAL, and the sidecar keeps serving.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc
import grpc.aio

from kvxfer._exceptions import (
    DataPlaneError,
    InvalidInputError,
    KvxferError,
    LeaseError,
    LimitExceededError,
    NegotiationError,
    NotFoundError,
    PeerDisconnectedError,
    PeerUnavailableError,
    PermissionDeniedError,
    RegistrationError,
    ShuttingDownError,
)
from kvxfer.wire.errors import error_status, trailers_for

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

# Most specific first: the first matching class wins.
STATUS_FOR: tuple[tuple[type[KvxferError], grpc.StatusCode], ...] = (
    (RegistrationError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NegotiationError, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (PeerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (PeerDisconnectedError, grpc.StatusCode.UNAVAILABLE),
    (DataPlaneError, grpc.StatusCode.INTERNAL),
)


def status_for(exc: KvxferError) -> grpc.StatusCode:
    for cls, code in STATUS_FOR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: Context, exc: BaseException) -> NoReturn:
    """End the call for `exc`: its status and rich details, or INTERNAL (logged)."""
    if isinstance(exc, KvxferError):
        code = status_for(exc)
        status = error_status(exc, code)
        await context.abort(code, status.message, trailing_metadata=trailers_for(status))
    log.error("unexpected error serving an RPC", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the sidecar log"
    )
