"""The vLLM harness without a running engine: tiny-model configs, CLI input errors,
prompts and comparison helpers, and how the fleet fails (bounded waits, nothing left)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_harness import vllm_python

from kvxfer._exceptions import InvalidInputError
from kvxfer.integrations import process_groups, vllm_fleet, vllm_stream
from kvxfer.integrations.tiny_models import (
    DEFAULT_SLIDING_WINDOW,
    FAMILIES,
    TinyModelSpec,
    config_kwargs,
)
from kvxfer.integrations.vllm_demo import DemoOptions, read_pulls

CLI = Path(sys.prefix) / "bin" / "kvxfer-cli"


def test_every_family_has_a_small_config_with_its_layer_kinds() -> None:
    kinds = {}
    for family in FAMILIES:
        _, kwargs = config_kwargs(TinyModelSpec(family))
        assert kwargs["hidden_size"] <= 256 and kwargs["vocab_size"] <= 4096, family
        kinds[family] = set(kwargs.get("layer_types", ["full_attention"]))
    assert kinds["llama"] == {"full_attention"}
    assert kinds["gemma3"] == kinds["gpt-oss"] == {"sliding_attention", "full_attention"}
    assert kinds["qwen3-next"] == {"linear_attention", "full_attention"}
    # The default window ends inside a block for every block size vLLM-CPU accepts.
    assert DEFAULT_SLIDING_WINDOW % 32 != 0


def test_window_and_layers_reach_the_config() -> None:
    _, kwargs = config_kwargs(TinyModelSpec("gemma3", layers=5, sliding_window=48))
    assert kwargs["sliding_window"] == 48 and kwargs["num_hidden_layers"] == 5
    assert len(kwargs["layer_types"]) == 5 and kwargs["layer_types"][-1] == "full_attention"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(family="mamba"), "family"),
        (dict(family="llama", layers=0), "layers"),
        (dict(family="llama", sliding_window=64), "sliding_window"),
        (dict(family="gemma3", sliding_window=0), "sliding_window"),
    ],
)
def test_bad_tiny_model_specs_name_the_field(spec: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        TinyModelSpec(**spec)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_cli_tiny_model_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "m"
    bad_window = subprocess.run(
        [str(CLI), "tiny-model", "--family", "llama", "--out", str(out), "--sliding-window", "8"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad_window.returncode == 2  # bad input (docs/cli.md)
    assert bad_window.stderr.strip() == (
        "kvxfer-cli: error: --sliding-window: family 'llama' has no sliding window"
    )
    bad_family = subprocess.run(
        [str(CLI), "tiny-model", "--family", "jamba", "--out", str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad_family.returncode == 2 and "--family" in bad_family.stderr
    assert not out.exists()


def test_random_prompts_are_reproducible_and_in_range() -> None:
    prompts = vllm_fleet.random_prompts(5, 10, 20, 100, seed=3)
    assert prompts == vllm_fleet.random_prompts(5, 10, 20, 100, seed=3)
    assert prompts != vllm_fleet.random_prompts(5, 10, 20, 100, seed=4)
    assert all(10 <= len(p) <= 20 and all(3 <= t < 100 for t in p) for p in prompts)


def test_first_divergence() -> None:
    assert vllm_fleet.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert vllm_fleet.first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert vllm_fleet.first_divergence([1, 2], [1, 2, 3]) == 2


def test_kvxfer_connector_config_is_what_vllm_loads() -> None:
    config = vllm_fleet.kvxfer_connector_config("kv_consumer", "unix:/tmp/d.sock", stats_path="s")
    assert config["kv_connector_module_path"] == "kvxfer.integrations.vllm"
    assert config["kv_connector_extra_config"] == {"sidecar": "unix:/tmp/d.sock", "stats_path": "s"}
    with pytest.raises(ValueError, match="kv_both"):
        vllm_fleet.kvxfer_connector_config("kv_both", "unix:/tmp/d.sock")


def test_a_worker_that_cannot_start_fails_with_its_log(tmp_path: Path) -> None:
    # kvxfer's own venv has no vLLM: the worker dies on import, and the error says so.
    spec = vllm_fleet.EngineSpec(tmp_path / "no-model")
    worker = vllm_fleet.VllmWorker("no-vllm", spec, Path(sys.executable), tmp_path)
    rpc_dir = worker.rpc_dir
    assert rpc_dir is not None and rpc_dir.is_dir()
    try:
        with pytest.raises(vllm_fleet.VllmWorkerError, match=r"(?s)exited with code 1.*vllm"):
            worker.wait_ready(timeout_s=60)
    finally:
        worker.close()
    assert not rpc_dir.exists()


def test_a_socket_directory_the_caller_chose_is_used_and_kept(tmp_path: Path) -> None:
    chosen = tmp_path / "rpc"
    chosen.mkdir()
    spec = vllm_fleet.EngineSpec(tmp_path / "no-model", env={vllm_fleet.RPC_BASE_ENV: str(chosen)})
    worker = vllm_fleet.VllmWorker("no-vllm", spec, Path(sys.executable), tmp_path)
    assert worker.rpc_dir is None
    worker.close()
    assert chosen.is_dir()


def _tiny_llama(tmp_path: Path) -> Path:
    model = tmp_path / "llama"
    subprocess.run(
        [str(vllm_python()), "-m", "kvxfer.cli.main", "tiny-model", "--family", "llama",
         "--out", str(model)],
        cwd=tmp_path, capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    return model


@pytest.mark.vllm
def test_a_worker_that_does_not_answer_in_time_is_stopped_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real model: loading takes longer than the worker's stop timeout, so it is still
    # loading (deaf to "quit") when closed, and only the process-group kill stops it.
    # A 1 s stop timeout keeps it so by a wider margin, and `close` waits 1 s for the quit
    # and 1 s after SIGTERM, not 10 each.
    monkeypatch.setattr(vllm_fleet, "STOP_TIMEOUT_S", 1.0)
    model = _tiny_llama(tmp_path)
    worker = vllm_fleet.VllmWorker("slow", vllm_fleet.EngineSpec(model), vllm_python(), tmp_path)
    group = worker._popen.pid
    try:
        with pytest.raises(vllm_fleet.VllmWorkerError, match="did not answer start within 2 s"):
            worker.wait_ready(timeout_s=2)
    finally:
        worker.close()
    # SIGKILLed children take a moment to tear down their memory before they are gone.
    assert process_groups.wait_group_gone(group, 15)


@pytest.mark.vllm
def test_a_killed_engine_leaves_no_shared_memory_or_sockets_behind(tmp_path: Path) -> None:
    """vLLM's message queues are 160 MiB /dev/shm segments its resource tracker unlinks;
    killed with the rest of the group, the tracker never would (this fails so): the
    worker kills it last, and sweeps what the group mapped."""
    model = _tiny_llama(tmp_path)
    worker = vllm_fleet.VllmWorker("killed", vllm_fleet.EngineSpec(model), vllm_python(), tmp_path)
    rpc_dir = worker.rpc_dir
    assert rpc_dir is not None
    try:
        worker.wait_ready()
        segments = worker.segments
        assert any(name.startswith("psm_") for name in segments), segments
        assert all((Path("/dev/shm") / name).exists() for name in segments)
        # vLLM's ZMQ sockets, which it never unlinks, are in the engine's own directory.
        assert [path for path in rpc_dir.iterdir() if path.is_socket()]
    finally:
        code = worker.kill()
    assert not [name for name in segments if (Path("/dev/shm") / name).exists()]
    assert not rpc_dir.exists()
    assert code == -signal.SIGKILL
    assert worker.close() == code  # stopped: nothing signalled or swept again


def test_side_channel_ports_are_outside_the_ephemeral_range_and_never_repeat() -> None:
    """vLLM binds its NIXL side channel seconds after the port is chosen: a port from the
    ephemeral range could be taken by any connection meanwhile (a CI hang), so the
    harness picks below that range, and never hands out one port twice."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [vllm_fleet.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low for p in ports), (low, sorted(ports)[-3:])


def test_stream_finds_nixl_transfer_durations_in_connector_stats() -> None:
    # What vLLM's scheduler sends per step: NixlConnector's stats dict, or a
    # MultiConnector's, one level down per child; other lists are not durations.
    single = {"transfer_duration": [0.001, 0.002], "post_duration": [0.5], "num_failed": 0}
    multi = {"NixlConnector": single, "KvxferConnector": {"bytes": [9]}}
    assert vllm_stream._transfer_durations(single) == [0.001, 0.002]
    assert vllm_stream._transfer_durations(multi) == [0.001, 0.002]
    assert vllm_stream._transfer_durations(None) == []


def test_demo_block_sizes_default_to_the_family_or_are_both_given() -> None:
    assert DemoOptions("gemma3").block_sizes == (32, 32)
    assert DemoOptions("llama").block_sizes == (None, None)  # vLLM's default
    options = DemoOptions("gemma3", decode_block_size=128)
    assert options.block_sizes == (32, 128) and options.dtype == "float32"
    assert DemoOptions("gemma3", decode_block_size=32).dtype == "bfloat16"
    assert DemoOptions("gemma3", prefill_block_size=64, decode_block_size=32).dtype == "float32"
    # Sizes that do not nest are staged (vllm_reblock), not refused.
    assert DemoOptions("gemma3", prefill_block_size=64, decode_block_size=96).block_sizes == (
        64, 96)  # fmt: skip
    with pytest.raises(InvalidInputError, match="give --prefill-block-size") as caught:
        DemoOptions("llama", decode_block_size=64)
    assert caught.value.field == "--decode-block-size"


PROBE = """
import os, sys
from pathlib import Path
from kvxfer.integrations.vllm_worker import keep_niceness_in_own_session
os.nice(int(sys.argv[1]))
keep_niceness_in_own_session()
print(os.getpriority(os.PRIO_PROCESS, 0))
print(Path("/proc/self/autogroup").read_text().strip())
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroup here")
@pytest.mark.parametrize("nice", [10, 0])
def test_a_niced_engine_in_its_own_session_nices_its_session(nice: int) -> None:
    """Autogroup gives each session a CPU share at the group's niceness, whatever its
    processes' niceness: a niced engine (its own session leader) sets it, so it yields
    to un-niced work in other sessions."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(nice)],
        capture_output=True, text=True, timeout=60, start_new_session=True, check=True,
    )  # fmt: skip
    niceness, group = done.stdout.splitlines()
    assert group.endswith(f" nice {niceness}"), done  # the caller may be niced already


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroup here")
def test_a_worker_in_another_session_leaves_that_sessions_group_alone() -> None:
    """Run in another's session (a shell's, or the tests'), the worker is not its
    session's leader and leaves the group as it was. That group may be the root one,
    which shows nothing (a container's first session): compare, do not parse."""
    before = Path("/proc/self/autogroup").read_text().strip()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "10"], capture_output=True, text=True, timeout=60, check=True
    )
    group = done.stdout.splitlines()[1:] or [""]
    assert group[0] == before == Path("/proc/self/autogroup").read_text().strip(), done


def test_pulls_are_read_with_their_plans_whichever_line_came_first(tmp_path: Path) -> None:
    """The connector does not wait for Pull's answer: its plan line may follow its
    PullDone's. Two TP ranks' pulls of one request, one in each order."""
    done = {"request_id": "r", "failed_blocks": {"0": [3]}, "valid_tokens": 48,
            "duration_s": 0.002}  # fmt: skip
    lines = [
        {"finished_sending": ["x"], "tp_rank": 0},
        {**done, "pull_id": "r-0", "bytes_moved": 100, "tp_rank": 0},
        {
            "request_id": "r",
            "pull_id": "r-0",
            "bytes_planned": 120,
            "full_attention_bytes": 300,
            "tp_rank": 0,
        },
        {
            "request_id": "r",
            "pull_id": "r-1",
            "bytes_planned": 80,
            "full_attention_bytes": 200,
            "tp_rank": 1,
        },
        {**done, "pull_id": "r-1", "bytes_moved": 80, "tp_rank": 1, "valid_tokens": 64},
        # The same pull id again later (another run in the same file): its own plan.
        {**done, "request_id": "s", "pull_id": "r-0", "bytes_moved": 5, "tp_rank": 0},
        {"request_id": "s", "pull_id": "r-0", "bytes_planned": 7, "full_attention_bytes": 9},
    ]
    stats = tmp_path / "stats.jsonl"
    stats.write_text("".join(json.dumps(line) + "\n" for line in lines))
    row, again = read_pulls(stats)
    assert (again["request_id"], again["bytes_planned"], again["full_attention_bytes"]) == (
        "s",
        7,
        9,
    )
    assert (row["bytes_moved"], row["bytes_planned"], row["full_attention_bytes"]) == (
        180,
        200,
        500,
    )
    assert row["pulls"] == 2 and row["failed"] == 2 and row["valid_tokens"] == 48
