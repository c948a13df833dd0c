"""The engine lane's framing: EngineService calls over a plain unix socket.

gRPC on the engine's socket costs a poller thread hand-off and HTTP/2 framing
on both sides of every call: on a 2-core host about 0.8 ms from an engine's
Pull to the sidecar's handler and 0.5 ms for an event back, where the bytes of
a 1k-token read take 3-5 ms. The lane carries the same protobuf messages,
handled by the same servicer, with a 9-byte header per frame:

    payload length (u32) | call id (u32) | kind (u8) | payload

A call's request frame (UNARY or STREAM) carries the method name (one length
byte, then ASCII) and the serialized request; its answer is one REPLY, or
ITEMs then END for a stream, or one ERROR whose payload is the google.rpc
Status the gRPC path puts in its `grpc-status-details-bin` trailer (so a
failure maps to the same kvxfer error on both). CANCEL ends a stream early.
A frame that breaks these rules closes the connection.

Call ids start at 1. An ERROR on call id 0 comes from the serving end, only
as its first frame: it refused the connection (a limit of connections)
without reading a call of it, and closes it. Anywhere else it breaks the
rules.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct

from kvxfer._exceptions import InvalidInputError

HEADER = struct.Struct("!IIB")
CONNECTION_ID = 0  # the call id of a frame about the connection, not a call
MAX_PAYLOAD_BYTES = 64 << 20  # as the gRPC channels' message limit
LANE_SUFFIX = ".lane"


class Kind(enum.IntEnum):
    UNARY = 1
    STREAM = 2
    CANCEL = 3
    REPLY = 11
    ITEM = 12
    END = 13
    ERROR = 14


class LaneProtocolError(Exception):
    """A frame that breaks the lane's rules: the connection cannot be trusted further."""


def lane_path(engine_address: str) -> str:
    """The lane's socket path beside a unix engine address (`unix:/run/e.sock` ->
    `/run/e.sock.lane`); a TCP engine address has none."""
    if not engine_address.startswith("unix:"):
        raise InvalidInputError(
            "engine_address",
            f"{engine_address} is not a unix socket: the engine lane is served only beside "
            "a unix engine socket",
        )
    return engine_address.removeprefix("unix:").removeprefix("//") + LANE_SUFFIX


def keep_alive(writer: asyncio.StreamWriter, idle_s: int = 30, interval_s: int = 10) -> None:
    """TCP keepalive on a lane's connection: a peer whose host vanished (no FIN, no RST)
    or a connection a NAT dropped is noticed within about idle_s + 3 * interval_s, as
    the gRPC channels' keepalive notices it, instead of after TCP's retransmissions
    give up (about 15 minutes) with every call on it timing out meanwhile."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", idle_s),
        ("TCP_KEEPINTVL", interval_s),
        ("TCP_KEEPCNT", 3),
    ):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def frame(call_id: int, kind: Kind, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), call_id, kind) + payload


def request_payload(method: str, body: bytes) -> bytes:
    name = method.encode("ascii")
    return bytes([len(name)]) + name + body


def split_request(payload: bytes) -> tuple[str, bytes]:
    """(method, body) of a request frame's payload."""
    if not payload or len(payload) < 1 + payload[0]:
        raise LaneProtocolError("a request frame without a whole method name")
    end = 1 + payload[0]
    try:
        method = payload[1:end].decode("ascii")
    except UnicodeDecodeError:
        raise LaneProtocolError("a method name that is not ASCII") from None
    return method, payload[end:]


async def read_frame(
    reader: asyncio.StreamReader, limit: int = MAX_PAYLOAD_BYTES
) -> tuple[int, Kind, bytes] | None:
    """The next frame, or None at a clean end of stream (between frames); a payload
    over `limit` bytes breaks the lane before it is read."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise LaneProtocolError("the connection ended inside a frame header") from None
    length, call_id, raw_kind = HEADER.unpack(header)
    if length > limit:
        raise LaneProtocolError(f"a {length}-byte frame exceeds {limit}")
    try:
        kind = Kind(raw_kind)
    except ValueError:
        raise LaneProtocolError(f"unknown frame kind {raw_kind}") from None
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise LaneProtocolError("the connection ended inside a frame") from None
    return call_id, kind, payload
