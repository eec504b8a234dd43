"""A big G3 report (a worker's snapshot of its whole index) is applied with the scheduler-side locks released
between chunks, so the scheduler's step (KV events ``take``, G3 lookups) is not held for the whole report.

Review finding (2026-12-01): ``G3KvEvents.apply`` held its lock across a 1M-block snapshot (0.3 s; a re-snapshot
at 300k published blocks 1.2 s) and ``G3Mirror.apply`` its lock (0.4 s), every scheduler step waiting.
``benchmarks/report_lock_holds.py`` gives the longest hold beside each operation's whole time."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
from kvbm_backend.pool.g3.index import tag_of


class _SeenAtRelease:
    """A lock that records ``probe()`` each time it is released (what another thread could see then)."""

    def __init__(self, probe):
        self._l, self.probe, self.seen = threading.Lock(), probe, []

    def __enter__(self):
        self._l.acquire()

    def __exit__(self, *exc):
        self.seen.append(self.probe())
        self._l.release()


def _snapshot(rank: int, n: int) -> KvbmWorkerMeta:
    t = tag_of("")
    return KvbmWorkerMeta(added=[(t, rank, (i * 0x9E3779B97F4A7C15 + 7) & (2**64 - 1)) for i in range(n)],
                          snapshot=True)


def test_the_mirror_applies_a_snapshot_in_chunks_between_which_lookups_get_the_lock():
    from kvbm_backend.integrations.vllm.g3_mirror import APPLY_CHUNK, G3Mirror
    m = G3Mirror(SimpleNamespace(fingerprint="f" * 16, layout=SimpleNamespace(page_size=16), tp_world_size=1))
    n = 3 * APPLY_CHUNK + 5
    lock = m._lock = _SeenAtRelease(lambda: len(m._set))
    m.apply(_snapshot(0, n), rank=0)
    assert len(m) == n and m.ready
    partial = [s for s in lock.seen if 0 < s < n]
    assert len(partial) >= 3, lock.seen  # released with 1, 2 and 3 chunks applied (before 2026-12-02: never)


def test_kv_events_apply_a_snapshot_in_chunks_between_which_take_gets_the_lock():
    pytest.importorskip("vllm")
    from kvbm_backend.integrations.vllm.kv_events import APPLY_CHUNK, G3KvEvents
    ev = G3KvEvents(1, 4)
    n = 3 * APPLY_CHUNK + 5
    lock = ev._lock = _SeenAtRelease(lambda: len(ev._ranks))
    ev.apply(_snapshot(0, n))
    assert len(ev._ranks) == n
    partial = [s for s in lock.seen if 0 < s < n]
    assert len(partial) >= 3, lock.seen
