"""What one process tree started and left behind, told apart from every other kvxfer run.

Other kvxfer runs share this machine, so a machine-wide `pgrep` or a listing
of /dev/shm sees their processes and segments too. A driver started with
`start_new_session=True` gives its whole tree one session id (its pid): the
fleet's children stay in it even once orphaned. `SessionWatch` samples that
session from /proc while the driver runs, remembering every pid it saw;
afterwards the leftovers are the processes still in the session and the
/dev/shm segments named after one of those pids (engine-sims name their
segments `kvxfer-<role>-<pid>-<random>-g<group>`, see kvxfer/client/shm.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

from kvxfer.client.shm import segment_creator

SHM_DIR = Path("/dev/shm")


def session_of(pid: int) -> int | None:
    """The session id of a live process, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesized command: state, ppid, pgrp, session, ...
    return int(stat.rpartition(")")[2].split()[3])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def in_session(sid: int) -> dict[int, str]:
    """{pid: command line} of every live process in session `sid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and session_of(int(entry.name)) == sid:
            found[int(entry.name)] = cmdline(int(entry.name))
    return found


class SessionWatch:
    """Samples the processes of session `sid` in a background thread until `stop()`."""

    def __init__(self, sid: int, interval_s: float = 0.05) -> None:
        self.sid = sid
        self.seen: dict[int, str] = {}
        # A segment left by an earlier run may be named after a pid this session's
        # processes reuse (seen in CI, a segment of 4 hours before): never counted.
        self._before = {entry.name for entry in SHM_DIR.iterdir()}
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._sample()
            self._stopped.wait(self._interval_s)

    def _sample(self) -> None:
        for pid, argv in in_session(self.sid).items():
            # A zombie's command line reads empty: keep what the live process showed.
            if argv or pid not in self.seen:
                self.seen[pid] = argv

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self._sample()

    def running(self) -> dict[int, str]:
        """Processes of the session alive now (the driver itself excluded once reaped)."""
        return in_session(self.sid)

    def segments(self) -> set[str]:
        """Segments in /dev/shm created by a process this watch saw (not there before)."""
        return {
            entry.name
            for entry in SHM_DIR.iterdir()
            if segment_creator(entry.name) in self.seen and entry.name not in self._before
        }
