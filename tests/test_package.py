"""The installed kvxfer distribution: its license, metadata and the wire contract
(`.proto` files) that non-Python clients compile against."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "proto" / "kvxfer" / "v1").glob("*.proto"))


def installed_v1() -> Path:
    return Path(str(resources.files("kvxfer.v1")))


def test_every_proto_ships_in_the_installed_package() -> None:
    assert PROTOS, "no proto/kvxfer/v1/*.proto in the checkout"
    shipped = {p.name: p for p in installed_v1().glob("*.proto")}
    assert sorted(shipped) == [p.name for p in PROTOS]
    for source in PROTOS:
        assert not shipped[source.name].is_symlink()
        assert shipped[source.name].read_bytes() == source.read_bytes(), source.name
    record = metadata.files("kvxfer") or []
    assert {f"kvxfer/v1/{p.name}" for p in PROTOS} <= {str(f) for f in record}


def test_installed_protos_compile_on_their_own(tmp_path: Path) -> None:
    """protoc with only the installed package as include root: the imports between the
    files (kvxfer/v1/layout.proto) resolve, as they will for a Go or C++ client."""
    root = installed_v1().parents[1]  # site-packages
    names = [f"kvxfer/v1/{p.name}" for p in PROTOS]
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(root),
         f"--descriptor_set_out={tmp_path / 'kvxfer.pb'}", *names],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "kvxfer.pb").stat().st_size > 1000


def test_license_and_metadata() -> None:
    meta = metadata.metadata("kvxfer")
    assert meta["License-Expression"] == "Apache-2.0"
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in license_text
    dist = metadata.distribution("kvxfer")
    shipped = [f for f in dist.files or [] if f.name == "LICENSE"]
    assert shipped and shipped[0].read_text() == license_text
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert "Typing :: Typed" in classifiers
    assert "kv-cache" in (meta["Keywords"] or "")
