"""A call cancelled in the same loop turn its answer arrives ends cancelled.

Python 3.11's `asyncio.wait_for` returns the inner result when its task is
cancelled in the turn that result arrives, and the cancellation is lost: the
task runs on as if nobody had cancelled it. That is how a test's event
watcher, cancelled while it connected, went on to watch for ever and hung its
test (`test_sidecar_tp_heads.py` under uvloop sidecars, about one run in 25:
the engine link's close waited on the watcher). kvxfer's waits with a deadline
use `asyncio.timeout`, which keeps the cancellation. Each test makes the
answer and the cancel land in one turn, deterministically: a channel that
becomes ready at the test's word (the fake is the gRPC channel seam), and a
real unix socket lane whose answer the test delivers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvxfer.client.engine import EngineClient
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.wire.lane import Kind
from kvxfer.wire.lane_client import Lane


class ReadyAtWord:
    """The part of a grpc.aio channel `EngineClient.connect` uses: ready when told."""

    def __init__(self) -> None:
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waits = 0

    async def channel_ready(self) -> None:
        self.waits += 1
        await self.ready

    async def close(self) -> None:
        return None


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    path = tmp_path / "engine.sock"
    path.touch()  # connect() waits for the socket file first
    return path


async def _waiting(task: asyncio.Task[object], channel: ReadyAtWord) -> None:
    for _ in range(100):
        if channel.waits:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the client never waited for its channel ({task!r})")


async def test_connect_cancelled_as_the_channel_becomes_ready_ends_cancelled(
    socket_path: Path,
) -> None:
    client = EngineClient(f"unix:{socket_path}", lane=False, connect_timeout_s=30)
    channel = ReadyAtWord()
    client._channel = channel  # type: ignore[assignment]
    task = asyncio.create_task(client.connect())
    await _waiting(task, channel)
    channel.ready.set_result(None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_event_watcher_cancelled_while_connecting_stops(socket_path: Path) -> None:
    """The hang itself: the watcher must end, not go on to watch."""
    client = EngineClient(f"unix:{socket_path}", engine_id="e-1", connect_timeout_s=30)
    channel = ReadyAtWord()
    client._channel = channel  # type: ignore[assignment]

    async def watch() -> None:
        async for _ in client.events():
            pass

    task = asyncio.create_task(watch())
    await _waiting(task, channel)
    channel.ready.set_result(None)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done == {task}, "the cancelled watcher went on"
    assert task.cancelled()
    await client.close()


@contextlib.asynccontextmanager
async def silent_lane(path: Path) -> AsyncIterator[None]:
    """A unix socket that takes frames and answers none (the test answers)."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass
        writer.close()

    server = await asyncio.start_unix_server(swallow, str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


async def test_a_lane_call_cancelled_as_its_answer_arrives_ends_cancelled(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.sock.lane"
    async with silent_lane(path):
        lane = Lane(str(path), connect_timeout_s=5)
        call = lane.call("Pull", pb.PullRequest(), pb.PullResponse, 30, "pull at sidecar")
        task = asyncio.create_task(call)
        for _ in range(100):
            link = lane._link
            if link is not None and link.waiting:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("the call never went out")
        (answer,) = link.waiting.values()
        answer.set_result((Kind.REPLY, pb.PullResponse(chunks=1).SerializeToString()))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await lane.close()
