"""A round withdrawn by a failed journal barrier leaves no live PUT in the journal (review finding, 2026-12-03).

When the journal's ``fdatasync`` fails and the repair rewrite fails too, ``journal_sync.repair_or_withdraw_locked``
takes the round's blocks out of the index (headers zeroed, slots freed) and their puts count them dropped. The
journal still held the round's PUT records, and nothing said the slots were empty (no DEL, no vacancy record):
the journal is only marked for repair, which runs at the next append or at close. A worker killed before that
left those PUTs as the journal's last word on their slots, so the restart read zeroed headers where the journal
said blocks were and counted every withdrawn block as lost (``restore_dropped``, reason ``magic``), blocks the
put had already reported dropped. Old code: ``restore_dropped`` 32 (``{'magic': 32}``) without reuse, 24 when 8
of the slots were written again (their PUTs supersede the stale ones). Now the withdrawal journals the slots
empty (:func:`kvbm_backend.pool.g3.journal_gen.encode_vacant`, best effort).

Never wrong KV, either way: a slot written again by another block is that block's at replay (the later PUT
wins per slot), and a stale PUT meeting another block's header is an identity drop (test_g3_corruption.py);
the withdrawn keys stay misses, the others hit with their own bytes, and the restored pool's slot accounting
holds exactly the blocks it serves (capacity is real). Real pool, real files, a real process that exits
without closing; the journal's barrier and the repair's fsync fail with EIO as a failing disk returns them."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvbm_backend.memory import aligned_empty
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from tests.helpers.g3_restart import CFG, HANG_S, check_refills, check_restored, run_child

_CHILD = """
import errno, json, os, sys
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.g3_restart import CFG
reuse = sys.argv[2] == "reuse"
pool = open_pool(sys.argv[1], **CFG)
pool.degrade_s = 0.0  # admission comes back at once: the reuse put below is not dropped as degraded
def put(keys):
    r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=600)
    return r.written, r.dropped
held = NS.keys(range(1, 17))
assert put(held) == (16, 0)
journal, real_fdatasync, real_fsync = os.path.realpath(pool.journal.path), os.fdatasync, os.fsync
left = [1]
def fdatasync(fd):  # the journal's barrier fails once (EIO)
    if left[0] and os.readlink(f"/proc/self/fd/{fd}") == journal:
        left[0] -= 1
        raise OSError(errno.EIO, "injected journal fdatasync failure")
    real_fdatasync(fd)
def fsync(fd):  # every journal rewrite (the repair, a compaction) fails at its fsync
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".journal-"):
        raise OSError(errno.EIO, "injected journal rewrite fsync failure")
    real_fsync(fd)
os.fdatasync, os.fsync = fdatasync, fsync
gone = NS.keys(range(100, 132))
assert put(gone) == (0, 32), pool.stats()
assert pool.stats()["dropped_by_reason"].get("journal_error") == 32
assert not any(pool.contains(k) for k in gone)
new = []
if reuse:  # 8 more blocks land in withdrawn slots (the repair keeps failing: the old journal stays)
    new = NS.keys(range(200, 208))
    assert put(new) == (8, 0), pool.stats()
    assert pool.cat.wait_compaction(600)
assert pool.cat.accounting()["leaked"] == 0
print("RESULT", json.dumps({"held": [k.seq_hash for k in held + new], "gone": [k.seq_hash for k in gone]}),
      flush=True)
os._exit(0)  # no close (no repair there): the journal is left as a killed worker leaves it
"""


@pytest.mark.parametrize("mode", ["killed", "reuse"])
def test_a_withdrawn_round_is_no_restore_drop_and_never_comes_back(tmp_path, mode):
    """Old code: ``restore_dropped`` 32 (killed right after the withdrawal) or 24 (8 slots written again) under
    ``magic``. Both: the withdrawn keys absent, every other block a hit with its own bytes, accounting exact."""
    got = run_child(_CHILD, tmp_path, mode)
    held, gone = NS.keys(got["held"]), NS.keys(got["gone"])
    assert len(held) == (24 if mode == "reuse" else 16) and len(gone) == 32
    with open_pool(tmp_path, **CFG) as pool:
        assert not any(pool.contains(k) for k in gone)
        check_restored(pool, held, gone)  # a withdrawn key is a miss, never another's bytes
        # the withdrawn slots are usable again: the pool fills to its capacity with no eviction of the held blocks
        check_refills(pool, held, 1000)


def test_a_vacancy_append_that_fails_too_loses_nothing(tmp_path, monkeypatch, caplog):
    """Best effort: the journal's barrier, the repair rewrite and then the vacancy append all fail (EIO). The put
    still resolves (all dropped, never stored), the failure is logged, the journal is cut back to its last whole
    record (not broken), the slots are free; a clean close then repairs the journal and a restart serves exactly
    the blocks held, with no restore drop."""
    held, gone = NS.keys(range(1, 17)), NS.keys(range(100, 132))
    with open_pool(tmp_path, **CFG) as pool:
        r = pool.put(held, [payload(k.seq_hash) for k in held]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (16, 0)
        journal, real_fdatasync, real_fsync, real_write = (os.path.realpath(pool.journal.path), os.fdatasync,
                                                           os.fsync, os.write)
        failing = {"writes": False}

        def fdatasync(fd):  # the barrier fails; from then on appends to the journal fail too
            if os.readlink(f"/proc/self/fd/{fd}") == journal:
                failing["writes"] = True
                raise OSError(errno.EIO, "injected journal fdatasync failure")
            real_fdatasync(fd)

        def fsync(fd):
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".journal-"):
                raise OSError(errno.EIO, "injected journal rewrite fsync failure")
            real_fsync(fd)

        def write(fd, data):
            if failing["writes"] and os.readlink(f"/proc/self/fd/{fd}") == journal:
                raise OSError(errno.EIO, "injected journal append failure")
            return real_write(fd, data)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "write", write)
        r = pool.put(gone, [payload(k.seq_hash) for k in gone]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (0, 32)
        monkeypatch.undo()
        assert failing["writes"] and not pool.journal.broken
        assert "cannot journal 32 withdrawn slot(s) empty" in caplog.text
        assert pool.stats()["vacancies_unjournaled"] == 32  # counted, every slot (test_g3_broken_logs.py)
        assert not any(pool.contains(k) for k in gone)
        acc = pool.cat.accounting()
        assert acc["leaked"] == 0 and acc["used"] == 16, acc
    with open_pool(tmp_path, **CFG) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 0 and st["restored_blocks"] == 16 and set(pool.keys()) == set(held), st
        out = [aligned_empty(LAYOUT.bytes_per_block) for _ in held]
        assert pool.get(held, out).result(timeout=HANG_S).ok == [True] * 16
        assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, held))
