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

import errno
from concurrent.futures import Future

import numpy as np
import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.memory import aligned_empty

HANG_S = 600.0  # a hang guard, not a bound
SLOTS = 64


class FailingWrites(PosixEngine):
    """The real posix engine; while ``fail`` is set, every write batch fails with EIO, after its bytes were
    written (``land``) or before any was."""

    def __init__(self) -> None:
        super().__init__(threads=2)
        self.fail = False
        self.land = False

    def submit(self, ops):
        ops = list(ops)
        if not (self.fail and ops and ops[0].write):
            return super().submit(ops)
        out: Future = Future()
        if self.land:
            super().submit(ops).result(timeout=HANG_S)
        out.set_exception(OSError(errno.EIO, "injected write failure"))
        return out


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
