"""Hypothesis strategies: real model profiles, requests, spans and failures."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from kvxfer._exceptions import UnsupportedModelError
from kvxfer.core.layout import EngineLayout, GroupKind
from kvxfer.core.profiles import builtin_profiles, layout_for_model

BLOCK_SIZES = (1, 16, 32, 64, 128, 256)


def supported_profiles() -> list[str]:
    names = []
    for name in builtin_profiles():
        try:
            layout_for_model(name)
        except UnsupportedModelError:
            continue
        names.append(name)
    return names


PROFILES = supported_profiles()


@st.composite
def layouts(draw: st.DrawFn, *, vary_window: bool = True) -> EngineLayout:
    """A real profile at a drawn block size; its sliding windows sometimes re-drawn
    (so windows aligned and not aligned to the block size both occur)."""
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    layout = layout_for_model(draw(st.sampled_from(PROFILES)), block_size=block_size)
    if not vary_window or not draw(st.booleans()):
        return layout
    window = draw(st.integers(1, 5000))
    groups = tuple(
        dataclasses.replace(g, sliding_window=window) if g.kind is GroupKind.SLIDING_WINDOW else g
        for g in layout.groups
    )
    return dataclasses.replace(layout, groups=groups)


@st.composite
def requests(draw: st.DrawFn, block_size: int, max_tokens: int = 200_000) -> tuple[int, int]:
    """(N, C): N up to max_tokens, aligned or not; C a multiple of B below N, or N."""
    num_tokens = draw(
        st.one_of(
            st.integers(1, max_tokens),
            st.integers(1, max_tokens // block_size).map(lambda k: k * block_size),
            st.integers(1, 600),
        )
    )
    if draw(st.integers(0, 19)) == 7:
        return num_tokens, num_tokens
    if draw(st.booleans()):
        computed = draw(st.integers(0, num_tokens // block_size)) * block_size
    else:  # close to N, where sliding windows overlap the held prefix
        computed = max(0, num_tokens - draw(st.integers(1, 3000))) // block_size * block_size
    if computed == num_tokens or draw(st.integers(0, 3)) == 0:
        computed = min(computed, (num_tokens - 1) // block_size * block_size)
    return num_tokens, computed
