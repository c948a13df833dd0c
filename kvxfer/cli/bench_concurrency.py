"""`kvxfer-cli bench --concurrency 1,8,64`: many pulls at once, kvxfer against raw NIXL.

A burst issues `level` pulls of the same request size at once and waits for
all of them, three times per round: kvxfer (`level` Pull calls on the decode
engine's socket, each to its PullDone), raw NIXL (`level` READ handles
created and posted by the bench's own agent, then polled until all are
done), and raw NIXL on two agents (half the handles each, each agent on its
own thread: on one host a read copies on the thread that posts it, and the
decode sidecar reads through up to two agents per peer by default, so this
is the like-for-like baseline beside the one-agent one; not run for one
pull). Every pull reads the same source blocks into the same destination
blocks, so memory does not grow with the level. Reported per (size, level):
aggregate GB/s (bytes of all pulls over the burst's wall time, pooled over the
rounds), latency p50/p99 from the start of the burst to each pull's end, the
CPU the two sidecars used during the kvxfer bursts (cores: CPU seconds per
wall second, their NIXL agent processes included) and their resident memory
without the engines' shared memory afterwards. Pulls kvxfer refused or failed
are counted, never raised: a burst is accepted when `errors` is 0.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvxfer._exceptions import KvxferError
from kvxfer.cli.bench_raw import raw_posts
from kvxfer.cli.fleet import rss_excluding_shm_bytes
from kvxfer.dataplane.descriptors import DescArray

DEFAULT_LEVELS = (1, 8, 64, 256, 1024)
DEFAULT_MAX_GIB = 32.0  # bytes one burst may move; larger (size, level) cases are skipped


@dataclass
class Burst:
    """One burst: wall seconds, each finished pull's seconds, and what went wrong."""

    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ranked = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ranked)))
    return ranked[rank - 1]


def summarize_bursts(
    level: int,
    nbytes: int,
    raw: Sequence[Burst],
    kvx: Sequence[Burst],
    raw2: Sequence[Burst] = (),
) -> dict[str, Any]:
    """Aggregate GB/s pooled over the rounds (done pulls' bytes over total wall time),
    latency percentiles over every pull of every round, and the errors; `raw2`, raw
    NIXL on two agents, where it ran."""

    def gbps(bursts: Sequence[Burst]) -> float:
        wall = sum(b.wall_s for b in bursts)
        done = sum(len(b.latencies_s) for b in bursts)
        return done * nbytes / wall / 1e9 if wall else 0.0

    def ms(bursts: Sequence[Burst], q: float) -> float | None:
        values = [x for b in bursts for x in b.latencies_s]
        return round(percentile(values, q) * 1e3, 3) if values else None

    raw_gbps, kvx_gbps, raw2_gbps = gbps(raw), gbps(kvx), gbps(raw2)
    errors = [e for b in kvx for e in b.errors]
    two_agents = {
        "raw_nixl_2agents_gbps": round(raw2_gbps, 3) if raw2 else None,
        "kvxfer_vs_raw_2agents": round(kvx_gbps / raw2_gbps, 3) if raw2_gbps else None,
    }
    return {
        "concurrency": level,
        "bytes_per_pull": nbytes,
        "rounds": len(kvx),
        "raw_nixl_gbps": round(raw_gbps, 3),
        "kvxfer_gbps": round(kvx_gbps, 3),
        "kvxfer_vs_raw": round(kvx_gbps / raw_gbps, 3) if raw_gbps else None,
        **two_agents,
        "raw_ms_p50": ms(raw, 50),
        "raw_ms_p99": ms(raw, 99),
        "kvxfer_ms_p50": ms(kvx, 50),
        "kvxfer_ms_p99": ms(kvx, 99),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
    }


def raw_burst(agent: Any, peer: str, local: DescArray, remote: DescArray, level: int) -> Burst:
    """On the bench agent's thread: `level` READ handles created and posted one after
    the other, then polled until every one is done; each one's time is from the start."""
    start = time.perf_counter()
    latencies = raw_posts(agent, [(peer, local, remote)] * level)
    return Burst(time.perf_counter() - start, latencies)


PullOnce = Callable[[], Awaitable[None]]


async def timed_burst(pulls: Sequence[PullOnce]) -> Burst:
    """Start every pull at once; each one's time is from the start of the burst."""
    burst = Burst()
    start = time.perf_counter()

    async def one(pull: PullOnce) -> None:
        try:
            await pull()
        except KvxferError as exc:
            burst.errors.append(str(exc)[:200])
            return
        burst.latencies_s.append(time.perf_counter() - start)

    await asyncio.gather(*(one(p) for p in pulls))
    burst.wall_s = time.perf_counter() - start
    return burst


class BurstCase(Protocol):
    """One model's engines, as the bench's `_Case` offers them to a burst."""

    def pull_bytes(self, tokens: int) -> int: ...

    async def kvxfer_burst(self, tokens: int, level: int) -> list[PullOnce]:
        """`level` requests published (not timed), each with its timed pull."""
        ...

    async def raw_burst(self, tokens: int, level: int, agents: int = 1) -> Burst:
        """`level` raw reads at once, split over `agents` agents (1 or 2)."""
        ...


async def measure_levels(
    case: BurstCase,
    tokens: int,
    levels: Sequence[int],
    rounds: int,
    max_bytes: int,
    pids: dict[str, int],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per level (and the levels skipped for moving more than `max_bytes` in
    one burst). Raw and kvxfer alternate who goes first, round by round; `pids` names
    the sidecars whose CPU and memory are reported."""
    nbytes = case.pull_bytes(tokens)
    rows, skipped = [], []
    for level in levels:
        if level * nbytes > max_bytes:
            skipped.append(
                {
                    "tokens": tokens,
                    "concurrency": level,
                    "reason": f"{level} pulls of {nbytes / 2**20:.1f} MiB exceed "
                    f"--concurrency-max-gib ({max_bytes / 2**30:g} GiB) per burst",
                }
            )
            continue
        raw: list[Burst] = []
        raw2: list[Burst] = []
        kvx: list[Burst] = []
        cpu_s = dict.fromkeys(pids, 0.0)
        order = ("raw", "raw2", "kvxfer") if level > 1 else ("raw", "kvxfer")
        for i in range(rounds):
            for name in order if i % 2 == 0 else order[::-1]:
                if name == "raw":
                    raw.append(await case.raw_burst(tokens, level))
                    continue
                if name == "raw2":
                    raw2.append(await case.raw_burst(tokens, level, agents=2))
                    continue
                pulls = await case.kvxfer_burst(tokens, level)
                before = {role: tree_cpu_s(pid) for role, pid in pids.items()}
                kvx.append(await timed_burst(pulls))
                for role, pid in pids.items():
                    cpu_s[role] += tree_cpu_s(pid) - before[role]
        row = {"tokens": tokens, **summarize_bursts(level, nbytes, raw, kvx, raw2)}
        wall_s = sum(b.wall_s for b in kvx)
        for role, pid in pids.items():
            row[f"{role}_sidecar_cpu_cores"] = round(cpu_s[role] / wall_s, 2) if wall_s else None
            row[f"{role}_sidecar_rss_mib"] = tree_rss_mib(pid)
        rows.append(row)
    return rows, skipped


# -- sidecar usage from /proc ------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) "


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live children (the NIXL agent child)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for candidate in tree(pid):
        try:
            fields = _stat_fields(candidate)
        except OSError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / ticks


def tree(pid: int) -> list[int]:
    """`pid` and its live children (a sidecar and its NIXL agent child)."""
    return [pid, *_children(pid)]


def threads_cpu_ns(pids: Sequence[int], prefix: str) -> tuple[int, int]:
    """CPU nanoseconds the scheduler ran every thread of `pids`, and those of them whose
    name starts with `prefix` (/proc/<pid>/task/<tid>/schedstat: exact, where the
    clock ticks of /proc/<pid>/stat are 10 ms apart, longer than a small pull). A thread
    that has ended is counted no more: for long-lived threads, such as a sidecar's."""
    total = named = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # ended meanwhile
            continue
        for tid in tids:
            task = f"/proc/{pid}/task/{tid}"
            try:
                ran = int(Path(f"{task}/schedstat").read_text().split()[0])
                name = Path(f"{task}/comm").read_text()
            except (OSError, ValueError, IndexError):
                continue
            total += ran
            named += ran if name.startswith(prefix) else 0
    return total, named


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat_fields(int(entry.name))[1]) == pid:  # ppid
                children.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def tree_rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its live children, the engines' shared memory excluded."""
    total = 0
    for candidate in tree(pid):
        try:
            total += rss_excluding_shm_bytes(candidate)
        except OSError:
            continue
    return round(total / 2**20, 1)
