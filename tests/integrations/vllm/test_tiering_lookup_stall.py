"""Never stall prefill (docs/invariants.md #3): while the G3 pool cannot answer lookups (its lock held across a
journal write on a stalled drive), requests posted together, or in consecutive steps, cost about one
``job_timeout_s`` in RETRY, not one each. vLLM's ``AsyncLookupManager`` worker runs a batch's requests one after
another; before 2026-12-01 each had its own ``job_timeout_s`` and asked the pool (review repro t1: 6 requests,
2 s: each resolved after 12 s; 8 at the default 60 s: 8 minutes). Now a batch has one deadline from when it was
posted, and after a timed-out lookup the tier answers misses without asking the pool until it answered.

No durations are asserted: the pool's own ``lookups_deferred`` counts the lookups handed to it while its lock was
held, and the verdicts must all arrive while the journal write is still held (``GUARD_S`` is a hang guard)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from tests.integrations.vllm.test_tiering import g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401
from tests.integrations.vllm.test_tiering_lock_stall import GUARD_S, _stall_a_delete  # noqa: E402

pytestmark = [pytest.mark.vllm]

N = 6


@pytest.mark.parametrize("arrival", ["one_step", "step_by_step"])
def test_requests_posted_while_the_pool_lock_is_held_ask_the_pool_once(tmp_path, harnesses,  # noqa: F811
                                                                       monkeypatch, arrival):
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=1.0)])
    tier, pool = h.tier, h.tier.pool
    held = keys_for(1, "held")
    h.store(held, payloads(h, 1))
    h.wait_idle(timeout=GUARD_S)
    reqs = []
    for i in range(N):
        ctx = h.context(f"r{i}")
        h.manager.on_new_request(ctx)
        ks = keys_for(2, f"req{i}")
        for j, k in enumerate(ks):
            ctx.set_offload_key_position(k, j + 1)
        reqs.append((ctx, ks))
    deferred0 = pool.stats()["lookups_deferred"]
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(held[0], ""))
    try:
        for ctx, ks in reqs:
            assert [h.manager.lookup(k, ctx) for k in ks] == [LookupResult.RETRY] * 2
            if arrival == "step_by_step":
                h.step()
        h.step()
        verdicts: dict[str, LookupResult] = {}
        end = time.monotonic() + GUARD_S
        while len(verdicts) < N and time.monotonic() < end:  # hang guard only
            for ctx, ks in reqs:
                r = h.manager.lookup(ks[0], ctx)
                if r is not LookupResult.RETRY:
                    verdicts[ctx.req_id] = r
            h.step()
            time.sleep(0.01)
        still_held = not hold.released.is_set() and pool.cat.lock.locked()
        asked = pool.stats()["lookups_deferred"] - deferred0
    finally:
        hold.release()
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    assert verdicts == {ctx.req_id: LookupResult.MISS for ctx, _ in reqs}, verdicts
    assert still_held  # every verdict came while the journal write still held the pool's lock
    # one lookup handed to the stalled pool (a second at most: a probe once the back-off ended), not one per request
    assert asked <= 2, f"{asked} lookups waited for the pool's lock for {N} requests"
    st = tier.kvbm_stats()["tier"]
    assert 1 <= st["lookups_timed_out"] <= asked and st["lookups_not_asked"] >= N - asked, st
    for ctx, _ in reqs:
        h.manager.on_request_finished(ctx)
