"""What an engine's event watch sees when its sidecar is gone, on a real sidecar: the
vLLM connector's worker (`_watch`) fails its waiting pulls and releases its
publications on exactly these two errors, and watches again on any other end.

- A sidecar that does not know the engine (it restarted, and the engine's memory
  was registered with the one before): NotFoundError.
- A sidecar that is no longer there: PeerUnavailableError, at once, not at a deadline;
  a call that could not connect is a LaneUnreachableError (nothing of it was sent).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from sidecars import start_engine, start_sidecar

from kvxfer._exceptions import LaneUnreachableError, NotFoundError, PeerUnavailableError
from kvxfer.client.engine import SyncEngineClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_the_watch_of_a_gone_sidecar_ends_in_the_two_errors_the_worker_acts_on(
    tmp_path: Path,
) -> None:
    p = start_sidecar(tmp_path, "p")
    address = p.ready["engine_address"]
    try:
        pe = start_engine(tmp_path, p, "gpt-oss-20b", "prefill", num_blocks=8)
        engine_id = pe.engine_id
        pe.stop()  # unregistered: the sidecar no longer knows it, as after a restart
        for gone in ("engine-of-a-sidecar-before", engine_id):
            stranger = SyncEngineClient(address, engine_id=gone)
            try:
                with pytest.raises(NotFoundError):
                    next(iter(stranger.events(timeout_s=10)))
            finally:
                stranger.close()
        # A client that used the sidecar before it died, as a worker's has.
        known = SyncEngineClient(address, engine_id=engine_id, connect_timeout_s=0.5)
        try:
            with pytest.raises(NotFoundError):
                known.abort("r-0")
            p.stop(signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(PeerUnavailableError):
                next(iter(known.events(timeout_s=10)))
            assert time.monotonic() - started < 5
            # Nobody takes the connection again: nothing of the call was sent, and it
            # says so (the worker then knows the sidecar took no pull of it).
            with pytest.raises(LaneUnreachableError, match="no engine lane"):
                known.abort("r-1")
        finally:
            known.close()
    finally:
        p.stop()
