"""Invariant 4: capacity is real; ENOSPC releases every reservation and degrades the tier.

Two tests: one on a real small filesystem (a tmpfs mounted with ``size=``; needs root and mount
rights, else it skips saying so), and one where ENOSPC is injected at the engine boundary (a real
posix engine subclass whose writes fail with ``OSError(ENOSPC)``, as a full disk would make them)
so the write-error path runs on every machine.
"""
from __future__ import annotations

import errno
import os
import time
from concurrent.futures import Future

import numpy as np
import pytest

from tests.helpers.tmpfs import mounted_tmpfs
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.model import frame
from kvbm_backend.pool.g3.slabs import fs_space

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

pytestmark = [pytest.mark.slow]

SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)


class EnospcEngine(PosixEngine):
    """Posix engine whose writes fail with ENOSPC while ``full`` is set (injected at the engine boundary)."""

    full = True

    def submit(self, ops):
        ops = list(ops)
        if self.full and ops and ops[0].write:
            f: Future = Future()
            f.set_exception(OSError(errno.ENOSPC, "No space left on device (injected)"))
            return f
        return super().submit(ops)


def _fill(path):
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\xff" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def _put(pool, seqs):
    keys = NS.keys(seqs)
    return keys, pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)


def test_injected_enospc_releases_reservations_and_degrades(tmp_path):
    """ENOSPC injected at the engine boundary (see module doc)."""
    eng = EnospcEngine(threads=4)
    try:
        with open_pool(tmp_path, engine=eng) as pool:
            pool.degrade_s = 600  # degraded until the test ends the period (no wall-clock window)
            eng.full = False
            ok_keys, r = _put(pool, range(1, 11))
            assert r.written == 10
            acct0 = pool.slot_accounting()
            eng.full = True
            keys, r = _put(pool, range(100, 140))  # no exception reaches the caller
            assert (r.written, r.dropped) == (0, 40)
            st = pool.stats()
            assert st["enospc"] == 1 and st["degraded"] and st["dropped_by_reason"] == {"enospc": 40}
            acct = pool.slot_accounting()
            assert acct["leaked"] == 0 and acct["reserved"] == 0 and acct["used"] == 10
            assert acct["free"] == acct0["free"]  # every reservation of the failed batch came back
            assert not any(pool.contains(k) for k in keys)
            _, r = _put(pool, range(200, 205))  # degraded: not admitted, counted
            assert r.dropped == 5 and pool.stats()["dropped_by_reason"]["degraded"] == 5
            eng.full = False
            pool.cat.degraded_until = time.monotonic()  # the degrade period is over
            _, r = _put(pool, range(100, 140))  # recovered after the degrade period
            assert r.written == 40 and not pool.stats()["degraded"]
            assert pool.lookup_prefix(ok_keys).result() == 10
            assert pool.slot_accounting()["leaked"] == 0
    finally:
        eng.close()


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs (:func:`tests.helpers.tmpfs.mounted_tmpfs`)."""
    with mounted_tmpfs(tmp_path / "mnt", "4m", why_skip="the injected-ENOSPC test covers the path") as mnt:
        yield mnt


def test_real_small_filesystem_full(small_fs):
    """A 4 MiB tmpfs: capacity follows free space; when another writer fills the disk, growth fails
    with ENOSPC (the statvfs re-check before growing), the batch's reservations are released, the
    tier degrades, callers see drops; when space returns, offloads are admitted again."""
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=1, min_free_fraction=0.0) as pool:
        pool.degrade_s = 0.2
        avail, total = fs_space(str(small_fs))
        assert pool.stats()["capacity_bytes"] <= total < 1e9  # the filesystem's size, not the configured 1 GB
        _, r = _put(pool, range(1, 5))
        assert r.written == 4
        filler = small_fs / "filler"
        _fill(filler)  # someone else fills the filesystem
        # the slab file grew lazily (1/8 of its share), so these need growth: refused, ENOSPC
        keys, r = _put(pool, range(1000, 1000 + 400))
        assert r.written + r.dropped == 400 and r.dropped > 0
        st = pool.stats()
        assert st["enospc"] >= 1 or st["dropped_by_reason"].get("no_space", 0) > 0
        acct = pool.slot_accounting()
        assert acct["leaked"] == 0 and acct["reserved"] == 0
        used_by_pool = sum(os.stat(f.path).st_size for f in pool.slabs.files)
        assert used_by_pool <= total
        filler.unlink()
        time.sleep(0.25)
        _, r = _put(pool, range(5000, 5010))
        assert r.written == 10, pool.stats()
        assert pool.slot_accounting()["leaked"] == 0


def test_reopen_on_a_full_disk_keeps_every_verified_block(small_fs):
    """Fault campaign finding: reopened on a filesystem another writer filled, a pool with several slab
    files dropped acknowledged blocks 'for capacity' (each file was cut to an even share of the tiny
    free-space budget, though its space is already the pool's). Every block must come back."""
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=2) as pool:
        keys, r = _put(pool, range(1, 41))
        assert r.written == 40
    _fill(small_fs / "filler")
    with open_pool(d, capacity_gb=1.0, files_per_path=2) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == 40 and st["restore_dropped"] == 0, st
        import numpy as np
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
        assert pool.get(keys, out).result(timeout=HANG_S).ok == [True] * 40
        assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))


def test_min_free_fraction_zero_fills_its_filesystem_and_keeps_working(small_fs):
    """Fault campaign finding: with min_free_fraction 0 slabs took the whole filesystem, then every
    journal append failed: degraded for good, nothing evicted. Slabs now leave a metadata reserve, so
    the pool evicts and keeps storing."""
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=2, min_free_fraction=0.0) as pool:
        pool.degrade_s = 0.1
        written_late = 0
        for b in range(40):  # far more than fits
            _, r = _put(pool, range(1000 + 32 * b, 1000 + 32 * (b + 1)))
            if b >= 30:
                written_late += r.written
            time.sleep(0.02)
        st = pool.stats()
        assert written_late > 0, st  # still storing once the filesystem is full of slabs
        assert st["evictions"] > 0 and pool.slot_accounting()["leaked"] == 0, st


def test_capacity_comes_back_when_space_returns_after_the_degradation_ended(small_fs, monkeypatch):
    """Review finding (2026-11-29): after a growth ENOSPC a file's cap was raised only when a degradation
    ended; if the disk was still short then, no growth was tried again, so no ENOSPC, no degradation and no
    re-check: the pool stayed shrunk for the life of the process. And slots reserved above the lowered cap
    were dropped from the free list for good (leaked). Now a short allocation re-reads statvfs (at most every
    ``slabs.RECHECK_SPACE_S``, lowered here) and parked slots are free again once the cap passes them."""
    from kvbm_backend.pool.g3 import slabs
    monkeypatch.setattr(slabs, "RECHECK_SPACE_S", 0.2)
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=1, min_free_fraction=0.0) as pool:
        pool.degrade_s = 0.2
        configured = pool.stats()["capacity_blocks"]
        _, r = _put(pool, range(1, 5))
        assert r.written == 4
        filler = small_fs / "filler"
        _fill(filler)
        with open(filler, "r+b") as f:  # leave the journal room to append, not the slab room to grow
            f.truncate(os.path.getsize(filler) - (256 << 10))
        _, r = _put(pool, range(100, 100 + configured))  # needs growth: refused, the tier degrades
        st = pool.stats()  # the tier degraded (counted: its 0.2 s window may be over on a busy host)
        assert r.dropped > 0 and st["enospc"] >= 1, st
        time.sleep(0.25)
        _, r = _put(pool, range(2000, 2002))  # the degradation ends here, the disk still short: cap stays low
        assert r.written == 2 and pool.stats()["capacity_blocks"] < configured
        filler.unlink()  # space returns
        time.sleep(0.25)
        for b in range(3):
            _, r = _put(pool, range(10_000 * (b + 1), 10_000 * (b + 1) + configured))
        st, acct = pool.stats(), pool.slot_accounting()
        assert st["capacity_blocks"] == configured and r.written == configured, (st, acct)
        assert acct["leaked"] == 0 and acct["used"] == configured, acct  # parked slots are in use again


def test_a_pool_opened_on_a_filled_disk_grows_to_the_space_that_returns(small_fs, monkeypatch):
    """Review finding (2026-11-30): a pool opened while another writer held most of its filesystem took the
    free space of that moment as its configured share (``max_slots``) for the life of the process: once the
    space came back it stayed at that size (nothing ever raised the cap above it), evicting at a fraction of its
    capacity. Now the share stays what ``capacity_gb`` grants, the free space only caps it for now, and the
    space that returns is taken."""
    from kvbm_backend.pool.g3 import slabs
    monkeypatch.setattr(slabs, "RECHECK_SPACE_S", 0.0)
    filler = small_fs / "filler"
    _fill(filler)
    with open(filler, "r+b") as f:  # another writer holds all but ~1 MiB
        f.truncate(os.path.getsize(filler) - (1 << 20))
    with open_pool(small_fs / "g3", capacity_gb=1.0, files_per_path=2, min_free_fraction=0.0) as pool:
        pool.degrade_s = 600  # an ENOSPC would show as drops (before 2026-12-03 the journal's growth cost a batch)
        at_open = pool.stats()["capacity_blocks"]
        assert 0 < at_open < (1 << 20) // SLOT
        filler.unlink()  # the space returns
        for b in range(4):
            _, r = _put(pool, range(10_000 * (b + 1), 10_000 * (b + 1) + 2 * at_open))
        st, acct = pool.stats(), pool.slot_accounting()
        avail, total = fs_space(str(small_fs))
        room = avail - pool.slabs._keep_free(total)
        assert st["capacity_blocks"] > 2 * at_open and st["blocks"] == st["capacity_blocks"], (at_open, st)
        assert st["enospc"] == 0 and st["dropped_by_reason"] == {}, st["dropped_by_reason"]
        assert room < SLOT * len(pool.slabs.files), (room, st)  # the space that came back is the pool's again
        assert acct["leaked"] == 0 and acct["reserved"] == 0, acct


def test_a_recheck_splits_the_room_over_the_files_instead_of_promising_it_to_each(small_fs):
    """Review finding (2026-11-30): re-reading statvfs gave every slab file of a directory the whole free room
    (``g3.files_per_path`` 4: four times the space there is): ``capacity_blocks`` (and the capacity gauge)
    claimed it, and a batch striped over the files found the shortfall by ENOSPC (batch dropped, tier degraded)
    where evicting would have stored it. Now the room is split over the files, and the pool evicts."""
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=4, min_free_fraction=0.0) as pool:
        pool.degrade_s = 600  # an ENOSPC would show as drops for the rest of the test (no wall-clock window)
        _, r = _put(pool, range(1, 9))
        assert r.written == 8
        avail, total = fs_space(str(small_fs))
        keep = pool.slabs._keep_free(total)
        with open(small_fs / "filler", "wb") as f:  # another writer leaves room for 12 slots (and half of one)
            f.write(b"\xff" * (avail - keep - 12 * SLOT - SLOT // 2))
        with pool.cat.lock:
            pool.slabs.recheck_space()
        held = sum(f.size_slots for f in pool.slabs.files)
        room = (fs_space(str(small_fs))[0] - keep) // SLOT
        assert room == 12
        assert pool.stats()["capacity_blocks"] <= held + room, (held, room, pool.stats()["capacity_blocks"])
        keys, r = _put(pool, range(100, 100 + held + room))  # more than fits: the oldest are evicted
        st = pool.stats()
        assert st["enospc"] == 0 and r.written == held + room and st["evictions"] > 0, (r, st)
        assert pool.slot_accounting()["leaked"] == 0


def test_two_paths_on_one_filesystem_split_its_room_at_open(small_fs):
    """Review finding (2026-12-01): the open gave each of two ``g3.paths`` on one filesystem a budget of the
    whole free space (35 MiB promised on a 20 MiB tmpfs; ``recheck_space`` already split it, the open did not),
    so the first fill found the shortfall by ENOSPC: a batch dropped and the tier degraded instead of evicting.
    Now the open splits each filesystem's room over its directories (slab_room.split_room)."""
    from kvbm_backend.pool.g3.slabs import keep_free_bytes
    a, b = small_fs / "a", small_fs / "b"
    with open_pool(a, paths=[str(a), str(b)], capacity_gb=1.0, files_per_path=1, min_free_fraction=0.1) as pool:
        avail, total = fs_space(str(small_fs))
        # the pool's own journal files sit inside what slab files leave free (since 2026-12-03: slab_room.slab_keep_free)
        journals = sum(os.stat(f).st_blocks * 512 for d in (a, b) for f in d.iterdir() if "journal" in f.name)
        room = avail - keep_free_bytes(total, round(1.0e9), SLOT, 0.1) + journals
        st = pool.stats()
        assert 0 < st["capacity_bytes"] <= room, (st["capacity_bytes"], room, total)
        assert {f.directory for f in pool.slabs.files if f.cap_slots} == {str(a), str(b)}  # both got a part


def test_blocks_past_their_share_are_counted_when_the_new_drive_is_full(small_fs, tmp_path):
    """A directory added to ``g3.paths`` on a filesystem another writer filled: the blocks past the old files'
    shrunk shares are kept (slab_share.py, lent by the new files' shares), though the new files cannot grow now.
    The pool's capacity and slot accounting count them: before, ``capacity_blocks`` summed only the caps of
    the files (the new ones at 0) and the accounting showed the kept blocks as leaked (negative)."""
    a, b = str(tmp_path / "a"), str(small_fs / "b")
    keys = NS.keys(range(1, 701))
    with open_pool(a, paths=[a], capacity_gb=0.01, files_per_path=2) as pool:
        for i in range(0, 700, 100):
            _, r = _put(pool, range(1 + i, 101 + i))
            assert r.written == 100
    os.makedirs(b)
    _fill(small_fs / "filler")
    with open_pool(a, paths=[a, b], capacity_gb=0.01, files_per_path=2) as pool:
        st, acct = pool.stats(), pool.slot_accounting()
        assert st["restored_blocks"] == 700 and st["restore_dropped"] == 0, st
        assert not any(f.cap_slots for f in pool.slabs.files if f.directory == b)  # the new drive has no room
        assert acct["leaked"] == 0 and acct["used"] == 700 == st["capacity_blocks"], (acct, st)
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
        assert pool.get(keys, out).result(timeout=HANG_S).ok == [True] * 700


def test_a_lending_file_that_holds_blocks_and_loses_its_room_keeps_the_accounting_whole(small_fs, tmp_path):
    """Merged-review finding F2 (2026-12-01): a new drive's files lend their shares' free slots to the old files'
    blocks past their shrunk shares. Once those lending files hold blocks of their own and their filesystem fills
    (another writer), their caps drop below what they lend: capacity counted ``cap - lent`` (clamped at 0), so the
    lenders' own blocks counted as no capacity (``leaked`` -40, ``capacity_blocks`` below the slots in use). A file
    holds back for its loans at most the free slots it really has."""
    a, b = str(tmp_path / "a"), str(small_fs / "b")
    with open_pool(a, paths=[a], capacity_gb=0.01, files_per_path=2) as pool:
        for i in range(0, 700, 100):
            assert _put(pool, range(1 + i, 101 + i))[1].written == 100
    os.makedirs(b)
    with open_pool(a, paths=[a, b], capacity_gb=0.01, files_per_path=2) as pool:
        assert _put(pool, range(2001, 2041))[1].written == 40
        lenders = [f for f in pool.slabs.files if f.directory == b]
        assert sum(f.lent for f in lenders) and sum(f.next_unused for f in lenders), "no lender holds a block"
        _fill(small_fs / "filler")
        with pool.cat.lock:
            pool.cat.slabs.recheck_space()  # the growth path's statvfs re-read (real, on the full filesystem)
        st, acct = pool.stats(), pool.slot_accounting()
        # blocks at slots a lowered cap left above it stay held and out of both counts (as for any file)
        assert acct["leaked"] == 0 and st["capacity_blocks"] == acct["capacity"] >= acct["used"] > 700, (acct, st)


def test_a_failed_statvfs_while_allocating_loses_no_slot(small_fs, monkeypatch):
    """A pool whose file is capped below its share by the filesystem, full but for 4 deleted slots; a put of 16
    blocks comes up short and re-reads statvfs, which fails (EIO: a soft NFS mount's hiccup). The put evicts for
    what it needs and its blocks are written; no slot is lost, and a later put fills the pool again. Review finding
    2026-12-02: the OSError left the allocation with its slots taken, never reserved, published or released
    (``leaked`` 4, the batch of 16 dropped as ``error``, the pool 4 slots smaller for the life of the process)."""
    from kvbm_backend.pool.g3 import slabs
    with open_pool(small_fs / "g3", capacity_gb=1.0, files_per_path=1) as pool:
        f = pool.slabs.files[0]
        assert f.cap_slots < f.max_slots  # the filesystem, not capacity_gb, bounds it
        n = f.cap_slots
        keys, r = _put(pool, range(1, n + 1))
        assert r.written == n, r
        assert pool.delete(keys[:4]).result(60) == 4 and pool.slot_accounting()["leaked"] == 0

        def failing(d):
            raise OSError(errno.EIO, "Input/output error")
        real = slabs.fs_space
        monkeypatch.setattr(slabs, "fs_space", failing)
        pool.slabs._space_checked = time.monotonic() - 2 * slabs.RECHECK_SPACE_S  # the re-check is due
        _, r = _put(pool, range(10_000, 10_016))
        monkeypatch.setattr(slabs, "fs_space", real)
        acct = pool.slot_accounting()
        assert r.written == 16 and acct["leaked"] == 0, (r, acct, pool.stats())
        _, r = _put(pool, range(20_000, 20_004))
        assert r.written == 4 and pool.slot_accounting()["leaked"] == 0


def test_churn_on_a_small_full_filesystem_keeps_the_journal_within_the_reserve(small_fs):
    """A pool of ~300 slots that fills a 4 MiB tmpfs (``min_free_fraction`` 0: only the metadata reserve stays
    free), then churns: 100 puts of 128 blocks, each evicting the oldest (~13K journal records). The journal is
    compacted within the reserve slab files leave free, the filesystem never fills up, and the last puts are
    written whole. Review finding 2026-12-02: the journal was compacted only past 65,536 records (2.8 MB), so it
    took the reserve and then the last free byte; every append and the repair failed with ENOSPC and the tier
    stayed degraded, every put dropped, until a restart."""
    with open_pool(small_fs / "g3", capacity_gb=1.0, files_per_path=1, min_free_fraction=0.0) as pool:
        pool.degrade_s = 600  # an ENOSPC would show as drops (before 2026-12-03 the journal's growth made one)
        seq = 1
        for _ in range(100):
            _put(pool, range(seq, seq + 128))
            seq += 128
        journal = os.path.getsize(pool.journal.path)
        avail, total = fs_space(str(small_fs))
        st = pool.stats()
        assert avail > 0 and journal < (256 << 10) + 256 * pool.slabs.files[0].cap_slots, (avail, journal, st)
        assert st["enospc"] == 0 and st["dropped_by_reason"] == {}, st["dropped_by_reason"]
        keys, r = _put(pool, range(seq, seq + 8))
        assert r.written == 8, (r, pool.stats()["dropped_by_reason"])
        assert pool.slot_accounting()["leaked"] == 0
