"""Parallel layouts and KV cache dtypes on the native tiers (``G3Tier``/``G4Tier`` under vLLM's real
TieringOffloadingSpec, out of tree via ``module_path``, real G3 pools on tmp_path).

Review finding (2026-12-02, wrong KV): vLLM's OffloadingConnector accepts pipeline and decode/prefill context
parallelism (nothing in ``offloading/config.py`` or ``offloading/scheduler.py`` refuses them) and builds one tier per
engine on the scheduler side, handing it ``OffloadingParallelConfig`` (``world_size``, ``tp_size``, ``pp_size``,
``pcp_size``, ``dcp_size``). The tier named rank ``r``'s slice by ``r`` in a namespace of ``world_size`` ranks and one
rank's geometry, which says neither which layers a stage holds nor which of a block's tokens a context-parallel rank
holds: a PCP=2 engine of an MQA model (its ranks holding parts of a block's tokens) got the fingerprint of a TP=2
engine (ranks holding every token, heads replicated) and loaded its chunks as verified hits; a DCP=2 engine whose
``num_kv_heads`` said TP's heads per rank did the same to a TP=2 engine with twice the blocks per chunk. The tiers now
refuse these layouts at construction, naming the field, with the connector's own check
(:func:`kvbm_backend.integrations.vllm.namespaces.refuse_parallel_layouts`).

The KV cache dtype was already in the namespace (``OffloadingModelConfig.dtype`` -> the layout's dtype): the dtype
tests pin it."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import _looked_up, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]


def engine_config(tier: dict, *, num_kv_heads: int, tokens_per_block: int = 16, blocks_per_chunk: int = 1,
                  world_size: int = 1, tp: int | None = None, pp: int = 1, pcp: int = 1, dcp: int = 1,
                  dtype: str = "bfloat16", head_dim: int = 64):
    """vLLM's ``OffloadingConfig`` for a 4-layer one-group model as ``build_offloading_config`` makes it under the
    given parallel layout: ``tokens_per_block`` is the engine block (``resolve_dcp_kv_block_size``: ``block_size
    x dcp``), ``worker_kv_bytes_per_block`` one worker's GPU block (``block_size`` tokens of ``num_kv_heads``
    heads, the worker's), the parallel sizes vLLM's ``parallel_config`` has."""
    cfg = offloading_config(secondary_tiers=[tier], num_layers=4, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            dtype=dtype, tokens_per_block=tokens_per_block // dcp, blocks_per_chunk=blocks_per_chunk,
                            chunks=8, world_size=world_size)
    return dataclasses.replace(
        cfg, groups=(dataclasses.replace(cfg.groups[0], tokens_per_block=tokens_per_block),),
        parallel=dataclasses.replace(cfg.parallel, tp_size=world_size if tp is None else tp, pp_size=pp,
                                     pcp_size=pcp, dcp_size=dcp))


LAYOUTS = [  # (field refused, the engine's parallel sizes)
    ("pipeline_parallel_size", dict(world_size=2, tp=1, pp=2)),
    ("prefill_context_parallel_size", dict(world_size=2, tp=1, pcp=2)),
    ("decode_context_parallel_size", dict(world_size=2, tp=2, dcp=2, tokens_per_block=32)),
]


@pytest.mark.parametrize("field,sizes", LAYOUTS, ids=[f for f, _ in LAYOUTS])
@pytest.mark.parametrize("tier_type", ["G3Tier", "G4Tier"])
def test_pipeline_and_context_parallel_engines_are_refused_naming_the_field(tmp_path, field, sizes, tier_type):
    """Both tiers refuse the layout when vLLM builds them, a ValueError naming ``parallel_config.<field>`` and its
    value, before anything opens (no G3 directory, no thread left)."""
    tier = g3_tier(tmp_path / "g3")
    if tier_type == "G4Tier":
        tier = {"type": "G4Tier", "module_path": tier["module_path"], "num_kv_heads": 2, "io_threads": 2,
                "g4": {"url": f"file://{tmp_path / 'g4'}", "encrypt": False}}
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match=rf"^parallel_config\.{field} 2\b.*{tier_type}'s block identity"):
        TieringHarness(engine_config(tier, num_kv_heads=2, **sizes))
    assert not (tmp_path / "g3").exists() and not (tmp_path / "g4").exists()
    assert not {t.name for t in threading.enumerate()} - before


COLLISIONS = [  # (field, the engine that stored first, the other layout that got its fingerprint before the fix)
    # an MQA model (1 KV head): TP=2 replicates the head, every rank holds all tokens; PCP=2 spreads the tokens
    ("prefill_context_parallel_size", dict(num_kv_heads=1, world_size=2, tp=2),
     dict(num_kv_heads=1, world_size=2, tp=1, pcp=2)),
    # 4 KV heads: TP=2 holds 2 heads per rank, 2 blocks per chunk (32 tokens); TP=2 DCP=2 holds all 4 heads of half
    # the tokens of a 32-token engine block, its tier told num_kv_heads 2 (TP's heads per rank: head_dim derives 64)
    ("decode_context_parallel_size", dict(num_kv_heads=2, world_size=2, tp=2, blocks_per_chunk=2),
     dict(num_kv_heads=4, world_size=2, tp=2, dcp=2, tokens_per_block=32)),
]


@pytest.mark.parametrize("field,first,other", COLLISIONS, ids=[f for f, _, _ in COLLISIONS])
def test_a_context_parallel_engine_never_loads_another_layouts_chunks(tmp_path, field, first, other):
    """Before the fix the second engine's tier got the first's fingerprint over the shared G3 path and loaded its
    chunks byte for byte as hits: KV of other tokens (or heads) per rank. Now it is refused; the first engine
    still finds its own chunks."""
    a = TieringHarness(engine_config(g3_tier(tmp_path / "g3", num_kv_heads=first["num_kv_heads"]), **first))
    keys, data = keys_for(2, field), payloads(a, 2, seed=3)
    a.store(keys, data)
    a.wait_idle()
    a.shutdown()
    tier = g3_tier(tmp_path / "g3", num_kv_heads=2 if field == "decode_context_parallel_size" else 1)
    with pytest.raises(ValueError, match=rf"^parallel_config\.{field} 2: "):
        b = TieringHarness(engine_config(tier, **other))
        b.shutdown()  # (old code) built, and its lookups were hits on the first engine's chunks
    again = TieringHarness(engine_config(g3_tier(tmp_path / "g3", num_kv_heads=first["num_kv_heads"]), **first))
    try:
        got = again.load(keys)
        assert len(got) == 2 and all(np.array_equal(g, d) for g, d in zip(got, data))
    finally:
        again.shutdown()


def test_kv_cache_dtype_is_part_of_the_native_tier_identity(tmp_path):
    """vLLM hands the tiers ``OffloadingModelConfig.dtype`` = the ``--kv-cache-dtype`` unless ``auto`` (then the
    model's dtype): the layout's dtype, in the namespace. An FP8 (e4m3) engine's chunks are misses for a BF16
    engine whose chunks have the same bytes (2 heads x 32, bf16) and for an FP8 e5m2 engine of the same geometry;
    ``fp8_e4m3`` (the same format as ``fp8``) finds them."""
    def make(dtype: str, head_dim: int = 64) -> TieringHarness:
        return TieringHarness(engine_config(g3_tier(tmp_path / "g3"), num_kv_heads=2, dtype=dtype, head_dim=head_dim))

    fp8 = make("fp8")
    keys, data = keys_for(2, "dtype"), payloads(fp8, 2, seed=9)
    fp8.store(keys, data)
    fp8.wait_idle()
    fps = {fp8.tier.namespace.fingerprint}
    assert fp8.tier.namespace.layout.dtype == "float8_e4m3fn"
    fp8.shutdown()
    for dtype, head_dim in (("bfloat16", 32), ("fp8_e5m2", 64)):
        h = make(dtype, head_dim)
        try:
            assert h.chunk_bytes == len(data[0])  # the same bytes per chunk: only the dtype tells them apart
            assert _looked_up(h.tier, h.context(), keys[0]) is LookupResult.MISS
            assert h.tier.namespace.fingerprint not in fps
            fps.add(h.tier.namespace.fingerprint)
        finally:
            h.shutdown()
    same = make("fp8_e4m3")
    try:
        got = same.load(keys)
        assert len(got) == 2 and all(np.array_equal(g, d) for g, d in zip(got, data))
    finally:
        same.shutdown()


@pytest.mark.parametrize("dtype", ["fp8_inc", "int8_per_token_head", "fp8_per_token_head", "nvfp4"])
def test_kv_cache_dtypes_of_no_plain_element_width_are_refused_naming_the_dtype(tmp_path, dtype):
    """Scaled or packed caches (their bytes are not one element per value, or carry scales): refused by name."""
    cfg = engine_config(g3_tier(tmp_path / "g3"), num_kv_heads=2, dtype="fp8")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    with pytest.raises(ValueError, match=rf"dtype: unknown KV dtype '{dtype}'"):
        TieringHarness(cfg)
    assert not (tmp_path / "g3").exists()
