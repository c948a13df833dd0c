"""Real vLLM on CPU: tiny models of every family load and generate, and vLLM's own
NixlConnector P/D (the baseline kvxfer's connector is measured against) decodes
token-identical to one engine, through the same harness kvxfer's connector uses.

One started P/D pair per model is shared by the module's tests, and its prefill
engine, before any P/D request, computes that model's single-engine reference
(a plain request: the connector only acts on kv_transfer_params): each vLLM start
costs 20-60 s here. Engines stop in the background while the next ones load.

Qwen3-Next has no pair here: the real-vLLM tier's Qwen3-Next demo
(tests/test_vllm_kvxfer.py) starts the same NixlConnector P/D as its reference, which
must have moved KV into its decode for every prompt (`vllm_demo._reference`), and loads
and generates with that model in five engines. Its decode finishes the prompt with the
recurrent kernel where one engine runs the chunked one, so bf16 drift can flip a greedy
token (issue 11): benchmarks/bench_vllm_nixl.py measures that drift.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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

PAIR_FAMILIES = ("llama", "gemma3")
# Started by tests/test_vllm_kvxfer.py's demos, as NixlConnector P/D among others.
ELSEWHERE = ("qwen3-next",)
LONE_FAMILIES = tuple(f for f in FAMILIES if f not in PAIR_FAMILIES + ELSEWHERE)
REFERENCE_PROMPTS = [*PROMPTS, CONTROL[0]]

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stopping() -> Iterator[list[threading.Thread]]:
    """Engines being stopped: vLLM's shutdown mostly waits, and the next engines can load
    meanwhile. Every one has stopped before the module ends."""
    threads: list[threading.Thread] = []
    yield threads
    for thread in threads:
        thread.join()


def stop_in_background(stopping: list[threading.Thread], close: Callable[[], object]) -> None:
    thread = threading.Thread(target=close, name="stop-vllm", daemon=True)
    thread.start()
    stopping.append(thread)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vllm_python()
    return write_models(tmp_path_factory.mktemp("models"), PAIR_FAMILIES + LONE_FAMILIES)


def run_alone(
    models: dict[str, Path], workdir: Path, stopping: list[threading.Thread]
) -> dict[str, vllm_fleet.Reply]:
    specs = {f: engine_spec(models, f, cpu=i % 2) for i, f in enumerate(LONE_FAMILIES)}
    workers = vllm_fleet.start_workers(specs, vllm_python(), workdir)
    try:
        return {f: w.generate(REFERENCE_PROMPTS, MAX_TOKENS) for f, w in workers.items()}
    finally:
        stop_in_background(stopping, lambda: vllm_fleet.close_all(workers.values()))


@pytest.fixture(scope="module")
def lone_references(
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    stopping: list[threading.Thread],
) -> Iterator[Future[dict[str, vllm_fleet.Reply]]]:
    """One engine alone for each family no P/D pair here runs, loading in the background
    beside the first pair (`nixl_pair` asks for it): one engine alone leaves a core idle."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lone")
    try:
        yield pool.submit(run_alone, models, tmp_path_factory.mktemp("reference"), stopping)
    finally:
        pool.shutdown(wait=True)


@pytest.fixture(scope="module", params=PAIR_FAMILIES)
def nixl_pair(
    request: pytest.FixtureRequest,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    stopping: list[threading.Thread],
    lone_references: Future[dict[str, vllm_fleet.Reply]],
) -> Iterator[tuple[str, vllm_fleet.PdPair, vllm_fleet.Reply]]:
    """(family, started pair, the prefill engine's own reference for REFERENCE_PROMPTS)."""
    family: str = request.param
    config = vllm_fleet.nixl_connector_config()
    specs = vllm_fleet.pd_specs(
        models[family], config, config, MAX_MODEL_LEN, BLOCK_SIZE.get(family)
    )
    pair = vllm_fleet.PdPair(*specs, vllm_python(), tmp_path_factory.mktemp(f"pd-{family}"))
    try:
        yield family, pair, pair.prefill.generate(REFERENCE_PROMPTS, MAX_TOKENS)
    finally:
        stop_in_background(stopping, pair.close)


def assert_loads_and_generates(family: str, reference: vllm_fleet.Reply) -> None:
    outputs = reference.outputs
    assert [o.prompt_tokens for o in outputs] == [len(p) for p in REFERENCE_PROMPTS]
    for out in outputs:
        assert len(out.token_ids) == MAX_TOKENS, family
        assert all(0 <= t < VOCAB_SIZE for t in out.token_ids), family
    # std-0.2 weights give varied tokens; all-equal outputs mean a degenerate model.
    every_token = {t for o in outputs for t in o.token_ids}
    assert len(every_token) > MAX_TOKENS, (family, [o.token_ids for o in outputs])


def test_tiny_models_of_every_family_load_and_generate(
    nixl_pair: tuple[str, vllm_fleet.PdPair, vllm_fleet.Reply],
) -> None:
    family, _, reference = nixl_pair
    assert_loads_and_generates(family, reference)


def test_tiny_models_of_the_families_without_a_pair_load_and_generate(
    lone_references: Future[dict[str, vllm_fleet.Reply]],
) -> None:
    references = lone_references.result()
    assert set(references) | set(PAIR_FAMILIES) | set(ELSEWHERE) == set(FAMILIES)
    for family, reference in references.items():
        assert_loads_and_generates(family, reference)


def test_nixl_pd_decode_matches_one_engine(
    nixl_pair: tuple[str, vllm_fleet.PdPair, vllm_fleet.Reply],
) -> None:
    family, pair, reference = nixl_pair
    for prompt, expected in zip(PROMPTS, reference.outputs[: len(PROMPTS)], strict=True):
        result = pair.route(prompt, MAX_TOKENS)
        assert len(result.token_ids) == MAX_TOKENS, family
        # The KV really moved: vLLM's NixlConnector counted a transfer into decode.
        assert result.bytes_transferred > 0, (family, result.decode_metrics)
        assert result.token_ids == expected.token_ids, (family, len(prompt))


def test_decode_given_another_requests_kv_diverges(
    nixl_pair: tuple[str, vllm_fleet.PdPair, vllm_fleet.Reply],
) -> None:
    """Negative control: the harness would notice a decode that ignores the transferred KV.
    A prompt decoded from another prompt's KV (same length) must not match one engine."""
    family, pair, reference = nixl_pair
    victim, donor = CONTROL
    donated = pair.prefill.generate([donor], 1, [{"do_remote_decode": True}])
    params = donated.outputs[0].kv_transfer_params
    swapped = pair.decode.generate([victim], MAX_TOKENS, [params]).outputs[0]
    assert swapped.finish_reason == "length", family
    assert swapped.token_ids != reference.outputs[len(PROMPTS)].token_ids, family
