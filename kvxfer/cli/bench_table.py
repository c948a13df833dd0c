"""`kvxfer-cli bench`'s report as text: the cases, handshakes and concurrency levels
(tables through `render.table`: boxed on a terminal, plain columns otherwise)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvxfer.cli.render import Column, table


def rounds_text(case: dict[str, Any]) -> str:
    r = case["kvxfer_vs_raw_rounds"]
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def cpu_text(case: dict[str, Any]) -> str:
    """Where a pull's CPU went, from its Pull call to its PullDone (p50 of each)."""
    cpu = case["cpu_ms_per_pull_p50"]
    return (
        f"{case['model']} {case['tokens']}: CPU per pull, p50: decode sidecar "
        f"{cpu['decode_sidecar']:.2f} ms (its NIXL threads, which copy, "
        f"{cpu['decode_nixl_threads']:.2f}), prefill sidecar {cpu['prefill_sidecar']:.2f} ms, "
        f"engine loop {cpu['engine_loop']:.2f} ms; the pull took {case['kvxfer_ms_p50']:.2f} ms"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}ms"


def _right(*names: str) -> list[Column]:
    return [Column(name, "right") for name in names]


_CASE_COLUMNS = [
    Column("model"),
    *_right("tokens", "MiB", "memcpy", "raw", "per-blk", "kvxfer", "kvx/raw"),
    *_right("per round (min-max)", "overhead", "p99", "hops", "vs full attn"),
]

_PAIRING_COLUMNS = [
    Column("model"),
    *_right("tokens", "TP p->d", "blocks", "mode", "xfers", "descs", "MiB", "vs min", "raw GB/s"),
    *_right("kvxfer"),
    *_right("kvx/raw", "per round (min-max)", "raw p50/p99 ms", "kvxfer p50/p99 ms"),
]

_LEVEL_COLUMNS = [
    Column("model"),
    *_right("tokens", "pulls", "raw GB/s", "kvxfer", "kvx/raw", "raw2", "kvx/raw2"),
    *_right("raw p50/p99 ms"),
    *_right("kvxfer p50/p99 ms", "errors", "CPU p/d", "RSS p/d MiB"),
]


def report_text(report: dict[str, Any]) -> str:
    rows = []
    for c in report["cases"]:
        saved = 1 - c["bytes"] / c["full_attention_bytes"] if c["full_attention_bytes"] else 0
        rows.append([
            c["model"], str(c["tokens"]), f"{c['bytes'] / 2**20:.1f}",
            f"{c['memcpy_gbps']:.2f}", f"{c['raw_nixl_gbps']:.2f}", f"{c['per_block_gbps']:.2f}",
            f"{c['kvxfer_gbps']:.2f}", f"{c['kvxfer_vs_raw']:.3f}", rounds_text(c),
            f"{c['overhead_ms_p50']:+.2f}ms", f"{c['overhead_ms_p99']:+.2f}ms",
            _ms(c.get("hops_ms_p50")), f"{saved:.1%}",
        ])  # fmt: skip
    lines = [
        f"host memcpy {report['memcpy_gbps']:.2f} GB/s (one core, 256 MiB)",
        "",
        table(_CASE_COLUMNS, rows),
        "(GB/s of planned bytes over wall time; kvx/raw of the medians, and per round: "
        "median (min-max); overhead = kvxfer p50 - raw p50, p99 = kvxfer p99 - raw p99 "
        "over the rounds; hops = p50 of an engine call plus a NIXL-thread round trip, no "
        "work behind either)",
    ]
    lines += [cpu_text(c) for c in report["cases"] if c.get("cpu_ms_per_pull_p50")]
    for h in report["handshakes"]:
        lines.append(
            f"{h['model']}: handshake {h['handshake_ms']} ms; first pull {h['first_pull_ms']} ms, "
            f"next {h['next_pull_ms']} ms (one block)"
        )
    if report.get("pairings"):
        lines += ["", *pairings_table(report["pairings"])]
    if report.get("concurrency"):
        lines += ["", *levels_table(report["concurrency"])]
    for s in report["skipped"]:
        what = s.get("pairing") or (
            f"{s['tokens']} x {s['concurrency']}" if "concurrency" in s else s["tokens"]
        )
        lines.append(f"skipped {s['model']} {what}: {s['reason']}")
    if "multihost" in report:
        lines.append(f"between hosts: {report['multihost']['transport']}")
    return "\n".join(lines)


def levels_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The concurrency rows as text lines."""
    cells = []
    for r in rows:
        ratio = f"{r['kvxfer_vs_raw']:.3f}" if r["kvxfer_vs_raw"] is not None else "-"
        raw2, ratio2 = r.get("raw_nixl_2agents_gbps"), r.get("kvxfer_vs_raw_2agents")
        cells.append([
            r["model"], str(r["tokens"]), str(r["concurrency"]), f"{r['raw_nixl_gbps']:.2f}",
            f"{r['kvxfer_gbps']:.2f}", ratio, "-" if raw2 is None else f"{raw2:.2f}",
            "-" if ratio2 is None else f"{ratio2:.3f}", _pair(r["raw_ms_p50"], r["raw_ms_p99"]),
            _pair(r["kvxfer_ms_p50"], r["kvxfer_ms_p99"]), str(r["errors"]),
            _pair(r.get("prefill_sidecar_cpu_cores"), r.get("decode_sidecar_cpu_cores")),
            _pair(r.get("prefill_sidecar_rss_mib"), r.get("decode_sidecar_rss_mib")),
        ])  # fmt: skip
    return [
        *table(_LEVEL_COLUMNS, cells).splitlines(),
        "(pulls at once; GB/s of all pulls over the burst's wall time; raw2: raw NIXL on two "
        "agents, each its own thread; latency from the burst's start; CPU in cores and RSS "
        "without shared memory, prefill/decode sidecar)",
    ]


def pairings_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The TP pairing rows as text lines."""
    cells = []
    for r in rows:
        cells.append([
            r["model"], str(r["tokens"]), f"{r['prefill_tp']}->{r['decode_tp']}",
            _orders(r.get("orders", "")), r["mode"],
            str(r["pulls"]), str(r["descriptors"]), f"{r['bytes'] / 2**20:.1f}",
            f"{r['bytes_vs_min']:.3f}", f"{r['raw_nixl_gbps']:.2f}", f"{r['kvxfer_gbps']:.2f}",
            f"{r['kvxfer_vs_raw']:.3f}", rounds_text(r), _pair(r["raw_ms_p50"], r["raw_ms_p99"]),
            _pair(r["kvxfer_ms_p50"], r["kvxfer_ms_p99"]),
        ])  # fmt: skip
    return [
        *table(_PAIRING_COLUMNS, cells).splitlines(),
        "(one request: every (prefill rank, decode rank) transfer at once, until the last "
        "PullDone (push: Received); raw posts the same descriptors as READ (push: WRITE); "
        "vs min = bytes moved / the decode ranks' exact need)",
    ]


def _orders(orders: str) -> str:
    """Block orders of a pairing row, short: t (token-major), h (head-major), hnd."""
    short = {"token-major": "t", "head-major": "h", "hnd": "hnd"}
    return "->".join(short.get(o, o) for o in orders.split("->")) if orders else "t->t"


def _pair(a: float | None, b: float | None) -> str:
    def one(x: float | None) -> str:
        return "-" if x is None else f"{x:g}"

    return f"{one(a)}/{one(b)}"
