"""Review findings (2026-12-03), fixed in ``integrations/vllm/tier_lookup.py`` / ``tier_pickups.py`` (removed) /
:mod:`.tier_gaps` (since 2026-12-03 counted by ``tier_ledger.py``): with two of our native tiers in one vLLM
manager, each request's lookup of each chunk counts once (``kvbm_matched_tokens``, the pools' lookup counters and
hit rates), on the tier that answered.

(a) The lowest of our tiers counted a request's lookup for every tier, but only over the chunks the request posted
to it. A chunk the request posted to the upper tier and never to the lowest (the lowest refused the request's tenant,
answered a chunk cooling after a failed load with a miss, or the request took up the lowest's verdict another request
had posted) was counted by neither: the request's outcome vanished from the metrics.
(b) A miss of the upper tier a request took up from another request was counted at the step's flush when the
request had not posted the chunk to the lowest tier, and again by the lowest's lookup when the request posted it
there in a later step.

Review of (a) and (b) (2026-12-03): (c) the upper tier counted a HIT it answered alone only when loaded, so a HIT
after a miss (vLLM's prefix scan stops at the miss) was counted by no tier; (d) a request ending while the lowest
tier's lookup of a chunk the upper tier had counted for it was in flight had that chunk counted on the upper tier
again (its record was dropped at the request's end, before the lookup read it); (e) a lone tier counted a chunk it
had answered cooling again when the request asked it after the cool-down.

(f) A verdict a request took up while still pending (another live request posted it in the same or the previous
step: the usual case for concurrent requests sharing a prefix) was counted only if the request asked the chunk again
once the answer was in; vLLM's prefix scan stops at the first MISS, so a chunk after it was never asked again and
was counted by no tier (a lone tier, G3 above G4, G4 below G3). Now it is settled at the step's end once its answer
is in, as a chunk the request posted itself. (g) While an earlier chunk's verdict was not in, every step rebuilt the
request's usable prefix (every key it asked x every tier) to judge its HIT; now only when one of its verdicts changed.

vLLM's real offloading spec and manager (:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`),
a real G3 directory, a file:// G4 store, a keyring changed by the ``kvbm-backend keys`` CLI."""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext, TierFilter, TierMatcher  # noqa: E402

from kvbm_backend.integrations.vllm import tier_ledger  # noqa: E402
from kvbm_backend.integrations.vllm.failed_blocks import FailedChunks  # noqa: E402
from kvbm_backend.integrations.vllm.tier_base import offload_key_hash  # noqa: E402
from tests.helpers.tier_counts import G4Counts, ask, cool_keys, counted, step_until  # noqa: E402
from tests.integrations.vllm import test_tiering  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, MOD, g3_tier, keys_for, payloads  # noqa: E402
from tests.integrations.vllm.test_tiering_counts import _g4_tier  # noqa: E402
from tests.integrations.vllm import test_tiering_revoked  # noqa: E402
from tests.integrations.vllm.test_tiering_revoked import NEVER_S, _check, _ctx, _keys  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test
kek = test_tiering_revoked.kek  # the fixture: the KEK file beside the keyring, as the CLI finds it
ACME = "acme"


def _started(h, keys, ctx):
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, i + 1)
    h.manager.on_new_request(ctx)
    return ctx


def _only(h, rid: str, locality: Locality):
    """A started request whose load tier filter allows storage of ``locality`` only (G3 LOCAL, G4 REMOTE)."""
    return ReqContext(req_id=rid, load_tier_filter=TierFilter((TierMatcher(Medium.STORAGE, locality),)))


def test_a_g4_lookup_is_counted_when_the_g3_tier_below_refuses_the_tenant(tmp_path, kek, harnesses):
    """G4Tier listed above G3Tier; the G3Tier follows G4's keyring, in which acme is revoked. A request of acme posts
    its 2 chunks to G4 (its lookups uncounted: the lowest of our tiers counts for all), and G3 answers them misses
    without asking its pool (``lookup_g3_revoked``), so it counts nothing. Before the fix the request's lookup was
    counted nowhere; now G4 counts its own 2 misses, G3 only the refused request."""
    kr = str(tmp_path / "keys" / "keyring.json")
    _keys(ACME, "create", kr=kr)
    g4 = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
          "g4": {"url": f"file://{tmp_path / 'g4'}", "keyring": {"path": kr, "reload_interval_s": NEVER_S}}}
    h = harnesses([g4, g3_tier(tmp_path / "g3")])
    g4t, g3t = h.manager.secondary_tiers
    _keys(ACME, "revoke", kr=kr)
    _check(g3t)
    b3, c4 = counted(g3t), G4Counts(g4t)
    assert h.load(keys_for(2, "refused"), ctx=_ctx(h, ACME), timeout=HANG_S) == []
    h.step()
    assert g3t.kvbm_stats()["tier"]["lookup_g3_revoked"] == 1 and counted(g3t) == b3
    assert c4() == (2, 0)  # before: (0, 0)


def test_a_g3_miss_is_counted_when_g4_answers_a_cooling_chunk_without_asking(tmp_path, harnesses):
    """G3Tier above G4Tier. G4's load of chunks 0-1 failed (they cool: G4 answers their lookups misses without asking
    its pool); G3 lacks them. A request posts both to G3 (uncounted: G4, the lowest, counts for all) and never to
    G4. Before the fix the request's G3 misses were counted nowhere; now G3 counts them (2 of 2 missed). Once G3
    holds them a new request loads both from G3: 2 hits, counted once. G4 counts its own cooling misses of the first
    request (since 2026-12-03: test_tiering_cooling_counts.py), none of the second's (G3 served them)."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "cooling")
    cool_keys(h, g4t, keys, 600.0)
    b3, c4 = counted(g3t), G4Counts(g4t)
    assert h.load(keys, timeout=HANG_S) == []
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (2, 0)  # before: (0, 0)
    assert c4() == (2, 0)  # G4's own cooling misses (before 2026-12-03: (0, 0))
    data = payloads(h, 2, seed=41)  # G3 stores them now (G4 skips its cooling chunks); a new request loads them
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    got = h.load(keys, timeout=HANG_S)
    assert len(got) == 2 and all(np.array_equal(x, d) for x, d in zip(got, data))
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (4, 2)  # its 2 hits, once (loaded from G3)
    assert c4() == (2, 0)  # the second request's cooling misses not counted on G4: G3 served the chunks


def test_a_g3_lookup_is_counted_when_the_request_takes_g4s_verdict_up(tmp_path, harnesses):
    """G3Tier above G4Tier, both empty. A (its load tier filter: remote storage only, so G3 is not asked for it) posts
    chunks 0-1 to G4; B posts them to G3 and takes up A's pending G4 verdicts (vLLM posts a key once). G4 counts A's
    2 misses and B's taken up; B's G3 misses were counted nowhere before the fix (G3's lookup uncounted, G4 not posted
    by B). Now G3 counts them: 2 of 2 missed, G4 4 of 4."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "g4-taken")
    b3, c4 = counted(g3t), G4Counts(g4t)
    a = _started(h, keys, _only(h, "taken-a", Locality.REMOTE))
    b = _started(h, keys, h.context())
    assert ask(h, keys, a) == [LookupResult.RETRY] * 2  # posted to G4 only
    assert ask(h, keys, b) == [LookupResult.RETRY] * 2  # G3: posted; G4: A's, pending
    h.step()
    step_until(lambda: ask(h, keys, b)[0] is LookupResult.MISS and ask(h, keys, a)[0] is LookupResult.MISS, h)
    for ctx in (a, b):
        h.manager.on_request_finished(ctx)
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (2, 0)  # before: (0, 0)
    assert c4() == (4, 0)


def _b_took_up_a_g3_misses(tmp_path, harnesses, tag: str):
    """G3Tier above G4Tier, both empty. A (local storage only) posts chunks 0-1 (``keys_for(2, tag)``) to G3: 2
    misses, counted by G3 (the lowest tier A asks). G4's loads of them fail, so they cool there. B takes A's G3
    misses up (G4 answers cooling misses, its pool not asked), counted for B on G3 at the step's end: (4, 0) in all.
    Then G4's cool-down ends (a fresh record: nothing cooling). Returns ``(h, keys, a, b, b3, c4)``: the harness,
    the keys, A's and B's contexts, G3's :func:`counted` before A, and G4's :class:`G4Counts` since then."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, tag)
    b3, c4 = counted(g3t), G4Counts(g4t)
    a = _started(h, keys, _only(h, f"{tag}-a", Locality.LOCAL))
    assert ask(h, keys, a) == [LookupResult.RETRY] * 2
    h.step()
    step_until(lambda: all(g3t.lookup(k, a) is LookupResult.MISS for k in keys), h)
    cool_keys(h, g4t, keys, 600.0)
    b = _started(h, keys, h.context())
    assert ask(h, keys, b) == [LookupResult.MISS] * 2  # G3: A's misses, taken up; G4: cooling, its pool not asked
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (4, 0)  # A's 2 and B's 2
    g4t._failed = FailedChunks(offload_key_hash)  # the cool-down ended (a fresh record: nothing cooling)
    return h, keys, a, b, b3, c4


def test_a_g3_miss_taken_up_is_counted_once_when_the_chunk_reaches_g4_in_a_later_step(tmp_path, harnesses):
    """G3Tier above G4Tier, both empty. A (local storage only) posts chunks 0-1 to G3: 2 misses, counted by G3 (the
    lowest tier A asks). G4's loads of them failed, so they cool there. B takes A's G3 misses up (counted for B on
    G3 at the step's end: G4 answered without asking its pool, B posted nothing there); once the cool-down ended B asks
    again and posts the chunks to G4, whose lookup counts the request for G3 and G4. Before the fix it counted B's G3
    misses a second time (G3: 6 chunks for 4 lookups); now G3 counts 4, G4 B's 2 (since 2026-12-03 its cooling
    misses, counted at the step's end, and left out of G4's count when B posts the chunks there)."""
    h, keys, a, b, b3, c4 = _b_took_up_a_g3_misses(tmp_path, harnesses, "later")
    g3t, g4t = h.manager.secondary_tiers
    step_until(lambda: all(g4t.lookup(k, b) is LookupResult.MISS for k in keys)
               and ask(h, keys, b) == [LookupResult.MISS] * 2, h)  # B posted them to G4 now; answered
    for ctx in (a, b):
        h.manager.on_request_finished(ctx)
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (4, 0)  # before: (6, 0)
    assert c4() == (2, 0)


def _own_hit(tmp_path, harnesses, cool: bool) -> tuple[int, int]:
    """G3Tier above G4Tier; G3 holds chunk 1 of 2, not chunk 0 (G4 neither). ``cool``: G4's loads of both failed,
    so G4 answers them misses without asking its pool (the request posts them to G3 only). Returns G3's
    ``(lookup_blocks, lookup_hits)`` moved by one request of chunks 0-1."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "own-hit")
    cool_keys(h, g4t, keys, 600.0 if cool else 0.001)
    h.store(keys[1:], payloads(h, 1, seed=7))  # G3 stores chunk 1 (G4 skips it while it cools)
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    if not cool:
        assert not g4t._failed.cooling("", keys[0])
    assert sum(g3t.pool.contains(bk) for bk in g3t._block_keys(keys[1], "")) == g3t.geometry.copies
    b3 = counted(g3t)
    assert h.load(keys, timeout=HANG_S) == []  # chunk 0 is nowhere: nothing loads
    h.step()
    h.step()
    return tuple(x - y for x, y in zip(counted(g3t), b3))


def test_g3_counts_every_chunk_asked_when_the_request_asks_g4_too(tmp_path, harnesses):
    """The control for the next test: the request posts both chunks to G4 too, whose lookup counts G3 over every
    chunk asked and finds none (chunk 1 lies past the request's usable prefix: chunk 0 is nowhere)."""
    assert _own_hit(tmp_path, harnesses, cool=False) == (2, 0)


def test_a_g3_hit_after_a_miss_is_counted_when_g4_answers_both_cooling(tmp_path, harnesses):
    """G4 cooling: G3 answered chunk 0 a miss and chunk 1 a HIT for the request, which posted neither to G4; chunk 1
    is never loaded (vLLM's prefix scan stops at chunk 0). G3 counts both, as when G4 is asked: (2, 0). Before the
    fix (1, 0): a HIT was counted only when loaded, so chunk 1's lookup was counted by no tier."""
    assert _own_hit(tmp_path, harnesses, cool=True) == (2, 0)


def _gated(tier) -> tuple[threading.Event, threading.Event]:
    """Hold ``tier``'s real ``batch_lookup`` (its worker thread's) until the returned ``gate`` is set (a slow HEAD,
    at most ``HANG_S`` s); ``done`` is set once a held lookup returned. Returns ``(gate, done)``."""
    gate, done = threading.Event(), threading.Event()
    real = tier._lookup.batch_lookup

    def gated(keys_, ctx):
        gate.wait(HANG_S)
        try:
            return list(real(keys_, ctx))
        finally:
            done.set()
    tier._lookup.batch_lookup = gated
    return gate, done


@pytest.mark.parametrize("end_first", [False, True], ids=["ends-after-lookup", "ends-while-in-flight"])
def test_a_g3_miss_is_counted_once_when_the_request_ends_while_g4s_lookup_is_in_flight(tmp_path, harnesses,
                                                                                       end_first):
    """The last scenario above (B's G3 misses taken up and counted on G3; once G4's cool-down ended B posts the
    chunks to G4, whose lookup leaves G3 out), with B ending while G4's lookup is in flight (a G4 HEAD takes its
    time; vLLM's worker still runs a posted batch whose request ended): a gate holds G4's real ``batch_lookup``.
    Before the fix B's end dropped G4's record that G3 had counted the chunks for B before G4's worker read it, so
    G3 counted B's 2 misses again: (6, 0) for 4 lookups. ``ends-after-lookup``: the control."""
    h, keys, a, b, b3, c4 = _b_took_up_a_g3_misses(tmp_path, harnesses, "race")
    g3t, g4t = h.manager.secondary_tiers
    gate, done = _gated(g4t)  # G4's real lookup, in flight until the gate opens (a slow HEAD)
    assert ask(h, keys, b) == [LookupResult.RETRY] * 2  # posted to G4 now
    h.step()  # flush: G4's worker thread takes the batch
    if end_first:
        for ctx in (a, b):
            h.manager.on_request_finished(ctx)  # B ends while its G4 lookup is in flight
    gate.set()
    assert done.wait(HANG_S)
    h.step()
    if not end_first:
        for ctx in (a, b):
            h.manager.on_request_finished(ctx)
        h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (4, 0)  # before (ends-while-in-flight): (6, 0)
    assert c4() == (2, 0)  # B's cooling misses, once
    assert len(g4t._lookup._ledger) == 0 and len(g3t._lookup._ledger) == 0  # nothing kept for ended requests


def test_a_lone_tier_counts_a_chunk_once_when_the_request_asks_it_again_after_its_cool_down(tmp_path, harnesses):
    """G3Tier alone. Its loads of chunks 0-1 failed, so it answers a request's lookups of them misses without asking
    its pool (``lookup_cooling_chunks``: 2, counted 2 misses); the cool-down ends while the request still runs, and
    it asks them again: posted to the pool now. Each chunk counts once for the request: (2, 0). Before the fix the
    pool's own lookup counted them again: (4, 0)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    (g3t,) = h.manager.secondary_tiers
    keys = keys_for(2, "lone-cool")
    cool_keys(h, g3t, keys, 600.0)
    b3 = counted(g3t)
    r = _started(h, keys, h.context())
    assert ask(h, keys, r) == [LookupResult.MISS] * 2  # cooling: the pool not asked
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (2, 0)
    assert g3t.kvbm_stats()["tier"]["lookup_cooling_chunks"] == 2
    g3t._failed = FailedChunks(offload_key_hash)  # the cool-down ended (a fresh record: nothing cooling)
    assert ask(h, keys, r) == [LookupResult.RETRY] * 2  # posted to the pool now
    h.step()
    step_until(lambda: ask(h, keys, r) == [LookupResult.MISS] * 2, h)
    h.manager.on_request_finished(r)
    h.step()
    assert tuple(x - y for x, y in zip(counted(g3t), b3)) == (2, 0)  # before: (4, 0)
    assert len(g3t._lookup._ledger) == 0


def _moved(tier, before) -> tuple[int, int]:
    return tuple(x - y for x, y in zip(counted(tier), before))


def _both_scan_and_end(h, keys, a, b) -> None:
    """A and B (started) ask ``keys``: RETRY for each (A's posted; B's posted or A's verdicts taken up while
    pending). After a step each scans as vLLM does, stopping at chunk 0's MISS (no usable prefix); then both end
    and two steps flush what is due."""
    assert ask(h, keys, a) == [LookupResult.RETRY] * 2
    assert ask(h, keys, b) == [LookupResult.RETRY] * 2
    h.step()
    assert h.lookup_prefix(keys, b, timeout=HANG_S) == 0  # stops at chunk 0's MISS
    assert h.lookup_prefix(keys, a, timeout=HANG_S) == 0
    for ctx in (a, b):
        h.manager.on_request_finished(ctx)
    h.step()
    h.step()


@pytest.mark.parametrize("g3_holds_chunk_1", [False, True], ids=["both-miss", "hit-after-miss"])
def test_g3_counts_every_chunk_a_request_took_up_pending_when_its_scan_stops_at_the_first_miss(tmp_path, harnesses,
                                                                                            g3_holds_chunk_1):
    """G3Tier above G4Tier; G4 cools chunks 0-1 (its loads failed: it answers misses without asking its store, so B
    never posts them to G4). A (G3 only) posts both to G3; B takes A's G3 verdicts up while pending, then scans as
    vLLM does, stopping at chunk 0's MISS (chunk 1 is not asked again). A's G3 lookup counts (2, 0); B asked G3 about
    both chunks: (2, 0) as when it posts them itself (chunk 1 a HIT past the usable prefix: not found), (4, 0) in
    all. Before the fix (3, 0): chunk 1 stayed among B's verdicts waiting to be asked again, counted by no tier."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "pending-pickup")
    cool_keys(h, g4t, keys, 600.0)
    if g3_holds_chunk_1:
        h.store(keys[1:], payloads(h, 1, seed=5))
        h.wait_idle(timeout=HANG_S)
        h.reset_primary()
    b3 = counted(g3t)
    a = _started(h, keys, _only(h, "pend-a", Locality.LOCAL))
    b = _started(h, keys, h.context())
    _both_scan_and_end(h, keys, a, b)  # A posts to G3; B takes A's G3 verdicts up while pending
    assert _moved(g3t, b3) == (4, 0)  # before: (3, 0)
    assert len(g3t._lookup._ledger) == 0  # nothing kept for ended requests


def test_a_lone_tier_counts_every_chunk_a_request_took_up_pending(tmp_path, harnesses):
    """G3Tier alone, empty. A posts chunks 0-1; B takes A's verdicts up while pending, then scans as vLLM does,
    stopping at chunk 0's MISS. Posting them itself B would move G3 by (2, 0); A and B: (4, 0). Before the fix
    (3, 0): B's chunk 1 was dropped uncounted at the request's end."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    (g3t,) = h.manager.secondary_tiers
    keys = keys_for(2, "lone-pending")
    b3 = counted(g3t)
    a = _started(h, keys, h.context())
    b = _started(h, keys, h.context())
    _both_scan_and_end(h, keys, a, b)
    assert _moved(g3t, b3) == (4, 0)  # before: (3, 0)


@pytest.mark.parametrize("g4_holds_chunk_1", [False, True], ids=["both-miss", "hit-after-miss"])
def test_g4_counts_every_chunk_a_request_took_up_pending_below_g3(tmp_path, harnesses, g4_holds_chunk_1):
    """G3Tier above G4Tier, G3 empty. A (remote storage only: G4 alone for it) posts chunks 0-1 to G4: (2, 0) there.
    B posts them to G3 (its misses: counted on G3, B posted nothing to G4) and takes A's G4 verdicts up while
    pending; its scan stops at chunk 0's MISS. G4 counts B's chunks G3 does not serve in B's usable prefix: both
    (chunk 1, held by G4 or not, lies past chunk 0, which no tier holds: not found), so G4 moves by (4, 0). Before
    the fix (3, 0): B's chunk 1 waited for an ask that never came."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "pending-g4")
    if g4_holds_chunk_1:
        h.store(keys[1:], payloads(h, 1, seed=9))
        h.wait_idle(timeout=HANG_S)
        h.reset_primary()
        assert g3t.pool.delete(g3t._block_keys(keys[1], "")).result(timeout=HANG_S)  # G4 only holds it now
        assert g4t.pool.lookup_prefix(g4t._block_keys(keys[1], ""), request=False).result(HANG_S) == 1
    b3, c4 = counted(g3t), G4Counts(g4t)
    a = _started(h, keys, _only(h, "pend-g4-a", Locality.REMOTE))
    b = _started(h, keys, h.context())
    _both_scan_and_end(h, keys, a, b)  # A posts to G4; B to G3, A's G4 verdicts pending
    assert _moved(g3t, b3) == (2, 0)
    assert c4() == (4, 0)  # before: (3, 0)


def _uncounted(tier, ctx) -> bool:
    """Whether a chunk the request asked about is not counted yet (its ledger record: :mod:`.tier_ledger`)."""
    r = tier._lookup._ledger._reqs.get(ctx.req_id)
    return r is not None and any(k not in r.done for k in r.ans)


def test_a_pending_hit_is_judged_once_while_no_verdict_of_the_request_changes(tmp_path, harnesses, monkeypatch):
    """G3Tier above G4Tier; G3 holds chunk 1, not chunk 0. A (remote storage only) posts chunks 0-1 to G4, whose
    lookup is held in flight (a gate around G4's real ``batch_lookup``: a slow HEAD); B posts them to G3 and takes
    A's G4 verdicts up. G3 counts B's HIT of chunk 1 itself, found only if chunk 0 is served, which G4's pending
    answer decides: while it is not in, each step's flush judged B's usable prefix again (every key x every tier:
    30 steps, 30 judgements). Now a request is judged only when one of its answers changed (at most the step after
    G3's answers came in); G4's answer settles it: not found, (2, 0). B's scan is deferred meanwhile, so vLLM asks
    its chunks again every step, each answer as before: until 2026-12-03 (review of the ledger) each such answer
    marked B changed, and B was judged every step all the same."""
    calls = []
    real = tier_ledger.Ledger._count

    def spy(self, r, final):  # the real judgement, counted
        calls.append(r.ctx.req_id)
        return real(self, r, final)
    monkeypatch.setattr(tier_ledger.Ledger, "_count", spy)
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")])
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "judged-once")
    h.store(keys[1:], payloads(h, 1, seed=11))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    assert g4t.pool.delete(g4t._block_keys(keys[1], "")).result(timeout=HANG_S)  # G3 only holds chunk 1
    gate, done = _gated(g4t)  # G4's real lookup, in flight until the gate opens (a slow HEAD)
    b3 = counted(g3t)
    a = _started(h, keys, _only(h, "judged-a", Locality.REMOTE))
    b = _started(h, keys, h.context())
    assert ask(h, keys, a) == [LookupResult.RETRY] * 2
    assert ask(h, keys, b) == [LookupResult.RETRY] * 2  # G3: posted; G4: A's, pending
    h.step()
    step_until(lambda: all(g3t._lookup._verdict((k, "")) is not None for k in keys), h)  # G3 answered B
    try:
        calls.clear()
        for _ in range(30):
            assert ask(h, keys[:1], b) == [LookupResult.RETRY]  # B waiting: chunk 0 asked again, still pending
            h.step()
        assert _uncounted(g3t, b)  # B's chunk 1 HIT still waits for chunk 0's G4 verdict
        assert len(calls) <= 2, f"B's usable prefix judged {len(calls)} times in 30 steps"  # before: 30+
    finally:
        gate.set()
    assert done.wait(HANG_S)
    step_until(lambda: not _uncounted(g3t, b), h)  # G4's answer in: B's HIT settled
    for ctx in (a, b):
        h.manager.on_request_finished(ctx)
    h.step()
    assert _moved(g3t, b3) == (2, 0)
