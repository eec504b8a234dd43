"""The native tiers (G3Tier/G4Tier under vLLM's OffloadingConnector) read a CPU engine's KV as vLLM's CPU
backend keeps it, and GPU engines' as before.

vLLM 0.32 allocates one tensor per layer of logical shape ``[num_blocks, heads, block_size, 2 * head_size]``.
The GPU backends pack K|V on the last dim (``flash_attn.py``: ``kv_cache.transpose(1, 2).split(head_size,
dim=-1)``), in the ``KVCacheLayout`` stride order; the CPU backend (``cpu_attn.py``, LBHNC only) views it as
``[num_blocks, heads, 2 * block_size, head_size]`` and ``chunk(2, dim=2)``: per block and head K rows then V
rows. Until 2026-11-30 the tiers read a CPU engine's page as packed K|V too, so its stored blocks held K/V
scrambled (not KVBM's ``[layer, K/V, token, heads * head_dim]``) under the same namespace as a GPU engine's.
Tensors here are built as each backend writes them (values distinct per layer, block, head, token, dim, K/V),
the chunk bytes as the primary tier holds them (``CpuOffloadingWorker`` / vLLM's worker: ``[layer, sub_block,
page]``), and the real tiers store them in real G3 pools.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402

from kvbm_backend.integrations.vllm.geometry import PrimaryGeometry, spec_device_type  # noqa: E402
from kvbm_backend.integrations.vllm.native_cpu import CpuTieringOffloadingSpec  # noqa: E402
from kvbm_backend.integrations.vllm.tiering import offload_key_hash  # noqa: E402
from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound
MOD = "kvbm_backend.integrations.vllm.tiering"
L, H, N, D, BPC = 2, 2, 16, 8, 2  # layers, KV heads, tokens per block, head_dim, blocks per chunk (float32)
#: the GPU engine's native-tier namespace fingerprint for this geometry (model "kvbm-bench", LBHNC, G3 below),
#: as the code before 2026-11-30 computed it: a GPU engine's reading did not change, nor may its fingerprint
GPU_FP = "1fccd0f5fbcf6b46"


def _value(layer: int, block: int, head: int, token: int, dim: int, kv: int) -> float:
    return float(((((layer * 8 + block) * H + head) * N + token) * D + dim) * 2 + kv)


def _kv_values(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, ``[layer, block, head, token, dim]`` float32, every element distinct."""
    lay, blk, hd, tok, dm = torch.meshgrid(*[torch.arange(s) for s in (L, num_blocks, H, N, D)], indexing="ij")
    base = ((((lay * 8 + blk) * H + hd) * N + tok) * D + dm) * 2
    return base.float(), (base + 1).float()


def cpu_engine_layers(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer KV tensors as vLLM's CPU backend allocates and writes them: ``[nb, H, N, 2D]`` (LBHNC,
    contiguous) viewed ``[nb, H, 2N, D]``, ``key_cache, value_cache = chunk(2, dim=2)`` (cpu_attn.py)."""
    out = []
    for layer in range(k.shape[0]):
        nb = k.shape[1]
        t = torch.empty((nb, H, N, 2 * D), dtype=torch.float32)
        key_cache, value_cache = t.view((nb, H, N * 2, -1)).chunk(2, dim=2)
        key_cache.copy_(k[layer])
        value_cache.copy_(v[layer])
        out.append(t)
    return out


def gpu_engine_layers(k: torch.Tensor, v: torch.Tensor, kvl: str) -> list[torch.Tensor]:
    """Per-layer physical KV tensors of a GPU engine: logical ``[nb, H, N, 2D]`` in ``kvl``'s stride order
    (LBNHC: physical ``[nb, N, H, 2D]``), K = ``[..., :D]``, V = ``[..., D:]`` (flash_attn.py)."""
    out = []
    for layer in range(k.shape[0]):
        nb = k.shape[1]
        phys = torch.empty((nb, N, H, 2 * D) if kvl == "LBNHC" else (nb, H, N, 2 * D), dtype=torch.float32)
        logical = phys.permute(0, 2, 1, 3) if kvl == "LBNHC" else phys
        logical[..., :D].copy_(k[layer])
        logical[..., D:].copy_(v[layer])
        out.append(phys)
    return out


def rank_slice(layers: list[torch.Tensor], blocks: list[int]) -> np.ndarray:
    """One rank's primary chunk bytes for engine ``blocks``: ``[layer, sub_block, page]`` (the CPU worker and
    vLLM's copy each layer tensor's block pages into the chunk in this order)."""
    return np.concatenate([t[b].contiguous().numpy().view(np.uint8).reshape(-1) for t in layers for b in blocks])


def assert_kvbm_block(block: np.ndarray, k: torch.Tensor, v: torch.Tensor, blocks: list[int]) -> None:
    """``block`` is KVBM FullyContiguous ``[layer, K/V, token, heads * head_dim]``: K at ``[l, 0, j*N + n,
    h*D:(h+1)*D]``, V at ``[l, 1, ...]``, for chunk sub-block ``j`` = engine block ``blocks[j]``."""
    blk = block.view(np.float32).reshape(L, 2, BPC * N, H, D)
    for j, b in enumerate(blocks):
        np.testing.assert_array_equal(blk[:, 0, j * N:(j + 1) * N], k[:, b].permute(0, 2, 1, 3).numpy())
        np.testing.assert_array_equal(blk[:, 1, j * N:(j + 1) * N], v[:, b].permute(0, 2, 1, 3).numpy())


def _geometry(kvl: str, packed: bool) -> PrimaryGeometry:
    return PrimaryGeometry(num_layers=L, num_kv_heads=H, head_dim=D, outer_dim=2, dtype="float32",
                           tokens_per_block=N, blocks_per_chunk=BPC, copies=1, rank_bytes=L * 2 * H * D * 4 * N * BPC,
                           kv_cache_layout=kvl, packed=packed)


# ---- the mapping ------------------------------------------------------------------------------
def test_cpu_engine_chunk_maps_k_rows_and_v_rows_to_kvbm_k_and_v():
    k, v = _kv_values(4)
    blocks = [3, 1]
    src = rank_slice(cpu_engine_layers(k, v), blocks)
    assert src.view(np.float32)[N * D] == _value(0, 3, 0, 0, 0, 1)  # after block 3 head 0's K rows: its V rows
    g = _geometry("LBHNC", packed=False)
    block = np.empty_like(src)
    g.engine_to_block(src, block)
    assert block.view(np.float32).reshape(L, 2, BPC * N, H * D)[0, 0, 1, 0] == _value(0, 3, 0, 1, 0, 0)  # K token 1
    assert_kvbm_block(block, k, v, blocks)
    back = np.empty_like(src)
    g.block_to_engine(block, back)
    np.testing.assert_array_equal(back, src)


@pytest.mark.parametrize("kvl", ["LBNHC", "LBHNC"])
def test_gpu_engine_packed_chunk_maps_as_before(kvl):
    k, v = _kv_values(4)
    blocks = [2, 0]
    src = rank_slice(gpu_engine_layers(k, v, kvl), blocks)
    g = _geometry(kvl, packed=True)
    block = np.empty_like(src)
    g.engine_to_block(src, block)
    assert_kvbm_block(block, k, v, blocks)
    back = np.empty_like(src)
    g.block_to_engine(block, back)
    np.testing.assert_array_equal(back, src)


def test_cpu_engine_refuses_a_layout_the_cpu_backend_has_not():
    with pytest.raises(ValueError, match="kv_cache_layout: 'LBNHC' on a CPU engine"):
        _geometry("LBNHC", packed=False)


def test_spec_device_type_rule():
    """vLLM's own TieringOffloadingSpec runs only on CUDA/XPU (packed); ours says its platform's device."""
    assert spec_device_type(object()) == "cuda"
    assert spec_device_type(type("S", (), {"engine_device_type": "cuda"})()) == "cuda"
    assert spec_device_type(type("S", (), {"engine_device_type": "cpu"})()) == "cpu"


# ---- through the real tiers -----------------------------------------------------------------------
def _harness(tmp_path, name: str, spec_cls=None, kv_cache_layout: str | None = "LBHNC") -> TieringHarness:
    tier = {"type": "G3Tier", "module_path": MOD, "num_kv_heads": H, "io_threads": 2,
            "g3": {"paths": [str(tmp_path / name)], "capacity_gb": 0.05, "io_threads": 2, "load_timeout_s": 120.0}}
    cfg = offloading_config(secondary_tiers=[tier], num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32",
                            tokens_per_block=N, blocks_per_chunk=BPC, chunks=8, kv_cache_layout=kv_cache_layout)
    return TieringHarness(cfg, spec_cls=spec_cls)


def _stored_block(h: TieringHarness, key: bytes) -> np.ndarray:
    tier = h.tier
    out = np.empty(tier.geometry.rank_bytes, np.uint8)
    res = tier.pool.get([tier.namespace.key(offload_key_hash(key))], [out]).result(timeout=HANG_S)
    assert res.ok == [True]
    return out


@pytest.mark.parametrize("kvl", ["LBHNC", None])
def test_cpu_engine_tier_stores_kvbm_blocks_under_a_new_fingerprint(tmp_path, kvl):
    """A CPU engine's tier (CpuTieringOffloadingSpec on vLLM's CPU platform: this machine) stores KVBM blocks
    and names them with kv_version 2; a GPU engine's tier (vLLM's TieringOffloadingSpec) keeps version 0 and
    its fingerprint from before the fix. ``kvl`` None: the engine's layout unresolved, LBHNC on a CPU engine."""
    k, v = _kv_values(4)
    key = make_offload_key(hashlib.sha256(b"cpu-kv").digest(), 0)
    cpu = _harness(tmp_path, "g3cpu", CpuTieringOffloadingSpec, kv_cache_layout=kvl)
    try:
        assert cpu.spec.engine_device_type == "cpu"
        geo = cpu.tier.geometry
        assert (geo.packed, geo.kv_cache_layout, cpu.tier.namespace.kv_version) == (False, "LBHNC", 2)
        chunk = rank_slice(cpu_engine_layers(k, v), [1, 3])
        assert chunk.nbytes == cpu.chunk_bytes
        cpu.store([key], [chunk])
        cpu.wait_idle()
        assert_kvbm_block(_stored_block(cpu, key), k, v, [1, 3])
        cpu.reset_primary()
        (got,) = cpu.load([key])
        np.testing.assert_array_equal(got, chunk)
        cpu_fp = cpu.tier.namespace.fingerprint
    finally:
        cpu.shutdown()
    gpu = _harness(tmp_path, "g3gpu")
    try:
        assert (gpu.tier.geometry.packed, gpu.tier.namespace.kv_version) == (True, 0)
        assert gpu.tier.namespace.fingerprint == GPU_FP
        chunk = rank_slice(gpu_engine_layers(k, v, "LBHNC"), [1, 3])
        gpu.store([key], [chunk])
        gpu.wait_idle()
        assert_kvbm_block(_stored_block(gpu, key), k, v, [1, 3])
    finally:
        gpu.shutdown()
    # the old CPU reading's blocks were under GPU_FP (same fields); the new reading's never meet them
    assert cpu_fp != GPU_FP


def test_a_cpu_and_a_gpu_engine_sharing_one_g3_never_serve_each_other(tmp_path):
    """One G3 path, one model: the CPU engine's chunk is no hit for the GPU engine (other fingerprint)."""
    k, v = _kv_values(4)
    key = make_offload_key(hashlib.sha256(b"shared").digest(), 0)
    cpu = _harness(tmp_path, "g3", CpuTieringOffloadingSpec)
    try:
        cpu.store([key], [rank_slice(cpu_engine_layers(k, v), [0, 2])])
        cpu.wait_idle()
    finally:
        cpu.shutdown()
    gpu = _harness(tmp_path, "g3")
    try:
        assert gpu.load([key]) == []
    finally:
        gpu.shutdown()
