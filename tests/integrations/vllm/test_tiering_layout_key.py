"""A native tier's ``kv_cache_layout`` key against the engine's resolved KV cache layout (never wrong KV, docs/invariants.md
#1). The key says how the bytes of a primary chunk are laid out (:class:`~kvbm_backend.integrations.vllm.geometry.
PrimaryGeometry` permutes them into KVBM's FullyContiguous block with it), but the namespace does not record it: a
correctly described chunk gives the same block whatever the engine's layout, so engines of other layouts share
blocks. A key that names another layout than the one vLLM resolved for the engine (``OffloadingConfig.kv_cache_layout``,
the bytes the primary tier really holds) stored scrambled blocks under that same namespace, and the engine restarted
without the key (or any engine sharing the G3 paths or G4 store) was served them as verified hits: wrong KV. Now such
a key is refused when the tier is built, a ValueError naming ``kv_cache_layout`` and both layouts. Through vLLM's real
tiering manager (:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`) over a real G3 pool."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401

pytestmark = [pytest.mark.vllm]


def test_a_layout_key_other_than_the_engines_is_refused_and_never_scrambles_shared_blocks(tmp_path, harnesses):  # noqa: F811
    """The engine's layout is LBNHC (vLLM resolved it); a G3Tier whose key says LBHNC is refused, naming the key and
    both layouts. Before, it started and stored its chunks permuted as LBHNC; the same engine restarted without the
    key (same namespace, same G3) was served those blocks as hits, every byte of them misplaced. The key naming the
    engine's own layout, any case, is accepted (and changes nothing)."""
    path = tmp_path / "g3"
    keys = keys_for(2, "layout-key")
    try:
        wrong = harnesses([g3_tier(path, kv_cache_layout="LBHNC")], kv_cache_layout="LBNHC")
    except ValueError as e:
        wrong = None
        msg = str(e)
        assert "kv_cache_layout" in msg and "'LBHNC'" in msg and "'LBNHC'" in msg, msg
    if wrong is not None:  # the old code: it started; what it stores is served scrambled after a restart
        data = payloads(wrong, 2, seed=11)
        fp = wrong.tier.namespace.fingerprint
        wrong.store(keys, data)
        wrong.wait_idle()
        wrong.shutdown()
        fresh = harnesses([g3_tier(path)], kv_cache_layout="LBNHC")
        assert fresh.tier.namespace.fingerprint == fp
        got = fresh.load(keys)
        bad = [i for i, (a, b) in enumerate(zip(got, data)) if not np.array_equal(a, b)]
        pytest.fail(f"a tier with kv_cache_layout LBHNC on an LBNHC engine started; the engine restarted without the "
                    f"key was served {len(got)} of {len(keys)} chunks as hits, {len(bad)} of them with other bytes "
                    "than were stored (wrong KV)")
    same = harnesses([g3_tier(tmp_path / "g3-same", kv_cache_layout="lbnhc")], kv_cache_layout="LBNHC")
    assert same.tier.geometry.kv_cache_layout == "LBNHC"


def test_the_key_still_names_the_layout_where_vllm_resolved_none(tmp_path):
    """An ``OffloadingConfig`` without a resolved layout (``kv_cache_layout`` None): the key is the layout, as before."""
    cfg = offloading_config(secondary_tiers=[g3_tier(tmp_path / "g3", kv_cache_layout="LBHNC")], chunks=8,
                            kv_cache_layout=None, **GEO)
    h = TieringHarness(cfg)
    try:
        assert h.tier.geometry.kv_cache_layout == "LBHNC"
        keys, data = keys_for(2, "unresolved"), payloads(h, 2, seed=12)
        h.store(keys, data)
        h.wait_idle()
        h.reset_primary()
        got = h.load(keys)
        assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, data))
    finally:
        h.shutdown()


@pytest.mark.parametrize("tier_keys, engine, key", [
    ({"mla": True}, "LBNHC", "LBHNC"),  # MLA: one latent per token, no head axis to order
    ({"mla": True}, "BLHNC", "BLNHC"),  # (DeepSeek-V4's indexer makes vLLM resolve a block-major layout)
    ({"num_kv_heads": 1}, "LBNHC", "LBHNC"),  # one KV head per rank (8 KV heads at TP 8)
    ({"num_kv_heads": 1}, "LBNHC", "hnd"),  # vLLM's legacy name of LBHNC, any case
])
def test_a_layout_key_placing_every_byte_as_the_engines_is_taken(tmp_path, harnesses, tier_keys, engine, key):  # noqa: F811
    """Where the engine has one head (MLA's latent, or one KV head per rank) ``*HNC`` and ``*NHC`` are the same
    bytes: a key naming the other is no other layout. It is taken, and its blocks are the ones the engine restarted
    without the key reads (same namespace, same bytes). Before, such a tier was refused ("blocks permuted as
    another layout are served scrambled"), though it stored exactly what the engine's own layout stores: a working
    MLA config stopped starting."""
    path = tmp_path / "g3"
    keys = keys_for(2, f"same-bytes-{engine}-{key}")
    keyed = harnesses([g3_tier(path, kv_cache_layout=key, **tier_keys)], kv_cache_layout=engine, num_kv_heads=1)
    data = payloads(keyed, 2, seed=13)
    fp = keyed.tier.namespace.fingerprint
    keyed.store(keys, data)
    keyed.wait_idle()
    keyed.shutdown()
    fresh = harnesses([g3_tier(path, **tier_keys)], kv_cache_layout=engine, num_kv_heads=1)
    assert fresh.tier.namespace.fingerprint == fp
    got = fresh.load(keys)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, data))
