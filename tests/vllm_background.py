"""The real-vLLM tier's long jobs, started as soon as pytest has collected a test that
reads them (conftest.py), and read by those tests.

Such a job is mostly waiting: vLLM engines starting, handshaking and shutting down on
two cores. Started at collection, one at a time and niced (CPU and I/O), the jobs run
beside the rest of the suite in what it leaves idle instead of after it; once the first
test that reads them runs, a second lane opens (the rest of the suite is done or
waiting) and the jobs left run two at a time.

The jobs: the four `kvxfer-cli demo --engine vllm` runs of tests/test_vllm_kvxfer.py,
the composed MultiConnector pairs of tests/test_vllm_multiconnector.py and the
NixlConnector baseline of tests/test_vllm_nixl_baseline.py. A job returns plain data;
its test asserts on it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_harness import (
    BLOCK_SIZE,
    CONTROL,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    engine_spec,
    vllm_python,
    write_models,
)

from kvxfer.cli.fleet import Fleet, Placement
from kvxfer.integrations import vllm_compose, vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE

CLI = Path(sys.prefix) / "bin" / "kvxfer-cli"
# Niced beside the rest of the suite, whose timing-sensitive e2e tests (frozen peers,
# stall deadlines) keep the CPU they need; nothing else runs once they are waited for.
NICE = 10
DEMO_TIMEOUT_S = 1500.0  # a demo alone takes 1-3 min; beside the suite, niced, longer
# Niced beside the suite, and two jobs at once on two cores once the second lane opens, a
# sidecar can wait seconds for the CPU: in the CI of 4f4e759 the gemma3 demo's prefill
# sidecar "did not run for 6.9 s", its BeginRead passed the 5 s peer deadline, and the
# pull failed (recomputed, tokens identical, but not the oracle's bytes). These jobs check
# bytes and tokens; the deadlines have their own tests (a frozen peer, a stalled agent),
# so the jobs' sidecars get longer ones (5x the RPC default, 2.5x the stall default),
# still under the 30 s lease TTL (settings refuse a stall deadline past it; the
# MultiConnector job waits on the TTL).
PATIENT_ENV = {"KVXFER_TRANSFER__RPC_TIMEOUT_S": "25", "KVXFER_TRANSFER__STALL_DEADLINE_S": "25"}

# ---- tests/test_vllm_kvxfer.py ---------------------------------------------------------
# Each test's demo, longest first so that the two lanes end close together.
DEMOS = {
    "qwen3-next": ("--model", "qwen3-next"),
    "gpt-oss": ("--model", "gpt-oss", "--fail-rate", "0.5", "--seed", "3"),
    "llama": ("--model", "llama", "--prefill-block-size", "96", "--decode-block-size", "64"),
    "gemma3": ("--model", "gemma3", "--prefill-block-size", "32", "--decode-block-size", "64"),
}


def demo(args: tuple[str, ...], running: set[subprocess.Popen[str]]) -> dict[str, Any]:
    argv = ["ionice", "-c", "3", str(CLI), "demo", "--engine", "vllm", "--json",
            "--requests", "3", *args]  # fmt: skip
    env = {**os.environ, **PATIENT_ENV}
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=DEMO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise
        finally:
            running.discard(proc)
    assert stdout.strip(), f"demo printed nothing (rc {proc.returncode}):\n{stderr}"
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    assert "error" not in report, f"demo failed: {report}\n{stderr[-3000:]}"
    report["returncode"] = proc.returncode
    report["stderr"] = stderr[-3000:]
    return report


def stop(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C, as a user would (the demo stops its engines and sidecars), then a kill."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def models(workdir: Path, families: Sequence[str]) -> dict[str, Path]:
    root = workdir / "models"
    root.mkdir()
    return write_models(root, families)


# ---- tests/test_vllm_multiconnector.py -------------------------------------------------
COMPOSED_TOKENS = 8
COMPOSED_PROMPTS = vllm_fleet.random_prompts(2, 200, 500, VOCAB_SIZE, seed=3)
CASES = [("llama", None, "kvxfer-first"), ("gemma3", 32, "offload-first")]


class PatientFleet(Fleet):
    """Sidecars with the PATIENT_ENV deadlines."""

    def placement(self, sidecar_id: str) -> Placement:
        del sidecar_id
        return Placement(prefix=("env", *(f"{k}={v}" for k, v in PATIENT_ENV.items())))


def composed(family: str, block_size: int | None, order: str, workdir: Path) -> Any:
    model = models(workdir, [family])[family]
    fleet = PatientFleet(workdir)
    try:
        return vllm_compose.run_composed_pd(
            model, COMPOSED_PROMPTS, COMPOSED_TOKENS, fleet, workdir / "engines",
            block_size=block_size, order=order, python=vllm_python(),
        )  # fmt: skip
    finally:
        fleet.close()


# ---- tests/test_vllm_nixl_baseline.py --------------------------------------------------
PAIR_FAMILIES = ("llama", "gemma3")
# Started by tests/test_vllm_kvxfer.py's demos, as NixlConnector P/D among others.
ELSEWHERE = ("qwen3-next",)
LONE_FAMILIES = tuple(f for f in FAMILIES if f not in PAIR_FAMILIES + ELSEWHERE)
REFERENCE_PROMPTS = [*PROMPTS, CONTROL[0]]


@dataclass
class Baseline:
    """What one NixlConnector P/D pair did: the prefill engine's own reference for
    REFERENCE_PROMPTS (before any P/D request), each prompt of PROMPTS routed P/D, and
    CONTROL's victim decoded from its donor's KV."""

    reference: vllm_fleet.Reply
    routed: list[vllm_fleet.PdResult]
    swapped: vllm_fleet.Generation


def alone(workdir: Path) -> dict[str, vllm_fleet.Reply]:
    """One engine alone for each family no P/D pair runs, two at a time."""
    written = models(workdir, LONE_FAMILIES)
    specs = {f: engine_spec(written, f, cpu=i % 2) for i, f in enumerate(LONE_FAMILIES)}
    workers = vllm_fleet.start_workers(specs, vllm_python(), workdir)
    try:
        return {f: w.generate(REFERENCE_PROMPTS, MAX_TOKENS) for f, w in workers.items()}
    finally:
        vllm_fleet.close_all(workers.values())


def nixl_pair(family: str, workdir: Path) -> Baseline:
    model = models(workdir, [family])[family]
    config = vllm_fleet.nixl_connector_config()
    specs = vllm_fleet.pd_specs(model, config, config, MAX_MODEL_LEN, BLOCK_SIZE.get(family))
    with vllm_fleet.PdPair(*specs, vllm_python(), workdir / "pd") as pair:
        reference = pair.prefill.generate(REFERENCE_PROMPTS, MAX_TOKENS)
        routed = [pair.route(prompt, MAX_TOKENS) for prompt in PROMPTS]
        victim, donor = CONTROL
        donated = pair.prefill.generate([donor], 1, [{"do_remote_decode": True}])
        params = donated.outputs[0].kv_transfer_params
        swapped = pair.decode.generate([victim], MAX_TOKENS, [params]).outputs[0]
    return Baseline(reference, routed, swapped)


Job = Callable[[Path], Any]
JOBS: dict[str, dict[str, Job]] = {  # per test file, in the order the suite reads them
    "test_vllm_kvxfer.py": {
        name: (lambda _, args=args: demo(args, _RUNNING)) for name, args in DEMOS.items()
    },
    "test_vllm_multiconnector.py": {
        case[2]: (lambda workdir, case=case: composed(*case, workdir)) for case in CASES
    },
    "test_vllm_nixl_baseline.py": {
        "alone": alone,
        **{f: (lambda workdir, f=f: nixl_pair(f, workdir)) for f in PAIR_FAMILIES},
    },
}
_RUNNING: set[subprocess.Popen[str]] = set()  # demos under way, stopped at close


class Background:
    """The jobs of the collected test files, each a future; one lane until `widen()`,
    then two."""

    def __init__(self, files: set[str]) -> None:
        self._lanes = threading.Semaphore(1)
        self._widened = False
        self._root = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-tier-"))
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-job")
        self.futures: dict[str, dict[str, Future[Any]]] = {
            file: {
                name: self._pool.submit(self._in_lane, job, self._root / f"{file}-{name}")
                for name, job in jobs.items()
            }
            for file, jobs in JOBS.items()
            if file in files
        }

    def _in_lane(self, job: Job, workdir: Path) -> Any:
        with self._lanes:
            # Linux nices a thread, and what it starts inherits it: engines, sidecars.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            workdir.mkdir(parents=True)
            return job(workdir)

    def widen(self) -> None:
        """The suite now waits for the jobs: let two run at once."""
        if not self._widened:
            self._widened = True
            self._lanes.release()

    def close(self) -> None:
        """Jobs not started are dropped, and a demo still running (the session ended
        without waiting for it: -x, a Ctrl-C) is stopped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(_RUNNING):
            stop(proc)
        self._pool.shutdown(wait=True)
        shutil.rmtree(self._root, ignore_errors=True)


_STARTED: list[Background] = []  # this session's, once started


def start(files: set[str]) -> None:
    """Start the jobs of `files` (test file names), once per session."""
    if not _STARTED and files & JOBS.keys():
        _STARTED.append(Background(files))


def futures(file: str) -> dict[str, Future[Any]]:
    """The jobs of `file` (started at collection, or now when it was not collected
    then); the suite waits for them from here on."""
    start({file})
    background = _STARTED[0]
    background.widen()
    return background.futures[file]


def close() -> None:
    for background in _STARTED:
        background.close()
