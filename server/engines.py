"""Engines registered with this sidecar, and the events queued for each.

An engine hands over its layout (with regions) and buffer handles; the
sidecar maps every buffer, checks each region fits inside its buffer, and
registers them with NIXL. Events (PullDone, Released, LeaseExpired) wait in
a per-engine queue until the engine's watcher takes them, so an event
emitted before the engine started watching is not lost; one watcher at a
time.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvxfer._exceptions import InvalidInputError, LayoutError
from kvxfer.core.buffers import BoundBuffer, BufferHandle
from kvxfer.core.layout import EngineLayout
from kvxfer.core.requests import EngineEvent
from kvxfer.dataplane.memory import MappedBuffer


class EventQueue:
    """Events for one engine, held until watched. Bounded: when full and unwatched,
    the oldest event is dropped and counted (`on_drop`)."""

    def __init__(self, limit: int, on_drop: Callable[[], None]) -> None:
        self._events: collections.deque[EngineEvent] = collections.deque()
        self._limit = limit
        self._on_drop = on_drop
        self._wakeup = asyncio.Event()
        self._watched = False
        self._closed = False

    def put(self, event: EngineEvent) -> None:
        if len(self._events) >= self._limit:
            self._events.popleft()
            self._on_drop()
        self._events.append(event)
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    async def watch(self) -> AsyncIterator[EngineEvent]:
        if self._watched:
            raise InvalidInputError("engine_id", "this engine's events are already being watched")
        self._watched = True
        try:
            while True:
                while self._events:
                    yield self._events.popleft()
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
        finally:
            self._watched = False


@dataclass
class Engine:
    engine_id: str
    name: str
    layout: EngineLayout
    buffers: list[MappedBuffer]
    events: EventQueue
    bound: dict[str, BoundBuffer] = field(default_factory=dict)

    @property
    def registered_bytes(self) -> int:
        return sum(b.handle.size_bytes for b in self.buffers)


def check_regions_fit(layout: EngineLayout, handles: list[BufferHandle]) -> None:
    """Every region must lie inside a declared buffer, before anything is mapped."""
    if not layout.regions:
        raise LayoutError("layout.regions", "an engine must register the regions of its layout")
    sizes = {h.name: h.size_bytes for h in handles}
    for region in layout.regions:
        size = sizes.get(region.buffer)
        where = f"layout.regions['{region.name}']"
        if size is None:
            raise LayoutError(f"{where}.buffer", f"names unknown buffer {region.buffer!r}")
        if region.end_bytes > size:
            raise LayoutError(
                where,
                f"ends at byte {region.end_bytes}, past buffer {region.buffer!r} ({size} bytes)",
            )
