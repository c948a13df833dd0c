"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair.

`two_hosts()`, `Host` and `unavailable()` (why not, for a skip) live in
`kvxfer.cli.hosts`, shared with `kvxfer-cli bench --multihost`.
`isolated_host()` is one namespace with loopback only: nothing started in it
can send a packet anywhere else. `start_sidecar` / `start_engine` run the
real processes inside a host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from sidecars import EngineSim

from kvxfer.cli.fleet import BIN, Proc, spawn
from kvxfer.cli.hosts import SUBNET, Host, ip, two_hosts, unavailable

__all__ = ["SUBNET", "Host", "ip", "two_hosts", "unavailable"]


@contextlib.contextmanager
def isolated_host() -> Iterator[Host]:
    """One namespace with only loopback (up): no route leads out of it."""
    host = Host(f"kvx-{os.getpid() % 100_000}-iso", "lo", "127.0.0.1")
    ip("netns", "add", host.netns)
    try:
        host.set_link(up=True)
        yield host
    finally:
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", host.netns)


def insecure_peer_args(host: Host) -> tuple[str, ...]:
    """Flags letting a sidecar serve PeerService on its namespace's (non-loopback) address
    without mTLS: the sidecar refuses that unless told explicitly. The tier is about the
    data path between hosts; mTLS has its own tests (test_sidecar_tls, test_peer_security).
    Every namespaced sidecar of the suite is started through here."""
    del host
    return ("--insecure-peer-port",)


def start_sidecar(tmp: Path, host: Host, name: str, *args: str, env: Sequence[str] = ()) -> Proc:
    """A kvxfer-server inside `host`, its peer port on the host's address; `env` as
    NAME=VALUE strings for its environment (UCX settings)."""
    argv = host.run([
        "env", *env,
        str(BIN / "kvxfer-server"),
        "--peer-address", f"{host.address}:0",
        "--engine-address", f"unix:{tmp / name}.sock",
        "--metrics-address", "127.0.0.1:0",
        "--sidecar-id", name,
        *insecure_peer_args(host),
        *args,
    ])  # fmt: skip
    return spawn(f"sidecar {name}", argv, _fresh(tmp / f"{name}.log"))


def start_engine(tmp: Path, host: Host, sidecar: Proc, role: str, *args: str) -> EngineSim:
    """A `kvxfer-cli engine-sim` inside `host`, registered with `sidecar`."""
    argv = host.run([
        str(BIN / "kvxfer-cli"), "engine-sim",
        "--sidecar", sidecar.ready["engine_address"],
        "--role", role,
        *args,
    ])  # fmt: skip
    log = _fresh(tmp / f"engine-{role}-{sidecar.ready['sidecar_id']}.log")
    return EngineSim(spawn(f"engine-sim {role}", argv, log))


def _fresh(path: Path) -> Path:
    n = 1
    candidate = path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate
