"""Timestamps at the steps of a pull, in every kvxfer process of a bench run.

Loaded by Python at start-up (this directory first on PYTHONPATH) in the
bench, both sidecars and their children; it does nothing unless
PULL_TRACE_DIR names a directory (not a KVXFER_ variable: the sidecar
refuses those it does not know). Then each process that imports kvxfer
wraps the functions below and appends `<monotonic ns> <point>` lines to
`<dir>/<pid>.log` (CLOCK_MONOTONIC is one clock for every process on the
host, so the files line up). A point is `name>` on entry and `name<` on
return; `@nixl` marks one seen on a NIXL agent's thread. Each line is one
`os.write`, about 2 us, so the trace slows what it times a little.

`benchmarks/trace_pull.py` runs the bench with this and prints where a
pull's time goes. The points wrap private functions on purpose (they are the
steps); `install` raises if one is gone, and `tests/test_pull_trace.py`
installs them all, so a rename breaks the test, not the trace.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any

ENV = "PULL_TRACE_DIR"
NIXL_THREAD_PREFIX = "nixl-"  # kvxfer.dataplane.adapter.THREAD_PREFIX, not imported early

_log: list[int] = []  # this process's log file, once opened


def record(point: str) -> None:
    if not _log:
        path = os.path.join(os.environ[ENV], f"{os.getpid()}.log")
        _log.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    if threading.current_thread().name.startswith(NIXL_THREAD_PREFIX):
        point += "@nixl"
    os.write(_log[0], f"{time.monotonic_ns()} {point}\n".encode())


MARK = "__pull_trace__"  # on a wrapper: the step it traces


def _traced(fn: Callable[..., Any], name: str, label: Callable[..., str] | None) -> Any:
    """`fn`, recording `name>` on entry and `name<` on return (async or not); with
    `label`, the name is `label(*args)`, computed per call."""

    def point(args: tuple[Any, ...]) -> str:
        return name if label is None else label(*args)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            at = point(args)
            record(at + ">")
            try:
                return await fn(*args, **kwargs)
            finally:
                record(at + "<")

        return traced_async

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        at = point(args)
        record(at + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            record(at + "<")

    return traced


def _wrap(owner: Any, attr: str, name: str, label: Callable[..., str] | None = None) -> None:
    fn = getattr(owner, attr)  # AttributeError: the traced step was renamed or removed
    wrapper = _traced(fn, name, label)
    setattr(wrapper, MARK, name or attr)
    setattr(owner, attr, wrapper)


def install() -> list[str]:
    """Wrap every traced step; the names wrapped. Raises if one is missing. (kvxfer is
    imported here, not at the top: a process not traced imports nothing.)"""
    from kvxfer.client import engine as client_engine  # noqa: PLC0415
    from kvxfer.dataplane import adapter, executor  # noqa: PLC0415
    from kvxfer.server import lane, peers, pulls, servicers  # noqa: PLC0415

    # The engine (the bench's own loop): its Pull call, and each event it decodes.
    _wrap(client_engine.EngineClient, "pull", "engine.pull")
    _wrap(client_engine, "event_from_proto", "engine.event")
    # Either sidecar: a lane frame read and dispatched, a frame written (by kind).
    _wrap(lane._Connection, "_dispatch", "", lambda _c, _i, kind, _p: f"lane.read.{kind.name}")
    _wrap(lane._Connection, "_send", "", lambda _c, _i, kind, *_: f"lane.write.{kind.name}")
    # The decode sidecar: the Pull handler (plan), the read begun (bind, hand-off to
    # the NIXL thread), the post and copy on that thread, the outcome back on the loop,
    # and BeginRead from its call to its answer.
    _wrap(servicers.EngineServicer, "Pull", "decode.Pull")
    _wrap(pulls, "execute_plan", "decode.execute_plan")
    _wrap(adapter.NixlAgent, "post_all", "decode.post_all")
    _wrap(adapter.NixlAgent, "_post", "decode.post")
    _wrap(executor, "_at_once", "decode.outcome")
    _wrap(peers.PeerLinks, "begin_read", "decode.begin_read")
    # The prefill sidecar: BeginRead's handler.
    _wrap(servicers.PeerServicer, "BeginRead", "prefill.BeginRead")
    return [
        "engine.pull", "engine.event", "lane.read", "lane.write", "decode.Pull",
        "decode.execute_plan", "decode.post_all", "decode.post", "decode.outcome",
        "decode.begin_read", "prefill.BeginRead",
    ]  # fmt: skip


if os.environ.get(ENV):
    install()
