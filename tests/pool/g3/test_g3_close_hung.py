"""G3 close while the storage hangs (a hard-mounted NFS whose flush never returns): ``close`` gives up after its
bound, every put future a caller holds is resolved (dropped ``closed``, never pending for ever), nothing of the
abandoned round is published, and the directory lock stays held until the hung I/O has returned (a new pool on
the directory must not take slots the old process may still be writing or syncing).

Real posix engine, real files, real ``fdatasync``; the slab flush is made to hang until the test releases it
(the pool's ``fdatasync`` global, as the group-commit tests wrap it), or the slab writes are held back by the
engine until the test releases them (a write that hangs in the kernel), as the group-commit tests hold one."""
from __future__ import annotations

import threading
from concurrent.futures import Future
import time

import pytest

from tests.helpers.crash_writer import NS, open_pool, payload
from kvbm_backend.io import fdatasync as real_fdatasync
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3 import pool as pool_mod
from kvbm_backend.pool.g3.dirs import G3LockedError

HANG_S = 600.0  # a hang guard, not a bound


class HeldWrites(PosixEngine):
    """Posix engine whose writes start only once :attr:`release` is set (each waits in its own thread, as a
    pwritev stuck in the kernel); :attr:`entered` is set when the first write is submitted."""

    def __init__(self):
        super().__init__(threads=2)
        self.release, self.entered = threading.Event(), threading.Event()

    def submit(self, ops):
        ops = list(ops)
        if not ops or not ops[0].write:
            return super().submit(ops)
        self.entered.set()
        out = Future()

        def later():
            self.release.wait(HANG_S)
            f = super(HeldWrites, self).submit(ops)
            f.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else
                                out.set_result(f.result()))
        threading.Thread(target=later, daemon=True).start()
        return out


def _open_when_unlocked(path):
    end = time.monotonic() + HANG_S  # hang guard: the lock goes once the hung I/O returned
    while True:
        try:
            return open_pool(path, files_per_path=1)
        except G3LockedError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


@pytest.mark.slow
def test_close_with_a_hung_flush_resolves_puts_and_holds_the_lock_until_the_flush_returns(tmp_path, monkeypatch):
    gate, entered = threading.Event(), threading.Event()

    def hung_sync(fd):
        entered.set()
        gate.wait(HANG_S)
        real_fdatasync(fd)

    monkeypatch.setattr(pool_mod, "fdatasync", hung_sync)
    pool = open_pool(tmp_path, files_per_path=1, fsync=True, load_timeout_s=0.1)
    keys = NS.keys(range(4))
    fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
    try:
        assert entered.wait(HANG_S)  # the piece is written; its flush hangs
        closer = threading.Thread(target=pool.close, daemon=True)
        closer.start()
        closer.join(HANG_S)
        assert not closer.is_alive()  # close gave up on the hung flush
        # the caller's future is resolved: before the fix it stayed pending until the flush returned (never, on a
        # hung hard mount)
        assert fut.done()
        r = fut.result()
        assert (r.written, r.dropped) == (0, 4), r
        # the hung flush still holds the old pool's files: the directory stays locked (before the fix close
        # released it with the flush in flight)
        with pytest.raises(G3LockedError):
            open_pool(tmp_path, files_per_path=1).close()
    finally:
        gate.set()
    p2 = _open_when_unlocked(tmp_path)
    try:  # nothing of the abandoned round was published
        assert not any(p2.contains(k) for k in keys)
        assert p2.slot_accounting()["leaked"] == 0
    finally:
        p2.close()
    assert pool.slot_accounting()["leaked"] == 0


@pytest.mark.slow
def test_close_with_a_hung_write_resolves_every_put_even_of_pieces_never_submitted(tmp_path, monkeypatch):
    """One piece in flight at a time, one block per piece: the first piece's write hangs, so the writer thread
    waits to submit the next pieces past close's whole bound (the case the 2026-11-30 note left open: their
    puts stayed pending for ever). Every put is resolved dropped when close returns; the lock is held until the
    hung write returned; nothing is published, and no slot leaks, after it did."""
    monkeypatch.setattr(G3Pool, "min_chunk_blocks", 1)
    monkeypatch.setattr(G3Pool, "chunk_bytes", 1)
    monkeypatch.setattr(G3Pool, "chunks_in_flight", 1)
    eng = HeldWrites()
    pool = open_pool(tmp_path, engine=eng, files_per_path=1, fsync=True, load_timeout_s=0.1)
    keys = NS.keys(range(3))
    try:
        futs = [pool.put([k], [payload(k.seq_hash)]) for k in keys]
        assert eng.entered.wait(HANG_S)
        closer = threading.Thread(target=pool.close, daemon=True)
        closer.start()
        closer.join(HANG_S)
        assert not closer.is_alive()
        assert all(f.done() for f in futs), [f._state for f in futs]
        assert [(f.result().written, f.result().dropped) for f in futs] == [(0, 1)] * 3
        with pytest.raises(G3LockedError):
            open_pool(tmp_path, files_per_path=1).close()
    finally:
        eng.release.set()
    p2 = _open_when_unlocked(tmp_path)
    try:
        assert not any(p2.contains(k) for k in keys)
        assert p2.slot_accounting()["leaked"] == 0
    finally:
        p2.close()
        eng.close()
    assert pool.slot_accounting()["leaked"] == 0
