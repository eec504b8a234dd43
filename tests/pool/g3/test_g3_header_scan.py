"""G3 warm restart without a journal: slab files no journal covers are indexed from their slot headers
(``pool/g3/scan.py``; docs/format.md "Where the journal is").

Before, losing the journal (the drive holding it failed and was taken out of ``g3.paths``, the file removed or
damaged) was a cold start for every directory. Real pools, real slab files in tmp_path, the real posix engine;
every served block's bytes are checked against what was written for its key.
"""
from __future__ import annotations

import os

import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from tests.pool.g3.test_g3_path_order import _open, _served  # a pool on dirs; served bytes checked
from kvbm_backend.model import frame

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

BB = LAYOUT.bytes_per_block
SLOT = frame.slot_bytes(BB)
JOURNAL = f"journal-{NS.fingerprint}.log"


def _put(pool, seqs, tenant=""):
    keys = NS.keys(seqs, tenant=tenant)
    res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
    assert res.written == len(keys), res
    return keys


@pytest.fixture
def dirs(tmp_path):
    out = [tmp_path / n for n in ("a", "b", "c")]
    for d in out:
        d.mkdir(mode=0o700)
    return out


def test_the_journal_drive_taken_out_keeps_the_other_drives_blocks(dirs, caplog):
    """The drive holding the journal fails and is removed from g3.paths: the other drives' blocks are
    found by their headers, served with their bytes, journaled again (the next restart needs no scan)."""
    a, b, c = dirs
    with _open([a, b, c]) as pool:
        keys = _put(pool, range(1, 151))
        where = {k: pool.slabs.by_index[pool.index.get(k)[0]].directory for k in keys}
    assert (a / JOURNAL).exists()
    kept = [k for k in keys if where[k] != str(a)]
    assert 0 < len(kept) < 150
    with _open([b, c]) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == st["restored_by_scan"] == len(kept), st
        assert st["restore_scanned_slots"] >= len(kept)
        assert _served(pool, keys) == [k in kept for k in keys]
        assert pool.slot_accounting()["leaked"] == 0
        more = _put(pool, range(500, 540))  # the restored pool takes writes (free slots were right)
    assert "not covered by a journal" in caplog.text
    assert (b / JOURNAL).exists()
    with _open([c, b]) as pool:
        st = pool.stats()
        assert st["restored_by_scan"] == 0 and st["restored_blocks"] == len(kept) + 40, st
        assert _served(pool, kept + more) == [True] * (len(kept) + 40)


@pytest.mark.parametrize("damage", ["removed", "foreign_header"])
def test_a_lost_or_damaged_journal_is_rebuilt_from_the_headers_oldest_first(dirs, damage):
    """One directory, its journal removed or its header damaged: every block is found again, tenants kept
    apart, and the LRU order is the write order (the oldest block is evicted first)."""
    a = dirs[0]
    with _open([a]) as pool:
        keys = _put(pool, range(1, 41)) + _put(pool, range(41, 61), tenant="acme")
    if damage == "removed":
        os.unlink(a / JOURNAL)
    else:
        data = bytearray((a / JOURNAL).read_bytes())
        data[9] ^= 0xFF  # inside the namespace fingerprint: another namespace's journal
        (a / JOURNAL).write_bytes(bytes(data))
    with _open([a]) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == st["restored_by_scan"] == 60, st
        assert _served(pool, keys) == [True] * 60
        assert _served(pool, NS.keys(range(41, 61), tenant="other")) == [False] * 20  # the tag binds the tenant
        assert _served(pool, NS.keys(range(1, 41), tenant="acme")) == [False] * 40
        assert [k.seq_hash for k, _ in pool.index.items()] == list(range(1, 61))  # write order
        assert pool.slot_accounting()["leaked"] == 0


def test_deleted_blocks_do_not_come_back_from_a_scan(dirs):
    a = dirs[0]
    with _open([a]) as pool:
        keys = _put(pool, range(1, 31))
        assert pool.delete(keys[:10]).result(timeout=HANG_S) == 10
    os.unlink(a / JOURNAL)
    with _open([a]) as pool:
        assert pool.stats()["restored_by_scan"] == 20
        assert _served(pool, keys) == [False] * 10 + [True] * 20


def test_damaged_slots_are_skipped_or_missed_never_served(dirs):
    """A slot whose header is damaged is not indexed; one whose payload is damaged is indexed (its header
    checks) but its get misses and it is dropped; a frame of another namespace is ignored; a key found in
    two slots is indexed once and the other slot is free."""
    a = dirs[0]
    with _open([a], files_per_path=1) as pool:
        keys = _put(pool, range(1, 21))
        slot = {k: pool.index.get(k) for k in keys}
    slab = next(a.glob("g3-*.slab"))
    with open(slab, "r+b") as f:
        f.seek(slot[keys[0]][1] * SLOT + 40)  # header: the sequence hash (its own check fails)
        f.write(b"\xff")
        f.seek(slot[keys[1]][1] * SLOT + frame.HEADER_BYTES + 100)  # payload
        f.write(b"\xff")
        f.seek(slot[keys[2]][1] * SLOT)
        dup = f.read(SLOT)  # keys[2]'s frame copied to a slot past the last one
        end = max(s for _, s in slot.values()) + 1
        f.seek(end * SLOT)
        f.write(dup)
    os.unlink(a / JOURNAL)
    with _open([a], files_per_path=1) as pool:
        st = pool.stats()
        assert st["restored_by_scan"] == 19, st
        assert _served(pool, keys) == [False, False] + [True] * 18
        assert pool.stats()["corrupt"] >= 1 and not pool.contains(keys[1])
        acc = pool.slot_accounting()
        assert acc["leaked"] == 0 and acc["used"] == 18, acc  # 20 - header damaged - payload damaged
    other = type(NS)(model="test/other", layout=LAYOUT)
    with open_pool(a, ns=other, files_per_path=1) as pool:  # another namespace's files: none of ours indexed
        assert pool.stats()["restored_blocks"] == 0


def test_a_write_cancelled_by_delete_and_a_corrupt_block_do_not_come_back(dirs, monkeypatch):
    """Reviewer (2026-11-30): a put still being written when delete() cancelled it was released with its frame
    intact, and a block dropped as corrupt kept its header: a scan without the journal found both again (the
    corrupt one to be dropped again). Both headers are zeroed before their slots are released now."""
    import threading
    import kvbm_backend.pool.g3.pool as g3pool
    a = dirs[0]
    gate, entered = threading.Event(), threading.Event()
    real = g3pool.fdatasync

    def slow_sync(fd):
        entered.set()  # the frames are written: the barrier waits until the delete ran
        gate.wait(HANG_S)
        real(fd)
    with _open([a], files_per_path=1) as pool:
        kept = _put(pool, range(1, 11))
        monkeypatch.setattr(g3pool, "fdatasync", slow_sync)
        keys = NS.keys(range(100, 108))
        fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
        assert entered.wait(HANG_S)
        assert pool.delete(keys).result(timeout=HANG_S) == 0  # none held yet: the write in flight is cancelled
        gate.set()
        res = fut.result(timeout=HANG_S)
        assert res.written == 0, res
        monkeypatch.setattr(g3pool, "fdatasync", real)
        bad = kept[0]
        slot = pool.index.get(bad)
    slab = next(a.glob("g3-*.slab"))
    with open(slab, "r+b") as f:
        f.seek(slot[1] * SLOT + frame.HEADER_BYTES + 10)  # a payload byte: the header still checks
        f.write(b"\xff")
    with _open([a], files_per_path=1) as pool:
        assert _served(pool, kept) == [False] + [True] * 9  # proven corrupt, dropped
    os.unlink(a / JOURNAL)
    with _open([a], files_per_path=1) as pool:
        st = pool.stats()
        assert st["restored_by_scan"] == 9 and st["corrupt"] == 0, st
        assert _served(pool, kept + keys) == [False] + [True] * 9 + [False] * 8


def test_scanned_files_are_made_durable_before_their_blocks_are_published(dirs, monkeypatch):
    """Reviewer (2026-11-30): a frame written but never synced (the worker killed during its barrier) was
    indexed by a scan and named by the rewritten journal without a sync: after a power loss the journal named
    torn slots. Each scanned file is fdatasync'ed before its blocks are indexed; a file whose sync fails
    restores nothing."""
    import kvbm_backend.pool.g3.scan as scan_mod
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 41))
        where = {k: pool.slabs.by_index[pool.index.get(k)[0]].path for k in keys}
    os.unlink(a / JOURNAL)
    synced, real = [], os.fdatasync
    failing = {os.stat(p).st_ino for p in set(where.values()) if p.startswith(str(b))}

    def sync(fd):
        synced.append(os.fstat(fd).st_ino)
        if os.fstat(fd).st_ino in failing:
            raise OSError(5, "EIO (test)")
        real(fd)
    monkeypatch.setattr(scan_mod.os, "fdatasync", sync)
    with _open([a, b]) as pool:
        monkeypatch.setattr(scan_mod.os, "fdatasync", real)
        slabs = {os.stat(f.path).st_ino for f in pool.slabs.files}
        assert slabs <= set(synced)  # every scanned file
        assert _served(pool, keys) == [not where[k].startswith(str(b)) for k in keys]


def _fail_for(real, pred):
    """Wrap an ``os`` call (``os.write`` / ``fdatasync``) so it raises ``OSError`` on the fds ``pred(path)`` names,
    as a failing disk returns it; every other fd is passed through."""
    import errno

    def call(fd, *a):
        if pred(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EIO, "injected I/O error (test)")
        return real(fd, *a)
    return call


@pytest.mark.parametrize("fault", ["journal_append", "slab_fdatasync"])
def test_a_put_that_failed_then_its_key_deleted_does_not_come_back_from_a_scan(dirs, monkeypatch, fault):
    """Reviewer (2026-11-30): a piece whose journal append failed, or whose slab fdatasync failed, released its
    slots with the frames' headers intact (the put counted dropped). The key was then deleted (not held: 0)
    and a restart without the journal found it by its header: a deleted block came back. Each slot a put
    reserved and did not publish has its header zeroed before it is released now."""
    import kvbm_backend.pool.g3.pool as g3pool
    a = dirs[0]
    with _open([a], files_per_path=1) as pool:
        kept = _put(pool, range(1, 11))
        if fault == "journal_append":
            monkeypatch.setattr(os, "write", _fail_for(os.write, lambda p: p.endswith(JOURNAL)))
        else:
            monkeypatch.setattr(g3pool, "fdatasync", _fail_for(g3pool.fdatasync, lambda p: p.endswith(".slab")))
        keys = NS.keys(range(100, 108))
        res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
        monkeypatch.undo()
        assert (res.written, res.dropped) == (0, 8), res
        assert pool.delete(keys).result(timeout=HANG_S) == 0  # not held
        assert pool.slot_accounting()["leaked"] == 0
    os.unlink(a / JOURNAL)
    with _open([a], files_per_path=1) as pool:
        st = pool.stats()
        assert st["restored_by_scan"] == 10, st
        assert _served(pool, kept + keys) == [True] * 10 + [False] * 8
