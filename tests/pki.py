"""A throwaway CA and certificates it signed, made with the openssl command: for the
mTLS tests and for the settings and flags that name PEM files (which are loaded when
they are named)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, *names: str) -> None:
    """ca.pem (its key ca.key) in `directory`, and for each name NAME.pem and NAME.key:
    a certificate the CA signed, common name NAME, valid for 127.0.0.1 and localhost."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=kvxfer-test-ca", cwd=directory)  # fmt: skip
    for name in names:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
        (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip


def tls_env(directory: Path) -> dict[str, str]:
    """KVXFER_TLS__CERT_FILE, __KEY_FILE and __CA_FILE naming good files in `directory`."""
    make_pki(directory, "kvxfer-test")
    return {
        "KVXFER_TLS__CERT_FILE": str(directory / "kvxfer-test.pem"),
        "KVXFER_TLS__KEY_FILE": str(directory / "kvxfer-test.key"),
        "KVXFER_TLS__CA_FILE": str(directory / "ca.pem"),
    }
