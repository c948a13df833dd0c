"""What a hop costs on this machine when the side it wakes was idle: the floor under
every sidecar hop, measured without kvxfer.

A kvxfer pull crosses processes and threads that sat idle since the last pull
(the engine's Pull wakes the decode sidecar's loop, the loop wakes the NIXL
thread, the thread wakes the loop, PullDone wakes the engine). Raw NIXL in the
bench crosses none of them. This probe times the two kinds of hop bare:

- process: a uvloop unix-socket echo between two processes (8 bytes each way);
- thread: an event loop handing a no-op to a thread that waits on a
  `queue.Queue` with a timeout (as the NIXL thread does) and hearing back
  through `call_soon_threadsafe`;

each after an idle gap (0 = back to back), and prints p50/p99 in microseconds,
with the CPU idle driver, which decides what an idle CPU does (in a VM that
halts, waking it costs an exit to the host).

    .venv/bin/python benchmarks/probe_wakeup.py [--rounds 500] [--gaps-ms 0 2 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop


def _percentiles(samples: list[float]) -> dict[str, float]:
    ranked = sorted(samples)
    return {
        "p50_us": round(ranked[len(ranked) // 2] * 1e6, 1),
        "p99_us": round(ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))] * 1e6, 1),
    }


async def _timed(hop: Callable[[], Awaitable[None]], rounds: int, gap_s: float) -> list[float]:
    await hop()  # warm
    samples = []
    for _ in range(rounds):
        if gap_s:
            await asyncio.sleep(gap_s)
        start = time.perf_counter()
        await hop()
        samples.append(time.perf_counter() - start)
    return samples


def _echo_child(sock: socket.socket) -> None:
    async def serve() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        while data := await reader.read(64):
            writer.write(data)

    uvloop.run(serve())
    os._exit(0)


def _process_hops(rounds: int, gaps: list[float]) -> dict[str, dict[str, float]]:
    mine, theirs = socket.socketpair()
    pid = os.fork()  # before any event loop runs in this process
    if pid == 0:
        mine.close()
        _echo_child(theirs)
    theirs.close()

    async def measure() -> dict[str, dict[str, float]]:
        reader, writer = await asyncio.open_unix_connection(sock=mine)

        async def echo() -> None:
            writer.write(b"12345678")
            await reader.readexactly(8)

        try:
            return {f"{g * 1e3:g}ms": _percentiles(await _timed(echo, rounds, g)) for g in gaps}
        finally:
            writer.close()

    try:
        return uvloop.run(measure())
    finally:
        os.waitpid(pid, 0)


async def _thread_hops(rounds: int, gaps: list[float]) -> dict[str, dict[str, float]]:
    loop = asyncio.get_running_loop()
    commands: queue.Queue[asyncio.Future[None] | None] = queue.Queue()

    def worker() -> None:
        while True:
            try:
                future = commands.get(timeout=0.005)  # the NIXL thread's idle wait
            except queue.Empty:
                continue
            if future is None:
                return
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    async def hand_off() -> None:
        future: asyncio.Future[None] = loop.create_future()
        commands.put(future)
        await future

    try:
        return {f"{g * 1e3:g}ms": _percentiles(await _timed(hand_off, rounds, g)) for g in gaps}
    finally:
        commands.put(None)
        thread.join()


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0.0, 2.0, 20.0])
    args = parser.parse_args()
    if args.rounds < 1 or any(g < 0 for g in args.gaps_ms):
        parser.error("--rounds must be at least 1 and --gaps-ms not negative")
    gaps = [g / 1e3 for g in args.gaps_ms]
    report = {
        "cpus": os.cpu_count(),
        "cpuidle_driver": _read("/sys/devices/system/cpu/cpuidle/current_driver"),
        "guest_halt_poll_ns": _read("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
        "rounds": args.rounds,
        "process": _process_hops(args.rounds, gaps),
        "thread": uvloop.run(_thread_hops(args.rounds, gaps)),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
