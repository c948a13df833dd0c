"""The real main job: prefill and decode vLLM processes moving KV through two sidecars.

`run_vllm_demo` starts two kvxfer sidecars (kvxfer.cli.fleet) and a prefill
and a decode vLLM with kvxfer's connector (vllm_fleet.PdPair), routes each
prompt prefill -> decode as a router does, and compares the decoded tokens
with a reference: one vLLM engine alone for attention models (the decode engine
itself, on plain requests before any transfer: one engine start fewer); for state models
(Qwen3-Next, whose chunked and recurrent kernels drift in bf16) vLLM's own
NixlConnector P/D on the same prompts. A negative control decodes a prompt
from another request's KV: it must diverge, or the moved KV was never used.
What moved comes from the connector's stats file (one JSON line per pull).
"""

from __future__ import annotations

import collections
import json
import random
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvxfer._exceptions import InvalidInputError, KvxferError
from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE
from kvxfer.integrations.vllm_params import published_request

STATE_FAMILIES = frozenset({"qwen3-next"})
# vLLM-CPU takes block sizes that are multiples of 32; B=32 puts gemma3's window of
# 80 inside a block, so the window is not block-aligned.
BLOCK_SIZE: dict[str, int | None] = {"gemma3": 32, "gpt-oss": 32}
# How long the prefill may take to tell vLLM its last requests' blocks are free (a step
# after the decode's EndRead; TP runs on this VM can stall for tens of seconds).
RELEASE_WAIT_S = 60.0


@dataclass(frozen=True)
class DemoOptions:
    model: str  # a tiny-model family or a model directory
    requests: int = 4
    tokens_range: tuple[int, int] = (150, 700)
    max_tokens: int = 8
    fail_rate: float = 0.0
    seed: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_block_size: int | None = None  # None: the family's default (BLOCK_SIZE)
    decode_block_size: int | None = None  # None: as the prefill's

    @property
    def block_sizes(self) -> tuple[int | None, int | None]:
        """The prefill's and the decode's block size (None: vLLM's default)."""
        prefill = self.prefill_block_size or BLOCK_SIZE.get(self.model)
        return prefill, self.decode_block_size or prefill

    @property
    def dtype(self) -> str:
        """float32 across different TP or block sizes: either changes the order of the
        sums (each rank reduces its own heads; the kernel walks the cache a block at a
        time), and in bfloat16 that alone flips near-tied tokens of a random-weight
        model, KV moved byte-exact or not; in float32 it does not. State models stay
        bfloat16 (vLLM-CPU's Gated DeltaNet kernels take nothing else): their reference
        is NixlConnector P/D at the same TP sizes, whose decode sums alike."""
        prefill, decode = self.block_sizes
        if self.model in STATE_FAMILIES or (
            self.prefill_tp == self.decode_tp and prefill == decode
        ):
            return "bfloat16"
        return "float32"

    @property
    def nice(self) -> int:
        """Engines with TP > 1 run niced: vLLM-CPU's TP workers poll their shared-memory
        queue after every step and otherwise starve the sidecars on two cores."""
        return 10 if max(self.prefill_tp, self.decode_tp) > 1 else 0

    def __post_init__(self) -> None:
        low, high = self.tokens_range
        if not 0 < low <= high:
            raise InvalidInputError("--tokens-range", f"needs 0 < A <= B, got {low}:{high}")
        if not 0 <= self.fail_rate < 1:
            raise InvalidInputError("--fail-rate", f"must be in [0, 1), got {self.fail_rate}")
        if self.requests < 2:
            raise InvalidInputError("--requests", f"needs 2 or more, got {self.requests}")
        prefill, decode = self.block_sizes
        if decode != prefill and (prefill is None or decode is None):
            raise InvalidInputError(
                "--decode-block-size",
                f"{decode} against vLLM's default block size for {self.model}, which the "
                "demo does not know: give --prefill-block-size too",
            )


def run_vllm_demo(options: DemoOptions, workdir: Path, sidecars: Any) -> dict[str, Any]:
    """The demo's report (see README); `sidecars` is a kvxfer.cli.fleet.Fleet."""
    python = vllm_fleet.find_vllm_python()
    family, model = _model(options.model, workdir, python)
    rng = random.Random(options.seed)
    low, high = options.tokens_range
    prompts = [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(low, high))]
               for _ in range(options.requests)]  # fmt: skip
    control = [rng.randrange(1, VOCAB_SIZE) for _ in range(len(prompts[1]))]
    p_block, block = options.block_sizes
    # A decode of another block size reads the prefill's pages whole (vllm_reblock).
    reblock = {"prefill_block_size": p_block} if p_block != block else {}
    stats = workdir / "decode-stats.jsonl"
    prefill_stats = workdir / "prefill-stats.jsonl"
    p = sidecars.sidecar("prefill")
    faults = ("--faults.fail-rate", str(options.fail_rate), "--faults.seed", str(options.seed),
              "--transfer.chunk-blocks", "1") if options.fail_rate else ()  # fmt: skip
    d = sidecars.sidecar("decode", *faults)
    prefill, decode = vllm_fleet.pd_specs(
        model,
        vllm_fleet.kvxfer_connector_config(
            "kv_producer", p.ready["engine_address"], stats_path=str(prefill_stats)
        ),
        vllm_fleet.kvxfer_connector_config(
            "kv_consumer", d.ready["engine_address"], stats_path=str(stats), **reblock
        ),
        max_model_len=1024,
        block_size=block,
    )
    prefill = replace(prefill, block_size=p_block)
    # Prefix caching off on both: the control must not hit a cache on decode, and both
    # sides must size their groups alike (with Mamba layers vLLM sizes them differently
    # when caching is on; the sidecars refuse such a pair, naming the fields).
    # With TP > 1 the engines share cores with each other and the sidecars (vllm_fleet,
    # EngineSpec.nice).
    dtype, nice = options.dtype, options.nice
    prefill = replace(prefill, enable_prefix_caching=False, tp_size=options.prefill_tp, nice=nice,
                      dtype=dtype)  # fmt: skip
    decode = replace(decode, enable_prefix_caching=False, tp_size=options.decode_tp, nice=nice,
                     dtype=dtype)  # fmt: skip
    state = family in STATE_FAMILIES
    reference = _nixl_reference(model, block, prompts, options, python, workdir) if state else []
    with vllm_fleet.PdPair(prefill, decode, python, workdir) as pair:
        # One vLLM alone: the decode engine itself, before any transfer, on plain requests
        # (its connector acts only on kv_transfer_params), at its own block size, dtype and
        # TP; prefix caching is off, so nothing of it is reused. The control's tokens come
        # from it in every case: they are compared, never matched.
        alone = pair.decode.generate([control] if state else [*prompts, control],
                                     options.max_tokens)  # fmt: skip
        reference += [o.token_ids for o in alone.outputs]
        routed = [pair.route(prompt, options.max_tokens) for prompt in prompts]
        donor, _ = pair.prefill_for_decode(prompts[1])
        fake = pair.decode.generate([control], options.max_tokens, [donor])
        published = [published_request(r.kv_transfer_params or {}) for r in routed]
        published.append(published_request(donor))
        held = still_held(prefill_stats, published, RELEASE_WAIT_S)
    n = len(prompts)
    # The pair's warm-up requests come first: a request ends only once every decode
    # rank's pulls ended, so the demo's are the last n + 1, the control's last of all.
    pulls = read_pulls(stats)[-(n + 1) :]
    if len(pulls) != n + 1:
        raise vllm_fleet.VllmWorkerError(f"pulls of {len(pulls)} requests recorded for {n} + 1")
    counted, control_pull = pulls[:n], pulls[n]
    per_request = []
    for prompt, result, want, pull in zip(prompts, routed, reference[:n], counted, strict=True):
        first = vllm_fleet.first_divergence(result.token_ids, want)
        per_request.append({
            "prompt_tokens": len(prompt), "match": first is None, "first_divergence": first,
            "num_tokens": pull["num_tokens"], "computed_tokens": pull["computed_tokens"],
            "bytes_moved": pull["bytes_moved"], "failed_blocks": pull["failed"],
            "valid_tokens": pull["valid_tokens"], "transfer_ms": pull["transfer_ms"],
            **({"repack_ms": pull["repack_ms"]} if "repack_ms" in pull else {}),
        })  # fmt: skip
    return {
        "engine": "vllm",
        "model": options.model,
        "prefill_tp": options.prefill_tp,
        "decode_tp": options.decode_tp,
        "block_sizes": {"prefill": p_block, "decode": block},
        "requests": len(prompts),
        "matched": sum(r["match"] for r in per_request),
        "reference": "vllm NixlConnector P/D" if state else "vllm single instance",
        "negative_control_diverged": fake.outputs[0].token_ids != reference[-1],
        # A control whose pull failed was recomputed from its own prompt: it proves nothing.
        "negative_control_applies": control_pull["failed"] == 0,
        "bytes_moved": sum(x["bytes_moved"] for x in counted),
        "bytes_exact_minimum": sum(x["bytes_planned"] for x in counted),
        "bytes_full_attention": sum(x["full_attention_bytes"] for x in counted),
        "failed_blocks": sum(x["failed"] for x in counted),
        "recomputed_tokens": sum(x["num_tokens"] - x["valid_tokens"] for x in counted),
        "layout": read_layout(stats),
        # Published requests the prefill never told vLLM were sent (blocks never freed).
        "prefill_blocks_held": held,
        "per_request": per_request,
    }


def _model(name: str, workdir: Path, python: Path) -> tuple[str | None, Path]:
    """(family or None, model directory): a family name writes a tiny model first."""
    if name in FAMILIES:
        out = workdir / f"tiny-{name}"
        # transformers lives in the vLLM venv; cwd "/" keeps a checkout off its sys.path.
        argv = [str(python), "-m", "kvxfer.cli.main", "tiny-model", "--family", name,
                "--out", str(out)]  # fmt: skip
        subprocess.run(argv, cwd="/", check=True, timeout=600, capture_output=True)
        return name, out
    path = Path(name)
    if not (path / "config.json").is_file():
        raise InvalidInputError(
            "--model", f"{name!r} is neither a family ({', '.join(FAMILIES)}) nor a model directory"
        )
    return None, path


def _nixl_reference(
    model: Path,
    block: int | None,
    prompts: Sequence[Sequence[int]],
    options: DemoOptions,
    python: Path,
    workdir: Path,
) -> list[list[int]]:
    """A state model's reference: the tokens each prompt decodes to through vLLM's own
    NixlConnector P/D at the same TP sizes (its decode finishes the prompt with the
    recurrent kernel, where one engine alone runs the chunked one; see the module doc)."""
    nixl = vllm_fleet.nixl_connector_config()
    prefill, decode = vllm_fleet.pd_specs(model, nixl, nixl, 1024, block)
    prefill = replace(prefill, tp_size=options.prefill_tp, nice=options.nice)
    decode = replace(decode, tp_size=options.decode_tp, nice=options.nice)
    with vllm_fleet.PdPair(prefill, decode, python, workdir) as pair:
        routed = [pair.route(p, options.max_tokens) for p in prompts]
    # A decode that recomputed the prompt would be a reference of another kind.
    if any(r.bytes_transferred <= 0 for r in routed):
        raise KvxferError("the reference's NixlConnector moved no KV into its decode")
    return [r.token_ids for r in routed]


def _pull_key(fact: dict[str, Any]) -> tuple[Any, Any]:
    return fact.get("tp_rank", 0), fact.get("pull_id", fact.get("request_id"))


def read_pulls(stats: Path, skip: int = 0) -> list[dict[str, Any]]:
    """Each request's finished pulls in a connector's stats file (extra config
    stats_path) after the first `skip` lines, in the order requests finished, with what
    their Pull calls planned: summed over the pulls of every decode rank (one per prefill
    rank it reads heads from, under different TP sizes), resuming where the worst did."""
    facts = [json.loads(line) for line in stats.read_text().splitlines()[skip:]]
    # A Pull call's answer may be written after its PullDone (the worker does not wait):
    # each PullDone takes the first plan of its pull not yet taken, wherever it is.
    planned: dict[tuple[Any, Any], collections.deque[dict[str, Any]]] = {}
    for fact in facts:
        if "bytes_planned" in fact:
            planned.setdefault(_pull_key(fact), collections.deque()).append(fact)
    merged: dict[str, dict[str, Any]] = {}
    for fact in facts:
        if "bytes_planned" in fact:
            continue
        if "repack_s" in fact and fact["request_id"] in merged:
            merged[fact["request_id"]]["repack_ms"] = round(fact["repack_s"] * 1000, 2)
        elif "bytes_moved" in fact:
            plans = planned.get(_pull_key(fact))
            plan = plans.popleft() if plans else {"bytes_planned": 0, "full_attention_bytes": 0}
            failed = sum(len(b) for b in fact["failed_blocks"].values())
            ms = round(fact["duration_s"] * 1000, 2)
            row = merged.get(fact["request_id"])
            if row is None:
                merged[fact["request_id"]] = {
                    **fact, **plan, "failed": failed, "transfer_ms": ms, "pulls": 1,
                }  # fmt: skip
                continue
            for field in ("bytes_moved", "bytes_planned", "full_attention_bytes"):
                row[field] += (fact if field == "bytes_moved" else plan)[field]
            row["failed"] += failed
            row["valid_tokens"] = min(row["valid_tokens"], fact["valid_tokens"])
            row["transfer_ms"] = max(row["transfer_ms"], ms)
            row["pulls"] += 1
    return list(merged.values())


def still_held(stats: Path, requests: Sequence[str], wait_s: float) -> list[str]:
    """The `requests` a prefill worker has not reported in `finished_sending` (its stats
    file) within `wait_s`: vLLM would keep their blocks for ever."""
    deadline = time.monotonic() + wait_s
    while True:
        sent: set[str] = set()
        if stats.exists():
            for line in stats.read_text().splitlines():
                sent.update(json.loads(line).get("finished_sending", ()))
        held = sorted(set(requests) - sent)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def read_layout(stats: Path) -> dict[str, Any] | None:
    for line in stats.read_text().splitlines():
        fact = json.loads(line)
        if "layout" in fact:
            return dict(fact["layout"])
    return None
