"""Timestamps at the steps of a pull, in every kvxfer process of a bench run.

Python loads this at start-up in every process that has this directory on
PYTHONPATH: the bench, both sidecars and their children. It does nothing
unless PULL_TRACE_DIR is set (not a KVXFER_ variable: the sidecar refuses
those it does not know). Then a process that has kvxfer installed wraps the
steps in `STEPS` and appends `<monotonic ns> <point>` lines to
`<dir>/<pid>.log`. CLOCK_MONOTONIC is one clock for every process on the
host, so the files line up. A point is `name>` on entry and `name<` on
return. `@nixl` marks a point seen on a NIXL agent's thread. A lane frame is
named by its kind and its call's method (`lane.read.UNARY.Pull`,
`lane.write.ITEM.WatchEvents`), and an event the engine decodes by its kind
(`engine.event.pull_done`). Each line is one `os.write` of about 2 us, so
the trace slows what it times a little.

`benchmarks/trace_pull.py` runs the bench with this and prints where a
pull's time goes. The steps are private functions on purpose: they are the
steps. `install` resolves every one before it wraps any, so a step renamed
away fails the whole install, and `tests/test_pull_trace.py` installs them
all. A rename therefore breaks the test, not the profile.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any

ENV = "PULL_TRACE_DIR"
MARK = "__pull_trace__"  # on a wrapper: the step it traces

_log: list[int] = []  # this process's log file, opened by install
_nixl_prefix: list[str] = []  # kvxfer's NIXL thread name prefix, read by install
_methods: dict[tuple[int, int], str] = {}  # (connection id, call id) -> method, per lane


def record(point: str) -> None:
    """One line in this process's log. Tracing must never change what it traces, so a
    failed write is dropped (the analysis then finds the step missing)."""
    if _nixl_prefix and threading.current_thread().name.startswith(_nixl_prefix[0]):
        point += "@nixl"
    with contextlib.suppress(OSError, IndexError):
        os.write(_log[0], f"{time.monotonic_ns()} {point}\n".encode())


def _traced(fn: Callable[..., Any], name: str | Callable[..., str]) -> Any:
    """`fn`, recording `<name>>` on entry and `<name><` on return, raise or cancel
    (async or not); a callable `name` is called with the call's arguments."""

    def point(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return name if isinstance(name, str) else name(*args, **kwargs)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            at = point(args, kwargs)
            record(at + ">")
            try:
                return await fn(*args, **kwargs)
            finally:
                record(at + "<")

        return traced_async

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        at = point(args, kwargs)
        record(at + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            record(at + "<")

    return traced


def _frame_read(connection: object, call_id: int, kind: Any, payload: bytes) -> str:
    """A lane frame the serving side read: its kind and, for a call, its method (kept
    to name the frames written back for it)."""
    from kvxfer.wire.lane import LaneProtocolError, split_request  # noqa: PLC0415

    if kind.name not in ("UNARY", "STREAM"):
        return f"lane.read.{kind.name}"
    try:
        method, _ = split_request(payload)
    except LaneProtocolError:  # the lane refuses it; the trace only names it
        method = "?"
    _methods[(id(connection), call_id)] = method
    return f"lane.read.{kind.name}.{method}"


def _frame_written(connection: object, call_id: int, kind: Any, *_: Any) -> str:
    key = (id(connection), call_id)
    method = _methods.get(key, "?")
    if kind.name in ("REPLY", "ERROR", "END"):  # the call's last frame
        _methods.pop(key, None)
    return f"lane.write.{kind.name}.{method}"


def _event(message: Any) -> str:
    return f"engine.event.{message.WhichOneof('event')}"


def _steps() -> list[tuple[Any, str, str | Callable[..., str]]]:
    """(owner, attribute, point name) of every traced step."""
    from kvxfer.client import engine as client_engine  # noqa: PLC0415
    from kvxfer.dataplane import adapter, executor  # noqa: PLC0415
    from kvxfer.server import lane, peers, pulls, servicers, sidecar  # noqa: PLC0415

    _nixl_prefix[:] = [adapter.THREAD_PREFIX]
    return [
        # The engine (the bench's own loop): its Pull call, each event it decodes.
        (client_engine.EngineClient, "pull", "engine.pull"),
        (client_engine, "event_from_proto", _event),
        # Either sidecar: a lane frame read and dispatched, a frame written.
        (lane._Connection, "_dispatch", _frame_read),
        (lane._Connection, "_send", _frame_written),
        # The decode sidecar: the Pull handler and its parts (the request's params
        # decoded, the plan), the read begun (its chunks bound, handed to the NIXL
        # thread), the post and copy on that thread, the outcome back on the loop,
        # BeginRead from its call to its answer.
        (servicers.EngineServicer, "Pull", "decode.Pull"),
        (servicers, "params_from_proto", "decode.params_from_proto"),
        (sidecar, "plan_transfer", "decode.plan_transfer"),
        (pulls, "execute_plan", "decode.execute_plan"),
        (executor, "handle_jobs", "decode.bind"),
        (adapter.NixlAgent, "post_all", "decode.post_all"),
        (adapter.NixlAgent, "_post", "decode.post"),
        (executor, "_at_once", "decode.outcome"),
        (peers.PeerLinks, "begin_read", "decode.begin_read"),
        # The prefill sidecar: BeginRead's handler.
        (servicers.PeerServicer, "BeginRead", "prefill.BeginRead"),
    ]


def install(directory: str) -> list[str]:
    """Open this process's log in `directory` and wrap every traced step: all of them,
    or none when one is missing (AttributeError). The attributes wrapped."""
    steps = _steps()
    found = [(owner, attr, name, getattr(owner, attr)) for owner, attr, name in steps]
    path = os.path.join(directory, f"{os.getpid()}.log")
    _log[:] = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)]
    for owner, attr, name, fn in found:
        wrapper = _traced(fn, name)
        setattr(wrapper, MARK, attr)
        setattr(owner, attr, wrapper)
    return [attr for _, attr, _, _ in found]


def _at_start_up() -> None:
    directory = os.environ.get(ENV)
    if not directory:
        return
    try:
        import kvxfer  # noqa: F401, PLC0415
    except ModuleNotFoundError:  # a Python without kvxfer (a tool, a child): nothing to trace
        return
    install(directory)


_at_start_up()
