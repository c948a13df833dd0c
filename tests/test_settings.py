"""Sidecar settings: flags over environment over file over defaults; every error named."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.fleet import BIN
from kvxfer.server.settings import load_settings


def test_defaults_are_safe() -> None:
    s = load_settings([], environ={})
    assert s.peer_address == "127.0.0.1:7500" and not s.tls.enabled and not s.faults.enabled
    assert s.transfer.stall_deadline_s < s.lease.ttl_s


def test_precedence_flag_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kvxfer.json"
    config.write_text(json.dumps({"lease": {"ttl_s": 40}, "peer_address": "127.0.0.1:1111"}))
    monkeypatch.setenv("KVXFER_PEER_ADDRESS", "127.0.0.1:2222")
    s = load_settings(["--config", str(config)])
    assert s.lease.ttl_s == 40 and s.peer_address == "127.0.0.1:2222"
    s = load_settings(["--config", str(config), "--peer-address", "127.0.0.1:3333"])
    assert s.peer_address == "127.0.0.1:3333"
    toml = tmp_path / "kvxfer.toml"
    toml.write_text('[nixl]\nbackend_params = { num_workers = "2" }\n')
    assert load_settings(["--config", str(toml)], environ={}).nixl.backend_params == {
        "num_workers": "2"
    }


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--peer-address", "nohost"], "peer_address"),
        (["--engine-address", "unix:"], "engine_address"),
        (["--lease.ttl-s", "-1"], "lease.ttl_s"),
        (["--lease.ttl-s", "5", "--transfer.stall-deadline-s", "6"], "transfer.stall_deadline_s"),
        (["--faults.fail-rate", "2"], "faults.fail_rate"),
        (["--tls.cert-file", "/nonexistent"], "tls"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ={})
    assert field in str(err.value)


def test_unknown_keys_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"lease": {"ttl": 5}}))
    with pytest.raises(InvalidInputError, match=r"lease\.ttl"):
        load_settings(["--config", str(config)], environ={})
    with pytest.raises(SystemExit) as exit_:  # argparse: usage line, exit 2
        load_settings(["--lease.ttl", "5"], environ={})
    assert exit_.value.code == 2


def test_server_exits_2_with_one_line_on_bad_settings() -> None:
    result = subprocess.run(
        [str(BIN / "kvxfer-server"), "--lease.ttl-s", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().startswith("kvxfer-server: lease.ttl_s")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "[::1]", "localhost"])
def test_loopback_peer_port_needs_no_tls(host: str) -> None:
    assert load_settings(["--peer-address", f"{host}:0"], environ={}).peer_address == f"{host}:0"


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "10.1.2.3", "sidecar.example"])
def test_non_loopback_peer_port_is_refused_without_tls(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(InvalidInputError, match=r"not loopback.*--insecure-peer-port"):
        load_settings(["--peer-address", f"{host}:7500"], environ={})
    s = load_settings(["--peer-address", f"{host}:7500", "--insecure-peer-port"], environ={})
    assert s.insecure_peer_port
    monkeypatch.setenv("KVXFER_INSECURE_PEER_PORT", "true")
    assert load_settings(["--peer-address", f"{host}:7500"]).insecure_peer_port
