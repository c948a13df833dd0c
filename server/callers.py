"""Who registers on the engine socket, and noticing when that process dies.

gRPC does not tell a servicer who is at the other end of a unix socket
(`context.peer()` is just "unix:" and the auth context holds no credentials).
This process holds the accepted sockets, though: SO_PEERCRED on each accepted
connection of the engine socket gives the (pid, uid) the kernel recorded for
every connected process. The engine says which pid it is in the
`kvxfer-engine-pid` request metadata (`EngineClient` sends it); the claim is
believed only when a process of that pid is connected right now. Without a
claim, the caller is the one connected process, if there is exactly one.

A process in a pid namespace this one cannot see (an engine container beside
the sidecar's in a pod without `shareProcessNamespace`) shows up with pid 0:
its uid is still known, its pid is not, so its death cannot be watched (the
sidecar then lets a new registration of the same TP rank replace it).

The engine's death is seen through a pidfd (Linux 5.3+): it becomes readable
when the process exits, whatever the signal, so the sidecar learns of a
SIGKILL at once, without polling and whether or not the engine was watching
its events. A pidfd names one process, never a later one that reuses the pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvxfer._exceptions import InvalidInputError, RegistrationError, shown

PID_METADATA = "kvxfer-engine-pid"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Caller:
    pid: int | None  # None: in a pid namespace this process cannot see
    uid: int


def claimed_pid(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The pid an engine claims in its request metadata; None when it claims none."""
    for key, value in metadata or ():
        if key == PID_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            # At most 7 digits (pids stay below 2^22) before int(), which refuses over 4300.
            digits = text.isascii() and text.isdigit() and len(text) <= 7
            if not digits or not 0 < int(text) < 1 << 22:
                raise InvalidInputError(PID_METADATA, f"must be a process id, got {shown(text)}")
            return int(text)
    return None


def connected_callers(socket_path: str) -> list[Caller]:
    """Credentials of every connection accepted on the unix socket this process serves."""
    callers: list[Caller] = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        with sock:
            credentials = _accepted_credentials(sock, socket_path)
        if credentials is not None:
            callers.append(credentials)
    return callers


def _accepted_credentials(sock: socket.socket, socket_path: str) -> Caller | None:
    """Credentials of the far end, when `sock` is a connection accepted on `socket_path`."""
    try:
        if sock.family != socket.AF_UNIX or sock.getsockname() != socket_path:
            return None
        sock.getpeername()  # the listening socket itself has no peer
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, _ = _UCRED.unpack(raw)
    return Caller(pid if pid > 0 else None, uid)


def identify_caller(socket_path: str, claimed: int | None) -> Caller:
    """The registering process, checked against the kernel's view of the connections."""
    callers = set(connected_callers(socket_path))
    visible = {c.pid: c for c in callers if c.pid is not None}
    hidden_uids = {c.uid for c in callers if c.pid is None}
    if claimed is not None and claimed in visible:
        return visible[claimed]
    if claimed is None and len(visible) == 1 and not hidden_uids:
        return next(iter(visible.values()))
    if len(hidden_uids) == 1 and (claimed is not None or not visible):
        # Its pid is in a namespace we cannot see: its uid is all the kernel tells us.
        return Caller(None, next(iter(hidden_uids)))
    if claimed is not None:
        raise RegistrationError(
            f"{PID_METADATA}: process {claimed} is not connected to {socket_path} "
            f"(connected: {sorted(visible) or 'none'})"
        )
    raise RegistrationError(
        f"{PID_METADATA}: {len(callers)} processes are connected to {socket_path}; "
        "say which one registers in this metadata (kvxfer's EngineClient does)"
    )


class ProcessWatch:
    """Calls `on_exit` once, on the event loop, when the process exits."""

    def __init__(self, pid: int, on_exit: Callable[[], None]) -> None:
        try:
            self._fd = os.pidfd_open(pid)
        except OSError as exc:
            raise RegistrationError(f"cannot watch engine process {pid}: {exc.strerror}") from exc
        self.pid = pid
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._fired)

    def _fired(self) -> None:
        self.close()
        self._on_exit()

    def exited(self) -> bool:
        """True once the process has exited (a non-blocking check)."""
        if self._fd < 0:
            return True
        readable, _, _ = select.select([self._fd], [], [], 0)
        return bool(readable)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
