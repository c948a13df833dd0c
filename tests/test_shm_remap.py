"""Remapping private engine memory onto POSIX shm in place (the vLLM CPU KV cache path)."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from kvxfer._exceptions import RegistrationError
from kvxfer.integrations.shm_remap import PAGE, SHM_DIR, SharedRemap


def _open(name: str, size: int) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def test_tensor_keeps_pointer_and_content_and_shares_writes() -> None:
    # An allocation that neither starts nor ends on a page boundary, as vLLM's does.
    backing = torch.randn(3 * PAGE + 777, dtype=torch.float32)
    tensor = backing[5:-3].view(torch.uint8)
    before = tensor.clone()
    whole = backing.clone()
    pointer = tensor.data_ptr()
    remap = SharedRemap(pointer, tensor.numel())
    try:
        assert tensor.data_ptr() == pointer
        assert torch.equal(tensor, before)
        assert torch.equal(backing, whole)  # the partial first and last pages survive
        offset = remap.range.offset_of(pointer)
        other = _open(remap.range.name, remap.range.size)
        seen = np.frombuffer(other, dtype=np.uint8)
        assert bytes(seen[offset : offset + 64]) == bytes(before[:64].numpy())
        tensor[:16] = 7  # the engine writes ...
        assert list(seen[offset : offset + 16]) == [7] * 16  # ... the sidecar's mapping sees it
        seen[offset + 100] = 42  # and the other way round
        assert int(tensor[100]) == 42
        os.stat(os.path.join(SHM_DIR, remap.range.name))
        assert os.stat(os.path.join(SHM_DIR, remap.range.name)).st_mode & 0o777 == 0o600
        del seen
        other.close()
    finally:
        remap.close()
    assert not os.path.exists(os.path.join(SHM_DIR, remap.range.name))
    assert torch.equal(tensor[16:64], before[16:64])  # unlinking keeps the engine's memory


def test_addresses_outside_the_segment_are_refused() -> None:
    data = torch.zeros(PAGE * 2, dtype=torch.uint8)
    remap = SharedRemap(data.data_ptr(), data.numel())
    try:
        with pytest.raises(RegistrationError, match="outside segment"):
            remap.range.offset_of(remap.range.base + remap.range.size)
    finally:
        remap.close()
    with pytest.raises(RegistrationError, match="cannot remap"):
        SharedRemap(0, 10)
