"""vLLM's native offloading path, whole, on the real vLLM CPU engine: vLLM's ``OffloadingConnector`` +
our ``CpuTieringOffloadingSpec`` (vLLM's ``TieringOffloadingSpec`` with a CPU<->CPU worker,
:mod:`kvbm_backend.integrations.vllm.native_cpu`) + our G3/G4 tiers as vLLM ``secondary_tiers``. Each
engine in its own process, tiny Llama in float32 (see test_connector_e2e), real files, real SeaweedFS.

Offloaded chunks are 4 engine blocks (128 tokens over 32-token blocks) throughout, so every store and
load below goes through the chunked path, including loads that enter a chunk mid-way (a prefix whose
first 10 blocks are in the engine's own prefix cache).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.vllm_runner import native_extra, prompts, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY, write_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(600)]

_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

NUM_BLOCKS = 48  # engine KV budget (blocks of 32 tokens)
DTYPE = "float32"  # see test_connector_e2e: prefix-cached and full prefill agree bit for bit in float32
CHUNK_TOKENS = 4 * 32  # blocks_per_chunk 4
FULL_CHUNKS = 700 // CHUNK_TOKENS  # 5 full chunks per 700-token prompt (the 6th is partial: not offloaded)


def _run(*args, **kw) -> dict:
    kw.setdefault("dtype", DTYPE)
    kw.setdefault("num_gpu_blocks", NUM_BLOCKS)
    return run_engine(*args, **kw)


def _tier(res: dict, kind: str) -> dict:
    (t,) = [t for t in res["tier_stats"] if t["type"] == kind]
    return t


def _bytes_on_disk(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model"), TINY)


def test_native_tiers_identical_outputs_restart_from_g3_g4_and_tenants(tmp_path, model_dir, seaweed, s3_prefix):
    """One family of four runs over the same prompts (two families of two 700-token prompts sharing 320
    tokens, plus X), every request as tenant ``a`` (``kv_transfer_params.kvbm_tenant``):

    * ``base``: no offloading. ``writer``: native tiers (G3 + G4 on SeaweedFS); then the engine's own
      prefix cache is emptied and the four prompts run again, so they are loaded from the CPU primary
      tier by our worker (the second of each family enters chunk 2 at block 10: 10 blocks come from the
      engine's prefix cache). Outputs identical to ``base`` both times.
    * ``restart``: a fresh engine on the writer's G3 directory (warm index: blocks restored from the
      journal), same G4: the prefixes come from G3, not G4; outputs identical.
    * ``g4only``: a fresh engine with an empty G3: X as tenant ``b`` first (same tokens, same (no) cache
      salt, so vLLM's block hashes match: only G4's per-tenant keys keep it apart) is a miss; then the
      four prompts as tenant ``a`` load from G4; outputs identical.
    """
    fams = prompts(2, 700, shared_prefix=320, seed=21) + prompts(2, 700, shared_prefix=320, seed=22)
    x = prompts(1, 700, seed=23)
    ps = fams + x
    g4 = seaweed.url(s3_prefix)
    a = {"kvbm_tenant": "a"}

    base = _run(tmp_path, "base", model_dir, ps, None)
    expect = base["outputs"]

    w = _run(tmp_path, "writer", model_dir, ps + fams, None, kv_transfer_params=[a] * 9,
             reset_prefix_cache_before=[5], native=native_extra(tmp_path / "w", g4, endpoint_url=seaweed.endpoint))
    assert w["outputs"] == expect + expect[:4]
    # second round: everything but the partial last chunk came back through our worker's loads
    assert all(c >= FULL_CHUNKS * CHUNK_TOKENS for c in w["cached_tokens"][5:]), w["cached_tokens"]
    g3w, g4w = _tier(w, "G3Tier"), _tier(w, "G4Tier")
    stored = 2 * (2 * FULL_CHUNKS - 2) + FULL_CHUNKS  # each family shares 2 full chunks (256 of 320 tokens)
    assert g3w["tier"]["chunks_stored"] == stored, g3w
    assert g4w["tier"]["chunks_stored"] == stored, g4w
    assert g3w["tier"]["stores_failed"] == g4w["tier"]["stores_failed"] == 0

    r = _run(tmp_path, "restart", model_dir, fams, None, kv_transfer_params=[a] * 4,
             native=native_extra(tmp_path / "w", g4, endpoint_url=seaweed.endpoint))
    assert r["outputs"] == expect[:4]
    g3r, g4r = _tier(r, "G3Tier"), _tier(r, "G4Tier")
    assert g3r["pool"]["restored_blocks"] == stored, g3r["pool"]  # warm index from the writer's journal
    assert g3r["tier"]["chunks_loaded"] == 2 * (2 * FULL_CHUNKS - 2), g3r["tier"]
    assert g3r["tier"]["chunks_load_failed"] == 0 and g4r["tier"]["loads"] == 0, (g3r["tier"], g4r["tier"])
    assert all(c >= FULL_CHUNKS * CHUNK_TOKENS for c in r["cached_tokens"]), r["cached_tokens"]

    o = _run(tmp_path, "g4only", model_dir, x + fams, None, kv_transfer_params=[{"kvbm_tenant": "b"}] + [a] * 4,
             native=native_extra(tmp_path / "fresh", g4, endpoint_url=seaweed.endpoint))
    assert o["outputs"] == expect[4:] + expect[:4]
    assert o["cached_tokens"][0] == 0, o["cached_tokens"]  # tenant b: tenant a's G4 blocks are not served
    g3o, g4o = _tier(o, "G3Tier"), _tier(o, "G4Tier")
    assert g4o["tier"]["chunks_loaded"] == 2 * (2 * FULL_CHUNKS - 2), g4o["tier"]
    assert g4o["tier"]["chunks_load_failed"] == 0 and g3o["tier"]["loads"] == 0, (g3o["tier"], g4o["tier"])
    assert all(c >= FULL_CHUNKS * CHUNK_TOKENS for c in o["cached_tokens"][1:]), o["cached_tokens"]


def test_g3_stays_within_its_bound_vllm_fs_tier_does_not(tmp_path, model_dir):
    """One engine, both tiers below the same CPU primary tier: our G3 with ``capacity_gb`` 0.006 and
    vLLM's own ``fs`` tier, under a working set of 12 distinct 700-token prompts (60 chunks of 512 KiB,
    31.5 MB: over 5x G3's bound). G3 evicts and keeps its files within the bound; vLLM's fs tier keeps
    every chunk: it has no capacity bound. Measured (2-core VM): G3 left 5,286,970 B on disk (bound
    6,000,000 B; 50 evictions), vLLM's fs tier 31,457,770 B. Outputs stay identical to a second pass
    served from the tiers."""
    ps = prompts(12, 700, seed=31)
    cap = 0.006
    extra = native_extra(tmp_path / "w", g3_capacity_gb=cap,
                         extra_tiers=({"type": "fs", "root_dir": str(tmp_path / "vllm-fs")},))
    res = _run(tmp_path, "bound", model_dir, ps + ps[-2:], None, native=extra, reset_prefix_cache_before=[12])
    assert res["outputs"][12:] == res["outputs"][10:12]
    g3 = _tier(res, "G3Tier")
    assert g3["tier"]["chunks_stored"] == 12 * FULL_CHUNKS, (g3["tier"], g3["pool"]["dropped_by_reason"])
    g3_bytes, fs_bytes = _bytes_on_disk(tmp_path / "w" / "g3"), _bytes_on_disk(tmp_path / "vllm-fs")
    working_set = 12 * FULL_CHUNKS * g3["pool"]["block_bytes"]
    bound = cap * 1e9
    assert working_set >= 3 * bound
    assert g3["pool"]["evictions"] > 0, g3["pool"]
    assert g3_bytes <= bound, f"G3 left {g3_bytes} B on disk, bound {bound:.0f} B (working set {working_set} B)"
    assert fs_bytes >= working_set > 3 * g3_bytes, (
        f"vLLM fs tier left {fs_bytes} B on disk, G3 {g3_bytes} B, working set {working_set} B")
