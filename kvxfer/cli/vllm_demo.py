"""`kvxfer-cli demo --engine vllm`: parse, run the real-vLLM demo, print.

The orchestration is `kvxfer.integrations.vllm_demo`; sidecars come from
`kvxfer.cli.fleet`. Exits 0 only when every request decoded the reference's
tokens, the negative control diverged and, without injected failures, exactly
the minimum bytes moved.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvxfer.cli.fleet import local_fleet, stops_raise
from kvxfer.cli.main import EXIT_FAILED, EXIT_OK
from kvxfer.integrations.vllm_demo import DemoOptions, run_vllm_demo


def run_vllm(args: argparse.Namespace) -> int:
    low_high = (args.tokens, args.tokens) if args.tokens else (args.tokens_range or (150, 700))
    options = DemoOptions(
        model=args.model or "llama",
        requests=args.requests or 4,
        tokens_range=low_high,
        max_tokens=args.max_tokens,
        fail_rate=args.fail_rate,
        seed=args.seed,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_block_size=args.prefill_block_size,
        decode_block_size=args.decode_block_size,
    )
    with stops_raise(), local_fleet("kvxfer-demo-vllm-", "kvxfer-cli demo") as fleet:
        # Synchronous: Ctrl-C raises KeyboardInterrupt here, and the vLLM workers (in
        # sessions of their own, out of the terminal's reach) are closed as it unwinds.
        report = run_vllm_demo(options, fleet.workdir, fleet)
        ok = passed(report, options)
        fleet.keep_logs = not ok
    print(json.dumps(report) if args.json else summary(report))
    return EXIT_OK if ok else EXIT_FAILED


def passed(report: dict[str, Any], options: DemoOptions) -> bool:
    exact = options.fail_rate > 0 or report["bytes_moved"] == report["bytes_exact_minimum"]
    control = report["negative_control_diverged"] or not report["negative_control_applies"]
    return report["matched"] == report["requests"] and control and exact


def summary(report: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"vLLM P/D through kvxfer, {report['model']}: {report['matched']}/{report['requests']} "
        f"requests decoded the same tokens as the reference ({report['reference']})",
        f"negative control (another request's KV) diverged: {report['negative_control_diverged']}"
        + ("" if report["negative_control_applies"] else " (its pull failed: recomputed)"),
        f"moved {report['bytes_moved'] / mib:.2f} MiB; exact minimum "
        f"{report['bytes_exact_minimum'] / mib:.2f} MiB; a full-attention transfer "
        f"{report['bytes_full_attention'] / mib:.2f} MiB",
        f"failed blocks {report['failed_blocks']}, recomputed tokens {report['recomputed_tokens']}",
    ]
    for row in report["per_request"]:
        lines.append(
            f"  {row['prompt_tokens']:4d} tokens: {'match' if row['match'] else 'DIVERGED'}"
            f", {row['bytes_moved']} B, {row['failed_blocks']} failed blocks,"
            f" {row['transfer_ms']} ms"
            + (f", laid out again in {row['repack_ms']} ms" if "repack_ms" in row else "")
        )
    return "\n".join(lines)
