"""Bind a planned chunk to registered memory: N x 3 NIXL descriptor arrays.

The same descriptors as `Chunk.descriptors()` (region-major, one per run, or
per block where a region is strided), built with numpy so that a 128k-token
request costs microseconds, not a Python loop per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import numpy as np
import numpy.typing as npt

from kvxfer._exceptions import PlanError
from kvxfer.core.buffers import BoundBuffer
from kvxfer.core.identity import IdentityMemo
from kvxfer.core.layout import Region
from kvxfer.core.planner import Chunk, RegionPair, kept_pairs

DescArray = npt.NDArray[np.uint64]
G = TypeVar("G", bound=np.generic)

__all__ = ["BoundBuffer", "DescArray", "chunk_arrays"]


def chunk_arrays(
    chunk: Chunk, src: Mapping[str, BoundBuffer], dst: Mapping[str, BoundBuffer]
) -> tuple[DescArray, DescArray]:
    """(src descriptors, dst descriptors) for one chunk, region-major."""
    src_block = np.fromiter((r.src_block for r in chunk.runs), dtype=np.uint64)
    dst_block = np.fromiter((r.dst_block for r in chunk.runs), dtype=np.uint64)
    count = np.fromiter((r.count for r in chunk.runs), dtype=np.uint64)
    geometry = _geometry(chunk.regions)
    if geometry is not None:
        # The common case: every region is one contiguous array of blocks, so all
        # regions' descriptors come from one broadcast (a loop costs ~40 us a region).
        return (
            _broadcast(geometry[0], src, src_block, count),
            _broadcast(geometry[1], dst, dst_block, count),
        )
    src_parts, dst_parts = [], []
    for pair in chunk.regions:
        s, d, n = src_block, dst_block, count
        if not pair.coalescable:
            s, d, n = _per_block(src_block, dst_block, count)
        length = n * np.uint64(pair.src.block_bytes)
        src_parts.append(_side(pair.src, src, s, length))
        dst_parts.append(_side(pair.dst, dst, d, length))
    return np.concatenate(src_parts), np.concatenate(dst_parts)


@dataclass(frozen=True)
class _Side:
    """One side's regions of a chunk as arrays: which buffer each is in, where it starts
    in it, its stride, block bytes and end (what binding needs besides the buffers)."""

    regions: tuple[Region, ...]
    buffers: tuple[str, ...]  # distinct, in order of first use
    index: npt.NDArray[np.intp]  # region -> position in `buffers`
    offsets: DescArray
    strides: DescArray
    sizes: DescArray
    ends: DescArray
    kept: bool  # memoized per layout pair (`_geometry`), not made for one binding


def _side_arrays(regions: tuple[Region, ...], kept: bool) -> _Side:
    buffers = tuple(dict.fromkeys(r.buffer for r in regions))
    position = {name: i for i, name in enumerate(buffers)}

    def column(values: list[int]) -> DescArray:
        return _frozen(np.array(values, dtype=np.uint64))

    return _Side(
        regions,
        buffers,
        _frozen(np.array([position[r.buffer] for r in regions], dtype=np.intp)),
        column([r.offset_bytes for r in regions]),
        column([r.stride_bytes for r in regions]),
        column([r.block_bytes for r in regions]),
        column([r.end_bytes for r in regions]),
        kept,
    )


def _frozen(array: npt.NDArray[G]) -> npt.NDArray[G]:
    array.flags.writeable = False  # kept, and shared by every binding of its pairs
    return array


# The region pairs the planner keeps per layout pair (`planner.kept_pairs`) are the same
# tuple in every pull between two layouts: their arrays are kept by its identity. Pairs
# built for one plan are bound from arrays made for that binding alone.
_GEOMETRY: IdentityMemo[tuple[_Side, _Side]] = IdentityMemo(1024)


def _geometry(pairs: tuple[RegionPair, ...]) -> tuple[_Side, _Side] | None:
    """Both sides' arrays when every pair is coalescable, else None."""
    known = _GEOMETRY.get(pairs)
    if known is not None:
        return known
    if not all(pair.coalescable for pair in pairs):
        return None
    kept = kept_pairs(pairs)
    sides = (
        _side_arrays(tuple(p.src for p in pairs), kept),
        _side_arrays(tuple(p.dst for p in pairs), kept),
    )
    return _GEOMETRY.put(sides, pairs) if kept else sides


# Each region's base address and device, checked to fit its buffer, by the identity of
# a side and of the (frozen) buffers it was bound to: the same in every pull between two
# registrations, so a pull binds with two broadcasts instead of a dozen numpy calls.
_BASES: IdentityMemo[tuple[DescArray, DescArray]] = IdentityMemo(1024)


def _broadcast(
    side: _Side, buffers: Mapping[str, BoundBuffer], blocks: DescArray, count: DescArray
) -> DescArray:
    bound = [buffers.get(name) for name in side.buffers]
    known = _BASES.get(side, *bound) if side.kept else None
    if known is None:
        known = _bases(side, buffers, bound)
        if side.kept:
            _BASES.put(known, side, *bound)
    bases, devices = known
    out = np.empty((len(side.regions), len(blocks), 3), dtype=np.uint64)
    out[:, :, 0] = bases[:, None] + blocks[None, :] * side.strides[:, None]
    out[:, :, 1] = count[None, :] * side.sizes[:, None]
    out[:, :, 2] = devices[:, None]
    return out.reshape(-1, 3)


def _bases(
    side: _Side, buffers: Mapping[str, BoundBuffer], bound: list[BoundBuffer | None]
) -> tuple[DescArray, DescArray]:
    """(each region's first byte's address, its device) in `bound`, the buffers
    `side.buffers` name; PlanError when one is missing or a region passes its end."""
    found = [b for b in bound if b is not None]
    if len(found) < len(bound):
        _refuse(side, buffers)
    addresses = np.array([b.address for b in found], dtype=np.uint64)[side.index]
    limits = np.array([b.size_bytes for b in found], dtype=np.uint64)[side.index]
    devices = np.array([b.device_id for b in found], dtype=np.uint64)[side.index]
    if (side.ends > limits).any():
        _refuse(side, buffers)
    return _frozen(addresses + side.offsets), _frozen(devices)


def _refuse(side: _Side, buffers: Mapping[str, BoundBuffer]) -> NoReturn:
    """The PlanError of the first region whose buffer is missing or too small."""
    for region in side.regions:
        _bound(region, buffers)
    raise PlanError("buffers", "changed while a chunk was being bound")  # not reached


def _bound(region: Region, buffers: Mapping[str, BoundBuffer]) -> BoundBuffer:
    buffer = buffers.get(region.buffer)
    if buffer is None:
        raise PlanError(f"region '{region.name}'.buffer", f"buffer {region.buffer!r} is not bound")
    if region.end_bytes > buffer.size_bytes:
        raise PlanError(
            f"region '{region.name}'",
            f"ends at byte {region.end_bytes}, past buffer {region.buffer!r} "
            f"({buffer.size_bytes} bytes)",
        )
    return buffer


def _per_block(
    src_block: DescArray, dst_block: DescArray, count: DescArray
) -> tuple[DescArray, DescArray, DescArray]:
    counts = count.astype(np.int64)
    run_starts = np.repeat(np.cumsum(counts) - counts, counts)
    steps = (np.arange(int(counts.sum()), dtype=np.int64) - run_starts).astype(np.uint64)
    return (
        np.repeat(src_block, counts) + steps,
        np.repeat(dst_block, counts) + steps,
        np.ones_like(steps),
    )


def _side(
    region: Region, buffers: Mapping[str, BoundBuffer], blocks: DescArray, length: DescArray
) -> DescArray:
    buffer = _bound(region, buffers)
    out = np.empty((len(blocks), 3), dtype=np.uint64)
    out[:, 0] = np.uint64(buffer.address + region.offset_bytes) + blocks * np.uint64(
        region.stride_bytes
    )
    out[:, 1] = length
    out[:, 2] = buffer.device_id
    return out
