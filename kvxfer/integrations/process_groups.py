"""An engine's process group, and the shared memory it leaves behind.

vLLM runs an engine core (and, with TP > 1, workers) below the process a fleet
starts, all in that process's group. Its shared-memory message queues
(`/dev/shm/psm_*`, 160 MiB each) and multiprocessing semaphores
(`/dev/shm/sem.mp-*`) are unlinked by their creator on a clean exit, else by
Python's resource tracker once every user is gone. A SIGKILL of the whole group
kills the tracker with them (it ignores SIGTERM, not SIGKILL), and the segments
stay in /dev/shm until the machine reboots. So a stop waits for the group to
leave on its own before signalling it, kills every process of it but the
tracker (which then unlinks what they registered and exits), and sweeps what
the group's processes had mapped once none of them is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")
SHM_DIR = Path("/dev/shm")
# What vLLM and Python's multiprocessing name their segments; a kvxfer engine's own
# (kvxfer-*) are its sidecar's and its fleet's to clean, never swept here.
SWEPT_PREFIXES = ("psm_", "sem.mp-")
TRACKER = b"multiprocessing.resource_tracker"  # in its command line
DELETED = " (deleted)"  # how /proc/<pid>/maps marks a mapped file that was unlinked
POLL_S = 0.05  # a scan of /proc takes a few ms here


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies included until reaped)."""
    return list(_states(pgid))


def _states(pgid: int) -> dict[int, str]:
    """Each process of group `pgid` and its state letter (Z: a zombie), from one read
    of its /proc/<pid>/stat."""
    states = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            # The command name is in parentheses and may hold spaces: fields after it
            # are state, ppid, pgrp.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            states[int(stat.parent.name)] = fields[0]
    return states


def shm_mapped_by(pids: list[int]) -> set[str]:
    """Names of the /dev/shm segments of `SWEPT_PREFIXES` that `pids` map now (not the
    ones already unlinked: their memory goes with the last mapping)."""
    names = set()
    for pid in pids:
        try:
            maps = (PROC / str(pid) / "maps").read_text()
        except OSError:
            continue  # gone, or not ours to read
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5:]
            if not path or not path[0].startswith(f"{SHM_DIR}/") or path[0].endswith(DELETED):
                continue
            name = path[0].removeprefix(f"{SHM_DIR}/")
            if name.startswith(SWEPT_PREFIXES):
                names.add(name)
    return names


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for every process of the group to exit; True if none is left.
    Zombies count as gone: their memory is released."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not _live(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def kill_group(pgid: int, tracker_s: float = 2.0) -> bool:
    """SIGKILL the group, its resource tracker last: killed first, the others leave the
    tracker to unlink what they registered, which it does within `tracker_s` (it exits
    once their ends of its pipe are closed). True once no process of it is left."""
    deadline = time.monotonic() + tracker_s
    while others := [pid for pid in _live(pgid) if not _tracker(pid)]:
        for pid in others:  # a process forked meanwhile is killed on the next pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if wait_group_gone(pgid, max(deadline - time.monotonic(), 0.0)):
        return True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return wait_group_gone(pgid, 5.0)


def sweep(names: set[str]) -> list[str]:
    """Unlink `names` from /dev/shm (call once the processes that mapped them are gone);
    the ones unlinked, the rest were already."""
    swept = []
    for name in sorted(names):
        try:
            os.unlink(SHM_DIR / name)
        except FileNotFoundError:
            continue
        except OSError as exc:  # another user's, say: /dev/shm is sticky
            log.warning("cannot remove /dev/shm/%s: %s", name, exc)
            continue
        swept.append(name)
    return swept


def _live(pgid: int) -> list[int]:
    return [pid for pid, state in _states(pgid).items() if state != "Z"]


def _tracker(pid: int) -> bool:
    try:
        return TRACKER in (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
