"""Two "hosts" on one machine: Linux network namespaces joined by a veth pair.

`two_hosts()` creates namespaces and a veth pair named after this process (so
parallel runs never collide), gives each end an address in a private /30 that
exists only inside those namespaces, and deletes both namespaces on exit,
also after a failure (deleting a namespace destroys its veth end and the
pair with it). `Host.run(argv)` is argv as run inside a host (`ip netns exec
NAME ...`, which execs: the pid is the command's own). Needs root and
iproute2; `unavailable()` says why not. Used by the multi-host test tier
(tests/netns.py) and `kvxfer-cli bench --multihost` (bench_multihost.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
