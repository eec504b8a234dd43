"""A chunk G3 lacks in the middle of a request's prefix does not hide the chunks G3 holds after it (review of the
native path, 2026-11-30). vLLM's TieringOffloadingManager asks its secondary tiers in order and promotes each chunk
from the first that answers HIT, so a request may take chunk 0 from G4 and chunks 1-3 from G3. G3Tier looked a
request's chunks up as one prefix and answered every chunk after the first it lacked a miss ("block hashes chain"),
true of the request, not of one tier among several: the chunks G3 held after the gap were read from G4 instead
(S3 GETs for what is on local NVMe), and with vLLM's own tiers below it (or none holding the gap's successors) they
were recomputed. vLLM's own ``fs`` tier answers each chunk. vLLM's real offloading spec and manager, a real G3
directory, a file:// G4 store."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend import metrics  # noqa: E402
from tests.integrations.vllm import test_tiering  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, g3_tier, keys_for, payloads  # noqa: E402
from tests.integrations.vllm.test_tiering_counts import _g4_tier  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test


@pytest.mark.parametrize("world_size", [1, 2])
def test_g3_serves_the_chunks_it_holds_after_a_chunk_only_g4_holds(tmp_path, harnesses, world_size):
    """G4 holds chunks 0-3, G3 (above it) 1-3: chunk 0 loads from G4, chunks 1-3 from G3 (before: all 4 from G4,
    G3 answered 1-3 missing behind its gap at 0). The bytes are the stored ones; each chunk counts once in
    kvbm_matched_tokens."""
    keys = keys_for(4, f"gap-{world_size}")
    only_g4 = harnesses([_g4_tier(tmp_path / "g4")], world_size=world_size)
    data = payloads(only_g4, 4, seed=11)
    only_g4.store(keys, data)
    only_g4.wait_idle()
    only_g4.shutdown()
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")], world_size=world_size)
    g3, g4 = h.manager.secondary_tiers
    h.store(keys[1:], data[1:])
    h.wait_idle()
    assert g3.kvbm_stats()["tier"]["chunks_stored"] == 3
    h.reset_primary()
    tokens0 = metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0
    # vLLM's manager promotes a chunk from the first tier answering HIT, and a tier answers RETRY until its lookup
    # thread has the index's answer: on a busy host G4's thread can answer first (CI 2026-12-02: [0, 4] loaded).
    # Both tiers' verdicts for this request are taken first (G3's, then G4's), as a step in which G3's thread
    # answered first would have them.
    ctx = h.context()
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, i + 1)
    for t, want in ((g3, ["MISS", "HIT", "HIT", "HIT"]), (g4, ["HIT"] * 4)):  # G3 before: all MISS
        t.on_new_request(ctx)
        verdicts = test_tiering._resolve(t, ctx, keys)
        assert [verdicts[k].name for k in keys] == want, (t.tier_type, verdicts)
    got = h.load(keys, ctx)
    assert len(got) == 4 and all(np.array_equal(a, b) for a, b in zip(got, data))
    loaded = [t.kvbm_stats()["tier"]["chunks_loaded"] for t in (g3, g4)]
    assert loaded == [3, 1], loaded  # before: [0, 4]
    moved = metrics.sample_value(None, "kvbm_matched_tokens_total") - tokens0
    assert moved == 4 * GEO["tokens_per_block"], moved


def test_a_chunk_missing_from_one_rank_is_still_a_miss_past_the_gap(tmp_path, harnesses):
    """TP=2, G3 alone holds chunks 0-3 but chunk 0's rank-0 block and chunk 2's rank-1 block are gone: chunks 1 and
    3 are hits, 0 and 2 misses (a chunk is held when every rank's block is, also past a gap)."""
    from vllm.v1.kv_offload.base import LookupResult
    h = harnesses([g3_tier(tmp_path / "g3")], world_size=2)
    keys, data = keys_for(4, "ranks"), payloads(h, 4, seed=12)
    h.store(keys, data)
    h.wait_idle()
    tier = h.tier
    tenant = tier._tenant_of(None)
    gone = [tier._block_keys(keys[0], tenant)[0], tier._block_keys(keys[2], tenant)[1]]
    tier.pool.delete(gone).result(timeout=test_tiering.HANG_S)
    ctx = h.context()
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, i + 1)
    tier.on_new_request(ctx)
    results = test_tiering._resolve(tier, ctx, keys)
    tier.on_request_finished(ctx)
    assert [results[k] for k in keys] == [LookupResult.MISS, LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]


def _g4_only(tmp_path, harnesses, keys, data, world_size=1) -> None:
    """Write ``data`` under ``keys`` to the file:// G4 store through a manager with G4 alone."""
    h = harnesses([_g4_tier(tmp_path / "g4")], world_size=world_size)
    h.store(keys, data)
    h.wait_idle()
    h.shutdown()


@pytest.mark.parametrize("world_size", [1, 2])
def test_g4_serves_the_chunks_it_holds_after_a_chunk_only_g3_holds(tmp_path, harnesses, world_size):
    """G3 (above) holds chunk 1 only, G4 chunks 0, 2, 3: all 4 load, 1 from G3 and 0, 2, 3 from G4, bytes exact.
    Before: G4 looked its chunks up as one prefix and answered 2 and 3 missing behind its gap at 1 (vLLM posts
    every chunk to every tier in the prompt's first step, when each still answers RETRY, and caches the verdicts),
    so the request stopped at chunk 2: 2 chunks loaded, [1, 1], chunks 2-3 recomputed."""
    keys = keys_for(4, f"g4gap-{world_size}")
    probe = harnesses([g3_tier(tmp_path / "g3")], world_size=world_size)
    data = payloads(probe, 4, seed=21)
    probe.store(keys[1:2], data[1:2])
    probe.wait_idle()
    probe.shutdown()
    _g4_only(tmp_path, harnesses, [keys[0]] + keys[2:], [data[0]] + data[2:], world_size)
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")], world_size=world_size)
    g3, g4 = h.manager.secondary_tiers
    got = h.load(keys)
    assert len(got) == 4 and all(np.array_equal(a, b) for a, b in zip(got, data)), len(got)  # before: 2
    loaded = [t.kvbm_stats()["tier"]["chunks_loaded"] for t in (g3, g4)]
    assert loaded == [1, 3], loaded  # before: [1, 1]


def _heads(tier) -> list:
    """The object names the tier's G4 pool HEADs from now on (its real store, spied)."""
    heads: list = []
    store = tier.pool.lookups.store
    real_head = store.head
    store.head = lambda name: heads.append(name) or real_head(name)
    return heads


def _g4_verdicts(h, keys) -> list:
    """G4's (the manager's second tier) verdicts of ``keys`` posted as one request's ascending prefix."""
    g4 = h.manager.secondary_tiers[1]
    ctx = h.context()
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, i + 1)
    h.manager.on_new_request(ctx)
    got = test_tiering._resolve(g4, ctx, keys)
    h.manager.on_request_finished(ctx)
    return [got[k] for k in keys]


def _seed(tmp_path, harnesses, keys, in_g3, in_g4, seed) -> list:
    """Payloads for ``keys``; chunks ``in_g3`` written to the G3 directory, ``in_g4`` to the G4 store."""
    probe = harnesses([g3_tier(tmp_path / "g3")], chunks=64)
    data = payloads(probe, len(keys), seed=seed)
    probe.store([keys[i] for i in in_g3], [data[i] for i in in_g3])
    probe.wait_idle()
    probe.shutdown()
    h = harnesses([_g4_tier(tmp_path / "g4")], chunks=64)
    h.store([keys[i] for i in in_g4], [data[i] for i in in_g4])
    h.wait_idle()
    h.shutdown()
    return data


def test_g4_stops_at_a_chunk_no_tier_holds(tmp_path, harnesses):
    """G3 holds chunk 1, G4 chunks 0, 2, 4, 5; chunk 3 is nowhere: G4 answers 0 and 2 hits (past its gap at 1,
    which G3 holds), 4 and 5 misses (the request ends at 3). Before: 2 a miss as well."""
    from vllm.v1.kv_offload.base import LookupResult
    keys = keys_for(6, "g4stop")
    _seed(tmp_path, harnesses, keys, [1], [0, 2, 4, 5], seed=22)
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    hit, miss = LookupResult.HIT, LookupResult.MISS
    assert _g4_verdicts(h, keys) == [hit, miss, hit, miss, miss, miss]


def test_g4_sends_no_head_for_the_chunks_g3_holds_past_its_gap(tmp_path, harnesses):
    """G3 holds chunks 0-39, G4 0-4: G4's lookup ends at its gap (G3 serves 5-39), no further HEADs; each name is
    HEADed once (a G4 looking past each gap G3 fills would send a wave of HEADs per chunk after 5)."""
    keys = keys_for(40, "g4full")
    _seed(tmp_path, harnesses, keys, list(range(40)), list(range(5)), seed=23)
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")], chunks=64)
    heads = _heads(h.manager.secondary_tiers[1])
    verdicts = _g4_verdicts(h, keys)
    assert [v.name for v in verdicts] == ["HIT"] * 5 + ["MISS"] * 35
    assert heads and len(heads) == len(set(heads)), sorted(heads)
