"""The native tiers' WARNING for a failed job (:mod:`kvbm_backend.integrations.vllm.tier_base`): one line per tier and
kind per minute (:class:`kvbm_backend.log_limits.LimitedLog`), every job still counted. docs/operations.md "Logs an
operator sees": a condition met per request is logged once per state change, never once per request. Before, a
stalled pool (a drive whose syncs hang, a hanging G4 endpoint) logged one WARNING for every job that passed its
``job_timeout_s``: the log grew at the rate vLLM cascades chunks for as long as the stall lasted.

Through vLLM's real tiering manager over a real G3 pool whose ``fdatasync`` is held on an event (test_tiering_jobs's
slow disk): the jobs pass their deadline while it is held; no duration is asserted."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from tests.integrations.vllm.test_tiering import g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401
from tests.integrations.vllm.test_tiering_jobs import GUARD_S, _held_fdatasync  # noqa: E402

pytestmark = [pytest.mark.vllm]

JOBS = 5


def test_jobs_failing_in_a_stall_log_one_warning_and_count_every_job(tmp_path, harnesses, monkeypatch, caplog):  # noqa: F811
    """``JOBS`` cascades while G3's sync is held: each fails at its ``job_timeout_s`` (0.5 s) and is counted, but the
    tier logs one WARNING per reason for them (naming the bound), not one per job: a job a busy host's store thread
    took up only past its deadline fails as queued, the other reason, so at most two lines."""
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=0.5)])
    tier = h.tier
    inside, release = _held_fdatasync(monkeypatch)
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            for i in range(JOBS):
                h.store(keys_for(2, f"stall{i}"), payloads(h, 2, seed=i))
            assert inside.wait(GUARD_S), "no cascade reached the pool's fdatasync"
            h.wait_idle(GUARD_S)  # every job fails at its deadline while the sync is held
            still_held = not release.is_set()
    finally:
        release.set()
    assert still_held
    st = tier.kvbm_stats()["tier"]
    assert (st["stores"], st["stores_failed"]) == (JOBS, JOBS), st
    lines = [r.getMessage() for r in caplog.records if "chunks) failed: " in r.getMessage()]
    assert 1 <= len(lines) <= 2, f"{len(lines)} WARNING lines for {JOBS} jobs failed by one stall: {lines}"
    assert all("job_timeout_s (0.5 s)" in ln and "store of 2 chunks" in ln for ln in lines), lines
