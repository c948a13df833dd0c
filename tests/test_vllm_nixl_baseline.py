"""Real vLLM on CPU: tiny models of every family load and generate, and vLLM's own
NixlConnector P/D (the baseline kvxfer's connector is measured against) decodes
token-identical to one engine, through the same harness kvxfer's connector uses.

One started P/D pair per model does every request of the module's tests, and its
prefill engine, before any P/D request, computes that model's single-engine reference
(a plain request: the connector only acts on kv_transfer_params): each vLLM start
costs 20-60 s here. The pairs and the lone engines run beside the rest of the suite
(tests/vllm_background.py); the tests check what they did.

Qwen3-Next has no pair here: the real-vLLM tier's Qwen3-Next demo
(tests/test_vllm_kvxfer.py) starts the same NixlConnector P/D as its reference, which
must have moved KV into its decode for every prompt (`vllm_demo._reference`), and loads
and generates with that model in five engines. Its decode finishes the prompt with the
recurrent kernel where one engine runs the chunked one, so bf16 drift can flip a greedy
token (issue 11): benchmarks/bench_vllm_nixl.py measures that drift.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import vllm_background
from vllm_background import (
    ELSEWHERE,
    PAIR_FAMILIES,
    REFERENCE_PROMPTS,
    Baseline,
)
from vllm_harness import MAX_TOKENS, PROMPTS

from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def jobs() -> dict[str, Future[Any]]:
    """ "alone" (one engine per family without a pair) and a Baseline per pair family."""
    return vllm_background.futures("test_vllm_nixl_baseline.py")


@pytest.fixture(params=PAIR_FAMILIES)
def pair(request: pytest.FixtureRequest, jobs: dict[str, Future[Any]]) -> tuple[str, Baseline]:
    family: str = request.param
    baseline: Baseline = jobs[family].result()
    return family, baseline


def assert_loads_and_generates(family: str, reference: vllm_fleet.Reply) -> None:
    outputs = reference.outputs
    assert [o.prompt_tokens for o in outputs] == [len(p) for p in REFERENCE_PROMPTS]
    for out in outputs:
        assert len(out.token_ids) == MAX_TOKENS, family
        assert all(0 <= t < VOCAB_SIZE for t in out.token_ids), family
    # std-0.2 weights give varied tokens; all-equal outputs mean a degenerate model.
    every_token = {t for o in outputs for t in o.token_ids}
    assert len(every_token) > MAX_TOKENS, (family, [o.token_ids for o in outputs])


def test_tiny_models_of_every_family_load_and_generate(pair: tuple[str, Baseline]) -> None:
    family, baseline = pair
    assert_loads_and_generates(family, baseline.reference)


def test_tiny_models_of_the_families_without_a_pair_load_and_generate(
    jobs: dict[str, Future[Any]],
) -> None:
    references: dict[str, vllm_fleet.Reply] = jobs["alone"].result()
    assert set(references) | set(PAIR_FAMILIES) | set(ELSEWHERE) == set(FAMILIES)
    for family, reference in references.items():
        assert_loads_and_generates(family, reference)


def test_nixl_pd_decode_matches_one_engine(pair: tuple[str, Baseline]) -> None:
    family, baseline = pair
    expected = baseline.reference.outputs[: len(PROMPTS)]
    for prompt, result, want in zip(PROMPTS, baseline.routed, expected, strict=True):
        assert len(result.token_ids) == MAX_TOKENS, family
        # The KV really moved: vLLM's NixlConnector counted a transfer into decode.
        assert result.bytes_transferred > 0, (family, result.decode_metrics)
        assert result.token_ids == want.token_ids, (family, len(prompt))


def test_decode_given_another_requests_kv_diverges(pair: tuple[str, Baseline]) -> None:
    """Negative control: the harness would notice a decode that ignores the transferred KV.
    A prompt decoded from another prompt's KV (same length) must not match one engine."""
    family, baseline = pair
    assert baseline.swapped.finish_reason == "length", family
    assert baseline.swapped.token_ids != baseline.reference.outputs[len(PROMPTS)].token_ids, family
