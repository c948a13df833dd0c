"""The PEM files of mTLS, checked where they are named (the sidecar's `tls.*` settings,
kvxfer-cli's `--tls-*` flags): a file that is not what it should be is refused there,
naming it, not found out by ssl or gRPC later (a traceback while the sidecar starts, a
peer reported unreachable). They are loaded as the sidecar's peer lane loads them
(server/peer_tls.py); gRPC reads the same PEM."""

from __future__ import annotations

import ssl
from pathlib import Path


class _EncryptedKeyError(Exception):
    """Raised by the passphrase callback: the key is encrypted."""


def certificate_problem(path: Path) -> str | None:
    """Why `path` is no PEM file of certificates (a certificate chain or a CA bundle), or
    None."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        return _no_pem("certificate", exc)
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if not context.cert_store_stats()["x509"]:  # revocation lists only
        return "holds no PEM certificate"
    return None


def key_problem(certificate: Path, key: Path) -> str | None:
    """Why `key` is not the unencrypted PEM private key of `certificate` (one that
    `certificate_problem` found good), or None."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(str(certificate), str(key), password=_refuse_passphrase)
    except _EncryptedKeyError:
        # gRPC takes no passphrase, and ssl would ask for one on the terminal.
        return "is encrypted: give the private key unencrypted (gRPC takes no passphrase)"
    except ssl.SSLError as exc:
        # A key of another type than the certificate's (RSA for an EC certificate) is
        # NO_CERTIFICATE_ASSIGNED to OpenSSL: as much not its key as a mismatched one.
        if exc.reason in ("KEY_VALUES_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
            return f"is not the private key of the certificate in {certificate}"
        if exc.reason == "EE_KEY_TOO_SMALL":
            return "holds a key too small for this host's OpenSSL security level"
        return _no_pem("private key", exc)
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    return None


def _refuse_passphrase() -> str:
    raise _EncryptedKeyError


def _no_pem(what: str, exc: ssl.SSLError) -> str:
    # OpenSSL's reason when it has one (NO_CERTIFICATE_OR_CRL_FOUND); "PEM lib" has none.
    return f"holds no PEM {what}" + (f" ({exc.reason})" if exc.reason else "")
