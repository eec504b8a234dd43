"""Lookup counters and steps shared by the native-tier counting tests (tests/integrations/vllm/
test_tiering_lookup_once.py, test_tiering_cooling_counts.py, test_tiering_load_credit.py): G3Tier / G4Tier under
vLLM's real offloading manager (:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`).

``counted(tier)`` is a tier's pool lookup counters, ``G4Counts(tier)`` G4's request lookups counted since it was
made (from its hit-rate window), ``ask(h, keys, ctx)`` the manager's answers, ``step_until(cond, h)`` steps the
manager until ``cond()`` holds, ``cool_keys(h, tier, keys, cooldown_s)`` makes a tier's load of ``keys`` fail so
they cool. Import it after ``pytest.importorskip("vllm...")``: it imports vLLM."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvbm_backend.integrations.vllm.failed_blocks import FailedChunks
from kvbm_backend.integrations.vllm.tier_base import offload_key_hash

HANG_S = 600.0  # a hang guard, not a bound: the waits return as soon as what must come came


def counted(tier) -> tuple[int, int]:
    """The tier's pool request lookup counters: ``(lookup_blocks, lookup_hits)`` (its hit rate's denominator,
    numerator), 0 where not counted yet."""
    s = tier.pool.stats()
    return s.get("lookup_blocks", 0), s.get("lookup_hits", 0)


class G4Counts:
    """G4's request lookups counted since construction: ``(requested, found)`` chunks, summed over its hit-rate
    window's new entries (one per counted lookup: ``lookups`` moves by one each)."""

    def __init__(self, tier) -> None:
        self.tier, self.n0 = tier, tier.pool.stats().get("lookups", 0)

    def __call__(self) -> tuple[int, int]:
        k = self.tier.pool.stats().get("lookups", 0) - self.n0
        new = list(self.tier.pool.metrics.hit_rate._win)[-k:] if k else []
        assert len(new) == k
        return sum(r for r, _ in new), sum(f for _, f in new)


def ask(h, keys, ctx) -> list:
    """vLLM's manager's lookup of each of ``keys`` for request ``ctx``: the ``LookupResult`` list, in order."""
    return [h.manager.lookup(k, ctx) for k in keys]


def step_until(cond: Callable[[], bool], h) -> None:
    """Step the harness ``h`` until ``cond()`` (a hang guard, not a bound: fails after :data:`HANG_S` seconds)."""
    end = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < end, "never came"
        h.step()
        time.sleep(0.001)


def cool_keys(h, tier, keys, cooldown_s: float) -> None:
    """Make ``tier`` fail a load of ``keys`` (the default tenant's; the tier does not hold them), so they cool for
    ``cooldown_s`` seconds: the tier answers their lookups misses without asking its pool meanwhile. The tier's
    failed-chunk record is a real :class:`FailedChunks` with that cool-down (the default, 30 s, is the connector's).
    Fails (AssertionError) if the load does not end failed within :data:`HANG_S` s or a key is not cooling."""
    tier._failed = FailedChunks(offload_key_hash, cooldown_s=cooldown_s)
    tier.submit_load(TransferJob(990, keys, np.arange(len(keys)), True, h.context()))
    end = time.monotonic() + HANG_S
    while not any(r.job_id == 990 and not r.success for r in tier.get_finished_jobs()):
        assert time.monotonic() < end, "the load never ended"
        time.sleep(0.002)
    assert all(tier._failed.cooling("", k) for k in keys)
