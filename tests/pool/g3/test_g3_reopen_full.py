"""A G3 pool reopened (warm restart) on a filesystem its own slab files fill (invariant 4, capacity is real).

Review finding 2026-12-03: the open split each directory's free-space budget (its slab bytes plus the free room)
evenly over its slab files, whatever each already held: a full file kept its size as its cap (no room), while the
others were promised room the filesystem did not have (the sum of the caps past the files' sizes exceeded the free
space, and ``capacity_blocks`` with it). The first puts after the restart hit ENOSPC: the batch dropped and the tier
degraded instead of evicting. Now the open water-fills only the free part over the files, as ``recheck_space`` does
at runtime. Real small tmpfs (needs root and mount(8), else skipped saying so).
"""
from __future__ import annotations


import numpy as np
import pytest

from tests.helpers.tmpfs import mounted_tmpfs
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.model import frame
from kvbm_backend.pool.g3.slabs import fs_space

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)
BATCH = 64


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (:func:`tests.helpers.tmpfs.mounted_tmpfs`)."""
    with mounted_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _put(pool, seqs):
    keys = NS.keys(seqs)
    return keys, pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)


def _fill_until_evicting(pool, seq: int) -> int:
    """Put batches until the pool evicts (its slab files then hold its filesystem); returns the next key."""
    pool.degrade_s = 600.0  # a first-fill ENOSPC would show as drops (before 2026-12-03 the journal's growth made one)
    for _ in range(200):
        _, r = _put(pool, range(seq, seq + BATCH))
        assert r.written == BATCH, (r, pool.stats()["dropped_by_reason"])
        seq += BATCH
        if pool.stats()["evictions"]:
            return seq
    raise AssertionError(f"never evicted: {pool.stats()}")


def _check_reopened(pool, fs, seq: int) -> None:
    """The caps past the files' sizes fit the free room, and puts of more than fits evict, never fail."""
    pool.degrade_s = 600.0  # an ENOSPC would show as 'degraded' drops for the rest of the test (no wall-clock window)
    avail, total = fs_space(str(fs))
    room = max(0, (avail - pool.slabs._keep_free(total)) // SLOT)
    files = pool.slabs.files
    held = sum(f.size_slots for f in files)
    promised = sum(max(0, f.cap_slots - f.size_slots) for f in files)
    st = pool.stats()
    sizes = [(f.size_slots, f.cap_slots) for f in files]
    assert promised <= room, (promised, room, sizes)  # old code: the free room promised beyond what there is
    assert st["capacity_blocks"] <= held + room, (st["capacity_blocks"], held, room, sizes)
    restored = st["blocks"]
    for _ in range(6):  # twice the room, and then some: the oldest are evicted
        keys, r = _put(pool, range(seq, seq + BATCH))
        seq += BATCH
        assert r.written == BATCH, (r, pool.stats()["dropped_by_reason"], sizes)
    st = pool.stats()
    assert st["enospc"] == 0 and not st["degraded"] and st["dropped_by_reason"] == {}, st
    assert st["evictions"] > 0 and st["blocks"] >= restored, st
    assert pool.slot_accounting()["leaked"] == 0
    out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
    assert pool.get(keys, out).result(timeout=HANG_S).ok == [True] * BATCH
    assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))


def test_reopen_with_more_files_per_path_on_a_full_filesystem_evicts_instead_of_enospc(small_fs):
    """Two slab files fill the tmpfs; reopened with ``files_per_path`` 4, the two new files were each promised a
    quarter of the directory's budget (the old files' bytes included), room the filesystem did not have: every
    put after the restart failed with ENOSPC. Now the new files get only the free part, and the pool evicts."""
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=2, min_free_fraction=0.0) as pool:
        seq = _fill_until_evicting(pool, 1)
    with open_pool(d, capacity_gb=1.0, files_per_path=4, min_free_fraction=0.0) as pool:
        assert pool.stats()["restored_blocks"] > 0, pool.stats()
        _check_reopened(pool, small_fs, seq)


def test_reopen_of_a_pool_that_fills_its_filesystem_evicts_instead_of_enospc(small_fs):
    """Two ``g3.paths`` on one tmpfs, two slab files each, filled until the pool evicts, closed and reopened
    with the same settings: the files' sizes differ by a few slots, and the even split of each directory's
    budget promised the smaller files more than the free room (old code: caps past the sizes above the room,
    and the first puts after the restart ENOSPC). Now the puts evict the oldest blocks."""
    a, b = str(small_fs / "a"), str(small_fs / "b")
    kw = dict(paths=[a, b], capacity_gb=1.0, files_per_path=2, min_free_fraction=0.05)
    with open_pool(a, **kw) as pool:
        seq = _fill_until_evicting(pool, 1)
    with open_pool(a, **kw) as pool:
        assert pool.stats()["restored_blocks"] > 0, pool.stats()
        _check_reopened(pool, small_fs, seq)
