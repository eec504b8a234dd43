"""vLLM 0.32's GPU KV caches (packed K|V on the last dim) gathered into KVBM blocks and scattered back, on
real torch tensors built as vLLM allocates them (finding 2026-11-30: they were read as the CPU backend's
K-rows-then-V-rows: the view raised for the default NHD strides with more than one KV head, and HND stored
a wrong K/V interleave), and the namespace version that keeps the old GPU blocks from being read.

vLLM 0.32 (``vllm/v1/worker/gpu/attn_utils.py`` / ``gpu_model_runner.py``): each layer's cache is allocated
in the physical order of the backend's ``get_kv_cache_stride_order`` (``KVCacheLayout``: LBNHC = NHD
``[nb, N, H, 2D]``; LBHNC = HND ``[nb, H, N, 2D]``; block-major BLNHC: one buffer ``[nb, L, N, H, 2D]``
sliced per layer) and permuted to the logical ``[nb, H, N, 2D]``; FlashAttention splits it
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``: K = ``[..., :D]``, V = ``[..., D:]``."""
from __future__ import annotations

from types import SimpleNamespace as S

import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.integrations.vllm.kv_io import EngineKv  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402

NB, N, D, L = 6, 4, 8, 3


def _packed(layout: str, H: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Per-layer logical ``[NB, H, N, 2D]`` tensors in ``layout``'s physical order, K and V distinct known
    values per (layer, block, head, token, dim) by FlashAttention's convention."""
    if layout == "LBNHC":
        ts = [torch.empty(NB, N, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3) for _ in range(L)]
    elif layout == "LBHNC":
        ts = [torch.empty(NB, H, N, 2 * D, dtype=dtype) for _ in range(L)]
    else:  # BLNHC: one block-major buffer, a layer is a strided slice
        buf = torch.empty(NB, L, N, H, 2 * D, dtype=dtype)
        ts = [buf[:, li].permute(0, 2, 1, 3) for li in range(L)]
    for li, t in enumerate(ts):
        assert t.shape == (NB, H, N, 2 * D)
        t.copy_(_kv(li, H).to(dtype))
    return ts


def _kv(li: int, H: int) -> torch.Tensor:
    """Logical ``[NB, H, N, 2D]`` values: K at ``[..., :D]``, V at ``[..., D:]``, all distinct (< 2**11: exact
    in every float dtype here; fp8 tests use their own bytes)."""
    return torch.arange(NB * H * N * 2 * D, dtype=torch.float32).view(NB, H, N, 2 * D) % 2000 + li


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
@pytest.mark.parametrize("H", [1, 2, 8])
def test_gpu_packed_kv_gathers_into_kvbm_blocks_and_scatters_back(layout, H):
    ts = _packed(layout, H)
    kv = EngineKv.from_tensors(ts, NB, N, H, D, packed=True)
    assert kv.engine_layout == "packed"
    ids = [4, 1, 5]
    staging = torch.zeros(len(ids) * kv.layout.bytes_per_block, dtype=torch.uint8)
    kv.gather(ids, staging)
    blocks = kv.block_view(staging, len(ids))  # [n, L, 2(K,V), N, H, D]
    for i, b in enumerate(ids):
        for li in range(L):
            eng = ts[li][b]  # [H, N, 2D]
            assert torch.equal(blocks[i, li, 0], eng[..., :D].transpose(0, 1)), (layout, H, "K")
            assert torch.equal(blocks[i, li, 1], eng[..., D:].transpose(0, 1)), (layout, H, "V")
    fresh = _packed(layout, H)
    for t in fresh:
        t.zero_()
    kv2 = EngineKv.from_tensors(fresh, NB, N, H, D, packed=True)
    kv2.scatter(staging, ids)
    for li in range(L):
        for b in range(NB):
            assert torch.equal(fresh[li][b], ts[li][b] if b in ids else torch.zeros_like(ts[li][b]))
    one = torch.zeros_like(staging[:kv.layout.bytes_per_block // L]).view(1, -1)  # layer-wise: layer 1 of block 4
    one.copy_(staging[:kv.layout.bytes_per_block].view(L, -1)[1:2])
    for t in fresh:
        t.zero_()
    kv2.scatter_layer(1, one, [2])
    assert torch.equal(fresh[1][2], ts[1][4]) and not fresh[0].any() and not fresh[2].any()


def test_fp8_packed_kv_moves_its_bytes():
    H = 2
    raw = torch.arange(NB * N * H * 2 * D, dtype=torch.int64).remainder(251).to(torch.uint8)
    ts = [raw.view(NB, N, H, 2 * D).clone().add_(li).view(torch.float8_e4m3fn).permute(0, 2, 1, 3) for li in range(L)]
    kv = EngineKv.from_tensors(ts, NB, N, H, D, packed=True)
    staging = torch.zeros(2 * kv.layout.bytes_per_block, dtype=torch.uint8)
    kv.gather([3, 0], staging)
    blocks = staging.view(2, L, 2, N, H, D)
    for li in range(L):
        eng = ts[li].view(torch.uint8)
        assert torch.equal(blocks[0, li, 0], eng[3][..., :D].transpose(0, 1))
        assert torch.equal(blocks[1, li, 1], eng[0][..., D:].transpose(0, 1))


def test_cpu_backend_tensors_keep_their_reading():
    """vLLM's CPU backend: the same logical shape, K rows then V rows per head (unchanged reading)."""
    H = 2
    kvh = torch.arange(NB * H * 2 * N * D, dtype=torch.float32).view(NB, H, 2, N, D)  # [nb, H, K|V, N, D]
    ts = [kvh.clone().add_(li).view(NB, H, N, 2 * D) for li in range(L)]
    kv = EngineKv.from_tensors(ts, NB, N, H, D)  # CPU tensors: the CPU backend's convention
    assert kv.engine_layout == "cpu"
    staging = torch.zeros(kv.layout.bytes_per_block, dtype=torch.uint8)
    kv.gather([5], staging)
    blocks = kv.block_view(staging, 1)
    assert torch.equal(blocks[0, 1, 0], (kvh[5, :, 0] + 1).transpose(0, 1))
    assert torch.equal(blocks[0, 1, 1], (kvh[5, :, 1] + 1).transpose(0, 1))


def _ns_for(device_type):
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations.vllm.namespaces import namespace_from_vllm
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    kcc = S(kv_cache_groups=[KVCacheGroupSpec(layer_names=[f"l{i}" for i in range(4)], kv_cache_spec=spec)])
    mc = S(model="m", served_model_name="m", revision=None, quantization=None, hf_overrides={})
    vc = S(model_config=mc, parallel_config=S(tensor_parallel_size=1, pipeline_parallel_size=1),
           cache_config=S(cache_dtype="auto"), device_config=S(device_type=device_type))
    return namespace_from_vllm(KvbmBackendConfig(), vc, kcc)


def test_gpu_engines_namespace_differs_from_the_old_one_and_cpu_engines_is_unchanged():
    from kvbm_backend.integrations.vllm.namespaces import check_kv_version
    from kvbm_backend.model.canonical import HeadMap
    cpu, gpu = _ns_for("cpu"), _ns_for("cuda")
    old = Namespace(model="m", layout=cpu.layout)  # what the code before 2026-11-30 built for both
    assert cpu.fingerprint == old.fingerprint and cpu.canonical_json() == old.canonical_json()
    assert gpu.kv_version == 2 and gpu.fingerprint != old.fingerprint
    assert Namespace.from_dict(gpu.to_dict()) == gpu
    assert HeadMap(gpu, 8).canonical.fingerprint != HeadMap(old, 8).canonical.fingerprint
    assert HeadMap(cpu, 8).canonical.fingerprint == HeadMap(old, 8).canonical.fingerprint
    check_kv_version(gpu, "packed")
    check_kv_version(cpu, "cpu")
    with pytest.raises(ValueError, match="kv_version"):
        check_kv_version(cpu, "packed")
    with pytest.raises(ValueError, match="kv_version"):
        check_kv_version(gpu, "cpu")


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_out_of_range_block_id_raises_before_any_engine_byte_moves(layout):
    """A ``"packed"`` engine moves with the torch ops where the Triton kernel is not usable (here: a CPU
    device; on a GPU: a failed kernel check), which bounds-check per element: on the CPU ``index_copy_`` raised only after writing layer 0 of the good ids,
    and on CUDA an out-of-range id is a device-side assert, not the IndexError gather/scatter document. The
    ids are now checked on the host first: IndexError, and no engine (or staging) byte written."""
    H = 2
    ts = [t.zero_() for t in _packed(layout, H)]
    kv = EngineKv.from_tensors(ts, NB, N, H, D, packed=True)
    bpb = kv.layout.bytes_per_block
    ones = torch.ones(2 * bpb, dtype=torch.uint8)
    with pytest.raises(IndexError, match=str(NB)):
        kv.scatter(ones, [1, NB])
    with pytest.raises(IndexError):
        kv.scatter(ones, [-1, 2])
    with pytest.raises(IndexError, match=str(NB)):
        kv.scatter_layer(0, ones[:2 * (bpb // L)].view(2, -1), [3, NB + 1])
    assert not any(t.any() for t in ts)
    staging = torch.zeros_like(ones)
    with pytest.raises(IndexError, match=str(NB)):
        kv.gather([2, NB], staging)
    assert not staging.any()
