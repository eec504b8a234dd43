"""Review finding (2026-12-03), fixed in ``integrations/vllm/tier_lookup.py`` / ``tier_pickups.py`` (removed: since
2026-12-03 counted by ``tier_ledger.py``): with G3Tier above G4Tier in one vLLM manager, a request taking up G4's
cached HIT verdict (another live request's) was credited to G4 (``kvbm_matched_tokens``, G4's ``lookup_hits`` and
hit rate) when G4 answered it, though vLLM loaded the chunk from G3: vLLM's manager asks G4 because G3 answered
RETRY (it re-asks a cached miss once G3 stored the chunk), and G4's HIT starts no promotion when the primary tier
has no free chunk (the manager answers MISS); the request asks again once G3's answer is in and G3 serves the chunk.
G3's share was never counted (its lookup was uncounted: the lowest of our tiers counts for all, but G4 had not
posted the chunk for the request). Now a verdict a request takes up is credited to the tier that loads the chunk,
when its load ends: each loaded chunk once, on that tier.
vLLM's real offloading spec and manager, a real G3 directory, a file:// G4 store."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend import metrics  # noqa: E402
from tests.helpers.tier_counts import counted, step_until  # noqa: E402
from tests.integrations.vllm import test_tiering  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, g3_tier, keys_for, payloads  # noqa: E402
from tests.integrations.vllm.test_tiering_counts import _g4_tier  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test


def _hits(tier) -> int:
    return tier.pool.stats().get("lookup_hits", 0)


def _held_in_g4_only(harnesses, tmp_path, keys, seed: int) -> list:
    """Store ``keys`` (payloads of ``seed``) through a manager with G4 alone, on ``tmp_path / "g4"``, then shut it
    down: the chunks' bytes."""
    only_g4 = harnesses([_g4_tier(tmp_path / "g4")])
    data = payloads(only_g4, len(keys), seed=seed)
    only_g4.store(keys, data)
    only_g4.wait_idle(timeout=HANG_S)
    only_g4.shutdown()
    return data


def _local_and_any(h, keys, rid: str):
    """Requests ``a`` (id ``rid``; its load tier filter: local storage only, so G4 is not asked for it) and ``b``
    (any tier), each with ``keys`` at positions 1.., both started: ``(a, b)``."""
    from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, TierFilter, TierMatcher

    a = ReqContext(req_id=rid, load_tier_filter=TierFilter((TierMatcher(Medium.STORAGE, Locality.LOCAL),)))
    b = h.context()
    for ctx in (a, b):
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, i + 1)
        h.manager.on_new_request(ctx)
    return a, b


def _resolved(h, keys, ctx) -> bool:
    """Every key a HIT for ``ctx`` (in the primary tier)."""
    return [h.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * len(keys)


def _load(h, keys, ctx, *finished) -> list:
    """Load ``keys`` for ``ctx`` from the primary tier (the chunks' bytes, copied), then end the requests
    ``finished`` and step once."""
    spec = h.manager.prepare_load(keys, ctx)
    got = [h.primary[int(c), :h.chunk_bytes].copy() for c in spec.chunk_ids]
    h.manager.complete_load(keys, ctx)
    for done in finished:
        h.manager.on_request_finished(done)
    h.step()
    return got


def test_a_chunk_g4_answered_but_g3_loaded_is_credited_to_g3(tmp_path, harnesses):
    """G4 holds chunks 0-1; request A looks chunk 1 up (G3 empty: A's G3 verdict a cached miss, G4's a HIT) and
    stays alive; then G3 stores 0-1 too. With the primary full (3 chunks pinned by another request's GPU->primary
    stores), B asks 0-1: chunk 0 RETRY on both tiers (posted), chunk 1 RETRY on G3 (its cached miss re-asked) and
    A's cached HIT on G4, which starts no promotion (MISS). Once G3 answered and the primary has room, B's chunks
    both load from G3. Both count on G3 (2 lookup hits), none on G4, 32 matched tokens. Before the fix G4 counted
    chunk 1 (G3 1 hit, G4 1) though G4 loaded nothing."""
    keys = keys_for(2, "credit")
    data = _held_in_g4_only(harnesses, tmp_path, keys, 11)

    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")], chunks=3)
    g3, g4 = h.manager.secondary_tiers
    _, n = h.promote(keys[1:], timeout=HANG_S)  # A: G3 misses chunk 1, G4 serves it; A stays alive
    assert n == 1 and g4.kvbm_stats()["tier"]["chunks_loaded"] == 1
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    h.store(keys, data)  # G3 stores 0-1 (G4 holds them already): A's cached G3 miss of chunk 1 is asked again
    h.wait_idle(timeout=HANG_S)
    assert g3.kvbm_stats()["tier"]["chunks_stored"] == 2
    h.reset_primary()

    pin = h.context()  # the primary full: 3 chunks whose GPU->primary store is in flight (not evictable)
    h.manager.on_new_request(pin)
    out = h.manager.prepare_store(keys_for(3, "pin"), pin)
    assert out is not None and len(out.keys_to_store) == 3

    t0, s3, s4 = metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0, _hits(g3), _hits(g4)
    l3, l4 = (t.kvbm_stats()["tier"]["chunks_loaded"] for t in (g3, g4))
    b = h.context()
    for i, k in enumerate(keys):
        b.set_offload_key_position(k, i + 1)
    h.manager.on_new_request(b)
    # chunk 0: posted to G3 and G4 (RETRY); chunk 1: G3 re-asks its miss (RETRY), G4 answers A's HIT, no room: MISS
    assert [h.manager.lookup(k, b) for k in keys] == [LookupResult.RETRY, LookupResult.MISS]
    h.step()
    step_until(lambda: all(g3.lookup(k, b) is LookupResult.HIT for k in keys), h)  # G3's answers in, the primary full
    h.manager.complete_store(out.keys_to_store, pin, False)  # the pinned stores failed: their chunks are free
    h.manager.on_request_finished(pin)
    step_until(lambda: _resolved(h, keys, b), h)  # both promoted from G3 (its HIT answers first), then loaded
    got = _load(h, keys, b, b)
    assert all(np.array_equal(a, d) for a, d in zip(got, data))
    loaded = tuple(t.kvbm_stats()["tier"]["chunks_loaded"] - n0 for t, n0 in ((g3, l3), (g4, l4)))
    assert loaded == (2, 0)  # both chunks came from G3
    moved = (metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0) - t0
    assert (_hits(g3) - s3, _hits(g4) - s4, moved) == (2, 0, 2 * GEO["tokens_per_block"])


def test_a_g3_verdict_taken_up_while_g4_counted_the_request_is_credited_once(tmp_path, harnesses):
    """Both tiers hold chunks 0-1. In one step request A (its load tier filter: local storage only, so G4 is not
    asked for it) posts them to G3 and B takes A's pending G3 verdicts up and posts them to G4, the lowest tier,
    whose lookup counts B's 2 chunks for G3 (G3's index holds them). Once A's answers are in B loads both from G3:
    counted once (G3: A's 2 hits + B's 2, 64 matched tokens, G4 none). Before the fix G3 also counted B's taken-up
    HITs at their answer: 6 hits, 96 tokens for 2 chunks loaded once."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3, g4 = h.manager.secondary_tiers
    keys, data = keys_for(2, "once"), payloads(h, 2, seed=12)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    assert [t.kvbm_stats()["tier"]["chunks_stored"] for t in (g3, g4)] == [2, 2]
    h.reset_primary()

    t0, s3, s4 = metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0, _hits(g3), _hits(g4)
    l3, l4 = (t.kvbm_stats()["tier"]["chunks_loaded"] for t in (g3, g4))
    a, b = _local_and_any(h, keys, "once-a")
    assert [h.manager.lookup(k, a) for k in keys] == [LookupResult.RETRY] * 2  # posted to G3 only
    assert [h.manager.lookup(k, b) for k in keys] == [LookupResult.RETRY] * 2  # G3: A's, pending; G4: posted
    h.step()
    step_until(lambda: all(g3.lookup(k, a) is LookupResult.HIT for k in keys)
               and all(g4.lookup(k, b) is LookupResult.HIT for k in keys), h)  # every answer in (G4's counted B)
    step_until(lambda: _resolved(h, keys, b), h)  # B first: promoted from G3 on A's verdicts, loaded
    assert _resolved(h, keys, a)  # A finds them in the primary tier
    got = _load(h, keys, b, b, a)
    assert all(np.array_equal(x, d) for x, d in zip(got, data))
    loaded = tuple(t.kvbm_stats()["tier"]["chunks_loaded"] - n0 for t, n0 in ((g3, l3), (g4, l4)))
    assert loaded == (2, 0)
    moved = (metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0) - t0
    assert (_hits(g3) - s3, _hits(g4) - s4, moved) == (4, 0, 4 * GEO["tokens_per_block"])


def test_a_g3_miss_taken_up_while_g4_counted_the_request_is_counted_once(tmp_path, harnesses):
    """Review finding (2026-12-03): as above with G3 empty. A (local storage only) posts chunks 0-1 to G3; B takes A's
    pending G3 verdicts up and posts them to G4, which holds them. G4's lookup counts B over every chunk for G3
    (``tier_gaps.split_prefix``, since removed); G3's miss B took up was counted again at its answer
    (``Pickups.note``, since removed: only a HIT waited for the load), so G3's ``lookup_blocks`` (the hit rate's
    denominator) grew by 6 for 2 chunks asked by 2 requests. Now a miss taken up is not counted where the lowest of
    our tiers counted the chunk: 4."""
    keys = keys_for(2, "missonce")
    data = _held_in_g4_only(harnesses, tmp_path, keys, 21)

    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3, g4 = h.manager.secondary_tiers
    b3, b4 = counted(g3), counted(g4)
    a, b = _local_and_any(h, keys, "miss-a")
    assert [h.manager.lookup(k, a) for k in keys] == [LookupResult.RETRY] * 2  # posted to G3 only
    assert [h.manager.lookup(k, b) for k in keys] == [LookupResult.RETRY] * 2  # G3: A's, pending; G4: posted
    h.step()
    step_until(lambda: all(g3.lookup(k, a) is LookupResult.MISS for k in keys)
               and all(g4.lookup(k, b) is LookupResult.HIT for k in keys), h)
    step_until(lambda: _resolved(h, keys, b), h)  # B: G3's (A's) miss taken up, then loaded from G4
    got = _load(h, keys, b, b, a)
    assert all(np.array_equal(x, d) for x, d in zip(got, data))
    d3 = tuple(x - y for x, y in zip(counted(g3), b3))
    d4 = tuple(x - y for x, y in zip(counted(g4), b4))
    assert (d3, d4[1]) == ((4, 0), 2)  # G3: A's 2 chunks and B's 2, none found; G4 found B's 2


def test_a_load_of_a_request_that_ended_credits_nothing_and_is_not_kept(tmp_path, harnesses):
    """Review finding (2026-12-03): a load vLLM submits for a request whose tier state ended (``cleanup``) was still
    noted, and its chunks credited to the tier once loaded (2 lookup hits for a request gone, its entry kept for
    good); a load still in flight when its request ends was kept until it reported (forever, were the tier closed
    first). Now neither: the chunks still load, nothing is counted or kept for the request."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3, _g4 = h.manager.secondary_tiers
    keys, data = keys_for(2, "ended"), payloads(h, 2, seed=31)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    b3 = counted(g3)

    gone = h.context()
    g3.on_request_finished(gone)  # ended before the load was submitted
    g3.submit_load(TransferJob(901, keys, np.array([0, 1]), True, gone))
    g3.drain_jobs()
    assert [r.success for r in g3.get_finished_jobs()] == [True]
    assert all(np.array_equal(h.primary[c, :h.chunk_bytes], d) for c, d in zip((0, 1), data))
    h.step()  # the tiers' flush: what is due is counted
    assert counted(g3) == b3  # before: (2, 2) more

    live = h.context()
    assert [g3.lookup(k, live) for k in keys] == [LookupResult.RETRY] * 2  # the request asks G3 (not G4)
    g3.submit_load(TransferJob(902, keys, np.array([0, 1]), True, live))
    g3.on_request_finished(live)  # ends while its load is in flight
    assert len(g3._lookup._ledger) == 0  # nothing kept for it (before: its load, until the load reports)
    g3.drain_jobs()
    assert [r.success for r in g3.get_finished_jobs()] == [True]
    h.step()
    assert counted(g3) == b3
