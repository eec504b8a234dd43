"""Found in review (2026-12-03), fixed in ``integrations/vllm/tier_lookup.py`` (``tier_pickups.py``, removed: since
2026-12-03 counted by ``tier_ledger.py``): the native tiers counted a request's lookup (``kvbm_matched_tokens``, the
pools' ``lookup_hits``, the hit rate) only in ``TenantLookup.batch_lookup``, which vLLM's ``AsyncLookupManager``
calls for the keys a request posts. A key whose verdict is cached (another live request asked it first) is answered
from the cache and never posted, so a request served from G3 on such verdicts was not counted at all. Now a request
counts the verdicts it takes up once, each on the tier whose verdict it took."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend import metrics  # noqa: E402
from tests.integrations.vllm import test_tiering  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]
harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test


def test_a_request_served_from_g3_on_a_cached_verdict_counts_its_matched_tokens(tmp_path, harnesses):
    """A looks G3's 4 chunks up (counted: 64 tokens) and stays alive; the primary is emptied (vLLM's reset_cache: sleep,
    weight update) and B asks for the same chunks: answered from A's cached HIT verdicts, promoted from G3 and loaded.
    B's 4 chunks count as A's did (before the fix: 0, matched tokens and G3's lookup hits unmoved)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    keys, data = keys_for(4, "cached"), payloads(h, 4)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()

    def matched() -> float:
        return metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0

    t0 = matched()
    _, n = h.promote(keys, timeout=HANG_S)  # A: looked up and promoted from G3; A stays alive (its verdicts cached)
    assert n == 4 and matched() - t0 == 4 * GEO["tokens_per_block"]
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    t1, hits = matched(), h.tier.pool.stats()["lookup_hits"]
    got = h.load(keys, timeout=HANG_S)  # B: served from G3 again, on A's cached verdicts
    assert len(got) == 4 and all(np.array_equal(a, b) for a, b in zip(got, data))
    assert h.tier.kvbm_stats()["tier"]["chunks_loaded"] == 8  # both requests loaded their 4 chunks from G3
    assert (matched() - t1, h.tier.pool.stats()["lookup_hits"] - hits) == (4 * GEO["tokens_per_block"], 4)


def test_a_shared_verdict_counts_once_per_request_however_often_it_is_asked(tmp_path, harnesses):
    """A and B ask G3's tier for the same 4 stored chunks in one step (A posts them, B shares A's pending verdicts),
    then each asks again over several steps: each request counts its 4 chunks once (64 tokens and 4 lookup hits
    each), however often it asks. Before the fix B's (shared, never posted) counted 0."""
    from vllm.v1.kv_offload.base import LookupResult

    h = harnesses([g3_tier(tmp_path / "g3")])
    keys = keys_for(4, "shared")
    h.store(keys, payloads(h, 4))
    h.wait_idle(timeout=HANG_S)
    tier, a, b = h.tier, h.context(), h.context()
    t0, hits = metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0, tier.pool.stats()["lookup_hits"]
    assert [tier.lookup(k, a) for k in keys] == [LookupResult.RETRY] * 4  # posted by A
    assert [tier.lookup(k, b) for k in keys] == [LookupResult.RETRY] * 4  # shared by B, not posted
    h.step()
    for _ in range(int(HANG_S / 0.001)):  # a hang guard: the worker answers A's posted batch
        if tier.lookup(keys[0], a) is not LookupResult.RETRY:
            break
        time.sleep(0.001)
        h.step()  # drains the answers in at the next lookup
    for _ in range(3):
        assert [tier.lookup(k, a) for k in keys] == [LookupResult.HIT] * 4
        assert [tier.lookup(k, b) for k in keys] == [LookupResult.HIT] * 4
        h.step()
    moved = (metrics.sample_value(None, "kvbm_matched_tokens_total") or 0.0) - t0
    assert (moved, tier.pool.stats()["lookup_hits"] - hits) == (2 * 4 * GEO["tokens_per_block"], 8)
    for ctx in (a, b):
        tier.on_request_finished(ctx)  # asked the tier directly: the manager never saw them
