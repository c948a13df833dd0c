"""Engines registered with this sidecar, and the events queued for each.

An engine hands over its layout (with regions) and buffer handles; the
sidecar maps every buffer, checks each region fits inside its buffer, and
registers them with NIXL. An engine whose process is known (a unix-socket
caller, `server/callers.py`) is watched: when it dies it is retired like an
explicit Unregister. A retiring engine takes no new work but keeps its
buffers registered until no read of its blocks is in flight.

Events (PullDone, Released, LeaseExpired) wait in a per-engine queue until
the engine's watcher takes them, so an event emitted before the engine
started watching is not lost; one watcher at a time. The queue goes with the
engine: a watch on it drains what the retirement emitted, one that arrives
once the retirement has begun is refused (not found).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvxfer._exceptions import InvalidInputError, LayoutError, NotFoundError, shown
from kvxfer.core.buffers import BoundBuffer, BufferHandle
from kvxfer.core.layout import BlockSpan, EngineLayout, GroupKind
from kvxfer.core.planner import check_span_ids, group_blocks
from kvxfer.core.requests import EngineEvent
from kvxfer.dataplane.memory import MappedBuffer
from kvxfer.server.callers import Caller, ProcessWatch


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
    caller: Caller | None = None  # None: registered over TCP, the process is unknown
    watch: ProcessWatch | None = None
    retiring: str = ""  # why it is going ("unregistered", "process 123 exited"), once it is
    retired: asyncio.Task[tuple[int, int]] | None = None  # the retirement, once started
    reads_ended: asyncio.Event = field(default_factory=asyncio.Event)  # last lease gone

    @property
    def registered_bytes(self) -> int:
        return sum(b.handle.size_bytes for b in self.buffers)

    def check_live(self) -> None:
        """Refuse new work once the engine is retiring. A transfer that awaited (a peer's
        handshake, BeginWrite) after its first check must check again before it is
        recorded: the retirement waits only for transfers it can see, then unmaps the
        buffers, and one recorded after that would register or copy unmapped memory."""
        if self.retiring:
            raise NotFoundError(f"engine {self.engine_id!r} is going away ({self.retiring})")


def check_regions_fit(layout: EngineLayout, handles: list[BufferHandle]) -> None:
    """Every region must lie inside a declared buffer, before anything is mapped."""
    if not layout.regions:
        raise LayoutError("layout.regions", "an engine must register the regions of its layout")
    sizes: dict[str, int] = {}
    for i, handle in enumerate(handles):
        if handle.name in sizes:
            raise LayoutError(f"buffers[{i}].name", f"buffer name {shown(handle.name)} repeats")
        sizes[handle.name] = handle.size_bytes
    for region in layout.regions:
        size = sizes.get(region.buffer)
        where = f"layout.regions['{region.name}']"
        if size is None:
            raise LayoutError(f"{where}.buffer", f"names unknown buffer {shown(region.buffer)}")
        if region.end_bytes > size:
            raise LayoutError(
                where,
                f"ends at byte {region.end_bytes}, "
                f"past buffer {shown(region.buffer)} ({size} bytes)",
            )


def check_spans_cover(layout: EngineLayout, num_tokens: int, spans: tuple[BlockSpan, ...]) -> None:
    """A published request must hold what any pull of it needs: every group that moves
    anything needs a span, reaching the last block of the `num_tokens` tokens (the Mamba
    state: block 0). A pull whose reader holds a prefix may need less, never more."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise InvalidInputError("num_tokens", f"must be at least 1, got {num_tokens!r}")
    if not spans:
        raise InvalidInputError(
            "spans", f"empty: {num_tokens} tokens need the blocks of every KV group"
        )
    by_group = {span.group_id: (i, span) for i, span in enumerate(spans)}
    for group in layout.groups:
        kind = group.kind
        blocks = group_blocks(group, num_tokens, 0, layout.block_size_of(group))
        if not blocks:
            continue
        last = blocks.stop - 1
        what = "the state block 0" if kind is GroupKind.MAMBA else f"logical block {last}"
        found = by_group.get(group.group_id)
        if found is None:
            raise InvalidInputError(
                f"spans[group {group.group_id}]", f"missing; {num_tokens} tokens need {what}"
            )
        i, span = found
        if not span.first_block <= last < span.end_block:
            raise InvalidInputError(
                f"spans[{i}]",
                f"covers logical blocks {span.first_block}..{span.end_block - 1} of group "
                f"{group.group_id}; num_tokens {num_tokens} needs {what}",
            )


def check_span_ids_once(layout: EngineLayout, spans: tuple[BlockSpan, ...], field: str) -> None:
    """One span per group, each naming block ids the layout's regions hold."""
    seen: set[int] = set()
    for i, span in enumerate(spans):
        if span.group_id in seen:
            raise InvalidInputError(f"{field}[{i}].group_id", f"group {span.group_id} repeats")
        seen.add(span.group_id)
        check_span_ids(layout, span, f"{field}[{i}]")
