"""G3 warm restart when a slot header read fails (``pool/g3/scan.py`` :func:`read_headers`).

Review of 2026-11-30: restart read each journaled slot's header once; one transient EIO (a flaky sector, a
device-path hiccup) dropped that block (``restore:io_error``) and the rewritten journal freed its slot, so the
block was lost for good. Then a failed header read was retried at once (``HEADER_READ_TRIES`` reads in all, no
sleep). Review of 2026-12-01 (finding 3): an outage of a few ms fails all three back-to-back reads, and the block
was still dropped for good. Now the header is re-read with backoff for up to ``HEADER_RETRY_WINDOW_S``, and a
header still unread after that keeps its block unverified (indexed, journaled, its slot kept:
``restore_unverified``); every load verifies it, and one that stays unreadable goes by the runtime policy
(``read/unreadable.py``). Only a header that reads and is wrong drops a block at open. Real pools and slab files
in tmp_path; the fault is injected at the OS boundary (``os.preadv`` of slot headers raises EIO).
"""
from __future__ import annotations

import errno
import os

from tests.helpers.crash_writer import NS, config, open_pool, payload
from tests.pool.g3.test_g3_path_order import _served  # served bytes checked against the key's payload
from tests.helpers.eio import slot_eio
from kvbm_backend.metrics import new_registry
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3 import scan
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


def _eio_outage(monkeypatch, n_reads):
    """An outage of the slab files' device path: the first ``n_reads`` slot-header reads (4 KiB ``os.preadv`` of a
    ``.slab`` file) raise EIO, every later one reads; counts reads and failures."""
    real = os.preadv
    seen = {"reads": 0, "failed": 0}

    def preadv(fd, bufs, off, *a):
        if sum(memoryview(b).nbytes for b in bufs) == HEADER_BYTES:
            try:
                slab = os.readlink(f"/proc/self/fd/{fd}").endswith(".slab")
            except OSError:
                slab = False
            if slab:
                seen["reads"] += 1
                if seen["failed"] < n_reads:
                    seen["failed"] += 1
                    raise OSError(errno.EIO, "injected device path outage")
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


def test_an_outage_longer_than_the_immediate_reads_loses_no_block(tmp_path, monkeypatch):
    """The reviewer's repro (r7_restart_hiccup_destroys, finding 3 of 2026-12-01), by read count instead of time:
    every header read fails until 70 have (the 3 immediate reads of all 20 slots, then 10 more). Before the fix
    every block was dropped (restore:io_error 20), the journal rewritten without them and their slots freed, and
    the next healthy restart had none either. Now the headers are read again after a pause: all 20 restored,
    verified (none left unverified) and served with their bytes, also after the next restart."""
    keys, _ = _stored(tmp_path)
    seen = _eio_outage(monkeypatch, 20 * HEADER_READ_TRIES + 10)
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 0 and st["restore_dropped_by_reason"] == {}, st
        assert seen["failed"] == 70 and seen["reads"] == 70 + 20, seen
        assert st["restored_blocks"] == 20 and st["restore_unverified"] == 0, st
        assert st["restore_header_retries"] == 20, st
        assert _served(pool, keys) == [True] * 20
        assert pool.slot_accounting()["leaked"] == 0
    monkeypatch.undo()
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == 20 and st["restored_by_scan"] == 0, st
        assert _served(pool, keys) == [True] * 20


def test_a_header_that_never_reads_keeps_its_block_unverified_after_bounded_retries(tmp_path, monkeypatch):
    """A slot whose header read fails every time is re-read for a bounded window (shortened here), then kept:
    indexed unverified (restore_unverified 1, nothing dropped), its slot not handed out, its record in the
    rewritten journal. Before the fix it was dropped (restore:io_error) and its slot freed. The other 19 blocks
    are served. While its reads still fail, a load misses (never wrong KV) and the runtime policy keeps it
    (unreadable_kept); once the device reads again, a restart verifies it and serves its exact bytes."""
    monkeypatch.setattr(scan, "HEADER_RETRY_WINDOW_S", 1.0, raising=False)  # new in the fix
    keys, where = _stored(tmp_path)
    seen = _eio_on_header(monkeypatch, where, times=None)
    with G3Pool(config(tmp_path, engine="posix"), NS, registry=new_registry()) as pool:  # reads: os.preadv
        st = pool.stats()
        pause, rounds, slept = scan.HEADER_RETRY_PAUSE_S[0], 0, 0.0
        while slept < 1.0:  # the most re-read rounds the window allows (each sleeps its pause or what is left)
            slept, pause, rounds = slept + pause, min(pause * 2, scan.HEADER_RETRY_PAUSE_S[1]), rounds + 1
        assert HEADER_READ_TRIES < seen["reads"] <= HEADER_READ_TRIES + rounds, (seen, rounds)
        assert st["restore_dropped"] == 0 and st["restore_dropped_by_reason"] == {}, st
        assert st["restored_blocks"] == 20 and st["restore_unverified"] == 1, st
        assert st["restore_header_retries"] == 1, st
        slot = pool.index.get(keys[7])
        assert slot is not None and slot[1] not in pool.slabs.by_index[slot[0]].free, slot
        assert pool.slot_accounting()["leaked"] == 0
        assert _served(pool, [k for k in keys if k != keys[7]]) == [True] * 19
        with monkeypatch.context() as mp:  # its reads fail at runtime too: a miss, and the block is kept
            slot_eio(mp, pool, keys[7])
            assert _served(pool, [keys[7]]) == [False]
            assert pool.drop_unreadable([keys[7]]).result(timeout=HANG_S) == 0
        st = pool.stats()
        assert pool.contains(keys[7]) and st["unreadable_kept"] == 1 and st["deleted"] == 0, st
    monkeypatch.undo()
    with open_pool(tmp_path) as pool:  # the rewritten journal still names it; now its header reads and checks
        st = pool.stats()
        assert st["restored_blocks"] == 20 and st["restore_unverified"] == 0, st
        assert _served(pool, keys) == [True] * 20


def test_a_header_that_reads_and_is_wrong_still_drops_its_block_at_open(tmp_path):
    """Only a proof drops a block at open: a zeroed header (as a delete leaves it) reads back and fails the
    check, so its block is dropped (restore:magic) and its slot reused; the others are served."""
    keys, where = _stored(tmp_path)
    fd = os.open(where[0], os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(HEADER_BYTES), where[1])
    finally:
        os.close(fd)
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 1 and st["restore_dropped_by_reason"] == {"magic": 1}, st
        assert st["restored_blocks"] == 19 and st["restore_unverified"] == 0, st
        assert _served(pool, keys) == [k != keys[7] for k in keys]
