"""A G3 pool reopened (warm restart) on a filesystem smaller than ``g3.capacity_gb`` but not full: its slab files'
caps hold what the files hold plus the whole free room (invariant 4: capacity is real, and all of it is used).

Review 2026-12-03 of 4f7e152: the open water-filled the free room over the files (``slab_room.file_caps``) and then
kept the lower of that and the budget split evenly over each directory's files. When the files of a directory held
different sizes (one block stored in a pool of two files; ``files_per_path`` raised), the fuller file's cap was cut
to the even split while the emptier file got only its water-filled part: slots the filesystem had were promised to
no file (old code: ``capacity_blocks`` 626 of 646, 571 of 646), the pool evicted before its filesystem was full
until a short allocation re-read statvfs. Real small tmpfs (needs root and mount(8), else skipped saying so).
"""
from __future__ import annotations

import pytest

from tests.helpers.tmpfs import mounted_tmpfs
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.model import frame
from kvbm_backend.pool.g3.slabs import fs_space

HANG_S = 600.0  # a hang guard, not a bound
SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (:func:`tests.helpers.tmpfs.mounted_tmpfs`)."""
    with mounted_tmpfs(tmp_path / "mnt", "8m") as mnt:
        yield mnt


def _put(pool, seqs):
    keys = NS.keys(seqs)
    r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
    assert r.written == len(keys), (r, pool.stats()["dropped_by_reason"])


def _check_caps_hold_the_room(pool, fs) -> None:
    avail, total = fs_space(str(fs))
    room = (avail - pool.slabs._keep_free(total)) // SLOT
    files = pool.slabs.files
    held = sum(f.size_slots for f in files)
    sizes = [(f.size_slots, f.cap_slots) for f in files]
    assert room > 0 and all(f.cap_slots < f.max_slots for f in files), (room, sizes)  # smaller than capacity_gb
    promised = sum(f.cap_slots - f.size_slots for f in files)
    assert all(f.cap_slots >= f.size_slots for f in files), sizes
    # the free room, all of it and no more (water-filling rounds down by at most a slot per file)
    assert room - len(files) < promised <= room, (promised, room, sizes)
    assert pool.stats()["capacity_blocks"] > held + room - len(files), (pool.stats()["capacity_blocks"], held, room)
    return promised


@pytest.mark.parametrize("files_per_path,reopen_files,blocks", [(2, 2, 1), (1, 2, 150)],
                         ids=["same_settings", "files_per_path_raised"])
def test_reopen_caps_hold_the_free_room(small_fs, files_per_path, reopen_files, blocks):
    """A pool of files of different sizes on a tmpfs smaller than its capacity, reopened: the caps past the
    files' sizes add up to the free room (old code: 20, then 75 slots short of it)."""
    d = small_fs / "g3"
    with open_pool(d, capacity_gb=1.0, files_per_path=files_per_path, min_free_fraction=0.0) as pool:
        _put(pool, range(1, blocks + 1))
    with open_pool(d, capacity_gb=1.0, files_per_path=reopen_files, min_free_fraction=0.0) as pool:
        assert pool.stats()["restored_blocks"] == blocks, pool.stats()
        sizes = [f.size_slots for f in pool.slabs.files]
        assert len(set(sizes)) > 1, sizes  # what the case is about: the files hold different sizes
        promised = _check_caps_hold_the_room(pool, small_fs)
        pool.degrade_s = 600.0  # an ENOSPC would show as drops (no wall-clock window)
        for a in range(0, promised, 64):  # what the caps promise fits: stored, nothing evicted, nothing dropped
            _put(pool, range(10_000 + a, 10_000 + min(promised, a + 64)))
        st = pool.stats()
        assert st["evictions"] == 0 and st["enospc"] == 0 and st["dropped_by_reason"] == {}, st
        assert st["blocks"] == blocks + promised, st
