"""The CPU<->CPU worker of :mod:`kvbm_backend.integrations.vllm.native_cpu`, built by vLLM's own
``OffloadingSpecFactory`` from ``spec_name`` + ``spec_module_path`` (as the OffloadingConnector does),
on CPU KV tensors: bytes land where vLLM's CUDA worker puts them (so secondary tiers see vLLM's layout)
and come back exactly, also when a transfer enters a chunk mid-way. The engine end to end is
tests/e2e/test_native_tiers.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvbm_backend.integrations.vllm.tiering_harness import offloading_config  # noqa: E402

pytestmark = [pytest.mark.vllm]

GEO = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", tokens_per_block=16)
PAGE = 2 * 16 * 2 * 8 * 4  # heads * tokens * (K|V head_dim) * 4 B: one layer's page of one engine block
BPC = 4
ENGINE_BLOCKS = 12


def _spec(spec_name: str, module: str | None):
    extra = {"spec_name": spec_name}
    if module:
        extra["spec_module_path"] = module
    cfg = offloading_config(secondary_tiers=[], blocks_per_chunk=BPC, chunks=8, extra=extra, **GEO)
    return OffloadingSpecFactory.create_spec(cfg)


def _kv_caches(seed: int):
    rng = np.random.default_rng(seed)
    tensors = [torch.from_numpy(rng.integers(-128, 128, (ENGINE_BLOCKS, PAGE), dtype=np.int8)) for _ in range(2)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                           [[CanonicalKVCacheRef(i, PAGE) for i in range(2)]])
    return tensors, kv


def test_vllm_own_tiering_spec_refuses_cpu_kv():
    """Why the project ships a spec: vLLM 0.32's TieringOffloadingSpec has no worker for CPU KV."""
    spec = _spec("TieringOffloadingSpec", None)
    try:
        spec.get_manager()
        with pytest.raises(Exception, match="only supported on CUDA"):
            spec.get_worker(_kv_caches(0)[1])
    finally:
        spec.get_manager().shutdown()


def test_cpu_worker_stores_in_vllm_layout_and_loads_back_chunked():
    spec = _spec("CpuTieringOffloadingSpec", "kvbm_backend.integrations.vllm.native_cpu")
    manager = spec.get_manager()
    tensors, kv = _kv_caches(1)
    worker = spec.get_worker(kv)
    try:
        view = manager.primary_tier.get_kv_memoryview()
        primary = np.asarray(view).view(np.int8).reshape(view.shape[0], -1)
        # store engine blocks 3..8 (request blocks 2..7: skip 2 sub-blocks into chunk 5, then chunk 1)
        src = [3, 4, 5, 6, 7, 8]
        assert worker.submit_store(7, GPULoadStoreSpec(src, [6], [2]), CPULoadStoreSpec([5, 1]))
        (res,) = worker.get_finished()
        assert (res.job_id, res.success, res.transfer_size) == (7, True, 6 * 2 * PAGE)
        assert worker.get_finished() == []
        slots = [(5, 2), (5, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
        for b, (c, j) in zip(src, slots):
            for t in range(2):  # row: [tensor0: BPC pages | tensor1: BPC pages | pad]
                off = t * BPC * PAGE + j * PAGE
                assert np.array_equal(primary[c, off:off + PAGE], tensors[t][b].numpy()), (b, c, j, t)
        before = [t.clone() for t in tensors]
        for t in tensors:
            t.zero_()
        # load the same request blocks 2..7 into other engine blocks
        dst = [11, 0, 9, 2, 10, 1]
        assert worker.submit_load(8, CPULoadStoreSpec([5, 1]), GPULoadStoreSpec(dst, [6], [2]))
        worker.wait({8})
        assert [r.job_id for r in worker.get_finished()] == [8]
        for b_src, b_dst in zip(src, dst):
            for t in range(2):
                assert torch.equal(tensors[t][b_dst], before[t][b_src])
        untouched = sorted(set(range(ENGINE_BLOCKS)) - set(dst))
        assert all(not tensors[t][untouched].any() for t in range(2))
        with pytest.raises(ValueError, match="group_sizes cover"):
            worker.submit_load(9, CPULoadStoreSpec([5, 1, 2]), GPULoadStoreSpec(dst, [6], [2]))
    finally:
        worker.shutdown()
        manager.shutdown()
