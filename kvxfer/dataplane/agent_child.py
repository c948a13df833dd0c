"""The serving NIXL agent's own process: `python -m kvxfer.dataplane.agent_child FD`.

Why a process of its own: over UCX's TCP transport between hosts, RMA is
emulated in software and the serving side sends the data of a peer's READ
itself. When that peer's worker goes away mid-read (it severed a timed-out
read, its link went down, it was killed), UCX 1.23 can abort the serving
process the next time it progresses (`ucp_request.inl`: the software-RMA get
reply returns the endpoint's error to `ucp_request_try_send`, which treats any
error but NO_RESOURCE as fatal). In this process that abort costs the serving
agent only; the sidecar (`serving.py`) starts another one and keeps its pid,
epoch, leases and engines.

This process maps each engine buffer itself, from the same handle the engine
gave the sidecar and with the same checks (`memory.open_buffer`: shared memory
or CUDA IPC), registers it with its agent, and reports the address peers must
read at. It takes requests on FD (a socket from the sidecar, pickled tuples
through `multiprocessing.connection`) one at a time, and exits when the socket
closes (the sidecar exited, even by SIGKILL) or on `close`. It never reads into
memory: peers only read from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvxfer._exceptions import (
    BackendCreationError,
    DataPlaneError,
    KvxferError,
    RegistrationError,
)
from kvxfer.core.buffers import BoundBuffer, BufferHandle
from kvxfer.dataplane.adapter import AgentOptions, NixlAgent
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer

log = logging.getLogger("kvxfer.dataplane.agent_child")


class _Served:
    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self.buffers: dict[str, MappedBuffer] = {}

    async def register(self, handle: BufferHandle, owner_uid: int | None) -> BoundBuffer:
        if handle.name in self.buffers:
            raise RegistrationError(f"buffer '{handle.name}' is already registered")
        buffer = open_buffer(handle, owner_uid)
        try:
            await self.agent.register([buffer])
        except BaseException:
            buffer.close()  # never registered: nothing can touch it
            raise
        self.buffers[handle.name] = buffer
        return bind([buffer])[handle.name]

    async def deregister(self, names: Sequence[str]) -> None:
        buffers = [self.buffers.pop(name) for name in names if name in self.buffers]
        await self.agent.deregister(buffers)
        # Memory safety: deregistered first, so this agent hands out no new access to
        # it; a peer's READ still posted fails on the peer's side. Nothing here writes.
        for buffer in buffers:
            buffer.close()

    async def close(self) -> None:
        # Destroying the agent ends every backend request before anything is unmapped.
        await self.agent.close()
        if not self.agent.alive:
            for buffer in self.buffers.values():
                buffer.close()
        self.buffers.clear()

    async def run(self, op: str, args: tuple[Any, ...]) -> Any:
        if op == "metadata":
            return await self.agent.metadata()
        if op == "register":
            return await self.register(*args)
        if op == "deregister":
            return await self.deregister(*args)
        if op == "add_peer":
            return await self.agent.add_peer(*args)
        if op == "remove_peer":
            return await self.agent.remove_peer(*args)
        raise DataPlaneError(f"serving agent: unknown request {op!r}")


async def _serve(conn: Connection) -> int:
    _, name, options = conn.recv()
    assert isinstance(options, AgentOptions)
    try:
        agent = await asyncio.to_thread(NixlAgent, name, options)
    except DataPlaneError as exc:
        conn.send(_failed(exc))
        return 1
    served = _Served(agent)
    conn.send(("ok", agent.name))
    op = ""
    try:
        while True:
            try:
                op, *args = await asyncio.to_thread(conn.recv)
            except EOFError:  # the sidecar is gone
                return 0
            if op == "close":
                return 0
            reply: tuple[Any, ...]
            try:
                reply = ("ok", await served.run(op, tuple(args)))
            except KvxferError as exc:
                reply = _failed(exc)
            conn.send(reply)
    finally:
        await served.close()
        if op == "close":
            with contextlib.suppress(OSError):
                conn.send(("ok", None))  # closed: nothing of ours is registered any more


def _failed(exc: KvxferError) -> tuple[str, str, str, str]:
    """A failure's reply, as the sidecar raises it again (serving.AgentProcess.call): its
    class's name, its message, and the option a BackendCreationError blames."""
    option = exc.option if isinstance(exc, BackendCreationError) else ""
    return ("err", type(exc).__name__, str(exc), option)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The sidecar decides when this process ends (close, or its socket closing): a
    # terminal's SIGINT or hangup, or a SIGTERM sent to the whole process group, is for
    # the sidecar, which closes this agent only once peers' reads have drained. Set here,
    # not inherited: a sidecar on uvloop starts this process with default handlers.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    conn = Connection(int(args[0]))
    try:
        return asyncio.run(_serve(conn))
    except (EOFError, BrokenPipeError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
