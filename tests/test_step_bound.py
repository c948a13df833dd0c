"""benchmarks/probe_step_bound.py: the bound it reads is a real bench whose params, plan
and binding were remembered in the decode sidecar (a renamed step, or a key that never
matches, breaks this test rather than silently reading an unchanged bench)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = [pytest.mark.nixl, pytest.mark.e2e]


def _probe() -> ModuleType:
    path = BENCHMARKS / "probe_step_bound.py"
    if str(BENCHMARKS) not in sys.path:  # its sibling bench_child.py, as when run
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("probe_step_bound", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["probe_step_bound"] = module
    spec.loader.exec_module(module)
    return module


def test_a_bounded_bench_skips_the_three_steps_and_an_unbounded_one_does_not() -> None:
    probe = _probe()
    rounds = 5
    bounded = probe.run_bench(["gpt-oss-20b"], rounds, bounded=True)
    (case,) = bounded["cases"]
    assert case["rounds"] == rounds and case["tokens"] == 1024
    hits, misses = bounded["steps"]["hits"], bounded["steps"]["misses"]
    # Every timed round and the warm-up repeat the first 1k pull's shape; the handshake's
    # one-block pulls and the first 1k pull are computed.
    for step in probe.STEPS:
        assert hits[step] >= rounds, (step, bounded["steps"])
        assert 1 <= misses[step] <= 4, (step, bounded["steps"])
    plain = probe.run_bench(["gpt-oss-20b"], rounds, bounded=False)
    assert plain["steps"] is None and len(plain["cases"]) == 1
