"""G3 warm restart when a slot header read fails (``pool/g3/scan.py`` :func:`read_headers`).

Review of 2026-11-30: restart read each journaled slot's header once; one transient EIO (a flaky sector, a
device-path hiccup) dropped that block (``restore:io_error``) and the rewritten journal freed its slot, so the
block was lost for good. Now a failed header read is retried (``HEADER_READ_TRIES`` reads in all, no sleep): one
flaky read keeps the block; a header that never reads is dropped as before. Real pools and slab files in
tmp_path; the fault is injected at the OS boundary (``os.preadv`` of that one slot's header raises EIO).
"""
from __future__ import annotations

import errno
import os

from tests.helpers.crash_writer import NS, open_pool, payload
from tests.pool.g3.test_g3_path_order import _served  # served bytes checked against the key's payload
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g3.scan import HEADER_READ_TRIES

HANG_S = 600.0  # a hang guard, not a bound


def _stored(tmp_path):
    """A pool's 20 blocks written and the pool closed; returns the keys and (slab path, header offset) of one."""
    keys = NS.keys(range(1, 21))
    with open_pool(tmp_path) as pool:
        res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
        assert res.written == 20, res
        fi, si = pool.index.get(keys[7])
        where = (os.path.realpath(pool.slabs.by_index[fi].path), si * pool.cat.slot_bytes)
    return keys, where


def _eio_on_header(monkeypatch, where, times):
    """``os.preadv`` of exactly the header at ``where`` raises EIO ``times`` times (None: always); counts reads."""
    real = os.preadv
    seen = {"reads": 0, "failed": 0}

    def preadv(fd, bufs, off, *a):
        n = sum(memoryview(b).nbytes for b in bufs)
        if off == where[1] and n == HEADER_BYTES:
            try:
                hit = os.readlink(f"/proc/self/fd/{fd}") == where[0]
            except OSError:
                hit = False
            if hit:
                seen["reads"] += 1
                if times is None or seen["failed"] < times:
                    seen["failed"] += 1
                    raise OSError(errno.EIO, "injected read error")
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


def test_one_failed_header_read_at_restart_keeps_the_block(tmp_path, monkeypatch):
    """Before the fix: the restart dropped the block whose header read failed once (restore_dropped 1,
    restore:io_error 1) and the next restart did not have it either. Now it is re-read, restored, served with its
    bytes, and journaled again."""
    keys, where = _stored(tmp_path)
    seen = _eio_on_header(monkeypatch, where, times=1)
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 0 and st["restore_dropped_by_reason"] == {}, st
        assert seen == {"reads": 2, "failed": 1}, seen
        assert st["restored_blocks"] == 20 and st["restore_header_retries"] == 1, st
        assert _served(pool, keys) == [True] * 20
        assert pool.slot_accounting()["leaked"] == 0
    monkeypatch.undo()
    with open_pool(tmp_path) as pool:  # the rewritten journal still names it
        assert pool.stats()["restored_blocks"] == 20
        assert _served(pool, keys) == [True] * 20


def test_a_header_that_never_reads_is_dropped_after_bounded_retries(tmp_path, monkeypatch):
    """A slot whose header read fails every time is dropped (restore:io_error), after HEADER_READ_TRIES reads
    (not forever); the other 19 blocks are restored and served, and the pool takes writes."""
    keys, where = _stored(tmp_path)
    seen = _eio_on_header(monkeypatch, where, times=None)
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert seen["reads"] == HEADER_READ_TRIES == 3, seen
        assert st["restore_dropped"] == 1 and st["restore_dropped_by_reason"] == {"io_error": 1}, st
        assert st["restored_blocks"] == 19 and st["restore_header_retries"] == 1, st
        assert _served(pool, keys) == [k != keys[7] for k in keys]
        assert pool.slot_accounting()["leaked"] == 0
