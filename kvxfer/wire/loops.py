"""The event loops kvxfer's processes and its engine client run.

`uvloop` (libuv's loop: scheduling and socket I/O in C) is the default wherever kvxfer
picks the loop: the sidecar (setting `event_loop`), `SyncEngineClient`'s thread (what
the vLLM connector calls through), and kvxfer-cli's bench and demo engines.
`asyncio` is Python's own. uvloop is a dependency, so a missing one is an error that
says how to choose the other loop, never a quiet fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from kvxfer._exceptions import KvxferError

EventLoop = Literal["uvloop", "asyncio"]
DEFAULT_EVENT_LOOP: EventLoop = "uvloop"


def loop_factory(name: str, setting: str = "event_loop") -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of the loop `name` names (for `asyncio.Runner(loop_factory=...)`)."""
    if name == "asyncio":
        return asyncio.new_event_loop
    if name != "uvloop":
        raise KvxferError(f"{setting}: {name!r} is not uvloop or asyncio")
    try:
        import uvloop  # noqa: PLC0415 (not on every platform: see pyproject.toml)
    except ImportError as exc:
        raise KvxferError(
            f"{setting}: uvloop cannot be imported ({exc}); install it, or choose asyncio"
        ) from exc
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """ "uvloop" or "asyncio": which loop this is (the sidecar's ready line says it)."""
    return type(loop).__module__.partition(".")[0]
