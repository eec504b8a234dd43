"""Slots emptied while the journal's repair is due are journaled empty too (review finding, 2026-12-03).

``SlotCatalog.clear_headers`` journals the slots whose header it zeroes as vacant (vacancy records,
:func:`kvbm_backend.pool.g3.journal_gen.encode_vacant`), but skipped them while a rewrite of the journal from the
index was due (an append had failed: the journal marked for repair, no repair compaction under way yet). That
rewrite names none of those slots, but it only runs at the next append or at close; a worker killed before it
left the evicted blocks' PUTs as the journal's last word on slots whose headers were zeroed, and the restart
counted each as lost (``restore_dropped``, reason ``magic``), blocks the pool had only evicted.

Two ways into that window, each followed by a kill (``os._exit``, no close): the put whose journal append failed
(EIO, once) had evicted 8 blocks and reused their slots, which it released with their headers zeroed; or, with
the journal still marked for repair after such a failure, a later put evicting 8 blocks failed its slab write
(nothing appended: the repair is not started). Old code: ``restore_dropped`` 8 (``{'magic': 8}``) both ways; 4
when 4 of the slots are written again before the kill (their PUTs supersede the stale ones). Now the vacancy
records go straight to the journal, which still takes appends (best effort; :mod:`kvbm_backend.pool.g3.vacancy`).

Never wrong KV, never a newer block's record cancelled: blocks written into vacated slots afterwards are that
slot's at replay, the evicted keys stay misses, every other block hits with its own bytes, and the slot accounting
holds exactly the blocks served. Real pool, real files, a real child process; the journal's append fails with EIO
at ``os.write`` as a failing disk returns it, the slab write through the real posix engine (FailingWrites)."""
from __future__ import annotations

import errno
import logging
import os

import pytest

from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.g3_restart import CFG, HANG_S, SLOTS, check_refills, check_restored, run_child

_CHILD = """
import errno, json, os, sys
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.eio import FailingWrites
from tests.helpers.g3_restart import CFG, SLOTS
mode = sys.argv[2]
eng = FailingWrites()
pool = open_pool(sys.argv[1], engine=eng, **CFG)
pool.degrade_s = 0.0  # admission comes back at once: the puts after the journal failure are not dropped degraded
def put(keys):
    r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=600)
    return r.written, r.dropped
journal, real_write, real_fsync = os.path.realpath(pool.journal.path), os.write, os.fsync
left = [0]
def write(fd, data):  # the journal's append fails while left (EIO; the journal is cut back, not broken)
    if left[0] and os.readlink(f"/proc/self/fd/{fd}") == journal:
        left[0] -= 1
        raise OSError(errno.EIO, "injected journal append failure")
    return real_write(fd, data)
def fsync(fd):  # every journal rewrite (the repair compaction) fails at its fsync: the old journal stays
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".journal-"):
        raise OSError(errno.EIO, "injected journal rewrite fsync failure")
    real_fsync(fd)
os.write, os.fsync = write, fsync
first = NS.keys(range(1, (SLOTS if mode != "write_failed" else SLOTS - 8) + 1))
assert put(first) == (len(first), 0)
slot_of = {k: tuple(pool.cat.index.get(k)) for k in first}
left[0] = 1
lost = NS.keys(range(1000, 1008))  # journal append fails: full pool (8 evicted, their slots reused), or 8 free
assert put(lost) == (0, 8), pool.stats()
assert left[0] == 0 and pool.cat.journal_dirty and not pool.journal.broken
if mode == "write_failed":  # the journal still marked for repair: 8 free slots and 8 evicted, the write fails
    eng.fail = True
    assert put(NS.keys(range(2000, 2016))) == (0, 16), pool.stats()
    eng.fail = False
    assert pool.cat.journal_dirty and pool.cat.journal.compaction is None  # no append: the repair not begun
gone = [k for k in first if not pool.contains(k)]
assert len(gone) == 8 and pool.stats()["evictions"] == 8, pool.stats()
new = []
if mode == "reuse":  # 4 blocks written into vacated slots (their append starts the repair, which keeps failing)
    new = NS.keys(range(3000, 3004))
    assert put(new) == (4, 0), pool.stats()
    assert pool.cat.wait_compaction(600) and pool.cat.journal_dirty
    assert {tuple(pool.cat.index.get(k)) for k in new} <= {slot_of[k] for k in gone}
assert pool.cat.accounting()["leaked"] == 0
held = [k for k in first if k not in gone] + new
print("RESULT", json.dumps({"held": [k.seq_hash for k in held], "gone": [k.seq_hash for k in gone + lost]}),
      flush=True)
os._exit(0)  # no close (no repair there): the journal is left as a killed worker leaves it
"""


@pytest.mark.parametrize("mode", ["append_failed", "write_failed", "reuse"])
def test_slots_emptied_while_the_repair_is_due_are_no_restore_drops(tmp_path, mode):
    """Old code: ``restore_dropped`` 8 (``{'magic': 8}``; ``reuse``: 4). Now 0; the held blocks (and those
    written into vacated slots) hit with their own bytes, the evicted and lost keys miss, accounting is exact and
    the vacated slots fill again without evicting a held block."""
    got = run_child(_CHILD, tmp_path, mode)
    held, gone = NS.keys(got["held"]), NS.keys(got["gone"])
    assert len(held) == {"append_failed": 40, "write_failed": 32, "reuse": 44}[mode] and len(gone) == 16
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, held, gone)
        check_refills(pool, held, 10_000)


def test_a_broken_journal_takes_no_vacancy_and_close_repairs_it(tmp_path, monkeypatch, caplog):
    """Best effort: the journal's append fails and cannot be cut back (broken: nothing can be appended until it
    is rewritten). The slots the failed put emptied are not journaled (logged), the put resolves dropped, nothing
    leaks; a clean close rewrites the journal from the index, and a restart serves exactly the blocks held."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    with open_pool(tmp_path, **CFG) as pool:
        first = NS.keys(range(1, SLOTS + 1))
        r = pool.put(first, [payload(k.seq_hash) for k in first]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (SLOTS, 0)
        journal, real_write, real_ftruncate = os.path.realpath(pool.journal.path), os.write, os.ftruncate

        def write(fd, data):
            if os.readlink(f"/proc/self/fd/{fd}") == journal:
                raise OSError(errno.EIO, "injected journal append failure")
            return real_write(fd, data)

        def ftruncate(fd, n):
            if os.readlink(f"/proc/self/fd/{fd}") == journal:
                raise OSError(errno.EIO, "injected journal cut-back failure")
            return real_ftruncate(fd, n)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "ftruncate", ftruncate)
        lost = NS.keys(range(1000, 1008))
        r = pool.put(lost, [payload(k.seq_hash) for k in lost]).result(timeout=HANG_S)
        monkeypatch.undo()
        assert (r.written, r.dropped) == (0, 8) and pool.journal.broken
        assert "cannot journal 8 emptied slot(s) empty" in caplog.text
        assert pool.stats()["vacancies_unjournaled"] == 8  # counted, every slot (test_g3_broken_logs.py)
        gone = [k for k in first if not pool.contains(k)]
        assert len(gone) == 8 and pool.cat.accounting()["leaked"] == 0
    held = [k for k in first if k not in gone]
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, held, gone + lost)
