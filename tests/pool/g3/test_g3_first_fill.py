"""A fresh G3 pool on a filesystem smaller than ``g3.capacity_gb``, filled for the first time (invariant 4, capacity
is real): it behaves as a pool of the filesystem's size, evicting (LRU) once its slab files hold the filesystem.

Finding 2026-12-03: the room slab files may take was the free space less the whole metadata reserve
(:func:`kvbm_backend.pool.g3.slab_room.keep_free_bytes`), while the journal and its ``.gen`` markers, the files that
reserve is kept for, already sat on the filesystem: each journal append took free space the caps had already
promised to the slabs, so the last growth of a slab file was refused ("would cross the ... free-space watermark (or
the metadata reserve)"), the batch was dropped ``enospc`` and the tier degraded, on every first fill of an 8 MiB
tmpfs. Now the bytes the pool's own journal files hold count against the reserve. Real small tmpfs (needs root and
mount(8), else skipped saying so).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers.tmpfs import mounted_tmpfs
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.model import frame
from kvbm_backend.pool.g3.slabs import fs_space, keep_free_bytes

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)
BATCH = 64


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (:func:`tests.helpers.tmpfs.mounted_tmpfs`)."""
    with mounted_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


# min_free_fraction: the default (the reserve is above it on 8 MiB), none, above the reserve; two g3.paths on the tmpfs
@pytest.mark.parametrize("n_paths,min_free_fraction", [(1, 0.05), (1, 0.0), (1, 0.2), (2, 0.05)])
def test_first_fill_of_a_filesystem_smaller_than_capacity_evicts_and_never_degrades(small_fs, n_paths,
                                                                                    min_free_fraction):
    """capacity_gb 1 on an 8 MiB tmpfs, two slab files per path: ~3x what fits is put, batch after batch. Every batch is
    written whole (the oldest blocks evicted), no ENOSPC, the tier never degrades, the pool ends full at the size
    the filesystem holds, and the last batch reads back byte-exact. Old code: one batch dropped ``enospc`` near the
    end of the first fill (the journal's growth took room already promised to the slabs) and the tier degraded."""
    paths = [str(small_fs / f"g3-{i}") for i in range(n_paths)]
    with open_pool(paths[0], paths=paths, capacity_gb=1.0, files_per_path=2,
                   min_free_fraction=min_free_fraction) as pool:
        pool.degrade_s = 600.0  # a degradation shows as 'degraded' drops for the rest of the test (no wall-clock)
        avail0, total = fs_space(str(small_fs))
        fits = total // SLOT
        seq, results = 1, []
        for _ in range(3 * fits // BATCH):
            keys = NS.keys(range(seq, seq + BATCH))
            seq += BATCH
            r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
            results.append(r.written)
            assert r.written == BATCH, (len(results), r, pool.stats()["dropped_by_reason"], pool.stats()["enospc"])
        st, acct = pool.stats(), pool.slot_accounting()
        assert st["enospc"] == 0 and not st["degraded"] and st["dropped_by_reason"] == {}, st
        assert st["evictions"] >= fits, st  # it evicted a lot: its whole size at least once over
        assert acct["leaked"] == 0 and acct["reserved"] == 0, acct
        # a pool of the filesystem's size: full, no more than the disk, not far below what slabs may take there
        slabs = sum(os.stat(f.path).st_blocks * 512 for f in pool.slabs.files)
        assert st["blocks"] == st["capacity_blocks"] and st["capacity_bytes"] <= slabs <= total, (st, slabs, total)
        # at least the room the open saw above the whole reserve (a slot per file lost to rounding): the journal's
        # growth since took nothing from it
        keep = keep_free_bytes(total, round(1.0e9), SLOT, min_free_fraction)
        assert st["capacity_bytes"] >= avail0 - keep - SLOT * len(pool.slabs.files), (st, avail0, keep)
        assert fs_space(str(small_fs))[0] > 0
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in keys]
        assert pool.get(keys, out).result(timeout=HANG_S).ok == [True] * BATCH
        assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))
