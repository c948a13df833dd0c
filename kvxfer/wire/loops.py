"""The event loops kvxfer's processes and its engine client run.

Where kvxfer picks the loop (the sidecar's setting `event_loop`, `SyncEngineClient`'s
thread, which the vLLM connector calls through, and kvxfer-cli's bench and demo
engines) it runs `uvloop` by default (libuv's: scheduling and socket I/O in C; the 1k-token
pull's overhead median 0.06-0.7 ms lower here in two A/Bs, docs/benchmarks.md); Python's
own `asyncio` loop on request. A missing uvloop is an error that says how to choose the
other loop, never a quiet fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

from kvxfer._exceptions import KvxferError

T = TypeVar("T")
EventLoop = Literal["uvloop", "asyncio"]
# uvloop: the hang once blamed on it (test_sidecar_tp_heads, about one run in 25) was
# Python 3.11's wait_for losing a cancel that lands with the answer, on either loop
# (tests/test_cancel_as_answered.py); 81 runs of that file on uvloop since, none hung.
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


def run(main: Coroutine[Any, Any, T], name: str, setting: str = "event_loop") -> T:
    """`asyncio.run(main)` on the loop `name` names. The loop is also made the thread's
    current one, as `asyncio.run` does (a Runner given a loop_factory does not): gRPC's
    asyncio stack looks its loop up that way."""
    if name == "asyncio":
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=loop_factory(name, setting)) as runner:
        asyncio.set_event_loop(runner.get_loop())
        try:
            return runner.run(main)
        finally:
            asyncio.set_event_loop(None)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """ "uvloop" or "asyncio": which loop this is (the sidecar's ready line says it)."""
    return type(loop).__module__.partition(".")[0]


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """`await awaitable` for at most `seconds` (TimeoutError after). Not
    asyncio.wait_for: on Python 3.11 it returns the result and drops a cancellation
    that lands in the same loop turn (tests/test_cancel_as_answered.py)."""
    async with asyncio.timeout(seconds):
        return await awaitable
