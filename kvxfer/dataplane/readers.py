"""Reading agents: NIXL agents of their own per (peer, destination engine).

A chunk that fails severs the agent that posted it, and every transfer in
flight on that agent with it (adapter.py: that is what makes a late write
impossible). So the reading side does not read through one shared agent: each
pair of remote peer and local engine gets agents of its own, with only that
engine's buffers registered and only that peer loaded. A stalled peer severs
the pulls from it into one engine, never a pull from another peer, and the
next pull from it gets a fresh agent.

`Readers` hands out an open reader for a pair, creating it (agent, memory
registration, peer metadata) when there is none, when the last one was
severed, or when the peer's metadata changed. Before an engine's memory is
unmapped, `close_engine` destroys every agent that could write into it.

A pair has up to `per_pair` readers, each its own agent and NIXL thread. On
one host a read copies on the thread that posts it, so one agent copies one
pull at a time: with many pulls from one peer at once, a second agent lets
the host's other cores copy too. `get` hands out an idle reader of the pair
(the first, for pulls that come one at a time), opens another while every
open one is busy and there is room, and otherwise the least busy; `done`
says a read (or write) that `get` handed a reader to has ended. Which agent a
transfer uses changes nothing else: each has the engine's buffers and the
peer registered, and a failure severs the agent it happened on, with every
transfer in flight there.

Creating a NIXL agent with its UCX backend is the slow part of opening a
reader: about 450 ms for the first one in a process (UCX's own start-up,
holding the GIL, so the sidecar's event loop stands still meanwhile) and
20-50 ms for later ones, where registering an engine's memory and loading the
peer's metadata take a few ms. So `start` creates one agent ahead (at sidecar
start, when nothing waits on the loop), a new reader takes it, and the next
spare is created once that reader is open: a first pull from a new peer pays
for registration and metadata, not for an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvxfer._exceptions import DataPlaneError
from kvxfer.dataplane.adapter import TransferBackend
from kvxfer.dataplane.memory import MappedBuffer

log = logging.getLogger(__name__)

PREFIX = "kvxfer-reader"
OPEN_WAIT_S = 10.0  # how long closing waits for a reader being opened (as for a thread)
BackendFactory = Callable[[str], TransferBackend]
"""Creates a new, empty agent (name prefix -> backend). Called off the event loop."""


@dataclass
class Reader:
    backend: TransferBackend
    peer: str  # the remote agent's name inside `backend`
    metadata: bytes
    busy: int = 0  # transfers `get` handed it to that have not ended (`Readers.done`)
    idle_since: float = 0.0  # time.monotonic() when its last transfer ended

    def usable(self, metadata: bytes) -> bool:
        return not self.backend.closed and self.metadata == metadata


Key = tuple[str, str, int]  # (peer, engine, which of the pair's readers)


class Readers:
    def __init__(
        self, factory: BackendFactory, *, per_pair: int, idle_s: float | None = None
    ) -> None:
        """`idle_s`: a reader no transfer used for that long is closed by `close_idle`
        (None: never)."""
        if per_pair < 1:
            raise ValueError(f"per_pair must be at least 1, not {per_pair}")
        self._factory = factory
        self.per_pair = per_pair
        self.idle_s = idle_s
        self._readers: dict[Key, Reader] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._waiting: dict[Key, int] = {}  # `get`s waiting for a key's reader to open
        self._closing: set[str] = set()  # engines whose readers are being closed
        self._spare: asyncio.Future[TransferBackend] | None = None
        self._closed = False
        # Replaced readers whose thread did not stop (stuck in a NIXL call): they may still
        # touch their engine's buffers, which must then stay mapped (`close_engine`).
        self._stuck: list[tuple[Key, Reader]] = []

    def start(self) -> None:
        """Create a spare agent in the background, unless one is there or coming."""
        if self._spare is None and not self._closed:
            self._spare = asyncio.ensure_future(asyncio.to_thread(self._factory, PREFIX))

    async def _agent(self) -> TransferBackend:
        """The spare agent, or a new one when there is none (or it could not be made)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            try:
                return await spare
            except Exception as exc:
                log.warning("the spare reading agent could not be created: %s", exc)
        return await asyncio.to_thread(self._factory, PREFIX)

    async def get(
        self, peer_key: str, engine_key: str, metadata: bytes, buffers: Sequence[MappedBuffer]
    ) -> Reader:
        """An open reader from `peer_key` into `engine_key`'s `buffers`, counted busy until
        `done` is called for it. Refused (DataPlaneError) once the readers are closing,
        or while that engine's are: no agent may register its memory then."""
        self._check_open(engine_key)
        # First: once a reader is counted busy below, nothing may be awaited before it is
        # handed out (a cancellation there would leave it counted busy for good).
        await self._sweep(peer_key, engine_key, metadata)
        key = (peer_key, engine_key, self._slot(peer_key, engine_key, metadata))
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            async with self._locks.setdefault(key, asyncio.Lock()):
                reader = self._readers.get(key)
                if reader is None or not reader.usable(metadata):
                    if reader is not None:
                        await self._retire(key, reader)  # severed or stale
                    reader = await self._open(key, metadata, buffers)
                    if self._closed or engine_key in self._closing:
                        await reader.backend.close()  # closed meanwhile: never handed out
                        self._check_open(engine_key)
                    self._readers[key] = reader
                reader.busy += 1
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
        return reader

    @staticmethod
    def done(reader: Reader) -> None:
        """A transfer `get` handed `reader` to has ended."""
        assert reader.busy > 0, f"reader {reader.backend.name} was not handed out"
        reader.busy -= 1
        if not reader.busy:
            reader.idle_since = time.monotonic()

    async def close_idle(self) -> int:
        """Close the readers no transfer has used for `idle_s` and none holds or waits
        for; how many. A peer that went away (a prefill pod replaced under a new address)
        would otherwise keep its readers until their engine leaves: each a NIXL agent, a
        UCX worker, a thread that wakes every few ms and a registration of the engine's
        memory. The next transfer from the peer opens a new one."""
        if self.idle_s is None or self._closed:
            return 0
        before = time.monotonic() - self.idle_s
        closed = 0
        for key, reader in list(self._readers.items()):
            if reader.busy or reader.idle_since > before or self._waiting.get(key):
                continue
            lock = self._locks.setdefault(key, asyncio.Lock())
            if lock.locked():
                continue
            async with lock:
                if self._readers.get(key) is not reader or reader.busy:
                    continue
                del self._readers[key]
                if not self._waiting.get(key):
                    self._locks.pop(key, None)
                log.info(
                    "reader %s for peer %s into engine %s closed: unused for %g s",
                    reader.backend.name, key[0], key[1], self.idle_s,
                )  # fmt: skip
                await self._retire(key, reader)
                closed += 1
        return closed

    def _check_open(self, engine_key: str) -> None:
        if self._closed:
            raise DataPlaneError("the sidecar is shutting down: no new reading agent")
        if engine_key in self._closing:
            raise DataPlaneError(f"engine {engine_key} is going away: no new reading agent")

    def _slot(self, peer_key: str, engine_key: str, metadata: bytes) -> int:
        """Which of the pair's readers a transfer gets, in this order: the first idle one;
        the first neither open nor being opened (or severed), to open; the first stale
        one (the peer's metadata changed) that is idle, to replace; the least loaded open
        or opening one; else the least busy stale one, to replace (its transfers fail)."""
        first = self._readers.get((peer_key, engine_key, 0))
        idle = first is not None and not first.busy and first.usable(metadata)
        if idle and not self._waiting.get((peer_key, engine_key, 0)):
            return 0  # pulls one at a time: the common case, without the lists
        slots = [(peer_key, engine_key, i) for i in range(self.per_pair)]
        readers = [self._readers.get(key) for key in slots]
        waiting = [self._waiting.get(key, 0) for key in slots]
        live = [r is not None and r.usable(metadata) for r in readers]
        loads = [(r.busy if r is not None and ok else 0) + w
                 for r, ok, w in zip(readers, live, waiting, strict=True)]  # fmt: skip
        for i in range(self.per_pair):
            if live[i] and loads[i] == 0:
                return i
        for i, reader in enumerate(readers):
            if not waiting[i] and (reader is None or reader.backend.closed):
                return i
        for i, reader in enumerate(readers):
            if not waiting[i] and not live[i] and reader is not None and not reader.busy:
                return i
        busy = [i for i in range(self.per_pair) if live[i] or waiting[i]]
        if busy:
            return min(busy, key=loads.__getitem__)
        return min(range(self.per_pair), key=lambda i: readers[i].busy)  # type: ignore[union-attr]

    async def _sweep(self, peer_key: str, engine_key: str, metadata: bytes) -> None:
        """Close the pair's stale readers (the peer's metadata changed) that no transfer
        holds or waits for: pulls one at a time would never pick them again, and each
        holds a UCX worker, a thread and a registration of the engine's memory."""
        for i in range(self.per_pair):
            key = (peer_key, engine_key, i)
            reader = self._readers.get(key)
            if reader is None or reader.usable(metadata) or reader.busy:
                continue
            lock = self._locks.setdefault(key, asyncio.Lock())
            if self._waiting.get(key) or lock.locked():
                continue
            async with lock:
                if self._readers.get(key) is reader and not reader.busy:
                    del self._readers[key]
                    await self._retire(key, reader)

    async def _retire(self, key: Key, reader: Reader) -> None:
        """Close a reader that is out of the pool (its thread is done or ends); one whose
        thread did not stop is kept in mind: its engine's memory must stay mapped."""
        await reader.backend.close()
        if reader.backend.alive:
            self._stuck.append((key, reader))

    async def _open(self, key: Key, metadata: bytes, buffers: Sequence[MappedBuffer]) -> Reader:
        start = time.perf_counter()
        backend = await self._agent()
        created = time.perf_counter()
        try:
            await backend.register(buffers)
            registered = time.perf_counter()
            peer = await backend.add_peer(metadata)
        except BaseException:
            await backend.close()
            raise
        log.info(
            "reader %s opened for peer %s into engine %s (slot %d of the pair's) in %.1f ms "
            "(agent %.1f, registration %.1f, peer metadata %.1f)",
            backend.name,
            *key,
            (time.perf_counter() - start) * 1e3,
            (created - start) * 1e3,
            (registered - created) * 1e3,
            (time.perf_counter() - registered) * 1e3,
        )
        self.start()  # the next reader's agent
        return Reader(backend, peer, metadata, idle_since=time.monotonic())

    async def close_engine(self, engine_key: str) -> bool:
        """Destroy every agent that reads into `engine_key`'s buffers. True when all are
        gone, so that nothing NIXL posted can touch those buffers any more. A reader being
        opened for it meanwhile is closed by its `get`, which fails."""
        self._closing.add(engine_key)
        gone = await self._close(lambda key: key[1] == engine_key)
        if gone:  # else an open still running closes what it opens, whenever it ends
            self._closing.discard(engine_key)
        return self._none_stuck(lambda key: key[1] == engine_key) and gone

    async def close(self) -> bool:
        self._closed = True
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(Exception):
                await (await spare).close()
        gone = await self._close(lambda key: True)
        return self._none_stuck(lambda key: True) and gone

    async def _close(self, touches: Callable[[Key], bool]) -> bool:
        """Close the readers whose key `touches`, once no `get` is opening one (each
        holds its key's lock meanwhile, and closes what it opened, seeing the close).
        False when one was still opening after OPEN_WAIT_S (a NIXL call that hangs):
        it may yet register the memory, which must then stay mapped."""
        gone = True
        for key, lock in list(self._locks.items()):
            if touches(key):
                try:
                    async with asyncio.timeout(OPEN_WAIT_S), lock:
                        pass
                except TimeoutError:
                    log.error("a reader for %s was still opening after %gs", key, OPEN_WAIT_S)
                    gone = False
        for key in [key for key in self._readers if touches(key)]:
            reader = self._readers.pop(key)
            if not self._waiting.get(key):
                self._locks.pop(key, None)
            await reader.backend.close()
            if reader.backend.alive:
                log.error("reader %s did not stop: its memory stays mapped", reader.backend.name)
                gone = False
        return gone

    def _none_stuck(self, touches: Callable[[Key], bool]) -> bool:
        """No replaced reader whose key `touches` still runs (those that stopped since
        are forgotten)."""
        self._stuck = [(key, reader) for key, reader in self._stuck if reader.backend.alive]
        still = [reader.backend.name for key, reader in self._stuck if touches(key)]
        if still:
            log.error("readers %s did not stop: their memory stays mapped", ", ".join(still))
        return not still

    def __len__(self) -> int:
        """Open readers. Also read from the metrics server's thread: the list is made in
        one step under the GIL, so the loop changing the pool meanwhile is harmless."""
        return sum(1 for r in list(self._readers.values()) if not r.backend.closed)
