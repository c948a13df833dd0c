"""Starting and stopping real sidecar and engine-sim processes (demo, bench, tests).

`Fleet` spawns `kvxfer-server` and `kvxfer-cli engine-sim` processes, waits
for each one's JSON ready line, watches that none of them dies, and on close
(also after Ctrl-C or a failure) stops them all with SIGTERM, then SIGKILL,
and unlinks any shared-memory segment an engine left behind. `EngineView`
maps an engine's segments read-only so a driver can check bytes.

`local_fleet` gives a Fleet its own /tmp directory and cleans both up, also on
Ctrl-C or SIGTERM; `run_until_interrupted` is asyncio.run where either cancels
the run and surfaces as one KeyboardInterrupt (`Terminated` for SIGTERM: the
CLI prints one line and exits 130, or 143).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
import numpy.typing as npt
from prometheus_client.parser import text_string_to_metric_families

from kvxfer._exceptions import KvxferError
from kvxfer.cli.main import Terminated
from kvxfer.client.patterns import pattern, salt_for
from kvxfer.client.shm import segment_creator
from kvxfer.core.layout import EngineLayout, Region
from kvxfer.core.profiles import layout_for_model
from kvxfer.wire.loops import DEFAULT_EVENT_LOOP
from kvxfer.wire.loops import run as run_on

T = TypeVar("T")
BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 90.0
SHM_DIR = Path("/dev/shm")


class ChildDiedError(KvxferError):
    """A process of the fleet exited while it was still needed."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    ready: dict[str, Any]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise ChildDiedError(
                f"{self.name} (pid {self.pid}) exited unexpectedly with code {code}; "
                f"its log: {self.log}"
            )

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal, wait, and SIGKILL if it will not stop; returns the exit code."""
        try:
            if self.popen.poll() is None:
                self.popen.send_signal(sig)
            try:
                return self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                return self.popen.wait(10)
        finally:
            if self.popen.stdout is not None:
                self.popen.stdout.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def spawn(name: str, argv: Sequence[str], log: Path) -> Proc:
    """Start a process and wait for its JSON ready line on stdout."""
    with log.open("w") as err:
        popen = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=False
        )
    assert popen.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([popen.stdout], [], [], 0.2)
        if readable:
            line = popen.stdout.readline()
            if line.startswith("{"):
                return Proc(name, popen, json.loads(line), log)
            if not line and popen.poll() is not None:
                break
        elif popen.poll() is not None:
            break
    popen.kill()
    popen.wait(10)
    popen.stdout.close()
    unlink_segments_of(popen.pid)
    tail = log.read_text(errors="replace")[-2000:]
    raise ChildDiedError(f"{name} did not start (log {log}):\n{tail}")


def unlink_segments_of(pid: int) -> list[str]:
    """Unlink the shared-memory segments a dead process created and could not remove: an
    engine killed while it started has no ready line naming them, only its pid in their
    names (`kvxfer-<role>-<pid>-<random>-g<group>`, kvxfer/client/shm.py)."""
    names = [path.name for path in SHM_DIR.glob("kvxfer-*") if segment_creator(path.name) == pid]
    for name in names:
        (SHM_DIR / name).unlink(missing_ok=True)
    return names


@dataclass
class EngineView:
    """An engine-sim's ready line, layout and read-only views of its shared memory."""

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
        base = layout_for_model(
            r["model"],
            kv_dtype=r["kv_dtype"],
            block_size=r["block_size"],
            tp_size=r.get("tp_size", 1),
            tp_rank=r.get("tp_rank", 0),
        )
        if r.get("head_major"):
            rows = bool(r.get("token_rows"))
            base = dataclasses.replace(base, token_major=False, head_major=True, token_rows=rows)
        return base.with_regions(Region(**region) for region in r["regions"])

    @functools.cached_property
    def regions(self) -> dict[str, Region]:
        return self.layout.region_map

    def shm_names(self) -> list[str]:
        return [b["shm_name"] for b in self.ready["buffers"]]

    def buffer_names(self) -> list[str]:
        return [b["name"] for b in self.ready["buffers"]]

    def view(self, buffer: str) -> npt.NDArray[np.uint8]:
        if buffer not in self._maps:
            spec = next(b for b in self.ready["buffers"] if b["name"] == buffer)
            fd = os.open(SHM_DIR / spec["shm_name"], os.O_RDONLY)
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

    def pattern_block(self, tensor: str, block_id: int) -> npt.NDArray[np.uint8]:
        """A copy of the fill pattern of one block (what it holds before any pull)."""
        region = self.regions[tensor]
        salt = self.salt(region.buffer)
        return pattern(salt, region.block_offset(block_id), region.block_bytes).copy()

    def image_mismatch(
        self, written: Mapping[tuple[str, int], npt.NDArray[np.uint8]]
    ) -> str | None:
        """Check every byte of every buffer: its fill pattern, or for (tensor, block id)
        in `written` the bytes pulled into it. None when all match, else where not."""
        for buffer in self.buffer_names():
            view = self.view(buffer)
            expected = pattern(self.salt(buffer), 0, view.size).copy()
            for (tensor, block_id), data in written.items():
                region = self.regions[tensor]
                if region.buffer == buffer:
                    start = region.block_offset(block_id)
                    expected[start : start + region.block_bytes] = data
            mismatch = np.flatnonzero(view != expected)
            if mismatch.size:
                return f"{buffer}: {mismatch.size} bytes differ, first at offset {mismatch[0]}"
        return None

    def salt(self, buffer: str) -> np.uint64:
        index = self.buffer_names().index(buffer)
        return salt_for(self.ready["role"], self.ready["seed"], index)

    def release(self) -> None:
        self._maps.clear()

    def stop(self) -> int:
        self.release()
        return self.proc.stop()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics_address: str) -> Samples:
    """One scrape of a sidecar's /metrics: {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(
    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def _fresh(path: Path) -> Path:
    """`path`, or `path` with -2, -3, ... before the suffix if it exists already."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def rss_excluding_shm_bytes(pid: int) -> int:
    """Resident memory of a process without mapped shared memory (the engines' KV):
    RssAnon + RssFile from /proc/PID/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(rest.split()[0]) * 1024
    return fields["RssAnon"] + fields["RssFile"]


@dataclass(frozen=True)
class Placement:
    """Where a sidecar and its engines run: `prefix` before their command lines (e.g.
    `ip netns exec NS env ...`), the address the sidecar serves peers on, and flags
    the sidecar needs there."""

    prefix: tuple[str, ...] = ()
    peer_host: str = "127.0.0.1"
    sidecar_args: tuple[str, ...] = ()


class Fleet:
    """The processes of one demo, bench or test; `close()` leaves nothing behind."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []
        self.engines: list[EngineView] = []
        self.keep_logs = False  # local_fleet keeps workdir (and says where) when set

    def placement(self, sidecar_id: str) -> Placement:
        """Where sidecar `sidecar_id` and its engines run: here (a subclass may say
        elsewhere, as the multi-host bench does)."""
        del sidecar_id
        return Placement()

    def sidecar(self, name: str, *args: str, peer_port: int = 0) -> Proc:
        where = self.placement(name)
        argv = [
            *where.prefix,
            str(BIN / "kvxfer-server"),
            "--peer-address", f"{where.peer_host}:{peer_port}",
            "--engine-address", f"unix:{self.workdir / name}.sock",
            "--metrics-address", "127.0.0.1:0",
            "--sidecar-id", name,
            *where.sidecar_args,
            *args,
        ]  # fmt: skip
        proc = spawn(f"sidecar {name}", argv, _fresh(self.workdir / f"{name}.log"))
        self.procs.append(proc)
        return proc

    def engine(self, sidecar: Proc, model: str, role: str, *args: str) -> EngineView:
        argv = [
            *self.placement(str(sidecar.ready["sidecar_id"])).prefix,
            str(BIN / "kvxfer-cli"), "engine-sim",
            "--sidecar", sidecar.ready["engine_address"],
            "--model", model,
            "--role", role,
            *args,
        ]  # fmt: skip
        name = f"engine-sim {role} at {sidecar.name.removeprefix('sidecar ')}"
        log = _fresh(self.workdir / f"engine-{role}-{sidecar.ready['sidecar_id']}.log")
        view = EngineView(spawn(name, argv, log))
        self.procs.append(view.proc)
        self.engines.append(view)
        return view

    def check_alive(self) -> None:
        for proc in self.procs:
            proc.check_alive()

    def sidecars(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("sidecar ")]

    def stop_engine(self, engine: EngineView) -> int:
        engine.release()
        self.engines.remove(engine)
        self.procs.remove(engine.proc)
        return engine.proc.stop()

    def close(self) -> list[str]:
        """Stop engines first (they unregister and unlink), then sidecars; unlink what a
        killed engine left. Returns the names of leftover segments that had to be removed."""
        leftovers: list[str] = []
        for engine in self.engines:
            engine.release()
        engines = {id(e.proc) for e in self.engines}
        for proc in sorted(self.procs, key=lambda p: id(p) not in engines):
            with contextlib.suppress(OSError):
                proc.stop()
        for engine in self.engines:
            for name in engine.shm_names():
                path = SHM_DIR / name
                if path.exists():
                    path.unlink(missing_ok=True)
                    leftovers.append(name)
        self.procs.clear()
        self.engines.clear()
        return leftovers


@contextlib.contextmanager
def local_fleet(prefix: str, label: str, make: Callable[[Path], Fleet] = Fleet) -> Iterator[Fleet]:
    """A Fleet (`make(workdir)`) in a fresh /tmp/PREFIX* directory. On the way out every
    process is stopped (SIGINT and SIGTERM are ignored meanwhile: a second Ctrl-C or
    kill cannot cut the cleanup short) and the directory removed, unless the run failed
    (an error, or `fleet.keep_logs` set): then its logs are kept and `label` names
    where. Ctrl-C (or SIGTERM) is not a failure."""
    fleet = make(Path(tempfile.mkdtemp(prefix=prefix)))
    failed = interrupted = False
    try:
        yield fleet
    except KeyboardInterrupt:
        interrupted = True  # engines got the SIGINT too: leftovers are expected, not news
        raise
    except BaseException:
        failed = True
        raise
    finally:
        with _stops_ignored():
            leftovers = fleet.close()
            if leftovers and not interrupted:
                print(f"{label}: removed leftover shared memory {leftovers}", file=sys.stderr)
            if failed or fleet.keep_logs:
                print(f"{label}: logs kept in {fleet.workdir}", file=sys.stderr)
            else:
                shutil.rmtree(fleet.workdir, ignore_errors=True)


STOPS = (signal.SIGINT, signal.SIGTERM)  # what stops a command and everything it started


def _stopped(sig: int) -> KeyboardInterrupt:
    return Terminated() if sig == signal.SIGTERM else KeyboardInterrupt()


def stops_raise() -> contextlib.AbstractContextManager[None]:
    """Ctrl-C raises KeyboardInterrupt inside, and SIGTERM `Terminated`, even when
    SIGINT came in ignored (a non-interactive shell starts background jobs that way, and
    Python then leaves it ignored): a synchronous command stops what it started, as the
    asyncio ones do (`run_until_interrupted`), instead of running on while its sidecars,
    which got the same SIGINT, shut down under it, or dying on SIGTERM and leaving them
    running."""

    def raise_stopped(sig: int, _frame: object) -> NoReturn:
        raise _stopped(sig)

    return _stops_handled(raise_stopped)


def _stops_ignored() -> contextlib.AbstractContextManager[None]:
    return _stops_handled(signal.SIG_IGN)


@contextlib.contextmanager
def _stops_handled(handler: Callable[[int, Any], object] | signal.Handlers) -> Iterator[None]:
    """`handler` for every signal of STOPS inside; the previous handlers after."""
    previous = {sig: signal.signal(sig, handler) for sig in STOPS}
    try:
        yield
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)


def run_until_interrupted(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on kvxfer's loop (`loops.DEFAULT_EVENT_LOOP`: the bench's and
    demo's engines run on what `SyncEngineClient` gives a real engine), where SIGINT or
    SIGTERM cancels `main` and, once it has unwound, raises KeyboardInterrupt (SIGTERM:
    `Terminated`) whatever error the cancellation caused on the way (on a terminal the
    fleet's sidecars get the same SIGINT and may refuse requests before `main` hears of
    it)."""
    stopped_by: list[int] = []

    async def interruptible() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_stop(sig: int) -> None:
            stopped_by.append(sig)
            task.cancel()

        for sig in STOPS:
            loop.add_signal_handler(sig, on_stop, sig)
        try:
            return await main
        finally:
            for sig in STOPS:
                loop.remove_signal_handler(sig)

    try:
        return run_on(interruptible(), DEFAULT_EVENT_LOOP)
    except BaseException:
        if stopped_by:
            raise _stopped(stopped_by[0]) from None
        raise
