"""Requests and what happens to them: transfer params, pull outcomes, lease events.

These are the domain objects the engine link speaks (docs/architecture.md,
"A request's life"): `TransferParams` go from the prefill engine through the router to the
decode engine; `PullDone`, `Released` and `LeaseExpired` are the events an
engine watches. All validate themselves, so a value decoded from the wire is
either whole or a field-named error.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvxfer._exceptions import InvalidInputError, shown
from kvxfer.core.layout import MAX_TOKENS, BlockSpan, check_int

# Matched with fullmatch: a `$` pattern also accepts a trailing newline.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}")
MAX_EPOCH = (1 << 53) - 1  # exact in a float, so it can be a Prometheus sample too


def check_request_id(value: str, field: str = "request_id") -> str:
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise InvalidInputError(
            field, f"must be 1-256 printable ASCII characters without spaces, got {shown(value)}"
        )
    return value


def check_address(
    value: str, field: str, *, allow_unix: bool = False, allow_port_zero: bool = False
) -> str:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`), or `unix:PATH` where allowed. Port 0 (pick a
    free one) only for addresses this process binds."""
    if not isinstance(value, str):  # from JSON (router params, config files): anything
        raise InvalidInputError(field, f"must be a string, got {type(value).__name__}")
    if allow_unix and value.startswith("unix:"):
        if len(value) <= len("unix:") or len(value) > 108 + len("unix:"):
            raise InvalidInputError(
                field, f"unix socket path must be 1-108 bytes, got {shown(value)}"
            )
        return value
    host, sep, port = value.rpartition(":")
    lowest = 0 if allow_port_zero else 1
    # At most 5 significant digits before int(): Python refuses to convert over 4300 (a
    # ValueError no caller expects), and no port needs more (leading zeros as before).
    number = port.lstrip("0") or "0"
    digits = port.isascii() and port.isdigit() and len(number) <= 5
    if not sep or not digits or not lowest <= int(number) < 65536:
        form = "HOST:PORT or unix:PATH" if allow_unix else "HOST:PORT"
        raise InvalidInputError(
            field, f"must be {form} with a port in {lowest}-65535, got {shown(value)}"
        )
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError as exc:
            raise InvalidInputError(field, f"bad IPv6 address in {shown(value)}") from exc
    elif not _HOST.fullmatch(host):
        raise InvalidInputError(field, f"bad host in {shown(value)}")
    return value


class PullStatus(enum.StrEnum):
    OK = "ok"  # every planned block arrived
    PARTIAL = "partial"  # some blocks failed; resume from valid_tokens
    FAILED = "failed"  # nothing usable arrived beyond what was held
    ABORTED = "aborted"  # an engine aborted the request first


class TransferMode(enum.StrEnum):
    """Who starts a transfer: the decode side reads (pull) or the prefill side writes
    (push, into blocks the decode engine announced)."""

    PULL = "pull"
    PUSH = "push"


class AbortState(enum.StrEnum):
    """What an aborted request was doing when the abort arrived."""

    HELD = "held"  # published, nobody reading: released at once
    READING = "reading"  # a peer was reading it: released when that read ends
    ABORTED = "aborted"  # already aborted while being read
    PULLING = "pulling"  # this engine's own pull was in flight: cancelled
    PUSHING = "pushing"  # this engine's own push was in flight: cancelled
    EXPECTED = "expected"  # announced for a push, no writer yet: released at once
    WRITING = "writing"  # a writer was writing it: reported when no byte can land


class HoldState(enum.StrEnum):
    """What holding one pulled request while it waits for the engine's blocks found."""

    HELD = "held"  # its publisher keeps it (or it is being read)
    ABORTED = "aborted"  # its publisher aborted it while it was being read
    # released, expired, never published, aborted unread, its publisher restarted, or its
    # publisher's layout and this engine's disagree (the pull would be refused)
    GONE = "gone"
    UNASKED = "unasked"  # its publisher could not be asked in time: hold it again later


@dataclass(frozen=True)
class Held:
    """A Hold's answer: one state per params, in order, and when to hold again."""

    states: tuple[HoldState, ...]
    interval_s: float


class ReleaseReason(enum.StrEnum):
    CONSUMED = "consumed"
    ABORTED = "aborted"
    UNREGISTERED = "unregistered"


@dataclass(frozen=True)
class TransferParams:
    """Everything the other side needs for one request: the published blocks to pull
    (mode pull), or the announced blocks to push into (mode push)."""

    peer_address: str
    engine_id: str
    epoch: int
    tp_rank: int
    request_id: str
    num_tokens: int
    spans: tuple[BlockSpan, ...]
    mode: TransferMode = TransferMode.PULL

    def __post_init__(self) -> None:
        _check_publication(self, "params")
        check_int("params.num_tokens", self.num_tokens, 1, MAX_TOKENS)


@dataclass(frozen=True)
class Publication:
    """Which publication a reader will pull: its params without the blocks (Hold)."""

    peer_address: str
    engine_id: str
    epoch: int
    tp_rank: int
    request_id: str

    def __post_init__(self) -> None:
        _check_publication(self, "publication")

    @classmethod
    def of(cls, params: TransferParams) -> Publication:
        return cls(
            params.peer_address, params.engine_id, params.epoch, params.tp_rank, params.request_id
        )


def _check_publication(p: TransferParams | Publication, field: str) -> None:
    check_address(p.peer_address, f"{field}.peer_address")
    check_request_id(p.engine_id, f"{field}.engine_id")
    check_int(f"{field}.epoch", p.epoch, 1, MAX_EPOCH)
    check_int(f"{field}.tp_rank", p.tp_rank, 0, 1 << 12)
    check_request_id(p.request_id, f"{field}.request_id")


@dataclass(frozen=True)
class PullAccepted:
    """A pull the decode sidecar planned and started; its outcome comes as PullDone."""

    bytes_planned: int
    full_attention_bytes: int
    chunks: int
    descriptors: int


@dataclass(frozen=True)
class PullDone:
    request_id: str
    status: PullStatus
    failed_blocks: Mapping[int, tuple[int, ...]]  # group id -> logical block indices
    valid_tokens: int
    bytes_moved: int
    duration_s: float
    reason: str = ""


@dataclass(frozen=True)
class Received(PullDone):
    """To the decode engine: a pushed request's outcome, in its own blocks. Sent only
    once no byte can land in them any more (docs/sidecar.md, Push)."""


@dataclass(frozen=True)
class Pushed(PullDone):
    """To the prefill engine: its push ended; its blocks are no longer read. Failed
    blocks and valid_tokens are the decode side's."""


@dataclass(frozen=True)
class PushAccepted:
    bytes_planned: int
    chunks: int
    chunks_posted: int


@dataclass(frozen=True)
class Released:
    request_id: str
    reason: ReleaseReason
    bytes_read: int = 0


@dataclass(frozen=True)
class LeaseExpired:
    request_id: str
    held_s: float


EngineEvent = PullDone | Released | LeaseExpired
