"""Opening engine buffers in the sidecar: POSIX shared memory or CUDA IPC.

The sidecar maps what the engine allocated; it never copies KV bytes. DRAM
segments live under /dev/shm and are mapped with mmap (not
multiprocessing.shared_memory, whose resource tracker would unlink the
engine's segment when the sidecar exits). VRAM handles are opened with CuPy,
imported only when a VRAM buffer is actually opened.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer._exceptions import RegistrationError
from kvxfer.core.buffers import BoundBuffer, BufferHandle, MemoryKind

SHM_DIR = Path("/dev/shm")


@dataclass
class MappedBuffer:
    """One engine buffer as this process sees it: an address NIXL can register."""

    handle: BufferHandle
    address: int
    owner_uid: int | None = None  # a DRAM segment's required owner (open_buffer's check)
    # (st_dev, st_ino) of the shared-memory file mapped, so that only that file's name
    # is ever unlinked on the engine's behalf (`unlink_segment`).
    segment: tuple[int, int] | None = None
    _keepalive: list[Any] = field(default_factory=list, repr=False)
    _close: list[Any] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def device_id(self) -> int:
        return self.handle.device_id if self.handle.kind is MemoryKind.VRAM else 0

    def close(self) -> None:
        self._keepalive.clear()
        while self._close:
            self._close.pop()()


def bind(buffers: Sequence[MappedBuffer]) -> dict[str, BoundBuffer]:
    """Name -> where each buffer sits in this process: what descriptors are built from."""
    return {
        b.name: BoundBuffer(b.address, b.handle.size_bytes, b.device_id, b.handle.kind)
        for b in buffers
    }


def open_buffer(handle: BufferHandle, owner_uid: int | None = None) -> MappedBuffer:
    """Map one engine buffer. A DRAM segment must be a regular file directly in /dev/shm
    owned by `owner_uid` (the registering engine's user; default: this process's)."""
    if handle.kind is MemoryKind.DRAM:
        return _open_shm(handle, os.geteuid() if owner_uid is None else owner_uid)
    return _open_cuda_ipc(handle)


def _open_shm(handle: BufferHandle, owner_uid: int) -> MappedBuffer:
    where = f"buffer '{handle.name}': shared memory {handle.shm_name!r}"
    # The sidecar may run with more rights than the engine: never follow a symlink the
    # engine planted, never open a device or FIFO, never map another user's file.
    # O_NONBLOCK keeps a FIFO from blocking the open; the fstat below refuses it.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(SHM_DIR / handle.shm_name, flags)
    except OSError as exc:
        reason = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise RegistrationError(
            f"buffer '{handle.name}': cannot open shared memory {handle.shm_name!r}: {reason}"
        ) from exc
    try:
        info = os.fstat(fd)
        _check_segment(where, info, owner_uid, handle.offset_bytes + handle.size_bytes)
        mapping = mmap.mmap(fd, handle.offset_bytes + handle.size_bytes)
    finally:
        os.close(fd)
    anchor = ctypes.c_char.from_buffer(mapping, handle.offset_bytes)
    address = ctypes.addressof(anchor)
    segment = (info.st_dev, info.st_ino)
    buffer = MappedBuffer(handle, address, owner_uid, segment, _keepalive=[anchor])
    buffer._close.append(mapping.close)
    return buffer


def unlink_segment(buffer: MappedBuffer) -> bool:
    """Remove the /dev/shm name of a DRAM buffer whose engine died: a killed engine
    cannot unlink what it created, and each leaked segment holds the engine's whole KV
    allocation in memory for good (tmpfs; a crash-looping pod would fill the node).
    Only if the name still points at the file this process mapped. Mappings are not
    affected: memory a read still touches stays valid until unmapped. True if removed."""
    if buffer.segment is None:  # VRAM: the driver frees it with its last handle
        return False
    path = SHM_DIR / buffer.handle.shm_name
    try:
        info = os.stat(path, follow_symlinks=False)
        if (info.st_dev, info.st_ino) != buffer.segment:
            return False
        os.unlink(path)
    except FileNotFoundError:  # already gone (several buffers may share one segment)
        return False
    return True


def _check_segment(where: str, info: os.stat_result, owner_uid: int, end_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise RegistrationError(f"{where}: is not a regular file")
    if info.st_uid != owner_uid:
        raise RegistrationError(
            f"{where}: owned by uid {info.st_uid}, the registering engine runs as uid {owner_uid}"
        )
    if info.st_size < end_bytes:
        raise RegistrationError(
            f"{where}: holds {info.st_size} bytes, the engine declared offset_bytes + "
            f"size_bytes = {end_bytes}"
        )


def _open_cuda_ipc(handle: BufferHandle) -> MappedBuffer:
    try:
        import cupy  # noqa: PLC0415  (optional `gpu` extra)
    except ImportError as exc:
        raise RegistrationError(
            f"buffer '{handle.name}' is VRAM but CuPy is not installed (pip install 'kvxfer[gpu]')"
        ) from exc
    try:
        with cupy.cuda.Device(handle.device_id):
            base = cupy.cuda.runtime.ipcOpenMemHandle(
                handle.ipc_handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
            )
    except Exception as exc:  # CuPy raises CUDARuntimeError and friends
        raise RegistrationError(
            f"buffer '{handle.name}': cannot open CUDA IPC handle on device "
            f"{handle.device_id}: {exc}"
        ) from exc
    buffer = MappedBuffer(handle, int(base) + handle.offset_bytes)

    def close() -> None:
        with cupy.cuda.Device(handle.device_id):
            cupy.cuda.runtime.ipcCloseMemHandle(base)

    buffer._close.append(close)
    return buffer
