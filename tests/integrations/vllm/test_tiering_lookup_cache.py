"""The native tiers' cached lookup verdicts never hide a chunk the tier holds and serves (docs/invariants.md #3, and
the KV events must match what is served): vLLM's ``AsyncLookupManager`` keeps a verdict while any live request
refers to the key. Before 2026-12-01 a request that missed a prefix and stored it kept that miss cached for its
whole life: the tier published the chunks stored (the router steered the prefix here) and answered every later
request a miss (review, 2026-12-01: 0 of 4 chunks served to 3 requests while the first lived); a miss forced by a
failed load outlived the tier's cool-down the same way.

Driven through vLLM's real tiering manager (:mod:`.test_tiering`'s harness) over a real G3 pool; no durations are
asserted (``HANG_S`` is a hang guard)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult, Medium  # noqa: E402

from kvbm_backend.integrations.vllm.failed_blocks import FailedChunks  # noqa: E402
from kvbm_backend.integrations.vllm.tiering import offload_key_hash  # noqa: E402
from tests.integrations.vllm.test_tiering import (HANG_S, _resolve, g3_tier, harnesses, keys_for,  # noqa: E402,F401
                                                  payloads)

pytestmark = [pytest.mark.vllm]


def test_a_chunk_stored_while_a_request_that_missed_it_lives_is_served_to_later_requests(tmp_path, harnesses):  # noqa: F811
    """R1 finds G3 empty (its miss cached while it lives), the prefix is offloaded and G3 publishes it stored:
    requests after that are served every chunk from G3 while R1 still lives (before: 0 of 4, recomputed)."""
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    keys, data = keys_for(4, "p"), payloads(h, 4)
    r1 = h.context("r1-long")
    h.manager.on_new_request(r1)
    assert h.lookup_prefix(keys, r1, timeout=HANG_S) == 0  # G3 empty: R1's miss, cached while R1 lives
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    stored = sorted(k for e in h.manager.take_events() if e.medium is Medium.STORAGE and not e.removed
                    for k in e.keys)
    assert stored == sorted(keys)  # published stored: the router steers this prefix here
    h.reset_primary()  # the CPU tier lost them: G3 must serve
    for i in range(2):
        got = h.load(keys, h.context(f"r{i + 2}"), timeout=HANG_S)
        assert len(got) == 4, f"request {i + 2} while R1 lives: {len(got)} of 4 chunks served"
        assert all(np.array_equal(a, b) for a, b in zip(got, data))
        h.reset_primary()
    h.manager.on_request_finished(r1)
    assert not h.tier._lookup._recheck  # nothing left to ask again once the request is gone


def test_a_failed_loads_miss_ends_with_its_cool_down_while_a_request_holding_the_verdict_lives(tmp_path, harnesses,  # noqa: F811
                                                                                                monkeypatch):
    """A load that timed out (the disk answered no read: the slot stays, its bytes good) forces the chunk's cached
    verdict to a miss and cools it; a request holding that verdict lives on. Once the cool-down ended a new request
    is served the chunk (before: the forced miss stayed cached while that request lived)."""
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=0.5)])
    tier = h.tier
    tier._failed = FailedChunks(offload_key_hash, cooldown_s=1.0)  # the real cool-down, shorter
    keys, data = keys_for(1, "f"), payloads(h, 1, seed=3)
    h.store(keys, data)
    h.wait_idle(timeout=HANG_S)
    live = h.context("live")
    tier.on_new_request(live)
    assert _resolve(tier, live, keys)[keys[0]] is LookupResult.HIT  # cached while ``live`` lives
    engine, real_submit = tier.pool.engine, tier.pool.engine.submit
    reads = threading.Event()

    def held_submit(ops):  # the disk answers no read until the load timed out
        ops = list(ops)
        if not ops or ops[0].write:
            return real_submit(ops)
        out: Future = Future()

        def later():
            reads.wait(HANG_S)
            try:
                out.set_result(real_submit(ops).result())
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
        threading.Thread(target=later, daemon=True).start()
        return out

    monkeypatch.setattr(engine, "submit", held_submit)
    h.reset_primary()
    try:
        assert h.load(keys, h.context("failed"), timeout=HANG_S) == []
    finally:
        reads.set()
    monkeypatch.setattr(engine, "submit", real_submit)
    assert tier.kvbm_stats()["tier"]["chunks_load_failed"] == 1
    assert tier.lookup(keys[0], live) is LookupResult.MISS  # forced (no promotion livelock)
    end = time.monotonic() + HANG_S
    while tier._failed.cooling("", keys[0]):  # hang guard only
        assert time.monotonic() < end, "the cool-down never ended"
        time.sleep(0.05)
    got = h.load(keys, h.context("after"), timeout=HANG_S)
    assert len(got) == 1 and np.array_equal(got[0], data[0]), "the forced miss outlived the cool-down"
    tier.on_request_finished(live)


def test_keys_to_ask_again_of_requests_that_ended_in_flight_are_forgotten(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """50 times: a request's lookup of a chunk is in flight (the pool answers when the test lets it), a store of
    that chunk finishes meanwhile (its cached miss is to be asked again), and the request ends before the answer.
    Once vLLM drops the verdict (its answer came, no request holds it), the tier forgets the key: none is kept
    (review 2026-12-02: all 50 kept for good, one per such race)."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    tier, lk = h.tier, h.tier._lookup
    gate = threading.Event()
    real = tier.pool.lookup_prefix

    def gated(keys, request=True):  # the pool answers once the test opens the gate (a busy index)
        f: Future = Future()
        inner = real(keys, request=request)

        def answer():
            gate.wait(HANG_S)
            f.set_result(inner.result(HANG_S))
        threading.Thread(target=answer, daemon=True).start()
        return f
    monkeypatch.setattr(tier.pool, "lookup_prefix", gated)
    for i, k in enumerate(keys_for(50, "gone")):
        gate.clear()
        ctx = h.context(f"r{i}")
        tier.on_new_request(ctx)
        assert tier.lookup(k, ctx) is LookupResult.RETRY  # posted with the next flush
        lk.flush()  # in flight: the worker waits for the pool
        lk.stored([k], "")  # a store job of the chunk finished meanwhile
        tier.on_request_finished(ctx)  # the request ends (aborted) before the answer
        gate.set()
        deadline = time.monotonic() + HANG_S  # hang guard: the answer comes, the next flush drops the verdict
        while (k, "") in lk._lookup_state and time.monotonic() < deadline:
            time.sleep(0.005)
            lk.flush()
        assert (k, "") not in lk._lookup_state
    assert len(lk._recheck) == 0, f"{len(lk._recheck)} keys kept to ask again for requests long gone"
