"""Reopening a G3 pool whose slab files' shares shrank: a directory added to ``g3.paths`` or ``files_per_path``
raised, ``capacity_gb`` unchanged (real pool, real slab files, fsync on).

Review finding (2026-12-01): each existing file's share (``capacity // paths // files_per_path``) shrank, so the
restart dropped every block past it (``restore:capacity``) and truncated the files, while the new drive stayed
empty: 294 of 700 good blocks lost though the pool could hold them all. Now they are kept while the pool's total
capacity holds them; new writes go to the files with room, and the blocks past their share give their room back
as LRU evicts them (slab_share.py).
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tests.helpers.crash_writer import NS, open_pool, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

BIG = 0.01  # GB: ~813 slots of 12 KiB


def _disk(*dirs) -> int:
    """Bytes the slab files of ``dirs`` hold on disk: allocated (st_blocks * 512; punched-out slots hold none),
    at most their size, less 4 KiB a file of filesystem metadata (ext4 counts a fragmented file's extent-tree
    block in st_blocks)."""
    sts = [os.stat(os.path.join(d, n)) for d in dirs if os.path.isdir(d) for n in os.listdir(d) if n.endswith(".slab")]
    return sum(max(0, min(st.st_blocks * 512, st.st_size) - (4096 if st.st_blocks * 512 % 12288 else 0))
               for st in sts)


def _put(pool, keys) -> None:
    for i in range(0, len(keys), 100):
        part = keys[i:i + 100]
        assert pool.put(part, [payload(k.seq_hash) for k in part]).result(timeout=HANG_S).written == len(part)


def _check_readable(pool, keys) -> None:
    out = [np.zeros_like(payload(0)) for _ in keys]
    assert all(pool.get(keys, out).result(timeout=HANG_S).ok)
    assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))


@pytest.mark.parametrize("change", ["add_directory", "raise_files_per_path"])
def test_shrunk_shares_keep_every_block_and_new_writes_take_their_room(tmp_path, change):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    before = dict(paths=[a], files_per_path=2)
    after = dict(paths=[a, b], files_per_path=2) if change == "add_directory" else dict(paths=[a], files_per_path=4)
    keys = NS.keys(range(1, 701))
    with open_pool(a, capacity_gb=BIG, **before) as pool:
        _put(pool, keys)
        assert max(si for _, (fi, si) in pool.cat.index.items()) >= 406  # past the share the change leaves

    with open_pool(a, capacity_gb=BIG, **after) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == 700 and st["restore_dropped"] == 0, st
        assert pool.cat.slabs.trimmed == []
        _check_readable(pool, keys)
        acct = pool.slot_accounting()
        configured = st["configured_capacity_blocks"]
        assert acct["leaked"] == 0 and acct["used"] == 700, acct
        assert acct["used"] + acct["free"] <= configured, acct  # the blocks past their share hold lent slots
        # the pool keeps storing within its capacity: new writes take the free room, then evict the oldest
        # blocks; those past their share give their slot back to the files that lent it
        more = NS.keys(range(1001, 1001 + configured))
        _put(pool, more)
        st, acct = pool.stats(), pool.slot_accounting()
        assert acct["leaked"] == 0 and st["blocks"] <= configured, (st, acct)
        assert st["evictions"] >= 700 + configured - st["blocks"] > 0, st
        assert not any(f.over for f in pool.cat.slabs.files) and not any(f.lent for f in pool.cat.slabs.files)
        assert acct["used"] == configured and acct["free"] == 0, acct  # every slot of the share in use again
        _check_readable(pool, more[-100:])
        assert _disk(a, b) <= BIG * 1e9, _disk(a, b)  # the old files' tails past their share given back
        held = {k.seq_hash for k in pool.keys()}

    with open_pool(a, capacity_gb=BIG, **after) as pool:  # and the next restart finds exactly that
        st = pool.stats()
        assert {k.seq_hash for k in pool.keys()} == held and st["restore_dropped"] == 0, st


def test_a_lowered_capacity_keeps_what_it_holds_past_the_shares_and_drops_the_oldest(tmp_path):
    """A directory added and ``capacity_gb`` lowered in one step: the blocks inside each file's new share stay,
    and of those past it as many as the unused shares hold (the newest), so the pool holds exactly its capacity;
    the slab files give back the disk of the dropped blocks."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    keys = NS.keys(range(1, 701))
    with open_pool(a, paths=[a], capacity_gb=BIG, files_per_path=2) as pool:
        _put(pool, keys)
    small = 0.006  # ~488 slots: 122 per file over 2 x 2 files, fewer than the 700 blocks
    with open_pool(a, paths=[a, b], capacity_gb=small, files_per_path=2) as pool:
        st, acct = pool.stats(), pool.slot_accounting()
        configured = st["configured_capacity_blocks"]
        assert st["restored_blocks"] == configured < 700, st
        assert st["restore_dropped_by_reason"] == {"capacity": 700 - configured}, st
        assert acct["leaked"] == 0 and acct["used"] == configured and acct["free"] == 0, acct
        _check_readable(pool, pool.keys())
        assert _disk(a, b) <= small * 1e9, _disk(a, b)


def test_a_lease_of_a_block_past_its_share_released_after_close_touches_no_file(tmp_path):
    """Merged-review finding (2026-12-01): a lease released after the pool closed (directly, or by the deferred
    unpin of a release that found the lock busy during close) gave back a slot past its file's share: it punched
    the slot out of the CLOSED slab fd's number, by then another file of the process (12 KiB of its bytes
    zeroed), then raised ValueError. Now a closed slab set gives nothing back and no unpin thread starts."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    keys = NS.keys(range(1, 701))
    with open_pool(a, capacity_gb=BIG, paths=[a], files_per_path=2) as pool:
        _put(pool, keys)
    pool = open_pool(a, capacity_gb=BIG, paths=[a, b], files_per_path=2)
    idx = {tuple(v): k for k, v in pool.cat.index.items()}
    f = next(f for f in pool.cat.slabs.files if f.over)
    top = max(f.over)
    lease = pool.lease([idx[(f.index, top)]])
    assert lease[0] is not None
    past = [idx[(f.index, s)] for s in f.over]  # the leased one too: pinned, its slot freed at the release
    assert pool.delete(past).result(timeout=HANG_S) == len(past)
    fd, size = f.fd, f.size_slots * pool.slot_bytes
    pool.close()
    victims = []
    for i in range(12):  # the process reuses the closed fd numbers for files of its own
        vfd = os.open(str(tmp_path / f"victim{i}"), os.O_RDWR | os.O_CREAT)
        os.write(vfd, b"V" * size)
        victims.append(vfd)
    assert fd in victims, "no file reused the slab's fd number: the test proves nothing"
    pool.release(lease)
    for vfd in victims:
        assert os.fstat(vfd).st_size == size and os.pread(vfd, size, 0) == b"V" * size, "a released lease wrote here"
        os.close(vfd)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvbm-g3-unpin")]
