"""The sidecar's Prometheus metrics (docs/architecture.md, Metrics).

One registry per sidecar (no process-global state), with the process and
platform collectors and `kvxfer_build_info` on it. Names carry their units;
labels are bounded: `peer` (a peer sidecar's identity as its handshake gave it,
its `sidecar_id`, so a series survives the peer's restart on a new address; for
the first `limits.max_peer_labels` peers a handshake succeeded with, every other
peer is `other`), `group_kind`, `direction` (`read`: this sidecar pulled),
`result`, `reason`. Never request ids. Series whose label values are all known
start at zero (`init_peer` for a new peer label; every `reason` and `service` at
start), so `rate()` and `absent()` see them before the first event.

Throughput is bytes over wall time: `kvxfer_transfer_active_seconds_total`
grows only while at least one pull is in flight, whatever the overlap, so
`rate(kvxfer_bytes_moved_total[1m]) / rate(kvxfer_transfer_active_seconds_total[1m])`
is the real throughput, where summed per-pull durations would understate it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.requests import PullStatus, ReleaseReason
from kvxfer.dataplane.adapter import TransferStatus

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Building a pull's descriptors takes tens to hundreds of microseconds: 5 us to 0.25 s.
_POST_BUCKETS = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip
# Per pull: one 16-token block of a small model is tens of KiB; a 128k-token request of a
# large one tens of GiB. Powers of 4 from 16 KiB to 64 GiB.
_BYTES_BUCKETS = tuple(float(16 << 10 << (2 * i)) for i in range(12))
# Descriptors per pull: 1 (contiguous runs) to millions (scattered 1-block runs).
_DESCRIPTOR_BUCKETS = tuple(float(1 << (2 * i)) for i in range(12))
# Label values known in advance: their series exist from the start, at zero.
HANDSHAKE_RESULTS = ("ok", "refused", "error")
# Where a pull's time goes (kvxfer_pull_phase_duration_seconds): waiting for a running
# slot against its peer, the peer's BeginRead from call to answer (beside the read),
# and the read itself (its chunks bound, posted and ended).
PULL_PHASES = ("queued", "begin_read", "read")
# Why a port guard refused a call (kvxfer.server.guard).
REFUSAL_REASONS = (
    "too_large",
    "undecodable",
    "not_allowed",
    "too_many_calls",
    "too_many_connections",
)
SERVICES = ("peer", "engine", "metrics")
# What the peer port's guard passes (PeerService and AdminService calls on the peer port).
PEER_METHODS = (
    "Handshake", "BeginRead", "Heartbeat", "HoldLeases", "EndRead", "BeginWrite", "EndWrite",
    "GetStatus", "ListPeers",
)  # fmt: skip


def build_labels() -> dict[str, str]:
    return {
        "version": importlib.metadata.version("kvxfer"),
        "protocol": str(PROTOCOL_VERSION),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


class ActiveClock:
    """Wall time during which at least one transfer was in flight, exported as the
    counter `kvxfer_transfer_active_seconds_total`. Read at every scrape, so it advances
    while pulls overlap without end, not only when the last one finishes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # the scrape runs on the HTTP server's thread
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def start(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self._clock()
            self._active += 1

    def stop(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += self._clock() - self._since

    def seconds(self) -> float:
        with self._lock:
            running = self._clock() - self._since if self._active else 0.0
            return self._total + running

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "kvxfer_transfer_active_seconds",
            "Wall time with at least one pull in flight (the throughput denominator)",
            value=self.seconds(),
        )

    describe = collect


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.build_info = Info(
            "kvxfer_build", "The sidecar's version, protocol and runtime (value 1)", registry=r
        )
        self.build_info.info(build_labels())
        self.bytes_moved = Counter(
            "kvxfer_bytes_moved", "KV bytes moved", ["peer", "group_kind", "direction"], registry=r
        )
        self.bytes_served = Counter(
            "kvxfer_bytes_served", "KV bytes peers reported reading from this sidecar", registry=r
        )
        self.bytes_received = Counter(
            "kvxfer_bytes_received",
            "KV bytes peers reported writing into this sidecar's engines (push)",
            registry=r,
        )
        self.push_revocations = Counter(
            "kvxfer_push_revocations",
            "Serving agents killed to revoke remote access while a pushing peer's writes "
            "may still land (it gave up on chunks, went silent past the lease TTL, or was "
            "still silent when its decode engine retired)",
            registry=r,
        )
        self.full_attention_bytes = Counter(
            "kvxfer_full_attention_bytes",
            "Bytes a transfer treating every attention group as full attention would move",
            ["peer", "direction"],
            registry=r,
        )
        self.requests = Counter("kvxfer_requests", "Pulls finished", ["peer", "result"], registry=r)
        self.transfer_duration = Histogram(
            "kvxfer_transfer_duration_seconds",
            "Pull duration, from accepted to PullDone",
            ["peer", "result"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pull_phase_duration = Histogram(
            "kvxfer_pull_phase_duration_seconds",
            "Where a pull's time went: queued (waiting for a running slot against its "
            "peer), begin_read (the peer's BeginRead, call to answer; beside the read), "
            "read (its chunks bound, posted and ended)",
            ["peer", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.post_duration = Histogram(
            "kvxfer_post_duration_seconds",
            "Time to build a pull's descriptors before its first NIXL post",
            ["peer"],
            buckets=_POST_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Histogram(
            "kvxfer_transfer_bytes",
            "KV bytes moved by one pull that reached the data plane",
            ["peer"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.transfer_descriptors = Histogram(
            "kvxfer_transfer_descriptors",
            "NIXL descriptors posted by one pull",
            ["peer"],
            buckets=_DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self.descriptors = Counter(
            "kvxfer_descriptors", "NIXL descriptors posted", ["peer"], registry=r
        )
        self.chunks = Counter(
            "kvxfer_chunks", "chunks by how their NIXL handle ended", ["peer", "result"], registry=r
        )
        self.failed_blocks = Counter(
            "kvxfer_failed_blocks",
            "Blocks reported failed to the engine",
            ["peer", "group_kind"],
            registry=r,
        )
        self.truncations = Counter(
            "kvxfer_valid_token_truncations",
            "Pulls whose valid_tokens fell short of num_tokens",
            ["peer"],
            registry=r,
        )
        self.handshakes = Counter(
            "kvxfer_handshakes", "Handshakes with peers", ["peer", "result"], registry=r
        )
        self.negotiation_failures = Counter(
            "kvxfer_negotiation_failures",
            "Pulls refused because the layouts disagree",
            ["peer"],
            registry=r,
        )
        self.handshake_duration = Histogram(
            "kvxfer_handshake_duration_seconds",
            "Handshake round trip, negotiation included",
            ["peer"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.active_leases = Gauge("kvxfer_active_leases", "Requests held for readers", registry=r)
        self.held_blocks = Gauge("kvxfer_held_blocks", "Blocks held under leases", registry=r)
        self.expired_leases = Counter(
            "kvxfer_expired_leases", "Leases that expired unconsumed", registry=r
        )
        self.released_leases = Counter(
            "kvxfer_released_leases", "Leases released", ["reason"], registry=r
        )
        self.inflight_pulls = Gauge(
            "kvxfer_inflight_pulls", "Pulls in flight", ["peer"], registry=r
        )
        self.peers = Gauge(
            "kvxfer_peers",
            "Peer sidecars linked (handshaken) and not found stale since",
            registry=r,
        )
        self.reading_agents = Gauge(
            "kvxfer_reading_agents",
            "NIXL agents open to read from peers (or write to them), up to "
            "transfer.agents_per_peer per peer and engine",
            registry=r,
        )
        self.peer_epoch = Gauge(
            "kvxfer_peer_epoch", "Current epoch of each peer", ["peer"], registry=r
        )
        self.peer_restarts = Counter(
            "kvxfer_peer_epoch_changes", "Peer restarts seen (new epoch)", ["peer"], registry=r
        )
        self.engines = Gauge("kvxfer_registered_engines", "Engines registered", registry=r)
        self.registered_bytes = Gauge(
            "kvxfer_registered_bytes", "Engine buffer bytes registered with NIXL", registry=r
        )
        self.events_dropped = Counter(
            "kvxfer_events_dropped",
            "Engine events dropped: queue full and nobody watching",
            registry=r,
        )
        self.engine_exits = Counter(
            "kvxfer_engine_exits",
            "Registered engines whose process exited without unregistering",
            registry=r,
        )
        self.serving_agent_restarts = Counter(
            "kvxfer_serving_agent_restarts",
            "Serving NIXL agent processes that died (UCX aborted them) and were replaced; "
            "the sidecar itself kept running",
            registry=r,
        )
        self.fault_injection = Gauge(
            "kvxfer_fault_injection",
            "1 when this sidecar injects chunk faults (testing)",
            registry=r,
        )
        self.insecure_listeners = Gauge(
            "kvxfer_insecure_listeners",
            "1 when the service (peer, engine, metrics) listens beyond loopback without "
            "authentication (started with an explicit insecure setting)",
            ["service"],
            registry=r,
        )
        self.refusals = Counter(
            "kvxfer_refusals",
            "Calls the port guards refused before any servicer ran, by reason "
            "(too_many_connections: peer lane connections, each before any call of it ran)",
            ["reason"],
            registry=r,
        )
        self.peer_calls = Counter(
            "kvxfer_peer_calls",
            "Peer calls this sidecar served past its port guard, by method and transport "
            "(grpc, or lane: the peer lane)",
            ["method", "transport"],
            registry=r,
        )
        self.lane_unreachable = Counter(
            "kvxfer_peer_lane_unreachable",
            "Peer calls that went over gRPC because the peer lane their peer's handshake "
            "named could not be connected to (a restarted peer, or a port not forwarded) or "
            "turned the connection away (its limits.max_lane_connections)",
            registry=r,
        )
        self.lane_stalled = Counter(
            "kvxfer_peer_lane_stalled",
            "Peer lane connections cut off, their calls cancelled, because their client took "
            "none of their answers for transfer.rpc_timeout_s",
            registry=r,
        )
        self.active = ActiveClock()
        r.register(self.active)
        for release in ReleaseReason:
            self.released_leases.labels(release.value)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        for service in SERVICES:
            self.insecure_listeners.labels(service)
        for method in PEER_METHODS:
            for transport in ("grpc", "lane"):
                self.peer_calls.labels(method, transport)

    def init_peer(self, peer: str) -> None:
        """Every series of a new `peer` label at zero, for each result it can have."""
        for pull in PullStatus:
            self.requests.labels(peer, pull.value)
        for chunk in TransferStatus:
            self.chunks.labels(peer, chunk.value)
        for result in HANDSHAKE_RESULTS:
            self.handshakes.labels(peer, result)
        for counter in (self.negotiation_failures, self.truncations, self.descriptors):
            counter.labels(peer)
        self.inflight_pulls.labels(peer)
        for phase in PULL_PHASES:
            self.pull_phase_duration.labels(peer, phase)
