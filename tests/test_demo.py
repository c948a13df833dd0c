"""`kvxfer-cli demo` and `kvxfer-cli bench` as a user runs them: real processes, real
NIXL; they verify, report, and leave no process or shared-memory segment behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from oracle import oracle_valid_tokens
from session_watch import SessionWatch, cmdline

from kvxfer.cli.fleet import BIN, SHM_DIR, unlink_segments_of
from kvxfer.core.profiles import layout_for_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CLI = str(BIN / "kvxfer-cli")


class Demos:
    """Starts `kvxfer-cli demo` runs, each in its own session watched from /proc, so
    that what a run leaves behind is told apart from other kvxfer runs on the machine."""

    def __init__(self, tmp: Path) -> None:
        self.watches: list[SessionWatch] = []
        self.tmp = tmp  # TMPDIR of every run: logs a failing run keeps stay in the test's dir

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        demo = subprocess.Popen(
            [CLI, "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own session and process group, as a terminal gives
            env={**os.environ, "TMPDIR": str(self.tmp), **(env or {})},
        )
        self.watches.append(SessionWatch(demo.pid))
        return demo

    def run(
        self, *args: str, timeout: float = 180, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        demo = self.start(*args, "--json", env=env)
        try:
            stdout, stderr = demo.communicate(timeout=timeout)
        finally:
            _kill(demo)
        return subprocess.CompletedProcess(demo.args, demo.returncode, stdout, stderr)

    def check_leftovers(self) -> None:
        for watch in self.watches:
            deadline = time.monotonic() + 10
            while watch.running() and time.monotonic() < deadline:
                time.sleep(0.2)
            watch.stop()
            assert any("engine-sim" in argv for argv in watch.seen.values()), (
                f"never saw the demo's engine-sims, so nothing was checked: {watch.seen}"
            )
            assert not watch.running(), f"the demo left processes running: {watch.running()}"
            assert not watch.segments(), f"the demo left shared memory: {watch.segments()}"


def _kill(demo: subprocess.Popen[str]) -> None:
    if demo.poll() is None:
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()


@pytest.fixture
def demos(tmp_path: Path) -> Iterator[Demos]:
    """Demo runs whose own processes and segments must all be gone afterwards."""
    runs = Demos(tmp_path)
    yield runs
    runs.check_leftovers()


def test_demo_moves_exactly_the_minimum_and_verifies_every_request(demos: Demos) -> None:
    result = demos.run("--requests", "6", "--tokens-range", "200:3000", "--prefix-hit-rate", "0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["model"] == "gpt-oss-20b" and report["requests"] == 6
    assert report["verified_requests"] == 6 and report["untouched_bytes_verified"] is True
    assert report["bytes_moved"] == report["bytes_exact_minimum"] > 0
    assert report["full_attention_bytes"] > report["bytes_moved"]
    assert report["failed_blocks"] == 0 and report["throughput_gbps"] > 0
    assert set(report["pull_latency_ms"]) == {"p50", "p99"} and report["handshake_ms"] > 0
    rows = report["per_request"]
    assert any(r["computed_tokens"] for r in rows), "seed 0 draws at least one prefix hit"
    for row in rows:
        assert row["status"] == "ok" and row["failed_blocks"] == {}
        assert row["valid_tokens"] == row["tokens"]
    assert sum(r["bytes_moved"] for r in rows) == report["bytes_moved"]


def test_demo_with_injected_failures_reports_what_the_recompute_rule_says(demos: Demos) -> None:
    result = demos.run("--requests", "6", "--tokens-range", "1000:4000", "--fail-rate", "0.2",
                       "--seed", "3")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["failed_blocks"] > 0
    assert report["verified_requests"] == 6
    assert report["bytes_moved"] < report["bytes_exact_minimum"]
    layout = layout_for_model("gpt-oss-20b")
    plan = subprocess.run(
        [CLI, "plan", "--model", "gpt-oss-20b", "--tokens", "100", "--json"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    num_groups = len(json.loads(plan.stdout)["groups"])
    for row in report["per_request"]:
        failed = {int(g): blocks for g, blocks in row["failed_blocks"].items()}
        assert set(failed) <= set(range(num_groups))
        want = oracle_valid_tokens(layout.groups, row["tokens"], row["computed_tokens"], 16, failed)
        assert row["valid_tokens"] == want
        if not failed:
            assert row["status"] == "ok"
        else:  # the executor's rule: partial when something beyond the hit is usable
            assert row["status"] == ("partial" if want > row["computed_tokens"] else "failed")
        assert row["problems"] == []


LLAMA4_CHUNK_256 = str(Path(__file__).parent / "data" / "llama4-text-chunk-256.json")


@pytest.mark.parametrize(
    ("model", "kinds"),
    [("deepseek-v2-lite", ["mla"]), (LLAMA4_CHUNK_256, ["chunked_local", "full_attention"])],
)
def test_demo_pulls_mla_and_chunked_models_byte_for_byte(
    demos: Demos, model: str, kinds: list[str]
) -> None:
    """The simulated demo on an MLA model and a chunked-local model: clean pulls move the
    exact minimum (chunked: far less than full attention), and with chunk failures
    injected every valid_tokens is the oracle's."""
    common = ("--model", model, "--requests", "6", "--tokens-range", "200:3000",
              "--prefix-hit-rate", "0.5")  # fmt: skip
    report = json.loads(demos.run(*common).stdout)
    assert [g["kind"] for g in report["per_group"]] == kinds
    assert report["verified_requests"] == 6 and report["untouched_bytes_verified"] is True
    assert report["bytes_moved"] == report["bytes_exact_minimum"] > 0
    if "chunked_local" in kinds:
        assert report["full_attention_bytes"] > 2 * report["bytes_moved"]
    result = demos.run(*common, "--fail-rate", "0.3", "--seed", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["failed_blocks"] > 0 and report["verified_requests"] == 6
    layout = layout_for_model(model)
    for row in report["per_request"]:
        failed = {int(g): blocks for g, blocks in row["failed_blocks"].items()}
        want = oracle_valid_tokens(layout.groups, row["tokens"], row["computed_tokens"], 16, failed)
        assert row["valid_tokens"] == want and row["problems"] == []


def test_unexpected_failures_make_the_demo_exit_non_zero(demos: Demos) -> None:
    """Faults the user did not ask for (here forced on the sidecars through their
    environment) are reported, and the demo fails."""
    result = demos.run(
        "--requests", "4", "--tokens", "3000", env={"KVXFER_FAULTS__FAIL_RATE": "0.5"}
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["failed_blocks"] > 0
    assert report["verified_requests"] == 4  # what did arrive is still checked


def _wait_until_running(demo: subprocess.Popen[str], requests: int) -> list[str]:
    """The demo's stderr up to its readiness marker: every engine and sidecar started
    (a fixed sleep was not enough beside the vLLM tier's background jobs)."""
    assert demo.stderr is not None
    seen: list[str] = []
    while not seen or f"running {requests} requests" not in seen[-1]:
        line = demo.stderr.readline()
        assert line, f"the demo ended before running requests: {seen}"
        seen.append(line)
    return seen


def _decode_engine(demo: subprocess.Popen[str]) -> int:
    """The pid of the demo's decode engine-sim (it is running)."""
    out = subprocess.run(
        ["pgrep", "-s", str(demo.pid), "-f", "engine-sim.*--role decode"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.stdout.strip(), "the demo has no decode engine running"
    return int(out.stdout.split()[0])


def test_a_killed_engine_fails_the_demo_with_a_clear_message(demos: Demos) -> None:
    demo = demos.start("--requests", "400", "--tokens", "4000")
    try:
        _wait_until_running(demo, 400)
        os.kill(_decode_engine(demo), signal.SIGKILL)
        _, stderr = demo.communicate(timeout=90)
    finally:
        _kill(demo)
    assert demo.returncode == 1
    assert "engine-sim decode" in stderr and "exited unexpectedly" in stderr, stderr[-2000:]


@pytest.mark.parametrize(
    ("to", "sig", "code", "said"),
    [
        ("group", signal.SIGINT, 130, "interrupted"),
        ("demo", signal.SIGINT, 130, "interrupted"),
        ("demo", signal.SIGTERM, 143, "terminated"),
    ],
)
def test_ctrl_c_or_kill_stops_everything_with_one_line(
    demos: Demos, to: str, sig: int, code: int, said: str, tmp_path: Path
) -> None:
    """SIGINT to the demo's process group (Ctrl-C in a terminal: sidecars and engines get
    it too) or to the demo alone, or SIGTERM to the demo alone (`kill`, a job's timeout):
    one line, its exit code, nothing left running or on disk. (SIGTERM's default would
    end the demo at once and leave its sidecars and engines running with their memory.)"""
    demo = demos.start("--requests", "4000", "--tokens", "4000", env={"TMPDIR": str(tmp_path)})
    try:
        _wait_until_running(demo, 4000)
        (workdir,) = tmp_path.glob("kvxfer-demo-*")  # the demo's directory is in TMPDIR
        assert _processes_mentioning(str(workdir)), "no sidecar or engine runs in it"
        if to == "group":
            os.killpg(demo.pid, sig)
        else:
            os.kill(demo.pid, sig)
        _, rest = demo.communicate(timeout=90)
    finally:
        _kill(demo)
    assert demo.returncode == code, rest[-3000:]
    after = [line for line in rest.splitlines() if not line.startswith("demo: ")]  # progress
    assert after == [f"kvxfer-cli: {said}"], rest[-3000:]
    assert not workdir.exists(), "the demo's directory was left behind"
    assert not _processes_mentioning(str(workdir)), "a sidecar or engine was left running"


def test_bench_reports_every_method_side_by_side() -> None:
    result = subprocess.run(
        [CLI, "bench", "--models", "gemma-3-4b-it", "--sizes", "1k", "--repeat", "2", "--json",
         "--concurrency", "1,4", "--concurrency-sizes", "1k"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["memcpy_gbps"] > 0
    assert report["engine_transport"] == "lane"
    (case,) = report["cases"]
    assert case["model"] == "gemma-3-4b-it" and case["tokens"] == 1024
    for key in ("raw_nixl_gbps", "per_block_gbps", "kvxfer_gbps", "kvxfer_vs_raw"):
        assert case[key] > 0, key
    assert case["bytes"] <= case["full_attention_bytes"]  # gemma: the window covers 1k
    assert case["rounds"] == 2  # --repeat, given, wins over the 1k default
    assert case["kvxfer_ms_p99"] >= case["kvxfer_ms_p50"] > 0
    assert case["raw_ms_p99"] >= case["raw_ms_p50"] > 0
    assert case["overhead_ms_p50"] == pytest.approx(
        case["kvxfer_ms_p50"] - case["raw_ms_p50"], abs=0.002
    )
    assert case["overhead_ms_p99"] == pytest.approx(
        case["kvxfer_ms_p99"] - case["raw_ms_p99"], abs=0.002
    )
    # The bare hand-offs were timed in the same rounds: each is a real round trip.
    assert case["engine_call_ms_p50"] > 0 and case["nixl_thread_ms_p50"] > 0
    assert case["hops_ms_p50"] == pytest.approx(
        case["engine_call_ms_p50"] + case["nixl_thread_ms_p50"], abs=0.002
    )
    rounds = case["kvxfer_vs_raw_rounds"]
    assert 0 < rounds["min"] <= rounds["median"] <= rounds["max"]
    # Each pull's CPU, where it ran: the copy is the decode sidecar's NIXL threads' (the
    # OS knows them by name), part of that sidecar's; the prefill sidecar answered its
    # BeginRead; the engine's loop made the call and heard PullDone.
    cpu = case["cpu_ms_per_pull_p50"]
    assert 0 < cpu["decode_nixl_threads"] < cpu["decode_sidecar"], cpu
    assert cpu["prefill_sidecar"] > 0 and cpu["engine_loop"] > 0, cpu
    (handshake,) = report["handshakes"]  # the decode sidecar met the prefill engine once
    assert handshake["handshakes"] == 1 and handshake["handshake_ms"] > 0
    assert [level["concurrency"] for level in report["concurrency"]] == [1, 4]
    for level in report["concurrency"]:
        assert level["errors"] == 0 and level["kvxfer_gbps"] > 0 and level["raw_nixl_gbps"] > 0
        assert level["decode_sidecar_rss_mib"] > 0


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name `text` (a demo's own directory)."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [argv for pid in pids if pid != os.getpid() and text in (argv := cmdline(pid))]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_vllm_demo_with_one_line(tmp_path: Path) -> None:
    """The vLLM path: SIGINT to the demo's process group once a vLLM engine is loading
    (the decode's, which computes the reference first).
    Its workers run in sessions of their own (out of the session watch's sight), so
    they are found by the demo directory their command lines name. The demo starts with
    SIGINT ignored, as a non-interactive shell starts a background job: its sidecars
    still stop on the SIGINT, so the demo must too (it ran on into a dead sidecar)."""
    ignoring = ["sh", "-c", 'trap "" INT; exec "$0" "$@"']  # exec keeps SIGINT ignored
    demo = subprocess.Popen(
        [*ignoring, CLI, "demo", "--engine", "vllm", "--model", "gemma3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        logs: list[Path] = []
        while not any(log.stat().st_size for log in logs):  # a vLLM engine is starting
            assert demo.poll() is None, demo.communicate()
            assert time.monotonic() < deadline, "no vLLM engine started within 300 s"
            logs = list(tmp_path.glob("kvxfer-demo-vllm-*/vllm-decode.log"))
            time.sleep(0.5)
        (workdir,) = {log.parent for log in logs}
        assert _processes_mentioning(str(workdir)), "no process runs in the demo's directory"
        os.killpg(demo.pid, signal.SIGINT)
        _, stderr = demo.communicate(timeout=240)
    finally:
        _kill(demo)
    assert demo.returncode == 130, stderr[-3000:]
    assert stderr.splitlines() == ["kvxfer-cli: interrupted"], stderr[-3000:]
    assert not workdir.exists(), "the demo's directory was left behind"
    assert not _processes_mentioning(str(workdir)), "a vLLM worker was left running"


def test_an_engine_that_died_starting_leaves_no_segment(tmp_path: Path) -> None:
    """What a killed engine created is named after its pid; nothing else is touched."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    ours = [SHM_DIR / f"kvxfer-decode-{dead.pid}-0a1b2c3d-g{g}" for g in (0, 1)]
    other = SHM_DIR / f"kvxfer-decode-{dead.pid}1-0a1b2c3d-g0"  # another pid's prefix
    for path in [*ours, other]:
        path.write_bytes(b"x")
    try:
        assert sorted(unlink_segments_of(dead.pid)) == sorted(p.name for p in ours)
        assert not any(p.exists() for p in ours) and other.exists()
    finally:
        for path in [*ours, other]:
            path.unlink(missing_ok=True)


def test_the_watch_counts_only_segments_made_while_it_watched() -> None:
    """A segment an earlier run left under a pid this session reuses is not a leftover
    of this session (CI: a segment of four hours before failed a demo's teardown)."""
    with subprocess.Popen(["sleep", "30"], start_new_session=True) as proc:
        stale = SHM_DIR / f"kvxfer-prefill-{proc.pid}-0a1b2c3d-g0"
        made = SHM_DIR / f"kvxfer-prefill-{proc.pid}-4e5f6a7b-g0"
        stale.write_bytes(b"x")
        try:
            watch = SessionWatch(proc.pid)
            made.write_bytes(b"x")
            deadline = time.monotonic() + 10
            while proc.pid not in watch.seen and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.kill()
            proc.wait()
            watch.stop()
            assert proc.pid in watch.seen
            assert watch.segments() == {made.name}
        finally:
            stale.unlink(missing_ok=True)
            made.unlink(missing_ok=True)
