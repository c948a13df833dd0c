"""Links to peer sidecars: gRPC channels, handshakes, agreements, NIXL peers.

One `PeerLink` per (peer address, TP rank) holds what the last handshake
returned: the peer's epoch, engine, layout, registered buffers and the NIXL
agent loaded from its metadata. Agreements are negotiated per local engine
and cached on the link. A link is handshaken again when the params of a
pull name another epoch or engine than the cached one (the peer restarted
or its engine re-registered), when the peer's registrations changed (its
metadata is reloaded in place), or after a transfer saw the peer disconnect.
A new epoch drops the stale NIXL agent before loading the new one.

Every pull, push and Hold claims its peer's address (`PeerLinks.use`) while it may
touch a link there. An address with no claim, no handshake under way and no call for
`transfer.idle_agent_s` is forgotten (`forget_idle`): its links, its loaded NIXL agent,
its gRPC channel and lanes. Prefill pods come back under new addresses, and a
long-lived decode sidecar kept all of that for every pod that ever existed; a later
pull to a forgotten address simply handshakes again. A forgotten peer keeps the epoch
it was last linked with, so that a restart while it was forgotten still counts
(kvxfer_peer_epoch_changes, under its label or `other`) and is logged when it is linked
again. One with a metric label of its own keeps its identity with it, for the latest
limits.max_peer_labels forgotten addresses of such peers; one folded into `other` keeps
the epoch alone, for the latest _MAX_FORGOTTEN_OTHERS forgotten addresses of those,
which never push out the labelled peers' ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from kvxfer._exceptions import (
    BusyError,
    InvalidInputError,
    KvxferError,
    LaneUnreachableError,
    NegotiationError,
    PeerUnavailableError,
)
from kvxfer.core.layout import EngineLayout
from kvxfer.core.negotiation import PROTOCOL_VERSION, Agreement, negotiate
from kvxfer.dataplane.serving import ServingBackend
from kvxfer.server.metrics import Metrics
from kvxfer.server.peer_tls import client_tls
from kvxfer.server.settings import Settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.errors import guarded
from kvxfer.wire.lane import keep_alive
from kvxfer.wire.lane_client import Lane
from kvxfer.wire.loops import within
from kvxfer.wire.sidecar import PeerHello, hello_from_proto, hello_request

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R", bound=Message)
_MAX_READ_TOKENS = 1 << 16
# The refusals after which the same peer call may be made again (the peer could not be
# reached, or ran too many of our calls to start this one): its read token is kept.
TRY_AGAIN = (PeerUnavailableError, BusyError)
OTHER_PEERS = "other"  # the metric label of peers beyond limits.max_peer_labels
_MAX_LABEL_CHARS = 128  # a peer's identity as a label value: bounded like engine names


# Keepalive: a peer whose host vanished (no FIN, no RST) is noticed within about
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS instead of at the next RPC's deadline, and
# idle connections through NAT or load balancers stay open.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# After a peer lane could not be connected to, its calls go over gRPC for LANE_RETRY_S,
# doubling while it stays unreachable up to LANE_RETRY_MAX_S: a port a firewall drops
# costs one pull a connect timeout (at most LANE_CONNECT_S) now and then, not each.
LANE_RETRY_S = 5.0
LANE_RETRY_MAX_S = 300.0
LANE_CONNECT_S = 2.0
_MAX_RETIRED_LANES = 1024
# Forgotten addresses of peers folded into "other" that keep their epoch, the oldest
# forgotten dropped first. Bounded apart from the labelled peers' (limits.max_peer_labels,
# a bound on metric series), so that the many unlabelled peers of a large fleet never push
# a labelled peer's identity and epoch out; and larger, since they are the peers beyond
# the labelled ones and each keeps only an address and an int.
_MAX_FORGOTTEN_OTHERS = 1024


def channel_options(settings: Settings) -> list[tuple[str, int]]:
    """Options of channels to peer sidecars."""
    limit = settings.limits.max_message_bytes
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """Options of the sidecar's gRPC servers."""
    limit = settings.limits.max_message_bytes
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would bind
        # silently and take half the connections. Off, binding a taken port fails.
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # Accept the clients' keepalive pings (the default refuses pings more often
        # than every 5 minutes and closes the connection with too_many_pings).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


class Dialer:
    """gRPC channels to peer sidecars (mTLS when configured), and error translation."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self._settings = settings
        self._metrics = metrics
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lanes: dict[tuple[str, int], Lane] = {}  # (peer address, its lane's port)
        # (address, lane port) -> (when to try the lane again, the pause that was)
        self._lane_down: dict[tuple[str, int], tuple[float, float]] = {}
        self._retired: dict[tuple[str, int], None] = {}  # ports peers left, oldest first
        self._lane_tls = client_tls(settings)
        self._credentials: grpc.ChannelCredentials | None = None
        tls = settings.tls
        if tls.enabled:
            assert tls.cert_file and tls.key_file and tls.ca_file
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.ca_file.read_bytes(),
                private_key=tls.key_file.read_bytes(),
                certificate_chain=tls.cert_file.read_bytes(),
            )

    def stub(self, address: str) -> pb_grpc.PeerServiceAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            options = channel_options(self._settings)
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            self._channels[address] = channel
        return pb_grpc.PeerServiceStub(channel)

    async def call(self, address: str, what: str, rpc: Callable[[], Awaitable[T]]) -> T:
        """`rpc` is one call with the `transfer.rpc_timeout_s` deadline, which every
        peer call gets."""
        deadline = self._settings.transfer.rpc_timeout_s
        return await guarded(f"{what} at peer {address}", rpc, deadline)

    async def call_peer(
        self,
        link: PeerLink,
        method: str,
        request: Message,
        reply: type[R],
        what: str,
    ) -> R:
        """One per-request PeerService call: over the peer's lane when its handshake
        named one (and `lane.enabled`), else over gRPC; the same errors either way.

        A lane that cannot be connected to, or that turned the connection away at its
        limit (either way nothing of the call ran), hands the call to gRPC, the
        authoritative port, which answers for the peer as it is now (a restarted
        peer's old lane port refuses, its peer port says it restarted); the lane is
        then skipped for LANE_RETRY_S, doubling while it stays down, with one warning
        per outage."""
        timeout = self._settings.transfer.rpc_timeout_s
        port = link.hello.lane_port
        key = (link.address, port)
        down_until, _ = self._lane_down.get(key, (0.0, 0.0))
        if port and self._settings.lane.enabled and time.monotonic() >= down_until:
            lane = await self.lane(link.address, port)
            try:
                return await lane.call(
                    method, request, reply, timeout, f"{what} at peer {link.address}"
                )
            except LaneUnreachableError as exc:
                until, pause = self._lane_down.get(key, (0.0, LANE_RETRY_S / 2))
                if time.monotonic() >= until:  # not a caller that waited on the same try
                    if not until:
                        log.warning("%s; its calls go over gRPC for now", exc)
                    pause = min(pause * 2, LANE_RETRY_MAX_S)
                    self._lane_down[key] = (time.monotonic() + pause, pause)
                if self._metrics is not None:
                    self._metrics.lane_unreachable.inc()
            else:
                self._lane_down.pop(key, None)
        # The stub is built only here: a call the lane carries needs none.
        rpc: Callable[..., Awaitable[R]] = getattr(self.stub(link.address), method)
        return await self.call(link.address, what, lambda: rpc(request, timeout=timeout))

    async def lane(self, address: str, port: int) -> Lane:
        """The lane to the peer at `address` whose handshake named `port` (mTLS when
        configured, its certificate checked against the host of `address`)."""
        lane = self._lanes.get((address, port))
        if lane is None:
            host = address.rpartition(":")[0]
            where = f"{host}:{port}"
            tls, timeout = self._lane_tls, self._settings.transfer.rpc_timeout_s
            connect_s = min(timeout, LANE_CONNECT_S)

            async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                bare = host.strip("[]")
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(
                            bare, port, ssl=tls, server_hostname=bare if tls else None
                        ),
                        connect_s,
                    )
                    keep_alive(writer)
                    return reader, writer
                except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
                    raise LaneUnreachableError(
                        f"cannot connect to the peer lane at {where} (the port its handshake "
                        f"named): {exc or type(exc).__name__}"
                    ) from None

            lane = Lane(where, timeout, opener=opener, name=f"peer lane {where}")
            if (address, port) in self._retired:  # a port the peer has left: no dialing
                await lane.close()
            self._lanes[(address, port)] = lane
        return lane

    async def retire_lanes(self, address: str, port: int) -> None:
        """The peer at `address` now names lane `port` (a handshake after its restart):
        its lanes of other ports close and are not dialed again (a pull begun before
        the restart has its old port; its calls go to gRPC, which says it restarted)."""
        stale = [k for k in self._lanes if k[0] == address and k[1] != port]
        for key in stale:
            self._retired[key] = None
            while len(self._retired) > _MAX_RETIRED_LANES:
                del self._retired[next(iter(self._retired))]
        for lane in [self._lanes.pop(k) for k in stale]:
            await lane.close()

    async def forget(self, address: str) -> None:
        """Close the channel and lanes to a peer that has no link (any more): params naming
        thousands of addresses that never answer, or prefill pods replaced under new
        addresses, must not leave a channel each behind."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()
        for key in [k for k in self._lane_down if k[0] == address]:
            del self._lane_down[key]
        for key in [k for k in self._lanes if k[0] == address]:
            await self._lanes.pop(key).close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
        lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            await lane.close()


class PeerUse:
    """A claim on a peer address, from before a transfer or Hold looks up its link until
    nothing of it can touch the link any more (its EndRead or EndWrite included): while
    any is held, `PeerLinks.forget_idle` leaves the address alone. `release` is
    idempotent; a context manager releases on exit."""

    def __init__(self, links: PeerLinks, address: str) -> None:
        self._links: PeerLinks | None = links
        self.address = address

    def release(self) -> None:
        links, self._links = self._links, None
        if links is not None:
            links._release(self.address)

    def __enter__(self) -> PeerUse:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


@dataclass
class PeerLink:
    address: str
    tp_rank: int
    hello: PeerHello
    nixl_peer: str
    handshakes: int = 1
    last_handshake_unix: float = field(default_factory=time.time)
    agreements: dict[str, Agreement] = field(default_factory=dict)
    stale: bool = False

    @property
    def epoch(self) -> int:
        return self.hello.epoch

    @property
    def layout(self) -> EngineLayout:
        return self.hello.layout


class PeerLinks:
    def __init__(
        self,
        *,
        settings: Settings,
        backend: ServingBackend,
        metrics: Metrics,
        dialer: Dialer,
        sidecar_id: str,
        epoch: int,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._metrics = metrics
        self._dialer = dialer
        self._sidecar_id = sidecar_id
        self._epoch = epoch
        self._links: dict[tuple[str, int], PeerLink] = {}
        # Counted at each scrape: a link found stale (its peer went away or restarted)
        # no longer counts, where a count kept at each handshake only ever grew.
        metrics.peers.set_function(self._live_peers)
        # Serialises handshakes and reloads of one (address, rank); never held by a pull
        # waiting for another peer.
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._loading: dict[str, asyncio.Lock] = {}  # address -> its agent being loaded
        # A handshake under way, and whether its caller logs a refused negotiation itself
        # (`link(quiet=True)`): a caller that joins it and does not, logs it then.
        self._pending: dict[tuple[str, int], tuple[asyncio.Future[PeerLink], bool]] = {}
        self._labels: set[str] = set()  # peer identities with a metric label of their own
        self._identities: dict[str, str] = {}  # address -> the identity its handshake gave
        self._nixl_peers: dict[str, tuple[int, str]] = {}  # address -> (epoch, agent name)
        # A forgotten address that keeps its identity -> the epoch its agent was loaded
        # with (None: none was), compared with the next one its handshake gives. For
        # peers with a label of their own, at most limits.max_peer_labels addresses: a
        # peer that comes back under new addresses (pods do) leaves no identity and no
        # epoch behind for each old one, the oldest forgotten dropped first.
        self._forgotten_epochs: dict[str, int | None] = {}
        # A forgotten address of a peer folded into "other" -> the epoch its agent was
        # loaded with, compared the same way; no identity (it names no label of its own)
        # and only where an agent was loaded (addresses named by bad params never had
        # one). At most _MAX_FORGOTTEN_OTHERS addresses, the oldest forgotten dropped first.
        self._forgotten_others: dict[str, int] = {}
        # (address, rank, request id) -> the read token BeginRead returned; bounded, since
        # a read that ends without EndRead (its lease lost) leaves its token behind.
        self._read_tokens: dict[tuple[str, int, str], str] = {}
        self._users: dict[str, int] = {}  # address -> claims held (`use`)
        self._last_used: dict[str, float] = {}  # address -> time.monotonic() of last use
        # Addresses being forgotten: a handshake with one waits until its agent is removed
        # and its channel closed, so it never loads an agent that removal then drops.
        self._forgetting: dict[str, asyncio.Event] = {}

    def all(self) -> list[PeerLink]:
        return list(self._links.values())

    def use(self, address: str) -> PeerUse:
        """Claim `address` until the claim is released: take it before looking up a link
        there, and release it once nothing will use that link (see `forget_idle`)."""
        self._users[address] = self._users.get(address, 0) + 1
        self._touch(address)
        return PeerUse(self, address)

    def _release(self, address: str) -> None:
        self._touch(address)  # its idle time starts now, not when it was claimed
        left = self._users[address] - 1
        if left:
            self._users[address] = left
        else:
            del self._users[address]

    def _touch(self, address: str) -> None:
        self._last_used[address] = time.monotonic()

    def _busy(self, address: str) -> bool:
        return (
            address in self._users
            or address in self._forgetting
            or any(pending == address for pending, _ in self._pending)
        )

    async def forget_idle(self, idle_s: float) -> int:
        """Forget every address unclaimed and uncalled for `idle_s` (transfer.idle_agent_s),
        with no handshake under way: its links go, its NIXL agent is removed from ours,
        its channel and lanes close. How many addresses that had a link or agent went.

        The addresses are chosen and their links removed with nothing awaited in between,
        in one pass over each map however many go (thousands of addresses named by bad
        params must not stall the loop): a pull that claims one later finds no link and
        handshakes anew, once the removal ended; one that claimed it earlier keeps it."""
        before = time.monotonic() - idle_s
        seen = {address for address, _ in self._links} | set(self._nixl_peers)
        idle = [
            address
            for address in seen | set(self._last_used)
            if not self._busy(address) and self._last_used.get(address, 0.0) <= before
        ]
        if not idle:
            return 0
        gone = set(idle)
        for key in [key for key in self._links if key[0] in gone]:
            self._links.pop(key).stale = True  # nothing holds it (unclaimed): belt and braces
        for key in [key for key in self._locks if key[0] in gone]:
            del self._locks[key]  # unclaimed, no handshake pending: no one holds or awaits it
        for address in [address for address in self._loading if address in gone]:
            del self._loading[address]  # the same: no handshake is loading its agent
        for token in [token for token in self._read_tokens if token[0] in gone]:
            del self._read_tokens[token]  # reads ended without EndRead (their lease lost)
        agents: dict[str, str | None] = {}  # address -> its loaded agent's name
        for address in idle:
            self._last_used.pop(address, None)
            known = self._nixl_peers.pop(address, None)
            agents[address] = None if known is None else known[1]
            self._keep_epoch(address, None if known is None else known[0])
            self._forgetting[address] = asyncio.Event()
        # Memory safety: an agent removed here is one our serving agent loaded for these
        # peers; no link points at it and no transfer claims their addresses. One that
        # another address still names (one peer reached two ways) stays, and one that two
        # of these name is removed once.
        kept = {name for _, name in self._nixl_peers.values()}
        try:
            for address in idle:
                name = agents[address]
                if name in kept:
                    name = None
                elif name is not None:
                    kept.add(name)
                try:
                    await self._forget(address, name)
                except Exception as exc:  # the next addresses are still let go
                    log.warning("forgetting peer %s: %s", address, exc)
                if address in seen:
                    log.info("forgot peer %s: no transfer used it for %g s", address, idle_s)
        finally:  # cancelled or failed: no handshake may wait for a removal that never ends
            for address in idle:
                done = self._forgetting.pop(address, None)
                if done is not None:
                    done.set()
        return len(gone & seen)

    def _keep_epoch(self, address: str, loaded: int | None) -> None:
        """Keep, for `address` being forgotten, the epoch its agent was `loaded` with, so
        that a restart meanwhile still counts when it is linked again. None: no agent was
        loaded since it was last forgotten (its handshakes failed, as a restarting peer's
        do), and the epoch kept then is still the one to compare.

        A peer with a metric label of its own keeps its identity too (its errors after
        this still count under its name), with None if it has no epoch; one folded into
        "other" keeps the epoch alone, if it has one."""
        kept = self._forgotten_epoch(address)  # kept again below, then as the newest
        epoch = kept if loaded is None else loaded
        if self._identities.get(address) not in self._labels:
            self._identities.pop(address, None)
            if epoch is not None:
                self._forgotten_others[address] = epoch
                while len(self._forgotten_others) > _MAX_FORGOTTEN_OTHERS:
                    del self._forgotten_others[next(iter(self._forgotten_others))]  # oldest
            return
        self._forgotten_epochs[address] = epoch
        while len(self._forgotten_epochs) > self._settings.limits.max_peer_labels:
            oldest = next(iter(self._forgotten_epochs))
            del self._forgotten_epochs[oldest]
            # Its identity goes too, unless it is in use again (a handshake under way
            # named it, or a pull claims it): then it is no longer a forgotten address.
            if oldest not in self._last_used and oldest not in self._nixl_peers:
                self._identities.pop(oldest, None)

    async def _forget(self, address: str, agent: str | None) -> None:
        """Remove `agent` (the one loaded for `address`, if it is to go) from ours and
        close the address's connections; `forget_idle` dropped the rest already."""
        try:
            if agent is not None:
                await self._backend.remove_peer(agent)
        finally:
            try:
                await self._dialer.forget(address)  # also when the removal failed
            finally:
                done = self._forgetting.pop(address, None)
                if done is not None:
                    done.set()

    async def _forgotten(self, address: str) -> None:
        """Until a removal of `address` under way has ended (its old agent removed, its
        channel closed): at most transfer.rpc_timeout_s, as any call to a peer, since the
        removal waits for the serving agent, which an engine's registration or a child's
        restart may hold."""
        timeout_s = self._settings.transfer.rpc_timeout_s
        while (forgetting := self._forgetting.get(address)) is not None:
            try:
                await within(forgetting.wait(), timeout_s)
            except TimeoutError:
                self._metrics.handshakes.labels(self.label(address), "error").inc()
                raise PeerUnavailableError(
                    f"peer {address}: its idle link was still being let go after "
                    f"{timeout_s:g}s (transfer.rpc_timeout_s)"
                ) from None

    def label(self, address: str) -> str:
        """The metric label of the peer at `address`: its identity (the `sidecar_id` its
        last successful handshake gave, which survives a restart on another address) for
        the first limits.max_peer_labels peers this sidecar linked with, `other` for the
        rest and for addresses that never completed a handshake, so params naming
        thousands of addresses cannot grow the registry without bound."""
        identity = self._identities.get(address)
        return identity if identity in self._labels else OTHER_PEERS

    async def link(
        self,
        address: str,
        engine_id: str,
        layout: EngineLayout,
        epoch: int,
        peer_engine: str,
        peer_rank: int | None = None,
        *,
        push: bool = False,
        quiet: bool = False,
    ) -> tuple[PeerLink, Agreement]:
        """The link to `address`'s engine of rank `peer_rank` (default: `layout`'s rank),
        handshaking first when the cached one is missing, stale, or of another epoch or
        engine than the pull expects. Pulls that arrive during a handshake share its
        outcome (success or failure) instead of queuing one timeout each behind it; other
        peers never wait on this one. `push`: this side writes into the peer's engine,
        so the agreement is negotiated from the peer's side (it is the reader there).
        `quiet`: a refused negotiation (NegotiationError) is not logged here, the caller
        logs it, throttled (Hold asks again at every interval; a pull logs each)."""
        rank = layout.tp_rank if peer_rank is None else peer_rank
        key = (address, rank)
        link = self._links.get(key)
        if link is None or link.stale or link.epoch != epoch or link.hello.engine_id != peer_engine:
            link = await self._handshaken(key, layout, engine_id, push, quiet)
        agreement = link.agreements.get(engine_id)
        if agreement is None:
            agreement = self._negotiate(address, engine_id, layout, link.hello, push, quiet)
            link.agreements[engine_id] = agreement
        return link, agreement

    async def _handshaken(
        self, key: tuple[str, int], layout: EngineLayout, engine_id: str, push: bool, quiet: bool
    ) -> PeerLink:
        """The handshake under way with `key`, or a new one: its link."""
        entry = self._pending.get(key)
        if entry is None:
            address, rank = key
            started = asyncio.ensure_future(
                self._handshake(address, layout, engine_id, rank, push, quiet)
            )
            entry = self._pending[key] = (started, quiet)
            started.add_done_callback(lambda _: self._pending.pop(key, None))
        pending, started_quiet = entry
        try:
            return await asyncio.shield(pending)
        except NegotiationError as exc:
            if started_quiet and not quiet:  # its starter did not log it: this caller does
                self._log_refused(key[0], engine_id, exc)
            raise

    def _negotiate(
        self,
        address: str,
        engine_id: str,
        layout: EngineLayout,
        hello: PeerHello,
        push: bool,
        quiet: bool,
    ) -> Agreement:
        try:
            if push:  # the destination (the peer) is the side negotiation calls local
                return negotiate(hello.layout, layout, hello.protocol_version, PROTOCOL_VERSION)
            return negotiate(layout, hello.layout, PROTOCOL_VERSION, hello.protocol_version)
        except NegotiationError as exc:
            self._metrics.negotiation_failures.labels(self.label(address)).inc()
            if not quiet:
                self._log_refused(address, engine_id, exc)
            raise

    def _log_refused(self, address: str, engine_id: str, exc: NegotiationError) -> None:
        log.warning("layouts of %s and peer %s disagree: %s", engine_id, address, exc)

    async def reload(self, link: PeerLink, layout: EngineLayout) -> None:
        """The peer's registrations changed: load its new metadata in place."""
        async with self._locks.setdefault((link.address, link.tp_rank), asyncio.Lock()):
            hello = await self.hello(link.address, layout, dry_run=False, peer_rank=link.tp_rank)
            link.hello, link.nixl_peer = hello, await self._load_agent(link.address, hello)

    def _live_peers(self) -> int:
        """Peer addresses with a link not found stale (the `kvxfer_peers` gauge)."""
        return len({address for (address, _), link in list(self._links.items()) if not link.stale})

    def invalidate(self, link: PeerLink) -> None:
        link.stale = True

    async def hello(
        self, address: str, layout: EngineLayout, *, dry_run: bool, peer_rank: int | None = None
    ) -> PeerHello:
        stub = self._dialer.stub(address)
        request = hello_request(
            layout,
            epoch=self._epoch,
            sidecar_id=self._sidecar_id,
            dry_run=dry_run,
            peer_tp_rank=peer_rank,
        )
        timeout = self._settings.transfer.rpc_timeout_s
        reply = await self._dialer.call(
            address, "handshake", lambda: stub.Handshake(request, timeout=timeout)
        )
        try:
            return hello_from_proto(reply, dry_run=dry_run)
        except InvalidInputError as exc:
            raise PeerUnavailableError(f"peer {address} sent a bad handshake: {exc}") from exc

    async def _handshake(
        self,
        address: str,
        layout: EngineLayout,
        engine_id: str,
        rank: int,
        push: bool,
        quiet: bool,
    ) -> PeerLink:
        """Hello, then negotiate, and only if they agree load the peer's NIXL agent: a
        refused peer adds no agent, no link and no `ok` handshake."""
        start = time.perf_counter()
        await self._forgotten(address)
        async with self._locks.setdefault((address, rank), asyncio.Lock()):
            try:
                hello = await self.hello(address, layout, dry_run=False, peer_rank=rank)
            except KvxferError:
                self._metrics.handshakes.labels(self.label(address), "error").inc()
                await self._forget_unlinked(address)
                raise
            try:
                agreement = self._negotiate(address, engine_id, layout, hello, push, quiet)
            except NegotiationError:
                self._metrics.handshakes.labels(self.label(address), "refused").inc()
                await self._forget_unlinked(address)
                raise
            try:
                nixl_peer = await self._load_agent(address, hello)
            except KvxferError:
                self._metrics.handshakes.labels(self.label(address), "error").inc()
                raise
            link = self._install(address, rank, hello, nixl_peer)
            link.agreements[engine_id] = agreement
            await self._dialer.retire_lanes(address, hello.lane_port)
        label = self.label(address)
        self._metrics.handshakes.labels(label, "ok").inc()
        self._metrics.handshake_duration.labels(label).observe(time.perf_counter() - start)
        return link

    async def _forget_unlinked(self, address: str) -> None:
        if not any(link_address == address for link_address, _ in self._links):
            await self._dialer.forget(address)

    def _install(self, address: str, tp_rank: int, hello: PeerHello, nixl_peer: str) -> PeerLink:
        key = (address, tp_rank)
        old = self._links.get(key)
        link = PeerLink(address, tp_rank, hello, nixl_peer)
        if old is not None:
            link.handshakes = old.handshakes + 1
            if old.epoch == hello.epoch and old.hello.engine_id == hello.engine_id:
                link.agreements = old.agreements
        self._links[key] = link
        self._touch(address)
        self._name_peer(address, hello.sidecar_id)
        self._metrics.peer_epoch.labels(self.label(address)).set(hello.epoch)
        return link

    def _name_peer(self, address: str, sidecar_id: str) -> None:
        identity = sidecar_id[:_MAX_LABEL_CHARS] or address  # a peer that gave none: its address
        self._identities[address] = identity
        if identity in self._labels or len(self._labels) >= self._settings.limits.max_peer_labels:
            return
        self._labels.add(identity)
        self._metrics.init_peer(identity)

    async def _load_agent(self, address: str, hello: PeerHello) -> str:
        """The name of `address`'s agent loaded from `hello`, one load per address at a
        time: the ranks of a restarted peer handshake at once, and each would otherwise
        count the restart and remove the old agent."""
        async with self._loading.setdefault(address, asyncio.Lock()):
            return await self._load_agent_alone(address, hello)

    async def _load_agent_alone(self, address: str, hello: PeerHello) -> str:
        known = self._nixl_peers.get(address)
        # Forgotten since it was last linked: its agent and links went then. Counted here
        # once, also when the new agent's load then fails.
        forgotten_epoch = self._forgotten_epoch(address)
        if known is None and forgotten_epoch is not None and forgotten_epoch != hello.epoch:
            log.info(
                "peer %s restarted while forgotten (epoch %d -> %d)",
                address,
                forgotten_epoch,
                hello.epoch,
            )
            self._metrics.peer_restarts.labels(self.label(address)).inc()
        if known is not None and known[0] != hello.epoch:
            log.info(
                "peer %s restarted (epoch %d -> %d): dropping its old agent",
                address,
                known[0],
                hello.epoch,
            )
            self._metrics.peer_restarts.labels(self.label(address)).inc()
            await self._backend.remove_peer(known[1])
            if self._nixl_peers.get(address) == known:
                # Gone now: a load of the new agent that fails must not leave the next
                # handshake to remove it again and count the same restart twice.
                del self._nixl_peers[address]
            for (link_address, _), link in self._links.items():
                if link_address == address:
                    link.stale = True
        name = await self._backend.add_peer(hello.agent_metadata)  # reloads in place if known
        self._nixl_peers[address] = (hello.epoch, name)
        return name

    def _forgotten_epoch(self, address: str) -> int | None:
        """The epoch `address` was last linked with, kept when it was forgotten (None:
        none was kept), taken out of what is kept: the address is being linked (or
        forgotten) again."""
        labelled_epoch = self._forgotten_epochs.pop(address, None)
        other_epoch = self._forgotten_others.pop(address, None)
        return other_epoch if labelled_epoch is None else labelled_epoch

    async def begin_read(
        self, link: PeerLink, request_id: str, reader_id: str
    ) -> pb.BeginReadResponse:
        request = pb.BeginReadRequest(
            epoch=link.epoch, tp_rank=link.tp_rank, request_id=request_id, reader_id=reader_id
        )
        reply = await self._call_peer(
            link, "BeginRead", request, pb.BeginReadResponse, "begin read"
        )
        self._keep_token(link, request_id, reply.read_token)
        return reply

    async def begin_write(
        self, link: PeerLink, request_id: str, writer_id: str
    ) -> pb.BeginWriteResponse:
        """Bind an expected request at the peer to this writer (push); its write token is
        kept like a read token, so heartbeats renew the destination lease the same way."""
        request = pb.BeginWriteRequest(
            epoch=link.epoch, tp_rank=link.tp_rank, request_id=request_id, writer_id=writer_id
        )
        reply = await self._call_peer(
            link, "BeginWrite", request, pb.BeginWriteResponse, "begin write"
        )
        self._keep_token(link, request_id, reply.write_token)
        return reply

    def _keep_token(self, link: PeerLink, request_id: str, token: str) -> None:
        if len(self._read_tokens) >= _MAX_READ_TOKENS:
            del self._read_tokens[next(iter(self._read_tokens))]  # the oldest
        self._read_tokens[(link.address, link.tp_rank, request_id)] = token

    async def heartbeat(self, link: PeerLink, request_id: str) -> int:
        token = self._read_tokens.get((link.address, link.tp_rank, request_id), "")
        request = pb.HeartbeatRequest(
            epoch=link.epoch, tp_rank=link.tp_rank, request_ids=[request_id], read_tokens=[token]
        )
        reply = await self._call_peer(link, "Heartbeat", request, pb.HeartbeatResponse, "heartbeat")
        return reply.states[0] if reply.states else pb.LEASE_STATE_UNKNOWN

    async def hold(
        self, link: PeerLink, request_ids: Sequence[str]
    ) -> list[pb.LeaseState.ValueType]:
        """Ask the peer to keep its publications of `request_ids` (HoldLeases): each one's
        LeaseState as it answered."""
        request = pb.HoldLeasesRequest(
            epoch=link.epoch, tp_rank=link.tp_rank, request_ids=list(request_ids)
        )
        reply = await self._call_peer(
            link, "HoldLeases", request, pb.HoldLeasesResponse, "hold leases"
        )
        if len(reply.states) != len(request_ids):
            raise PeerUnavailableError(
                f"hold leases at {link.address}: {len(reply.states)} states for "
                f"{len(request_ids)} request ids"
            )
        return list(reply.states)

    async def end_read(self, link: PeerLink, request: pb.EndReadRequest) -> None:
        """End the read; its token is kept while the peer cannot be reached, so that the
        caller's retry presents it again."""
        key = (link.address, link.tp_rank, request.request_id)
        request.read_token = self._read_tokens.get(key, "")
        await self._ending(
            key,
            self._call_peer(link, "EndRead", request, pb.EndReadResponse, "end read"),
        )

    async def end_write(self, link: PeerLink, request: pb.EndWriteRequest) -> pb.EndWriteResponse:
        """End the write (push), as `end_read` ends a read."""
        key = (link.address, link.tp_rank, request.request_id)
        request.write_token = self._read_tokens.get(key, "")
        return await self._ending(
            key,
            self._call_peer(link, "EndWrite", request, pb.EndWriteResponse, "end write"),
        )

    def _call_peer(
        self, link: PeerLink, method: str, request: Message, reply: type[R], what: str
    ) -> Awaitable[R]:
        """A per-request call at the peer of `link`, its address marked used."""
        self._touch(link.address)
        return self._dialer.call_peer(link, method, request, reply, what)

    async def _ending(self, key: tuple[str, int, str], call: Awaitable[T]) -> T:
        try:
            reply = await call
        except TRY_AGAIN:
            raise  # the call may be tried again: keep its token for it
        except KvxferError:
            self._read_tokens.pop(key, None)
            raise
        self._read_tokens.pop(key, None)
        return reply
