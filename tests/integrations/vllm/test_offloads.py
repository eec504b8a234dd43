"""The worker role's offloads (:mod:`kvbm_backend.integrations.vllm.offloads`): staged in ``wait_for_save``,
handed to the pools on the ``kvbm-save`` thread where the engine is on CUDA.

These drive the real :class:`WorkerSide` with a CPU engine and real G3 / G4 pools over files, with the
hand-off deferred as a CUDA engine defers it (``offloads.defer``): what the GPU path adds is only an
event waited for on that thread (``tests/gpu/test_gpu_path.py`` shows that ``save`` does not wait for the
stream). The save thread is held busy by a task queued before the save, so the tests see a save that was
staged but not yet handed off.
"""
from __future__ import annotations

import contextlib
import threading

import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (flushes, results, the test's release); returns as soon as it does

torch = pytest.importorskip("torch")

from kvbm_backend.integrations.vllm import stats
from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
from kvbm_backend.integrations.vllm.worker_side import WorkerSide
from tests.integrations.vllm.test_worker_device_path import _block_bytes, _clear, _engine, _g3, _ns, _wait


@contextlib.contextmanager
def _worker(tmp_path, seed: int, defer: bool = True, **kw):
    """A registered CPU :class:`WorkerSide` over a fresh G3 pool, its hand-off deferred: ``(kv, g3, w)``."""
    kv = _engine("cpu", seed=seed)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=120, **kw)  # was 30: a read the busy CI VM froze is no failed load
    try:
        w.register(kv)
        w.offloads.defer = defer
        yield kv, g3, w
    finally:
        w.shutdown()
        g3.close()


def _hold(w: WorkerSide) -> threading.Event:
    """Keep ``w``'s save thread busy until the returned event is set."""
    gate = threading.Event()
    w.offloads._thread.submit(gate.wait, HANG_S)
    return gate


def test_a_deferred_save_reaches_the_pools_only_through_flush_saves_and_loads_back_intact(tmp_path):
    with _worker(tmp_path, 11, device_checksum="on") as (kv, g3, w):
        src, seqs = [1, 2, 3], [701, 702, 703]
        want = [_block_bytes(kv, b) for b in src]
        gate = _hold(w)
        w.save([SaveJob("r", src, seqs, "acme")])  # returns with the hand-off queued behind the gate
        bpb = kv.layout.bytes_per_block
        assert w.offloads.pending_bytes == 3 * bpb  # staged: counted against max_pending_save_bytes
        assert g3.flush(HANG_S) and g3.stats()["blocks"] == 0  # not handed to G3 yet
        assert not w.flush_saves(0.2)  # the hand-off cannot run: flush_saves says so
        gate.set()
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S)
        assert g3.stats()["blocks"] == 3
        assert w.offloads.pending_bytes == 0
        dst = [10, 11, 12]
        _clear(kv, dst)
        w.start_loads([LoadJob("l", dst, seqs, ["G3"] * 3, "acme")])
        assert _wait(w, "l") == set()
        for b, x in zip(dst, want):
            assert torch.equal(_block_bytes(kv, b), x)
        # the device checksums were carried to the put on the save thread: device loads verified them
        assert g3.device_reader(kv.device).stats().get("host_verified", 0) == 0


def test_shutdown_hands_off_the_saves_staged_before_it(tmp_path):
    with _worker(tmp_path, 12) as (kv, g3, w):
        gate = _hold(w)
        w.save([SaveJob("r", [4, 5], [801, 802], "acme")])
        threading.Timer(0.2, gate.set).start()
        w.shutdown()  # waits for the queued hand-off, as the connector's close does before the pools flush
        assert g3.flush(HANG_S) and g3.stats()["blocks"] == 2
        assert w.flush_saves(HANG_S)  # after shutdown: nothing left to wait for


def test_saves_staged_but_not_handed_off_count_against_max_pending_save_bytes(tmp_path):
    bpb = _engine("cpu").layout.bytes_per_block
    with _worker(tmp_path, 13, max_pending_save_bytes=3 * bpb) as (kv, g3, w):
        gate = _hold(w)
        before = stats.snapshot()
        w.save([SaveJob("a", [1, 2], [901, 902], "acme")])
        w.save([SaveJob("b", [3, 4], [903, 904], "acme")])  # 4 blocks would pass 3: b's first is staged, its last dropped
        after = stats.snapshot()
        assert after["save_dropped_blocks"] - before.get("save_dropped_blocks", 0) == 1
        assert after["save_dropped_full_blocks"] - before.get("save_dropped_full_blocks", 0) == 1
        assert w.offloads.pending_bytes == 3 * bpb  # the bound held
        w.save([SaveJob("c", [5], [905], "acme")])  # nothing fits: dropped whole
        assert stats.get("save_dropped_blocks") - before.get("save_dropped_blocks", 0) == 2
        gate.set()
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S)
        assert w.offloads.pending_bytes == 0
        assert [g3.contains(k) for k in w.ns.keys([901, 902, 903, 904, 905], "acme", 0)] == [True] * 3 + [False] * 2
        w.save([SaveJob("b", [3, 4], [903, 904], "acme")])  # room again once the first were written
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S) and g3.stats()["blocks"] == 4


def test_a_save_larger_than_max_pending_save_bytes_stages_its_leading_blocks(tmp_path):
    """One save job is one request's blocks of one step (a whole prefill chunk): one larger than the bound keeps
    its leading blocks (a prefix is found only as a prefix), the bound holding; only the tail is dropped."""
    bpb = _engine("cpu").layout.bytes_per_block
    with _worker(tmp_path, 19, max_pending_save_bytes=4 * bpb + bpb // 2) as (kv, g3, w):
        src, seqs = [1, 2, 3, 4, 5, 6], [1401, 1402, 1403, 1404, 1405, 1406]
        want = [_block_bytes(kv, b) for b in src[:4]]
        gate = _hold(w)
        before = stats.snapshot()
        w.save([SaveJob("big", src, seqs, "acme")])
        assert w.offloads.pending_bytes == 4 * bpb  # never past the bound
        after = stats.snapshot()
        assert after["save_dropped_blocks"] - before.get("save_dropped_blocks", 0) == 2
        assert after["save_dropped_full_blocks"] - before.get("save_dropped_full_blocks", 0) == 2
        assert after["save_blocks"] - before.get("save_blocks", 0) == 4
        gate.set()
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S) and w.offloads.pending_bytes == 0
        keys = w.ns.keys(seqs, "acme", 0)
        assert [g3.contains(k) for k in keys] == [True] * 4 + [False] * 2
        dst = [20, 21, 22, 23]
        _clear(kv, dst)
        w.start_loads([LoadJob("l", dst, seqs[:4], ["G3"] * 4, "acme")])  # each block under its own hash
        assert _wait(w, "l") == set()
        for b, x in zip(dst, want):
            assert torch.equal(_block_bytes(kv, b), x)


def test_a_save_with_an_engine_block_id_out_of_range_raises_before_staging(tmp_path):
    bpb = _engine("cpu").layout.bytes_per_block
    with _worker(tmp_path, 14, defer=False, max_pending_save_bytes=2 * bpb) as (kv, g3, w):
        with pytest.raises(IndexError):
            w.save([SaveJob("bad", [1, 10_000], [1001, 1002], "acme")])  # no engine block 10000: a caller bug
        assert w.offloads.pending_bytes == 0  # before, the bound kept these bytes forever
        w.save([SaveJob("ok", [1, 2], [1001, 1002], "acme")])
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S) and g3.stats()["blocks"] == 2


@pytest.mark.parametrize("where", ["staging", "gather"])
def test_a_failed_staging_is_a_dropped_save_counted_and_logged_once_not_raised(tmp_path, monkeypatch, caplog, where):
    """A staging allocation that fails (on CUDA a transient ``torch.OutOfMemoryError`` of the device buffer) or
    a failed gather never reaches vLLM's ``wait_for_save``: the blocks are dropped, counted, their bytes given
    back, and a WARNING logged at most once a minute."""
    from kvbm_backend.integrations.vllm import offloads
    from kvbm_backend.log_limits import LimitedLog
    from kvbm_backend.integrations.vllm.workers import GroupedWorkers
    bpb = _engine("cpu").layout.bytes_per_block
    with _worker(tmp_path, 20, defer=False, max_pending_save_bytes=4 * bpb) as (kv, g3, w):
        monkeypatch.setattr(offloads, "LOG", LimitedLog(offloads.log))
        if where == "staging":
            def fail(nbytes, pool=None):
                raise MemoryError(f"cannot allocate {nbytes} bytes")
            monkeypatch.setattr(offloads, "numpy_staging", fail)
        else:
            def fail(block_ids, staging):
                raise RuntimeError("gather failed")
            monkeypatch.setattr(kv, "gather", fail)
        gw = GroupedWorkers([w], block_errors=True)
        before = stats.snapshot()
        with caplog.at_level("WARNING", logger="kvbm_backend.connector"):
            gw.save([SaveJob("r", [1, 2], [1501, 1502], "acme")])  # what wait_for_save calls
            gw.save([SaveJob("s", [3, 4, 5, 6, 7], [1503, 1504, 1505, 1506, 1507], "acme")])  # 4 fit, 1 over the bound
        after = stats.snapshot()
        assert after["save_dropped_blocks"] - before.get("save_dropped_blocks", 0) == 7
        assert after["save_dropped_error_blocks"] - before.get("save_dropped_error_blocks", 0) == 6
        assert after["save_dropped_full_blocks"] - before.get("save_dropped_full_blocks", 0) == 1
        assert w.offloads.pending_bytes == 0
        assert len([r for r in caplog.records if "staging failed" in r.getMessage()]) == 1
        monkeypatch.undo()
        w.save([SaveJob("ok", [1, 2], [1501, 1502], "acme")])  # the next save stages as before
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S) and g3.stats()["blocks"] == 2


def test_flush_all_waits_for_every_worker_of_the_process(tmp_path):
    """``engine_run`` runs ``offloads.flush_all`` before it flushes the pools and reads their stats."""
    from kvbm_backend.integrations.vllm.offloads import flush_all
    with _worker(tmp_path / "a", 15) as (_, g3a, a), _worker(tmp_path / "b", 16) as (_, g3b, b):
        gate = _hold(b)
        a.save([SaveJob("r", [1], [1101], "acme")])
        b.save([SaveJob("r", [1], [1102], "acme")])
        assert not flush_all(0.2)  # b's hand-off is held
        gate.set()
        assert flush_all(HANG_S)
        assert g3a.flush(HANG_S) and g3b.flush(HANG_S)
        assert g3a.stats()["blocks"] == 1 and g3b.stats()["blocks"] == 1


def test_a_save_after_shutdown_is_dropped_and_counted_not_raised(tmp_path):
    with _worker(tmp_path, 17) as (_, g3, w):
        w.shutdown()
        before = stats.snapshot()
        w.save([SaveJob("late", [1, 2], [1201, 1202], "acme")])  # vLLM's thread never sees an error
        after = stats.snapshot()
        assert after["save_dropped_blocks"] - before.get("save_dropped_blocks", 0) == 2
        assert after["save_dropped_closed_blocks"] - before.get("save_dropped_closed_blocks", 0) == 2
        assert w.offloads.pending_bytes == 0
        assert g3.flush(HANG_S) and g3.stats()["blocks"] == 0


def test_a_deferred_promotion_reaches_g3_past_admission_through_the_save_thread(tmp_path):
    """G4 hits promoted into G3 (``Offloads.promote``, the worker's load thread) go through the save thread
    where hand-offs are deferred, past G3's admission filter, with the rows' bytes."""
    with _worker(tmp_path, 18) as (kv, g3, w):
        bpb = kv.layout.bytes_per_block
        rows = torch.randint(0, 256, (2, bpb), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        keys = w.ns.keys([1301, 1302], "acme", 0)
        gate = _hold(w)
        w.offloads.promote(keys, rows, dev_checks=True)
        assert g3.flush(HANG_S) and not any(g3.contains(k) for k in keys)  # queued behind the gate
        gate.set()
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S)
        assert all(g3.contains(k) for k in keys) and w.offloads.pending_bytes == 0
        out = torch.zeros(2, bpb, dtype=torch.uint8)
        assert g3.get(keys, out).result(timeout=HANG_S).ok == [True, True]
        assert torch.equal(out, rows)
