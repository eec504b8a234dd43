"""The native tiers' per-request counting from the answers each request got (``integrations/vllm/tier_ledger.py``,
2026-12-03): each chunk a request looks up counts once, on the tier that answered it, whatever the request did next.

Defects of the counting it replaced (records built up as requests asked: posted, taken up, waiting, counted above,
the usable-prefix memo), each pinned here:
(a) a HIT a request took up from another live request, already answered, counted only when the chunk loaded: with
    the primary tier full vLLM starts no promotion (the manager answers MISS), so the request's lookup was counted
    nowhere;
(b) with three of our tiers over one primary, the middle tier counted a HIT found though the first served the
    chunk (both tiers' hits: ``kvbm_matched_tokens`` twice the tokens loaded);
(c) whether a chunk a tier answered lay in the request's usable prefix was judged from the tiers' live state (a
    tenant revoked after the tier answered HIT made its answers count as misses) instead of the answers given.

Defects of the ledger itself (review of 35463e0, fixed 2026-12-03), pinned below:
(d) a chunk's owner was the first tier in the manager's order that eventually answered HIT, though vLLM's manager
    passes a tier still answering over (RETRY) and loads the chunk from the next tier down that answered HIT, and
    loads from below a HIT another request's failed load forced to a miss: the find went to the tier not read;
(e) a sliding-window group's chunks were judged as a leading prefix, though vLLM scans a window group from its end
    and loads the window it finds there: a window served after an earlier miss counted not found;
(f) every lookup marked the request changed, so a deferred request asked again every step was judged every step
    (test_tiering_lookup_once.py::test_a_pending_hit_is_judged_once_while_no_verdict_of_the_request_changes).

vLLM's real offloading spec and manager (:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`),
real G3 directories, a file:// G4 store, a keyring changed by the ``kvbm-backend keys`` CLI."""
from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import Locality, LookupResult, make_offload_key  # noqa: E402

from kvbm_backend import metrics  # noqa: E402
from tests.helpers.tier_counts import G4Counts, ask, cool_keys, counted, step_until  # noqa: E402
from tests.integrations.vllm import test_tiering, test_tiering_revoked  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, MOD, g3_tier, keys_for, payloads  # noqa: E402
from tests.integrations.vllm.test_tiering_counts import _g4_tier  # noqa: E402
from tests.integrations.vllm.test_tiering_lookup_once import _gated, _only, _started  # noqa: E402
from tests.integrations.vllm.test_tiering_revoked import NEVER_S, _check, _ctx, _keys  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test
kek = test_tiering_revoked.kek  # the fixture: the KEK file beside the keyring, as the CLI finds it


def _moved(tier, before) -> tuple[int, int]:
    return tuple(x - y for x, y in zip(counted(tier), before))


def _matched() -> float:
    return metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0


def _g3_over_g4(tmp_path, harnesses, name: str, n: int, seed: int, **kw):
    """``(h, g3t, g4t, keys)``: a harness (``harnesses(tiers, **kw)``) with a G3Tier (``tmp_path / "g3"``) above a
    G4Tier (``tmp_path / "g4"``), both holding the ``n`` chunks ``keys_for(n, name)`` (payloads of ``seed``), their
    stores done (hang guard :data:`HANG_S` s) and the primary tier emptied."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")], **kw)
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(n, name)
    h.store(keys, payloads(h, n, seed=seed))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    return h, g3t, g4t, keys


def test_a_hit_taken_up_counts_when_answered_though_the_full_primary_starts_no_load(tmp_path, harnesses):
    """(a) G3Tier above G4Tier, G3 holding chunks 0-1. A (local storage only) looks them up on G3 (its answers in,
    no promotion) and stays alive. With the primary tier full (3 chunks pinned by stores in flight) B asks both:
    G3 answers A's cached HITs, vLLM has no room to promote them (MISS) and asks G4 nothing. B's lookup counts on
    G3 as answered: 2 of 2, as A's. Before: (2, 2) in all, B counted nowhere (its HITs waited for a load that never
    came)."""
    h, g3t, g4t, keys = _g3_over_g4(tmp_path, harnesses, "taken-hit", 2, seed=3, chunks=3)
    b3, c4, t0 = counted(g3t), G4Counts(g4t), _matched()
    a = _started(h, keys, _only(h, "taken-hit-a", Locality.LOCAL))
    assert ask(h, keys, a) == [LookupResult.RETRY] * 2
    h.step()
    step_until(lambda: all(g3t.lookup(k, a) is LookupResult.HIT for k in keys), h)  # answered; nothing promoted
    pin = h.context()  # the primary full: 3 chunks whose GPU->primary store is in flight (not evictable)
    h.manager.on_new_request(pin)
    out = h.manager.prepare_store(keys_for(3, "taken-pin"), pin)
    assert out is not None and len(out.keys_to_store) == 3
    b = _started(h, keys, h.context())
    assert ask(h, keys, b) == [LookupResult.MISS] * 2  # G3's (A's) HITs, no room to promote them
    h.step()
    h.manager.complete_store(out.keys_to_store, pin, False)
    for ctx in (pin, a, b):
        h.manager.on_request_finished(ctx)
    h.step()
    assert _moved(g3t, b3) == (4, 4)  # before: (2, 2)
    assert c4() == (0, 0)
    assert _matched() - t0 == 4 * GEO["tokens_per_block"]


def test_with_three_tiers_the_middle_one_counts_nothing_for_a_chunk_the_first_serves(tmp_path, harnesses):
    """(b) Two G3Tiers (different directories) above a G4Tier, in that order; both G3s hold chunks 0-1, G4 cools
    them (its loads failed: it answers misses without asking its store, so the request posts nothing there). The
    request posts both chunks to the first and second G3 and loads them from the first: 2 hits there, none on the
    second (it is asked over no chunk the first served), 32 matched tokens. Before: the second G3 counted 2 found
    hits too (64 tokens for 2 chunks loaded)."""
    h = harnesses([g3_tier(tmp_path / "g3a"), g3_tier(tmp_path / "g3b"), _g4_tier(tmp_path / "g4")])
    first, second, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "three-tiers")
    cool_keys(h, g4t, keys, 600.0)
    data = payloads(h, 2, seed=4)
    h.store(keys, data)  # both G3s store them (G4 skips its cooling chunks)
    h.wait_idle(timeout=HANG_S)
    assert [t.kvbm_stats()["tier"]["chunks_stored"] for t in (first, second)] == [2, 2]
    h.reset_primary()
    b1, b2, c4, t0 = counted(first), counted(second), G4Counts(g4t), _matched()
    got = h.load(keys, timeout=HANG_S)
    assert len(got) == 2 and all(np.array_equal(x, d) for x, d in zip(got, data))
    assert [t.kvbm_stats()["tier"]["chunks_loaded"] for t in (first, second)] == [2, 0]
    h.step()
    assert _moved(first, b1) == (2, 2)
    assert _moved(second, b2) == (0, 0)  # before: (2, 2)
    assert c4() == (0, 0)  # its cooling answers: chunks the first served
    assert _matched() - t0 == 2 * GEO["tokens_per_block"]  # before: 4 chunks' tokens


def test_answers_count_as_given_when_the_tenant_is_revoked_before_the_step_ends(tmp_path, kek, harnesses):
    """(c) G3Tier above G4Tier; the G3Tier follows G4's keyring. G3 holds acme's chunks 0-1; G4 cools them (it
    answers misses without asking its store). A request of acme posts both to G3, which answers HIT, HIT; acme is
    revoked before the step's end counts them. The request was served both answers: G3 counts 2 of 2. Before: the
    usable prefix was judged from G3's live state (acme refused now: chunk 0 not served), so chunk 1 counted not
    found: (2, 1)."""
    kr = str(tmp_path / "keys" / "keyring.json")
    _keys("acme", "create", kr=kr)
    g4 = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
          "g4": {"url": f"file://{tmp_path / 'g4'}", "keyring": {"path": kr, "reload_interval_s": NEVER_S}}}
    h = harnesses([g3_tier(tmp_path / "g3"), g4])
    g3t, g4t = h.manager.secondary_tiers
    assert g3t._revoked is not None  # G3 follows G4's keyring
    keys = keys_for(2, "revoked-after")
    h.store(keys, payloads(h, 2, seed=5), ctx=_ctx(h, "acme"))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    g4t._failed.add("acme", keys)  # G4's loads of them failed: cooling (no verdict of theirs cached to force)
    b3 = counted(g3t)
    r = _started(h, keys, _ctx(h, "acme"))
    assert ask(h, keys, r) == [LookupResult.RETRY] * 2  # G3: posted; G4: cooling, not posted
    h.step()
    end = time.monotonic() + HANG_S
    while not all(g3t._lookup._verdict((k, "acme")) is not None for k in keys):  # G3's answers in, not counted
        assert time.monotonic() < end, "G3 never answered"  # a hang guard
        time.sleep(0.002)
        g3t._lookup.drain_results()
    assert all(g3t._lookup._verdict((k, "acme")) for k in keys)
    _keys("acme", "revoke", kr=kr)
    _check(g3t)
    h.step()  # the step's end: the answers are counted
    h.manager.on_request_finished(r)
    h.step()
    assert _moved(g3t, b3) == (2, 2)  # before: (2, 1)


def _gated_index(tier, monkeypatch) -> threading.Event:
    """Hold ``tier``'s index answers (its pool's ``lookup_prefix``) until the returned gate is set (at most
    :data:`HANG_S` s): the tier answers RETRY meanwhile, as a slow index does."""
    gate = threading.Event()
    real = tier.pool.lookup_prefix

    def gated(keys, request=True):
        f: Future = Future()
        inner = real(keys, request=request)

        def answer():
            gate.wait(HANG_S)
            f.set_result(inner.result(HANG_S))
        threading.Thread(target=answer, daemon=True).start()
        return f
    monkeypatch.setattr(tier.pool, "lookup_prefix", gated)
    return gate


def test_a_chunk_loaded_from_g4_while_g3_was_still_answering_is_g4s_find(tmp_path, harnesses, monkeypatch):
    """(d) G3Tier above G4Tier, both holding chunks 0-1. G3's index is slow to answer (held until the test lets it);
    G4 answers first. vLLM's manager asks G3 (RETRY), then G4 (HIT) and promotes both chunks from G4: G4 loads 2, G3
    none. G3 then answers HIT. The chunks were found on G4: G4 (2, 2); G3 was asked about both and served neither:
    (2, 0), counted when its answers came. Before: G3 (2, 2) and G4 (0, 0), the find credited to the tier not read."""
    h, g3t, g4t, keys = _g3_over_g4(tmp_path, harnesses, "late-g3", 2, seed=7)
    gate = _gated_index(g3t, monkeypatch)
    b3, c4 = counted(g3t), G4Counts(g4t)
    r = _started(h, keys, h.context())
    assert ask(h, keys, r) == [LookupResult.RETRY] * 2  # both tiers posted
    h.step()
    end = time.monotonic() + HANG_S
    while not all(g4t._lookup._verdict((k, "")) for k in keys):  # G4's answers in; G3's held back
        assert time.monotonic() < end, "G4 never answered"  # a hang guard
        time.sleep(0.002)
        g4t._lookup.drain_results()
    assert ask(h, keys, r) == [LookupResult.HIT_PENDING] * 2  # G3 still RETRY: promoted from G4
    step_until(lambda: g4t.kvbm_stats()["tier"]["chunks_loaded"] == 2 and not h.manager.has_pending_work(), h)
    assert ask(h, keys, r) == [LookupResult.HIT] * 2
    assert [t.kvbm_stats()["tier"]["chunks_loaded"] for t in (g3t, g4t)] == [0, 2]
    assert c4() == (2, 2)  # counted when loaded: no wait for G3's answers
    gate.set()  # G3 answers HIT, HIT (late)
    step_until(lambda: all(g3t._lookup._verdict((k, "")) is not None for k in keys), h)
    h.manager.on_request_finished(r)
    h.step()
    got = (_moved(g3t, b3), c4())
    assert got == ((2, 0), (2, 2)), f"(G3, G4) counted {got}: the find went to G3, the chunks were loaded from G4"


def test_a_chunk_loaded_from_g4_after_g3s_hit_was_forced_to_a_miss_is_g4s_find(tmp_path, harnesses):
    """(d) G3Tier above G4Tier, both holding chunk 0; G4's lookup is held in flight (a slow HEAD). R posts the chunk
    to both; G3 answers it HIT. A (local storage only) takes G3's HIT up and loads the chunk from G3, whose block was
    deleted meanwhile: the load fails, G3's verdict is forced to a miss and the chunk cools there. G4 answers R HIT
    and vLLM promotes the chunk from G4 for R. R's find is G4's: G4 (1, 1), G3 asked and not read: R (1, 0), plus A's
    failed load (1, 1, its own HIT owned as answered): G3 (2, 1). Before: R counted on G3 as soon as G3 answered (the
    first HIT in order): G3 (2, 2), G4 (0, 0)."""
    h, g3t, g4t, keys = _g3_over_g4(tmp_path, harnesses, "forced-g3", 1, seed=12)
    gate, done = _gated(g4t)
    b3, c4 = counted(g3t), G4Counts(g4t)
    r = _started(h, keys, h.context())
    try:
        assert ask(h, keys, r) == [LookupResult.RETRY]  # posted to G3 and G4
        h.step()
        step_until(lambda: g3t._lookup._verdict((keys[0], "")) is True, h)  # G3: HIT; G4 still in flight
        assert g3t.pool.delete(g3t._block_keys(keys[0], "")).result(timeout=HANG_S)
        a = _started(h, keys, _only(h, "forced-a", Locality.LOCAL))
        assert ask(h, keys, a) == [LookupResult.HIT_PENDING]  # G3's cached HIT: promoted from G3
        step_until(lambda: g3t.kvbm_stats()["tier"]["chunks_load_failed"] == 1, h)
    finally:
        gate.set()
    assert done.wait(HANG_S)
    step_until(lambda: g4t._lookup._verdict((keys[0], "")) is True, h)
    assert ask(h, keys, r) == [LookupResult.HIT_PENDING]  # G3 cooling (a miss): promoted from G4
    step_until(lambda: g4t.kvbm_stats()["tier"]["chunks_loaded"] == 1 and not h.manager.has_pending_work(), h)
    assert ask(h, keys, r) == [LookupResult.HIT]
    for ctx in (a, r):
        h.manager.on_request_finished(ctx)
    h.step()
    got = (_moved(g3t, b3), c4())
    assert got == ((2, 1), (1, 1)), f"(G3, G4) counted {got}: R's chunk was loaded from G4"


def test_a_sliding_window_run_loaded_after_an_earlier_miss_counts_found(tmp_path, harnesses):
    """(e) One G3Tier; a hybrid model's sliding-window group (group 1: vLLM records every group's key positions,
    ``update_offload_keys``, and scans a window group from its end, ``_sliding_window_lookup``). The request's
    window group has chunks 0-3 (positions 16..64), G3 holds 2-3 (0-1 evicted), the window is 2 chunks. Step 1
    posts all four (RETRY); step 2 finds 3 and 2 on G3, promotes them and stops (the window is complete): vLLM loads
    and uses chunks 2-3. G3 found 2 of the 4 asked. Before: (4, 0), the usable prefix (per group in position order)
    ended at chunk 0, so the two chunks loaded from G3 counted as not found (kvbm_matched_tokens +0)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    g3t = h.tier
    keys = [make_offload_key(hashlib.sha256(f"sw:{i}".encode()).digest(), 1) for i in range(4)]
    h.store(keys[2:], payloads(h, 2, seed=9))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    b3 = counted(g3t)
    r = h.context()
    for i, k in enumerate(keys):
        r.set_offload_key_position(k, 16 * (i + 1))
    h.manager.on_new_request(r)
    assert ask(h, keys[::-1], r) == [LookupResult.RETRY] * 4  # the window scan, from the end
    h.step()
    step_until(lambda: all(g3t._lookup._verdict((k, "")) is not None for k in keys), h)
    assert ask(h, keys[:1:-1], r) == [LookupResult.HIT_PENDING] * 2  # chunks 3, 2: the window, promoted
    step_until(lambda: g3t.kvbm_stats()["tier"]["chunks_loaded"] == 2 and not h.manager.has_pending_work(), h)
    assert ask(h, keys[:1:-1], r) == [LookupResult.HIT] * 2
    h.manager.on_request_finished(r)
    h.step()
    got = _moved(g3t, b3)
    assert got == (4, 2), f"G3 counted {got} for a window of 2 chunks it served"


def test_a_window_group_counts_found_only_the_window_vllm_loads(tmp_path, harnesses):
    """(e) One G3Tier holding all 4 chunks of a window group (group 1, positions 16..64), the window 2 chunks. Step 1
    posts all four (RETRY); step 2 finds 3 and 2, promotes them and stops: vLLM loads chunks 2-3 and never needs
    0-1 (below the window). G3: 4 asked, 2 found (the 2 loaded), and a full-attention group's count is unchanged:
    the same chunks of group 0 asked in ascending order (a prefix) count 4 found."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    g3t = h.tier
    win = [make_offload_key(hashlib.sha256(f"sw-all:{i}".encode()).digest(), 1) for i in range(4)]
    full = [make_offload_key(hashlib.sha256(f"sw-all:{i}".encode()).digest(), 0) for i in range(4)]
    h.store(full + win, payloads(h, 8, seed=10))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    b3 = counted(g3t)
    r = h.context()
    for i in range(4):
        r.set_offload_key_position(full[i], 16 * (i + 1))
        r.set_offload_key_position(win[i], 16 * (i + 1))
    h.manager.on_new_request(r)
    assert ask(h, full + win[::-1], r) == [LookupResult.RETRY] * 8  # the prefix scan, then the window's
    h.step()
    step_until(lambda: all(g3t._lookup._verdict((k, "")) is not None for k in full + win), h)
    assert ask(h, full + win[:1:-1], r) == [LookupResult.HIT_PENDING] * 6  # group 0: 4; window: chunks 3, 2
    step_until(lambda: g3t.kvbm_stats()["tier"]["chunks_loaded"] == 6 and not h.manager.has_pending_work(), h)
    h.manager.on_request_finished(r)
    h.step()
    got = _moved(g3t, b3)
    assert got == (8, 6), f"G3 counted {got}: group 0's 4 chunks and the window's 2 loaded"

