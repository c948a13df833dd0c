"""valid_tokens against the oracle that simulates which tokens hold valid KV."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle_valid_tokens
from strategies import layouts, requests
from test_planner_oracle import llama4_layouts, mla_layouts

from kvxfer._exceptions import PlanError
from kvxfer.core.layout import EngineLayout, GroupKind
from kvxfer.core.planner import plan_blocks
from kvxfer.core.profiles import layout_for_model, layout_from_config
from kvxfer.core.recompute import valid_tokens


@st.composite
def failures(
    draw: st.DrawFn, layout: EngineLayout, num_tokens: int, computed: int
) -> dict[int, set[int]]:
    """Failed blocks per group: a few runs of consecutive moved blocks (as chunks fail)."""
    failed: dict[int, set[int]] = {}
    for plan in plan_blocks(layout, num_tokens, computed):
        if not plan.blocks or draw(st.integers(0, 3)) == 0:
            continue
        lost: set[int] = set()
        for _ in range(draw(st.integers(1, 3))):
            start = draw(st.integers(0, len(plan.blocks) - 1))
            length = draw(st.integers(1, 40))
            lost.update(plan.blocks[start : start + length])
        failed[plan.group.group_id] = lost
    return failed


def _check_against_simulation(data: st.DataObject, layout: EngineLayout, max_tokens: int) -> None:
    num_tokens, computed = data.draw(requests(layout.block_size, max_tokens=max_tokens))
    failed = data.draw(failures(layout, num_tokens, computed))
    got = valid_tokens(layout.groups, num_tokens, computed, layout.block_size, failed)
    assert got == oracle_valid_tokens(
        layout.groups, num_tokens, computed, layout.block_size, failed
    )
    assert computed <= got <= num_tokens
    if not any(failed.values()):
        assert got == num_tokens


@settings(max_examples=200)
@given(st.data())
def test_valid_tokens_matches_simulation(data: st.DataObject) -> None:
    _check_against_simulation(data, data.draw(layouts()), 60_000)


def test_early_full_attention_failure_is_limited_by_the_window() -> None:
    """gpt-oss-20b, N = 4096: a failed full-attention block at 100 alone allows s = 1600;
    but sliding-window KV before N-W+1 was never moved, so s falls back to C."""
    layout = layout_for_model("gpt-oss-20b", block_size=16)
    full = next(g for g in layout.groups if g.kind is GroupKind.FULL_ATTENTION).group_id
    assert valid_tokens(layout.groups, 4096, 0, 16, {full: {100}}) == 0
    assert valid_tokens(layout.groups, 4096, 1024, 16, {full: {100}}) == 1024


def test_failure_inside_the_last_window_resumes_before_it() -> None:
    """llama (full attention only): a failure at block 10 resumes at token 160."""
    layout = layout_for_model("llama-3.1-8b", block_size=16)
    assert valid_tokens(layout.groups, 1000, 0, 16, {0: {10, 11}}) == 160


def test_mamba_state_failure_returns_to_the_prefix() -> None:
    layout = layout_for_model("qwen3-next-80b-a3b", block_size=16)
    mamba = next(g for g in layout.groups if g.kind is GroupKind.MAMBA).group_id
    assert valid_tokens(layout.groups, 800, 512, 16, {mamba: {0}}) == 512


def test_failed_block_outside_the_transfer_is_rejected() -> None:
    layout = layout_for_model("llama-3.1-8b", block_size=16)
    with pytest.raises(PlanError, match=r"failed_blocks\[0\]: blocks \[2\] were not part"):
        valid_tokens(layout.groups, 1000, 64, 16, {0: {2}})


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_chunked_valid_tokens_matches_simulation(data: st.DataObject) -> None:
    """Llama 4 layouts (chunked_local beside full attention), failures anywhere."""
    _check_against_simulation(data, data.draw(llama4_layouts()), 30_000)


def test_chunked_failure_resumes_inside_the_chunk() -> None:
    """All layers chunked, S = 100, B = 10, N = 290, C = 0: blocks 20..28 move (tokens
    [200, 290)). A failed block 25 leaves [200, 250) whole: the engine resumes at 250,
    whose chunk [200, 250) it holds; a failed block 20 leaves nothing of the chunk, so
    only s = 200 (a chunk start, reading nothing) works."""
    config = {
        "model_type": "llama4_text",
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 4,
        "attention_chunk_size": 100,
        "no_rope_layers": [1, 1],
    }
    layout = layout_from_config(config, name="chunked", block_size=10)
    assert [g.kind for g in layout.groups] == [GroupKind.CHUNKED_LOCAL]
    assert valid_tokens(layout.groups, 290, 0, 10, {0: {25}}) == 250
    assert valid_tokens(layout.groups, 290, 0, 10, {0: {20}}) == 200
    assert valid_tokens(layout.groups, 290, 0, 10, {0: {28}}) == 280


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mla_valid_tokens_matches_simulation(data: st.DataObject) -> None:
    """MLA groups (alone or beside a sliding or chunked group), failures anywhere."""
    _check_against_simulation(data, data.draw(mla_layouts()), 30_000)


def test_mla_failure_resumes_at_the_first_lost_latent() -> None:
    """DeepSeek-V2-Lite, N = 1000, C = 320: blocks 20..62 move; a failed block 40 leaves
    the latents of [0, 640) whole, so the engine resumes at 640."""
    layout = layout_for_model("deepseek-v2-lite", block_size=16)
    assert valid_tokens(layout.groups, 1000, 320, 16, {0: {40, 41}}) == 640
    assert valid_tokens(layout.groups, 1000, 320, 16, {0: {20}}) == 320
