"""Real vLLM on CPU: tiny models of every family load and generate, and vLLM's own
NixlConnector P/D (the baseline kvxfer's connector is measured against) decodes
token-identical to one engine, through the same harness kvxfer's connector uses.

One reference run per family and one started P/D pair per model are shared by
the module's tests: each vLLM start costs 20-60 s here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_harness import (
    BLOCK_SIZE,
    CONTROL,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    engine_spec,
    vllm_python,
    write_models,
)

from kvxfer.integrations import vllm_fleet
from kvxfer.integrations.tiny_models import FAMILIES, VOCAB_SIZE

# Qwen3-Next's decode finishes the prompt with the recurrent kernel where one engine
# runs the chunked one: bf16 drift can flip a greedy token (issue 11), so its P/D run
# is checked for transfers and the negative control, and its drift is measured by
# benchmarks/bench_vllm_nixl.py, not asserted.
STATE_FAMILIES = ("qwen3-next",)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vllm_python()
    return write_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def references(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, vllm_fleet.Reply]:
    specs = {f: engine_spec(models, f, cpu=i % 2) for i, f in enumerate(FAMILIES)}
    workdir = tmp_path_factory.mktemp("reference")
    prompts = [*PROMPTS, CONTROL[0]]
    return vllm_fleet.reference_runs(specs, prompts, MAX_TOKENS, vllm_python(), workdir)


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3-next"])
def nixl_pair(
    request: pytest.FixtureRequest,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, vllm_fleet.PdPair]]:
    family: str = request.param
    config = vllm_fleet.nixl_connector_config()
    specs = vllm_fleet.pd_specs(
        models[family], config, config, MAX_MODEL_LEN, BLOCK_SIZE.get(family)
    )
    with vllm_fleet.PdPair(*specs, vllm_python(), tmp_path_factory.mktemp(f"pd-{family}")) as pair:
        yield family, pair


def test_tiny_models_of_every_family_load_and_generate(
    references: dict[str, vllm_fleet.Reply],
) -> None:
    for family in FAMILIES:
        outputs = references[family].outputs
        assert [o.prompt_tokens for o in outputs] == [len(p) for p in (*PROMPTS, CONTROL[0])]
        for out in outputs:
            assert len(out.token_ids) == MAX_TOKENS, family
            assert all(0 <= t < VOCAB_SIZE for t in out.token_ids), family
        # std-0.2 weights give varied tokens; all-equal outputs mean a degenerate model.
        every_token = {t for o in outputs for t in o.token_ids}
        assert len(every_token) > MAX_TOKENS, (family, [o.token_ids for o in outputs])


def test_nixl_pd_decode_matches_one_engine(
    nixl_pair: tuple[str, vllm_fleet.PdPair], references: dict[str, vllm_fleet.Reply]
) -> None:
    family, pair = nixl_pair
    for prompt, expected in zip(PROMPTS, references[family].outputs[: len(PROMPTS)], strict=True):
        result = pair.route(prompt, MAX_TOKENS)
        assert len(result.token_ids) == MAX_TOKENS, family
        # The KV really moved: vLLM's NixlConnector counted a transfer into decode.
        assert result.bytes_transferred > 0, (family, result.decode_metrics)
        if family not in STATE_FAMILIES:
            assert result.token_ids == expected.token_ids, (family, len(prompt))


def test_decode_given_another_requests_kv_diverges(
    nixl_pair: tuple[str, vllm_fleet.PdPair], references: dict[str, vllm_fleet.Reply]
) -> None:
    """Negative control: the harness would notice a decode that ignores the transferred KV.
    A prompt decoded from another prompt's KV (same length) must not match one engine."""
    family, pair = nixl_pair
    victim, donor = CONTROL
    donated = pair.prefill.generate([donor], 1, [{"do_remote_decode": True}])
    params = donated.outputs[0].kv_transfer_params
    swapped = pair.decode.generate([victim], MAX_TOKENS, [params]).outputs[0]
    assert swapped.finish_reason == "length", family
    assert swapped.token_ids != references[family].outputs[len(PROMPTS)].token_ids, family
