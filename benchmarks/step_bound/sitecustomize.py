"""A bound, not a build: a pull whose params, plan and binding cost nothing.

Python loads this at start-up in every process that has this directory on
PYTHONPATH. It does nothing unless STEP_BOUND_DIR is set. Then, in a process
with kvxfer installed, three steps of the decode sidecar's pull remember what
they returned and return it again for the same input:

- `params_from_proto`, by the message's bytes but its request id (each round
  pulls a new one, which the remembered params are then given);
- `plan_transfer`, by the identity of both layouts and the rest of its
  arguments (spans, token counts, chunk size);
- `handle_jobs` (the binding), by the identity of the chunks, which the
  remembered plan keeps alive; only the job's post callback is new.

`kvxfer-cli bench` pulls the same request shape every round, so after its first
pulls each of these steps is a dictionary lookup. What the bench then reads is
the most that any faster implementation of those steps (native code) could
save: `benchmarks/probe_step_bound.py` runs it beside an unchanged bench.

Nothing here is fit for serving: a real fleet's pulls differ, and a plan is only
right for the buffers it was made for. Each process writes how often each step
was remembered to `<dir>/<pid>.json` at exit, so the probe can refuse a run in
which the steps were not skipped.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
from typing import Any

ENV = "STEP_BOUND_DIR"

_hits: dict[str, int] = {"params": 0, "plan": 0, "bind": 0}
_misses: dict[str, int] = {"params": 0, "plan": 0, "bind": 0}


def _remembered(step: str, table: dict[Any, Any], key: Any) -> Any:
    found = table.get(key)
    (_misses if found is None else _hits)[step] += 1
    return found


def install() -> None:
    """Wrap the three steps; a step renamed away raises AttributeError before any is."""
    from kvxfer.dataplane import executor  # noqa: PLC0415
    from kvxfer.server import servicers, sidecar  # noqa: PLC0415

    plan_transfer = sidecar.plan_transfer
    handle_jobs = executor.handle_jobs
    params_from_proto = servicers.params_from_proto
    plans: dict[Any, Any] = {}
    bindings: dict[Any, Any] = {}
    params: dict[bytes, Any] = {}

    def remembered_plan(src: Any, dst: Any, src_spans: Any, dst_spans: Any, *rest: Any) -> Any:
        key = (id(src), id(dst), tuple(src_spans), tuple(dst_spans), rest)
        known = _remembered("plan", plans, key)
        if known is None:  # the layouts kept with it: their ids stay theirs
            known = plans[key] = (src, dst, plan_transfer(src, dst, src_spans, dst_spans, *rest))
        return known[2]

    def remembered_binding(
        chunks: Any, peer: str, local: Any, remote: Any, options: Any, write: bool = False,
        on_post: Any = None,
    ) -> Any:  # fmt: skip
        key = (id(chunks), peer, options, write)  # local and remote: the sidecar's own
        known = _remembered("bind", bindings, key)
        if known is None:
            handles = handle_jobs(chunks, peer, local, remote, options, write, on_post)
            bindings[key] = (chunks, handles)  # the chunks kept: their id stays theirs
            return handles
        return [(dataclasses.replace(job, on_post=on_post), n) for job, n in known[1]]

    def remembered_params(message: Any, field: str = "params") -> Any:
        # Each bench round pulls a new request id: remembered without it, then given it.
        blank = type(message)()
        blank.CopyFrom(message)
        blank.request_id = ""
        key = blank.SerializeToString()
        found = _remembered("params", params, key)
        if found is None:
            found = params[key] = params_from_proto(message, field)
        return dataclasses.replace(found, request_id=message.request_id)

    sidecar.plan_transfer = remembered_plan
    executor.handle_jobs = remembered_binding
    servicers.params_from_proto = remembered_params


def _write(path: str) -> None:
    if any(_hits.values()) or any(_misses.values()):
        with open(path, "w", encoding="utf-8") as out:
            json.dump({"hits": _hits, "misses": _misses}, out)


def _at_start_up() -> None:
    directory = os.environ.get(ENV)
    if not directory:
        return
    try:
        import kvxfer  # noqa: F401, PLC0415
    except ModuleNotFoundError:  # a Python without kvxfer: nothing to bound
        return
    install()
    atexit.register(_write, os.path.join(directory, f"{os.getpid()}.json"))


_at_start_up()
