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

vLLM's real offloading spec and manager (:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`),
real G3 directories, a file:// G4 store, a keyring changed by the ``kvbm-backend keys`` CLI."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import Locality, LookupResult  # noqa: E402

from kvbm_backend import metrics  # noqa: E402
from tests.helpers.tier_counts import G4Counts, ask, cool_keys, counted, step_until  # noqa: E402
from tests.integrations.vllm import test_tiering, test_tiering_revoked  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, MOD, g3_tier, keys_for, payloads  # noqa: E402
from tests.integrations.vllm.test_tiering_counts import _g4_tier  # noqa: E402
from tests.integrations.vllm.test_tiering_lookup_once import _only, _started  # noqa: E402
from tests.integrations.vllm.test_tiering_revoked import NEVER_S, _check, _ctx, _keys  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test
kek = test_tiering_revoked.kek  # the fixture: the KEK file beside the keyring, as the CLI finds it


def _moved(tier, before) -> tuple[int, int]:
    return tuple(x - y for x, y in zip(counted(tier), before))


def _matched() -> float:
    return metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0


def test_a_hit_taken_up_counts_when_answered_though_the_full_primary_starts_no_load(tmp_path, harnesses):
    """(a) G3Tier above G4Tier, G3 holding chunks 0-1. A (local storage only) looks them up on G3 (its answers in,
    no promotion) and stays alive. With the primary tier full (3 chunks pinned by stores in flight) B asks both:
    G3 answers A's cached HITs, vLLM has no room to promote them (MISS) and asks G4 nothing. B's lookup counts on
    G3 as answered: 2 of 2, as A's. Before: (2, 2) in all, B counted nowhere (its HITs waited for a load that never
    came)."""
    h = harnesses([g3_tier(tmp_path / "g3"), _g4_tier(tmp_path / "g4")], chunks=3)
    g3t, g4t = h.manager.secondary_tiers
    keys = keys_for(2, "taken-hit")
    h.store(keys, payloads(h, 2, seed=3))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
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
