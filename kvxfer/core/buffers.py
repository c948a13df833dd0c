"""How an engine shares a KV buffer with its sidecar: by handle, never by copy.

A DRAM buffer is `size_bytes` at `offset_bytes` of a POSIX shared-memory
segment named `shm_name` (the segment must hold offset + size bytes); a VRAM
buffer is a CUDA IPC memory handle (64 opaque bytes from
cudaIpcGetMemHandle) plus the offset of the tensor inside that allocation.
Regions name buffers by `name`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from kvxfer._exceptions import LayoutError
from kvxfer.core.layout import check_int

CUDA_IPC_HANDLE_BYTES = 64
# fullmatch, not `$`: a `$` pattern also accepts a trailing newline.
_SHM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class MemoryKind(enum.StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class BufferHandle:
    name: str
    kind: MemoryKind
    size_bytes: int
    shm_name: str = ""
    ipc_handle: bytes = b""
    device_id: int = 0
    offset_bytes: int = 0

    def __post_init__(self) -> None:
        where = f"buffer '{self.name}'"
        if not self.name:
            raise LayoutError("buffer.name", "must not be empty")
        check_int(f"{where}.size_bytes", self.size_bytes, 1)
        check_int(f"{where}.device_id", self.device_id, 0, 1024)
        check_int(f"{where}.offset_bytes", self.offset_bytes, 0)
        if self.kind is MemoryKind.DRAM:
            if not _SHM_NAME.fullmatch(self.shm_name) or self.shm_name in (".", ".."):
                raise LayoutError(
                    f"{where}.shm_name",
                    f"must be 1-200 characters of [A-Za-z0-9_.-], not '.' or '..', "
                    f"got {self.shm_name!r}",
                )
            if self.ipc_handle:
                raise LayoutError(f"{where}.ipc_handle", "must be empty for a DRAM buffer")
        elif self.kind is MemoryKind.VRAM:
            if len(self.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
                raise LayoutError(
                    f"{where}.ipc_handle",
                    f"must be {CUDA_IPC_HANDLE_BYTES} bytes, got {len(self.ipc_handle)}",
                )
        else:
            raise LayoutError(f"{where}.kind", f"unknown memory kind {self.kind!r}")


@dataclass(frozen=True)
class BoundBuffer:
    """Where a named buffer sits in the address space of the agent that registered it."""

    address: int
    size_bytes: int
    device_id: int
    kind: MemoryKind
