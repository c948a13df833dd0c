"""The serving agent's child starts without running the sidecar's fork handlers.

A fork() from the sidecar runs every pthread_atfork handler in the child before exec;
under uvloop, whose spawn forks, its own after-fork handler unmapped memory through
UCX's hooked munmap, which took a spinlock another thread held: the child spun forever
before exec and the sidecar hung replacing a crashed serving agent (found in
tests/test_multihost.py). Here a child handler that aborts is installed in a fresh
process; a serving agent started on either loop must still come up, answer, and close.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.nixl]

SCRIPT = textwrap.dedent(
    """
    import asyncio, ctypes, sys
    from kvxfer.dataplane.serving import ServingAgent
    from kvxfer.wire.loops import loop_name, run

    # Any fork() from here on kills its child before exec (SIGABRT). glibc exports
    # pthread_atfork's implementation as __register_atfork (the last argument: no DSO).
    libc = ctypes.CDLL(None)
    abort = ctypes.cast(libc.abort, ctypes.c_void_p)
    assert libc.__register_atfork(None, None, abort, None) == 0

    async def main() -> None:
        agent = ServingAgent("spawn-test")
        await agent.start()
        metadata, _ = await agent.served([])
        assert metadata, "no agent metadata"
        pid = agent.pid
        await agent.close()
        print(loop_name(asyncio.get_running_loop()), pid, agent.pid)

    run(main(), sys.argv[1])
    """
)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_serving_agent_starts_without_fork_handlers(loop: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, loop],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    name, pid, after = done.stdout.split()
    assert name == loop
    assert int(pid) > 0 and after == "None"
