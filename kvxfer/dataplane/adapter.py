"""The NIXL adapter: the only module in kvxfer that imports nixl.

One `NixlAgent` owns one NIXL agent and one dedicated thread. Every NIXL call
runs on that thread (NIXL is not guaranteed thread-safe); asyncio callers get
`concurrent.futures` results wrapped for their loop, so the event loop never
blocks and never polls. The thread also polls in-flight transfer handles
(NIXL reports status per handle) and enforces each chunk's stall deadline,
which NIXL itself does not have: a chunk not done by then is released and
reported TIMED_OUT.

No write after "failed". NIXL cannot cancel a posted READ: releasing its
handle, or even removing the remote agent, leaves the backend's requests
alive, and a stalled peer that wakes up later still delivers its bytes into
the destination blocks (measured over UCX TCP: every byte of a timed-out
read landed within 2 s of the peer resuming). Only destroying the agent and
its backend (the UCX worker and endpoints) ends them. So when a posted chunk
ends any other way than DONE, the agent severs itself: it releases every
handle, deregisters its memory and destroys the NIXL agent, and only then
resolves the failed chunk and every other chunk in flight (SEVERED). A
severed agent is closed: reads on it end CANCELLED at once. Every NIXL handle
holds the C++ agent too, so no handle may outlive that teardown: each is taken
out of its chunk as it is released (`_InFlight.take_handle`). One agent per
peer and destination (`readers.py`) keeps one bad peer from severing
transfers from the others.

NIXL's string states and exceptions stop here: callers see `TransferStatus`
and kvxfer errors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import os
import queue
import secrets
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvxfer._exceptions import (
    BackendCreationError,
    DataPlaneError,
    PeerDisconnectedError,
    RegistrationError,
    TransferError,
    shown,
)
from kvxfer.core.buffers import MemoryKind
from kvxfer.dataplane.memory import MappedBuffer

log = logging.getLogger(__name__)

T = TypeVar("T")
DescArray = npt.NDArray[np.uint64]  # N x 3: (address, length, device id)

THREAD_PREFIX = "nixl-"  # every agent's thread is named this and the agent's name
_IDLE_S = 0.005  # wait for commands (and notification polls) when idle


class TransferStatus(enum.Enum):
    DONE = "done"
    FAILED = "failed"  # NIXL reported an error for the handle
    TIMED_OUT = "timed_out"  # not done by the stall deadline
    DISCONNECTED = "disconnected"  # the remote agent is gone
    CANCELLED = "cancelled"  # not posted, or the adapter was closed: nothing can land
    SEVERED = "severed"  # in flight when another chunk's failure severed the agent


@dataclass(frozen=True)
class ChunkJob:
    """One NIXL handle: a READ of `remote` descriptors into `local` ones, or with
    `write` a WRITE of `local` descriptors into `remote` ones (push). Either way a
    failure severs the agent before it is reported: a late WRITE would land in the
    peer's blocks as a late READ lands in ours."""

    peer: str
    local: DescArray
    remote: DescArray
    local_kind: MemoryKind
    remote_kind: MemoryKind
    deadline_s: float
    write: bool = False
    # Called on the NIXL thread just before the handle is posted (the post releases the
    # GIL while it copies): a caller holding back GIL-heavy work until then.
    on_post: Callable[[], None] | None = None


@dataclass(frozen=True)
class AgentOptions:
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0
    # NIXL's Python API runs its progress thread with no delay: it spins a core even when
    # idle. This thread drives progress instead: tightly while transfers are in flight,
    # every _IDLE_S otherwise (enough for connection wireup and passive targets).
    enable_prog_thread: bool = False
    backend_params: tuple[tuple[str, str], ...] = ()


class TransferBackend(Protocol):
    """What the executor and the sidecar need from a data plane (real or fault-injecting)."""

    @property
    def name(self) -> str: ...

    async def metadata(self) -> bytes: ...

    async def register(self, buffers: Sequence[MappedBuffer]) -> None: ...

    async def deregister(self, buffers: Sequence[MappedBuffer]) -> None: ...

    async def add_peer(self, metadata: bytes) -> str: ...

    async def remove_peer(self, peer: str) -> None: ...

    async def read(self, job: ChunkJob) -> TransferStatus: ...

    def post_all(self, jobs: Sequence[ChunkJob]) -> asyncio.Future[list[TransferStatus]]:
        """Post every job now, in order; the future ends once each has (their statuses in
        the same order). One hand-off to the NIXL thread and one back for all of them,
        where `read` costs one each way per chunk."""
        ...

    async def notify(self, peer: str, message: bytes) -> None: ...

    def on_notification(self, callback: Callable[[str, bytes], None]) -> None: ...

    async def close(self) -> None: ...

    @property
    def abandoned(self) -> bool:
        """A chunk this agent posted ended without completing (failed, timed out,
        severed, or the agent closed under it): its bytes may still be on their way to
        the peer. For a READ nothing more lands here once the agent is gone; for a WRITE
        the peer's memory is what they land in (server/destinations.py)."""
        ...

    @property
    def closed(self) -> bool:
        """Closed or severed: reads end CANCELLED without being posted."""
        ...

    @property
    def alive(self) -> bool:
        """Its NIXL thread still runs: memory registered with it may still be touched."""
        ...


@dataclass
class _InFlight:
    handle: Any  # None once released (or given up on at teardown)
    deadline: float
    end: Callable[[TransferStatus], None]  # how it ended, told on the NIXL thread

    def take_handle(self) -> Any:
        """The handle, no longer held here: a NIXL handle keeps its agent's C++ object
        alive, and a chunk is still referenced while its end is being reported."""
        handle, self.handle = self.handle, None
        return handle


class _Batch:
    """The chunks of one `post_all`: each ends on its own, and the loop hears once, when
    the last has (on the NIXL thread, like every chunk's end)."""

    def __init__(self, count: int) -> None:
        self.statuses: list[TransferStatus | None] = [None] * count
        self.left = count
        self.outcome: concurrent.futures.Future[list[TransferStatus]] = concurrent.futures.Future()
        if not count:
            self.outcome.set_result([])

    def ender(self, index: int) -> Callable[[TransferStatus], None]:
        def end(status: TransferStatus) -> None:
            self.statuses[index] = status
            self.left -= 1
            if not self.left:
                # Every entry is set once `left` reaches 0.
                _settle(self.outcome, [s or TransferStatus.CANCELLED for s in self.statuses])

        return end

    def unrun(self, command: concurrent.futures.Future[None], closed: bool) -> None:
        """The posting command raised instead of posting: the agent was closed or severed
        before it ran (every chunk CANCELLED, none posted), or a bug (passed on)."""
        exc = command.exception()
        if exc is None:
            return
        if isinstance(exc, DataPlaneError) and closed and self.left == len(self.statuses):
            _settle(self.outcome, [TransferStatus.CANCELLED] * len(self.statuses))
        else:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self.outcome.set_exception(exc)


@dataclass
class _State:
    agent: Any = None
    inflight: list[_InFlight] = field(default_factory=list)
    registered: dict[str, Any] = field(default_factory=dict)  # buffer name -> reg descs
    stuck: list[Any] = field(default_factory=list)  # handles NIXL would not release yet


def _nixl() -> Any:
    """The nixl API module: the `nixl` meta package where present, else the cu12 wheel."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: PLC0415
    _logs_to_stderr()
    return nixl_agent, nixl_agent_config


def _plugin_list(agent: Any) -> list[str]:
    try:
        return [str(name) for name in agent.get_plugin_list()]
    except Exception:  # NIXL that cannot list its plugins lists none
        return []


def _logs_to_stderr() -> None:
    """NIXL and UCX log to stdout; stdout belongs to the program (JSON output, ready
    lines), and a parent that reads only the ready line leaves that pipe undrained: UCX
    warning about requests a severed worker never returned would block on a full pipe
    inside the teardown. UCX reads UCX_LOG_FILE when its backend is created (after this)."""
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _settle(outcome: concurrent.futures.Future[T], status: T) -> None:
    """Tell a chunk's outcome, unless its waiter gave up on it: cancelling the task that
    awaits a chunk cancels its future, and `set_result` on that would raise here and end
    this agent's thread, leaving every later call unanswered. The chunk itself stays
    this thread's to poll and release."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        outcome.set_result(status)


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` where the OS shows it (its first 15 bytes: top -H,
    /proc/<pid>/task/<tid>/comm), which Python before 3.14 leaves at the process's
    name: the bench tells the CPU a copy takes from the rest by it."""
    with contextlib.suppress(OSError):
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_bytes(name.encode()[:15])


def _without_locals(exc: BaseException) -> BaseException:
    """`exc`, its frames' locals dropped, for logging: a NIXL handle in one of those frames
    would keep its agent's C++ object alive for as long as a log handler keeps the record
    (pytest's does), past the teardown that must destroy it. Tracebacks still print."""
    traceback.clear_frames(exc.__traceback__)
    return exc


def _weakly(agent: Any) -> Callable[[], object]:
    """A weak reference to the C++ agent behind nixl's Python one (what its handles hold),
    or, where this nixl does not expose it, a reference that always reads None."""
    try:
        return weakref.ref(agent.agent)
    except (AttributeError, TypeError):
        return lambda: None


def _is_disconnect(exc: BaseException) -> bool:
    return type(exc).__name__ == "nixlRemoteDisconnectError"


class NixlAgent:
    """A NIXL agent on its own thread. Implements TransferBackend."""

    def __init__(self, name: str = "kvxfer", options: AgentOptions | None = None) -> None:
        self._name = f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self._options = options or AgentOptions()
        self._commands: queue.SimpleQueue[
            tuple[Callable[[_State], Any], concurrent.futures.Future[Any]]
        ] = queue.SimpleQueue()
        self._stopping = threading.Event()
        # Held while a command is queued and while the thread takes its last commands:
        # a command queued once the thread is done would never be answered.
        self._queueing = threading.RLock()
        self._exited = False
        self._abandoned = False  # set on the NIXL thread, read after its chunks ended
        self._notify_callback: Callable[[str, bytes], None] | None = None
        self._notify_loop: asyncio.AbstractEventLoop | None = None
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"{THREAD_PREFIX}{self._name}", daemon=True
        )
        self._thread.start()
        started.result()  # re-raises a failed agent creation here

    @property
    def name(self) -> str:
        return self._name

    # -- the NIXL thread ---------------------------------------------------

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        _name_os_thread(self._thread.name)
        state = _State()
        try:
            state.agent = self._create_agent()
        except BackendCreationError as exc:
            started.set_exception(exc)
            return
        except Exception as exc:
            started.set_exception(DataPlaneError(f"cannot create NIXL agent: {exc}"))
            return
        started.set_result(None)
        next_notif_poll = 0.0
        while not self._stopping.is_set() or not self._commands.empty():
            # While transfers are in flight, never sleep: each state check drives UCX
            # progress (for shared-memory transports, the copy itself), and even a 1 us
            # timed wait hands the core to the scheduler.
            self._run_commands(state, None if state.inflight else _IDLE_S)
            self._poll_transfers(state)
            if state.inflight:
                # Hand the GIL over between polls: the event loop (gRPC, the next
                # chunk's post) would otherwise wait up to a switch interval (5 ms).
                time.sleep(0)
            now = time.monotonic()
            if now >= next_notif_poll:  # also progresses the backend's workers
                self._poll_notifications(state)
                next_notif_poll = now + _IDLE_S
        self._shutdown(state)

    def _create_agent(self) -> Any:
        nixl_agent, nixl_agent_config = _nixl()
        config = nixl_agent_config(
            enable_prog_thread=self._options.enable_prog_thread,
            backends=[],
            num_threads=self._options.num_threads,
        )
        agent = nixl_agent(self._name, config)
        for backend in self._options.backends:
            params = self._backend_params(agent, backend, given=True)
            try:
                agent.create_backend(backend, params)
            except Exception as exc:
                refused = self._option_to_blame(agent, backend, exc)
                if refused is None:
                    raise
                raise refused from exc
        return agent

    def _backend_params(self, agent: Any, backend: str, *, given: bool) -> dict[str, str]:
        """The plugin's defaults, and the parameters the options give when `given`:
        createBackend with a parameter missing does not take the plugin's default for it.
        For UCX that default is peer error handling; without it a peer that tears its
        endpoints down (a severed reader) makes this side's UCX abort on a failed lane
        when it next progresses."""
        params = {str(k): str(v) for k, v in agent.get_plugin_params(backend).items()}
        if given:
            params.update(self._options.backend_params)
        if self._options.num_threads:
            params.setdefault("num_threads", str(self._options.num_threads))
        return params

    def _option_to_blame(
        self, agent: Any, backend: str, exc: Exception
    ) -> BackendCreationError | None:
        """The option to blame for NIXL refusing to create `backend`, where NIXL shows it
        at fault: the backend's name when NIXL finds no plugin it can load by that name;
        the parameters given when NIXL creates the backend without them. None when no
        option is known to be at fault (NIXL fails with its own defaults too: the host,
        its drivers or the environment)."""
        if type(exc).__name__ == "nixlNotFoundError":
            listed = backend in _plugin_list(agent)
            why = "its plugin does not load here" if listed else "no plugin of that name"
            return BackendCreationError(
                "backends", f"NIXL cannot create backend {shown(backend)}: {why}"
            )
        given = ", ".join(f"{key}={value}" for key, value in self._options.backend_params)
        if not given:
            return None
        try:  # the parameters are at fault only if NIXL takes the backend without them
            agent.create_backend(backend, self._backend_params(agent, backend, given=False))
        except Exception:
            return None
        return BackendCreationError(
            "backend_params",
            f"NIXL could not create backend {shown(backend)} with {shown(given)}, and can "
            f"without them ({exc}; NIXL's log above says why)",
        )

    def _run_commands(self, state: _State, wait_s: float | None) -> None:
        """Run queued commands; wait up to `wait_s` for the first (None: do not wait)."""
        try:
            if wait_s is None:
                command, future = self._commands.get_nowait()
            else:
                command, future = self._commands.get(timeout=wait_s)
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(command(state))
                except BaseException as exc:
                    future.set_exception(exc)
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _poll_transfers(self, state: _State) -> None:
        if not state.inflight and not state.stuck:
            return
        now = time.monotonic()
        still: list[_InFlight] = []
        failed: list[tuple[_InFlight, TransferStatus]] = []
        for item in state.inflight:
            status = self._check(state, item.handle)
            if status is None and now >= item.deadline:
                status = TransferStatus.TIMED_OUT
            if status is None:
                still.append(item)
            elif status is TransferStatus.DONE:
                item.end(status)  # the bytes are in: tell the loop first
                self._release(state, item)
            else:
                failed.append((item, status))
        state.inflight = still
        if failed:
            self._sever(state, failed)
            return
        if state.stuck:
            retry, state.stuck = state.stuck, []
            for handle in retry:
                self._release(state, handle)

    @staticmethod
    def _check(state: _State, handle: Any) -> TransferStatus | None:
        try:
            text = state.agent.check_xfer_state(handle)
        except Exception as exc:
            return TransferStatus.DISCONNECTED if _is_disconnect(exc) else TransferStatus.FAILED
        if text == "DONE":
            return TransferStatus.DONE
        if text == "PROC":
            return None
        return TransferStatus.FAILED

    @staticmethod
    def _release(state: _State, item: _InFlight) -> None:
        handle = item.take_handle()
        try:
            state.agent.release_xfer_handle(handle)
        except Exception as exc:  # still busy in the backend: try again later
            log.debug("xfer handle not released yet: %s", _without_locals(exc))
            state.stuck.append(handle)

    def _sever(self, state: _State, failed: list[tuple[_InFlight, TransferStatus]]) -> None:
        """A posted chunk failed: make every handle of this agent unable to write, then
        report. The failed chunks get their own status, the rest in flight SEVERED."""
        log.warning(
            "NIXL agent %s: %d handle(s) %s; severing it (%d more in flight)",
            self._name,
            len(failed),
            "/".join(sorted({status.value for _, status in failed})),
            len(state.inflight),
        )
        outcomes = [*failed, *((item, TransferStatus.SEVERED) for item in state.inflight)]
        state.inflight = []
        self._abandoned = True
        self._stopping.set()
        self._destroy(state, [item for item, _ in outcomes])
        # Only now, with the backend's workers gone, may anyone hear that these failed.
        for item, status in outcomes:
            item.end(status)

    def _poll_notifications(self, state: _State) -> None:
        if state.agent is None:  # severed
            return
        callback, loop = self._notify_callback, self._notify_loop
        try:
            notifs = state.agent.get_new_notifs()
        except Exception as exc:
            log.warning("polling NIXL notifications failed: %s", exc)
            return
        for peer, messages in notifs.items():
            for message in messages:
                if loop is not None and callback is not None:
                    # A closed loop has nobody to tell; this thread goes on regardless.
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(callback, peer, bytes(message))

    def _shutdown(self, state: _State) -> None:
        pending, state.inflight = state.inflight, []
        self._abandoned = self._abandoned or bool(pending)
        self._destroy(state, pending)
        for item in pending:  # reported only once nothing can write for them any more
            item.end(TransferStatus.CANCELLED)
        with self._queueing:  # a command queued since the loop last looked fails now
            self._exited = True
            self._run_commands(state, None)

    def _destroy(self, state: _State, items: Sequence[_InFlight]) -> None:
        """Release the handles of `items` (taking them out of the chunks, which the caller
        still holds to report them) and every stuck one, deregister all memory and destroy
        the NIXL agent. Destroying it tears down the backend's workers and endpoints, which
        is what ends requests that releasing their handle leaves running (see the module
        docstring)."""
        if state.agent is None:
            return
        handles = [*(item.take_handle() for item in items), *state.stuck]
        state.stuck = []
        while handles:  # popped: once released, no name here holds a handle
            self._release_for_teardown(state, handles.pop())
        for descs in state.registered.values():
            try:
                state.agent.deregister_memory(descs)
            except Exception as exc:
                log.warning("deregistering memory failed: %s", exc)
        state.registered.clear()
        # Every NIXL handle holds the C++ agent (nixl_xfer_handle._agent) besides this
        # wrapper; with each handle dropped above (a handle not yet released tries once
        # more as it goes), this is the last reference, and dropping it destroys the agent
        # and its backends here, before any chunk of it is reported. (No gc.collect(): it
        # would run other objects' finalizers, gRPC's among them, on this thread.)
        binding = _weakly(state.agent)
        state.agent = None
        if binding() is not None:
            log.error(
                "NIXL agent %s outlived its teardown: something still holds it, and its "
                "transfers may still write into memory reported failed",
                self._name,
            )

    @staticmethod
    def _release_for_teardown(state: _State, handle: Any) -> None:
        try:
            state.agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("xfer handle not released before teardown: %s", _without_locals(exc))

    # -- the asyncio side --------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._stopping.is_set()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    @property
    def alive(self) -> bool:
        """The NIXL thread still runs: memory registered here may still be touched."""
        return self._thread.is_alive()

    def _submit(self, command: Callable[[_State], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def guarded(state: _State) -> T:
            if state.agent is None:  # severed after this command was queued
                raise DataPlaneError(f"NIXL agent {self._name} is closed")
            return command(state)

        with self._queueing:
            if self._stopping.is_set() or self._exited:
                future.set_exception(DataPlaneError(f"NIXL agent {self._name} is closed"))
            else:
                self._commands.put((guarded, future))
        return future

    async def _call(self, command: Callable[[_State], T]) -> T:
        return await asyncio.wrap_future(self._submit(command))

    async def _call_unless_closed(self, command: Callable[[_State], None]) -> None:
        """For teardown steps that closing (or severing) has already done."""
        try:
            await self._call(command)
        except DataPlaneError:
            if not self.closed:
                raise

    async def metadata(self) -> bytes:
        return await self._call(lambda s: bytes(s.agent.get_agent_metadata()))

    async def register(self, buffers: Sequence[MappedBuffer]) -> None:
        def command(state: _State) -> None:
            for buffer in buffers:
                if buffer.name in state.registered:
                    raise RegistrationError(f"buffer '{buffer.name}' is already registered")
                region = [(buffer.address, buffer.handle.size_bytes, buffer.device_id, buffer.name)]
                try:
                    state.registered[buffer.name] = state.agent.register_memory(
                        region, buffer.handle.kind.value
                    )
                except Exception as exc:
                    raise RegistrationError(
                        f"NIXL could not register buffer '{buffer.name}' "
                        f"({buffer.handle.size_bytes} bytes, {buffer.handle.kind.value}): {exc}"
                    ) from exc

        await self._call_unless_closed(command)

    async def deregister(self, buffers: Sequence[MappedBuffer]) -> None:
        """Deregister `buffers`; nothing to do once closed (closing deregistered all)."""

        def command(state: _State) -> None:
            for buffer in buffers:
                descs = state.registered.pop(buffer.name, None)
                if descs is not None:
                    state.agent.deregister_memory(descs)

        await self._call_unless_closed(command)

    async def add_peer(self, metadata: bytes) -> str:
        def command(state: _State) -> str:
            try:
                peer = state.agent.add_remote_agent(metadata)
                return peer.decode() if isinstance(peer, bytes) else str(peer)
            except Exception as exc:
                raise DataPlaneError(f"cannot load peer NIXL metadata: {exc}") from exc

        return await self._call(command)

    async def remove_peer(self, peer: str) -> None:
        def command(state: _State) -> None:
            try:
                state.agent.remove_remote_agent(peer)
            except Exception as exc:
                log.info("removing NIXL peer %s: %s", peer, exc)

        await self._call(command)

    async def read(self, job: ChunkJob) -> TransferStatus:
        """Post one chunk and wait for it: DONE, or why not. Never raises for the
        transfer itself."""
        (status,) = await self.post_all([job])
        return status

    def post_all(self, jobs: Sequence[ChunkJob]) -> asyncio.Future[list[TransferStatus]]:
        batch = _Batch(len(jobs))
        if not jobs:
            return asyncio.wrap_future(batch.outcome)

        def command(state: _State) -> None:
            for index, job in enumerate(jobs):
                end = batch.ender(index)
                try:
                    self._post(state, job, end)
                except Exception as exc:  # a bug: chunks of this batch may be in flight
                    log.error(
                        "posting a chunk to %s failed; severing the agent",
                        job.peer,
                        exc_info=_without_locals(exc),  # the failed post's frames hold its handle
                    )
                    # Nothing is reported before what was posted can no longer land; the
                    # rest of the batch then ends CANCELLED, unposted.
                    self._sever(state, [])
                    end(TransferStatus.FAILED)

        # One hand-off back to the loop for the whole batch: its chunks' outcomes, or
        # why its command did not run (closed or severed before any was posted).
        self._submit(command).add_done_callback(lambda c: batch.unrun(c, self.closed))
        return asyncio.wrap_future(batch.outcome)

    def _post(self, state: _State, job: ChunkJob, end: Callable[[TransferStatus], None]) -> None:
        """Create and post one chunk's handle (on the NIXL thread); `end` hears how it
        ended. A chunk after one whose failure severed the agent is not posted."""
        if state.agent is None:
            end(TransferStatus.CANCELLED)
            return
        try:  # the handle goes straight into its chunk, which gives it up to a teardown
            item = _InFlight(self._create(state, job), time.monotonic() + job.deadline_s, end)
        except PeerDisconnectedError:
            end(TransferStatus.DISCONNECTED)
            return
        except TransferError as exc:  # nothing was posted: nothing to sever
            log.warning("chunk to %s not created: %s", job.peer, exc)
            end(TransferStatus.FAILED)
            return
        if job.on_post is not None:
            job.on_post()
        status = self._start(state, item, job.peer)
        if status is None:
            # Where the post copies (one host: CMA) the chunk is done already; said now,
            # a later chunk of its batch that fails cannot take it down with it (SEVERED).
            status = self._check(state, item.handle)
        if status is None:
            state.inflight.append(item)
        elif status is TransferStatus.DONE:
            item.end(status)
            self._release(state, item)
        else:  # part of the handle may have been posted before NIXL gave up
            self._sever(state, [(item, status)])

    @staticmethod
    def _create(state: _State, job: ChunkJob) -> Any:
        agent = state.agent
        try:
            local = agent.get_xfer_descs(job.local, job.local_kind.value)
            remote = agent.get_xfer_descs(job.remote, job.remote_kind.value)
            return agent.initialize_xfer("WRITE" if job.write else "READ", local, remote, job.peer)
        except Exception as exc:
            if _is_disconnect(exc):
                raise PeerDisconnectedError(f"peer {job.peer} disconnected") from exc
            raise TransferError(f"cannot create transfer to {job.peer}: {exc}") from exc

    @staticmethod
    def _start(state: _State, item: _InFlight, peer: str) -> TransferStatus | None:
        """Post the handle: None while it runs, else why it failed at once."""
        try:
            status = state.agent.transfer(item.handle)
        except Exception as exc:
            log.warning("chunk to %s failed to post: %s", peer, _without_locals(exc))
            return TransferStatus.DISCONNECTED if _is_disconnect(exc) else TransferStatus.FAILED
        if status == "ERR":
            log.warning("NIXL refused the transfer to %s", peer)
            return TransferStatus.FAILED
        return None

    async def notify(self, peer: str, message: bytes) -> None:
        def command(state: _State) -> None:
            try:
                state.agent.send_notif(peer, message)
            except Exception as exc:
                if _is_disconnect(exc):
                    raise PeerDisconnectedError(f"peer {peer} disconnected") from exc
                raise TransferError(f"cannot notify {peer}: {exc}") from exc

        await self._call(command)

    async def run_on_agent(self, function: Callable[[Any], T]) -> T:
        """Run `function(nixl_agent)` on the NIXL thread. For benchmarks that measure raw
        NIXL on the same agent and buffers; kvxfer itself never needs it."""
        return await self._call(lambda state: function(state.agent))

    def on_notification(self, callback: Callable[[str, bytes], None]) -> None:
        """Deliver NIXL notifications (peer agent name, message) on the caller's loop."""
        self._notify_loop = asyncio.get_running_loop()
        self._notify_callback = callback

    async def close(self) -> None:
        """Stop the thread; chunks in flight end CANCELLED once the agent is destroyed.
        On return the agent is destroyed, unless its thread is stuck in a NIXL call for
        10 s: then `alive` stays True and its memory must not be unmapped."""
        self._stopping.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 10.0)
