"""The floor under any Python sidecar's pull on this machine: a sidecar with no logic.

Three processes, as in `kvxfer-cli bench`: an engine, a decode sidecar that
reads with NIXL, and a prefill sidecar that owns the source buffer. The
"sidecar" here does nothing a real one must do beyond the bare protocol:

- the engine sends 8 bytes over a unix socket (its Pull);
- the decode process, on its uvloop, sends 8 bytes to the prefill process (its
  BeginRead, answered at once) and, without waiting, posts one NIXL READ of
  descriptors built once at start, on the loop's own thread (no hand-off to a
  NIXL thread), and polls it to DONE;
- it then reads the prefill's answer (by then in its socket) and sends 8 bytes
  back to the engine (its PullDone).

`--no-begin` leaves the prefill round trip out. Raw is the same READ of the
same descriptors, posted and timed inside the decode process (the bench's raw
is timed the same way, inside the agent that posts it). Every operation
follows an idle gap, as a pull in the bench follows the bench's other
methods. Printed: raw p50, the engine's end-to-end p50 and p99, and their
difference, the floor of the bench's `overhead_ms_p50`.

    .venv/bin/python benchmarks/probe_floor.py [--mib 27] [--regions 48] [--rounds 200] \
        [--gap-ms 20] [--no-begin] [--json]

Nothing of kvxfer's runs here but `_nixl()`, which finds the installed NIXL
package: the numbers are NIXL's, CPython's, uvloop's and the machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import uvloop

from kvxfer.dataplane.adapter import _nixl

_PULL, _RAW, _STOP = 1, 2, 3


def _agent(name: str) -> Any:
    nixl_agent, nixl_agent_config = _nixl()
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _prefill(conn: Connection, lane: socket.socket, nbytes: int) -> None:
    """Owns the source buffer (its agent progressed every 5 ms, as a sidecar's idle
    serving agent is); answers every 8-byte BeginRead at once."""
    agent = _agent("floor-prefill")
    src = np.ones(nbytes, dtype=np.uint8)
    agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), src.ctypes.data))

    def progress() -> None:  # a serving agent's idle poll, as a sidecar's thread runs it
        while True:
            agent.get_new_notifs()
            time.sleep(0.005)

    threading.Thread(target=progress, daemon=True).start()

    async def serve() -> None:
        reader, writer = await asyncio.open_unix_connection(sock=lane)
        while data := await reader.readexactly(8):
            writer.write(data)

    with contextlib.suppress(asyncio.IncompleteReadError):  # the decode side closed
        uvloop.run(serve())


def _descs(base: int, nbytes: int, regions: int) -> np.ndarray:
    size = nbytes // regions
    rows = [[base + i * size, size, 0] for i in range(regions)]
    return np.array(rows, dtype=np.uint64)


def _decode(
    engine: socket.socket, prefill: socket.socket, meta: tuple[bytes, int], args: Any
) -> None:
    """The decode sidecar with no logic: one loop thread posts and polls the READ."""
    agent = _agent("floor-decode")
    dst = np.zeros(args.nbytes, dtype=np.uint8)
    agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent(meta[0])
    local = agent.get_xfer_descs(_descs(dst.ctypes.data, args.nbytes, args.regions), "DRAM")
    remote = agent.get_xfer_descs(_descs(meta[1], args.nbytes, args.regions), "DRAM")

    def read() -> None:
        handle = agent.initialize_xfer("READ", local, remote, peer)
        agent.transfer(handle)
        while (state := agent.check_xfer_state(handle)) == "PROC":
            pass
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"read ended {state}")

    async def serve() -> None:
        e_reader, e_writer = await asyncio.open_unix_connection(sock=engine)
        p_reader, p_writer = await asyncio.open_unix_connection(sock=prefill)
        while True:
            kind, seq = struct.unpack("<II", await e_reader.readexactly(8))
            if kind == _STOP:
                return
            if kind == _RAW:
                start = time.perf_counter()
                read()
                e_writer.write(struct.pack("<d", time.perf_counter() - start))
                continue
            if not args.no_begin:
                p_writer.write(struct.pack("<II", kind, seq))
            read()
            if not args.no_begin:
                await p_reader.readexactly(8)
            e_writer.write(struct.pack("<d", 0.0))

    uvloop.run(serve())


async def _engine(sock: socket.socket, args: Any) -> dict[str, float]:
    reader, writer = await asyncio.open_unix_connection(sock=sock)

    async def call(kind: int, seq: int) -> float:
        start = time.perf_counter()
        writer.write(struct.pack("<II", kind, seq))
        (inside,) = struct.unpack("<d", await reader.readexactly(8))
        return inside if kind == _RAW else time.perf_counter() - start

    raw, pulls = [], []
    for seq in range(args.rounds + 10):
        await asyncio.sleep(args.gap_ms / 1000)
        r = await call(_RAW, seq)
        await asyncio.sleep(args.gap_ms / 1000)
        p = await call(_PULL, seq)
        if seq >= 10:
            raw.append(r)
            pulls.append(p)
    writer.write(struct.pack("<II", _STOP, 0))
    await writer.drain()
    pulls.sort()
    return {
        "raw_ms_p50": round(statistics.median(raw) * 1e3, 3),
        "e2e_ms_p50": round(statistics.median(pulls) * 1e3, 3),
        "e2e_ms_p99": round(pulls[int(len(pulls) * 0.99) - 1] * 1e3, 3),
        "floor_ms_p50": round((statistics.median(pulls) - statistics.median(raw)) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=27, help="bytes per read, MiB")
    parser.add_argument("--regions", type=int, default=48, help="descriptors per read")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="idle before each call")
    parser.add_argument("--no-begin", action="store_true", help="no prefill round trip")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    engine_end, decode_from_engine = socket.socketpair()
    decode_to_prefill, prefill_end = socket.socketpair()
    prefill = ctx.Process(target=_prefill, args=(there, prefill_end, args.nbytes))
    prefill.start()
    meta = here.recv()
    decode = ctx.Process(target=_decode, args=(decode_from_engine, decode_to_prefill, meta, args))
    decode.start()
    try:
        row = uvloop.run(_engine(engine_end, args))
    finally:
        decode.join(10)
        decode_to_prefill.close()
        prefill.join(10)
        for proc in (decode, prefill):
            if proc.is_alive():
                proc.kill()
    row.update(mib=args.mib, regions=args.regions, begin=not args.no_begin, gap_ms=args.gap_ms)
    if args.json:
        print(json.dumps(row))
        return
    print(
        f"{args.mib} MiB in {args.regions} descriptors, {args.gap_ms:g} ms idle before each call, "
        f"prefill round trip {'on' if row['begin'] else 'off'}: "
        f"raw p50 {row['raw_ms_p50']:.2f} ms, "
        f"engine end to end p50 {row['e2e_ms_p50']:.2f} / p99 {row['e2e_ms_p99']:.2f} ms, "
        f"floor (p50 less raw's) {row['floor_ms_p50']:+.2f} ms"
    )


if __name__ == "__main__":
    main()
