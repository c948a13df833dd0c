"""Share memory an engine already allocated privately, in place, through POSIX shm.

vLLM on CPU allocates its KV cache with `torch.zeros` in private anonymous
memory, which no sidecar can open. `remap_to_shm` moves that memory onto a
shared-memory segment without moving it in the address space: it copies the
page-aligned range covering the allocation into a new /dev/shm segment, then
maps the segment over the same range with MAP_SHARED | MAP_FIXED. Every
tensor keeps its data pointer and its contents; from then on the engine's
writes land in the segment, which the sidecar opens by name (no per-request
copy, no staging buffer).

The first and last pages may hold bytes that are not the allocation's
(allocator headers, neighbouring objects); they are copied with the rest, so
the process sees the same bytes before and after. Nothing may write the range
while it is copied: call this before the engine runs (vLLM calls
`register_kv_caches` right after allocating, before the first step).

When the allocation is freed, the allocator unmaps the range (a large
allocation is its own mapping); the segment's name stays until `close()`
unlinks it (also at garbage collection and at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import secrets
import time
import weakref
from dataclasses import dataclass

from kvxfer._exceptions import RegistrationError
from kvxfer.client.shm import new_segment_fd
from kvxfer.core.buffers import BufferHandle, MemoryKind

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True)
class RemappedRange:
    """A shared-memory segment now backing [base, base + size) of this process."""

    name: str
    base: int  # page-aligned address where the segment is mapped
    size: int  # bytes, a multiple of the page size
    seconds: float  # what the remap cost (copy + map)

    def offset_of(self, address: int) -> int:
        """Offset inside the segment of an address inside the remapped range."""
        if not self.base <= address < self.base + self.size:
            raise RegistrationError(f"address {address:#x} is outside segment {self.name}")
        return address - self.base

    def handle(self) -> BufferHandle:
        return BufferHandle(
            name=self.name, kind=MemoryKind.DRAM, size_bytes=self.size, shm_name=self.name
        )


class SharedRemap:
    """Owns one remapped range; `close()` unlinks its name (the mapping stays the
    engine's until it frees the memory)."""

    def __init__(self, address: int, nbytes: int, prefix: str = "kvxfer-vllm") -> None:
        if address <= 0 or nbytes <= 0:
            raise RegistrationError(f"cannot remap {nbytes} bytes at {address:#x}")
        self.range = _remap(address, nbytes, f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}")
        self._finalizer = weakref.finalize(self, _unlink, self.range.name)
        atexit.register(self._finalizer)

    def close(self) -> None:
        self._finalizer()


def _remap(address: int, nbytes: int, name: str) -> RemappedRange:
    started = time.perf_counter()
    base = address - address % PAGE
    end = -(-(address + nbytes) // PAGE) * PAGE
    size = end - base
    fd = new_segment_fd(name, size)
    try:
        _copy_into(fd, base, size)
        flags = mmap.MAP_SHARED | 0x10  # MAP_FIXED: replace the private pages in place
        got = _libc.mmap(base, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if got in (None, _MAP_FAILED) or got != base:
            err = ctypes.get_errno()
            raise RegistrationError(f"mmap over {base:#x} failed: {os.strerror(err)}")
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)
    return RemappedRange(name, base, size, time.perf_counter() - started)


def _copy_into(fd: int, base: int, size: int) -> None:
    """Copy [base, base + size) of this process into the segment, through a
    temporary mapping of the segment."""
    staging = mmap.mmap(fd, size)
    try:
        target = ctypes.addressof(ctypes.c_char.from_buffer(staging))
        ctypes.memmove(target, base, size)
        del target
    finally:
        with contextlib.suppress(BufferError):
            staging.close()


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
