"""A key put again after ``delete()`` cancelled its in-flight write is stored (found in review, 2026-11-30).

``delete()`` of a key whose offload is queued or being written cancels that write (it is not published, its
header is zeroed). The key stayed in the writer's in-flight set until the whole batch settled, so a ``put`` of
the same key meanwhile was answered ``skipped`` (PutResult: already stored or in flight) and counted
``offloads_skipped_present`` although the only write of it was cancelled: the block was never stored, and a
caller (the connector, the tiering tier) took it for stored. Real pools on tmp dirs, the real posix engine;
the engine's submit and ``fdatasync`` are held on an Event only to stop the write at a known point.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.helpers.crash_writer import NS, open_pool, payload
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.pool.g3 import pool as pool_mod

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does


def _served(pool, key) -> bool:
    out = np.zeros(pool.block_bytes, np.uint8)
    ok = pool.get([key], [out]).result(timeout=HANG_S).ok[0]
    return bool(ok) and bool(np.array_equal(out, payload(key.seq_hash)))


def _check_counts(pool, results, offered, deleted=1):
    """The put results add up to ``offered`` and agree with ``stats()``: a write cancelled by ``delete`` is
    ``skipped`` in its put's result and counted ``offloads_skipped_deleted`` (before, in no counter:
    ``stats()["skipped"]`` was lower than the results' sum)."""
    st = pool.stats()
    assert sum(r.written for r in results) == st["written"] == st["blocks"], (results, st)
    assert sum(r.skipped for r in results) == st["skipped"], (results, st)
    assert sum(r.dropped for r in results) == st["dropped"], (results, st)
    assert st["offloads_skipped_deleted"] == deleted, st
    assert sum(r.written + r.skipped + r.dropped for r in results) == offered, results
    assert pool.slot_accounting()["leaked"] == 0


def test_put_again_while_the_cancelled_write_is_being_synced_is_stored(tmp_path, monkeypatch):
    """The write is past its slab I/O, waiting for its fdatasync, when the key is deleted and put again: the
    second put must end with the block stored (the bytes are the key's either way), not skipped and lost."""
    gate, entered = threading.Event(), threading.Event()
    real = pool_mod.fdatasync

    def held_sync(fd):
        entered.set()
        gate.wait(HANG_S)
        real(fd)
    with open_pool(tmp_path) as pool:
        monkeypatch.setattr(pool_mod, "fdatasync", held_sync)
        k = NS.keys([7])[0]
        f1 = pool.put([k], [payload(k.seq_hash)])
        assert entered.wait(HANG_S)
        assert pool.delete([k]).result(timeout=HANG_S) == 0  # not held yet: the write in flight is cancelled
        f2 = pool.put([k], [payload(k.seq_hash)])
        gate.set()
        r1, r2 = f1.result(timeout=HANG_S), f2.result(timeout=HANG_S)
        assert pool.flush(HANG_S)
        assert pool.contains(k) and _served(pool, k), (r1, r2, pool.stats())
        _check_counts(pool, [r1, r2], 2)
    with open_pool(tmp_path) as pool:  # and it is durable: journaled, found after a restart
        assert _served(pool, k)


class HeldEngine(PosixEngine):
    """The real posix engine; its first submit waits for ``gate`` (the writer thread is held there)."""

    def __init__(self):
        super().__init__(threads=2)
        self.gate, self.entered, self.first = threading.Event(), threading.Event(), True

    def submit(self, ops):
        if self.first:
            self.first = False
            self.entered.set()
            self.gate.wait(HANG_S)
        return super().submit(ops)


def test_put_again_while_the_cancelled_write_is_still_queued_is_stored(tmp_path):
    """The key's offload is still queued (the writer is busy with an earlier batch) when it is deleted and put
    again: the cancelled queued write is skipped by the writer, and the second put must store the block."""
    eng = HeldEngine()
    try:
        with open_pool(tmp_path, engine=eng) as pool:
            first = NS.keys([1])
            f0 = pool.put(first, [payload(first[0].seq_hash)])
            assert eng.entered.wait(HANG_S)  # the writer is inside the first batch's submit
            k = NS.keys([7])[0]
            f1 = pool.put([k], [payload(k.seq_hash)])  # queued behind it
            assert pool.delete([k]).result(timeout=HANG_S) == 0
            f2 = pool.put([k], [payload(k.seq_hash)])
            eng.gate.set()
            rs = [f.result(timeout=HANG_S) for f in (f0, f1, f2)]
            assert pool.flush(HANG_S)
            assert pool.contains(k) and _served(pool, k), (rs, pool.stats())
            _check_counts(pool, rs, 3)
    finally:
        eng.close()


@pytest.mark.parametrize("where", ["queued", "syncing"])
def test_a_write_cancelled_by_delete_is_counted_skipped_in_stats(tmp_path, monkeypatch, where):
    """A key deleted while its write is queued or waiting for its fdatasync, and not put again: not stored, its
    put answers it ``skipped``, and ``stats()`` counts it there (``offloads_skipped_deleted``, in ``skipped``), so
    the pool's counters agree with the put results. Before, the cancelled write was in no counter."""
    gate, entered = threading.Event(), threading.Event()
    eng = HeldEngine()
    real = pool_mod.fdatasync

    def held_sync(fd):
        entered.set()
        gate.wait(HANG_S)
        real(fd)
    try:
        with open_pool(tmp_path, engine=eng if where == "queued" else None) as pool:
            futs = []
            if where == "queued":
                first = NS.keys([1])
                futs.append(pool.put(first, [payload(first[0].seq_hash)]))
                assert eng.entered.wait(HANG_S)  # the writer is inside the first batch's submit
            else:
                monkeypatch.setattr(pool_mod, "fdatasync", held_sync)
            k = NS.keys([7])[0]
            futs.append(pool.put([k], [payload(k.seq_hash)]))
            if where == "syncing":
                assert entered.wait(HANG_S)
            assert pool.delete([k]).result(timeout=HANG_S) == 0  # in flight, not held: its write is cancelled
            eng.gate.set()
            gate.set()
            rs = [f.result(timeout=HANG_S) for f in futs]
            assert pool.flush(HANG_S)
            assert not pool.contains(k) and rs[-1].skipped == 1, (rs, pool.stats())
            _check_counts(pool, rs, len(futs))
    finally:
        eng.gate.set()
        gate.set()
        eng.close()
