"""The worker's G3 report to the scheduler's mirror (split mode: TP > 1 or vLLM's mp executor) on a real G3
pool that evicts: what G3 dropped is found from its removal log (``G3Pool.removed_since``), O(removals), and
the scheduler's mirror (a real :class:`G3Mirror` fed the reports) ends exactly as G3's index is. Before
2026-11-30 each report after an eviction read the whole index (``keys()``) under the catalog lock: 4.2 s at
500,000 blocks, every 0.5 s while G3 was full, on vLLM's worker thread or holding the GIL beside it."""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
from kvbm_backend.integrations.vllm.worker_side import WorkerSide
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from tests.helpers.pools import open_g3

HANG_S = 600.0  # a hang guard, not a bound: waits for puts and flushes that must complete; returns as soon as they do

LAYOUT = KvLayout(1, 1, 16, 128, "bfloat16")  # 4 KiB blocks, 8 KiB slots
CAP = 64  # blocks G3 holds


class _Spy:
    """Counts the calls the worker makes to the real pool's ``keys`` / ``keys_within`` (a whole-index read) and its
    index lookups (``contains``: one; ``holds``: one per key), passing them through."""

    def __init__(self, g3):
        self.keys = self.contains = 0
        real_keys, real_within, real_contains, real_holds = g3.keys, g3.keys_within, g3.contains, g3.holds

        def keys():
            self.keys += 1
            return real_keys()

        def keys_within(wait_s):
            got = real_within(wait_s)
            self.keys += got is not None
            return got

        def contains(k):
            self.contains += 1
            return real_contains(k)

        def holds(ks, *a, **kw):
            self.contains += len(ks)
            return real_holds(ks, *a, **kw)
        g3.keys, g3.keys_within, g3.contains, g3.holds = keys, keys_within, contains, holds


@pytest.fixture
def setup(tmp_path):
    ns = Namespace("m", LAYOUT)
    g3 = open_g3(tmp_path / "g3", ns, files_per_path=1, capacity_gb=CAP * 8192 / 1e9, admission={"policy": "all"})
    w = WorkerSide(ns, 0, g3, None, report_g3=True)
    w.reconcile_interval_s = 0.0  # no rate limit: any index read the report would make, it makes
    mirror = G3Mirror(ns)
    yield ns, g3, w, mirror
    w.shutdown()
    g3.close()


def _write(ns, g3, w, hashes, tenant="acme"):
    """Put blocks in G3 as the worker's offloads do, and hand their keys to the worker's report (the callback
    :class:`~kvbm_backend.integrations.vllm.offloads.Offloads` makes for each completed G3 put)."""
    keys = ns.keys(list(hashes), tenant, 0)
    blk = np.zeros(LAYOUT.bytes_per_block, np.uint8)
    g3.put(keys, [blk] * len(keys)).result(HANG_S)
    assert g3.flush(HANG_S)
    w._g3_written(keys)
    return keys


def _report(w, mirror):
    meta = w.worker_meta()
    if meta is not None:
        mirror.apply(meta)


def _assert_mirror_is_the_index(g3, mirror, every_key):
    held = set(type(g3).keys(g3))  # the real index (past a _Spy)
    assert len(mirror) == len(held)
    in_mirror = {k for k in every_key if mirror.lookup_prefix([k], request=False).result() == 1}
    assert in_mirror == held


def test_a_report_after_evictions_reads_the_removal_log_not_the_index(setup):
    """After the snapshot, reports while G3 evicts never read the whole index: one index lookup per logged
    removal that names a reported block (its sequence hash and rank) and per block written, no ``keys()``.
    The mirror ends exactly as the index: evicted blocks removed, the others kept; another tenant's block
    with an evicted block's sequence hash stays, and so does a block evicted and written again."""
    ns, g3, w, mirror = setup
    every = _write(ns, g3, w, range(1, 49)) + _write(ns, g3, w, range(1, 17), tenant="other")
    _report(w, mirror)  # the snapshot: reads the index once
    _assert_mirror_is_the_index(g3, mirror, every)
    spy = _Spy(g3)
    for step in range(3):
        ev0, cur0 = g3.stats()["evictions"], g3.removal_cursor()
        new = range(1000 + 32 * step, 1000 + 32 * (step + 1))
        every += _write(ns, g3, w, new)
        if step == 1:  # blocks acme evicted in step 0 come back (newer than their removal)
            every += _write(ns, g3, w, range(1, 5))
        removals = g3.removal_cursor() - cur0
        assert g3.stats()["evictions"] > ev0 and removals > 0
        lookups0 = spy.contains
        _report(w, mirror)
        assert spy.keys == 0, "a report after evictions read the whole G3 index"
        written = 32 + (4 if step == 1 else 0)
        assert spy.contains - lookups0 <= written + 2 * removals  # O(removals): 2 tenants per hash at most
        _assert_mirror_is_the_index(g3, mirror, every)
        if step == 0:  # the shared hashes are a real case: acme's copy evicted, other's kept
            assert any(not g3.contains(a) and g3.contains(o)
                       for a, o in zip(ns.keys(list(range(1, 17)), "acme", 0), ns.keys(list(range(1, 17)), "other", 0)))


def test_a_removal_log_that_overflowed_is_read_from_the_index_once_even_when_rate_limited(setup, monkeypatch):
    """More removals between two reports than G3's log keeps: the report reads the index (``keys()``) once and
    the mirror is exact. An overflow while a read is rate-limited (``reconcile_interval_s``) is owed: the next
    report past the interval reads the index although the log has nothing new."""
    from kvbm_backend.pool.g3 import catalog
    ns, g3, w, mirror = setup
    g3.cat.removed = type(g3.cat.removed)(maxlen=8)  # G3's removal log keeps 8 entries (REMOVED_LOG_ENTRIES)
    every = _write(ns, g3, w, range(1, 65))
    _report(w, mirror)
    spy = _Spy(g3)
    every += _write(ns, g3, w, range(100, 132))  # 32 evictions > 8
    _report(w, mirror)
    assert spy.keys == 1
    _assert_mirror_is_the_index(g3, mirror, every)
    w.reconcile_interval_s = 3600.0  # the next read is due in an hour
    every += _write(ns, g3, w, range(200, 232))  # overflows again
    _report(w, mirror)
    assert spy.keys == 1  # rate-limited: not read yet (the mirror may be stale towards present meanwhile)
    w.reconcile_interval_s = 0.0
    _report(w, mirror)  # nothing new in the log: the read is owed
    assert spy.keys == 2
    _assert_mirror_is_the_index(g3, mirror, every)
    every += _write(ns, g3, w, range(300, 304))  # 4 removals: the log tells again
    _report(w, mirror)
    assert spy.keys == 2
    _assert_mirror_is_the_index(g3, mirror, every)
    assert catalog.REMOVED_LOG_ENTRIES > 8  # the module value is untouched (only this pool's log was shrunk)


STALL_S = 30.0  # the held lock's hang guard: a report waiting for it returns only then, and finds it free


@contextlib.contextmanager
def _pool_lock_held(g3):
    """Another thread holds G3's lock (a journal write on a stalled drive) until the block ends, or ``STALL_S``."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with g3.cat.lock:
            taken.set()
            release.wait(STALL_S)
    t = threading.Thread(target=hold, name="test-journal-stall")
    t.start()
    try:
        assert taken.wait(HANG_S)
        yield
    finally:
        release.set()
        t.join(HANG_S)


def test_an_index_read_the_busy_pool_cannot_give_now_is_owed_not_waited_for(setup):
    """The removal log overflowed and the report must read the whole index, but another thread holds G3's lock (a
    journal write on a stalled drive): the report returns while the lock is still held (the forward thread does not
    wait for it; before 2026-12-02 it waited the whole stall, reviewer: 1.5 s), and the next report, the lock free,
    reads the index it owes: the mirror is exact."""
    ns, g3, w, mirror = setup
    g3.cat.removed = type(g3.cat.removed)(maxlen=8)
    every = _write(ns, g3, w, range(1, 65))
    _report(w, mirror)
    spy = _Spy(g3)
    every += _write(ns, g3, w, range(100, 132))  # 32 evictions > 8: the log overflowed
    with _pool_lock_held(g3):
        _report(w, mirror)
        still_held = g3.cat.lock.locked()
    assert still_held and spy.keys == 0, "the report waited for the pool's lock"
    _report(w, mirror)  # the lock free: the owed read
    assert spy.keys == 1
    _assert_mirror_is_the_index(g3, mirror, every)


def test_a_first_snapshot_the_busy_pool_cannot_give_now_goes_with_a_later_report(tmp_path):
    """A worker restarted over a G3 pool holding blocks: its first report is the index snapshot, but another thread
    holds G3's lock (a journal write on a stalled drive). The report returns while the lock is still held, without a
    snapshot (the forward thread does not wait for it; before 2026-12-02 it waited the whole stall); the next
    report, the lock free, carries the snapshot and the mirror is the index."""
    ns = Namespace("m", LAYOUT)
    with open_g3(tmp_path / "g3", ns, files_per_path=1, admission={"policy": "all"}) as g3:
        every = ns.keys(list(range(1, 17)), "acme", 0)
        g3.put(every, [np.zeros(LAYOUT.bytes_per_block, np.uint8)] * len(every)).result(HANG_S)
        assert g3.flush(HANG_S)
        w = WorkerSide(ns, 0, g3, None, report_g3=True)
        mirror = G3Mirror(ns)
        with _pool_lock_held(g3):
            meta = w.worker_meta()
            still_held = g3.cat.lock.locked()
        try:
            assert still_held, "the first report waited for the pool's lock"
            assert meta is None or not meta.snapshot, meta
            _report(w, mirror)
            _assert_mirror_is_the_index(g3, mirror, every)
        finally:
            w.shutdown()


def test_a_block_written_and_evicted_before_the_report_is_not_reported_added(setup):
    """A put's completion reaches the worker's report after G3 already evicted the block (a busy GIL delays the
    callback): the report looks it up, so the scheduler is never told it is present."""
    ns, g3, w, mirror = setup
    _report(w, mirror)
    blk = np.zeros(LAYOUT.bytes_per_block, np.uint8)
    early = ns.keys(list(range(1, 9)), "acme", 0)
    g3.put(early, [blk] * 8).result(HANG_S)
    assert g3.flush(HANG_S)
    every = early + _write(ns, g3, w, range(100, 100 + CAP))  # evicts `early`
    assert not any(g3.contains(k) for k in early)
    w._g3_written(early)  # their callback comes late
    _report(w, mirror)
    _assert_mirror_is_the_index(g3, mirror, every)


def test_the_tiering_tiers_removal_check_owes_an_overflow_it_could_not_read_yet(tmp_path):
    """The vLLM tiering tier's check (:class:`HeldChunks`, the same :class:`RemovalWatch`): removals past G3's
    log while the index read is rate-limited are found by the next check past the interval, although the log has
    nothing new by then (before: lost, the chunks stayed published as stored)."""
    from kvbm_backend.integrations.vllm.tier_removals import HeldChunks
    ns = Namespace("m", LAYOUT)
    with open_g3(tmp_path / "g3", ns, files_per_path=1, capacity_gb=CAP * 8192 / 1e9,
                 admission={"policy": "all"}) as g3:
        g3.cat.removed = type(g3.cat.removed)(maxlen=8)
        blk = np.zeros(LAYOUT.bytes_per_block, np.uint8)

        def put(hashes):
            keys = ns.keys(list(hashes), "acme", 0)
            g3.put(keys, [blk] * len(keys)).result(HANG_S)
            assert g3.flush(HANG_S)
            return keys
        held = HeldChunks(g3, ns.fingerprint, 1, lambda k: k.seq_hash, 0.0)
        first = put(range(1, 65))
        held.published(first, held.cursor())
        put(range(100, 132))  # 32 evictions > 8: the log overflowed
        assert sorted(held.removed()) == sorted(first[:32])
        held.interval_s = 3600.0
        put(range(200, 232))  # overflows again, the read is not due
        assert held.removed() == []
        held.interval_s = 0.0
        assert sorted(held.removed()) == sorted(first[32:])  # owed
        assert len(held) == 0
