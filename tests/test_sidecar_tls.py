"""mTLS on PeerService: a peer with an allowed certificate pulls; others are refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pki import make_pki
from sidecars import DecodeImage, engine_link, scrape, spans, start_engine, start_sidecar

from kvxfer._exceptions import KvxferError
from kvxfer.cli.fleet import BIN, metric
from kvxfer.core.requests import PullDone, PullStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "gemma-3-4b-it"


def _config(tmp: Path, name: str, allowed: list[str]) -> str:
    path = tmp / f"{name}.json"
    tls = {
        "cert_file": str(tmp / f"{name}.pem"),
        "key_file": str(tmp / f"{name}.key"),
        "ca_file": str(tmp / "ca.pem"),
        "allowed_peers": allowed,
    }
    path.write_text(json.dumps({"tls": tls}))
    return str(path)


async def test_mtls_allow_list(tmp_path: Path) -> None:
    make_pki(tmp_path, "kvxfer-p", "kvxfer-d", "kvxfer-rogue")
    p = start_sidecar(tmp_path, "p", "--config", _config(tmp_path, "kvxfer-p", ["kvxfer-d"]))
    pe = start_engine(tmp_path, p, MODEL, "prefill", num_blocks=32)
    d = start_sidecar(tmp_path, "d", "--config", _config(tmp_path, "kvxfer-d", []))
    de = start_engine(tmp_path, d, MODEL, "decode", num_blocks=32)
    r = start_sidecar(tmp_path, "r", "--config", _config(tmp_path, "kvxfer-rogue", []))
    re = start_engine(tmp_path, r, MODEL, "decode", num_blocks=32)
    try:
        blocks = {g.group_id: list(range(8)) for g in pe.layout.groups}
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            params = await pc.publish("tls-ok", 100, spans(blocks))
            await dc.pull(params, spans(blocks), 0)
            done = await d_events.next()
            assert isinstance(done, PullDone) and done.status is PullStatus.OK, done.reason
            DecodeImage(de).expect_pull(pe, spans(blocks), spans(blocks), 100, 0, {})
        # Its BeginRead took the peer lane, over the same mTLS.
        begun = metric(scrape(p), "kvxfer_peer_calls_total", method="BeginRead", transport="lane")
        assert begun == 1
        async with engine_link(p, pe) as (pc, _), engine_link(r, re) as (rc, _):
            params = await pc.publish("tls-rogue", 100, spans(blocks))
            with pytest.raises(KvxferError, match="allowed_peers"):
                await rc.pull(params, spans(blocks), 0)
        cli = [str(BIN / "kvxfer-cli"), "handshake", "--peer", p.ready["peer_address"],
               "--layout", MODEL]  # fmt: skip
        plain = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)
        assert plain.returncode == 3 and "unreachable" in plain.stderr  # docs/cli.md
        with_cert = [
            *cli,
            "--tls-cert", str(tmp_path / "kvxfer-d.pem"),
            "--tls-key", str(tmp_path / "kvxfer-d.key"),
            "--tls-ca", str(tmp_path / "ca.pem"),
        ]  # fmt: skip
        ok = subprocess.run(with_cert, capture_output=True, text=True, timeout=60, check=False)
        assert ok.returncode == 0, ok.stderr
    finally:
        for proc in (re, r, de, d, pe, p):
            proc.stop()
