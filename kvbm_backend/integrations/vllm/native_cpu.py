"""vLLM's native tiered offloading on CPU engines: :class:`CpuTieringOffloadingSpec`.

vLLM 0.32's ``TieringOffloadingSpec`` (CPU primary tier + ``secondary_tiers``) runs only on CUDA/XPU: its
worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) copies with CUDA streams and asserts a CUDA tensor, and
``CPUOffloadingSpec.get_worker`` refuses any other platform. This spec IS vLLM's ``TieringOffloadingSpec``
(same manager, primary tier, shared ``/dev/shm`` region, secondary tiers, metrics, config keys); only the
worker differs where the engine's KV tensors are on the CPU: :class:`CpuOffloadingWorker` copies blocks
between the engine's per-layer KV tensors and the primary tier's rows with torch indexing, synchronously
(the CPU engine's forward pass is synchronous, so a store submitted at the next step reads finished KV and
a load is complete before the request is scheduled). On an accelerator the spec hands over to vLLM's own
worker unchanged.

kv-transfer-config for a CPU engine (``vllm serve ... --kv-transfer-config '<JSON>'``; our G3/G4 tiers
below the CPU primary tier, 4 engine blocks per offloaded chunk)::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
       "spec_name": "CpuTieringOffloadingSpec",
       "spec_module_path": "kvbm_backend.integrations.vllm.native_cpu",
       "cpu_bytes_to_use": 1073741824,
       "blocks_per_chunk": 4,
       "secondary_tiers": [
         {"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering",
          "config": "/etc/kvbm-backend.yaml", "g3": {"paths": ["/nvme/kvbm"], "capacity_gb": 100}},
         {"type": "G4Tier", "module_path": "kvbm_backend.integrations.vllm.tiering",
          "config": "/etc/kvbm-backend.yaml"}]}}

On CUDA use vLLM's own spec: the same JSON with ``"spec_name": "TieringOffloadingSpec"`` and no
``spec_module_path`` (this spec also works there: it defers to vLLM's worker). Not run in this
project's CI (no GPU); see docs/operations.md.

Every key is vLLM's (``cpu_bytes_to_use`` required; ``block_size`` or ``blocks_per_chunk``;
``eviction_policy``; ``secondary_tiers``); the tiers' keys are in :mod:`.tiering`. A request's G4
tenant is ``kv_transfer_params["kvbm_tenant"]``: vLLM hands tiers the request's ``kv_transfer_params``,
not its ``cache_salt`` (the salt is inside vLLM's block hash, so salted prefixes never meet anyway).

Not supported (ValueError at worker creation, naming the setting): ``canonical_layout``.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CpuOffloadingWorker", "CpuTieringOffloadingSpec"]


class CpuOffloadingWorker(OffloadingWorker):
    """Synchronous CPU<->CPU block copies between an engine's KV tensors and the primary tier's rows.

    ``kv_caches.tensors[i].tensor``: int8-viewable, ``(num_blocks, page_size_bytes)`` per block (vLLM's
    canonical form, one engine block per row). The primary tier gets one ``(num_chunks, page_size_bytes *
    blocks_per_chunk)`` view per tensor from ``region`` (``create_next_worker_view``, the same order and
    layout as vLLM's ``CPUOffloadingWorker``, so secondary tiers see the bytes vLLM's would). Jobs finish
    inside ``submit_*``; ``get_finished`` reports them once, with bytes and seconds.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion | None) -> None:
        self._bpc = int(blocks_per_chunk)
        self._region = region
        self._refs = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []
        self._primary: list[torch.Tensor] = []  # (num_chunks, blocks_per_chunk, page) views of the region
        for kv in kv_caches.tensors:
            page = int(kv.page_size_bytes)
            if kv.tensor.device.type != "cpu":
                raise ValueError(f"CpuOffloadingWorker: KV tensor on {kv.tensor.device}, expected cpu")
            self._engine.append(kv.tensor.view(torch.int8).view((-1, page)))
            if region is None:  # vLLM's num_chunks == 0 case: nothing can be offloaded
                self._primary.append(torch.empty((0, self._bpc, page), dtype=torch.int8))
            else:
                self._primary.append(region.create_next_worker_view(page * self._bpc).unflatten(1, (self._bpc, page)))
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks ``src_spec`` -> primary chunks ``dst_spec``, now."""
        return self._copy(job_id, src_spec, dst_spec, to_primary=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Primary chunks ``src_spec`` -> engine blocks ``dst_spec``, now."""
        return self._copy(job_id, dst_spec, src_spec, to_primary=False)

    def _copy(self, job_id: int, engine_spec: GPULoadStoreSpec, primary_spec: LoadStoreSpec,
              *, to_primary: bool) -> bool:
        """vLLM's transfer enumeration (``SingleDirectionOffloadingHandler.transfer_async``): per KV group,
        ``group_sizes[g]`` engine blocks that are logically consecutive from block ``block_indices[g]`` of
        the request, against ``ceil((skip + size) / blocks_per_chunk)`` primary chunks, the first entered
        at sub-block ``skip = block_indices[g] % blocks_per_chunk``."""
        assert isinstance(primary_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        eng_ids, chunk_ids = engine_spec.block_ids, primary_spec.block_ids
        e_off = c_off = nbytes = 0
        for g, (size, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices)):
            if size == 0:
                continue
            skip = int(first) % self._bpc
            n_chunks = -(-(size + skip) // self._bpc)
            eng = torch.from_numpy(eng_ids[e_off:e_off + size].astype(np.int64))
            sub = np.arange(skip, skip + size)
            rows = torch.from_numpy(chunk_ids[c_off:c_off + n_chunks].astype(np.int64)[sub // self._bpc])
            cols = torch.from_numpy(sub % self._bpc)
            for ref in self._refs[g]:
                n = int(ref.page_size_bytes)  # un-padded bytes of this layer's page
                e, p = self._engine[ref.tensor_idx], self._primary[ref.tensor_idx]
                if to_primary:
                    p[rows, cols, :n] = e[eng, :n]
                else:
                    e[eng, :n] = p[rows, cols, :n]
                nbytes += size * n
            e_off += size
            c_off += n_chunks
        if e_off != len(eng_ids) or c_off != len(chunk_ids):
            raise ValueError(f"job {job_id}: group_sizes cover {e_off}/{len(eng_ids)} engine blocks and "
                             f"{c_off}/{len(chunk_ids)} chunks")
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside submit_*

    def shutdown(self) -> None:
        self._engine.clear()
        self._primary.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with :class:`CpuOffloadingWorker` where the engine's KV is on the
    CPU (vLLM's own worker elsewhere). Load with ``spec_name`` + ``spec_module_path`` (module docstring)."""

    @property
    def engine_device_type(self) -> str:
        """The engine's device type, as the secondary tiers need it (:func:`.geometry.spec_device_type`): vLLM's
        ``current_platform.device_type`` (what ``DeviceConfig`` takes), ``"cpu"`` on vLLM's CPU platform."""
        from vllm.platforms import current_platform
        return str(current_platform.device_type)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None and all(t.tensor.device.type == "cpu" for t in kv_caches.tensors):
            # vLLM's get_worker returns whatever _worker holds (typed as its GPU<->CPU worker): ours, for a CPU engine
            self._worker = self.create_cpu_worker(kv_caches)  # type: ignore[assignment]
        return super().get_worker(kv_caches)

    def create_cpu_worker(self, kv_caches: CanonicalKVCaches) -> CpuOffloadingWorker:
        """The primary tier's worker-side region (as ``TieringOffloadingSpec.create_worker``) and the worker."""
        if self.config.canonical_layout:
            raise ValueError("canonical_layout: not supported by CpuTieringOffloadingSpec "
                             "(remove it from kv_connector_extra_config)")
        region = None
        if self.num_chunks > 0:
            region = SharedOffloadRegion(
                engine_id=self._engine_id, num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk, cpu_page_size=self.cpu_page_size_per_worker)
        try:
            return CpuOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            if region is not None:
                region.cleanup()
            raise
