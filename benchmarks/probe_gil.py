"""What a busy event loop costs a NIXL thread's copies, per GIL switch interval.

A NIXL read on one host copies inside `transfer()`, with the GIL released, but
each call into NIXL (creating the handle, posting it, checking and releasing
it) needs the GIL back. While another thread keeps running Python, a thread
waiting for the GIL gets it only when the switch interval runs out (Python's
default: 5 ms). This probe reads one buffer from another process over and over
on a thread, first alone, then while the main thread runs Python without
pause (as a sidecar's loop does in a burst of pulls), for each interval given.

    .venv/bin/python benchmarks/probe_gil.py [--mib 28] [--intervals 0.005 0.0001] [--json]

Nothing of kvxfer's runs here but `_nixl()`, which finds the installed NIXL
package: the numbers are NIXL's and CPython's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.dataplane.adapter import _nixl


def _agent(name: str) -> Any:
    nixl_agent, nixl_agent_config = _nixl()
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _serve(conn: Connection, nbytes: int) -> None:
    """The other process: registers a buffer, says where it is, progresses until told."""
    agent = _agent("probe-serve")
    src = np.ones(nbytes, dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), src.ctypes.data))
    while not conn.poll(0.001):
        agent.get_new_notifs()


class _Reader:
    def __init__(self, nbytes: int, metadata: bytes, address: int) -> None:
        self.agent = _agent("probe-read")
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        self.agent.register_memory([(self.dst.ctypes.data, nbytes, 0, "")], "DRAM")
        self.peer = self.agent.add_remote_agent(metadata)
        self.local = np.array([[self.dst.ctypes.data, nbytes, 0]], dtype=np.uint64)
        self.remote = np.array([[address, nbytes, 0]], dtype=np.uint64)

    def read(self) -> float:
        agent, start = self.agent, time.perf_counter()
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(self.local, "DRAM"),
            agent.get_xfer_descs(self.remote, "DRAM"),
            self.peer,
        )
        agent.transfer(handle)
        while (state := agent.check_xfer_state(handle)) == "PROC":
            pass
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"read ended {state}")
        return time.perf_counter() - start


def _spin(seconds: float) -> int:
    """Python without pause, as a busy loop runs: how many turns it made."""
    turns, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        turns += 1
    return turns


def _beside_busy_loop(reader: _Reader, seconds: float) -> tuple[list[float], float]:
    """Reads on a thread while this one spins: their times, and the spin's turns per s."""
    times: list[float] = []
    stop = threading.Event()

    def reads() -> None:
        while not stop.is_set():
            times.append(reader.read())

    thread = threading.Thread(target=reads)
    thread.start()
    time.sleep(0.01)
    turns = _spin(seconds)
    stop.set()
    thread.join()
    return times, turns / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=28, help="bytes per read, MiB")
    parser.add_argument("--seconds", type=float, default=0.5, help="busy time per interval")
    parser.add_argument(
        "--intervals", type=float, nargs="+", default=[0.005, 0.001, 0.0005, 0.0001]
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(there, nbytes))
    server.start()
    try:
        reader = _Reader(nbytes, *here.recv())
        rows = []
        for interval in args.intervals:
            sys.setswitchinterval(interval)
            for _ in range(5):
                reader.read()
            alone = [reader.read() for _ in range(20)]
            spin_alone = _spin(args.seconds) / args.seconds
            beside, spin_beside = _beside_busy_loop(reader, args.seconds)
            rows.append(
                {
                    "switch_interval_s": interval,
                    "read_alone_ms_p50": round(statistics.median(alone) * 1e3, 3),
                    "read_beside_busy_loop_ms_p50": round(statistics.median(beside) * 1e3, 3),
                    "reads_beside": len(beside),
                    "busy_loop_speed_beside_reads": round(spin_beside / spin_alone, 3),
                }
            )
    finally:
        here.send("stop")
        server.join(10)
    if args.json:
        print(json.dumps({"mib": args.mib, "rows": rows}))
        return
    print(f"{args.mib} MiB reads, ms p50 (the busy loop's speed beside them, of alone)")
    for row in rows:
        print(
            f"switch interval {row['switch_interval_s'] * 1e3:g} ms: "
            f"alone {row['read_alone_ms_p50']:.2f}, beside a busy loop "
            f"{row['read_beside_busy_loop_ms_p50']:.2f} "
            f"({row['busy_loop_speed_beside_reads']:.2f})"
        )


if __name__ == "__main__":
    main()
