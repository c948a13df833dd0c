"""One long-lived vLLM engine, driven over a pipe by `kvxfer.integrations.vllm_fleet`.

Runs in the vLLM venv (`make vllm-venv`), never in kvxfer's own:
`python -m kvxfer.integrations.vllm_worker '<config json>'`. The config names
the model directory and engine options (see `vllm_fleet.EngineSpec`). The
worker answers one JSON object per line on its original stdout and sends
everything else vLLM prints (Python logging and native code alike) to stderr,
so log lines can never corrupt the protocol.

Requests (one JSON object per line on stdin):
  {"op": "generate", "prompts": [[ids]], "max_tokens": N, "kv_transfer_params": [obj|null]}
  {"op": "reset_prefix_cache"}   (drop the engine's own prefix cache; connectors keep theirs)
  {"op": "stream", ...}          (requests added while others decode: see vllm_stream)
  {"op": "quit"}
Replies: {"ok": true, ...} or {"ok": false, "error": "..."}; the first line is
{"ok": true, "ready": true, ...} once the engine has loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from kvxfer.integrations import vllm_stream
from kvxfer.integrations.cpu_amx import ALLOW_AMX_ENV, allow_amx

# Metrics a reply carries (summed over label sets): vLLM's NixlConnector
# transfer stats and the time-to-first-token histogram.
_METRIC_PREFIXES = ("vllm:nixl_", "vllm:time_to_first_token_seconds", "vllm:kv_")


# Before anything runs a kernel: see cpu_amx.allow_amx. Spawned vLLM processes
# re-import this module, so each of them asks. Engines with kvxfer's connector are
# left to it (vllm_fleet sets this only for the others), so the tier tests its call.
if os.environ.get(ALLOW_AMX_ENV) == "1":
    allow_amx()


def _protocol_stream() -> IO[str]:
    """Keep the real stdout for replies and point fd 1 at stderr for everything else."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def _engine(config: dict[str, Any]) -> Any:
    from vllm import LLM  # noqa: PLC0415 (vLLM exists only in the vLLM venv)

    options: dict[str, Any] = {
        "model": config["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": config.get("dtype", "bfloat16"),
        "max_model_len": config["max_model_len"],
        "seed": config.get("seed", 0),
        # Stats on: the NixlConnector transfer metrics and TTFT come from them.
        "disable_log_stats": False,
    }
    for key in ("block_size", "enable_prefix_caching"):
        if config.get(key) is not None:
            options[key] = config[key]
    if config.get("tensor_parallel_size", 1) > 1:
        options["tensor_parallel_size"] = config["tensor_parallel_size"]
        options["distributed_executor_backend"] = "mp"
    if config.get("kv_transfer_config") is not None:
        from vllm.config import KVTransferConfig  # noqa: PLC0415

        options["kv_transfer_config"] = KVTransferConfig(**config["kv_transfer_config"])
    return LLM(**options)


def _metrics(llm: Any) -> dict[str, float]:
    """Counters and histogram sums/counts under `_METRIC_PREFIXES`, summed over labels."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(_METRIC_PREFIXES):
            continue
        if hasattr(metric, "sum") and hasattr(metric, "count"):
            pairs = {f"{metric.name}_sum": metric.sum, f"{metric.name}_count": metric.count}
        elif isinstance(getattr(metric, "value", None), int | float):
            pairs = {metric.name: metric.value}
        else:
            continue
        for key, value in pairs.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def _peak_rss_bytes() -> int:
    """High-water RSS of this process and its children (vLLM's engine core)."""
    import psutil  # noqa: PLC0415 (a vLLM dependency)

    total = 0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    prompts = request["prompts"]
    params_list = request.get("kv_transfer_params") or [None] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(
            f"kv_transfer_params has {len(params_list)} entries for {len(prompts)} prompts"
        )
    sampling = [
        SamplingParams(
            temperature=0.0,
            max_tokens=request["max_tokens"],
            ignore_eos=True,
            extra_args=None if params is None else {"kv_transfer_params": params},
        )
        for params in params_list
    ]
    started = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts], sampling, use_tqdm=False
    )
    elapsed_s = time.perf_counter() - started
    return {
        "ok": True,
        "elapsed_s": elapsed_s,
        "outputs": [
            {
                "token_ids": list(out.outputs[0].token_ids),
                "kv_transfer_params": out.kv_transfer_params,
                "prompt_tokens": len(out.prompt_token_ids or ()),
                "finish_reason": out.outputs[0].finish_reason,
            }
            for out in outputs
        ],
        "metrics": _metrics(llm),
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def keep_niceness_in_own_session() -> None:
    """The engine runs in a session of its own (vllm_fleet starts it so, to stop it with
    its children). Where Linux groups each session's processes for the CPU (autogroup,
    on by default), that group competes with every other at its own niceness, 0 unless
    set, whatever the niceness of its processes: a niced engine (TP > 1, or started by a
    niced caller) would take the CPU from un-niced sidecars and tests as if it were not
    niced. So the group gets the niceness the engine runs at. Raising it needs no
    privilege; without autogroup there is nothing to do. Only a session leader does it:
    run from a shell, the group would be the shell's."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0 and os.getsid(0) == os.getpid():
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(str(nice))


def main() -> None:
    replies = _protocol_stream()
    config = json.loads(sys.argv[1])
    if config.get("nice"):
        os.nice(int(config["nice"]))  # the engine's processes inherit it
    keep_niceness_in_own_session()
    started = time.perf_counter()
    llm = _engine(config)
    ready = {"ok": True, "ready": True, "load_s": time.perf_counter() - started}
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        try:
            reply: dict[str, Any]
            if request.get("op") == "reset_prefix_cache":
                reply = {"ok": True, "reset": bool(llm.reset_prefix_cache())}
            elif request.get("op") == "generate":
                reply = _generate(llm, request)
            elif request.get("op") == "stream":
                reply = {
                    "ok": True,
                    **vllm_stream.stream(llm, request, sys.stdin),
                    "metrics": _metrics(llm),
                }
            else:
                raise ValueError(
                    f"op {request.get('op')!r} unknown; expected generate, stream, "
                    "reset_prefix_cache or quit"
                )
        except Exception as exc:  # any failure goes back to the driver, which raises it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
