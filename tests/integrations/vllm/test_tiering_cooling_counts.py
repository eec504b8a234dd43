"""Review findings (2026-12-03), fixed in ``integrations/vllm/tier_lookup.py`` / ``tier_pickups.py`` (removed) /
:mod:`.tier_gaps` (since 2026-12-03 counted by ``tier_ledger.py``): the hit or miss a native tier is credited with
is the answer it gave.

(1) A tier cooling a chunk after a failed load (:class:`FailedChunks`: it answers MISS without asking its pool)
still held it for the tier below's bookkeeping: G4 under G3 credited G3 with a HIT for a chunk G3 answered MISS and
G4 served (``split_prefix``, since removed, read G3's index), and G4 did not look past its own gap at a chunk G3
held but cooled (:func:`skip_held`): nobody served it, recomputed.
(2) A cooling miss was counted in no pool's lookup counters (the tier alone, or the lowest of ours), and no counter
said why the tier answered a miss: now ``lookup_cooling_chunks`` (``kvbm_stats()["tier"]``), once per request and
chunk, and the miss once in the tier's pool where that tier counts the chunk.
(3) A G3Tier refusing a revoked tenant listed above G4: G4 counted the request's chunks as G3 misses in G3's pool on
top of ``lookup_g3_revoked`` (the connector counts only the latter).
(4) G4's cached miss of a chunk it skipped because G3 above held it stayed cached after G3's load of the chunk failed
and G3 cooled it: while the request that posted it lived, new requests took the stale miss up and recomputed the chunk
G4 held (:func:`.tier_gaps.failed_load` now has the tiers below ask their misses of those chunks again).

vLLM's real offloading spec and manager (:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`),
a real G3 directory, a file:// G4 store, a keyring changed by the ``kvbm-backend keys`` CLI."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from tests.helpers.tier_counts import G4Counts, cool_keys, counted  # noqa: E402
from tests.integrations.vllm import test_tiering  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, MOD, g3_tier, keys_for, payloads  # noqa: E402
from tests.integrations.vllm.test_tiering_counts import _g4_tier  # noqa: E402
from tests.integrations.vllm import test_tiering_revoked  # noqa: E402
from tests.integrations.vllm.test_tiering_revoked import NEVER_S, _check, _ctx, _keys  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test
kek = test_tiering_revoked.kek  # the fixture: the KEK file beside the keyring, as the CLI finds it


def _delta(now: tuple[int, int], before: tuple[int, int]) -> tuple[int, int]:
    return now[0] - before[0], now[1] - before[1]


def _cooling(tier) -> int:
    return tier.kvbm_stats()["tier"].get("lookup_cooling_chunks", 0)


def test_a_chunk_g3_cools_and_g4_serves_counts_a_g3_miss_and_a_g4_hit(tmp_path, harnesses):
    """G3Tier above G4Tier, both hold chunks 0-1, but G3's load of them failed (they cool: G3 answers misses without
    asking its pool, though its index holds them). A request loads both from G4. Before the fix G4's count credited
    G3 with 2 hits (G3's index) and G4 with nothing; now G3 counts 2 misses, G4 2 hits, G3 2 cooling answers."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "g3-cooling")
    cool_keys(h, g3t, keys, 600.0)
    data = payloads(h, 2, seed=7)
    h.store(keys, data)  # both put them (G3 does not publish its cooling chunks)
    h.wait_idle(timeout=HANG_S)
    assert all(g3t.pool.contains(bk) for k in keys for bk in g3t._block_keys(k, ""))
    h.reset_primary()
    b3, c4 = counted(g3t), G4Counts(g4t)
    got = h.load(keys, timeout=HANG_S)
    assert len(got) == 2 and all(np.array_equal(x, d) for x, d in zip(got, data))  # from G4
    h.step()
    assert _delta(counted(g3t), b3) == (2, 0)  # before: (2, 2)
    assert c4() == (2, 2)  # before: (0, 0)
    assert _cooling(g3t) == 2


def test_g4_looks_past_its_gap_at_a_chunk_g3_holds_but_cools(tmp_path, harnesses):
    """G3Tier above G4Tier. G3 holds chunks 0-1, chunk 1 cooling (G3 answers it a miss); G4 holds chunk 1 only. G4
    looks past its gap (chunk 0) only where G3 fills it. Before the fix G4 skipped chunk 1 as held by G3 (its index)
    and answered it a miss too: 1 chunk loaded, chunk 1 recomputed. Now both load (0 from G3, 1 from G4), counted
    so: G3 2 asked 1 found, G4 1 asked 1 found."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "g3-past-gap")
    cool_keys(h, g3t, keys[1:], 600.0)
    data = payloads(h, 2, seed=8)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    assert g4t.pool.delete(g4t._block_keys(keys[0], "")).result(timeout=HANG_S) == 1  # G4 lacks chunk 0
    h.reset_primary()
    b3, c4 = counted(g3t), G4Counts(g4t)
    got = h.load(keys, timeout=HANG_S)
    assert len(got) == 2  # before: 1 (chunk 1 recomputed)
    assert all(np.array_equal(x, d) for x, d in zip(got, data))
    h.step()
    assert _delta(counted(g3t), b3) == (2, 1)
    assert c4() == (1, 1)
    assert _cooling(g3t) == 1


def test_a_lone_tier_counts_its_cooling_miss_once_per_request(tmp_path, harnesses):
    """One G3Tier; its load of chunks 0-1 failed (they cool). A request looks them up twice (vLLM's scheduler stops at
    chunk 0's miss): one miss counted in G3's pool and ``lookup_cooling_chunks`` 1. Before the fix: nothing counted
    (the pool's lookup counters did not move, and no counter said why G3 answered a miss)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    g3t = h.tier
    keys = keys_for(2, "alone")
    cool_keys(h, g3t, keys, 600.0)
    b3 = counted(g3t)
    ctx = h.context()
    h.manager.on_new_request(ctx)
    assert h.lookup_prefix(keys, ctx, timeout=HANG_S) == 0
    h.step()
    assert h.lookup_prefix(keys, ctx, timeout=HANG_S) == 0  # asked again: not counted again
    h.manager.on_request_finished(ctx)
    h.step()
    assert _delta(counted(g3t), b3) == (1, 0)  # before: (0, 0)
    assert _cooling(g3t) == 1  # before: no such counter


def test_g4_counts_its_cooling_miss_unless_g3_above_served_the_chunk(tmp_path, harnesses):
    """G3Tier above G4Tier; G4's load of chunks 0-1 failed (they cool), G3 lacks them. A request gets misses from both:
    G3 counts its 2 (c9440c9), G4 now its own 2 (before: none). Once G3 holds them a new request loads both from G3
    while G4 still answers them cooling misses: G4 counts nothing for it (served above), ``lookup_cooling_chunks``
    counts G4's 4 answers."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "g4-cooling")
    cool_keys(h, g4t, keys, 600.0)
    b3, c4 = counted(g3t), G4Counts(g4t)
    assert h.load(keys, timeout=HANG_S) == []
    h.step()
    assert _delta(counted(g3t), b3) == (2, 0)
    assert c4() == (2, 0)  # before: (0, 0)
    assert _cooling(g4t) == 2
    data = payloads(h, 2, seed=9)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    got = h.load(keys, timeout=HANG_S)
    assert len(got) == 2 and all(np.array_equal(x, d) for x, d in zip(got, data))
    h.step()
    assert _delta(counted(g3t), b3) == (4, 2)
    assert c4() == (2, 0)
    assert _cooling(g4t) == 4


def test_a_g3_tier_above_refusing_a_revoked_tenant_is_not_counted_in_its_pool(tmp_path, kek, harnesses):
    """G3Tier listed above G4Tier, following G4's keyring, in which acme is revoked. A request of acme: G3 answers
    misses without asking its pool (``lookup_g3_revoked`` 1), G4 its own 2 misses. Before the fix G4's count also put
    2 misses in G3's pool (the connector counts a refused G3 lookup only as ``lookup_g3_revoked``)."""
    kr = str(tmp_path / "keys" / "keyring.json")
    _keys("acme", "create", kr=kr)
    g4 = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
          "g4": {"url": f"file://{tmp_path / 'g4'}", "keyring": {"path": kr, "reload_interval_s": NEVER_S}}}
    h = harnesses([g3_tier(tmp_path / "g3"), g4])
    g3t, g4t = h.manager.secondary_tiers
    assert g3t._revoked is not None  # G3 follows G4's keyring
    _keys("acme", "revoke", kr=kr)
    _check(g3t)
    b3, c4 = counted(g3t), G4Counts(g4t)
    assert h.load(keys_for(2, "refused-above"), ctx=_ctx(h, "acme"), timeout=HANG_S) == []
    h.step()
    assert g3t.kvbm_stats()["tier"]["lookup_g3_revoked"] == 1
    assert counted(g3t) == b3  # before: (2, 0) more
    assert c4() == (2, 0)


def test_the_request_whose_load_failed_is_not_counted_again_for_the_cooling_miss(tmp_path, harnesses):
    """One G3Tier holding chunks 0-1. A request's lookup finds both (counted 2 of 2 by its own lookup); the blocks go
    before the load runs (deleted), the load fails and the chunks cool. The request asks again: a cooling miss,
    ``lookup_cooling_chunks`` 1, but no second count in G3's pool (its lookup counted the chunk for it already)."""
    from vllm.v1.kv_offload.base import LookupResult

    h = harnesses([g3_tier(tmp_path / "g3")])
    g3t = h.tier
    keys = keys_for(2, "failed-own")
    h.store(keys, payloads(h, 2, seed=10))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    b3 = counted(g3t)
    ctx = h.context()
    h.manager.on_new_request(ctx)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, i + 1)
    assert [h.manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 2
    for _ in range(300_000):  # a hang guard: until the tier's verdicts are in (not yet taken: no promotion yet)
        h.step()
        g3t._lookup.drain_results()
        if all(g3t._lookup._verdict((k, "")) for k in keys):
            break
    assert g3t.pool.delete([bk for k in keys for bk in g3t._block_keys(k, "")]).result(timeout=HANG_S) == 2
    assert [h.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 2
    for _ in range(300_000):
        h.step()
        if h.manager.lookup(keys[0], ctx) is LookupResult.MISS:  # the load failed: cooling
            break
    assert g3t._failed.cooling("", keys[0])
    assert h.lookup_prefix(keys, ctx, timeout=HANG_S) == 0
    h.manager.on_request_finished(ctx)
    h.step()
    assert _delta(counted(g3t), b3) == (2, 2)  # its own lookup's; the cooling miss not counted again
    assert _cooling(g3t) == 1


def _a_holds_verdicts(h, g3t, g4t, keys):
    """Request A (alive) asks ``keys``: G3 answers RETRY, so vLLM's manager asks G4 too; until both tiers' verdicts
    are in (not taken: no promotion starts). Returns A's context."""
    from vllm.v1.kv_offload.base import LookupResult

    a = h.context("req-a")
    h.manager.on_new_request(a)
    for i, k in enumerate(keys):
        a.set_offload_key_position(k, i + 1)
    assert [h.manager.lookup(k, a) for k in keys] == [LookupResult.RETRY] * len(keys)  # posted to G3 and G4
    end = time.monotonic() + HANG_S
    while not all(t._lookup._verdict((k, "")) is not None for t in (g3t, g4t) for k in keys):
        assert time.monotonic() < end, "verdicts never came"  # a hang guard
        h.step()
        g3t._lookup.drain_results()
        g4t._lookup.drain_results()
        time.sleep(0.001)
    return a


def _fail_load_keeping_the_block(h, g3t, a, key) -> None:
    """A's load of ``key`` from G3 fails while G3 keeps the block (the job raises: a primary chunk id past the
    buffer, as a read error would), reported through the tier's ``get_finished_jobs``: the chunk cools."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    g3t.submit_load(TransferJob(991, [key], np.array([h.primary.shape[0]]), True, a))
    end = time.monotonic() + HANG_S
    while not any(r.job_id == 991 and not r.success for r in g3t.get_finished_jobs()):
        assert time.monotonic() < end, "the load never ended"  # a hang guard
        time.sleep(0.002)


@pytest.mark.parametrize("how", ["kept", "gone", "dropped"])
@pytest.mark.parametrize("a_alive", [False, True], ids=["a-ended", "a-alive"])
def test_g4_serves_a_chunk_g3_cools_while_an_earlier_request_holds_g4s_cached_miss(tmp_path, harnesses, how,
                                                                                   a_alive):
    """G3Tier above G4Tier. G3 holds chunks 0-1, G4 chunk 1 only. Request A asks both: G3 answers RETRY, so vLLM's
    manager asks G4 too, which caches a miss for chunk 1 without asking its store (G3 held it). Then chunk 1's load
    from G3 fails and G3 cools it: A's load with G3 keeping the block (``kept``), A's load through the manager after
    G3's block went (``gone``: evicted between lookup and load), or B's own load after G3 dropped the block while A
    waited (``dropped``: B took up A's cached G3 HIT). A stays alive (``a-alive``; ``a-ended``: the control, passing
    before). A new request B with the same prefix loads chunk 0 from G3 (or the primary) and chunk 1 from G4. Before
    the fix B took up G4's cached miss (A's) and recomputed chunk 1 although G4 held it (1 chunk loaded). Counted once
    for B: chunk 1 a G3 miss and a G4 hit; chunk 0 a G3 hit unless the primary served it."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, f"stale-g4-verdict-{how}")
    data = payloads(h, 2, seed=12)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    assert g4t.pool.delete(g4t._block_keys(keys[0], "")).result(timeout=HANG_S) == 1  # G4 lacks chunk 0
    h.reset_primary()
    a = _a_holds_verdicts(h, g3t, g4t, keys)
    assert g4t._lookup._verdict((keys[1], "")) is False  # G3 held chunk 1: G4 did not look at it
    if how == "kept":
        _fail_load_keeping_the_block(h, g3t, a, keys[1])
        assert g3t.pool.contains(g3t._block_keys(keys[1], "")[0])
    else:
        assert g3t.pool.delete(g3t._block_keys(keys[1], "")).result(timeout=HANG_S) == 1
    if how == "gone":  # A's lookups start the promotion of both from G3: chunk 1's fails, A keeps G4's miss
        assert h.lookup_prefix(keys, a, timeout=HANG_S) == 1
    if how != "dropped":
        assert g3t._failed.cooling("", keys[1])
    if not a_alive:
        h.manager.on_request_finished(a)
        h.step()
    b3, c4 = counted(g3t), G4Counts(g4t)
    got = h.load(keys, ctx=h.context("req-b"), timeout=HANG_S)
    assert len(got) == 2, f"{len(got)} chunk(s) loaded: chunk 1 recomputed although G4 holds it (G4's stale miss)"
    assert all(np.array_equal(x, d) for x, d in zip(got, data))
    h.step()
    assert _delta(counted(g3t), b3) == ((1, 0) if how == "gone" else (2, 1))  # gone: chunk 0 in the primary (A's)
    assert c4() == (1, 1)
