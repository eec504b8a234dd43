"""Loads that run out of time (the connector's worker role, real pools on tmp files, the CPU engine).

* A load whose reads outlive its deadline is a *timeout*, not a miss, whoever notices first (the load
  thread's own wait, ``get_finished``, or the pool's own bound: ``GetResult.timed_out``, G3 and G4): reported
  ``FailedLoad(reason="timeout")``, counted ``load_timeouts``; the scheduler does not cool the block (it is
  stored, only slow), and a G3 block still stored is not reported removed to the scheduler's mirror.
* A real miss (the block is gone from G3) stays a miss: cooled, and reported removed.
* A load already past its deadline when a load thread picks it up issues no pool read: a slow tier gets no
  more reads exactly when it is overloaded.

Slow tiers are real pools whose reads wait on a gate the test opens (G3: the device reader's ``preadv``; G4:
objects whose ``open`` blocks in the kernel, :class:`tests.helpers.held_open.HeldOpen`).
"""
from __future__ import annotations

import threading
import time

import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a load's end, flushes); returns as soon as it does
FAST_S = 0.3  # the bound that must run out (a worker's load_timeout_s, or a pool's own): reads are gated past it

torch = pytest.importorskip("torch")

from kvbm_backend.config import G4Config  # noqa: E402
from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import LoadJob, mirror_id  # noqa: E402
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvbm_backend.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvbm_backend.pool.g4.pool import G4Pool  # noqa: E402
from tests.helpers.pools import open_g3  # noqa: E402
from tests.integrations.vllm.test_worker_device_path import LOAD_S, _engine, _g3, _ns, _save  # noqa: E402


class _GatedReads:
    """The G3 device reader's file reads (the CPU engine's load path) wait until :meth:`open` (a slow disk)."""

    def __init__(self, monkeypatch, g3, kv):
        self.gate = threading.Event()
        files = g3.device_reader(kv.device).reads.files
        real = files.preadv

        def slow(*a, **k):
            self.gate.wait(HANG_S)
            return real(*a, **k)
        monkeypatch.setattr(files, "preadv", slow)

    def open(self):
        self.gate.set()


def _ended_by_load_thread(w, req):
    """Wait until the load thread itself ended ``req`` (nobody polls ``get_finished`` meanwhile, which would
    mark it timed out first: the race the load thread won in review finding 5)."""
    end = time.monotonic() + HANG_S
    while w._loads[req].state == "pending" and time.monotonic() < end:
        time.sleep(0.01)


def _finish(w, req):
    end = time.monotonic() + HANG_S
    while req not in w.get_finished():
        assert time.monotonic() < end, f"load {req} never finished"
        time.sleep(0.01)
    return w.load_errors(), w.worker_meta()


def _cooled(ns, meta):
    """What the scheduler does with the worker's report: the blocks it cools for every request."""
    s = SchedulerSide(ns, ns.layout.page_size, None, None)
    s.update_connector_output(meta)
    return len(s.failed_blocks)


def test_load_past_the_worker_deadline_is_a_timeout_not_a_miss(tmp_path, monkeypatch):
    """The G3 reads hang past the worker's load_timeout_s and the load thread's own wait notices first:
    reason "timeout", load_timeouts 1, no cooling, and the still-stored blocks are not reported removed."""
    kv = _engine("cpu", seed=11)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)  # the pool's own bound: LOAD_S, far past the worker's
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=FAST_S, report_g3=True)
    gate = None
    try:
        w.register(kv)
        _save(w, g3, [1, 2], [501, 502])
        w.worker_meta()  # the first report (snapshot) is out
        gate = _GatedReads(monkeypatch, g3, kv)
        stats.reset()
        w.start_loads([LoadJob("r1", [10, 11], [501, 502], ["G3", "G3"], "acme")])
        _ended_by_load_thread(w, "r1")
        errs, meta = _finish(w, "r1")
        assert errs == {10, 11}  # recomputed
        assert [(f.first_failed, f.reason) for f in meta.failed] == [(501, "timeout")]
        assert stats.get("load_timeouts") == 1
        keys = ns.keys([501, 502], "acme", 0)
        assert all(g3.contains(k) for k in keys)  # still stored: only slow
        assert not set(meta.removed) & {mirror_id(k) for k in keys}
        assert _cooled(ns, meta) == 0
    finally:
        if gate is not None:
            gate.open()
        w.shutdown()
        g3.close()


def test_g3_pool_timing_out_first_makes_the_load_a_timeout(tmp_path, monkeypatch):
    """G3's own g3.load_timeout_s runs out before the worker's: its GetResult marks the blocks timed out, so
    the load is a timeout (not a miss: the G3 pool bound sits under the worker's, 5 s vs 7 s by default)."""
    kv = _engine("cpu", seed=12)
    ns = _ns(kv)
    g3 = open_g3(tmp_path / "g3", ns, files_per_path=2, load_timeout_s=FAST_S)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=HANG_S, report_g3=True)
    gate = None
    try:
        w.register(kv)
        _save(w, g3, [1, 2], [601, 602])
        w.worker_meta()
        gate = _GatedReads(monkeypatch, g3, kv)
        stats.reset()
        w.start_loads([LoadJob("r1", [10, 11], [601, 602], ["G3", "G3"], "acme")])
        errs, meta = _finish(w, "r1")
        assert errs == {10, 11}
        assert [(f.first_failed, f.reason) for f in meta.failed] == [(601, "timeout")]
        assert stats.get("load_timeouts") == 1 and g3.stats()["misses_by_reason"]["timeout"] == 2
        assert not set(meta.removed) & {mirror_id(k) for k in ns.keys([601, 602], "acme", 0)}
        assert _cooled(ns, meta) == 0
    finally:
        if gate is not None:
            gate.open()
        w.shutdown()
        g3.close()


def test_g4_pool_timing_out_first_makes_the_load_a_timeout(tmp_path):
    """G4's load bound (timeout_s x (1 + retries)) runs out on object opens hung in the kernel, long before the
    worker's deadline: the load is a timeout, not a miss (the objects are there)."""
    from tests.helpers.held_open import HeldOpen
    kv = _engine("cpu", seed=13)
    ns = _ns(kv)
    g4 = G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", timeout_s=FAST_S, retries=0,
                         keyring={"path": str(tmp_path / "keys" / "keyring.json")}), ns)
    w = WorkerSide(ns, 0, None, g4, load_timeout_s=HANG_S)
    held = None
    try:
        w.register(kv)
        seqs = [701, 702]
        _save(w, g4, [1, 2], seqs)
        held = HeldOpen([g4.store._path(g4.object_name(k)) for k in w.offloads.g4_keys(ns.keys(seqs, "acme", 0))])
        stats.reset()
        w.start_loads([LoadJob("r1", [10, 11], seqs, ["G4", "G4"], "acme")])
        errs, meta = _finish(w, "r1")
        assert errs == {10, 11}
        assert [(f.first_failed, f.reason) for f in meta.failed] == [(701, "timeout")]
        assert stats.get("load_timeouts") == 1
        assert _cooled(ns, meta) == 0
    finally:
        if held is not None:
            held.release()
        w.shutdown()
        g4.close()


def test_a_block_gone_from_g3_is_still_a_miss_and_reported_removed(tmp_path):
    """The other side of the line: a block G3 no longer holds is a miss (cooled) and reported removed."""
    kv = _engine("cpu", seed=14)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, report_g3=True)
    try:
        w.register(kv)
        _save(w, g3, [1, 2], [801, 802])
        w.worker_meta()
        gone = ns.key(802, "acme", 0)
        assert g3.delete([gone]).result(HANG_S) == 1
        stats.reset()
        w.start_loads([LoadJob("r1", [10, 11], [801, 802], ["G3", "G3"], "acme")])
        errs, meta = _finish(w, "r1")
        assert errs == {11}
        assert [(f.first_failed, f.reason) for f in meta.failed] == [(802, "miss")]
        assert stats.get("load_timeouts") == 0
        assert mirror_id(gone) in meta.removed and mirror_id(ns.key(801, "acme", 0)) not in meta.removed
        assert _cooled(ns, meta) == 1
    finally:
        w.shutdown()
        g3.close()


def test_loads_past_their_deadline_issue_no_pool_reads(tmp_path, monkeypatch):
    """Eight loads queued behind a tier that answers after every deadline has passed (the worker has two load
    threads): the loads picked up after their deadline issue no ``pool.get`` at all; all eight are timeouts."""
    kv = _engine("cpu", seed=15)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=FAST_S)
    n = 8
    started = threading.Event()
    all_late_at = [0.0]
    calls: list[int] = []
    gate = None
    try:
        w.register(kv)
        seqs = [900 + i for i in range(n)]
        _save(w, g3, list(range(1, n + 1)), seqs)
        gate = _GatedReads(monkeypatch, g3, kv)  # the two gets issued never answer in time either
        real = g3.get

        def slow_get(keys, out):  # the pool takes its time to take a get: until every load's deadline passed
            calls.append(keys[0].seq_hash)
            started.wait(HANG_S)
            while time.monotonic() < all_late_at[0]:
                time.sleep(0.01)
            return real(keys, out)
        g3.get = slow_get
        stats.reset()
        w.start_loads([LoadJob(f"r{i}", [10 + i], [seqs[i]], ["G3"], "acme") for i in range(n)])
        all_late_at[0] = time.monotonic() + FAST_S  # every load's deadline was set before this
        started.set()
        reasons = {}
        end = time.monotonic() + HANG_S
        while len(reasons) < n:
            assert time.monotonic() < end, "loads never finished"
            w.get_finished()
            reasons.update((f.req_id, f.reason) for f in w.take_failed_loads())
            time.sleep(0.01)
        w._exec.shutdown(wait=True)  # every load thread is done: no get comes later
        assert len(calls) <= 2, f"{len(calls)} pool.get calls for loads past their deadline"
        assert set(reasons.values()) == {"timeout"} and stats.get("load_timeouts") == n
    finally:
        if gate is not None:
            gate.open()
        w.shutdown()
        g3.close()
