"""Two real NIXL agents in two processes, as the prefill and decode sidecars run them.

`SourcePeer` starts a child process (multiprocessing 'spawn') that opens the
engine's buffers by handle, registers them with its own NIXL agent, and sends
back its metadata and the buffers' addresses; it serves until stopped or
killed. `LocalSide` is the decode sidecar's half in the calling process.
Used by the data-plane tests and benchmarks/bench_dataplane.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from types import TracebackType

from kvxfer.core.buffers import BufferHandle
from kvxfer.core.planner import TransferPlan
from kvxfer.dataplane.adapter import NixlAgent, TransferBackend
from kvxfer.dataplane.descriptors import BoundBuffer
from kvxfer.dataplane.executor import TransferResult, execute_plan
from kvxfer.dataplane.memory import MappedBuffer, bind, open_buffer


def _serve_source(conn: Connection, handles: list[BufferHandle]) -> None:
    asyncio.run(_serve(conn, handles))


async def _serve(conn: Connection, handles: list[BufferHandle]) -> None:
    agent = NixlAgent("src")
    buffers = [open_buffer(h) for h in handles]
    await agent.register(buffers)
    notes: list[bytes] = []
    agent.on_notification(lambda _peer, message: notes.append(message))
    conn.send((await agent.metadata(), bind(buffers)))
    while True:
        if not await asyncio.to_thread(conn.poll, 0.02):
            continue
        message = conn.recv()
        if message == "notes":
            conn.send(list(notes))
        elif message == "stop":
            break
    await agent.deregister(buffers)
    await agent.close()
    for buffer in buffers:
        buffer.close()
    conn.send("stopped")


class SourcePeer:
    def __init__(self, handles: Sequence[BufferHandle]) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve_source, args=(child, list(handles)), daemon=True)
        self.process.start()
        if not self._conn.poll(60):
            self.process.kill()
            raise RuntimeError("source peer did not start within 60 s")
        self.metadata, self.buffers = self._conn.recv()

    def notes(self) -> list[bytes]:
        self._conn.send("notes")
        return list(self._conn.recv())

    def stop(self) -> None:
        if self.process.is_alive():
            self._conn.send("stop")
            self._conn.poll(30)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)


class LocalSide:
    """The pulling side: an agent with the engine's buffers registered."""

    def __init__(self, handles: Sequence[BufferHandle], backend: TransferBackend | None = None):
        self.handles = list(handles)
        self.backend: TransferBackend = backend or NixlAgent("dst")
        self.mapped: list[MappedBuffer] = []
        self.buffers: Mapping[str, BoundBuffer] = {}

    async def __aenter__(self) -> LocalSide:
        self.mapped = [open_buffer(h) for h in self.handles]
        await self.backend.register(self.mapped)
        self.buffers = bind(self.mapped)
        return self

    async def pull(
        self, plan: TransferPlan, peer: str, remote: Mapping[str, BoundBuffer], block_size: int
    ) -> TransferResult:
        """Carry out `plan` from `peer` with this side's backend and default options."""
        return await execute_plan(
            plan,
            backend=self.backend,
            peer=peer,
            local=self.buffers,
            remote=remote,
            block_size=block_size,
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.backend.deregister(self.mapped)
        await self.backend.close()
        for buffer in self.mapped:
            buffer.close()
