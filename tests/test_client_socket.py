"""EngineClient waits (bounded) for its sidecar's socket instead of failing at once,
and is importable from `kvxfer.client`."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sidecars import start_sidecar

import kvxfer.client
from kvxfer._exceptions import InvalidInputError, NotFoundError, PeerUnavailableError
from kvxfer.client import EngineClient, SyncEngineClient
from kvxfer.client import engine as engine_module

pytestmark = pytest.mark.e2e


async def test_a_client_started_before_its_sidecar_waits_for_the_socket(tmp_path: Path) -> None:
    path = tmp_path / "sc.sock"  # where start_sidecar puts sidecar "sc"'s engine socket
    client = EngineClient(f"unix:{path}", engine_id="nobody", connect_timeout_s=120)
    try:
        call = asyncio.create_task(client.unregister())
        await asyncio.sleep(0.2)
        assert not call.done()
        assert not path.exists()
        sidecar = await asyncio.to_thread(start_sidecar, tmp_path, "sc")
        try:
            # The call reached the sidecar, which does not know this engine.
            with pytest.raises(NotFoundError):
                await call
        finally:
            assert await asyncio.to_thread(sidecar.stop) == 0
    finally:
        await client.close()


async def test_a_missing_socket_fails_naming_its_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock"
    async with EngineClient(f"unix:{path}", engine_id="e", connect_timeout_s=0.3) as client:
        with pytest.raises(PeerUnavailableError, match=f"{path} did not appear within 0.3s"):
            await client.abort("req-1")


async def test_a_socket_nobody_listens_on_fails_naming_the_address(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(path))  # the file exists, nothing accepts
        async with EngineClient(f"unix:{path}", engine_id="e", connect_timeout_s=0.5) as client:
            with pytest.raises(PeerUnavailableError, match=f"unix:{path} did not accept"):
                await client.abort("req-1")


def test_the_sync_client_waits_and_fails_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock"
    client = SyncEngineClient(f"unix:{path}", engine_id="e", connect_timeout_s=0.3)
    try:
        with pytest.raises(PeerUnavailableError, match=f"{path} did not appear"):
            client.abort("req-1")
    finally:
        client.close()


def test_connect_timeout_must_be_positive() -> None:
    with pytest.raises(InvalidInputError, match="connect_timeout_s"):
        EngineClient("unix:/tmp/x.sock", connect_timeout_s=0)


def test_clients_are_exported_from_kvxfer_client_lazily(tmp_path: Path) -> None:
    assert EngineClient is engine_module.EngineClient
    assert SyncEngineClient is engine_module.SyncEngineClient
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = kvxfer.client.NoSuchThing
    code = "import sys, kvxfer.client.shm; print('grpc' in sys.modules)"
    out = subprocess.run(  # outside the source tree: the installed package
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.stdout.strip() == "False"
