"""`kvxfer-cli bench --multihost`: the same bench with the prefill side on one "host"
and the decode side on another, over UCX TCP (issue 13, multi-host numbers).

The two hosts are network namespaces joined by a veth pair (`kvxfer.cli.hosts`, the
multi-host test tier's): host A runs the prefill sidecar and engines, host B the
decode sidecar and engines and the bench itself, so the bench's raw NIXL agent reads
over the same path as the decode sidecar: `UCX_TLS=tcp,self`, `UCX_NET_DEVICES` each
host's end of the veth. The prefill sidecar serves peers on A's address (insecure:
the link exists only between these two namespaces); engines reach their sidecars
through unix sockets and shared memory, which namespaces do not separate.

Run as root: the command makes the namespaces, runs itself again inside B (with
`KVX_BENCH_HOSTS` naming both hosts), which prints the report, and deletes the
namespaces afterwards, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.fleet import BIN, Fleet, Placement, local_fleet
from kvxfer.cli.hosts import Host, two_hosts, unavailable

ENV = "KVX_BENCH_HOSTS"  # not KVXFER_*: the sidecars take those as settings
UCX_TLS = "tcp,self"


def inside() -> tuple[Host, Host] | None:
    """(prefill host, decode host) when this process is the bench inside host B."""
    text = os.environ.get(ENV)
    if not text:
        return None
    a, b = json.loads(text)
    return Host(**a), Host(**b)


def run_in_hosts(argv: Sequence[str]) -> int:
    """Make the two hosts, run `kvxfer-cli ARGV` inside B, delete the hosts; its exit code."""
    why = unavailable()
    if why is not None:
        raise InvalidInputError("--multihost", why)
    with two_hosts() as (a, b):
        env = [f"{ENV}={json.dumps([asdict(a), asdict(b)])}", *ucx_env(b)]
        command = b.run(["env", *env, str(BIN / "kvxfer-cli"), *argv])
        child = subprocess.Popen(command)
        try:
            return child.wait()
        except KeyboardInterrupt:  # the child got the same SIGINT: let it clean up
            return child.wait()


def ucx_env(host: Host) -> list[str]:
    return [f"UCX_TLS={UCX_TLS}", f"UCX_NET_DEVICES={host.device}"]


class HostFleet(Fleet):
    """The prefill sidecar ("p") and its engines on host A; the rest here, on B."""

    def __init__(self, workdir: Path, prefill: Host) -> None:
        super().__init__(workdir)
        self.prefill = prefill

    def placement(self, sidecar_id: str) -> Placement:
        if sidecar_id != "p":
            return Placement()
        return Placement(
            prefix=tuple(self.prefill.run(["env", *ucx_env(self.prefill)])),
            peer_host=self.prefill.address,
            sidecar_args=("--insecure-peer-port",),  # a link only these namespaces share
        )


def host_fleet(hosts: tuple[Host, Host]) -> contextlib.AbstractContextManager[Fleet]:
    """`local_fleet`'s directory and cleanup, the prefill side placed on host A."""
    return local_fleet(
        "kvxfer-bench-hosts-", "kvxfer-cli bench", lambda workdir: HostFleet(workdir, hosts[0])
    )


def describe(hosts: tuple[Host, Host]) -> dict[str, Any]:
    """What the report says about the path between the sides (while the hosts exist)."""
    a, b = hosts
    return {
        "transport": f"UCX_TLS={UCX_TLS} over a veth pair between two network namespaces",
        "prefill_host": a.address,
        "decode_host": b.address,
        "prefill_link_tx_bytes": a.tx_bytes(),  # since the link was made: this run's
    }
