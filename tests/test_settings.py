"""Sidecar settings: flags over environment over file over defaults; every error named."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pki import make_pki, openssl, tls_env

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.fleet import BIN
from kvxfer.server import settings as settings_module
from kvxfer.server.settings import SettingsInvalidError, load_settings


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
        (["--lease.ttl-s", "60", "--lease.max-hold-s", "30"], "lease.max_hold_s"),
        (["--lease.max-hold-s", "0"], "lease.max_hold_s"),
        (["--nixl.backends", "UCX,GDS,UCX"], "nixl.backends"),
        (["--sidecar-id", "p\nforged log line"], "sidecar_id"),
        (["--engine-address", "unix:relative.sock"], "engine_address"),
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


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--nixl.backends", "FOO", "nixl.backends"),
        ("--nixl.backend-params", "num_workers=abc", "nixl.backend_params"),
    ],
)
def test_server_exits_2_naming_a_nixl_setting_nixl_refuses(
    flag: str, value: str, field: str, tmp_path: Path
) -> None:
    """Only NIXL knows its backends and their parameters: the sidecar said `cannot create
    NIXL agent: NIXL_ERR_NOT_FOUND` and exited 1, naming no setting."""
    result = subprocess.run(
        [str(BIN / "kvxfer-server"), flag, value, "--peer-address", "127.0.0.1:0",
         "--engine-address", f"unix:{tmp_path}/e.sock", "--metrics-address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("kvxfer-server:")]
    assert line.startswith(f"kvxfer-server: {field} ({flag}, "), line


def test_an_unknown_event_loop_is_refused_naming_the_setting() -> None:
    assert load_settings([], environ={}).event_loop == "uvloop"
    assert load_settings([], environ={"KVXFER_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(InvalidInputError, match="event_loop"):
        load_settings([], environ={"KVXFER_EVENT_LOOP": "trio"})


@pytest.mark.parametrize(
    ("name", "content", "errors"),
    [
        # Read as 0 and 1: a grace of nothing, a lease of one second, one block a chunk.
        (
            "b.yaml",
            "shutdown_grace_s: off\nlease: {ttl_s: on}\n",
            [
                "shutdown_grace_s (--shutdown-grace-s, KVXFER_SHUTDOWN_GRACE_S): Input should "
                "be a number, not a boolean, got False",
                "lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S): Input should be a number, "
                "not a boolean, got True",
            ],
        ),
        (
            "b.json",
            '{"transfer": {"chunk_blocks": true}, "lane": {"port": false}}',
            [
                "lane.port (--lane.port, KVXFER_LANE__PORT): Input should be an integer, not a "
                "boolean, got False",
                "transfer.chunk_blocks (--transfer.chunk-blocks, KVXFER_TRANSFER__CHUNK_BLOCKS): "
                "Input should be an integer, not a boolean, got True",
            ],
        ),
        (
            "b.toml",
            "[faults]\nfail_rate = true\n",
            [
                "faults.fail_rate (--faults.fail-rate, KVXFER_FAULTS__FAIL_RATE): Input should be "
                "a number, not a boolean, got True"
            ],
        ),
    ],
)
def test_a_number_setting_refuses_a_boolean_from_a_file(
    tmp_path: Path, name: str, content: str, errors: list[str]
) -> None:
    config = tmp_path / name
    config.write_text(content)
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--config", str(config)], environ={})
    assert str(err.value).splitlines() == errors


def test_a_number_setting_refuses_a_boolean_from_flags_and_variables_too() -> None:
    ttl = "lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S): Input should be a"
    refused = [
        (["--lease", '{"ttl_s": true}'], {}, f"{ttl} number, not a boolean, got True"),
        ([], {"KVXFER_LEASE": '{"ttl_s": false}'}, f"{ttl} number, not a boolean, got False"),
        ([], {"KVXFER_LEASE__TTL_S": "true"}, f"{ttl} valid number"),
        (["--lease.ttl-s", "false"], {}, f"{ttl} valid number"),
    ]
    for argv, environ, error in refused:
        with pytest.raises(InvalidInputError) as err:
            load_settings(argv, environ=environ)
        assert str(err.value).startswith(error), (argv, environ, str(err.value))
    # Numbers as text still read, and a boolean setting still takes its flag and true/false.
    s = load_settings(
        ["--lease.ttl-s", "40", "--lane.enabled"],
        environ={"KVXFER_TRANSFER__CHUNK_BLOCKS": "16", "KVXFER_INSECURE_ENGINE_TCP": "false"},
    )
    assert (s.lease.ttl_s, s.transfer.chunk_blocks, s.lane.enabled) == (40, 16, True)
    assert not s.insecure_engine_tcp


def test_the_gil_switch_interval_is_short_by_default_and_checked() -> None:
    assert load_settings([], environ={}).gil_switch_interval_s == 0.0001
    flag = load_settings(["--gil-switch-interval-s", "0.002"], environ={})
    assert flag.gil_switch_interval_s == 0.002
    least = load_settings([], environ={"KVXFER_GIL_SWITCH_INTERVAL_S": "0.000001"})
    assert least.gil_switch_interval_s == 1e-6
    # Below a microsecond CPython's sys.setswitchinterval runs it as 0, silently.
    for bad in ("0", "-1", "0.5", "fast", "9e-7", "1e-9"):
        with pytest.raises(InvalidInputError, match="gil_switch_interval_s"):
            load_settings([], environ={"KVXFER_GIL_SWITCH_INTERVAL_S": bad})


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


def test_list_settings_take_comma_lists_from_env_and_flags(tmp_path: Path) -> None:
    env = {
        **tls_env(tmp_path),
        "KVXFER_NIXL__BACKENDS": "UCX",
        "KVXFER_TLS__ALLOWED_PEERS": "decode-0, decode-1",
    }
    s = load_settings([], environ=env)
    assert s.nixl.backends == ("UCX",) and s.tls.allowed_peers == ("decode-0", "decode-1")
    s = load_settings(["--tls.allowed-peers", "a,b", "--nixl.backends", "UCX,GDS"], environ=env)
    assert s.tls.allowed_peers == ("a", "b") and s.nixl.backends == ("UCX", "GDS")
    assert load_settings([], environ={"KVXFER_NIXL__BACKENDS": '["GDS"]'}).nixl.backends == (
        "GDS",
    )  # JSON still reads
    params = {"KVXFER_NIXL__BACKEND_PARAMS": "num_workers=2, x=y"}
    assert load_settings([], environ=params).nixl.backend_params == {"num_workers": "2", "x": "y"}
    one = {"KVXFER_NIXL__BACKEND_PARAMS__NUM_WORKERS": "4"}
    assert load_settings([], environ=one).nixl.backend_params == {"num_workers": "4"}
    with pytest.raises(InvalidInputError, match="KVXFER_NIXL__BACKEND_PARAMS: expected KEY=VALUE"):
        load_settings([], environ={"KVXFER_NIXL__BACKEND_PARAMS": "num_workers"})


@pytest.mark.parametrize(
    ("argv", "environ", "field"),
    [
        # Accepted, then every peer call was refused at runtime: no certificate to check.
        (["--tls.allowed-peers", "a"], {}, "tls.allowed_peers"),
        ([], {"KVXFER_TLS__ALLOWED_PEERS": "a"}, "tls.allowed_peers"),
        # A stray comma is a typo, not a shorter list.
        (["--nixl.backends", ","], {}, "nixl.backends"),
        (["--nixl.backends", "UCX,,GDS"], {}, "nixl.backends"),
        ([], {"KVXFER_NIXL__BACKENDS": "UCX,,"}, "nixl.backends"),
        ([], {"KVXFER_NIXL__BACKENDS": '["UCX", ""]'}, "nixl.backends"),
        (["--nixl.backend-params", "=1"], {}, "nixl.backend_params"),
        ([], {"KVXFER_NIXL__BACKEND_PARAMS": "a=1,,b=2"}, "KVXFER_NIXL__BACKEND_PARAMS"),
    ],
)
def test_nonsense_lists_are_refused_naming_the_setting(
    argv: list[str], environ: dict[str, str], field: str
) -> None:
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ=environ)
    assert err.value.field.startswith(field), err.value


def test_one_trailing_comma_in_a_variable_ends_its_list() -> None:
    """What templated deployments emit (`a,b,`): no entry is lost, so it is no typo."""
    settings = load_settings([], environ={"KVXFER_NIXL__BACKENDS": "UCX,"})
    assert settings.nixl.backends == ("UCX",)
    params = {"KVXFER_NIXL__BACKEND_PARAMS": "num_workers=4,"}
    assert load_settings([], environ=params).nixl.backend_params == {"num_workers": "4"}


FLAG_PARAMS = "nixl.backend_params (--nixl.backend-params, KVXFER_NIXL__BACKEND_PARAMS)"
EMPTY = "is empty (a stray comma?)"


@pytest.mark.parametrize(
    ("argv", "environ", "error"),
    [
        # A map flag dropped its empty entries: this was {num_workers: 2, x: 1}.
        (
            ["--nixl.backend-params", "num_workers=2,,x=1"],
            {},
            f"{FLAG_PARAMS}: entry 2 of 3 {EMPTY}",
        ),
        (["--nixl.backend-params", ",a=1"], {}, f"{FLAG_PARAMS}: entry 1 of 2 {EMPTY}"),
        (["--nixl.backend-params", "[a=1,]"], {}, f"{FLAG_PARAMS}: entry 2 of 2 {EMPTY}"),
        (["--nixl.backend-params", ""], {}, f"{FLAG_PARAMS}: entry 1 of 1 {EMPTY}"),
        # No trailing comma in a flag, unlike a variable (nothing templates flags).
        (["--nixl.backend-params", "a=1,"], {}, f"{FLAG_PARAMS}: entry 2 of 2 {EMPTY}"),
        # A repeated flag is one list: its empty entries were dropped, a list's too.
        (
            ["--nixl.backend-params", "a=1", "--nixl.backend-params", ",b=2"],
            {},
            f"{FLAG_PARAMS}: entry 2 of 3 {EMPTY}",
        ),
        (
            ["--nixl.backends", "UCX", "--nixl.backends", ",GDS"],
            {},
            f"nixl.backends (--nixl.backends, KVXFER_NIXL__BACKENDS): entry 2 of 3 {EMPTY}",
        ),
        (
            ["--nixl.backends", "UCX", "--nixl.backends", ""],
            {},
            f"nixl.backends (--nixl.backends, KVXFER_NIXL__BACKENDS): entry 2 of 2 {EMPTY}",
        ),
        (
            ["--transfer.modes", "pull,,push"],
            {},
            f"transfer.modes (--transfer.modes, KVXFER_TRANSFER__MODES): entry 2 of 3 {EMPTY}",
        ),
        # Was "settings: Parsing error encountered for ...: not enough values to unpack".
        (
            ["--nixl.backend-params", "num_workers=2,x"],
            {},
            f"{FLAG_PARAMS}: expected KEY=VALUE[,KEY=VALUE...], got 'x'",
        ),
        # A variable's empty entry was refused, but not as one: "expected KEY=VALUE, got ''".
        (
            [],
            {"KVXFER_NIXL__BACKEND_PARAMS": "num_workers=2,,x=1"},
            f"KVXFER_NIXL__BACKEND_PARAMS: entry 2 of 3 {EMPTY}",
        ),
        (
            [],
            {"KVXFER_NIXL__BACKEND_PARAMS": ",a=1"},
            f"KVXFER_NIXL__BACKEND_PARAMS: entry 1 of 2 {EMPTY}",
        ),
        # One trailing comma is dropped from a variable, a second one is not.
        (
            [],
            {"KVXFER_NIXL__BACKEND_PARAMS": "a=1,,"},
            f"KVXFER_NIXL__BACKEND_PARAMS: entry 2 of 2 {EMPTY}",
        ),
    ],
)
def test_an_empty_entry_is_refused_in_a_flag_as_in_a_variable(
    argv: list[str], environ: dict[str, str], error: str
) -> None:
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ=environ)
    assert str(err.value) == error


def test_a_map_flags_spaces_are_read_as_a_variables() -> None:
    flag = load_settings(["--nixl.backend-params", "a = 1, b=2 "], environ={})
    env = load_settings([], environ={"KVXFER_NIXL__BACKEND_PARAMS": "a = 1, b=2 "})
    assert flag.nixl.backend_params == env.nixl.backend_params == {"a": "1", "b": "2"}
    with pytest.raises(InvalidInputError, match=r"nixl\.backend_params.*given twice"):
        load_settings(["--nixl.backend-params", "a=1,a =2"], environ={})


def test_a_transfer_mode_listed_twice_is_refused_as_a_backend_is() -> None:
    for argv, environ in (
        (["--transfer.modes", "pull,pull"], {}),
        ([], {"KVXFER_TRANSFER__MODES": "push,pull,push"}),
    ):
        with pytest.raises(InvalidInputError, match=r"transfer\.modes.*listed twice"):
            load_settings(argv, environ=environ)
    assert [m.value for m in load_settings(["--transfer.modes", "push"], {}).transfer.modes] == [
        "push"
    ]


def test_a_map_flag_still_reads_quotes_json_and_repeats() -> None:
    """The empty-entry check splits a flag where pydantic-settings does: a comma inside
    quotes or a JSON object is no separator."""
    cases = {
        ("a=1,b=2",): {"a": "1", "b": "2"},
        ('a="x,,y"',): {"a": "x,,y"},
        ('{"a": "1", "b": "2"},c=3',): {"a": "1", "b": "2", "c": "3"},
        ("[a=1,b=2]",): {"a": "1", "b": "2"},
        ("[]",): {},
        ("a=1", "b=2"): {"a": "1", "b": "2"},
    }
    for values, expected in cases.items():
        argv = [arg for value in values for arg in ("--nixl.backend-params", value)]
        assert load_settings(argv, environ={}).nixl.backend_params == expected, values


def test_server_names_a_map_flags_empty_entry_and_exits_2() -> None:
    # --lease.ttl-s 0 as well: without the check the sidecar would report only that one,
    # and a refused flag must not hide it (one line per field).
    argv = ["--nixl.backend-params", "num_workers=2,,x=1", "--lease.ttl-s", "0"]
    result = subprocess.run(
        [str(BIN / "kvxfer-server"), *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvxfer-server: {FLAG_PARAMS}: entry 2 of 3 {EMPTY}",
        "kvxfer-server: lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S): "
        "Input should be greater than 0, got '0'",
    ]


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("a=1,{}", "entry 2 of 2 is an empty JSON object"),
        ("a=1,[]", "entry 2 of 2 is not KEY=VALUE nor a JSON object"),
        ('a=1,["x"]', "entry 2 of 2 is not KEY=VALUE nor a JSON object"),
        ('a=1,{"b":', 'not valid JSON: Missing end delimiter "}"'),
    ],
)
def test_a_map_flags_json_entry_that_adds_nothing_or_does_not_parse_is_refused(
    value: str, error: str
) -> None:
    """`a=1,{}` was read as `a=1`, silently; JSON that does not parse escaped as a
    traceback instead of an error naming the flag."""
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--nixl.backend-params", value], environ={})
    assert str(err.value) == f"{FLAG_PARAMS}: {error}"
    assert load_settings(["--nixl.backend-params", "{}"], environ={}).nixl.backend_params == {}


def test_a_list_flags_json_that_does_not_parse_is_refused_beside_the_rest() -> None:
    argv = ["--nixl.backends", '["UCX"', "--lease.ttl-s", "0"]
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ={})
    assert str(err.value).splitlines() == [
        "nixl.backends (--nixl.backends, KVXFER_NIXL__BACKENDS): not valid JSON: Missing end "
        'delimiter "]"',
        "lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S): Input should be greater than 0, got '0'",
    ]


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        (["--lease", '{"ttl_s":'], {}, "lease (--lease)"),
        ([], {"KVXFER_LEASE": '{"ttl_s":'}, "lease (KVXFER_LEASE*)"),
    ],
)
def test_a_group_that_does_not_parse_is_named_where_it_came_from(
    argv: list[str], environ: dict[str, str], named: str
) -> None:
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ=environ)
    assert str(err.value) == (
        f'{named}: not valid: lists are A,B or JSON ["A","B"], a whole group a JSON object'
    )


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        (["--lease", "[" * 200_000], {}, "--lease"),
        ([], {"KVXFER_LEASE": "[" * 200_000}, "KVXFER_LEASE"),
        ([], {"KVXFER_NIXL__BACKENDS": "[" * 200_000}, "KVXFER_NIXL__BACKENDS"),
        ([], {"KVXFER_NIXL__BACKEND_PARAMS": '{"a": ' * 200_000}, "KVXFER_NIXL__BACKEND_PARAMS"),
    ],
)
def test_json_nested_past_the_recursion_limit_is_refused_naming_the_flag_or_variable(
    argv: list[str], environ: dict[str, str], named: str
) -> None:
    """It was a RecursionError traceback."""
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ=environ)
    assert str(err.value) == f"{named}: its JSON is nested too deeply"


def test_only_a_settings_field_is_named_from_a_parse_error() -> None:
    """The field is taken from pydantic-settings' message only where it is a setting:
    anything else is reported as the message says, not as a name to fix."""
    odd = 'error parsing value for field "no_such" from source "EnvSource"'
    assert settings_module._env_error(odd) == ("settings", odd)
    assert settings_module._env_error("something else") == ("settings", "something else")


def test_a_refused_flag_is_reported_beside_every_other_field_once() -> None:
    """Flags are checked as they are parsed, before the values are validated: what they
    refuse is reported with the rest, and a list's empty entry, which validation refuses
    too, only once."""
    argv = ["--nixl.backends", "UCX,,GDS", "--transfer.modes", "pull,,push"]
    with pytest.raises(InvalidInputError) as err:
        load_settings(
            [*argv, "--nixl.backend-params", ",a=1"], environ={"KVXFER_LEASE__TTL_S": "0"}
        )
    assert sorted(str(err.value).splitlines()) == sorted(
        [
            f"nixl.backends (--nixl.backends, KVXFER_NIXL__BACKENDS): entry 2 of 3 {EMPTY}",
            f"nixl.backend_params (--nixl.backend-params, KVXFER_NIXL__BACKEND_PARAMS): "
            f"entry 1 of 2 {EMPTY}",
            f"transfer.modes (--transfer.modes, KVXFER_TRANSFER__MODES): entry 2 of 3 {EMPTY}",
            "lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S): "
            "Input should be greater than 0, got '0'",
        ]
    )


def test_an_allow_list_needs_mtls_and_no_empty_entry(tmp_path: Path) -> None:
    tls = tls_env(tmp_path)
    allowed = load_settings(["--tls.allowed-peers", "a,b"], environ=tls).tls.allowed_peers
    assert allowed == ("a", "b")
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--tls.allowed-peers", "a,,b"], environ=tls)
    assert err.value.field.startswith("tls.allowed_peers") and "entry 2 of 3" in str(err.value)


def test_tls_files_are_pem_and_the_key_is_the_certificates(tmp_path: Path) -> None:
    """They were only checked to exist: the sidecar then died starting, with an ssl
    traceback, on a file that was not PEM."""
    env = tls_env(tmp_path)
    assert load_settings([], environ=env).tls.enabled
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    other = tmp_path / "other"
    other.mkdir()
    make_pki(other)  # other/ca.key: a key, but not the certificate's
    openssl("genrsa", "-aes128", "-passout", "pass:x", "-out", "locked.key", "2048", cwd=tmp_path)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", "ec.key", "-out", "ec.pem", "-days", "1", "-subj", "/CN=ec",
            cwd=tmp_path)  # fmt: skip
    key = env["KVXFER_TLS__KEY_FILE"]
    refusals = [
        ("CERT_FILE", str(junk), "holds no PEM certificate"),
        ("CERT_FILE", key, "holds no PEM certificate"),
        ("CERT_FILE", str(tmp_path / "missing.pem"), "cannot be read: No such file"),
        ("CA_FILE", str(junk), "holds no PEM certificate"),
        ("KEY_FILE", str(junk), "holds no PEM private key"),
        ("KEY_FILE", str(other / "ca.key"), "is not the private key of the certificate"),
        ("KEY_FILE", str(tmp_path / "locked.key"), "is encrypted"),
        # an RSA key for an EC certificate: OpenSSL says NO_CERTIFICATE_ASSIGNED
        ("KEY_FILE", key, "is not the private key of the certificate", "ec.pem"),
    ]
    for name, path, why, *cert in refusals:
        given = {f"KVXFER_TLS__{name}": path}
        if cert:
            given["KVXFER_TLS__CERT_FILE"] = str(tmp_path / cert[0])
        with pytest.raises(SettingsInvalidError) as err:
            load_settings([], environ={**env, **given})
        ((field, message),) = err.value.problems
        setting = name.lower()
        assert field == f"tls.{setting} (--tls.{setting.replace('_', '-')}, KVXFER_TLS__{name})"
        assert message.startswith(why) and message.endswith(f"got {path!r}"), message
    refused = subprocess.run(
        [str(BIN / "kvxfer-server"), "--tls.cert-file", str(junk)],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **env},
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("kvxfer-server: tls.cert_file (--tls.cert-file, ")
    assert len(refused.stderr.splitlines()) == 1


def test_a_long_ttl_alone_raises_the_hold_cap_with_it() -> None:
    """A long lease.ttl_s was the mitigation for a long decode queue before holds: set
    alone, it must not stop the sidecar from starting (max_hold_s follows it); set
    below it, max_hold_s is refused."""
    assert load_settings([], environ={}).lease.max_hold_s == 600.0
    lease = load_settings(["--lease.ttl-s", "900"], environ={}).lease
    assert lease.ttl_s == lease.max_hold_s == 900.0
    lease = load_settings([], environ={"KVXFER_LEASE__TTL_S": "1200"}).lease
    assert lease.max_hold_s == 1200.0
    with pytest.raises(InvalidInputError, match="max_hold_s"):
        load_settings(["--lease.ttl-s", "900", "--lease.max-hold-s", "700"], environ={})
    with pytest.raises(InvalidInputError) as err:  # named once, as ttl_s alone
        load_settings(["--lease.ttl-s", "90000"], environ={})
    assert "lease.ttl_s" in str(err.value) and "max_hold_s" not in str(err.value)


def test_environment_is_the_one_given() -> None:
    """load_settings(environ=...) reads that mapping, not the process environment."""
    s = load_settings([], environ={"KVXFER_LEASE__TTL_S": "45"})
    assert s.lease.ttl_s == 45


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("KVXFER_PEER_ADRESS", "KVXFER_PEER_ADDRESS"),
        ("KVXFER_LEASE__TTL", "KVXFER_LEASE__TTL_S"),
        ("kvxfer_log_levl", "KVXFER_LOG_LEVEL"),
        ("KVXFER_NIXL_BACKENDS", "KVXFER_NIXL__BACKENDS"),
    ],
)
def test_unknown_kvxfer_variables_are_refused_naming_the_closest(name: str, closest: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        load_settings([], environ={name: "1"})
    assert str(err.value) == (
        f"{name}: no such setting; did you mean {closest}? (docs/configuration.md lists them)"
    )


def test_variables_that_are_not_settings_are_let_through() -> None:
    env = {
        "KVXFER_TEST_FUZZ_EXAMPLES": "9",  # the test suite's knobs
        "KVXFER_HARNESS_ALLOW_AMX": "1",  # the vLLM harness's
        "KVXFER_LEASE": '{"ttl_s": 50}',  # a whole group, as JSON
        "OTHER_PEER_ADRESS": "x",
    }
    assert load_settings([], environ=env).lease.ttl_s == 50


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_config_file_is_read_as_its_extension_says(tmp_path: Path, suffix: str) -> None:
    config = tmp_path / f"kvxfer{suffix}"
    config.write_text("lease:\n  ttl_s: 40\nnixl:\n  backends: [UCX, GDS]\n")
    s = load_settings(["--config", str(config)], environ={})
    assert s.lease.ttl_s == 40 and s.nixl.backends == ("UCX", "GDS")
    config.write_text("lease: [\n")
    with pytest.raises(InvalidInputError, match=r"^config: .* is not valid YAML"):
        load_settings(["--config", str(config)], environ={})
    config.write_text("- a list\n")
    with pytest.raises(InvalidInputError, match="must hold an object"):
        load_settings([], environ={"KVXFER_CONFIG": str(config)})


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (
            "log_level: off\n",
            "log_level (--log-level, KVXFER_LOG_LEVEL): Input should be a valid string, "
            "got False (YAML reads an unquoted on, off, yes or no as a boolean); quote it",
        ),
        (
            "nixl:\n  backends: [UCX, yes]\n",
            "nixl.backends.1: Input should be a valid string (YAML reads an unquoted on, "
            "off, yes or no as a boolean); quote it",
        ),
    ],
)
def test_a_yaml_boolean_where_text_belongs_says_to_quote_it(
    tmp_path: Path, content: str, error: str
) -> None:
    config = tmp_path / "kvxfer.yaml"
    config.write_text(content)
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--config", str(config)], environ={})
    assert str(err.value) == error


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        # A UTF-16 byte order mark: was a UnicodeDecodeError traceback.
        ("bom.json", b'\xff\xfe{"lease": {}}', "is not UTF-8 text: invalid start byte at byte 0"),
        ("bom.yaml", b"\xff\xfelease: {}\n", "is not UTF-8 text: invalid start byte at byte 0"),
        # Keys YAML reads as no string: was "TypeError: keywords must be strings".
        ("k.yaml", b"1: 2\n", "has the key 1 at the top level: a number, not a string; quote it"),
        (
            "k.yaml",
            b"on: 1\n",
            "has the key True at the top level: a boolean, not a string (YAML reads an "
            "unquoted on, off, yes or no as one); quote it",
        ),
        (
            "k.yaml",
            b"nixl:\n  backend_params: {a: b, yes: c}\n",
            "has the key True in nixl.backend_params: a boolean, not a string (YAML reads "
            "an unquoted on, off, yes or no as one); quote it",
        ),
        (
            "k.yaml",
            b"tls:\n  allowed_peers: [a, {~: b}]\n",
            "has the key None in tls.allowed_peers[1]: null, not a string; quote it",
        ),
        # Deeper than Python's recursion limit: was a RecursionError traceback.
        ("deep.json", b'{"lease": ' + b"[" * 200_000, "is nested more than 32 levels deep"),
        ("deep.yaml", b"lease: " + b"[" * 200_000, "is nested more than 32 levels deep"),
        ("deep.toml", b"lease = " + b"[" * 200_000, "is nested more than 32 levels deep"),
        # Parsed, but deeper than any setting; an alias of its own parent never ends.
        (
            "deep.json",
            b'{"lease": ' + b"[" * 33 + b"]" * 33 + b"}",
            "is nested more than 32 levels deep",
        ),
        ("loop.yaml", b"lease: &a [*a]\n", "is nested more than 32 levels deep"),
    ],
)
def test_a_config_file_that_cannot_hold_settings_is_refused_naming_it(
    tmp_path: Path, name: str, content: bytes, error: str
) -> None:
    config = tmp_path / name
    config.write_bytes(content)
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--config", str(config)], environ={})
    assert err.value.field == "config"
    assert err.value.detail == f"{str(config)!r} {error}"


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        # The last one won silently.
        (
            "twice.json",
            '{"log_level": "DEBUG", "log_level": "ERROR"}',
            "gives the key 'log_level' twice in one object",
        ),
        (
            "twice.json",
            '{"lease": {"ttl_s": 40, "ttl_s": 50}}',
            "gives the key 'ttl_s' twice in one object",
        ),
        # A whole group: the first one's ttl_s was lost, and its max_hold_s below
        # ttl_s escaped the check that refuses it.
        (
            "twice.yaml",
            "lease: {ttl_s: 5, max_hold_s: 1}\nlease: {sweep_s: 1}\n",
            "gives the key 'lease' twice in one mapping (lines 1 and 2)",
        ),
        (
            "twice.yaml",
            "nixl:\n  backend_params:\n    a: '1'\n    'a': '2'\n",
            "gives the key 'a' twice in one mapping (lines 3 and 4)",
        ),
        ("twice.toml", "log_level = 'DEBUG'\nlog_level = 'ERROR'\n", "is not valid TOML"),
    ],
)
def test_a_key_given_twice_in_a_config_file_is_refused_naming_it(
    tmp_path: Path, name: str, content: str, error: str
) -> None:
    config = tmp_path / name
    config.write_text(content)
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--config", str(config)], environ={})
    assert err.value.field == "config"
    assert err.value.detail.startswith(f"{str(config)!r} {error}"), err.value.detail


def test_a_yaml_merge_may_still_be_overridden(tmp_path: Path) -> None:
    config = tmp_path / "merge.yaml"
    config.write_text("lease:\n  <<: {ttl_s: 40, sweep_s: 1}\n  ttl_s: 50\n")
    lease = load_settings(["--config", str(config)], environ={}).lease
    assert (lease.ttl_s, lease.sweep_s) == (50, 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "{a}", "--config", "{b}"],
        ["--config={a}", "--config", "{b}"],
        ["--config", "{a}", "--config={b}"],
    ],
)
def test_config_given_twice_is_refused(tmp_path: Path, argv: list[str]) -> None:
    """The first file was read, while Settings.config (argparse) said the second."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"log_level": "DEBUG"}')
    b.write_text('{"log_level": "ERROR"}')
    with pytest.raises(InvalidInputError) as err:
        load_settings([arg.format(a=a, b=b) for arg in argv], environ={})
    assert str(err.value) == (
        f"config (--config, KVXFER_CONFIG): given 2 times ({str(a)!r}, {str(b)!r}): "
        "only one file is read, give one"
    )


@pytest.mark.parametrize("via", ["flag", "variable"])
def test_a_config_file_naming_another_is_refused(tmp_path: Path, via: str) -> None:
    """A `config` key was accepted and never read."""
    other = tmp_path / "other.json"
    other.write_text('{"log_level": "DEBUG"}')
    config = tmp_path / "kvxfer.yaml"
    config.write_text(f"config: {other}\n")
    argv, environ = (
        (["--config", str(config)], {}) if via == "flag" else ([], {"KVXFER_CONFIG": str(config)})
    )
    with pytest.raises(InvalidInputError) as err:
        load_settings(argv, environ=environ)
    assert str(err.value) == (
        f"config: {str(config)!r} sets config: a file cannot name another; only --config "
        "or KVXFER_CONFIG names the file read"
    )


@pytest.mark.timeout(10)
def test_a_config_file_of_aliases_of_aliases_is_refused_at_once(tmp_path: Path) -> None:
    """Nine lines of YAML that are 9**9 values: walked for nesting and keys, it never
    ended (pydantic refused the unknown keys without reading their values)."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]"
        for p, n in zip("abcdefgh", "bcdefghi", strict=True)
    ]
    config = tmp_path / "laughs.yaml"
    config.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidInputError) as err:
        load_settings(["--config", str(config)], environ={})
    assert err.value.detail == (
        f"{str(config)!r} holds more than 100000 values (a YAML alias counts each time it is used)"
    )


def test_a_config_file_as_deep_as_the_limit_is_read(tmp_path: Path) -> None:
    config = tmp_path / "deep.json"
    config.write_text('{"lease": ' + "[" * 31 + "]" * 31 + "}")
    with pytest.raises(InvalidInputError) as err:  # read, then refused by the setting
        load_settings(["--config", str(config)], environ={})
    assert err.value.field.startswith("lease")


def test_server_exits_2_naming_a_config_file_it_cannot_read(tmp_path: Path) -> None:
    config = tmp_path / "k.yaml"
    config.write_text("yes: 1\n")
    result = subprocess.run(
        [str(BIN / "kvxfer-server"), "--config", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"kvxfer-server: config: {str(config)!r} has the key True")
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("name", ["kvxfer.ini", "kvxfer.conf", "kvxfer"])
def test_config_file_of_another_extension_is_refused(tmp_path: Path, name: str) -> None:
    config = tmp_path / name
    config.write_text('{"lease": {"ttl_s": 40}}')
    with pytest.raises(InvalidInputError, match=r"unknown extension .*\.json, \.toml, \.yaml"):
        load_settings(["--config", str(config)], environ={})


def server(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """kvxfer-server with only PATH and `env` in its environment."""
    environ = {"PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run(
        [str(BIN / "kvxfer-server"), *argv],
        capture_output=True, text=True, timeout=60, check=False, env=environ,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "env", "lines"),
    [
        (
            ["--lease.ttl-s", "0", "--faults.fail-rate", "3"],
            {},
            [
                "lease.ttl_s (--lease.ttl-s, KVXFER_LEASE__TTL_S): Input should be greater "
                "than 0, got '0'",
                "faults.fail_rate (--faults.fail-rate, KVXFER_FAULTS__FAIL_RATE): Input "
                "should be less than or equal to 1, got '3'",
            ],
        ),
        (
            [],
            {"KVXFER_PEER_ADRESS": "127.0.0.1:1"},
            [
                "KVXFER_PEER_ADRESS: no such setting; did you mean KVXFER_PEER_ADDRESS? "
                "(docs/configuration.md lists them)"
            ],
        ),
        (
            [],
            {"KVXFER_NIXL__BACKENDS": "[UCX"},
            [
                'nixl (KVXFER_NIXL*): not valid: lists are A,B or JSON ["A","B"], a whole '
                "group a JSON object"
            ],
        ),
        (
            [],
            {"KVXFER_PEER_ADDRESS": "nohost"},
            [
                "peer_address (--peer-address, KVXFER_PEER_ADDRESS): must be HOST:PORT "
                "with a port in 0-65535, got 'nohost'"
            ],
        ),
    ],
)
def test_server_names_each_bad_setting_on_its_own_line(
    argv: list[str], env: dict[str, str], lines: list[str]
) -> None:
    result = server(*argv, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"kvxfer-server: {line}" for line in lines]


def test_server_serves_with_comma_list_variables(tmp_path: Path) -> None:
    """The variables that crashed the server with a 44-line SettingsError start it."""
    env = {
        **os.environ,
        "KVXFER_NIXL__BACKENDS": "UCX",
        "KVXFER_TRANSFER__MODES": "pull,push",
    }
    argv = [
        str(BIN / "kvxfer-server"),
        "--peer-address", "127.0.0.1:0",
        "--engine-address", f"unix:{tmp_path}/e.sock",
        "--metrics-address", "127.0.0.1:0",
    ]  # fmt: skip
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        try:
            ready = json.loads(proc.stdout.readline() or "null")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=60)
    assert ready and ready["peer_address"].startswith("127.0.0.1:"), stderr[-2000:]
    assert proc.returncode == 0, stderr[-2000:]


def _open_files(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_server_refuses_a_lane_connection_limit_its_open_file_limit_cannot_hold() -> None:
    """A container's soft limit of 1024 with the default 1024 connections: descriptors ran
    out short of the limit and every port stopped accepting. The soft limit is raised to
    the hard one; where even that cannot hold the setting, the server does not start."""
    done = subprocess.run(
        [str(BIN / "kvxfer-server")],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin"}, preexec_fn=lambda: _open_files(1024, 1024),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvxfer-server: limits.max_lane_connections: 1024 ")
    assert "open-file limit (1024" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("soft", "hard", "connections", "raised"),
    [(1024, 4096, 1024, 4096), (1024, 1024, 512, 1024)],
)
def test_the_soft_open_file_limit_is_raised_to_the_hard_one(
    soft: int, hard: int, connections: int, raised: int
) -> None:
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from kvxfer.server.main import open_files_for\n"
        f"print(open_files_for({connections}), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
        cwd="/",
    )  # fmt: skip
    assert done.stdout.split() == [str(raised)] * 2, done.stderr
