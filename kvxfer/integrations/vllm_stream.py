"""The `stream` op of `vllm_worker`: an engine's step time while transfers arrive.

Runs in the vLLM venv, inside the worker process. `llm.generate` returns only once
every request is done; this op drives vLLM's `LLMEngine` step by step instead, so
that some requests keep decoding while others are added as they come:

    {"op": "stream", "long_prompts": [[ids]], "long_max_tokens": N,
     "injected_max_tokens": M, "deadline_s": S}

starts the `long_prompts` ("already decoding": one that reaches N tokens is started
again, so they run until the end). The op then reads more lines from stdin while
it steps the engine, each acted on between two steps:

    {"start": true}                                   the window opens
    {"prompt": [ids], "kv_transfer_params": {...}}    add a request now (a P/D decode:
                                                      the connector loads its KV first)
    {"end": true}                                     the window closes

and replies once every added request has finished (or after `deadline_s`). Every
token's arrival is stamped as the front end receives it (what a streaming client
sees). The reply carries, per long request, its tokens' times inside the window
(the driver derives inter-token latency), per added request its add, first-token
and finish times, and the transfer durations vLLM's connector stats report per step
(NixlConnector's `transfer_duration`; kvxfer's connector writes its own stats file).
Times are seconds from the window's start.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from typing import IO, Any

INJECTED_PREFIX = "inj-"
LONG_PREFIX = "long-"


def _transfer_durations(stats: Any) -> list[float]:
    """`transfer_duration` lists anywhere in a connector stats payload (a dict, nested
    for a MultiConnector)."""
    found: list[float] = []
    if isinstance(stats, dict):
        for key, value in stats.items():
            if key == "transfer_duration" and isinstance(value, list):
                found += [float(v) for v in value]
            else:
                found += _transfer_durations(value)
    return found


def _capture_connector_stats(engine: Any, sink: list[float]) -> Callable[[], None]:
    """Copy each step's connector transfer durations into `sink` as vLLM records them;
    returns the undo. (Its stat loggers only keep aggregates: prometheus buckets start at
    5 ms, the log line gives a mean.)"""
    manager = engine.logger_manager
    if manager is None:
        return lambda: None
    original = manager.record

    def record(*args: Any, **kwargs: Any) -> Any:
        scheduler_stats = kwargs.get("scheduler_stats", args[0] if args else None)
        payload = getattr(scheduler_stats, "kv_connector_stats", None)
        if payload:
            sink.extend(_transfer_durations(payload))
        return original(*args, **kwargs)

    manager.record = record
    return lambda: setattr(manager, "record", original)


def _read_lines(stdin: IO[str], inbox: queue.Queue[dict[str, Any]]) -> None:
    """The op's own lines, up to and including {"end": true} (or EOF: an end too)."""
    for line in stdin:
        message = json.loads(line)
        inbox.put(message)
        if message.get("end"):
            return
    inbox.put({"end": True})


class _Run:
    """One stream op's bookkeeping: requests, their token times, the window clock."""

    def __init__(self, engine: Any, request: dict[str, Any]) -> None:
        from vllm import SamplingParams  # noqa: PLC0415 (vLLM exists only in the vLLM venv)
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        self.engine = engine
        self.request = request
        self.t0: float | None = None  # the window's start (perf_counter)
        self.end_s: float | None = None  # the window's end, from t0
        self.long_tokens: dict[str, list[float]] = {}  # request id -> token times in window
        self.long_index: dict[str, int] = {}  # request id -> its prompt in long_prompts
        self.injected: dict[str, dict[str, Any]] = {}
        self.long_restarts = 0
        self._sampling = SamplingParams
        self._delta = RequestOutputKind.DELTA

    def params(self, max_tokens: int, kv_params: dict[str, Any] | None) -> Any:
        return self._sampling(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            output_kind=self._delta,
            extra_args=None if kv_params is None else {"kv_transfer_params": kv_params},
        )

    def add(self, request_id: str, prompt: list[int], params: Any) -> None:
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)

    def start_long(self, index: int) -> None:
        prompt = self.request["long_prompts"][index]
        request_id = f"{LONG_PREFIX}{index}-{self.long_restarts}"
        self.long_restarts += 1
        self.add(request_id, prompt, self.params(int(self.request["long_max_tokens"]), None))
        self.long_tokens[request_id] = []
        self.long_index[request_id] = index

    def now(self) -> float:
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0

    def on_message(self, message: dict[str, Any]) -> None:
        missing = [k for k in ("prompt", "kv_transfer_params") if k not in message]
        if not (message.get("start") or message.get("end")) and missing:
            raise ValueError(f"stream line {sorted(message)}: {', '.join(missing)} missing")
        if message.get("start"):
            self.t0 = time.perf_counter()
        elif message.get("end"):
            self.end_s = self.now()
        else:
            request_id = f"{INJECTED_PREFIX}{len(self.injected)}"
            self.injected[request_id] = {"added_s": self.now(), "tokens": 0}
            max_tokens = int(self.request["injected_max_tokens"])
            self.add(request_id, message["prompt"],
                     self.params(max_tokens, message["kv_transfer_params"]))  # fmt: skip

    def on_output(self, out: Any, stamp: float) -> None:
        request_id: str = out.request_id
        new = len(out.outputs[0].token_ids) if out.outputs else 0
        if request_id in self.long_tokens:
            if self.t0 is not None and self.end_s is None and new:
                self.long_tokens[request_id] += [stamp] * new
            if out.finished:
                self.start_long(self.long_index[request_id])
        elif request_id in self.injected:
            row = self.injected[request_id]
            row["tokens"] += new
            if new and "first_token_s" not in row:
                row["first_token_s"] = stamp
            if out.finished:
                row["finished_s"] = stamp
                row["finish_reason"] = out.outputs[0].finish_reason if out.outputs else None

    def done(self) -> bool:
        return self.end_s is not None and all("finished_s" in r for r in self.injected.values())


def stream(llm: Any, request: dict[str, Any], stdin: IO[str]) -> dict[str, Any]:
    """Run one window (see the module docstring), reading its lines from `stdin`;
    returns the reply's measured part."""
    for key in ("long_prompts", "long_max_tokens", "injected_max_tokens"):
        if key not in request:
            raise ValueError(f"stream: {key} missing")
    engine = llm.llm_engine
    run = _Run(engine, request)
    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(stdin, inbox), daemon=True)
    reader.start()
    durations: list[float] = []
    for index in range(len(request["long_prompts"])):
        run.start_long(index)
    deadline_s = float(request.get("deadline_s", 600.0))
    deadline = time.perf_counter() + deadline_s
    undo = _capture_connector_stats(engine, durations)
    try:
        while not run.done():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"stream did not finish within {deadline_s} s")
            while not inbox.empty():
                message = inbox.get()
                if message.get("start"):
                    durations.clear()
                run.on_message(message)
            outputs = engine.step()
            stamp = run.now()
            for out in outputs:
                run.on_output(out, stamp)
    finally:
        undo()
        # External ids; vLLM skips those already finished. Injected ones only after a
        # failure (a stuck load would otherwise keep the drain below going).
        engine.abort_request([*run.long_tokens, *run.injected])
        while engine.has_unfinished_requests():
            engine.step()
        # The op's lines must all be read here, also after a failure: the worker's own
        # loop reads the next op from the same stdin.
        reader.join(max(0.0, deadline - time.perf_counter()) + 60.0)
    return {
        "window_s": run.end_s,
        "long_token_times": [times for times in run.long_tokens.values() if times],
        "injected": list(run.injected.values()),
        "connector_transfer_durations_s": durations,
    }
