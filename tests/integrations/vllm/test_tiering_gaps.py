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
    got = h.load(keys)
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
