"""The sidecar's one configuration object.

Every setting comes from, highest priority first: command-line flags
(`--peer-address`, `--lease.ttl-s`), `KVXFER_*` environment variables
(`KVXFER_PEER_ADDRESS`, `KVXFER_LEASE__TTL_S`), a JSON, TOML or YAML file named by
`--config` / `KVXFER_CONFIG`, then the defaults below. Lists are comma lists in flags
and variables (`KVXFER_NIXL__BACKENDS=UCX,GDS`). Unknown keys are errors everywhere
(`extra="forbid"`, and unknown `KVXFER_*` variables): a misspelt setting never falls
back silently. The sources and the error format are server/settings_sources.py.
Built once in `main()` and passed down; nothing reads it at import time.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import typing
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvxfer._exceptions import InvalidInputError
from kvxfer.core.planner import DEFAULT_CHUNK_BLOCKS
from kvxfer.core.requests import TransferMode, check_address, check_request_id
from kvxfer.server.settings_sources import (
    PREFIX,
    EnvSource,
    cli_source,
    empty_entry,
    problems,
    read_file,
    refused_flags,
    setting_name,
    unknown_env_names,
)
from kvxfer.wire.loops import DEFAULT_EVENT_LOOP, EventLoop
from kvxfer.wire.tls import certificate_problem, key_problem

CONFIG_ENV = "KVXFER_CONFIG"


class _NumbersNotBooleans:
    """Every int and float setting of a model refuses true and false: pydantic reads them
    as 1 and 0, so a YAML `shutdown_grace_s: off` was a grace of 0 and `ttl_s: on` a
    lease of one second. A number given as text (a flag, a variable) is still parsed."""

    @field_validator("*", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = typing.cast(type[BaseModel], cls).model_fields[info.field_name].annotation
            kinds = typing.get_args(annotation) or (annotation,)  # int | None: (int, None)
            if bool not in kinds and (int in kinds or float in kinds):
                kind = "an integer" if int in kinds else "a number"
                raise ValueError(f"Input should be {kind}, not a boolean")
        return value


class _Group(_NumbersNotBooleans, BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_MAX_TTL_S = 3600


class LeaseSettings(_Group):
    ttl_s: float = Field(
        30.0, gt=0, le=_MAX_TTL_S, description="how long a published request is held"
    )
    max_hold_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="the longest a reader's holds (HoldLeases, while its request waits in "
        "its engine's queue) keep a published request nobody reads yet, from its publish; "
        "at least ttl_s (unset: 600, or ttl_s if that is longer)",
    )
    sweep_s: float = Field(0.25, gt=0, le=60, description="how often expired leases are swept")

    @model_validator(mode="before")
    @classmethod
    def _hold_at_least_a_ttl(cls, data: Any) -> Any:
        """Unset, max_hold_s follows a ttl_s raised past its default: a configuration that
        set only a long TTL (the mitigation before holds existed) keeps working. Set below
        ttl_s, it is refused (`Settings._deadlines`)."""
        fields = cls.model_fields
        if isinstance(data, dict) and "max_hold_s" not in data:
            with contextlib.suppress(TypeError, ValueError):
                ttl = float(data.get("ttl_s", fields["ttl_s"].default))
                # Only a TTL of its own range: one out of it is refused as ttl_s alone.
                if fields["max_hold_s"].default < ttl <= _MAX_TTL_S:
                    return {**data, "max_hold_s": ttl}
        return data


class LaneSettings(_Group):
    """The peer lane (server/peer_lane.py): a reader's per-request calls to this sidecar
    over a framed TCP connection instead of gRPC."""

    enabled: bool = Field(
        True,
        description="serve the peer lane beside the peer port and use peers' lanes; off: "
        "every peer call goes over gRPC",
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="its TCP port on the peer port's host (0: any free port); peers learn "
        "it from the handshake, so it must be reachable wherever the peer port is",
    )


class TransferSettings(_Group):
    stall_deadline_s: float = Field(
        10.0, gt=0, le=600, description="a chunk not done by then fails and is released"
    )
    chunk_blocks: int = Field(
        DEFAULT_CHUNK_BLOCKS, ge=1, le=1 << 20, description="logical blocks per NIXL handle"
    )
    max_inflight_chunks: int = Field(
        32, ge=1, le=4096, description="NIXL handles posted at once per pull or push"
    )
    rpc_timeout_s: float = Field(5.0, gt=0, le=300, description="deadline of each peer RPC")
    agents_per_peer: int = Field(
        2,
        ge=1,
        le=16,
        description="NIXL agents, each with a thread of its own, that read from one peer "
        "into one engine (or write to it); another is opened only while every open one is "
        "busy, so that many transfers at once copy on more than one core",
    )
    idle_agent_s: float = Field(
        600.0,
        ge=1,
        le=86400,
        description="a reading (or writing) agent no transfer used for this long is "
        "closed, with its thread and its registration of the engine's memory, and a peer "
        "address no transfer used for this long is forgotten (its links, loaded NIXL "
        "agent, channel and lanes; the next pull handshakes again): a peer that went "
        "away does not keep any of it until the engine or the sidecar leaves",
    )
    modes: tuple[TransferMode, ...] = Field(
        (TransferMode.PULL, TransferMode.PUSH),
        min_length=1,
        description="transfer modes this sidecar takes part in: pull (peers read what it "
        "publishes, it reads from peers) and push (peers write what it expects, it writes "
        "to peers); the engines choose per request, pull unless they Expect/Push",
    )

    @field_validator("modes")
    @classmethod
    def _modes(cls, value: tuple[TransferMode, ...]) -> tuple[TransferMode, ...]:
        twice = sorted({mode.value for mode in value if value.count(mode) > 1})
        if twice:  # a typo for the other mode, most likely: not silently one
            raise ValueError(f"{', '.join(twice)} listed twice")
        return value

    end_read_patience_s: float = Field(
        300.0,
        ge=0,
        le=3600,
        description="how long a finished pull keeps retrying EndRead at a peer that does not "
        "answer (a stalled or frozen peer holds the lease until it hears it)",
    )


class LimitSettings(_Group):
    max_message_bytes: int = Field(
        64 << 20, ge=1 << 16, le=1 << 30, description="largest gRPC message accepted"
    )
    max_blocks_per_request: int = Field(
        1 << 20, ge=1, description="block ids in one publish or pull, all groups together"
    )
    max_inflight_pulls_per_peer: int = Field(
        256, ge=1, description="pulls running at once against one peer"
    )
    max_queued_pulls_per_peer: int = Field(
        4096,
        ge=0,
        le=1 << 20,
        description="pulls against one peer accepted beyond the running ones, waiting "
        "for a slot in arrival order; only a pull beyond both is refused",
    )
    max_leases: int = Field(100_000, ge=1, description="published requests held at once")
    max_engines: int = Field(64, ge=1, description="engines registered at once")
    max_pending_events: int = Field(
        100_000, ge=16, description="events queued per engine while nobody watches"
    )
    max_calls_per_peer: int = Field(
        512,
        ge=1,
        le=65536,
        description="PeerService/AdminService calls one client (certificate, or host "
        "without TLS) runs at once",
    )
    max_lane_connections: int = Field(
        1024,
        ge=1,
        le=65536,
        description="peer lane connections served at once (a peer sidecar uses one); "
        "beyond, a connection is refused before any of its calls runs and its caller "
        "uses gRPC",
    )
    max_heartbeat_ids: int = Field(
        4096, ge=1, le=1 << 20, description="request ids in one Heartbeat"
    )
    max_peer_labels: int = Field(
        64, ge=1, le=4096, description="peer addresses with metric labels of their own"
    )


def _no_empty_entries(values: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list's entries, refused if one is empty: `a,,b` is a typo (a variable's
    one trailing comma is dropped before; a map's entries and a flag's are checked
    there too: `settings_sources.empty_entry`)."""
    problem = empty_entry(values)
    if problem:
        raise ValueError(problem)
    return values


class NixlSettings(_Group):
    backends: tuple[str, ...] = Field(("UCX",), min_length=1, description="NIXL backends")
    num_threads: int = Field(
        0, ge=0, le=256, description="NIXL/UCX worker threads (0: NIXL's own choice)"
    )
    enable_prog_thread: bool = Field(
        False,
        description="NIXL's own progress thread: it spins a core even when idle; the "
        "sidecar drives progress itself unless this is on",
    )
    backend_params: dict[str, str] = Field(
        default_factory=dict, description="extra backend parameters, e.g. num_workers"
    )

    @field_validator("backends")
    @classmethod
    def _backends(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        value = _no_empty_entries(value)
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice: NIXL creates each backend once")
        return value

    @field_validator("backend_params")
    @classmethod
    def _params(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not key.strip() for key in value):
            raise ValueError("a parameter has an empty name: expected KEY=VALUE[,KEY=VALUE...]")
        # A flag's `a = 1` reads as a variable's does: NIXL would not know the name 'a '.
        stripped = {key.strip(): val.strip() for key, val in value.items()}
        if len(stripped) < len(value):
            raise ValueError("a parameter is given twice (names differing only in spaces)")
        return stripped


class TlsSettings(_Group):
    cert_file: Path | None = Field(None, description="server/client certificate (PEM)")
    key_file: Path | None = Field(None, description="private key (PEM)")
    ca_file: Path | None = Field(None, description="CA that signs peer certificates (PEM)")
    allowed_peers: tuple[str, ...] = Field(
        (),
        description="peer certificate common names allowed (empty: any the CA signed); "
        "only with mTLS (tls.cert_file, tls.key_file, tls.ca_file)",
    )

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    # The files are loaded here, as the sidecar will load them: one that is not PEM (or a
    # key not the certificate's) stops it naming the setting, not with an ssl traceback.
    @field_validator("cert_file", "ca_file")
    @classmethod
    def _certificates(cls, value: Path | None) -> Path | None:
        return _checked(value, None if value is None else certificate_problem(value))

    @field_validator("key_file")
    @classmethod
    def _key(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        # A key is checked as the certificate's; without a good one (refused above, or
        # missing: _complete) there is nothing to check it against.
        certificate = info.data.get("cert_file")
        if value is None or certificate is None:
            return value
        return _checked(value, key_problem(certificate, value))

    @field_validator("allowed_peers")
    @classmethod
    def _peers(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # Without a certificate no peer has a name to check, and every peer call would
        # be refused at runtime: refused here instead.
        if value and "cert_file" in info.data and info.data["cert_file"] is None:
            raise ValueError(
                "names peers by their certificates, but mTLS is off: set tls.cert_file, "
                "tls.key_file and tls.ca_file too, or leave tls.allowed_peers empty"
            )
        return _no_empty_entries(value)

    @model_validator(mode="after")
    def _complete(self) -> TlsSettings:
        given = [f for f in ("cert_file", "key_file", "ca_file") if getattr(self, f) is not None]
        if given and len(given) != 3:
            raise ValueError("mTLS needs cert_file, key_file and ca_file together")
        return self


def _checked(path: Path | None, problem: str | None) -> Path | None:
    """`path`, unless there is a `problem` with it."""
    if problem:
        raise ValueError(problem)
    return path


class FaultSettings(_Group):
    """Fault injection for tests and the demo: never set in production. A sidecar
    started with faults logs a warning and exports kvxfer_fault_injection 1."""

    fail_rate: float = Field(0.0, ge=0, le=1, description="fail this fraction of NIXL handles")
    stall_rate: float = Field(
        0.0, ge=0, le=1, description="stall this fraction of NIXL handles until their deadline"
    )
    seed: int = Field(0, ge=0, description="seed of the fault draws")

    @property
    def enabled(self) -> bool:
        return self.fail_rate > 0 or self.stall_rate > 0


class Settings(_NumbersNotBooleans, BaseSettings):
    """kvxfer-server: the KV-cache transfer sidecar of one prefill or decode engine."""

    model_config = SettingsConfigDict(
        env_prefix="KVXFER_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        cli_kebab_case=True,
        cli_prog_name="kvxfer-server",
        cli_implicit_flags=True,
        cli_avoid_json=True,
    )

    config: Path | None = Field(None, description="settings file: .json, .toml, .yaml or .yml")
    peer_address: str = Field("127.0.0.1:7500", description="HOST:PORT peers dial (PeerService)")
    advertise_address: str | None = Field(
        None, description="HOST:PORT peers are told to dial; unset: the bound --peer-address"
    )
    engine_address: str = Field(
        "unix:/tmp/kvxfer-engine.sock", description="unix:PATH or HOST:PORT for engines"
    )
    insecure_engine_tcp: bool = Field(
        False,
        description="INSECURE: allow a TCP engine_address (even loopback). TCP callers are "
        "not identified and their deaths not detected; any process reaching the port can "
        "register memory and read published KV. Use unix:PATH",
    )
    metrics_address: str = Field("127.0.0.1:9400", description="HOST:PORT of /metrics")
    sidecar_id: str = Field("", description="name in logs and peers' views; unset: the hostname")
    shutdown_grace_s: float = Field(10.0, ge=0, le=600, description="SIGTERM grace period")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    event_loop: EventLoop = Field(
        DEFAULT_EVENT_LOOP,
        description="the sidecar's event loop: uvloop (libuv's: scheduling and socket I/O in "
        "C, a little faster here), or Python's own asyncio",
    )
    gil_switch_interval_s: float = Field(
        0.0001,
        ge=1e-6,  # sys.setswitchinterval takes less, but runs it as 0 (microseconds)
        le=0.1,
        description="how long the event loop may keep the GIL while a NIXL thread waits "
        "for it (Python's own interval is 0.005): each post and end of a copy takes the GIL, "
        "so while the loop is busy (a burst of pulls) every copy would wait that long, twice",
    )
    insecure_peer_port: bool = Field(
        False,
        description="INSECURE: serve PeerService without mTLS on a non-loopback address; "
        "anyone who reaches it can read and write registered KV memory",
    )
    lease: LeaseSettings = LeaseSettings()
    lane: LaneSettings = LaneSettings()
    transfer: TransferSettings = TransferSettings()
    limits: LimitSettings = LimitSettings()
    nixl: NixlSettings = NixlSettings()
    tls: TlsSettings = TlsSettings()
    faults: FaultSettings = FaultSettings()

    @field_validator("peer_address", "metrics_address")
    @classmethod
    def _bind(cls, value: str, info: Any) -> str:
        return check_address(value, info.field_name, allow_port_zero=True)

    @field_validator("advertise_address")
    @classmethod
    def _advertise(cls, value: str | None) -> str | None:
        return None if value is None else check_address(value, "advertise_address")

    @field_validator("engine_address")
    @classmethod
    def _engine(cls, value: str) -> str:
        value = check_address(value, "engine_address", allow_unix=True, allow_port_zero=True)
        path = value.removeprefix("unix:").removeprefix("//")
        if value.startswith("unix:") and not path.startswith("/"):
            # Relative to the sidecar's working directory, which its engines do not share.
            raise ValueError(f"a unix socket needs an absolute path, got {value!r}")
        return value

    @field_validator("sidecar_id")
    @classmethod
    def _sidecar_id(cls, value: str) -> str:
        # In log lines and in peers' views (their labels): no spaces, newlines or controls.
        return value and check_request_id(value, "sidecar_id")

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError(f"must be DEBUG, INFO, WARNING or ERROR, got {value!r}")
        return value.upper()

    @model_validator(mode="after")
    def _engine_socket(self) -> Settings:
        if not self.engine_address.startswith("unix:") and not self.insecure_engine_tcp:
            raise ValueError(
                f"engine_address: {self.engine_address!r} is TCP; the engine service only "
                "listens on unix:PATH (0600, callers identified by SO_PEERCRED) unless "
                "--insecure-engine-tcp is given"
            )
        return self

    @model_validator(mode="after")
    def _peer_port_secure(self) -> Settings:
        host = self.peer_address.rpartition(":")[0]
        if not self.tls.enabled and not self.insecure_peer_port and not is_loopback(host):
            raise ValueError(
                f"peer_address {self.peer_address!r} is not loopback and tls.* is not set: "
                "PeerService hands out NIXL metadata that lets any client read and write "
                "registered KV memory. Configure mTLS (tls.cert_file, tls.key_file, "
                "tls.ca_file) or, on a network you trust, pass --insecure-peer-port "
                "(KVXFER_INSECURE_PEER_PORT=true)"
            )
        return self

    @model_validator(mode="after")
    def _lane_reachable(self) -> Settings:
        if self.advertise_address is not None and self.lane.enabled and not self.lane.port:
            raise ValueError(
                f"lane.port: peers dial the peer lane at the advertised host "
                f"({self.advertise_address!r}) on the port the handshake names, and a port "
                "taken at random is not one a Service or a firewall forwards: set lane.port "
                "to a port forwarded like the peer port's, or lane.enabled false"
            )
        return self

    @model_validator(mode="after")
    def _deadlines(self) -> Settings:
        if self.lease.max_hold_s < self.lease.ttl_s:
            raise ValueError(
                f"lease.max_hold_s ({self.lease.max_hold_s}) must be at least lease.ttl_s "
                f"({self.lease.ttl_s}): a hold never shortens a lease"
            )
        if self.transfer.stall_deadline_s >= self.lease.ttl_s:
            raise ValueError(
                f"transfer.stall_deadline_s ({self.transfer.stall_deadline_s}) must be below "
                f"lease.ttl_s ({self.lease.ttl_s}): "
                "a stalled read must fail before its lease lapses"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags come first, from the CliSettingsSource load_settings passes in.
        load = _LOADING.get() or _Load(os.environ, None)
        return (init_settings, EnvSource(settings_cls, load.environ), _FileSource(load.path))


def is_loopback(host: str) -> bool:
    """`127.0.0.0/8`, `::1` and `localhost` are loopback; wildcards (`0.0.0.0`, `[::]`)
    and every other name are not, since a name may resolve anywhere."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SettingsInvalidError(InvalidInputError):
    """Settings that cannot be used; `problems` holds one (field, message) per field,
    and the message is one line for each."""

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        super().__init__(problems[0][0], problems[0][1])
        self.problems = tuple(problems)
        self.args = ("\n".join(f"{field}: {message}" for field, message in problems),)

    def __str__(self) -> str:
        return str(self.args[0])


def setting_refused(path: tuple[str, ...], message: str) -> SettingsInvalidError:
    """A setting found wrong only once it is used (a NIXL backend `nixl.*` names that NIXL
    refuses), named as load_settings names one: the sidecar exits 2 as for those."""
    return SettingsInvalidError([(setting_name(path), message)])


@dataclass(frozen=True)
class _Load:
    environ: Mapping[str, str]
    path: Path | None


# What load_settings is reading from; Settings(...) built directly reads os.environ.
_LOADING: ContextVar[_Load | None] = ContextVar("kvxfer_settings_loading", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The `--config` file; its path is found before the other sources are read."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        data = read_file(self.path)
        if "config" in data:  # it was accepted, and never read
            raise InvalidInputError(
                "config",
                f"{str(self.path)!r} sets config: a file cannot name another; "
                f"only --config or {CONFIG_ENV} names the file read",
            )
        return data


EPILOG = """\
Each setting is also read from its KVXFER_* variable (shown in brackets) and from the
--config file (.json, .toml, .yaml or .yml); flags win over variables, variables over
the file. Lists are comma lists (--nixl.backends UCX,GDS; KVXFER_TLS__ALLOWED_PEERS=a,b).
Reference: docs/configuration.md.

exit codes: 0 stopped cleanly; 1 failed while serving (a port could not be bound, ...);
2 bad settings (one line per field) or usage."""


def load_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from flags, environment and file; SettingsInvalidError names each
    field that is wrong, and `--help`/`--version`/bad flags exit (SystemExit) as argparse
    does."""
    env = os.environ if environ is None else environ
    unknown = unknown_env_names(Settings, env)
    if unknown:
        raise SettingsInvalidError(unknown)
    cli = cli_source(Settings, "kvxfer-server", EPILOG)
    token = _LOADING.set(_Load(env, _config_path(argv, env)))
    try:
        flags = cli(args=list(argv))
        refused = refused_flags(flags)
        try:
            settings = Settings(_cli_settings_source=flags)
        except ValidationError as exc:
            raise _invalid(refused, problems(exc, Settings)) from exc
        except SettingsError as exc:
            cause = exc.__cause__
            if isinstance(cause, InvalidInputError):
                raise _invalid(refused, [(cause.field, cause.detail)]) from exc
            raise _invalid(refused, [_env_error(str(exc))]) from exc
        if refused:
            raise _invalid(refused, [])
        return settings
    finally:
        _LOADING.reset(token)


def _invalid(
    refused: Sequence[tuple[str, str, str]], others: Sequence[tuple[str, str]]
) -> SettingsInvalidError:
    """The flags refused as they were parsed, then every other field's problem but what
    those flags' own values caused again (an empty list entry is refused twice)."""
    fields = [dotted for dotted, _, _ in refused]
    rest = [
        (name, message)
        for name, message in others
        if not any(name == f or name.startswith((f + " ", f + ".")) for f in fields)
    ]
    return SettingsInvalidError([(shown, why) for _, shown, why in refused] + rest)


_PARSE_ERROR = re.compile(r'error parsing value for field "(\w+)" from source "(\w+)"')


def _env_error(message: str) -> tuple[str, str]:
    """pydantic-settings' 'error parsing value for field "nixl" from source "EnvSource"'
    as the flag or variables to fix; only a field of Settings is named so (anything
    else is passed on as it is, never read as a name)."""
    found = _PARSE_ERROR.search(message)
    if found is None or found[1] not in Settings.model_fields:
        return "settings", message
    field, source = found[1], found[2]
    where = (
        f"--{field.replace('_', '-')}"
        if "Cli" in source
        else f"{PREFIX}{field.upper()}*"
        if "Env" in source
        else "--config"
    )
    return (
        f"{field} ({where})",
        'not valid: lists are A,B or JSON ["A","B"], a whole group a JSON object',
    )


def _config_path(argv: Sequence[str], env: Mapping[str, str]) -> Path | None:
    """The file `--config` names, else KVXFER_CONFIG's. Given twice, it is refused: the
    file is read from here, before the flags are parsed, so a second one would be
    shown as `config` while the first was read."""
    given = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            given.append(argv[i + 1])
        elif arg.startswith("--config="):
            given.append(arg.split("=", 1)[1])
    if len(given) > 1:
        files = ", ".join(repr(g) for g in given)
        raise SettingsInvalidError(
            [
                (
                    setting_name(("config",)),
                    f"given {len(given)} times ({files}): only one file is read, give one",
                )
            ]
        )
    if given:
        return Path(given[0])
    value = env.get(CONFIG_ENV)
    return Path(value) if value else None
