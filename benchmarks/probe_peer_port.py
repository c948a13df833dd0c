"""Probe a real sidecar's peer port with hostile load and print the figures for
docs/reliability.md ("Peer port: security and limits").

    .venv/bin/python benchmarks/probe_peer_port.py [--addresses 4000] [--pulls 3]

1. Pulls whose params name N distinct addresses that refuse connections: the
   decode sidecar's metric series and RSS before and after.
2. Three concurrent pulls from a peer that accepts TCP and never answers: when
   each one ended (they share one handshake, so all end at one RPC timeout).
3. A 63 MiB Heartbeat against the prefill sidecar: its status and RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import tempfile
import time
from pathlib import Path

import grpc
import grpc.aio

from kvxfer._exceptions import KvxferError
from kvxfer.cli.fleet import Fleet, scrape
from kvxfer.client.engine import EngineClient
from kvxfer.core.layout import BlockId, BlockSpan, GroupId
from kvxfer.core.requests import TransferParams
from kvxfer.v1 import sidecar_pb2 as pb

MODEL = "gemma-3-4b-it"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def params_for(address: str, request_id: str) -> TransferParams:
    span = BlockSpan(GroupId(0), 0, (BlockId(0),))
    return TransferParams(address, "e-x", 1, 0, request_id, 16, (span,))


async def bogus_addresses(client: EngineClient, count: int) -> int:
    refused = 0
    for i in range(count):
        params = params_for(f"127.0.0.1:{closed_port()}", f"bogus-{i}")
        try:
            await client.pull(params, [BlockSpan(GroupId(0), 0, (BlockId(1),))], 0)
        except KvxferError:
            refused += 1
    return refused


async def hung_peer(client: EngineClient, pulls: int) -> list[float]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    start = time.monotonic()

    async def one(i: int) -> float:
        with contextlib.suppress(KvxferError):
            await client.pull(params_for(address, f"hung-{i}"), [], 0)
        return time.monotonic() - start

    try:
        return list(await asyncio.gather(*(one(i) for i in range(pulls))))
    finally:
        listener.close()


async def huge_heartbeat(address: str) -> str:
    body = pb.HeartbeatRequest(request_ids=["r"] * (21 << 20)).SerializeToString()
    options = [("grpc.max_send_message_length", 128 << 20)]
    async with grpc.aio.insecure_channel(address, options) as channel:
        call = channel.unary_unary("/kvxfer.v1.PeerService/Heartbeat")
        try:
            await call(body, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name} ({len(body) / 2**20:.0f} MiB body)"
    return "OK"


def series(metrics_address: str) -> int:
    return len(scrape(metrics_address))


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp))
        try:
            p = fleet.sidecar("p")
            fleet.engine(p, MODEL, "prefill", "--num-blocks", "16")
            d = fleet.sidecar("d", "--transfer.rpc-timeout-s", "2")
            de = fleet.engine(d, MODEL, "decode", "--num-blocks", "16")
            async with EngineClient(d.ready["engine_address"], engine_id=de.engine_id) as client:
                before = (series(d.ready["metrics_address"]), rss_mib(d.pid))
                refused = await bogus_addresses(client, args.addresses)
                after = (series(d.ready["metrics_address"]), rss_mib(d.pid))
                print(f"{args.addresses} bogus peer addresses: {refused} refused; series "
                      f"{before[0]} -> {after[0]}; decode RSS {before[1]:.0f} -> "
                      f"{after[1]:.0f} MiB")  # fmt: skip
                ended = await hung_peer(client, args.pulls)
                print(f"{args.pulls} pulls from a hung peer (rpc timeout 2 s) ended after "
                      + ", ".join(f"{t:.1f}" for t in ended) + " s")  # fmt: skip
            rss = rss_mib(p.pid)
            status = await huge_heartbeat(p.ready["peer_address"])
            print(f"63 MiB Heartbeat: {status}; prefill RSS {rss:.0f} -> {rss_mib(p.pid):.0f} MiB")
        finally:
            fleet.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addresses", type=int, default=4000)
    parser.add_argument("--pulls", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
