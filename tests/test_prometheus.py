"""A real Prometheus server scrapes a sidecar during pulls; its view matches the
sidecar's own counters, and the documented throughput query gives a number."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sidecars import engine_link, free_port, scrape, spans, start_engine, start_sidecar

from kvxfer.cli.fleet import Proc, Samples, metric
from kvxfer.core.negotiation import PROTOCOL_VERSION
from kvxfer.core.requests import PullDone, PullStatus

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="the prometheus server is not installed (.ci/run installs the Debian package)",
    ),
]

THROUGHPUT = (
    "sum(rate(kvxfer_bytes_moved_total[1m])) / sum(rate(kvxfer_transfer_active_seconds_total[1m]))"
)


def _query(port: int, expr: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def _value(port: int, expr: str) -> float | None:
    result = _query(port, expr)
    if not result:
        return None
    value = result[0]["value"]
    assert isinstance(value, list)
    return float(value[1])


async def _ready(server: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.3)
    raise AssertionError(f"prometheus never became ready: {log.read_text()[-2000:]}")


async def _wait_for(port: int, expr: str, want: float, timeout_s: float = 30) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = _value(port, expr)
        if value == want:
            return value
        await asyncio.sleep(0.5)
    return value


async def test_prometheus_scrapes_what_the_sidecar_did(tmp_path: Path) -> None:
    p = start_sidecar(tmp_path, "p")
    d = start_sidecar(tmp_path, "d")
    pe = start_engine(tmp_path, p, "gpt-oss-20b", "prefill", num_blocks=64)
    de = start_engine(tmp_path, d, "gpt-oss-20b", "decode", num_blocks=64)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kvxfer\n"
        f"    static_configs: [{{targets: ['{d.ready['metrics_address']}', "
        f"'{p.ready['metrics_address']}']}}]\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    server = subprocess.Popen(
        [
            "prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log, stderr=log,
    )  # fmt: skip
    try:
        await _ready(server, port, tmp_path / "prometheus.log")
        blocks = {0: range(20), 1: range(20)}
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            for i in range(3):
                params = await pc.publish(f"prom-{i}", 300, spans(blocks))
                await dc.pull(params, spans({0: range(30, 50), 1: range(30, 50)}), 0)
                done = await d_events.next()
                assert isinstance(done, PullDone) and done.status is PullStatus.OK
                # Let Prometheus see each step, so rate() has increases to work with.
                own = metric(scrape(d), "kvxfer_bytes_moved_total")
                seen = await _wait_for(port, "sum(kvxfer_bytes_moved_total)", own)
                assert seen == own, f"Prometheus saw {seen} bytes, the sidecar counted {own}"
        assert await _wait_for(port, "sum(kvxfer_requests_total{result='ok'})", 3) == 3
        assert await _wait_for(port, "kvxfer_active_leases", 0) == 0
        throughput = _value(port, THROUGHPUT)
        assert throughput is not None and throughput > 0, throughput
    finally:
        server.terminate()
        server.wait(30)
        log.close()
        for proc in (de, pe, d, p):
            proc.stop()


def _samples(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _exposition(sidecar: Proc) -> str:
    address = sidecar.ready["metrics_address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with prometheus")
async def test_a_live_scrape_is_clean_and_complete(tmp_path: Path) -> None:
    p = start_sidecar(tmp_path, "prefill-0")
    d = start_sidecar(tmp_path, "decode-0")
    pe = start_engine(tmp_path, p, "gpt-oss-20b", "prefill", num_blocks=64)
    de = start_engine(tmp_path, d, "gpt-oss-20b", "decode", num_blocks=64)
    try:
        before = scrape(d)  # no pull yet: the series whose labels are known exist, at zero
        async with engine_link(p, pe) as (pc, _), engine_link(d, de) as (dc, d_events):
            params = await pc.publish("lint-0", 300, spans({0: range(20), 1: range(20)}))
            await dc.pull(params, spans({0: range(30, 50), 1: range(30, 50)}), 0)
            assert isinstance(await d_events.next(), PullDone)
        text = _exposition(d)
    finally:
        for proc in (de, pe, d, p):
            proc.stop()
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    samples = _samples(text)
    # The peer is named by its identity (its sidecar id), not its IP:port.
    assert metric(samples, "kvxfer_requests_total", peer="prefill-0", result="ok") == 1
    assert not any(
        dict(labels).get("peer", "prefill-0") not in ("prefill-0", "other") for _, labels in samples
    )
    # A new peer label starts every result at zero; reasons exist before any event.
    assert ("kvxfer_requests_total", (("peer", "prefill-0"), ("result", "failed"))) in samples
    for reason in (
        "too_large",
        "undecodable",
        "not_allowed",
        "too_many_calls",
        "too_many_connections",
    ):
        assert ("kvxfer_refusals_total", (("reason", reason),)) in before
    for reason in ("consumed", "aborted", "unregistered"):
        assert ("kvxfer_released_leases_total", (("reason", reason),)) in before
    assert metric(samples, "kvxfer_build_info", protocol=str(PROTOCOL_VERSION)) == 1
    assert metric(samples, "process_resident_memory_bytes") > 0
    assert metric(samples, "kvxfer_transfer_bytes_count") == 1
    assert metric(samples, "kvxfer_transfer_bytes_sum") == metric(
        samples, "kvxfer_bytes_moved_total"
    )
    assert metric(samples, "kvxfer_transfer_descriptors_sum") == metric(
        samples, "kvxfer_descriptors_total"
    )
    # Building the descriptors took well under a millisecond: the buckets resolve it.
    post = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in samples.items()
        if name == "kvxfer_post_duration_seconds_bucket"
    )
    assert sum(1 for le, _ in post if le < 0.001) >= 5
    assert post[0][1] == 0, "the post took less than the first bucket: it resolves nothing"
    # The pull went through each phase once, none longer than the whole pull.
    whole = metric(samples, "kvxfer_transfer_duration_seconds_sum", peer="prefill-0", result="ok")
    for phase in ("queued", "begin_read", "read"):
        labels = {"peer": "prefill-0", "phase": phase}
        assert metric(samples, "kvxfer_pull_phase_duration_seconds_count", **labels) == 1, phase
        spent = metric(samples, "kvxfer_pull_phase_duration_seconds_sum", **labels)
        assert 0 <= spent <= whole, (phase, spent, whole)
    read = metric(samples, "kvxfer_pull_phase_duration_seconds_sum", peer="prefill-0", phase="read")
    assert read > 0  # a read of 40 blocks takes time; queueing with no other pull need not
