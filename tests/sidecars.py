"""Real kvxfer-server and engine-sim processes for end-to-end tests, and byte checks.

`start_sidecar` / `start_engine` run the installed console scripts and wait
for their JSON ready line. `EngineSim` maps the engine's shared memory
read-only so a test can compare destination blocks with source blocks and
check that every other destination byte still holds the decode pattern; the
blocks that must move come from the token-level oracle, not the planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from oracle import oracle_blocks
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.client.engine import EngineClient
from kvxfer.client.patterns import pattern, salt_for
from kvxfer.core.layout import BlockId, BlockSpan, EngineLayout, GroupId, Region
from kvxfer.core.profiles import layout_for_model
from kvxfer.core.requests import EngineEvent

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 60.0


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    ready: dict[str, Any]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
            raise AssertionError(f"{self.log.name}: did not stop within {timeout_s}s") from None
        finally:
            if self.popen.stdout is not None:
                self.popen.stdout.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _spawn(argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> Proc:
    full_env = {**os.environ, **(env or {})}
    with log.open("w") as err:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=full_env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    assert popen.stdout is not None
    while time.monotonic() < deadline:
        readable, _, _ = select.select([popen.stdout], [], [], 0.2)
        if readable:
            line = popen.stdout.readline()
            if line.startswith("{"):
                return Proc(popen, json.loads(line), log)
            if not line and popen.poll() is not None:
                break
        elif popen.poll() is not None:
            break
    popen.kill()
    popen.wait(5)
    popen.stdout.close()
    raise AssertionError(f"{argv[0]} did not become ready:\n{log.read_text()[-3000:]}")


def start_sidecar(tmp: Path, name: str, *args: str, peer_port: int = 0) -> Proc:
    argv = [
        str(BIN / "kvxfer-server"),
        "--peer-address", f"127.0.0.1:{peer_port}",
        "--engine-address", f"unix:{tmp / name}.sock",
        "--metrics-address", "127.0.0.1:0",
        "--sidecar-id", name,
        *args,
    ]  # fmt: skip
    return _spawn(argv, tmp / f"{name}.log")


def start_engine(
    tmp: Path, sidecar: Proc, model: str, role: str, *args: str, num_blocks: int = 128
) -> EngineSim:
    argv = [
        str(BIN / "kvxfer-cli"), "engine-sim",
        "--sidecar", sidecar.ready["engine_address"],
        "--model", model,
        "--role", role,
        "--num-blocks", str(num_blocks),
        "--state-blocks", "4",
        *args,
    ]  # fmt: skip
    proc = _spawn(argv, tmp / f"engine-{role}-{sidecar.ready['sidecar_id']}.log")
    return EngineSim(proc)


@dataclass
class EngineSim:
    proc: Proc
    _maps: dict[str, npt.NDArray[np.uint8]] = field(default_factory=dict)

    @property
    def ready(self) -> dict[str, Any]:
        return self.proc.ready

    @property
    def engine_id(self) -> str:
        return str(self.ready["engine_id"])

    @functools.cached_property
    def layout(self) -> EngineLayout:
        r = self.ready
        base = layout_for_model(r["model"], kv_dtype=r["kv_dtype"], block_size=r["block_size"])
        return base.with_regions(Region(**region) for region in r["regions"])

    def buffer_names(self) -> list[str]:
        return [b["name"] for b in self.ready["buffers"]]

    def view(self, buffer: str) -> npt.NDArray[np.uint8]:
        if buffer not in self._maps:
            spec = next(b for b in self.ready["buffers"] if b["name"] == buffer)
            fd = os.open(f"/dev/shm/{spec['shm_name']}", os.O_RDONLY)
            try:
                mapping = mmap.mmap(fd, spec["size_bytes"], prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[buffer] = np.frombuffer(mapping, dtype=np.uint8)
        return self._maps[buffer]

    def block(self, tensor: str, block_id: int) -> npt.NDArray[np.uint8]:
        region = self.regions[tensor]
        start = region.block_offset(block_id)
        return self.view(region.buffer)[start : start + region.block_bytes]

    @functools.cached_property
    def regions(self) -> dict[str, Region]:
        return self.layout.region_map

    def salt(self, buffer: str) -> np.uint64:
        index = self.buffer_names().index(buffer)
        return salt_for(self.ready["role"], self.ready["seed"], index)

    def stop(self) -> int:
        self._maps.clear()
        return self.proc.stop()


def spans(group_ids: Mapping[int, Sequence[int]], first: int = 0) -> list[BlockSpan]:
    return [
        BlockSpan(GroupId(g), first, tuple(BlockId(b) for b in ids)) for g, ids in group_ids.items()
    ]


@dataclass
class DecodeImage:
    """What every byte of the decode engine's buffers must hold: its pattern, plus the
    blocks earlier verified pulls wrote."""

    engine: EngineSim
    written: dict[tuple[str, int], npt.NDArray[np.uint8]] = field(default_factory=dict)

    def expect_pull(
        self,
        source: EngineSim,
        src_spans: Sequence[BlockSpan],
        dst_spans: Sequence[BlockSpan],
        num_tokens: int,
        computed: int,
        failed: Mapping[int, Sequence[int]],
    ) -> int:
        """Check the moved blocks (oracle's choice, minus `failed`) equal the source's;
        record them; return the bytes that moved."""
        layout = source.layout
        by_group_src = {s.group_id: s for s in src_spans}
        by_group_dst = {s.group_id: s for s in dst_spans}
        moved_bytes = 0
        for group in layout.groups:
            lost = set(failed.get(group.group_id, ()))
            for logical in sorted(oracle_blocks(group, num_tokens, computed, layout.block_size)):
                if logical in lost:
                    continue
                src_id = by_group_src[group.group_id].block_id(logical)
                dst_id = by_group_dst[group.group_id].block_id(logical)
                for tensor in group.tensors:
                    want = source.block(tensor.name, src_id)
                    got = self.engine.block(tensor.name, dst_id)
                    assert np.array_equal(got, want), (
                        f"{tensor.name} logical block {logical} (dst id {dst_id}) differs"
                    )
                    self.written[(tensor.name, dst_id)] = want.copy()
                    moved_bytes += tensor.bytes_per_block
        return moved_bytes

    def check_all(self) -> None:
        """Every byte of every decode buffer: pattern, or a recorded pulled block."""
        layout = self.engine.layout
        for buffer in self.engine.buffer_names():
            view = self.engine.view(buffer)
            expected = pattern(self.engine.salt(buffer), 0, view.size).copy()
            for (tensor, block_id), data in self.written.items():
                region = layout.region_map[tensor]
                if region.buffer == buffer:
                    start = region.block_offset(block_id)
                    expected[start : start + region.block_bytes] = data
            mismatch = np.flatnonzero(view != expected)
            assert mismatch.size == 0, (
                f"{buffer}: {mismatch.size} bytes differ, first at offset {mismatch[0]}"
            )


class Events:
    """Collects an engine's events in the background for the length of a test."""

    def __init__(self, client: EngineClient) -> None:
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(client))

    async def _pump(self, client: EngineClient) -> None:
        async for event in client.events():
            await self._queue.put(event)

    async def next(self, timeout_s: float = 20.0) -> EngineEvent:
        return await asyncio.wait_for(self._queue.get(), timeout_s)

    def pending(self) -> int:
        return self._queue.qsize()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def engine_link(
    sidecar: Proc, engine: EngineSim
) -> AsyncIterator[tuple[EngineClient, Events]]:
    async with EngineClient(sidecar.ready["engine_address"], engine_id=engine.engine_id) as client:
        events = Events(client)
        try:
            yield client, events
        finally:
            await events.close()


def scrape(sidecar: Proc) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One real scrape of the sidecar's /metrics: {(sample name, labels): value}."""
    url = f"http://{sidecar.ready['metrics_address']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(
    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def rss_excluding_shm_bytes(pid: int) -> int:
    """Resident memory of a process, not counting mapped shared memory (engine buffers):
    RssAnon + RssFile from /proc/PID/status (RssShmem is the engines' KV)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(rest.split()[0]) * 1024
    return fields["RssAnon"] + fields["RssFile"]
