"""A native tier's load job whose ``job_timeout_s`` passes while a later piece of it is still being read
(:meth:`~kvbm_backend.integrations.vllm.tier_base.KvbmSecondaryTier._run_load_held`). The chunks of the pieces the
pool verified by then are already in the primary tier: they are reported loaded (``JobResult.successful_keys``, the
module doc of :mod:`kvbm_backend.integrations.vllm.tiering`) and are not cooled; only the late ones fail (a miss,
cooled as any late chunk). Before, the deadline raised out of the job: it failed whole, the verified chunks were
thrown away and cooled for 30 s, and every new request of that prefix recomputed chunks G3 held intact.

Real parts: the tier under vLLM's real offloading spec (:class:`~kvbm_backend.integrations.vllm.tiering_harness.
TieringHarness`), a real G3 pool; the slow disk is the pool's I/O engine holding one read submission (the load's
thread is held inside it until the job's deadline has passed, an ordering guard, and the read it submits answers
only when the test ends). No duration is asserted."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvbm_backend.integrations.vllm.tiering import G3Tier  # noqa: E402
from tests.integrations.vllm.test_tiering import (CHUNK, HANG_S, g3_tier, harnesses, keys_for,  # noqa: E402,F401
                                                  payloads)

pytestmark = [pytest.mark.vllm]

TIMEOUT_S = 3.0  # the job's bound: its thread takes it up well within; it passes while the test holds that thread


def test_a_load_past_its_deadline_keeps_the_chunks_verified_before_it(tmp_path, harnesses, monkeypatch, caplog):  # noqa: F811
    """Two chunks in G3, loaded in one job of two pieces (one chunk each). Piece 0 is read and verified; the load's
    thread is held submitting piece 1's read until the job's deadline has passed, and that read never answers while
    the test runs. The job fails, but chunk 0 is reported loaded (its bytes in the primary) and is not cooling;
    chunk 1 failed and cools. Counted: one load, one chunk loaded, one failed; the WARNING names the bound."""
    monkeypatch.setattr(G3Tier, "piece_bytes", CHUNK)  # one pool.get per chunk
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=TIMEOUT_S)])
    tier, pool = h.tier, h.tier.pool
    keys, data = keys_for(2, "late-piece"), payloads(h, 2, seed=21)
    h.store(keys, data)
    h.wait_idle(HANG_S)
    h.reset_primary()
    gets: list[Future] = []  # the futures of the load's pool.get calls, one per piece (observed, unchanged)
    real_get = pool.get
    monkeypatch.setattr(pool, "get", lambda bkeys, out: gets.append(real_get(bkeys, out)) or gets[-1])

    engine, real_submit = pool.engine, pool.engine.submit
    reads = [0]
    in_second, go_on, answer = threading.Event(), threading.Event(), threading.Event()

    def submit(ops):
        ops = list(ops)
        if not ops or ops[0].write:
            return real_submit(ops)
        reads[0] += 1
        if reads[0] != 2:  # piece 0 (and anything later): the disk as it is
            return real_submit(ops)
        in_second.set()  # the load's thread, inside piece 1's get: held here past the job's deadline
        go_on.wait(HANG_S)
        out: Future = Future()

        def later():  # piece 1's read answers only when the test is done with the job
            answer.wait(HANG_S)
            try:
                out.set_result(real_submit(ops).result())
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
        threading.Thread(target=later, daemon=True).start()
        return out

    monkeypatch.setattr(engine, "submit", submit)
    rows = [5, 6]
    h.primary[rows] = 0
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            tier.submit_load(TransferJob(901, keys, np.array(rows), True, h.context()))
            passed = time.monotonic() + TIMEOUT_S  # the job's deadline is no later than this
            assert in_second.wait(HANG_S), "the load never asked for its second piece"
            assert gets[0].result(HANG_S).ok == [True]  # piece 0 read and verified (its get resolved)
            end = time.monotonic() + HANG_S
            while time.monotonic() <= passed:  # an ordering guard, no bound: the job is now past its deadline
                time.sleep(0.01)
            go_on.set()
            done = []
            while not done:
                assert time.monotonic() < end, "load 901 never finished"
                done = [r for r in tier.get_finished_jobs() if r.job_id == 901]
                time.sleep(0.002)
    finally:
        go_on.set()
        answer.set()
    res = done[0]
    assert not res.success
    assert list(res.successful_keys or ()) == keys[:1], \
        f"the chunk verified before the deadline was not reported loaded: successful_keys={res.successful_keys}"
    np.testing.assert_array_equal(h.primary[rows[0], :h.chunk_bytes], data[0])
    assert not tier._failed.cooling("", keys[0]), "the chunk verified before the deadline is cooling"
    assert tier._failed.cooling("", keys[1])
    st = tier.kvbm_stats()["tier"]
    assert (st["loads"], st["loads_failed"], st["chunks_loaded"], st["chunks_load_failed"]) == (1, 1, 1, 1), st
    assert f"job_timeout_s ({TIMEOUT_S:g} s)" in caplog.text and "load of 2 chunks" in caplog.text, caplog.text
