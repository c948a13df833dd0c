"""kvxfer's connector as a child of vLLM's MultiConnector, beside an offloading connector.

The real tier runs a prefill and a decode vLLM, both configured with
MultiConnector([kvxfer, OffloadingConnector]) (vLLM's own offloading connector
with kvxfer's host-copy spec; the in-tree specs need a GPU), and checks
(`vllm_compose.run_composed_pd`): decode tokens equal the single-instance
run's; each kvxfer pull moves the token oracle's exact minimum; the
offloading child serves the prefill every prompt's prefix once the engines
dropped their own caches (a dead child fails this); and on the decode the
child listed first with a hit loads a repeated prompt, the other standing
aside without changing the output. Llama runs kvxfer first, Gemma3 (sliding
window + full, B = 32) the offloading connector first.

The unit part checks the side channel that carries the worker's registration
to the scheduler when a MultiConnector sibling owns vLLM's handshake channel,
and the config builders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import vllm_background
from vllm_background import CASES
from vllm_harness import oracle_pull_bytes

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.fleet import Fleet
from kvxfer.integrations import vllm_compose, vllm_fleet
from kvxfer.integrations.vllm_params import (
    handshake_path,
    read_handshake,
    remove_handshake,
    write_handshake,
)


# ---- unit: the registration side channel and the config builders --------------------
def test_the_registration_file_round_trips_and_names_a_safe_path(tmp_path: Path) -> None:
    path = handshake_path("engine/../../etc", directory=str(tmp_path))
    assert Path(path).parent == tmp_path and "/" not in Path(path).name
    assert read_handshake(path) is None  # nothing yet: the scheduler keeps waiting
    record = {"engine_id": "e-1", "epoch": 7, "peer_address": "127.0.0.1:5", "extra": 1}
    write_handshake(path, record)
    assert read_handshake(path) == {"engine_id": "e-1", "epoch": 7, "peer_address": "127.0.0.1:5"}
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert handshake_path("a", directory=str(tmp_path)) != handshake_path("b", directory="x")


def test_a_registration_file_others_may_write_or_missing_a_field_is_refused(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "h.json")
    write_handshake(path, {"engine_id": "e", "epoch": 1, "peer_address": "p"})
    os.chmod(path, 0o622)
    with pytest.raises(InvalidInputError, match="writable by others"):
        read_handshake(path)
    Path(path).write_text(json.dumps({"engine_id": "e", "epoch": "1", "peer_address": "p"}))
    os.chmod(path, 0o600)
    with pytest.raises(InvalidInputError, match=r"\.epoch: missing or not int"):
        read_handshake(path)


def _written_by_a_worker_that_is_gone(path: str) -> None:
    """`path` written by another process that has exited since (as if killed)."""
    code = (
        "import sys; from kvxfer.integrations.vllm_params import write_handshake as w; "
        "w(sys.argv[1], {'engine_id': 'gone', 'epoch': 1, 'peer_address': 'p'})"
    )
    subprocess.run([sys.executable, "-c", code, path], check=True)


def test_a_registration_whose_worker_is_gone_is_none_and_its_successor_replaces_it(
    tmp_path: Path,
) -> None:
    path = handshake_path("killed-engine", directory=str(tmp_path))
    _written_by_a_worker_that_is_gone(path)
    assert json.loads(Path(path).read_text())["pid"] != os.getpid()
    assert read_handshake(path) is None  # its worker is gone: no registration yet
    remove_handshake(path)  # not this process's: left to the worker that replaces it
    assert Path(path).exists()
    Path(f"{path}.{os.getpid()}.tmp").write_text("{")  # a killed writer had this pid
    write_handshake(path, {"engine_id": "e-2", "epoch": 3, "peer_address": "127.0.0.1:6"})
    assert read_handshake(path) == {"engine_id": "e-2", "epoch": 3, "peer_address": "127.0.0.1:6"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(path).name]
    remove_handshake(path)  # this process's own: removed at close
    assert not Path(path).exists()


def test_a_registration_that_is_no_regular_file_or_names_no_usable_pid_is_refused(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "h.json")
    for pid, match in (("7", "pid: missing or not int"), (True, "pid: missing or not int"),
                       (0, "pid: must be positive")):  # fmt: skip
        Path(path).write_text(
            json.dumps({"engine_id": "e", "epoch": 1, "peer_address": "p", "pid": pid})
        )
        os.chmod(path, 0o600)
        with pytest.raises(InvalidInputError, match=match):
            read_handshake(path)
    fifo = str(tmp_path / "planted.json")
    os.mkfifo(fifo, 0o600)  # would block a plain open for ever: nobody writes to it
    with pytest.raises(InvalidInputError, match="not a regular file"):
        read_handshake(fifo)
    planted = tmp_path / "dir.json"
    planted.mkdir()  # a directory opens, but must not leak its descriptor when refused
    open_fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(InvalidInputError, match="not a regular file"):
            read_handshake(str(planted))
        remove_handshake(str(planted))
    assert len(os.listdir("/proc/self/fd")) == open_fds and planted.is_dir()
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(InvalidInputError, match="cannot be opened"):
        read_handshake(str(link))  # never followed (O_NOFOLLOW): the scheduler's error


def test_multiconnector_configs_keep_the_order_role_and_recompute_policy() -> None:
    prefill, decode = vllm_compose.composed_configs(
        "unix:/p", "unix:/d", Path("/s.jsonl"), "offload-first"
    )
    assert decode["kv_connector"] == "MultiConnector"
    assert decode["kv_role"] == "kv_consumer" and prefill["kv_role"] == "kv_producer"
    assert decode["kv_load_failure_policy"] == "recompute"  # vLLM reads only the top level
    children = decode["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["OffloadingConnector", "KvxferConnector"]
    with pytest.raises(InvalidInputError, match="order"):
        vllm_compose.composed_configs("unix:/p", "unix:/d", Path("/s"), "sideways")
    with pytest.raises(InvalidInputError, match="connectors"):
        vllm_fleet.multi_connector_config([])
    with pytest.raises(InvalidInputError, match="cpu_bytes_to_use"):
        vllm_fleet.host_offload_connector_config(0)


def test_a_stuck_reset_says_what_the_prefill_sidecar_holds(tmp_path: Path) -> None:
    """The harness's error when a prefill keeps its blocks: the sidecar's lease and
    event counters (a real sidecar), or why they could not be read."""
    fleet = Fleet(tmp_path)
    try:
        said = vllm_compose._lease_samples(fleet.sidecar("p").ready["metrics_address"])
    finally:
        fleet.close()
    assert "kvxfer_active_leases 0.0" in said and "kvxfer_expired_leases_total 0.0" in said
    assert "kvxfer_events_dropped_total 0.0" in said and "_created" not in said
    assert "scrape of 127.0.0.1:9 failed" in vllm_compose._lease_samples("127.0.0.1:9")


# ---- real vLLM processes ------------------------------------------------------------
@pytest.fixture(scope="module")
def reports() -> dict[str, Future[Any]]:
    """Both cases' reports (vllm_background.composed, started at collection); a test
    waits for its own."""
    return vllm_background.futures("test_vllm_multiconnector.py")


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("family", "block_size", "order"), CASES)
def test_kvxfer_beside_an_offloading_connector_in_a_multiconnector(
    family: str, block_size: int | None, order: str, reports: dict[str, Future[Any]]
) -> None:
    report = reports[order].result()
    routed, again = report["routed"], report["repeat"]
    # 1. P/D through the MultiConnector: the single instance's tokens, exact bytes.
    assert report["matched"] == report["requests"] == len(vllm_background.COMPOSED_PROMPTS) + 1, (
        report
    )
    _assert_exact_pulls(report)
    # 2. The offloading child is alive: it served the prefill every prompt's prefix.
    assert all(r["prefill_load_bytes"] > 0 for r in routed), routed
    assert all(r["decode_load_bytes"] == 0 for r in routed), routed  # kvxfer pulled those
    # 3. Routing on the decode: the first child with a hit loads the repeated prompt.
    pulls = report["pulls"]
    if order == "kvxfer-first":
        assert len(pulls) == 3 and again["decode_load_bytes"] == 0, report
    else:  # the offloading child's own copy wins; kvxfer only lets the prefill release
        assert len(pulls) == 2 and again["decode_load_bytes"] > 0, report


def _assert_exact_pulls(report: dict[str, Any]) -> None:
    layout = report["layout"]
    for pull in report["pulls"]:
        assert pull["status"] == "ok", pull
        minimum = oracle_pull_bytes(layout, pull["num_tokens"], pull["computed_tokens"])
        assert pull["bytes_moved"] == pull["bytes_planned"] == minimum, pull
