"""Engine side, VRAM: export torch CUDA tensors as CUDA IPC buffer handles.

The sidecar opens the handle with CuPy (`kvxfer.dataplane.memory`) and
registers the memory as VRAM with NIXL. torch is imported by the caller;
this module only needs a tensor-like object with `untyped_storage()`.
"""

from __future__ import annotations

from typing import Any

from kvxfer._exceptions import LayoutError
from kvxfer.core.buffers import CUDA_IPC_HANDLE_BYTES, BufferHandle, MemoryKind


def export_cuda_tensor(name: str, tensor: Any) -> BufferHandle:
    """A BufferHandle for a contiguous CUDA tensor (its storage's IPC handle + offset)."""
    if not getattr(tensor, "is_cuda", False):
        raise LayoutError(f"buffer '{name}'", "tensor is not on a CUDA device")
    if not tensor.is_contiguous():
        raise LayoutError(f"buffer '{name}'", "tensor must be contiguous")
    storage = tensor.untyped_storage()
    # torch returns (device, handle, storage size, storage offset, ref counter ...).
    device, ipc_handle, _size, storage_offset, *_ = storage._share_cuda_()
    return buffer_from_ipc(
        name=name,
        device_id=int(device),
        ipc_handle=bytes(ipc_handle),
        offset_bytes=int(storage_offset) + tensor.storage_offset() * tensor.element_size(),
        size_bytes=tensor.numel() * tensor.element_size(),
    )


def buffer_from_ipc(
    name: str, device_id: int, ipc_handle: bytes, offset_bytes: int, size_bytes: int
) -> BufferHandle:
    """Validate and pack raw IPC data (also used by engines not written in torch)."""
    if len(ipc_handle) != CUDA_IPC_HANDLE_BYTES:
        raise LayoutError(
            f"buffer '{name}'.ipc_handle",
            f"must be {CUDA_IPC_HANDLE_BYTES} bytes, got {len(ipc_handle)}",
        )
    return BufferHandle(
        name=name,
        kind=MemoryKind.VRAM,
        size_bytes=size_bytes,
        ipc_handle=ipc_handle,
        device_id=device_id,
        offset_bytes=offset_bytes,
    )
