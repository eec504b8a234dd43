"""A block evicted for a batch whose write then fails is not journaled as gone (no DEL record: a successful
write's PUT of the slot supersedes it). A restart after such a failure (checked by review, 2026-11-30) drops it:
either the new frame reached the slot (its header names another key) or, the write having failed, the slot's
header was zeroed before it was released (``SlotCatalog.release_unpublished``). Before (reviewer, 2026-11-30,
second pass) a write that never reached the slot left the evicted block's header and its journal PUT: the block
came back, even after a ``delete`` of it (not held then: nothing to clear, no DEL): a deleted block resurrected.
Never wrong bytes: a slot whose payload was torn under an intact old header fails the frame checksum on read
(tests/pool/g3/test_g3_corruption.py). Real posix engine and files; the engine's writes are made to fail as a
failing disk would (before or after the bytes land)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from tests.helpers.eio import FailingWrites
from kvbm_backend.memory import aligned_empty

HANG_S = 600.0  # a hang guard, not a bound
SLOTS = 64


def _read(pool, keys):
    out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
    return pool.get(keys, out).result(timeout=HANG_S).ok, out


@pytest.mark.parametrize("land", [False, True])
def test_block_evicted_for_a_failed_write_after_restart(tmp_path, land):
    cfg = dict(capacity_gb=SLOTS * 12288 / 1e9, files_per_path=1)
    old = NS.keys(range(1, SLOTS + 1))
    eng = FailingWrites()
    try:
        with open_pool(tmp_path, engine=eng, **cfg) as pool:
            assert pool.put(old, [payload(k.seq_hash) for k in old]).result(timeout=HANG_S).written == SLOTS
            eng.fail, eng.land = True, land
            new = NS.keys(range(1000, 1008))
            res = pool.put(new, [payload(k.seq_hash) for k in new]).result(timeout=HANG_S)
            assert res.written == 0 and res.dropped == 8
            gone = [k for k in old if not pool.contains(k)]
            assert len(gone) == 8  # evicted for the failed batch
            eng.fail = False
            assert pool.delete(gone).result(timeout=HANG_S) == 0  # evicted: not held, no DEL journaled
    finally:
        eng.close()
    with open_pool(tmp_path, **cfg) as pool:
        assert not any(pool.contains(k) for k in new)
        # the new frames reached the slots, or the failed write's slots were zeroed: the evicted (and deleted)
        # blocks' journal records fail the header check, none comes back
        assert [k for k in gone if pool.contains(k)] == []
        ok, out = _read(pool, old)
        assert ok == [k not in gone for k in old]
        assert all(np.array_equal(o.view(np.uint8), payload(k.seq_hash)) for o, k, h in zip(out, old, ok) if h)
        assert pool.cat.accounting()["leaked"] == 0


CAP = 4  # the lowered cap of the slab file: evicted slots at or above it are not reused


@pytest.mark.parametrize("journal", ["kept", "removed"])
@pytest.mark.parametrize("fail", [True, False], ids=["write_fails", "write_succeeds"])
def test_evicted_slots_the_batch_did_not_reuse_stay_gone_after_restart(tmp_path, monkeypatch, fail, journal):
    """The batch's "evicted, not reused" slots (``G3Writer._start_batch``: ``clear_headers`` of the evicted
    slots the second allocation did not return). With the allocator as it is, a batch re-reserves every slot it
    evicted (free slots are taken only once a file's room above its high-water mark is gone, and the first
    allocation took all of it): the branch is reached only by an evicted slot at or above its file's cap, which
    the allocator parks instead of handing out. The slab code never lowers a cap below a published slot, so the
    test lowers it by hand (``cap_slots``, as a shrunk filesystem lowers it) and keeps statvfs from being re-read
    (``RECHECK_SPACE_S``) so it stays there for the batch: 8 blocks evicted, 4 slots reused (the write then fails,
    or succeeds), 4 not. No DEL is journaled for an eviction, so only the zeroed header keeps a not-reused
    block from coming back at the restart: by its journal PUT (``journal`` kept) or by a header scan (removed),
    even though it was deleted meanwhile (not held: nothing to clear)."""
    from kvbm_backend.pool.g3 import slabs
    monkeypatch.setattr(slabs, "RECHECK_SPACE_S", 1e9)
    cfg = dict(capacity_gb=SLOTS * 12288 / 1e9, files_per_path=1)
    old = NS.keys(range(1, SLOTS + 1))
    new = NS.keys(range(1000, 1008))
    eng = FailingWrites()
    try:
        with open_pool(tmp_path, engine=eng, **cfg) as pool:
            assert pool.put(old, [payload(k.seq_hash) for k in old]).result(timeout=HANG_S).written == SLOTS
            with pool.cat.lock:
                slot_of = {k: tuple(pool.cat.index.get(k)) for k in old}
                (f,) = pool.slabs.files
                assert f.cap_slots == f.next_unused == SLOTS
                f.cap_slots = CAP
            eng.fail = fail
            res = pool.put(new, [payload(k.seq_hash) for k in new]).result(timeout=HANG_S)
            assert (res.written, res.dropped) == ((0, 8) if fail else (CAP, 8 - CAP)), res
            gone = [k for k in old if not pool.contains(k)]
            not_reused = [k for k in gone if slot_of[k][1] >= CAP]
            assert len(gone) == 8 and len(not_reused) == 8 - CAP, (gone, slot_of)
            eng.fail = False
            assert pool.delete(gone).result(timeout=HANG_S) == 0  # evicted: not held, no DEL journaled
    finally:
        eng.close()
    if journal == "removed":
        os.unlink(tmp_path / f"journal-{NS.fingerprint}.log")
    with open_pool(tmp_path, **cfg) as pool:
        assert [k for k in gone if pool.contains(k)] == []  # before the zeroing: the not-reused 4 came back
        ok, out = _read(pool, old)
        assert ok == [k not in gone for k in old]
        assert all(np.array_equal(o.view(np.uint8), payload(k.seq_hash)) for o, k, h in zip(out, old, ok) if h)
        assert [pool.contains(k) for k in new] == [not fail and i < CAP for i in range(len(new))]
        assert pool.cat.accounting()["leaked"] == 0
