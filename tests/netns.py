"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair.

`two_hosts()` creates namespaces and a veth pair named after this process (so
parallel runs never collide), gives each end an address in a private /30 that
exists only inside those namespaces, and deletes both namespaces on exit,
also after a failure (deleting a namespace destroys its veth end and the
pair with it). Processes are started inside a host with `host.run(argv)`'s
prefix (`ip netns exec NAME ...`, which execs: the pid is the command's own).
Needs root and iproute2; `unavailable()` says why not, for a skip.
`isolated_host()` is one namespace with loopback only: nothing started in it
can send a packet anywhere else. `start_sidecar` / `start_engine` run the
real processes inside a host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sidecars import EngineSim

from kvxfer.cli.fleet import BIN, Proc, spawn

# A /30 inside the two namespaces only: nothing outside them ever sees it.
SUBNET = "10.213.47.{}/30"


@dataclass(frozen=True)
class Host:
    netns: str
    device: str  # its end of the veth pair
    address: str  # IPv4 of that end

    def run(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def tx_bytes(self) -> int:
        """Bytes sent so far out of this host's end of the link."""
        result = subprocess.run(
            ["ip", "-n", self.netns, "-s", "-j", "link", "show", "dev", self.device],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return int(json.loads(result.stdout)[0]["stats64"]["tx"]["bytes"])

    def set_link(self, *, up: bool) -> None:
        """Take this host's end of the link down, or bring it back up."""
        ip("-n", self.netns, "link", "set", self.device, "up" if up else "down")


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def unavailable() -> str | None:
    """Why network namespaces cannot be created here, or None if they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvx-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Hosts A (10.213.47.1) and B (10.213.47.2), each with loopback up."""
    tag = f"{os.getpid() % 100_000}"
    a = Host(f"kvx-{tag}-a", f"kvx{tag}a", SUBNET.format(1).split("/")[0])
    b = Host(f"kvx-{tag}-b", f"kvx{tag}b", SUBNET.format(2).split("/")[0])
    created: list[str] = []
    try:
        for host in (a, b):
            ip("netns", "add", host.netns)
            created.append(host.netns)
        ip("link", "add", a.device, "netns", a.netns, "type", "veth",
           "peer", "name", b.device, "netns", b.netns)  # fmt: skip
        for index, host in enumerate((a, b), start=1):
            ip("-n", host.netns, "addr", "add", SUBNET.format(index), "dev", host.device)
            ip("-n", host.netns, "link", "set", "lo", "up")
            host.set_link(up=True)
        yield a, b
    finally:
        for netns in created:
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", netns)


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
