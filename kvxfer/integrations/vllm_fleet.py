"""Starting, driving and stopping real vLLM processes (demo, bench and tests).

vLLM runs in its own venv (`make vllm-venv`: it pins its own torch and
setuptools), so this module never imports it: each engine is a
`kvxfer.integrations.vllm_worker` process run by that venv's python, driven
over a pipe with one JSON object per line. The same code runs

- a single-instance reference (`reference_run`): prompts -> greedy token ids;
- a prefill/decode pair (`PdPair`), each engine pinned to its own core and
  given a `kv_transfer_config` (vLLM's NixlConnector, `nixl_connector_config`,
  or kvxfer's, `kvxfer_connector_config`), routed as a P/D router does:
  prefill with max_tokens=1 and `{"do_remote_decode": true}`, then decode with
  the `kv_transfer_params` prefill returned.

Every wait has a deadline; `close()` (also on failure, through the context
managers) stops each engine's whole process group: vLLM forks an engine core
and a worker below the process we start. kvxfer's sidecars are not started
here: `kvxfer.cli.fleet` starts those, and a caller passes their addresses in
`kvxfer_connector_config`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvxfer._exceptions import InvalidInputError, KvxferError
from kvxfer.integrations import process_groups
from kvxfer.integrations.cpu_amx import ALLOW_AMX_ENV

WORKER_MODULE = "kvxfer.integrations.vllm_worker"
VLLM_VENV = ".venv-vllm"
READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0
# After the worker quits: how long its engine core and Python's resource tracker get to
# finish their own clean-up (unlinking vLLM's shared memory) before they are signalled.
GROUP_DRAIN_S = 5.0
# vLLM names its ZMQ sockets ipc://<VLLM_RPC_BASE_PATH>/<uuid> and never unlinks them
# (default: the system temp dir, where every engine started would leave a dozen behind).
RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
# vLLM's NixlConnector metrics, as the worker reports them (histogram _sum/_count).
NIXL_BYTES = "vllm:nixl_bytes_transferred"
NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"


class VllmWorkerError(KvxferError):
    """A vLLM worker process failed to start, died, timed out or answered an error."""


def find_vllm_python(explicit: Path | None = None) -> Path:
    """The python of the vLLM venv: `explicit`, else `.venv-vllm` beside the running venv
    (a checkout's `.venv`), else the running python if it has vLLM itself."""
    candidates = [explicit] if explicit is not None else []
    candidates.append(Path(sys.prefix).parent / VLLM_VENV / "bin" / "python")
    for candidate in candidates:
        if candidate is not None and candidate.exists():
            return candidate
    with contextlib.suppress(ImportError):
        import vllm  # noqa: F401, PLC0415

        return Path(sys.executable)
    tried = ", ".join(str(c) for c in candidates)
    raise VllmWorkerError(f"no vLLM venv found (tried {tried}); run `make vllm-venv` first")


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what bind(0) and connect pick)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low


def free_port() -> int:
    """A loopback TCP port that is free now and stays free until an engine binds it.

    vLLM binds its NIXL side channel only after loading the model, seconds later. A port
    from the ephemeral range (bind to 0) can be taken meanwhile by any outgoing
    connection or bind(0) on the machine (seen in CI: the decode engine's handshake
    listener died with EADDRINUSE and the run hung); a port below that range is only
    ever taken by an explicit bind. Never the same port twice in one process."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, low) if low > 10001 else rng.randrange(low, 65536)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise VllmWorkerError("no free loopback port below the ephemeral range")


def random_prompts(count: int, lo: int, hi: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`count` prompts of `lo`..`hi` token ids drawn from [3, vocab_size) (0-2 are special)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(count)
    ]


def nixl_connector_config(load_failure_policy: str | None = None) -> dict[str, Any]:
    """vLLM's own NixlConnector on CPU memory (both roles: vLLM's P/D examples use kv_both);
    `load_failure_policy` sets vLLM's kv_load_failure_policy (None keeps its default)."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    if load_failure_policy is not None:
        config["kv_load_failure_policy"] = load_failure_policy
    return config


def kvxfer_connector_config(role: str, sidecar: str, **extra_config: Any) -> dict[str, Any]:
    """kvxfer's connector, talking to the sidecar at `sidecar` (e.g. "unix:/tmp/p.sock");
    `extra_config` adds connector options (e.g. stats_path). Load failures are recomputed:
    vLLM's default policy ("fail") would fail the request instead."""
    if role not in ("kv_producer", "kv_consumer"):
        raise InvalidInputError("kv_role", f"{role!r} unknown; expected kv_producer or kv_consumer")
    return {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"sidecar": sidecar, **extra_config},
    }


def host_offload_connector_config(cpu_bytes: int = 256 << 20) -> dict[str, Any]:
    """vLLM's OffloadingConnector with kvxfer's host-copy spec (`vllm_offload`): the
    in-tree specs need a GPU. `cpu_bytes` sizes its pool (vLLM's cpu_bytes_to_use)."""
    if cpu_bytes <= 0:
        raise InvalidInputError("cpu_bytes_to_use", f"must be positive, got {cpu_bytes}")
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "HostCopyOffloadingSpec",
            "spec_module_path": "kvxfer.integrations.vllm_offload",
            "cpu_bytes_to_use": cpu_bytes,
        },
    }


def multi_connector_config(children: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """vLLM's MultiConnector over `children` (each a kv_transfer_config), in that order:
    the first child reporting matched tokens loads a request; every child saves. The
    load-failure policy is the MultiConnector's own (vLLM's scheduler reads only the
    top level), so it is "recompute" when any child asks for it."""
    if not children:
        raise InvalidInputError("connectors", "MultiConnector needs at least one child")
    roles = {c.get("kv_role") for c in children} - {"kv_both"}
    recompute = any(c.get("kv_load_failure_policy") == "recompute" for c in children)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": roles.pop() if len(roles) == 1 else "kv_both",
        **({"kv_load_failure_policy": "recompute"} if recompute else {}),
        "kv_connector_extra_config": {"connectors": [dict(c) for c in children]},
    }


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine: model directory and the options the worker passes to `LLM`."""

    model: Path
    max_model_len: int = 2048
    block_size: int | None = None
    kv_transfer_config: Mapping[str, Any] | None = None
    # Core for VLLM_CPU_OMP_THREADS_BIND; None leaves vLLM's default (all cores).
    cpu: int | None = None
    kvcache_gib: int = 1
    # None keeps vLLM's default (on); off where a reference must not reuse earlier prompts.
    enable_prefix_caching: bool | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # Tensor-parallel size: that many worker processes, one core each from `cpu` on.
    tp_size: int = 1
    # Scheduling niceness of the engine's processes. vLLM-CPU's TP workers poll their
    # shared-memory queue for a second after every step, so on a machine with fewer
    # cores than engines they would starve the sidecars; niced, they take the idle CPU.
    nice: int = 0
    dtype: str = "bfloat16"

    def config_json(self) -> str:
        return json.dumps(
            {
                "model": str(self.model),
                "max_model_len": self.max_model_len,
                "block_size": self.block_size,
                "enable_prefix_caching": self.enable_prefix_caching,
                "tensor_parallel_size": self.tp_size,
                "nice": self.nice,
                "dtype": self.dtype,
                "kv_transfer_config": (
                    None if self.kv_transfer_config is None else dict(self.kv_transfer_config)
                ),
            }
        )

    def environ(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_gib)}
        if self.tp_size > 1:  # vLLM-CPU wants one core list per worker ("0|1")
            cores, first = os.cpu_count() or 1, self.cpu or 0
            ranks = (str((first + rank) % cores) for rank in range(self.tp_size))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(ranks)
        elif self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        connector = (self.kv_transfer_config or {}).get("kv_connector")
        if connector != "KvxferConnector":  # kvxfer's connector asks itself (cpu_amx.py)
            env[ALLOW_AMX_ENV] = "1"
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        return {**env, **self.env}


@dataclass(frozen=True)
class Generation:
    """One prompt's result from one engine."""

    token_ids: list[int]
    prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # "length" when all max_tokens came (the worker ignores EOS); anything else means
    # vLLM ended the request early, e.g. a KV load it could not complete ("error"/"abort").
    finish_reason: str | None


@dataclass(frozen=True)
class Reply:
    """One `generate` call: its outputs, wall time, metric deltas and memory high-water mark."""

    outputs: list[Generation]
    elapsed_s: float
    metrics_delta: dict[str, float]
    peak_rss_bytes: int


class VllmWorker:
    """One vLLM engine process; use as a context manager or call `close()`."""

    def __init__(self, name: str, spec: EngineSpec, python: Path, workdir: Path) -> None:
        self.name = name
        # vllm-: a fleet's sidecars of the same name log to <name>.log in the same place.
        self.log = workdir / f"vllm-{name}.log"
        workdir.mkdir(parents=True, exist_ok=True)
        env = spec.environ()
        # Unless the caller chose a place, the engine's sockets go in a directory of its
        # own (short, under the temp dir: a socket path is at most 107 bytes), removed
        # once the engine is gone.
        self._rpc_dir: Path | None = None
        if RPC_BASE_ENV not in env:
            self._rpc_dir = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-rpc-"))
            env[RPC_BASE_ENV] = str(self._rpc_dir)
        try:
            with self.log.open("w") as err:
                # cwd is the workdir: `python -m` puts cwd on sys.path, and a checkout's
                # kvxfer/ source folder there would shadow the installed package.
                self._popen = subprocess.Popen(
                    [str(python), "-m", WORKER_MODULE, spec.config_json()],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                    cwd=workdir, env=env, start_new_session=True,
                )  # fmt: skip
        except BaseException:
            self._remove_rpc_dir()
            raise
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()
        self._stopped: int | None = None  # its exit code, once stopped and swept
        self._metrics: dict[str, float] = {}
        self.ready: dict[str, Any] = {}
        self.peak_rss_bytes = 0
        self._segments: set[str] = set()  # vLLM's /dev/shm segments, swept once it is gone

    @property
    def rpc_dir(self) -> Path | None:
        """Where the engine's ZMQ sockets are (None: where the caller's environment said)."""
        return self._rpc_dir

    @property
    def pid(self) -> int:
        """The worker's pid, also its process group (vLLM's engine core runs in it)."""
        return self._popen.pid

    def _read(self) -> None:
        assert self._popen.stdout is not None
        for line in self._popen.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the worker exited

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        self.ready = self.receive(timeout_s, "start")
        self._note_segments()
        return self.ready

    @property
    def segments(self) -> frozenset[str]:
        """vLLM's own /dev/shm segments its group mapped (noted at start and at stop)."""
        return frozenset(self._segments)

    def _note_segments(self) -> None:
        self._segments |= process_groups.shm_mapped_by(process_groups.group_pids(self.pid))

    def _sweep(self) -> None:
        """Unlink the mapped shared memory its group left (its tracker gone too), once no
        process of the group is left (one stuck in the kernel still maps it: it stays)."""
        if process_groups.wait_group_gone(self.pid, STOP_TIMEOUT_S):
            process_groups.sweep(self._segments)

    def receive(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The next reply line (raises on an error reply, EOF or `timeout_s`)."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise self._failure(f"did not answer {what} within {timeout_s:.0f} s") from None
        if line is None:
            raise self._failure(
                f"exited with code {self._popen.wait(STOP_TIMEOUT_S)} during {what}"
            )
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise self._failure(f"{what} failed: {reply.get('error')}")
        return reply

    def _failure(self, message: str) -> VllmWorkerError:
        tail = self.log.read_text(errors="replace")[-3000:]
        return VllmWorkerError(f"vLLM worker {self.name} {message}; log {self.log}:\n{tail}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> Reply:
        raw = self.call(
            "generate", timeout_s, prompts=[list(p) for p in prompts], max_tokens=max_tokens,
            kv_transfer_params=None if kv_transfer_params is None else list(kv_transfer_params),
        )  # fmt: skip
        metrics: dict[str, float] = raw["metrics"]
        delta = {k: v - self._metrics.get(k, 0.0) for k, v in metrics.items()}
        self._metrics = metrics
        self.peak_rss_bytes = raw["peak_rss_bytes"]
        outputs = [
            Generation(
                o["token_ids"], o["prompt_tokens"], o["kv_transfer_params"], o["finish_reason"]
            )
            for o in raw["outputs"]
        ]
        return Reply(outputs, raw["elapsed_s"], delta, raw["peak_rss_bytes"])

    def reset_prefix_cache(self, timeout_s: float = CALL_TIMEOUT_S) -> bool:
        """Drop the engine's own prefix cache (connectors keep theirs); False while blocks
        are still in use (e.g. held for a remote decode)."""
        return bool(self.call("reset_prefix_cache", timeout_s)["reset"])

    def call(self, op: str, timeout_s: float = CALL_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """Send one op (see `vllm_worker`) and return its raw reply."""
        self.send({"op": op, **fields})
        return self.receive(timeout_s, op)

    def send(self, message: Mapping[str, Any]) -> None:
        """Write one line: an op, or a line an op in progress reads (`vllm_stream`); then
        `receive` its reply."""
        assert self._popen.stdin is not None
        try:
            self._popen.stdin.write(json.dumps(message) + "\n")
            self._popen.stdin.flush()
        except BrokenPipeError as exc:
            raise self._failure("closed its stdin") from exc

    def request_quit(self) -> None:
        """Ask the worker to quit without waiting (so that several shut down at once)."""
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert self._popen.stdin is not None
            self._popen.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self._popen.stdin.close()

    def kill(self) -> int:
        """SIGKILL the engine's whole process group at once (a crashed pod) and reap it;
        its resource tracker goes last, so the shared memory vLLM registered with it is
        unlinked as it would be with the pod (a machine's /dev/shm outlives a process)."""
        if self._stopped is not None:
            return self._stopped
        self._note_segments()
        process_groups.kill_group(self.pid)
        return self._stop(self._popen.wait())

    def close(self) -> int:
        """Ask the worker to quit and let its group finish cleaning up; SIGTERM the group
        if the worker will not quit, then SIGKILL whatever of it is left (the resource
        tracker last), and sweep what it left in /dev/shm. Once stopped (closed or
        killed), it returns the exit code and touches nothing: its pid, reaped, may be
        another process's by then."""
        if self._stopped is not None:
            return self._stopped
        self._note_segments()
        self.request_quit()
        try:
            code: int | None = self._popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGTERM)
            code = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._popen.wait(STOP_TIMEOUT_S)
        # vLLM's engine core and worker live in this process group (start_new_session); after
        # a clean quit they and the resource tracker may still be unlinking their memory.
        if code is None or not process_groups.wait_group_gone(self.pid, GROUP_DRAIN_S):
            process_groups.kill_group(self.pid)
        return self._stop(self._popen.wait())

    def _stop(self, code: int) -> int:
        """With the group gone: close the pipes (once the reader saw their end: closing
        under its read would raise in its thread), sweep /dev/shm and remove the engine's
        socket directory."""
        self._reader.join(STOP_TIMEOUT_S)
        for pipe in (self._popen.stdin, self._popen.stdout):
            with contextlib.suppress(OSError):  # stdin: a flush into a dead reader
                if pipe is not None:
                    pipe.close()
        self._sweep()
        self._remove_rpc_dir()
        self._stopped = code
        return code

    def _remove_rpc_dir(self) -> None:
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def start_workers(
    named_specs: Mapping[str, EngineSpec], python: Path, workdir: Path
) -> dict[str, VllmWorker]:
    """Start several engines at once (they load in parallel) and wait until all are ready;
    on any failure stop every one of them."""
    workers: dict[str, VllmWorker] = {}
    try:
        for name, spec in named_specs.items():
            workers[name] = VllmWorker(name, spec, python, workdir)
        for worker in workers.values():
            worker.wait_ready()
    except BaseException:
        close_all(workers.values())
        raise
    return workers


def close_all(workers: Iterable[VllmWorker]) -> None:
    """Stop several workers at once: vLLM takes 5-10 s to shut down, each in parallel."""
    workers = list(workers)
    for worker in workers:
        worker.request_quit()
    for worker in workers:
        worker.close()


def reference_run(
    spec: EngineSpec,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    python: Path,
    workdir: Path,
) -> Reply:
    """One engine, no connector: the greedy tokens a P/D run must reproduce."""
    with VllmWorker("reference", spec, python, workdir) as worker:
        worker.wait_ready()
        return worker.generate(prompts, max_tokens)


def reference_runs(
    specs: Mapping[str, EngineSpec],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    python: Path,
    workdir: Path,
    parallel: int = 2,
) -> dict[str, Reply]:
    """`reference_run` for several engines (e.g. one per model), `parallel` loading at
    once: loading is mostly single-threaded Python, so two overlap well on two cores."""
    names = list(specs)
    replies: dict[str, Reply] = {}
    for start in range(0, len(names), parallel):
        batch = {name: specs[name] for name in names[start : start + parallel]}
        workers = start_workers(batch, python, workdir)
        try:
            for name, worker in workers.items():
                replies[name] = worker.generate(prompts, max_tokens)
        finally:
            close_all(workers.values())
    return replies


@dataclass(frozen=True)
class PdResult:
    """One request routed prefill -> decode."""

    prompt_tokens: int
    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    prefill_s: float
    decode_s: float
    # Decode side metric deltas for this request (NixlConnector: bytes, transfer time; TTFT).
    decode_metrics: dict[str, float]

    @property
    def bytes_transferred(self) -> float:
        return self.decode_metrics.get(f"{NIXL_BYTES}_sum", 0.0)

    @property
    def transfer_time_s(self) -> float:
        return self.decode_metrics.get(f"{NIXL_XFER_TIME}_sum", 0.0)

    @property
    def decode_ttft_s(self) -> float:
        return self.decode_metrics.get(f"{TTFT}_sum", 0.0)


def pd_specs(
    model: Path,
    prefill_kv_config: Mapping[str, Any],
    decode_kv_config: Mapping[str, Any],
    max_model_len: int = 2048,
    block_size: int | None = None,
) -> tuple[EngineSpec, EngineSpec]:
    """Prefill on core 0, decode on core 1, otherwise alike (`dataclasses.replace` to vary)."""
    return (
        EngineSpec(model, max_model_len, block_size, prefill_kv_config, cpu=0),
        EngineSpec(model, max_model_len, block_size, decode_kv_config, cpu=1),
    )


class PdPair:
    """A prefill and a decode vLLM (see `pd_specs`), driven as a P/D router."""

    def __init__(
        self, prefill: EngineSpec, decode: EngineSpec, python: Path, workdir: Path
    ) -> None:
        started = time.perf_counter()
        workers = start_workers({"prefill": prefill, "decode": decode}, python, workdir)
        self.prefill, self.decode = workers["prefill"], workers["decode"]
        self._decode_tp = decode.tp_size if (prefill.tp_size, decode.tp_size) != (1, 1) else None
        try:
            self._warm_up()
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - started

    def _warm_up(self, attempts: int = 3) -> None:
        """One short request first: the decode's first request also does the connector's
        handshake with the prefill (vLLM's NixlConnector gives its side channel 5 s, which a
        loaded 2-core machine can miss; the next request tries again)."""
        prompt = random_prompts(1, 64, 64, 1000, seed=0)[0]
        for attempt in range(1, attempts + 1):
            try:
                self.route(prompt, 1)
                return
            except VllmWorkerError:
                if attempt == attempts:
                    raise

    def prefill_for_decode(self, prompt: Sequence[int]) -> tuple[dict[str, Any], Reply]:
        """The router's first step: prefill one token, KV kept for a remote decode. Returns
        the kv_transfer_params to hand to the decode, and the prefill's reply."""
        route: dict[str, Any] = {"do_remote_decode": True}
        if self._decode_tp is not None:  # a prefill rank publishes once per decode reader
            route["decode_tp_size"] = self._decode_tp
        first = self.prefill.generate([prompt], 1, [route])
        params = first.outputs[0].kv_transfer_params
        if params is None:
            raise VllmWorkerError(
                "prefill returned no kv_transfer_params: its connector did not publish the request"
            )
        return params, first

    def route(self, prompt: Sequence[int], max_tokens: int) -> PdResult:
        """Prefill (one token, KV kept for a remote decode), then decode from its KV."""
        params, first = self.prefill_for_decode(prompt)
        second = self.decode.generate([prompt], max_tokens, [params])
        out = second.outputs[0]
        if out.finish_reason != "length":
            raise self.decode._failure(
                f"ended a request early (finish_reason {out.finish_reason!r}, "
                f"{len(out.token_ids)} of {max_tokens} tokens)"
            )
        return PdResult(
            out.prompt_tokens, out.token_ids, params, first.elapsed_s, second.elapsed_s,
            second.metrics_delta,
        )  # fmt: skip

    def peak_rss_bytes(self) -> int:
        """Prefill + decode high-water RSS as of their last replies."""
        return self.prefill.peak_rss_bytes + self.decode.peak_rss_bytes

    def close(self) -> None:
        close_all((self.decode, self.prefill))

    def __enter__(self) -> PdPair:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first token that differs (or where one sequence ends), None if equal."""
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return index
    return None if len(got) == len(want) else min(len(got), len(want))


def measure_pd(
    pair: PdPair,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    reference: Reply,
) -> list[dict[str, Any]]:
    """Route every prompt through `pair` and compare with `reference`: one row per request
    with what the P/D side-by-side reports (bytes moved, transfer time and decode TTFT as
    vLLM's NixlConnector metrics give them; zero where a connector reports none)."""
    rows = []
    for prompt, expected in zip(prompts, reference.outputs, strict=True):
        result = pair.route(prompt, max_tokens)
        divergence = first_divergence(result.token_ids, expected.token_ids)
        rows.append(
            {
                "prompt_tokens": result.prompt_tokens,
                "match": divergence is None,
                "first_divergence": divergence,
                "bytes_moved": int(result.bytes_transferred),
                "transfer_time_s": result.transfer_time_s,
                "decode_ttft_s": result.decode_ttft_s,
                "prefill_s": result.prefill_s,
                "decode_s": result.decode_s,
            }
        )
    return rows


def measure_dead_prefill(
    pair: PdPair,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    reference: Reply,
    timeout_s: float = 120.0,
) -> list[dict[str, Any]]:
    """The failure case of the side by side: prefill every prompt, SIGKILL the prefill
    engine (its KV is gone before the decode reads it), then decode each prompt from the
    params the prefill returned. One row per request: "match" when the decode recovered
    (recomputed) with the reference's tokens, else what happened. After a request that
    does not answer within `timeout_s` the decode engine is stuck: the rest are not sent.
    Leaves the pair's prefill dead; run it last."""
    params = [pair.prefill_for_decode(p)[0] for p in prompts]
    pair.prefill.kill()
    rows: list[dict[str, Any]] = []
    stuck = False
    for prompt, param, expected in zip(prompts, params, reference.outputs, strict=True):
        row: dict[str, Any] = {"prompt_tokens": len(prompt)}
        started = time.perf_counter()
        if stuck:
            row["outcome"] = "not sent (decode engine stuck)"
        else:
            try:
                out = pair.decode.generate([prompt], max_tokens, [param], timeout_s).outputs[0]
            except VllmWorkerError as exc:
                stuck = "did not answer" in str(exc)
                row["outcome"] = "error: " + str(exc).splitlines()[0][:200]
            else:
                divergence = first_divergence(out.token_ids, expected.token_ids)
                row["outcome"] = "match" if divergence is None else f"diverged at {divergence}"
        row["decode_s"] = round(time.perf_counter() - started, 3)
        rows.append(row)
    return rows
