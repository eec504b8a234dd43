"""The native tiers' WARNING for a failed job (:mod:`kvbm_backend.integrations.vllm.tier_base`): one line per tier and
kind per minute (:class:`kvbm_backend.log_limits.LimitedLog`), every job still counted. docs/operations.md "Logs an
operator sees": a condition met per request is logged once per state change, never once per request. Before, a
stalled pool (a drive whose syncs hang, a hanging G4 endpoint) logged one WARNING for every job that passed its
``job_timeout_s``: the log grew at the rate vLLM cascades chunks for as long as the stall lasted.

Through vLLM's real tiering manager over a real G3 pool whose ``fdatasync`` is held on an event (test_tiering_jobs's
slow disk). No duration is asserted, and the outcome does not depend on when threads run: the jobs' ``job_timeout_s``
is a hang guard, each job's deadline passes when the test moves it to the present as its puts are out (the pool
waiting on the held sync), and the limiter's minute runs on a clock the test moves (before 2026-12-04 a 0.5 s bound
had to outlast a store thread's pick-up, else the job failed queued and the sync was never reached, and the five
failures had to fall within one real minute)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend.integrations.vllm.tier_base import log as tier_log  # noqa: E402
from kvbm_backend.log_limits import LOG_EVERY_S, LimitedLog  # noqa: E402
from tests.integrations.vllm.test_tiering import HANG_S, g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401
from tests.integrations.vllm.test_tiering_jobs import _held_fdatasync  # noqa: E402

pytestmark = [pytest.mark.vllm]

JOBS = 5
JOB_TIMEOUT_S = HANG_S  # the jobs' bound as configured: never reached by itself; the test passes each deadline


def test_jobs_failing_in_a_stall_log_one_warning_and_count_every_job(tmp_path, harnesses, monkeypatch, caplog):  # noqa: F811
    """``JOBS`` cascades while G3's sync is held: each fails at its deadline, passed while its puts wait for the
    pool, and is counted, but the tier logs one WARNING for them (naming the bound), not one per job. A minute later
    on the limiter's clock, one more failed job logs the next line, which says how many were counted, not logged."""
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=JOB_TIMEOUT_S)])
    tier = h.tier
    now = [0.0]  # the limiter's clock: every failure below falls in one window however slowly the host runs
    monkeypatch.setattr(tier, "_warn", LimitedLog(tier_log, clock=lambda: now[0]), raising=False)
    real_wait = tier._tasks.wait

    def wait(job, futs, complete):  # a store's puts are out (the pool holds them on the sync): its deadline passes
        job.deadline.at = time.monotonic()
        real_wait(job, futs, complete)
    monkeypatch.setattr(tier._tasks, "wait", wait)
    inside, release = _held_fdatasync(monkeypatch)
    try:
        with caplog.at_level("WARNING", logger=tier_log.name):
            for i in range(JOBS):
                h.store(keys_for(2, f"stall{i}"), payloads(h, 2, seed=i))
            assert inside.wait(HANG_S), "no cascade reached the pool's fdatasync"
            h.wait_idle(HANG_S)  # every job failed at its deadline while the sync is held
            first = [r.getMessage() for r in caplog.records if "chunks) failed: " in r.getMessage()]
            now[0] += LOG_EVERY_S  # the next minute: the next failure is logged, naming those left out
            h.store(keys_for(2, "stall-next"), payloads(h, 2, seed=JOBS))
            h.wait_idle(HANG_S)
            still_held = not release.is_set()
    finally:
        release.set()
    assert still_held
    st = tier.kvbm_stats()["tier"]
    assert (st["stores"], st["stores_failed"]) == (JOBS + 1, JOBS + 1), st
    assert len(first) == 1, f"{len(first)} WARNING lines for {JOBS} jobs failed by one stall: {first}"
    lines = [r.getMessage() for r in caplog.records if "chunks) failed: " in r.getMessage()]
    assert len(lines) == 2, lines
    assert all(f"no answer from the pool within job_timeout_s ({JOB_TIMEOUT_S:g} s)" in ln and "store of 2 chunks" in ln
               for ln in lines), lines
    assert f"({JOBS - 1} more like it in the last {LOG_EVERY_S:.0f} s were counted, not logged" in lines[1], lines
