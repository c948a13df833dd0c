"""`kvxfer-cli bench`'s report as text: the cases, handshakes and concurrency levels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def rounds_text(case: dict[str, Any]) -> str:
    r = case["kvxfer_vs_raw_rounds"]
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def table(report: dict[str, Any]) -> str:
    lines = [
        f"host memcpy {report['memcpy_gbps']:.2f} GB/s (one core, 256 MiB)",
        "",
        f"{'model':<20} {'tokens':>7} {'MiB':>8} {'memcpy':>7} {'raw':>6} {'per-blk':>7} "
        f"{'kvxfer':>7} {'kvx/raw':>7} {'per round (min-max)':>19} {'overhead':>9} "
        f"{'vs full attn':>12}",
    ]
    for c in report["cases"]:
        saved = 1 - c["bytes"] / c["full_attention_bytes"] if c["full_attention_bytes"] else 0
        lines.append(
            f"{c['model']:<20} {c['tokens']:>7} {c['bytes'] / 2**20:>8.1f} "
            f"{c['memcpy_gbps']:>7.2f} {c['raw_nixl_gbps']:>6.2f} {c['per_block_gbps']:>7.2f} "
            f"{c['kvxfer_gbps']:>7.2f} {c['kvxfer_vs_raw']:>7.3f} {rounds_text(c):>19} "
            f"{c['overhead_ms_p50']:>+7.2f}ms {saved:>11.1%}"
        )
    lines.append(
        "(GB/s of planned bytes over wall time; kvx/raw of the medians, and per round: "
        "median (min-max); overhead = kvxfer p50 - raw p50)"
    )
    for h in report["handshakes"]:
        lines.append(
            f"{h['model']}: handshake {h['handshake_ms']} ms; first pull {h['first_pull_ms']} ms, "
            f"next {h['next_pull_ms']} ms (one block)"
        )
    if report.get("concurrency"):
        lines += ["", *levels_table(report["concurrency"])]
    for s in report["skipped"]:
        size = f"{s['tokens']} x {s['concurrency']}" if "concurrency" in s else s["tokens"]
        lines.append(f"skipped {s['model']} {size}: {s['reason']}")
    return "\n".join(lines)


def levels_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The concurrency rows as text lines."""
    lines = [
        f"{'model':<20} {'tokens':>6} {'pulls':>5} {'raw GB/s':>8} {'kvxfer':>7} "
        f"{'kvx/raw':>7} {'raw p50/p99 ms':>17} {'kvxfer p50/p99 ms':>19} {'errors':>6} "
        f"{'CPU p/d':>9} {'RSS p/d MiB':>13}"
    ]
    for r in rows:
        ratio = f"{r['kvxfer_vs_raw']:.3f}" if r["kvxfer_vs_raw"] is not None else "-"
        lines.append(
            f"{r['model']:<20} {r['tokens']:>6} {r['concurrency']:>5} {r['raw_nixl_gbps']:>8.2f} "
            f"{r['kvxfer_gbps']:>7.2f} {ratio:>7} "
            f"{_pair(r['raw_ms_p50'], r['raw_ms_p99']):>17} "
            f"{_pair(r['kvxfer_ms_p50'], r['kvxfer_ms_p99']):>19} {r['errors']:>6} "
            f"{_pair(r.get('prefill_sidecar_cpu_cores'), r.get('decode_sidecar_cpu_cores')):>9} "
            f"{_pair(r.get('prefill_sidecar_rss_mib'), r.get('decode_sidecar_rss_mib')):>13}"
        )
    lines.append(
        "(pulls at once; GB/s of all pulls over the burst's wall time; latency from the "
        "burst's start; CPU in cores and RSS without shared memory, prefill/decode sidecar)"
    )
    return lines


def _pair(a: float | None, b: float | None) -> str:
    def one(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"

    return f"{one(a)}/{one(b)}"
