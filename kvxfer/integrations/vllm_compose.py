"""kvxfer's connector as a vLLM MultiConnector child, beside an offloading connector.

`run_composed_pd` runs a prefill and a decode vLLM whose kv_transfer_config is
`MultiConnector([kvxfer, OffloadingConnector])` (or the reverse order), both
with prefix caching on (the offloading connector keys its cache by block
hash), and records what a dead or misrouted child would change:

1. Reference: the prefill engine generates every prompt on its own first (no
   kv_transfer_params: a single-instance run, which also lets its offloading
   child store the prompts' blocks).
2. Both engines drop their own prefix cache (connectors keep theirs), then
   each prompt is routed prefill -> decode: the prefill is served its prefix
   by the offloading child (`vllm:kv_offload_load_bytes`), kvxfer publishes
   those blocks and the decode pulls them (the decode's offloading child has
   never seen these prompts): tokens must equal the reference's, and kvxfer's
   pulls (stats file) are compared with the oracle by the caller.
3. Caches dropped again, the first prompt is routed once more: on the decode
   the first child with a hit loads it, kvxfer (a pull) or the offloading
   child (its own copy, kvxfer only lets the prefill release).

The offloading connector is vLLM's own with kvxfer's host-copy spec
(`vllm_offload`): the in-tree specs need a GPU. Sidecars come from the caller
(a `kvxfer.cli.fleet.Fleet`), as in `vllm_demo`.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvxfer._exceptions import InvalidInputError
from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.vllm_demo import read_layout, read_pulls

STORE_BYTES = "vllm:kv_offload_store_bytes"
LOAD_BYTES = "vllm:kv_offload_load_bytes"
ORDERS = ("kvxfer-first", "offload-first")
RESET_DEADLINE_S = 45.0  # past the lease TTL: see _reset_prefix_caches
LEASE_METRICS = (
    "kvxfer_active_leases",
    "kvxfer_held_blocks",
    "kvxfer_released_leases_total",
    "kvxfer_expired_leases_total",
    "kvxfer_events_dropped",
)


def composed_configs(
    prefill_sidecar: str, decode_sidecar: str, stats_path: Path, order: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill, decode) kv_transfer_configs: MultiConnector over kvxfer and vLLM's
    OffloadingConnector, in `order`."""
    if order not in ORDERS:
        raise InvalidInputError("order", f"{order!r} unknown; expected one of {ORDERS}")
    offload = vllm_fleet.host_offload_connector_config()
    configs = []
    for role, sidecar, extra in (
        ("kv_producer", prefill_sidecar, {}),
        ("kv_consumer", decode_sidecar, {"stats_path": str(stats_path)}),
    ):
        kvxfer = vllm_fleet.kvxfer_connector_config(role, sidecar, **extra)
        children = [kvxfer, offload] if order == "kvxfer-first" else [offload, kvxfer]
        configs.append(vllm_fleet.multi_connector_config(children))
    return configs[0], configs[1]


def _reset_prefix_caches(pair: vllm_fleet.PdPair, prefill_metrics: str | None) -> float:
    """Drop both engines' own prefix caches (the offloading child keeps its copy);
    returns how long the prefill's took.

    A prefill frees a routed request's blocks once the decode's pull released its
    lease, which the engine hears on its next step (so a step is taken between
    tries). A lease its reader never ended frees them when it expires (the sidecars'
    lease TTL, 30 s): the wait runs past that, and what the prefill sidecar says of
    its leases is in the error if the blocks are still held."""
    took = 0.0
    for worker in (pair.prefill, pair.decode):
        start = time.monotonic()
        while not worker.reset_prefix_cache():
            if time.monotonic() - start > RESET_DEADLINE_S:
                raise vllm_fleet.VllmWorkerError(
                    f"{worker.name} kept blocks in use for {RESET_DEADLINE_S:g}s of reset "
                    f"attempts; the prefill sidecar's leases: {_lease_samples(prefill_metrics)}"
                )
            worker.generate([[7]], 1)
            time.sleep(0.1)
        if worker is pair.prefill:
            took = time.monotonic() - start
    return took


def _lease_samples(metrics_address: str | None) -> str:
    """The lease and event lines of a sidecar's /metrics, for an error message."""
    if metrics_address is None:
        return "(no metrics address)"
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except Exception as exc:  # a diagnosis must not hide the error it explains
        return f"(scrape of {metrics_address} failed: {exc})"
    lines = [
        line
        for line in text.splitlines()
        if line.startswith(LEASE_METRICS) and "_created" not in line
    ]
    return "; ".join(lines)


def run_composed_pd(
    model: Path,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    sidecars: Any,
    workdir: Path,
    *,
    block_size: int | None = None,
    order: str = "kvxfer-first",
    python: Path | None = None,
) -> dict[str, Any]:
    """Run the composed P/D pair on `prompts` and report what it saw (see module doc)."""
    if len(prompts) < 1:
        raise InvalidInputError("prompts", "needs at least one prompt")
    python = vllm_fleet.find_vllm_python(python)
    workdir.mkdir(parents=True, exist_ok=True)
    p = sidecars.sidecar(f"{workdir.name}-prefill")
    d = sidecars.sidecar(f"{workdir.name}-decode")
    stats = workdir / "decode-stats.jsonl"
    prefill_config, decode_config = composed_configs(
        p.ready["engine_address"], d.ready["engine_address"], stats, order
    )
    prefill, decode = vllm_fleet.pd_specs(model, prefill_config, decode_config, 1024, block_size)
    prefill = replace(prefill, enable_prefix_caching=True)
    decode = replace(decode, enable_prefix_caching=True)
    with vllm_fleet.PdPair(prefill, decode, python, workdir) as pair:
        reference = pair.prefill.generate(prompts, max_tokens)
        want = [g.token_ids for g in reference.outputs]
        metrics = p.ready.get("metrics_address")
        _reset_prefix_caches(pair, metrics)
        warm_up = len(stats.read_text().splitlines())
        routed = [_route(pair, prompt, max_tokens) for prompt in prompts]
        release_wait_s = _reset_prefix_caches(pair, metrics)
        again = _route(pair, prompts[0], max_tokens)
    pulls = read_pulls(stats, warm_up)
    rows = [*routed, again]
    return {
        "model": str(model),
        "order": order,
        "prefill_kv_transfer_config": prefill_config,
        "decode_kv_transfer_config": decode_config,
        "requests": len(rows),
        "matched": sum(r["token_ids"] == w for r, w in zip(rows, [*want, want[0]], strict=True)),
        "reference_store_bytes": reference.metrics_delta.get(STORE_BYTES, 0.0),
        "routed": routed,
        "repeat": again,
        "prefill_release_wait_s": release_wait_s,
        "pulls": pulls,
        "bytes_moved": sum(x["bytes_moved"] for x in pulls),
        "layout": read_layout(stats),
    }


def _route(pair: vllm_fleet.PdPair, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """One request prefill -> decode, with the offloading child's byte counters on both."""
    params, first = pair.prefill_for_decode(prompt)
    second = pair.decode.generate([prompt], max_tokens, [params])
    out = second.outputs[0]
    return {
        "prompt_tokens": len(prompt),
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "prefill_store_bytes": first.metrics_delta.get(STORE_BYTES, 0.0),
        "prefill_load_bytes": first.metrics_delta.get(LOAD_BYTES, 0.0),
        "decode_store_bytes": second.metrics_delta.get(STORE_BYTES, 0.0),
        "decode_load_bytes": second.metrics_delta.get(LOAD_BYTES, 0.0),
    }
