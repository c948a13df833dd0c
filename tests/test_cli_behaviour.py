"""How kvxfer-cli and kvxfer-server behave as commands: versions, help, exit codes,
errors under --json, plain or terminal output, and cleanup on Ctrl-C (the demo's
real SIGINT test is in test_demo.py). docs/cli.md documents what is checked here."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from pki import tls_env

from kvxfer.cli.fleet import BIN, Fleet, local_fleet

CLI = str(BIN / "kvxfer-cli")
SERVER = str(BIN / "kvxfer-server")


def run(*argv: str, tty: bool = False) -> subprocess.CompletedProcess[str]:
    """A console script; with `tty`, its stdout is a pseudo-terminal (read back here)."""
    if not tty:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    leader, follower = os.openpty()
    try:
        done = subprocess.run(
            argv, stdout=follower, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
            env={**os.environ, "COLUMNS": "120"},
        )  # fmt: skip
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the writer is gone and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    return subprocess.CompletedProcess(
        argv, done.returncode, b"".join(chunks).decode(), done.stderr
    )


@pytest.mark.parametrize("binary", [CLI, SERVER])
def test_version_comes_from_the_package_metadata(binary: str) -> None:
    result = run(binary, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{Path(binary).name} {metadata.version('kvxfer')}\n"


def test_bare_cli_prints_its_usage_and_exits_2() -> None:
    result = run(CLI)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: kvxfer-cli")
    for command in ("layout", "plan", "handshake", "status", "demo", "bench"):
        assert re.search(rf"^\s+{command}\s", result.stderr, re.M), command
    assert "exit codes:" in result.stderr


def test_server_help_has_readable_metavars_and_each_default_once() -> None:
    result = run(SERVER, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for python_type in ("{Path,None}", "{str,None}", "tuple[str", "dict[str", " float", " int "):
        assert python_type not in text, python_type
    for flag_metavar in (
        "--peer-address HOST:PORT",
        "--lease.ttl-s SECONDS",
        "--limits.max-message-bytes BYTES",
        "--nixl.backends NAME[,NAME...]",
        "--tls.cert-file FILE",
    ):
        assert flag_metavar in text, flag_metavar
    options = re.split(r"\n  (?=--)", text)
    for option in options:
        assert option.count("(default:") <= 1, option
        assert option.count("default") <= 1, option
    assert "[KVXFER_LEASE__TTL_S]" in text and "exit codes:" in text


HANDSHAKE = ["handshake", "--peer", "127.0.0.1:1", "--layout", "llama-3.1-8b"]


@pytest.mark.parametrize(
    ("argv", "code", "field"),
    [
        (["plan", "--model", "llama-3.1-8b", "--tokens", "0"], 2, None),  # argparse
        (["plan", "--model", "nope", "--tokens", "10"], 2, "model"),  # bad input
        (["status", "--sidecar", "nohost"], 2, "--sidecar"),
        # a port past int()'s 4300 digits: a field error, not a ValueError traceback
        (["status", "--sidecar", "127.0.0.1:" + "1" * 4400], 2, "--sidecar"),
        (["handshake", "--peer", "h:" + "1" * 4400, "--layout", "llama-3.1-8b"], 2, "--peer"),
        # a rank past the handshake's uint32 was a protobuf ValueError traceback; one no
        # layout can have was sent to the peer
        ([*HANDSHAKE, "--peer-rank", str(1 << 32)], 2, None),
        ([*HANDSHAKE, "--peer-rank", "4096"], 2, None),
        # a block size past the layout's bound was blamed on a tensor's bytes per block
        (["layout", "--model", "gpt-oss-20b", "--block-size", "9" * 20], 2, None),
        (["demo", "--decode-block-size", str((1 << 20) + 1)], 2, None),
        (["plan", "--model", "llama-3.1-8b"], 2, None),  # a required flag missing
        # the demo's prompt lengths are bounded as every other command's (argparse)
        (["demo", "--tokens", str(1 << 41)], 2, None),
        (["demo", "--tokens-range", f"1:{1 << 41}"], 2, None),
        # `--tls-ca "$UNSET"` went plaintext without a word
        ([*HANDSHAKE, "--tls-cert", "", "--tls-key", "", "--tls-ca", ""], 2, "--tls-cert"),
        ([*HANDSHAKE, "--tls-cert", "c", "--tls-key", "k", "--tls-ca", ""], 2, "--tls-ca"),
        # options of bursts that do not run were dropped silently
        (["bench", "--concurrency-sizes", "16k"], 2, "--concurrency-sizes"),
        (["bench", "--concurrency-max-gib", "1"], 2, "--concurrency-max-gib"),
    ],
)
def test_bad_input_exits_2_and_is_json_under_json(
    argv: list[str], code: int, field: str | None
) -> None:
    plain = run(CLI, *argv)
    assert plain.returncode == code and plain.stdout == ""
    assert len(plain.stderr.splitlines()) == 1 and "Traceback" not in plain.stderr
    as_json = run(CLI, *argv, "--json")
    assert as_json.returncode == code and as_json.stderr == ""
    error = json.loads(as_json.stdout)
    assert set(error) == {"error", "field", "code", "type"}
    assert error["code"] == code and error["field"] == field
    assert error["error"] in plain.stderr


def test_a_tiny_model_directory_that_cannot_be_created_is_a_usage_error(tmp_path: Path) -> None:
    """Refused before a model (or the vLLM venv's python) is started: it was a
    FileNotFoundError traceback from the model's writer."""
    (tmp_path / "file").write_text("")
    for out in ("/proc/nope", str(tmp_path / "file" / "model")):
        result = run(CLI, "tiny-model", "--family", "llama", "--out", out)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"kvxfer-cli: error: --out: cannot create {out}: ")
        assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("timeout", ["nan", "-1", "0", "inf", "1e300"])
@pytest.mark.parametrize("command", ["status", "peers", "handshake"])
def test_a_timeout_that_is_no_wait_is_a_usage_error(command: str, timeout: str) -> None:
    """nan, -1 and 0 were taken, and ended as "unreachable (no answer within nans)";
    1e300 was a deadline gRPC took as already past."""
    target = ["--peer", "127.0.0.1:1", "--layout", "llama-3.1-8b"]
    if command != "handshake":
        target = ["--sidecar", "127.0.0.1:1"]
    result = run(CLI, command, *target, "--timeout", timeout)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"kvxfer-cli {command}: error: argument --timeout: ")
    assert len(result.stderr.splitlines()) == 1


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("port", ["closed_port", "silent_port"])
@pytest.mark.parametrize("command", ["status", "peers", "handshake"])
def test_unreachable_or_silent_sidecar_exits_3(
    port: str, command: str, request: pytest.FixtureRequest
) -> None:
    address = f"127.0.0.1:{request.getfixturevalue(port)}"
    target = (
        ["--peer", address, "--layout", "llama-3.1-8b"]
        if command == "handshake"
        else ["--sidecar", address]
    )
    argv = [command, *target, "--timeout", "1"]
    plain = run(CLI, *argv)
    assert plain.returncode == 3, plain.stderr
    assert plain.stderr.startswith("kvxfer-cli: error: ") and address in plain.stderr
    assert len(plain.stderr.splitlines()) == 1
    error = json.loads(run(CLI, *argv, "--json").stdout)
    assert error["code"] == 3 and error["type"] == "PeerUnavailableError"


def test_handshake_tls_files_that_are_not_pem_are_a_usage_error(
    tmp_path: Path, closed_port: int
) -> None:
    """They were read as bytes and handed to gRPC, which could then not make a handshaker:
    the peer was reported unreachable (exit 3)."""
    env = tls_env(tmp_path)
    good = {
        "--tls-cert": env["KVXFER_TLS__CERT_FILE"],
        "--tls-key": env["KVXFER_TLS__KEY_FILE"],
        "--tls-ca": env["KVXFER_TLS__CA_FILE"],
    }
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    handshake = [CLI, "handshake", "--peer", f"127.0.0.1:{closed_port}", "--layout", "llama-3.1-8b"]
    for flag in good:
        files = {**good, flag: str(junk)}
        result = run(*handshake, *(part for item in files.items() for part in item))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"kvxfer-cli: error: {flag}: {junk} holds no PEM ")
        assert len(result.stderr.splitlines()) == 1
    reached = run(*handshake, *(part for item in good.items() for part in item), "--timeout", "1")
    assert reached.returncode == 3, reached.stderr  # good files: on to the (closed) port


@pytest.mark.e2e
def test_handshake_exit_codes_against_a_real_sidecar(tmp_path: Path) -> None:
    """0 compatible, 1 incompatible (with --json: the report, not an error)."""
    fleet = Fleet(tmp_path)
    try:
        sidecar = fleet.sidecar("p")
        fleet.engine(sidecar, "llama-3.1-8b", "prefill", "--num-blocks", "16")
        peer = sidecar.ready["peer_address"]
        same = run(CLI, "handshake", "--peer", peer, "--layout", "llama-3.1-8b")
        assert same.returncode == 0, same.stderr
        assert "compatible" in same.stdout
        other = run(CLI, "handshake", "--peer", peer, "--layout", "gemma-3-4b-it", "--json")
        assert other.returncode == 1, other.stderr
        report = json.loads(other.stdout)
        assert report["compatible"] is False and report["mismatches"]
    finally:
        fleet.close()


def test_tables_are_plain_columns_off_a_terminal() -> None:
    result = run(CLI, "plan", "--model", "gemma-3-4b-it", "--tokens", "32768")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = lines.index("group  kind                    layers  blocks      count       bytes")
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[header + 1 : header + 3]]
    assert rows == [
        ["0", "sliding_window(W=1024)", "29", "1984..2047", "64", "116.00 MiB"],
        ["1", "full_attention", "5", "0..2047", "2048", "640.00 MiB"],
    ]
    assert "\x1b[" not in result.stdout and "─" not in result.stdout


def test_tables_are_drawn_on_a_terminal() -> None:
    result = run(CLI, "layout", "--model", "gpt-oss-20b", tty=True)
    assert result.returncode == 0, result.stderr
    assert "─" in result.stdout  # rich's rule under the header
    assert "sliding_window(W=128)" in result.stdout


@pytest.mark.e2e
def test_local_fleet_cleans_up_on_ctrl_c_and_keeps_logs_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the sim demo, the vLLM demo and the bench share: Ctrl-C (KeyboardInterrupt)
    stops every process and removes the directory; a failure keeps it, saying where."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile  # noqa: PLC0415 (tempfile caches TMPDIR on first use)

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(KeyboardInterrupt), local_fleet("kvxfer-demo-", "test") as fleet:
        sidecar = fleet.sidecar("p")
        workdir = fleet.workdir
        raise KeyboardInterrupt
    assert sidecar.popen.poll() is not None
    assert workdir.parent == tmp_path and not workdir.exists()
    with pytest.raises(RuntimeError), local_fleet("kvxfer-demo-", "test") as fleet:
        sidecar = fleet.sidecar("p")
        raise RuntimeError("a check failed")
    assert sidecar.popen.poll() is not None
    assert (fleet.workdir / "p.log").exists()


SIM = [
    "engine-sim",
    "--sidecar",
    "unix:/nonexistent/kvxfer.sock",
    "--model",
    "llama-3.1-8b",
    "--role",
    "prefill",
]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        # shared memory that cannot be had: an OSError traceback, or a SIGBUS mid-fill
        ([*SIM, "--num-blocks", str(1 << 32)], "--num-blocks"),
        ([*SIM, "--num-blocks", str(1 << 31)], "--num-blocks"),
    ],
)
def test_commands_without_json_name_the_flag_in_one_line(argv: list[str], flag: str) -> None:
    before = set(os.listdir("/dev/shm"))
    result = run(CLI, *argv)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert f"error: {flag}: " in result.stderr
    assert set(os.listdir("/dev/shm")) <= before  # nothing left behind
