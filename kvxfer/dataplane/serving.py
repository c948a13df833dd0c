"""The serving agent: what peers read our engines' memory through, in a child process.

A sidecar's serving agent only serves: peers READ registered engine memory
through it; it never reads. It runs in a process of its own
(`agent_child.py`), because over UCX's TCP transport between hosts a peer
that goes away mid-read (a severed reader, a link that went down, a killed
decode sidecar) can make UCX abort the serving process (see that module).
Contained there, the abort costs one child: `ServingAgent` notices its exit,
starts a new one, registers every buffer it serves again, and tells the
sidecar (`on_replaced`), which bumps its registration version so that
readers load the new agent's metadata before their next read. Reads that
were in flight from the dead child fail on the reader's side (disconnected
or timed out), as any read from a lost peer does; nothing else is lost: the
sidecar keeps its pid, epoch, leases and engines.

Peers read at the child's addresses of each buffer, not the sidecar's:
`served()` returns the metadata and those addresses from the same child. A
child that keeps dying at start is retried with a growing pause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvxfer._exceptions import BackendCreationError, DataPlaneError, RegistrationError
from kvxfer.core.buffers import BoundBuffer
from kvxfer.dataplane.adapter import AgentOptions
from kvxfer.dataplane.memory import MappedBuffer

log = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 120.0  # registering many GB can pin memory for a while (RDMA)
_CLOSE_TIMEOUT_S = 10.0
_RESTART_PAUSE_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServingBackend(Protocol):
    """What the sidecar needs from the agent that serves its engines' memory."""

    @property
    def name(self) -> str: ...

    async def served(self, names: Sequence[str]) -> tuple[bytes, dict[str, BoundBuffer]]: ...

    async def register(self, buffers: Sequence[MappedBuffer]) -> None: ...

    async def deregister(self, buffers: Sequence[MappedBuffer]) -> None: ...

    async def add_peer(self, metadata: bytes) -> str: ...

    async def remove_peer(self, peer: str) -> None: ...

    def on_replaced(self, callback: Callable[[str], None]) -> None: ...

    async def revoke(self, reason: str) -> None: ...

    async def close(self) -> None: ...


class AgentProcess:
    """One serving-agent child and the socket to it. Requests go one at a time, each a
    round trip on this child's own thread: a caller that gives up (a cancelled RPC)
    cannot leave a reply behind for the next request to read."""

    def __init__(self, proc: ChildProcess, conn: Connection) -> None:
        self.proc = proc
        self._conn = conn
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "serving-agent")
        self.name = ""

    @classmethod
    async def start(cls, name: str, options: AgentOptions) -> AgentProcess:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            try:
                proc = _spawn_child(theirs.fileno())
            except OSError as exc:
                raise DataPlaneError(f"cannot start a serving agent process: {exc}") from exc
            child = cls(proc, Connection(ours.detach()))
        try:
            child.name = await child.call("init", name, options)
        except BaseException:
            await child.kill()
            raise
        return child

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def call(self, op: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.run_in_executor(self._thread, self._roundtrip, (op, *args))
        except RuntimeError as exc:  # the executor was shut down: closed or killed
            raise DataPlaneError(f"serving agent {self.pid} is closed") from exc
        if reply[0] == "ok":
            return reply[1]
        _, kind, message, option = reply  # agent_child._failed
        if kind == "BackendCreationError":
            raise BackendCreationError(option, message)
        raise (RegistrationError if kind == "RegistrationError" else DataPlaneError)(message)

    def _roundtrip(self, request: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            self._conn.send(request)
            if not self._conn.poll(_CALL_TIMEOUT_S):
                raise DataPlaneError(
                    f"serving agent {self.pid} did not answer {request[0]!r} within "
                    f"{_CALL_TIMEOUT_S:.0f}s"
                )
            reply: tuple[Any, ...] = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise DataPlaneError(f"serving agent {self.pid} is gone ({exc!r})") from exc
        return reply

    async def close(self) -> None:
        """Destroy the agent (it deregisters everything) and let the process exit; kill it
        if it does not within _CLOSE_TIMEOUT_S."""
        with contextlib.suppress(DataPlaneError, TimeoutError):
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await self.call("close")
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await self.proc.wait()
        except TimeoutError:
            await self.kill()
        self._release()

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()
        self._release()

    def _release(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._conn.close()


class ChildProcess:
    """A child process started by `subprocess.Popen` and awaited on the loop through its
    pidfd.

    Not `asyncio.create_subprocess_exec`: uvloop's starts the child with fork(), which
    runs the process's fork handlers in the child before exec. In a sidecar whose other
    threads are inside UCX (which hooks munmap behind a spinlock), the child can then
    spin forever in uvloop's own after-fork handler, never reaching exec, while the
    loop waits for that exec: the sidecar hung replacing a crashed serving agent, and
    the child outlived it at 100% CPU. Popen starts the child with vfork(), which runs
    no fork handler (tests/test_serving_spawn.py)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        self._loop.add_reader(self._pidfd, self._reap)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def _reap(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        returncode = self._popen.wait()  # it has exited: this only reaps it
        if not self._exited.done():
            self._exited.set_result(returncode)

    def kill(self) -> None:
        """SIGKILL, unless it has been reaped already (then its pid may be another's)."""
        self._popen.kill()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


def _spawn_child(fd: int) -> ChildProcess:
    popen = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.dataplane.agent_child", str(fd)],
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        stdout=2,  # our stdout carries the ready line; UCX and NIXL log to stderr
    )  # fmt: skip
    return ChildProcess(popen)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


class ServingAgent:
    """The sidecar's serving agent, replaced whenever its process dies. Implements
    ServingBackend."""

    def __init__(self, name: str = "kvxfer-sidecar", options: AgentOptions | None = None) -> None:
        self._name = name
        self._options = options or AgentOptions()
        self._child: AgentProcess | None = None
        self._lock = asyncio.Lock()  # one change at a time: register, replace, close
        self._buffers: dict[str, MappedBuffer] = {}  # what every child must serve
        self._served: dict[str, BoundBuffer] = {}  # ... and where the current one serves it
        self._callbacks: list[Callable[[str], None]] = []
        self._watch: asyncio.Task[None] | None = None
        self._closed = False
        self.generation = 0  # +1 for every child started after the first
        self.restarts = 0  # children replaced because they died
        self._revoked = ""  # why the current child was killed on purpose (revoke)

    async def start(self) -> None:
        """Start the first child; raises DataPlaneError when it cannot start."""
        async with self._lock:
            await self._spawn()

    @property
    def name(self) -> str:
        return self._child.name if self._child is not None else self._name

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def on_replaced(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` runs on the loop as soon as a dead child is noticed, before
        its replacement is ready: what peers loaded of the old agent is stale from then."""
        self._callbacks.append(callback)

    async def served(self, names: Sequence[str]) -> tuple[bytes, dict[str, BoundBuffer]]:
        """The current child's metadata and where it serves `names`, taken together."""
        async with self._lock:
            child = self._current()
            missing = [name for name in names if name not in self._served]
            if missing:
                raise DataPlaneError(f"buffers {missing} are not served by agent {child.name}")
            metadata = await child.call("metadata")
            return bytes(metadata), {name: self._served[name] for name in names}

    async def register(self, buffers: Sequence[MappedBuffer]) -> None:
        async with self._lock:
            child = self._current()
            for buffer in buffers:
                if buffer.name in self._buffers:
                    raise RegistrationError(f"buffer '{buffer.name}' is already registered")
                where = await child.call("register", buffer.handle, buffer.owner_uid)
                self._buffers[buffer.name] = buffer
                self._served[buffer.name] = where

    async def deregister(self, buffers: Sequence[MappedBuffer]) -> None:
        """Deregister `buffers` in the child (which unmaps its own mapping of them)."""
        async with self._lock:
            names = [b.name for b in buffers if self._buffers.pop(b.name, None) is not None]
            for name in names:
                self._served.pop(name, None)
            if self._child is not None and names:
                with contextlib.suppress(DataPlaneError):  # a dead child holds nothing
                    await self._child.call("deregister", names)

    async def add_peer(self, metadata: bytes) -> str:
        async with self._lock:
            peer: str = await self._current().call("add_peer", metadata)
            return peer

    async def remove_peer(self, peer: str) -> None:
        async with self._lock:
            if self._child is not None:
                with contextlib.suppress(DataPlaneError):
                    await self._child.call("remove_peer", peer)

    async def revoke(self, reason: str) -> None:
        """Take every peer's access away now: kill the child (SIGKILL) and return once it
        is reaped, so that no transfer through it (a late WRITE of a stalled pusher, a
        READ) can touch our memory any more; a new child takes over as for a crash and
        peers reload its metadata (`on_replaced`). Costs every transfer in flight through
        this sidecar's serving agent (docs/dataplane.md, Push)."""
        child = self._child
        if child is None:
            return
        log.warning("revoking remote access: killing serving agent %d (%s)", child.pid, reason)
        self._revoked = reason
        child.proc.kill()
        await child.proc.wait()

    async def close(self) -> None:
        """Stop the child (its agent destroyed, so no read it serves goes on) for good."""
        self._closed = True
        if self._watch is not None:  # also ends a replacement under way
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        async with self._lock:
            child, self._child = self._child, None
            if child is not None:
                await child.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _current(self) -> AgentProcess:
        if self._child is None:
            raise DataPlaneError("the serving agent is closed")
        return self._child

    async def _spawn(self) -> None:
        """Start a child and register every buffer served in it (under the lock)."""
        child = await AgentProcess.start(self._name, self._options)
        served: dict[str, BoundBuffer] = {}
        for name, buffer in list(self._buffers.items()):
            try:
                served[name] = await child.call("register", buffer.handle, buffer.owner_uid)
            except RegistrationError as exc:  # e.g. its engine died and removed it
                log.warning("serving agent %s cannot serve buffer %s: %s", child.name, name, exc)
        self._child, self._served = child, served
        self._watch = asyncio.create_task(self._watch_exit(child))
        log.info("serving agent %s running as process %d", child.name, child.pid)

    async def _watch_exit(self, child: AgentProcess) -> None:
        returncode = await child.proc.wait()
        if self._closed or child is not self._child:
            return
        reason = f"serving agent process {child.pid} {describe_exit(returncode)}"
        if self._revoked:
            reason, self._revoked = f"{reason}: revoked ({self._revoked})", ""
        log.error("%s; starting another (the sidecar itself is unaffected)", reason)
        self.restarts += 1
        self.generation += 1
        for callback in self._callbacks:
            callback(reason)
        await self._replace(child)

    async def _replace(self, dead: AgentProcess) -> None:
        async with self._lock:
            await dead.kill()  # reaped; closes our end of its socket
            for attempt in range(1_000_000):
                if self._closed:
                    return
                pause = _RESTART_PAUSE_S[min(attempt, len(_RESTART_PAUSE_S) - 1)]
                await asyncio.sleep(pause)
                try:
                    await self._spawn()
                    return
                except DataPlaneError as exc:
                    log.error("starting a serving agent failed (attempt %d): %s", attempt + 1, exc)
