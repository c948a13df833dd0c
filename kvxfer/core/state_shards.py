"""How a state tensor is cut over TP ranks, in elements, as vLLM shards it
(docs/planning.md, State under different TP sizes). Pure.

vLLM's MambaStateShapeCalculator (vllm/model_executor/layers/mamba/mamba_utils.py) gives
each rank's state shapes; the layers' column-parallel conv weights say which channels a
rank holds: Gated DeltaNet's conv channels are [q | k | v], each split by TP (q and k by
key heads, v by value heads); Mamba-2's are [x | B | C], x split with the heads and B, C
by groups, a single group replicated on every rank; Mamba-1's and short convolution's
are one split run of channels. A conv state is stored (kernel - 1, channels) by default
(vLLM's "SD" layout: kernel - 1 rows of channels) or (channels, kernel - 1) ("DS": one
row, a channel's kernel - 1 values together). A recurrent (ssm) state is (heads/tp, ...),
one row of whole heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer._exceptions import ProfileError
from kvxfer.core.layout import ShardSegment, StateShard

CONV_LAYOUTS = ("SD", "DS")


@dataclass(frozen=True)
class Cut:
    """A state tensor's cut in elements: `rows` rows of (units, elements per unit)."""

    rows: int
    segments: tuple[tuple[int, int], ...]

    def shard(self, element_bytes: int) -> StateShard:
        return StateShard(
            self.rows, tuple(ShardSegment(n, e * element_bytes) for n, e in self.segments)
        )


def check_conv_layout(value: str) -> str:
    if value not in CONV_LAYOUTS:
        raise ProfileError(
            "conv_state_layout", f"must be one of {', '.join(CONV_LAYOUTS)}, got {value!r}"
        )
    return value


def conv_cut(kernel: int, segments: Sequence[tuple[int, int]], layout: str) -> Cut:
    """A conv state of `kernel - 1` values per channel over channel `segments` (units,
    channels per unit), stored as `layout` says."""
    if check_conv_layout(layout) == "SD":
        return Cut(kernel - 1, tuple(segments))
    return Cut(1, tuple((n, c * (kernel - 1)) for n, c in segments))


def head_cut(heads: int, elements_per_head: int) -> Cut:
    """A state of `heads` whole heads, split by TP (ssm / recurrent / lightning state)."""
    return Cut(1, ((heads, elements_per_head),))


def channel_units(channels: int, heads: int) -> tuple[int, int]:
    """(units, channels per unit) of a channel run split with `heads` (Mamba-2's x):
    whole heads where they divide the channels, single channels otherwise."""
    return (heads, channels // heads) if channels % heads == 0 else (channels, 1)
