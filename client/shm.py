"""Engine side, DRAM: allocate a layout's KV regions in POSIX shared memory.

CPU engines, the simulated engine, the demo and the tests use this. Each KV
group gets one segment holding its tensors one after another (tensor-major:
all blocks of `layer.0.k`, then all blocks of `layer.0.v`, ...), so a run of
consecutive block ids is one contiguous range per tensor. Segments are
created 0600 and unlinked by `close()` (also on garbage collection).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer._exceptions import LayoutError, RegistrationError
from kvxfer.core.buffers import BufferHandle, MemoryKind
from kvxfer.core.layout import EngineLayout, GroupKind, Region, check_int

SHM_DIR = "/dev/shm"
# A segment's name: kvxfer-<role>-<creator's pid>-<random>-g<group> (EngineMemory).
_SEGMENT = re.compile(r"^kvxfer-[a-z]+-(\d+)-[0-9a-f]+-g\d+$")


def segment_creator(name: str) -> int | None:
    """The pid of the process that created the engine segment `name`, None if `name` is
    not one."""
    match = _SEGMENT.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class _Segment:
    handle: BufferHandle
    mapping: mmap.mmap


class ShmKVCache:
    """A layout's KV regions in shared memory, owned by the engine process."""

    def __init__(
        self,
        layout: EngineLayout,
        num_blocks: int,
        prefix: str = "kvxfer",
        num_state_blocks: int = 8,
        num_sliding_blocks: int | None = None,
        num_chunked_blocks: int | None = None,
    ) -> None:
        """`num_blocks` per full-attention or MLA group (one latent tensor per layer);
        `num_sliding_blocks` per sliding-window group and `num_chunked_blocks` per
        chunked-local group (default `num_blocks`; an engine that frees blocks leaving
        the window or chunk needs far fewer); `num_state_blocks` per Mamba group (one
        state block per running request, each often tens of MiB)."""
        check_int("num_blocks", num_blocks, 1, 1 << 32)
        check_int("num_state_blocks", num_state_blocks, 1, 1 << 32)
        sliding = num_blocks if num_sliding_blocks is None else num_sliding_blocks
        check_int("num_sliding_blocks", sliding, 1, 1 << 32)
        chunked = num_blocks if num_chunked_blocks is None else num_chunked_blocks
        check_int("num_chunked_blocks", chunked, 1, 1 << 32)
        counts = {
            GroupKind.FULL_ATTENTION: num_blocks,
            GroupKind.MLA: num_blocks,
            GroupKind.SLIDING_WINDOW: sliding,
            GroupKind.CHUNKED_LOCAL: chunked,
            GroupKind.MAMBA: num_state_blocks,
        }
        tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        self._segments: list[_Segment] = []
        regions: list[Region] = []
        try:
            for group in layout.groups:
                count = counts[group.kind]
                size = count * group.bytes_per_block
                name = f"{tag}-g{group.group_id}"
                self._segments.append(_create(name, size))
                offset = 0
                for tensor in group.tensors:
                    regions.append(
                        Region(
                            tensor.name,
                            name,
                            offset,
                            count,
                            tensor.bytes_per_block,
                            tensor.bytes_per_block,
                        )
                    )
                    offset += count * tensor.bytes_per_block
        except BaseException:
            self.close()
            raise
        self.layout = layout.with_regions(regions)
        self.num_blocks = num_blocks
        self._finalizer = weakref.finalize(
            self, _unlink_all, [s.handle.shm_name for s in self._segments]
        )

    @property
    def buffers(self) -> list[BufferHandle]:
        return [s.handle for s in self._segments]

    def view(self, buffer: str) -> npt.NDArray[np.uint8]:
        """The whole segment as bytes (writable); for filling and checking."""
        for segment in self._segments:
            if segment.handle.name == buffer:
                return np.frombuffer(segment.mapping, dtype=np.uint8)
        raise LayoutError("buffer", f"unknown buffer {buffer!r}")

    def block(self, tensor: str, block_id: int) -> npt.NDArray[np.uint8]:
        region = self.layout.region_map[tensor]
        start = region.block_offset(block_id)
        return self.view(region.buffer)[start : start + region.block_bytes]

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent)."""
        names = [s.handle.shm_name for s in self._segments]
        for segment in self._segments:
            # A numpy view may still exist; the unlink below frees the name regardless.
            with contextlib.suppress(BufferError):
                segment.mapping.close()
        self._segments = []
        _unlink_all(names)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()


def new_segment_fd(name: str, size: int) -> int:
    """Create /dev/shm/NAME, 0600, never through a link, of `size` bytes, and return its
    descriptor (the caller closes it, and maps through it: nothing can swap the file in
    between). On error nothing is left behind."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise RegistrationError(f"cannot create shared memory {name!r}: {exc.strerror}") from exc
    try:
        os.ftruncate(fd, size)
    except BaseException as exc:
        os.close(fd)
        os.unlink(path)
        if isinstance(exc, OSError):
            raise RegistrationError(
                f"cannot size shared memory {name!r} to {size} bytes: {exc.strerror}"
            ) from exc
        raise
    return fd


def _create(name: str, size: int) -> _Segment:
    """Create, size and map a new segment through one file descriptor."""
    fd = new_segment_fd(name, size)
    try:
        mapping = mmap.mmap(fd, size)
    except BaseException as exc:
        os.unlink(os.path.join(SHM_DIR, name))
        if isinstance(exc, OSError):
            raise RegistrationError(
                f"cannot map {size} bytes of shared memory {name!r}: {exc.strerror}"
            ) from exc
        raise
    finally:
        os.close(fd)
    handle = BufferHandle(name=name, kind=MemoryKind.DRAM, size_bytes=size, shm_name=name)
    return _Segment(handle, mapping)


def _unlink_all(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


@contextmanager
def shm_kv_cache(
    layout: EngineLayout,
    num_blocks: int,
    prefix: str = "kvxfer",
    num_state_blocks: int = 8,
    num_sliding_blocks: int | None = None,
    num_chunked_blocks: int | None = None,
) -> Iterator[ShmKVCache]:
    cache = ShmKVCache(
        layout, num_blocks, prefix, num_state_blocks, num_sliding_blocks, num_chunked_blocks
    )
    try:
        yield cache
    finally:
        cache.close()
