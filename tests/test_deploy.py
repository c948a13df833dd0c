"""What an operator deploys: the image's install steps, its defaults, the monitoring
bundle and the generated settings reference (docs/deploy.md).

No Docker daemon exists here, so the image is tested through its one build step,
`deploy/image/install.sh`, run in a fresh venv: a real sidecar starts from that venv,
a real engine registers NIXL memory with it, the image's health probe asks it over
gRPC, and promtool checks a real scrape. The static checks (hadolint, checkov,
kubernetes-validate, promtool test rules) run in `make deploy-check`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pki import tls_env

from kvxfer._exceptions import InvalidInputError
from kvxfer.cli.fleet import Proc, spawn
from kvxfer.core.requests import PullStatus
from kvxfer.dataplane.adapter import TransferStatus
from kvxfer.server.metrics import Metrics
from kvxfer.server.settings import Settings, load_settings
from kvxfer.v1 import sidecar_pb2

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "deploy" / "image"
GEN_CONFIG_DOCS = ROOT / "scripts" / "gen_config_docs.py"
# What the lean venv may hold at most (measured 249 MB: docs/deploy.md). A torch
# or CUDA wheel sneaking in would add gigabytes.
MAX_IMAGE_VENV_MB = 300
FORBIDDEN = {"torch", "triton", "cupy-cuda12x"}


def tool(name: str) -> str:
    """A CI tool that must be present: missing, the test fails (never skips)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: install it (.ci/run does: {name} is required)")
    return path


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("image") / "venv"
    done = subprocess.run(
        [str(IMAGE / "install.sh"), str(venv), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


def site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


def du_mb(path: Path) -> float:
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_symlink()) / 1e6


def test_image_venv_is_lean_and_complete(image_venv: Path) -> None:
    dists = {
        canonicalize_name(d.metadata["Name"]): d
        for d in importlib.metadata.distributions(path=[str(site_packages(image_venv))])
    }
    assert "kvxfer" in dists
    assert not FORBIDDEN & dists.keys()
    assert not [n for n in dists if n.startswith("nvidia-")]
    # Every dependency is installed (install.sh uses --no-deps), except the torch that
    # nixl-cu12 declares and the sidecar never imports.
    missing = []
    for name, dist in dists.items():
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(req.name) not in dists and (name, req.name) != (
                "nixl-cu12",
                "torch",
            ):
                missing.append(f"{name} -> {text}")
    assert missing == []
    size = du_mb(image_venv)
    print(f"image venv: {size:.0f} MB")
    assert size < MAX_IMAGE_VENV_MB


# What the compiled libraries in the image venv may take from the system: all of it is
# in python:3.11.14-slim-bookworm (apt itself depends on libstdc++6; python on libssl3).
SLIM_BASE_LIBS = {
    "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
    "libgcc_s.so.1", "libstdc++.so.6", "libz.so.1", "libssl.so.3", "libcrypto.so.3",
}  # fmt: skip


def test_image_venv_needs_only_what_the_slim_base_has(image_venv: Path) -> None:
    site = site_packages(image_venv)
    system: set[str] = set()
    for lib in [*site.glob("nixl_cu12/*.so"), *site.glob("nixl_cu12.libs/*.so*")]:
        out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            name, _, where = line.strip().partition(" => ")
            assert "not found" not in where, f"{lib.name}: {line.strip()}"
            if where and str(site) not in str(Path(where.split()[0]).resolve()):
                system.add(name)
    assert "libstdc++.so.6" in system  # found at all
    assert system <= SLIM_BASE_LIBS


@pytest.fixture
def lean_sidecar(image_venv: Path, tmp_path: Path) -> Iterator[Proc]:
    argv = [
        str(image_venv / "bin" / "kvxfer-server"),
        "--peer-address", "127.0.0.1:0",
        "--engine-address", f"unix:{tmp_path}/engine.sock",
        "--metrics-address", "127.0.0.1:0",
    ]  # fmt: skip
    proc = spawn("sidecar from the image venv", argv, tmp_path / "sidecar.log")
    try:
        yield proc
    finally:
        assert proc.stop() == 0, (tmp_path / "sidecar.log").read_text()[-2000:]


def health(venv: Path, address: str, service: str) -> subprocess.CompletedProcess[str]:
    argv = [str(venv / "bin" / "python"), str(IMAGE / "kvxfer-health"), address]
    return subprocess.run(
        [*argv, "--service", service], capture_output=True, text=True, timeout=60, check=False
    )


def test_image_venv_runs_a_sidecar_its_probe_and_promtool_accept(
    image_venv: Path, lean_sidecar: Proc, tmp_path: Path
) -> None:
    engine = lean_sidecar.ready["engine_address"]
    ok = health(image_venv, engine, "kvxfer.v1.EngineService")
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout
    unknown = health(image_venv, engine, "kvxfer.v1.NoSuchService")
    assert unknown.returncode == 1
    assert "NOT_FOUND" in unknown.stderr
    gone = health(image_venv, f"unix:{tmp_path}/nobody.sock", "")
    assert gone.returncode == 1
    assert "UNAVAILABLE" in gone.stderr

    # A real engine (numpy + shared memory, no torch) registers NIXL memory.
    sim = [
        str(image_venv / "bin" / "kvxfer-cli"), "engine-sim", "--sidecar", engine,
        "--model", "llama-3.1-8b", "--role", "prefill", "--num-blocks", "8",
        "--state-blocks", "4",
    ]  # fmt: skip
    engine_proc = spawn("engine-sim from the image venv", sim, tmp_path / "engine.log")
    try:
        address = lean_sidecar.ready["metrics_address"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            scrape = response.read().decode()
    finally:
        assert engine_proc.stop() == 0, (tmp_path / "engine.log").read_text()[-2000:]
    assert re.search(r"^kvxfer_registered_engines 1\.0$", scrape, re.M)
    check = subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=scrape,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def dockerfile_env() -> dict[str, str]:
    """The runtime stage's ENV, as the container sees it."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    runtime = text.rsplit("\nFROM ", 1)[1]
    env: dict[str, str] = {}
    for line in runtime.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def test_image_defaults_need_tls_and_never_bind_the_peer_port_wide(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = {k: v for k, v in dockerfile_env().items() if k.startswith("KVXFER_")}
    dockerfile = (ROOT / "Dockerfile").read_text()
    sock_dir = str(Path(env["KVXFER_ENGINE_ADDRESS"].removeprefix("unix:")).parent)
    assert f"-o 10001 -g 10001 -m 0700 {sock_dir}\n" in dockerfile  # created, owned
    assert re.search(r"^CMD \[\]$", dockerfile, re.M)  # no flag overrides the env
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # Without the mounted certificates the sidecar refuses to start, naming the file.
    with pytest.raises(InvalidInputError, match="cert_file"):
        load_settings([])
    for key, path in tls_env(tmp_path).items():
        monkeypatch.setenv(key, path)
    settings = load_settings([])
    assert settings.peer_address == "127.0.0.1:7500"  # never 0.0.0.0 by default
    assert settings.tls.enabled
    monkeypatch.setenv("KVXFER_PEER_ADDRESS", "10.1.2.3:7500")  # as $(POD_IP):7500
    assert load_settings([]).peer_address == "10.1.2.3:7500"


def test_health_probe_refuses_bad_arguments() -> None:
    probe = [sys.executable, str(IMAGE / "kvxfer-health"), "unix:/x.sock", "--timeout", "0"]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--timeout" in done.stderr


MONITORING = ROOT / "deploy" / "monitoring"


def exported_series() -> set[str]:
    """Every series name the sidecar's registry can export (server/metrics.py)."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "info": ("_info",),
    }
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


@pytest.mark.parametrize("path", ["prometheusrule.yaml", "grafana-dashboard.json"])
def test_monitoring_queries_use_metrics_and_labels_the_sidecar_exports(path: str) -> None:
    text = (MONITORING / path).read_text()
    used = set(re.findall(r"\bkvxfer_[a-z_]+", text))
    assert used, path
    assert used - exported_series() == set()
    results = {s.value for s in PullStatus} | {s.value for s in TransferStatus}
    results |= {"ok", "refused", "error"}  # handshakes (server/peers.py)
    for values in re.findall(r'result[!=]~?\\?"([^"\\]+)', text):
        assert set(values.split("|")) <= results, values


def test_alerts_cover_what_operators_must_hear_about() -> None:
    text = (MONITORING / "prometheusrule.yaml").read_text()
    alerts = set(re.findall(r"- alert: (\w+)", text))
    wanted = {"TransferFailures", "LeaseExpiries", "StalledPulls", "HandshakesRefused", "NoPeers"}
    assert {f"Kvxfer{a}" for a in wanted} <= alerts
    tests = (MONITORING / "rules-test.yaml").read_text()
    assert alerts <= set(re.findall(r"alertname: (\w+)", tests))  # each one unit-tested


def config_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", GEN_CONFIG_DOCS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations there
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current_and_complete() -> None:
    gen = config_docs()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen.render(), "run: python scripts/gen_config_docs.py"
    rows = list(gen.rows(Settings))
    assert len(rows) > 30
    for row in rows:
        assert row.description, f"{row.flag}: add a Field description in server/settings.py"
        assert f"| `{row.flag}` | `{row.env}` |" in committed


def test_configuration_reference_names_what_the_sidecar_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each numeric setting's documented flag and variable reach that very field: a bad
    value given either way is refused naming it (a wrong name would be ignored or
    refused as unknown)."""
    numeric = [r for r in config_docs().rows(Settings) if r.type in {"integer", "number"}]
    assert len(numeric) > 20
    for row in numeric:
        field = ".".join(row.path)
        with pytest.raises(InvalidInputError, match=re.escape(field)):
            load_settings([f"{row.flag}=x"])
        with monkeypatch.context() as env:
            env.setenv(row.env, "x")
            with pytest.raises(InvalidInputError, match=re.escape(field)):
                load_settings([])


KUBE = ROOT / "deploy" / "kubernetes"
POD = {"POD_IP": "10.1.2.3", "POD_NAMESPACE": "kvxfer"}


def statefulset(role: str) -> dict[str, Any]:
    (found,) = [
        doc
        for doc in yaml.safe_load_all((KUBE / "base" / f"{role}.yaml").read_text())
        if doc["kind"] == "StatefulSet"
    ]
    return found  # type: ignore[no-any-return]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of env values and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


@pytest.mark.parametrize(("role", "other"), [("prefill", "decode"), ("decode", "prefill")])
def test_manifests_configure_a_sidecar_the_server_accepts(
    role: str, other: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pod = statefulset(role)["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER
    assert re.search(r"^USER 10001:10001$", (ROOT / "Dockerfile").read_text(), re.M)
    env = dict(dockerfile_env()) | POD | {"POD_NAME": f"{role}-0"}
    for item in sidecar["env"]:
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
    certs = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert certs["tls"] == str(Path(env["KVXFER_TLS__CERT_FILE"]).parent)
    env |= tls_env(tmp_path)
    for key, value in env.items():
        if key.startswith("KVXFER_"):
            monkeypatch.setenv(key, value)
    settings = load_settings([])
    assert settings.peer_address == "10.1.2.3:7500"  # the pod IP, never 0.0.0.0
    advertised = f"{role}-0.kvxfer-{role}.kvxfer.svc.cluster.local:7500"
    assert settings.advertise_address == advertised
    # Peers dial the lane at the advertised name: a fixed port the pod declares.
    assert settings.lane.enabled
    assert {"name": "lane", "containerPort": settings.lane.port} in sidecar["ports"]
    assert settings.tls.allowed_peers == (f"kvxfer-{other}",)

    # The certificates cover the advertised name and carry the CN the other role allows.
    certs_doc = yaml.safe_load_all((KUBE / "cert-manager" / "certificates.yaml").read_text())
    (cert,) = [
        d["spec"]
        for d in certs_doc
        if d["kind"] == "Certificate" and d["metadata"]["name"] == f"kvxfer-{role}"
    ]
    assert cert["commonName"] == f"kvxfer-{role}"
    other_env = statefulset(other)["spec"]["template"]["spec"]["initContainers"][0]["env"]
    assert {"name": "KVXFER_TLS__ALLOWED_PEERS", "value": f'["kvxfer-{role}"]'} in other_env
    assert {"server auth", "client auth"} <= set(cert["usages"])
    (wildcard,) = cert["dnsNames"]
    assert advertised.rsplit(":", 1)[0].split(".", 1)[1] == wildcard.removeprefix("*.")
    (tls_volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert tls_volume["secret"]["secretName"] == cert["secretName"]

    # The engine reaches the same socket, through the same volume.
    kv = json.loads(next(e["value"] for e in engine["env"] if e["name"] == "KV_TRANSFER_CONFIG"))
    assert kv["kv_connector_extra_config"]["sidecar"] == settings.engine_address
    assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    run = str(Path(settings.engine_address.removeprefix("unix:")).parent)
    for container in (sidecar, engine):
        assert {"name": "kvxfer-run", "mountPath": run} in container["volumeMounts"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # Probes ask for services the sidecar serves.
    services = set(sidecar_pb2.DESCRIPTOR.services_by_name)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = sidecar[probe]["exec"]["command"]
        assert command[0] == "kvxfer-health"
        assert command[command.index("--service") + 1].removeprefix("kvxfer.v1.") in services


def test_the_gpu_overlay_sets_settings_the_server_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU overlay's own sidecar variables name real settings: one reading agent per
    peer there (the NIC copies over RDMA; a second would register the memory again)."""
    ops = yaml.safe_load((KUBE / "overlays" / "gpu" / "gpu.yaml").read_text())
    added = [
        op["value"]
        for op in ops
        if op["path"] == "/spec/template/spec/initContainers/0/env/-"
        and op["value"]["name"].startswith("KVXFER_")
    ]
    assert added, "the GPU overlay sets no kvxfer setting"
    for item in added:
        monkeypatch.setenv(item["name"], item["value"])
    assert load_settings([]).transfer.agents_per_peer == 1
