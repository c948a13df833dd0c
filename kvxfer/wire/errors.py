"""kvxfer errors as google.rpc rich status, both ways.

The serving side ends a failed call with a `google.rpc.Status` in the standard
`grpc-status-details-bin` trailer (`error_status`), so grpcurl and clients in
any language read it without kvxfer's code:

- `ErrorInfo`: `reason` is the kvxfer exception class in UPPER_SNAKE
  (`LAYOUT_ERROR`, `NEGOTIATION_ERROR`), `domain` is `DOMAIN`; `metadata` holds
  `field` for input errors and, for a negotiation failure, `mismatches` (a JSON
  list of {field, local, peer, hint}, so a client can rebuild them exactly).
- `BadRequest`: one field violation (field path, what is wrong) for input errors.
- `PreconditionFailure`: one `LAYOUT_MISMATCH` violation per mismatch (subject:
  the layout field), for a negotiation failure.

A status always fits gRPC's limit on trailers (`MESSAGE_BYTES`, `STATUS_BYTES`):
one that did not would reach the client as RESOURCE_EXHAUSTED "Stream removed",
without its code, field or message. Texts too long are cut, saying how long they
were; of a negotiation failure's mismatches, as many as fit are sent.

The calling side maps a failure back (`rpc_error`), so engines and the CLI catch
the same exception, field and message as library users. A status without
kvxfer's ErrorInfo (from gRPC itself: deadline, unreachable) is mapped by code.
The old `kvxfer-*` trailers are gone: both sides ship together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, astuple
from typing import TypeVar

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2

from kvxfer._exceptions import (
    BackendCreationError,
    BusyError,
    DataPlaneError,
    InvalidInputError,
    KvxferError,
    LaneUnreachableError,
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
    UnsupportedModelError,
)
from kvxfer.core.negotiation import Mismatch

log = logging.getLogger(__name__)
T = TypeVar("T")
DOMAIN = "kvxfer.dev"
DETAILS_TRAILER = "grpc-status-details-bin"  # the standard key (grpcio-status's too)
MISMATCH_TYPE = "LAYOUT_MISMATCH"  # PreconditionFailure.Violation.type of a mismatch
_INPUT_CLASSES: tuple[type[InvalidInputError], ...] = (
    InvalidInputError,
    LayoutError,
    PlanError,
    ProfileError,
    UnsupportedModelError,
)
_OTHER_CLASSES: tuple[type[KvxferError], ...] = (
    BusyError,
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


def reason(cls: type[BaseException]) -> str:
    """`ErrorInfo.reason` of a kvxfer error class: `LayoutError` -> `LAYOUT_ERROR`."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper()


# Errors only the side that raised them can know to be true travel as their base class:
# a LaneUnreachableError says nothing of the call was sent, and a caller told so by a
# peer that passed one on would send its own call again by another way; the option a
# BackendCreationError blames is a setting of the sidecar that raised it.
_LOCAL_ONLY: dict[type[KvxferError], type[KvxferError]] = {
    LaneUnreachableError: PeerUnavailableError,
    BackendCreationError: DataPlaneError,
}


def on_the_wire(cls: type[KvxferError]) -> type[KvxferError]:
    """The class an error of `cls` arrives as at the other end of a call."""
    return _LOCAL_ONLY.get(cls, cls)


_INPUT_BY_REASON = {reason(cls): cls for cls in _INPUT_CLASSES}
_OTHER_BY_REASON = {reason(cls): cls for cls in _OTHER_CLASSES}


# gRPC refuses received metadata above 8 KiB at random and above 16 KiB always
# (grpc.max_metadata_size, grpc.absolute_max_metadata_size), counting a -bin trailer
# decoded. A status travels twice: its message as grpc-message (percent-encoded, up to
# 3 bytes a byte) and the whole status in DETAILS_TRAILER. A status goes as it is when
# it fits (a negotiation failure of 7 mismatches is some 7 KiB in all); one that does
# not (a value from the wire echoed whole, many mismatches) has its texts cut, and
# keeps as many mismatches as fit: a client rebuilds the message from them.
TRAILER_BYTES = 7 << 10  # grpc-message and the status together; 1 KiB left for the rest
MESSAGE_BYTES = 1024  # a cut status.message, and a cut field violation's description
FIELD_BYTES = 256  # a cut field path (it may hold a name taken from the request)
MISMATCH_BYTES = 512  # each text of a mismatch, when cut (the peer's come from the wire)


def error_status(exc: KvxferError, code: grpc.StatusCode) -> status_pb2.Status:
    """The rich status a servicer ends a call with when `exc` was raised; it always
    fits in gRPC's trailers (`trailer_bytes` at most TRAILER_BYTES)."""
    mismatches = list(exc.mismatches) if isinstance(exc, NegotiationError) else []
    whole = _status(exc, code, mismatches, cut=False)
    if trailer_bytes(whole) <= TRAILER_BYTES:
        return whole
    if not mismatches:
        return _status(exc, code, [])  # its texts cut: fits by MESSAGE_BYTES and FIELD_BYTES
    # Mismatches are what makes a negotiation status long: as many as fit, their texts
    # cut shorter when not even one does (JSON writes a control character in 6 bytes).
    for limit in (MISMATCH_BYTES, MISMATCH_BYTES // 16):
        cut = [Mismatch(*(clip(t, limit) for t in astuple(m))) for m in mismatches]
        for count in range(len(cut), 0, -1):
            status = _status(exc, code, cut[:count])
            if trailer_bytes(status) <= TRAILER_BYTES:
                return status
    return status  # one mismatch of 32-byte texts: fits, though its texts were cut


def trailer_bytes(status: status_pb2.Status) -> int:
    """What `status` adds to a call's trailers as gRPC counts them: grpc-message
    percent-encoded, the serialized status as it is."""
    printable = sum(0x20 <= b < 0x7F and b != 0x25 for b in status.message.encode())
    return 3 * len(status.message.encode()) - 2 * printable + status.ByteSize()


def _status(
    exc: KvxferError, code: grpc.StatusCode, mismatches: list[Mismatch], cut: bool = True
) -> status_pb2.Status:
    """The status of `exc` with these mismatches; with `cut`, its texts cut to size."""
    field_bytes, message_bytes = (FIELD_BYTES, MESSAGE_BYTES) if cut else (None, None)
    info = error_details_pb2.ErrorInfo(reason=reason(on_the_wire(type(exc))), domain=DOMAIN)
    details: list[error_details_pb2.BadRequest | error_details_pb2.PreconditionFailure] = []
    if isinstance(exc, InvalidInputError):
        field = clip(exc.field, field_bytes)
        info.metadata["field"] = field
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=clip(exc.detail, message_bytes), reason=info.reason
        )
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if mismatches:
        info.metadata["mismatches"] = json.dumps([asdict(m) for m in mismatches])
        violations = [
            error_details_pb2.PreconditionFailure.Violation(
                type=MISMATCH_TYPE,
                subject=m.field,
                description=f"local {m.local}, peer {m.peer} ({m.hint})",
            )
            for m in mismatches
        ]
        details.append(error_details_pb2.PreconditionFailure(violations=violations))
    status = status_pb2.Status(code=code.value[0], message=clip(str(exc), message_bytes))
    for message in (info, *details):
        status.details.add().Pack(message)
    return status


def clip(text: str, limit: int | None) -> str:
    """`text` in at most `limit` bytes of UTF-8 (None: no limit), ending with how long
    it was if cut."""
    data = text.encode(errors="replace")  # a lone surrogate could not be sent at all
    if limit is None or len(data) <= limit:
        return data.decode()
    note = f"... ({len(data)} bytes)"
    return data[: max(0, limit - len(note))].decode(errors="ignore") + note


def trailers_for(status: status_pb2.Status) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries `status` (`context.abort(..., trailers)`)."""
    return ((DETAILS_TRAILER, status.SerializeToString()),)


def backstop_s(deadline_s: float) -> float:
    """How long a call with a gRPC deadline of `deadline_s` may stay unanswered before
    its caller stops waiting on gRPC: twice the deadline, and at least a second more."""
    return deadline_s + max(deadline_s, 1.0)


async def guarded(what: str, rpc: Callable[[], Awaitable[T]], deadline_s: float | None = None) -> T:
    """Await one RPC; a failure becomes the kvxfer error its status stands for.

    `deadline_s` is the deadline the call was given. gRPC ends the call by then; should
    a completion ever not reach the loop, a call still unanswered `backstop_s(deadline_s)`
    after it started is cancelled here and ends as its deadline would,
    PeerUnavailableError."""
    if deadline_s is None:
        try:
            return await rpc()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, what) from exc
    limit = backstop_s(deadline_s)
    try:
        async with asyncio.timeout(limit) as scope:
            return await rpc()
    except grpc.aio.AioRpcError as exc:
        raise rpc_error(exc, what) from exc
    except TimeoutError:
        if not scope.expired():
            raise
        log.error(
            "%s: no answer from gRPC within %.3g s (its deadline %.3g s)", what, limit, deadline_s
        )
        raise PeerUnavailableError(
            f"{what}: unreachable (no answer within {limit:g}s; "
            f"the call's deadline was {deadline_s:g}s)"
        ) from None


def rpc_error(exc: grpc.aio.AioRpcError, what: str) -> KvxferError:
    """A failed RPC as the kvxfer error it carries (or its status code stands for);
    `what` says which call against which address."""
    status = rich_status(exc.trailing_metadata() or ())
    return status_error(exc.code(), exc.details() or "", status, what)


def lane_error(status: status_pb2.Status, what: str) -> KvxferError:
    """A call failed on the engine lane, which sends the status the gRPC path puts in
    its trailer: the same kvxfer error as `rpc_error` makes of it."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return status_error(code, status.message, status if status.details else None, what)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_error(
    code: grpc.StatusCode, detail: str, status: status_pb2.Status | None, what: str
) -> KvxferError:
    """The kvxfer error a failed call's status code, message and rich status stand for."""
    info = _error_info(status.details) if status is not None else None
    if status is not None and info is not None:
        error = _kvxfer_error(status, info, detail, what)
        if error is not None:
            return error
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


def rich_status(trailers: Iterable[tuple[str, str | bytes]]) -> status_pb2.Status | None:
    """The google.rpc.Status in `trailers`, if one is there and decodes."""
    for key, value in trailers:
        if key == DETAILS_TRAILER and isinstance(value, bytes):
            try:
                status = status_pb2.Status.FromString(value)
            except DecodeError:
                return None
            return status if status.code != code_pb2.OK else None
    return None


def _error_info(details: Iterable[any_pb2.Any]) -> error_details_pb2.ErrorInfo | None:
    for detail in details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:  # False for another type
            return info
    return None


def _kvxfer_error(
    status: status_pb2.Status, info: error_details_pb2.ErrorInfo, detail: str, what: str
) -> KvxferError | None:
    if info.reason == reason(NegotiationError):
        mismatches = _mismatches(info.metadata.get("mismatches", ""))
        return NegotiationError(mismatches) if mismatches else None
    if info.reason in _INPUT_BY_REASON:
        field = info.metadata.get("field", what)
        message = _violation(status, field)
        if message is None:
            message = detail.removeprefix(f"{field}: ")
        return _INPUT_BY_REASON[info.reason](field, message)
    if info.reason in _OTHER_BY_REASON:
        return _OTHER_BY_REASON[info.reason](f"{what}: {detail}")
    return None


def _violation(status: status_pb2.Status, field: str) -> str | None:
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            for violation in bad.field_violations:
                if violation.field == field:
                    return violation.description
    return None


def _mismatches(text: str) -> list[Mismatch]:
    try:
        return [Mismatch(**item) for item in json.loads(text)]
    except (TypeError, ValueError):
        return []
