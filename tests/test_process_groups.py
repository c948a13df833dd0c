"""An engine's process group and the shared memory it leaves (kvxfer/integrations/
process_groups.py), on real process groups that create segments as vLLM does:
through `multiprocessing.shared_memory`, which Python's resource tracker (a process
of the same group) unlinks once every user is gone, unless it is killed with them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer.integrations import process_groups

# A group leader that creates a segment the way vLLM's message queues do, and a child of
# its group that maps it too; it exits cleanly (unlinking nothing itself: the tracker
# must) once its stdin closes.
LEADER = """
import subprocess, sys
from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 16)
child = subprocess.Popen([sys.executable, "-c",
    "import mmap, sys; f = open('/dev/shm/' + sys.argv[1], 'r+b'); "
    "m = mmap.mmap(f.fileno(), 0); sys.stdin.read()", segment.name],
    stdin=subprocess.PIPE)
print(segment.name, flush=True)
sys.stdin.read()
child.stdin.close()
child.wait()
segment.close()
"""


@pytest.fixture
def group() -> Iterator[tuple[subprocess.Popen[str], str]]:
    with subprocess.Popen(
        [sys.executable, "-c", LEADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as leader:  # fmt: skip
        assert leader.stdout is not None
        name = leader.stdout.readline().strip()
        try:
            yield leader, name
        finally:
            if leader.poll() is None:
                os.killpg(leader.pid, signal.SIGKILL)
                leader.wait()
            process_groups.wait_group_gone(leader.pid, 10)
            (Path("/dev/shm") / name).unlink(missing_ok=True)


def _mapped_soon(pgid: int, name: str) -> set[str]:
    """What the group maps once its child has opened the segment too."""
    for _ in range(100):
        pids = process_groups.group_pids(pgid)
        mapped = {pid for pid in pids if name in process_groups.shm_mapped_by([pid])}
        if len(mapped) >= 2:
            break
        process_groups.wait_group_gone(pgid, 0.05)
    return process_groups.shm_mapped_by(process_groups.group_pids(pgid))


def test_a_group_killed_whole_leaves_its_segment_and_the_sweep_takes_it(
    group: tuple[subprocess.Popen[str], str],
) -> None:
    leader, name = group
    assert name.startswith("psm_")
    assert _mapped_soon(leader.pid, name) == {name}
    assert len(process_groups.group_pids(leader.pid)) == 3  # leader, child, tracker
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()
    assert process_groups.wait_group_gone(leader.pid, 10)
    assert (Path("/dev/shm") / name).exists()  # the tracker died with the group
    assert process_groups.sweep({name}) == [name]
    assert not (Path("/dev/shm") / name).exists()
    assert process_groups.sweep({name}) == []


def test_killing_the_group_tracker_last_lets_it_unlink_the_segment(
    group: tuple[subprocess.Popen[str], str],
) -> None:
    """`VllmWorker.kill`: the same crash, but the tracker outlives the others long
    enough to unlink what they registered; nothing is left to sweep."""
    leader, name = group
    assert _mapped_soon(leader.pid, name) == {name}
    assert process_groups.kill_group(leader.pid)
    assert leader.wait(10) == -signal.SIGKILL
    assert process_groups.wait_group_gone(leader.pid, 0)  # zombies at most, till reaped
    assert not (Path("/dev/shm") / name).exists()


def test_a_group_left_to_quit_cleans_up_by_itself(group: tuple[subprocess.Popen[str], str]) -> None:
    """What `VllmWorker.close` waits for before it signals the group: with the leader
    gone, the tracker unlinks the segment once the child is gone too."""
    leader, name = group
    assert _mapped_soon(leader.pid, name) == {name}
    assert leader.stdin is not None
    leader.stdin.close()
    assert leader.wait(10) == 0
    assert process_groups.wait_group_gone(leader.pid, 10)
    assert not (Path("/dev/shm") / name).exists()


def test_a_group_still_running_is_not_gone(group: tuple[subprocess.Popen[str], str]) -> None:
    leader, _ = group
    assert leader.pid in process_groups.group_pids(leader.pid)
    assert not process_groups.wait_group_gone(leader.pid, 0.2)
    assert process_groups.group_pids(2**22 + 7) == []  # above any pid_max: no such group
