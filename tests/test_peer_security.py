"""The peer port, attacked from outside: who may start it, call it, and end whose read.

Real kvxfer-server processes, real gRPC clients speaking raw PeerService and
AdminService, as an anonymous or rogue client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from pki import make_pki
from sidecars import engine_link, scrape, spans, start_engine, start_sidecar
from test_sidecar_tls import _config

from kvxfer._exceptions import NotFoundError, PeerUnavailableError, PermissionDeniedError
from kvxfer.cli.fleet import BIN, Proc, metric
from kvxfer.core.requests import TransferParams
from kvxfer.server.peers import Dialer
from kvxfer.server.settings import load_settings
from kvxfer.v1 import sidecar_pb2 as pb
from kvxfer.v1 import sidecar_pb2_grpc as pb_grpc
from kvxfer.wire.lane_client import Lane

NAMES = ("kvxfer-p", "kvxfer-d", "kvxfer-rogue")  # the certificates make_pki signs
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gemma-3-4b-it"


def test_non_loopback_peer_port_needs_tls_or_the_insecure_flag(tmp_path: Path) -> None:
    argv = [str(BIN / "kvxfer-server"), "--peer-address", "0.0.0.0:0", "--engine-address",
            f"unix:{tmp_path}/e.sock", "--metrics-address", "127.0.0.1:0"]  # fmt: skip
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "not loopback" in refused.stderr and "--insecure-peer-port" in refused.stderr
    # Listens on every interface for a moment; nothing is sent to it but the scrape.
    p = start_sidecar(tmp_path, "p", "--peer-address", "0.0.0.0:0", "--insecure-peer-port")
    try:
        assert scrape(p)[("kvxfer_insecure_listeners", (("service", "peer"),))] == 1
        assert "INSECURE PEER PORT" in p.log_text()
    finally:
        p.stop()
    p = start_sidecar(tmp_path, "q")  # loopback: no flag needed, gauge 0
    try:
        assert scrape(p)[("kvxfer_insecure_listeners", (("service", "peer"),))] == 0
    finally:
        p.stop()


@pytest.fixture
async def published(tmp_path: Path) -> AsyncIterator[tuple[Proc, TransferParams]]:
    p = start_sidecar(tmp_path, "p")
    pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=16)
    try:
        async with engine_link(p, pe) as (pc, _):
            blocks = {g.group_id: [0, 1] for g in pe.layout.groups}
            yield p, await pc.publish("bound", 32, spans(blocks))
    finally:
        pe.stop()
        p.stop()


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_reads_are_bound_to_the_reader_that_began_them(
    published: tuple[Proc, TransferParams],
) -> None:
    p, params = published
    async with grpc.aio.insecure_channel(p.ready["peer_address"]) as channel:
        peer = pb_grpc.PeerServiceStub(channel)
        ids = {"epoch": params.epoch, "tp_rank": params.tp_rank}
        beat = pb.HeartbeatRequest(**ids, request_ids=["bound"], read_tokens=[""])
        # Nobody reads it yet: an anonymous heartbeat must not pin the lease.
        assert await _code(peer.Heartbeat(beat)) is grpc.StatusCode.PERMISSION_DENIED
        begun = await peer.BeginRead(pb.BeginReadRequest(**ids, request_id="bound"))
        assert len(begun.read_token) == 32
        assert await _code(peer.Heartbeat(beat)) is grpc.StatusCode.PERMISSION_DENIED
        end = pb.EndReadRequest(**ids, request_id="bound", reason=pb.RELEASE_REASON_CONSUMED)
        assert await _code(peer.EndRead(end)) is grpc.StatusCode.PERMISSION_DENIED
        end.read_token = "f" * 32
        assert await _code(peer.EndRead(end)) is grpc.StatusCode.PERMISSION_DENIED
        # Bad input from a peer, named: invalid ids, a reason only the publisher may give.
        bad = pb.HeartbeatRequest(**ids, request_ids=["a b"], read_tokens=[""])
        assert await _code(peer.Heartbeat(bad)) is grpc.StatusCode.INVALID_ARGUMENT
        unreg = pb.EndReadRequest(**ids, request_id="bound", read_token=begun.read_token,
                                  reason=pb.RELEASE_REASON_UNREGISTERED)  # fmt: skip
        assert await _code(peer.EndRead(unreg)) is grpc.StatusCode.INVALID_ARGUMENT
        # The reader itself, with its token, renews and ends.
        beat.read_tokens[0] = begun.read_token
        assert (await peer.Heartbeat(beat)).states == [pb.LEASE_STATE_HELD]
        end.read_token = begun.read_token
        await peer.EndRead(end)
    assert "Traceback" not in p.log_text()


async def test_with_mtls_every_peer_port_call_checks_the_allow_list(tmp_path: Path) -> None:
    make_pki(tmp_path, *NAMES)
    p = start_sidecar(tmp_path, "p", "--config", _config(tmp_path, "kvxfer-p", ["kvxfer-d"]))
    try:
        address = p.ready["peer_address"]
        for name, allowed in (("kvxfer-rogue", False), ("kvxfer-d", True)):
            creds = grpc.ssl_channel_credentials(
                root_certificates=(tmp_path / "ca.pem").read_bytes(),
                private_key=(tmp_path / f"{name}.key").read_bytes(),
                certificate_chain=(tmp_path / f"{name}.pem").read_bytes(),
            )
            async with grpc.aio.secure_channel(address, creds) as channel:
                admin = pb_grpc.AdminServiceStub(channel)
                codes = {
                    await _code(admin.GetStatus(pb.GetStatusRequest())),
                    await _code(admin.ListPeers(pb.ListPeersRequest())),
                }
            expected = grpc.StatusCode.OK if allowed else grpc.StatusCode.PERMISSION_DENIED
            assert codes == {expected}, name
    finally:
        p.stop()


async def test_with_mtls_the_peer_lane_takes_only_an_allowed_certificate(tmp_path: Path) -> None:
    make_pki(tmp_path, *NAMES)
    p = start_sidecar(tmp_path, "p", "--config", _config(tmp_path, "kvxfer-p", ["kvxfer-d"]))
    request = pb.BeginReadRequest(epoch=p.ready["epoch"], request_id="nobody")
    port = p.ready["peer_lane_port"]

    async def begin(lane: Lane) -> None:
        try:
            await lane.call("BeginRead", request, pb.BeginReadResponse, 5, "begin read")
        finally:
            await lane.close()

    def bare(tls: ssl.SSLContext | None) -> Lane:
        """A lane client with `tls` as given, not the sidecar's own dialing."""

        async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            try:
                return await asyncio.open_connection(
                    "127.0.0.1", port, ssl=tls, server_hostname="127.0.0.1" if tls else None
                )
            except OSError as exc:
                raise PeerUnavailableError(f"peer lane: {exc}") from None

        return Lane(f"127.0.0.1:{port}", 5, opener=opener, name="peer lane")

    try:
        # Each refused by the lane closing the connection (never a deadline: the lane
        # answers nothing to a caller that did not present a certificate the CA signed).
        closed = "closed the peer lane|peer lane broken"
        with pytest.raises(PeerUnavailableError, match=closed):  # plain frames to TLS
            await begin(bare(None))
        no_certificate = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with pytest.raises(PeerUnavailableError, match=closed):
            await begin(bare(no_certificate))
        # The allowed name, but signed by another CA.
        forged = tmp_path / "forged"
        forged.mkdir()
        make_pki(forged, *NAMES)
        other_ca = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        other_ca.load_cert_chain(forged / "kvxfer-d.pem", forged / "kvxfer-d.key")
        with pytest.raises(PeerUnavailableError, match=closed):
            await begin(bare(other_ca))
        for name, expected in (
            ("kvxfer-rogue", PermissionDeniedError),
            ("kvxfer-d", NotFoundError),
        ):
            # The sidecars' own dialing: their certificate, the CA, the host name checked.
            dialer = Dialer(load_settings(["--config", _config(tmp_path, name, [])]))
            try:
                with pytest.raises(expected, match=r"allowed_peers|no engine with tp_rank 0"):
                    await begin(await dialer.lane(p.ready["peer_address"], port))
            finally:
                await dialer.close()
        assert (
            metric(scrape(p), "kvxfer_peer_calls_total", method="BeginRead", transport="lane") == 1
        )
        assert metric(scrape(p), "kvxfer_refusals_total", reason="not_allowed") == 1
    finally:
        p.stop()


async def test_with_mtls_a_lane_client_that_never_ends_its_handshake_is_closed(
    tmp_path: Path,
) -> None:
    make_pki(tmp_path, *NAMES)
    config = _config(tmp_path, "kvxfer-p", [])
    p = start_sidecar(tmp_path, "p", "--config", config, "--transfer.rpc-timeout-s", "1")
    port = p.ready["peer_lane_port"]
    try:
        # A TCP connection that never says hello: asyncio's own default holds one 60 s,
        # the lane as long as a peer call's deadline.
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for reader, writer in silent:
            with contextlib.suppress(ConnectionResetError):  # closed too, by a reset
                assert await asyncio.wait_for(reader.read(), 20) == b""
            writer.close()
        dialer = Dialer(load_settings(["--config", _config(tmp_path, "kvxfer-d", [])]))
        try:  # and the lane still serves
            lane = await dialer.lane(p.ready["peer_address"], port)
            with pytest.raises(NotFoundError):
                request = pb.BeginReadRequest(epoch=p.ready["epoch"], request_id="nobody")
                await lane.call("BeginRead", request, pb.BeginReadResponse, 5, "begin read")
        finally:
            await dialer.close()
    finally:
        p.stop()
    assert "Traceback" not in p.log_text()


_FROZEN_PEER = """
import asyncio, ssl, sys
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=sys.argv[1])
context.load_cert_chain(sys.argv[2], sys.argv[3])
async def main():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0, ssl=context)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_closing_a_lane_to_a_frozen_peer_does_not_wait_for_its_tls_goodbye(
    tmp_path: Path,
) -> None:
    make_pki(tmp_path, *NAMES)
    peer = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_PEER, str(tmp_path / "ca.pem"),
         str(tmp_path / "kvxfer-p.pem"), str(tmp_path / "kvxfer-p.key")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    dialer = Dialer(load_settings(["--config", _config(tmp_path, "kvxfer-d", [])]))
    try:
        assert peer.stdout is not None
        port = int(peer.stdout.readline())
        lane = await dialer.lane("127.0.0.1:7500", port)
        await lane._open()  # connected, TLS done
        os.kill(peer.pid, signal.SIGSTOP)  # it will never answer the close
        # asyncio would wait 30 s for the peer's TLS close_notify; the lane cuts it off.
        await asyncio.wait_for(dialer.close(), 10)
    finally:
        peer.kill()
        peer.communicate()  # reaped, its pipe closed
