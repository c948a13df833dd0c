"""Forward a unix socket to a TCP address: `python unix_forward.py SOCKET HOST:PORT`.

The fuzz tier runs its sidecar in a network namespace that has only loopback,
so that no fuzzed address can reach anything outside it. Run inside that
namespace, this lets the test process (outside it) reach the sidecar's TCP
peer port through a pathname socket, which namespaces share. Prints one JSON
ready line; stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _main(path: str, host: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pipe(reader, upstream_writer), _pipe(upstream_reader, writer), return_exceptions=True
        )

    server = await asyncio.start_unix_server(handle, path)
    print(json.dumps({"address": f"unix:{path}"}), flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    socket_path, target = sys.argv[1], sys.argv[2]
    target_host, _, target_port = target.rpartition(":")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(socket_path, target_host, int(target_port)))
