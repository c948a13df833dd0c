"""`kvxfer-server`: the sidecar process.

Starts two gRPC servers (PeerService for peer sidecars, EngineService for
engines; AdminService, health checking and reflection on both), the engine
lane beside a unix engine socket (server/lane.py), the
Prometheus endpoint and the NIXL agent, then prints one JSON line with the
bound addresses and epoch to stdout (port 0 binds a free port) and serves
until SIGTERM or SIGINT. Shutdown is graceful: no new work, in-flight pulls
get the grace period, leases are released and reported, buffers deregistered.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import start_http_server

from kvxfer._exceptions import BackendCreationError, InvalidInputError, KvxferError
from kvxfer.dataplane.adapter import AgentOptions, NixlAgent, TransferBackend
from kvxfer.dataplane.faults import FaultInjectingBackend, random_faults
from kvxfer.dataplane.readers import Readers
from kvxfer.dataplane.serving import ServingAgent
from kvxfer.server.guard import PEER_SERVER_MAX_RECEIVE_BYTES, EngineSocketGuard, PeerPortGuard
from kvxfer.server.lane import EngineLane
from kvxfer.server.metrics import Metrics
from kvxfer.server.peer_lane import PeerLane
from kvxfer.server.peers import server_options
from kvxfer.server.reflection import enable_reflection
from kvxfer.server.servicers import AdminServicer, EngineServicer, PeerServicer
from kvxfer.server.settings import (
    Settings,
    SettingsInvalidError,
    is_loopback,
    load_settings,
    setting_refused,
)
from kvxfer.server.sidecar import Sidecar
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.lane import lane_path
from kvxfer.wire.loops import loop_name
from kvxfer.wire.loops import run as run_on

log = logging.getLogger("kvxfer.server")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except InvalidInputError as exc:
        return _bad_settings(exc)
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The NIXL threads and the event loop share the GIL: see the setting's description.
    sys.setswitchinterval(settings.gil_switch_interval_s)
    try:
        open_files_for(settings.limits.max_lane_connections)
    except InvalidInputError as exc:
        return _bad_settings(exc)
    try:
        return run_on(serve(settings), settings.event_loop)
    except SettingsInvalidError as exc:  # one only its use shows wrong: nixl.*
        return _bad_settings(exc)
    except KvxferError as exc:
        print(f"kvxfer-server: {exc}", file=sys.stderr)
        return 1


# Descriptors the sidecar needs besides its peer-lane connections: listeners, gRPC's
# connections, engine lanes, shared memory, NIXL's and UCX's.
OWN_FILES = 256


def open_files_for(lane_connections: int) -> int:
    """Raise this process's soft open-file limit to its hard limit and return it; refuse
    (naming the setting) when that leaves no room for `lane_connections` peer-lane
    connections and the sidecar's own. Containers often start with a soft limit of 1024:
    without this, connections short of the setting's limit exhaust the descriptors and
    every port of the sidecar stops accepting, instead of the one beyond being turned
    away."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):  # the kernel's cap may be lower
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and lane_connections + OWN_FILES > soft:
        raise InvalidInputError(
            "limits.max_lane_connections",
            f"{lane_connections} connections and {OWN_FILES} descriptors of the sidecar's "
            f"own exceed its open-file limit ({soft}, the hard limit): lower the setting "
            "or raise the limit (ulimit -Hn, the container's nofile)",
        )
    return int(soft)


def _bad_settings(exc: InvalidInputError) -> int:
    for line in str(exc).splitlines():  # one line per field
        print(f"kvxfer-server: {line}", file=sys.stderr)
    return 2


async def serve(settings: Settings) -> int:
    metrics = Metrics()
    backend, readers = await _data_plane(settings, metrics)
    sidecar = Sidecar(settings, backend, metrics, readers)
    flag_insecure_listeners(settings, metrics)
    peer_servicer, guard = PeerServicer(sidecar), PeerPortGuard(settings, metrics)
    peer = _server(
        settings,
        [("peer", peer_servicer), ("admin", AdminServicer(sidecar))],
        max_receive_bytes=PEER_SERVER_MAX_RECEIVE_BYTES,
        interceptors=[guard],
    )
    # The per-request peer calls without gRPC, through the same gate (peer_lane.py).
    peer_lane = PeerLane(peer_servicer, guard, settings, metrics)
    engine_servicer = EngineServicer(sidecar)
    engine = _server(
        settings,
        [("engine", engine_servicer), ("admin", AdminServicer(sidecar))],
        interceptors=[EngineSocketGuard(metrics)],
    )
    try:
        peer_port = _bind_peer(peer.server, settings, metrics)
        if settings.lane.enabled:
            sidecar.lane_port = await peer_lane.start(settings.peer_address.rpartition(":")[0])
        # gRPC creates the socket file at bind time (not at start): umask it there.
        with _private_umask(settings.engine_address):
            engine_address = _bind_engine(engine.server, settings.engine_address)
        lane = EngineLane(engine_servicer, metrics, settings.limits.max_message_bytes)
        if engine_address.startswith("unix:"):
            await lane.start(lane_path(engine_address))
        metrics_http, metrics_port = _start_metrics(settings.metrics_address, metrics)
    except KvxferError:
        await backend.close()
        raise
    if settings.advertise_address is None:
        sidecar.address = _with_port(settings.peer_address, peer_port)
    await peer.start()
    await engine.start()
    sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {
        "peer_address": sidecar.address,
        "engine_address": engine_address,
        "engine_lane": lane.path,
        "peer_lane_port": sidecar.lane_port,
        "metrics_address": _with_port(settings.metrics_address, metrics_port),
        "epoch": sidecar.epoch,
        "sidecar_id": sidecar.sidecar_id,
        "pid": os.getpid(),
        "event_loop": loop_name(loop),
        # As Python keeps it (0.1 ms reads back as 9.999999999999999e-05), to the ns.
        "gil_switch_interval_s": round(sys.getswitchinterval(), 9),
        "frozen_objects": settle_heap(),
    }
    print(json.dumps(ready), flush=True)
    log.info("serving: %s", ready)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", settings.shutdown_grace_s)
    await peer.drain()
    await engine.drain()
    await sidecar.shutdown(settings.shutdown_grace_s)
    await lane.close()
    await peer_lane.close()
    await engine.server.stop(1.0)
    await peer.server.stop(1.0)
    metrics_http.shutdown()
    await backend.close()
    log.info("stopped")
    return 0


async def _data_plane(settings: Settings, metrics: Metrics) -> tuple[ServingAgent, Readers]:
    """The serving agent (started, in a child process: dataplane/serving.py) and the
    readers' agents (here), with faults injected on the reading side when configured."""
    nixl = settings.nixl
    options = AgentOptions(
        backends=nixl.backends,
        num_threads=nixl.num_threads,
        enable_prog_thread=nixl.enable_prog_thread,
        backend_params=tuple(nixl.backend_params.items()),
    )
    backend = ServingAgent("kvxfer-sidecar", options)
    try:
        await backend.start()
    except BackendCreationError as exc:
        # NIXL refused a backend as the settings name or configure it: they are wrong.
        raise setting_refused(("nixl", exc.option), str(exc)) from exc
    faults = settings.faults
    rule = random_faults(faults.fail_rate, faults.stall_rate, faults.seed)
    if faults.enabled:
        log.warning("FAULT INJECTION ON: %s (testing only)", faults)
        metrics.fault_injection.set(1)

    def reader(prefix: str) -> TransferBackend:
        agent = NixlAgent(prefix, options)
        # Faults are injected on the reading side only, with one rule for all readers.
        return FaultInjectingBackend(agent, rule) if faults.enabled else agent

    readers = Readers(
        reader,
        per_pair=settings.transfer.agents_per_peer,
        idle_s=settings.transfer.idle_agent_s,
    )
    metrics.reading_agents.set_function(lambda: len(readers))  # read at each scrape
    return backend, readers


def settle_heap() -> int:
    """Collect once, then freeze what start-up left (modules, gRPC, protobuf, NIXL's
    bindings, the servers): the cyclic GC no longer scans it. A full collection of that
    heap stalls the event loop, and every pull on it, for about 16 ms on the bench
    machine; with it frozen, 0.3-0.5 ms. How many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class _Served:
    """One gRPC server with its health service: every kvxfer service it serves reports
    SERVING once started (by its full name, e.g. `kvxfer.v1.PeerService`, and as the
    server's "" status) and NOT_SERVING from the moment the sidecar starts draining."""

    server: grpc.aio.Server
    health: HealthServicer
    services: list[str]

    async def start(self) -> None:
        await self.server.start()
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        await self.health.enter_graceful_shutdown()


def _server(
    settings: Settings,
    servicers: list[tuple[str, Any]],
    *,
    max_receive_bytes: int | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> _Served:
    options = dict(server_options(settings))
    if max_receive_bytes is not None:  # refused by gRPC before the body is buffered
        options["grpc.max_receive_message_length"] = max_receive_bytes
    server = grpc.aio.server(options=list(options.items()), interceptors=interceptors)
    health = HealthServicer()
    services: list[str] = []
    for kind, servicer in servicers:
        if kind == "peer":
            pb_grpc.add_PeerServiceServicer_to_server(servicer, server)
            services.append(pb.DESCRIPTOR.services_by_name["PeerService"].full_name)
        elif kind == "engine":
            pb_grpc.add_EngineServiceServicer_to_server(servicer, server)
            services.append(pb.DESCRIPTOR.services_by_name["EngineService"].full_name)
        else:
            pb_grpc.add_AdminServiceServicer_to_server(servicer, server)
            services.append(pb.DESCRIPTOR.services_by_name["AdminService"].full_name)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    enable_reflection([health_name, *services], server)
    return _Served(server, health, services)


def _bind_peer(server: grpc.aio.Server, settings: Settings, metrics: Metrics) -> int:
    tls = settings.tls
    metrics.insecure_listeners.labels("peer").set(0)
    try:
        if tls.enabled:
            assert tls.cert_file and tls.key_file and tls.ca_file
            credentials = grpc.ssl_server_credentials(
                [(tls.key_file.read_bytes(), tls.cert_file.read_bytes())],
                root_certificates=tls.ca_file.read_bytes(),
                require_client_auth=True,
            )
            port = server.add_secure_port(settings.peer_address, credentials)
        else:
            # Settings refused a non-loopback address without TLS unless insecure_peer_port.
            insecure = not is_loopback(settings.peer_address.rpartition(":")[0])
            metrics.insecure_listeners.labels("peer").set(int(insecure))
            if insecure:
                log.warning(
                    "INSECURE PEER PORT: PeerService (and its peer lane) on %s without mTLS "
                    "(--insecure-peer-port): any host that reaches it can read and write "
                    "registered KV memory; configure tls.* outside a trusted network",
                    settings.peer_address,
                )
            port = server.add_insecure_port(settings.peer_address)
    except RuntimeError as exc:
        raise InvalidInputError("peer_address", _bind_failed(settings.peer_address, exc)) from exc
    if port == 0:
        raise InvalidInputError("peer_address", _bind_failed(settings.peer_address, None))
    return port


def _bind_failed(address: str, exc: BaseException | None) -> str:
    why = f" ({exc})" if exc else ""
    return (
        f"cannot bind {address}{why}: is another kvxfer-server (or anything else) "
        "listening there, or is the host not an address of this machine?"
    )


def _bind_engine(server: grpc.aio.Server, address: str) -> str:
    if address.startswith("unix:"):
        _claim_socket_path(address.removeprefix("unix:"))
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise InvalidInputError("engine_address", f"cannot bind {address}: {exc}") from exc
    if address.startswith("unix:"):
        return address
    if port == 0:
        raise InvalidInputError("engine_address", f"cannot bind {address}")
    return _with_port(address, port)


def _claim_socket_path(path: str) -> None:
    """Remove a socket a killed sidecar left behind; refuse one a live process serves
    (a second sidecar must not take over the first one's engines) and anything else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise InvalidInputError(
            "engine_address", f"{path} exists and is not a socket; refusing to replace it"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: stale
            return
        except OSError as exc:
            raise InvalidInputError(
                "engine_address", f"cannot check whether {path} is in use: {exc.strerror}"
            ) from exc
    raise InvalidInputError(
        "engine_address",
        f"{path} is served by another live process (another kvxfer-server?); "
        "stop it or choose another --engine-address",
    )


def flag_insecure_listeners(settings: Settings, metrics: Metrics) -> None:
    """Warn about, and count, the engine and metrics endpoints reachable beyond loopback.
    (The peer port's own check lives with its binding.)"""
    engine = settings.engine_address
    engine_exposed = not engine.startswith("unix:") and not is_loopback(_host(engine))
    metrics_exposed = not is_loopback(_host(settings.metrics_address))
    if not engine.startswith("unix:"):
        log.warning(
            "INSECURE: EngineService on TCP %s (insecure_engine_tcp): callers are not "
            "identified, engine deaths are not detected, and any process that reaches "
            "the port can register memory and read published KV",
            engine,
        )
    if metrics_exposed:
        log.warning(
            "INSECURE: /metrics on %s is reachable beyond loopback without authentication",
            settings.metrics_address,
        )
    metrics.insecure_listeners.labels("engine").set(int(engine_exposed))
    metrics.insecure_listeners.labels("metrics").set(int(metrics_exposed))


@contextlib.contextmanager
def _private_umask(address: str) -> Any:
    """The engine socket is created 0600: only the engine's user may connect."""
    if not address.startswith("unix:"):
        yield
        return
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(address.removeprefix("unix:"), 0o600)


def _start_metrics(address: str, metrics: Metrics) -> tuple[Any, int]:
    host, _, port = address.rpartition(":")
    try:
        http, _thread = start_http_server(int(port), host.strip("[]"), registry=metrics.registry)
    except OSError as exc:
        raise InvalidInputError(
            "metrics_address", f"cannot bind {address}: {exc.strerror}"
        ) from exc
    return http, int(http.server_port)


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def _with_port(address: str, port: int) -> str:
    return f"{address.rpartition(':')[0]}:{port}"


if __name__ == "__main__":
    sys.exit(main())
