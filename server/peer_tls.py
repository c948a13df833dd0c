"""mTLS of the peer lane (server/peer_lane.py), as the peer port's gRPC has it: the
sidecar's certificate both ways, the CA checked both ways, a client certificate
required, and the server's checked against the host it was dialed by."""

from __future__ import annotations

import ssl

from kvxfer.server.settings import Settings


def server_tls(settings: Settings) -> ssl.SSLContext | None:
    """The lane's TLS with `tls.*` set: this sidecar's certificate, and a client
    certificate the CA signed required of every caller (as the peer port requires)."""
    context = _context(settings, ssl.Purpose.CLIENT_AUTH)
    if context is not None:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls(settings: Settings) -> ssl.SSLContext | None:
    """A peer's lane is dialed with this sidecar's certificate and checked against the
    CA and the host it was dialed by, as the gRPC channel to its peer port is."""
    return _context(settings, ssl.Purpose.SERVER_AUTH)


def _context(settings: Settings, purpose: ssl.Purpose) -> ssl.SSLContext | None:
    tls = settings.tls
    if not tls.enabled:
        return None
    assert tls.cert_file and tls.key_file and tls.ca_file
    context = ssl.create_default_context(purpose, cafile=str(tls.ca_file))
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return context
