"""Operator-grade hardening of G3 (issue 10): a full disk never hangs or crashes the metadata path,
odd files in the directory give clear errors, and G3 files are private (modes, no symlink following,
owner/mode checks, tenant ids pseudonymised in the journal).

ENOSPC comes two ways, as in ``test_g3_enospc.py``: a real small tmpfs (needs root and mount rights,
else those tests skip saying so) and a fault hook on the pool's journal (its append/rewrite raise
``OSError(ENOSPC)`` as a full disk makes them), so the paths run on every machine.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import struct
import subprocess
import time

import numpy as np
import pytest
import xxhash

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.model import frame
from kvbm_backend.model.namespace import tenant_tag
from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3 import journal as jr
from kvbm_backend.pool.g3.index import LruIndex, TagKey
from kvbm_backend.pool.g3.slabs import LOCK_NAME, G3PathError

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)
TENANT = "tenant-secret-4242"
JOURNAL = f"journal-{NS.fingerprint}.log"


def _put(pool, seqs, tenant=""):
    keys = NS.keys(seqs, tenant=tenant)
    return keys, pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)


def _get(pool, keys):
    out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
    r = pool.get(keys, out).result(timeout=HANG_S)
    for k, o, ok in zip(keys, out, r.ok):
        if ok:
            assert np.array_equal(o, payload(k.seq_hash))
    return r.ok


class JournalFull:
    """Fault hook: while ``full``, the pool journal's append and rewrite fail with ENOSPC (nothing written)."""

    def __init__(self, pool):
        self.full = False
        self.calls = 0
        j = pool.journal
        real_append, real_rewrite = j.append, j.rewrite

        def append(recs):
            self.calls += 1
            if self.full and recs:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real_append(recs)

        def rewrite(entries):
            self.calls += 1
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real_rewrite(entries)

        j.append, j.rewrite = append, rewrite


# ---- 1. full disk on the metadata path -----------------------------------------------------------
def test_journal_enospc_on_put_drops_unpublished_and_recovers(tmp_path):
    with open_pool(tmp_path) as pool:
        pool.degrade_s = 600  # degraded until the test ends the period (no wall-clock window)
        hook = JournalFull(pool)
        ok_keys, r = _put(pool, range(1, 11))
        assert r.written == 10
        free0 = pool.slot_accounting()["free"]
        hook.full = True
        keys, r = _put(pool, range(100, 120))  # resolves (it used to hang), nothing published
        assert (r.written, r.dropped) == (0, 20)
        st = pool.stats()
        assert st["degraded"] and st["dropped_by_reason"] == {"enospc": 20} and st["enospc"] == 1
        assert not any(pool.contains(k) for k in keys)
        acct = pool.slot_accounting()
        assert acct["leaked"] == 0 and acct["reserved"] == 0 and acct["free"] == free0
        _, r = _put(pool, range(200, 205))  # degraded: no admission
        assert r.dropped == 5 and pool.stats()["dropped_by_reason"]["degraded"] == 5
        hook.full = False
        pool.cat.degraded_until = time.monotonic()  # the degrade period is over
        _, r = _put(pool, range(100, 120))  # space back: journal repaired, blocks published
        assert r.written == 20 and not pool.stats()["degraded"]
        assert _get(pool, ok_keys + keys) == [True] * 30
    with open_pool(tmp_path) as pool:  # the repaired journal finds everything
        assert pool.stats()["restored_blocks"] == 30


def test_delete_never_raises_on_journal_enospc_and_journal_is_repaired(tmp_path):
    with open_pool(tmp_path) as pool:
        pool.degrade_s = 0.2
        hook = JournalFull(pool)
        keys, r = _put(pool, range(1, 9))
        assert r.written == 8
        hook.full = True
        assert pool.delete(keys[:3]).result(timeout=HANG_S) == 3  # used to raise ENOSPC
        assert not any(pool.contains(k) for k in keys[:3])  # the index removal stands
        assert pool.stats()["enospc"] >= 1  # the tier degraded (counted: its 0.2 s window may be over on a busy host)
        assert pool.slot_accounting()["leaked"] == 0
        hook.full = False
        time.sleep(0.25)
        _, r = _put(pool, range(50, 52))  # next journal write rewrites it from the index first
        assert r.written == 2
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == 7
        assert _get(pool, keys) == [False] * 3 + [True] * 5


def test_delete_repaired_at_close_when_space_returns(tmp_path):
    with open_pool(tmp_path) as pool:
        hook = JournalFull(pool)
        keys, _ = _put(pool, range(1, 5))
        hook.full = True
        pool.delete(keys[:1]).result(timeout=HANG_S)
        hook.full = False  # no further journal traffic: close() repairs it
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 3 and not pool.contains(keys[0])


def test_get_with_corrupt_slot_resolves_when_journal_is_full(tmp_path):
    with open_pool(tmp_path, load_timeout_s=30.0) as pool:
        hook = JournalFull(pool)
        keys, _ = _put(pool, range(1, 4))
        fi, si = pool.index.get(keys[1])
        with open(pool.slabs.by_index[fi].path, "r+b") as f:
            f.seek(si * SLOT + frame.HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(si * SLOT + frame.HEADER_BYTES + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        hook.full = True
        t0 = time.monotonic()
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
        r = pool.get(keys, out).result(timeout=25)  # the DEL of the corrupt slot cannot be journaled
        # resolved by the load itself, not by the 30 s load bound: < 25 s (was 10; room for the busy CI VM)
        assert time.monotonic() - t0 < 25
        assert r.ok == [True, False, True]
        assert not pool.contains(keys[1]) and pool.stats()["degraded"]
        assert pool.slot_accounting()["leaked"] == 0


def test_open_degraded_when_journal_cannot_be_written(tmp_path, monkeypatch):
    with open_pool(tmp_path) as pool:
        keys, _ = _put(pool, range(1, 6))

    def full(self, entries):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    real = jr.Journal.rewrite
    monkeypatch.setattr(jr.Journal, "rewrite", full)
    monkeypatch.setattr(G3Pool, "degrade_s", 0.2)  # the open itself degrades
    with open_pool(tmp_path) as pool:  # used to raise
        st = pool.stats()
        assert st["degraded"] and st["restored_blocks"] == 5
        assert _get(pool, keys) == [True] * 5  # serves what it has
        _, r = _put(pool, range(10, 12))
        assert r.dropped == 2 and st["journal_records"] >= 0
        monkeypatch.setattr(jr.Journal, "rewrite", real)
        time.sleep(0.25)
        _, r = _put(pool, range(10, 12))
        assert r.written == 2
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 7


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root and mount(8); the injected-ENOSPC tests cover the paths")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip()}); the injected-ENOSPC tests cover the paths")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path):
    """Fill the filesystem (unbuffered writes, smaller and smaller, until not one byte fits)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\xff" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_real_full_disk_journal_put_delete_reopen(tmpfs):
    """A 16 MiB tmpfs filled by someone else: slab writes into already-grown space still succeed, but
    the journal cannot grow: the put resolves with drops, delete does not raise, the tier degrades; a
    reopen on the full disk (namespace and lock files gone too) opens degraded and serves its blocks;
    when space returns everything recovers (the journal is rewritten from the index) and a restart finds
    exactly the published blocks. A delete sticks even while its DEL record cannot be journaled: the slot's
    header is zeroed first (scan.clear_headers), so the journal's PUT no longer checks."""
    d = tmpfs / "g3"
    filler = tmpfs / "filler"
    kw = dict(capacity_gb=1.0, files_per_path=1, min_free_fraction=0.0)
    with open_pool(d, **kw) as pool:
        pool.degrade_s = 0.2
        keys, r = _put(pool, range(1, 5))
        assert r.written == 4
        _fill(filler)
        keys2, r = _put(pool, range(100, 200))  # 100 journal records: more than a page
        assert r.written + r.dropped == 100 and r.dropped > 0
        assert pool.stats()["enospc"] >= 1  # the tier degraded (counted: its 0.2 s window may be over on a busy host)
        assert pool.slot_accounting()["leaked"] == 0
        assert pool.delete(keys[:1]).result(timeout=HANG_S) == 1
        written = [k for k in keys2 if pool.contains(k)]
    # restarted while still full: the journal tail is whole (cut back after the failed append); the
    # delete's DEL record could not be written, but the deleted block's header is gone: not found again
    with open_pool(d, **kw) as pool:
        st = pool.stats()
        # the DEL went to the old journal (a journal marked for repair still takes appends while the repair is
        # written off the lock, since 2026-12-01) where its page had room, else its zeroed header drops it
        assert st["restored_blocks"] == 3 + len(written), st
        assert st["restore_dropped_by_reason"] in ({"magic": 1}, {}), st
        assert not pool.contains(keys[0]) and pool.delete(keys[:1]).result(timeout=HANG_S) == 0
    os.unlink(d / "namespace.json")
    os.unlink(d / LOCK_NAME)
    _fill(tmpfs / "filler2")
    G3Pool.degrade_s, saved = 0.2, G3Pool.degrade_s  # the open itself degrades
    try:
        pool = open_pool(d, **kw)  # used to raise ENOSPC
    finally:
        G3Pool.degrade_s = saved
    pool.degrade_s = 0.2
    with pool:
        st = pool.stats()
        # the open met ENOSPC and degraded the tier (counted: the 0.2 s window itself may be over by now on a busy
        # host, where this asserted st["degraded"] and failed once, CI 2026-12-02)
        assert st["enospc"] >= 1, st
        assert st["restored_blocks"] == 3 + len(written), st
        assert _get(pool, keys) == [False] + [True] * 3  # serves what it has
        assert pool.delete(keys[1:2]).result(timeout=HANG_S) == 1
        _, r = _put(pool, range(500, 510))
        assert r.dropped == 10 and r.written == 0
        filler.unlink()
        (tmpfs / "filler2").unlink()
        time.sleep(0.25)
        _, r = _put(pool, range(500, 510))
        assert r.written == 10 and not pool.stats()["degraded"]
        assert (d / "namespace.json").read_text().strip() == NS.canonical_json()
    with open_pool(d, **kw) as pool:
        assert pool.stats()["restored_blocks"] == 12 + len(written)
        assert _get(pool, keys) == [False, False, True, True]


# ---- 2. odd files where G3 expects its own -------------------------------------------------------
def test_non_utf8_namespace_json_is_replaced_with_a_warning(tmp_path, caplog):
    tmp_path.joinpath("namespace.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    with caplog.at_level(logging.WARNING), open_pool(tmp_path) as pool:
        _, r = _put(pool, range(1, 3))
        assert r.written == 2
    assert str(tmp_path / "namespace.json") in caplog.text and "not UTF-8" in caplog.text
    assert (tmp_path / "namespace.json").read_text().strip() == NS.canonical_json()


def test_journal_path_that_is_a_directory_gives_a_clear_error(tmp_path):
    (tmp_path / JOURNAL).mkdir()
    with pytest.raises(jr.JournalPathError, match=f"{tmp_path / JOURNAL} is a directory"):
        open_pool(tmp_path)
    (tmp_path / JOURNAL).rmdir()
    with open_pool(tmp_path) as pool:  # the failed open released the lock
        assert _put(pool, range(1, 3))[1].written == 2


def test_namespace_json_that_is_a_directory_gives_a_clear_error(tmp_path):
    (tmp_path / "namespace.json").mkdir()
    with pytest.raises(G3PathError, match=f"{tmp_path / 'namespace.json'} is a directory"):
        open_pool(tmp_path)


# ---- 3. private files --------------------------------------------------------------------------
def _mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_created_directory_and_files_are_private(tmp_path):
    d = tmp_path / "a" / "g3"
    with open_pool(d) as pool:
        _put(pool, range(1, 3))
        assert _mode(d) == 0o700
        names = sorted(os.listdir(d))
        assert JOURNAL in names and LOCK_NAME in names and "namespace.json" in names
        assert any(n.endswith(".slab") for n in names)
        for n in names:
            assert _mode(d / n) == 0o600, n


def test_old_world_readable_files_are_narrowed(tmp_path):
    with open_pool(tmp_path) as pool:
        _put(pool, range(1, 3))
    for n in os.listdir(tmp_path):
        os.chmod(tmp_path / n, 0o644)
    with open_pool(tmp_path) as pool:
        _put(pool, range(3, 5))
    for n in os.listdir(tmp_path):
        assert _mode(tmp_path / n) == 0o600, n


@pytest.mark.parametrize("name", [LOCK_NAME, f"g3-{NS.fingerprint}-0.slab", JOURNAL, "namespace.json"])
def test_planted_symlink_is_refused_and_target_untouched(tmp_path, name):
    d = tmp_path / "g3"
    d.mkdir(mode=0o700)
    target = tmp_path / "precious"
    target.write_bytes(b"do not touch" * 1000)
    before = target.read_bytes()
    os.symlink(target, d / name)
    exc = jr.JournalPathError if name == JOURNAL else G3PathError
    with pytest.raises(exc, match="symbolic link") as ei:
        open_pool(d)
    assert str(d / name) in str(ei.value)
    assert target.read_bytes() == before and _mode(target) == _mode(target)
    assert os.path.islink(d / name)


def test_group_writable_directory_is_refused(tmp_path):
    d = tmp_path / "g3"
    d.mkdir()
    os.chmod(d, 0o775)
    with pytest.raises(G3PathError, match=f"chmod 700 {d}"):
        open_pool(d)
    os.chmod(d, 0o700)
    with open_pool(d) as pool:
        assert _put(pool, range(1, 2))[1].written == 1


def test_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "g3"
    d.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    os.chown(d, 65534, 65534)
    with pytest.raises(G3PathError, match=f"{d} is owned by uid 65534"):
        open_pool(d)


def test_journal_holds_no_tenant_string_and_restart_finds_blocks(tmp_path):
    with open_pool(tmp_path) as pool:
        keys, r = _put(pool, range(1, 21), tenant=TENANT)
        plain, _ = _put(pool, range(1, 6))
        assert r.written == 20
        pool.delete(keys[:2]).result()
    data = (tmp_path / JOURNAL).read_bytes()
    assert data[:8] == jr.FILE_MAGIC
    assert TENANT.encode() not in data and b"secret" not in data
    assert tenant_tag(TENANT) in data
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 23
        assert plain[0] in pool.keys()  # the unsalted tenant is resolved at restore
        assert pool.lookup_prefix(keys[2:]).result() == 18  # found by the real keys (adopted by tag)
        assert _get(pool, keys) == [False] * 2 + [True] * 18
        assert set(keys[2:]) <= set(pool.keys())
        assert not pool.contains(NS.key(5, tenant="another-tenant"))
        pool.delete(keys[2:4]).result()
    assert TENANT.encode() not in (tmp_path / JOURNAL).read_bytes()
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 21
        assert _get(pool, keys[2:6]) == [False, False, True, True]


def test_restored_tag_entries_evict_and_delete_without_being_seen(tmp_path):
    with open_pool(tmp_path) as pool:
        keys, _ = _put(pool, range(1, 11), tenant=TENANT)
    with open_pool(tmp_path) as pool:
        tagged = [k for k in pool.keys() if isinstance(k, TagKey)]
        assert len(tagged) == 10 and all(k.tenant.startswith("<tenant tag ") for k in tagged)
        assert pool.delete(keys[:1]).result() == 1
        assert pool.slot_accounting()["leaked"] == 0
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 9


def test_index_adoption_keeps_accounting():
    ix = LruIndex()
    k = NS.key(7, tenant=TENANT)
    tk = TagKey(k.namespace, tenant_tag(TENANT), k.rank, k.seq_hash)
    ix.restore(tk, (0, 1))
    ix.restore(TagKey(k.namespace, tenant_tag(""), 0, 8), (0, 2))
    assert NS.key(8) in ix  # known tag: a BlockKey at once
    assert ix.get(k) == (0, 1) and k in dict(ix.items())
    assert ix.remove(k) == (0, 1) and len(ix) == 1
    ix.restore(tk, (0, 3))
    assert [s for _, s in ix.evict(5)] == [(0, 2), (0, 3)] and len(ix) == 0


def test_version_1_journal_is_read_and_rewritten_as_version_2(tmp_path):
    with open_pool(tmp_path) as pool:
        keys, _ = _put(pool, range(1, 6), tenant=TENANT)
        where = {k: pool.index.get(k) for k in keys}
    recs = [jr.FILE_MAGIC_V1 + bytes.fromhex(NS.fingerprint)]
    for k in keys:
        t = k.tenant.encode()
        body = struct.pack("<BHIQIH", jr.PUT, where[k][0], where[k][1], k.seq_hash, k.rank, len(t)) + t
        recs.append(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
    (tmp_path / JOURNAL).write_bytes(b"".join(recs))
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 5
        assert set(keys) <= set(pool.keys())  # v1 names tenants: BlockKeys at once
        assert _get(pool, keys) == [True] * 5
    data = (tmp_path / JOURNAL).read_bytes()
    assert data[:8] == jr.FILE_MAGIC and TENANT.encode() not in data


def test_a_put_drops_only_its_keys_no_slot_can_hold(tmp_path):
    """A put batching valid keys with one no slot can hold (seq_hash >= 2**64 or negative, rank >= 2**32, a
    float seq_hash) writes the valid ones and drops only that key (``invalid_key``), as G4 does. Before, the
    bad key failed its whole piece in the writer (frame/journal packing): every valid key batched with it
    was dropped ("write failed"), or the put raised (a float)."""
    from kvbm_backend.model.namespace import BlockKey
    with open_pool(tmp_path) as pool:
        n = 0
        for bad in (BlockKey(pool.fp, "", 0, 1 << 64), BlockKey(pool.fp, "", 0, -5), BlockKey(pool.fp, "", 1 << 32, 7),
                    BlockKey(pool.fp, "", 0, 2.5)):
            good = NS.keys(range(n + 1, n + 4))
            n += 3
            r = pool.put([bad] + good, [payload(1)] + [payload(k.seq_hash) for k in good]).result(timeout=HANG_S)
            assert (r.written, r.dropped, r.skipped) == (3, 1, 0), (bad, r)
            out = [np.zeros_like(payload(0)) for _ in good]
            assert all(pool.get(good, out).result(timeout=HANG_S).ok)
            assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, good))
        st = pool.stats()
        assert st["dropped_by_reason"] == {"invalid_key": 4} and st["write_errors"] == 0, st
        assert pool.slot_accounting()["leaked"] == 0 and len(pool.keys()) == n
