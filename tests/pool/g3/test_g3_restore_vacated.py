"""``restore_dropped`` counts blocks lost or found damaged at a warm restart, never blocks the pool evicted.

Reported 2026-12-03: after a fill-until-evict on an 8 MiB tmpfs (two paths, two slab files each), the reopened pool
counted ~60 ``restore_dropped`` (reason ``magic``), one per block evicted before the restart. Cause: an eviction
writes no journal record (the evicting batch's PUT of the slot supersedes the old key's), but that batch's write
failed (ENOSPC growing a slab file; EIO does the same), so the slots were released with their headers zeroed
(``SlotCatalog.release_unpublished``) while the journal's last word on them stayed the evicted blocks' PUTs; the
restart read zeros where the journal said a block was, and counted each as lost. The same holds for evicted slots
a batch did not reuse, and for a write cancelled by a delete. Now every header the pool zeroes without a DEL of
its key is journaled empty (vacancy records, :func:`kvbm_backend.pool.g3.journal_gen.encode_vacant`), so the
journal's last word on the slot is that it is empty; a slot the journal's last word says holds a block and whose
header is zeros or damaged is still counted (a torn or lost write). Real posix engine and slab files; the
engine's writes fail as a failing disk's would (after the bytes land, or before)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from tests.helpers.eio import FailingWrites
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SLOTS = 48
CFG = dict(capacity_gb=SLOTS * frame.slot_bytes(LAYOUT.bytes_per_block) / 1e9, files_per_path=1)
REPO = Path(__file__).resolve().parents[3]


def _put(pool, keys) -> tuple[int, int]:
    r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
    return r.written, r.dropped


def evict_for_a_failed_write(pool, eng: FailingWrites, land: bool):
    """Fill the pool (``SLOTS`` blocks), put 8 more whose write fails (8 blocks evicted for them, their slots
    zeroed and released), then 4 that succeed (in 4 of the freed slots: their PUTs supersede the evicted blocks';
    the other 4 stay free). Returns ``(held, gone, slot_of)``: the keys the pool holds, the 8 evicted, and each
    key's slot when it was put."""
    old = NS.keys(range(1, SLOTS + 1))
    assert _put(pool, old) == (SLOTS, 0)
    slot_of = {k: tuple(pool.cat.index.get(k)) for k in old}
    eng.fail, eng.land = True, land
    assert _put(pool, NS.keys(range(1000, 1008))) == (0, 8)
    eng.fail = False
    more = NS.keys(range(2000, 2004))
    assert _put(pool, more) == (4, 0)
    slot_of.update({k: tuple(pool.cat.index.get(k)) for k in more})
    gone = [k for k in old if not pool.contains(k)]
    assert len(gone) == 8 and pool.stats()["evictions"] == 8, pool.stats()
    assert {slot_of[k] for k in more} < {slot_of[k] for k in gone}
    return [k for k in old + more if k not in gone], gone, slot_of


def _check_held(pool, held, gone) -> None:
    assert not any(pool.contains(k) for k in gone)  # evicted blocks stay gone
    out = [aligned_empty(LAYOUT.bytes_per_block) for _ in held]
    assert pool.get(held, out).result(timeout=HANG_S).ok == [True] * len(held)
    assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, held))
    assert pool.cat.accounting()["leaked"] == 0


@pytest.mark.parametrize("land", [False, True], ids=["write_lost", "write_landed"])
def test_blocks_evicted_before_a_clean_close_are_not_restore_drops(tmp_path, land):
    """Old code: restore_dropped 4 (``{'magic': 4}``): the blocks evicted for the failed batch whose slots no
    later PUT named (the other 4 were superseded by the next put's)."""
    eng = FailingWrites()
    try:
        with open_pool(tmp_path, engine=eng, **CFG) as pool:
            held, gone, _ = evict_for_a_failed_write(pool, eng, land)
    finally:
        eng.close()
    with open_pool(tmp_path, **CFG) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 0 and st["restore_dropped_by_reason"] == {}, st
        assert st["restored_blocks"] == len(held) == SLOTS - 4, st
        _check_held(pool, held, gone)


@pytest.mark.parametrize("damage", ["zeroed", "magic_flipped"])
def test_a_damaged_block_is_still_a_restore_drop_beside_evictions(tmp_path, damage):
    """A block the journal's last word says is there, in a slot an evicted block left (the failed batch's:
    journaled empty, then written again), its header zeroed (a lost write) or its magic damaged on disk between
    close and reopen: counted, once, under ``magic``; the evictions are not."""
    eng = FailingWrites()
    try:
        with open_pool(tmp_path, engine=eng, **CFG) as pool:
            held, gone, slot_of = evict_for_a_failed_write(pool, eng, False)
            victim = next(k for k in held if k.seq_hash >= 2000)  # in a slot journaled empty, then written again
            fi, si = slot_of[victim]
            path, slot_bytes = pool.slabs.by_index[fi].path, pool.cat.slot_bytes
    finally:
        eng.close()
    with open(path, "r+b") as f:
        f.seek(si * slot_bytes)
        hdr = bytearray(f.read(frame.HEADER_BYTES))
        hdr[:] = bytes(len(hdr)) if damage == "zeroed" else bytes([hdr[0] ^ 0x20]) + hdr[1:]
        f.seek(si * slot_bytes)
        f.write(hdr)
        f.flush()
        os.fsync(f.fileno())
    with open_pool(tmp_path, **CFG) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 1 and st["restore_dropped_by_reason"] == {"magic": 1}, st
        assert st["restored_blocks"] == len(held) - 1, st
        assert not pool.contains(victim)
        _check_held(pool, [k for k in held if k != victim], gone)


_KILLED = """
import os, sys
from tests.helpers.crash_writer import open_pool
from tests.pool.g3.test_g3_restore_vacated import CFG, FailingWrites, evict_for_a_failed_write
eng = FailingWrites()
pool = open_pool(sys.argv[1], engine=eng, **CFG)
held, gone, _ = evict_for_a_failed_write(pool, eng, False)
print("HELD", " ".join(str(k.seq_hash) for k in held), flush=True)
os._exit(0)  # no close: the journal is left as a killed worker leaves it
"""


def test_blocks_evicted_before_a_kill_are_not_restore_drops(tmp_path):
    """The vacancy records are appended when the headers are zeroed, not at close: a worker that dies without
    closing leaves no false drops either. Old code: restore_dropped 4 (``{'magic': 4}``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], capture_output=True, text=True,
                       timeout=HANG_S, env=env, cwd=str(REPO))
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("HELD"))
    held = {int(x) for x in line.split()[1:]}
    assert len(held) == SLOTS - 4
    with open_pool(tmp_path, **CFG) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 0 and st["restore_dropped_by_reason"] == {}, st
        assert {k.seq_hash for k in pool.keys()} == held, st


def test_vacancy_records_empty_their_slots_at_replay():
    """Replay of vacancy records (the columnar decoder and the record-by-record reference, ``journal._apply``):
    the slots they name are empty whatever PUT named them before, a later PUT into such a slot stands, and the
    vacancy key itself is never an entry."""
    from kvbm_backend.pool.g3 import journal as jr, journal_columns as jc, journal_gen as jg
    from kvbm_backend.pool.g3.index import TagKey
    k1, k2, k3 = NS.keys([1, 2, 3])
    data = b"".join([jr.encode(jr.PUT, k1, (0, 5)), jr.encode(jr.PUT, k2, (1, 7)), jr.encode(jr.PUT, k3, (0, 9))]
                    + jg.encode_vacant([(0, 5), (1, 7)]) + [jr.encode(jr.PUT, k2, (0, 5))])
    cols, n, good = jc.decode(data)
    assert n == 7 and good == len(data)
    assert [(int(s), int(f), int(sl)) for s, f, sl in zip(cols.seqs, cols.files, cols.slots)] == [(3, 0, 9), (2, 0, 5)]
    ref: OrderedDict = OrderedDict()
    by_slot: dict = {}
    for pos in range(0, len(data), jr.RECORD_BYTES):
        kind, fi, si, seq, rank, tag = jr._REC.unpack_from(data, pos)
        jr._apply(ref, by_slot, kind, TagKey(NS.fingerprint, tag, rank, seq), (fi, si))
    assert [(k.seq_hash, s) for k, s in ref.items()] == [(3, (0, 9)), (2, (0, 5))]
    assert jg.encode_vacant([]) == []


def test_a_vacancy_cut_off_by_a_crash_is_no_block(tmp_path):
    """A crash between a vacancy's PUTs and its DEL (the journal's torn tail) leaves the vacancy key live after
    replay: the restore drops it silently (no block has that key), not as ``restore_dropped``."""
    from kvbm_backend.pool.g3 import journal_gen as jg
    keys = NS.keys(range(1, 11))
    with open_pool(tmp_path, **CFG) as pool:
        assert _put(pool, keys) == (10, 0)
        used = {tuple(pool.cat.index.get(k)) for k in keys}
    free = next((0, s) for s in range(SLOTS) if (0, s) not in used)
    with open(tmp_path / f"journal-{NS.fingerprint}.log", "ab") as f:
        f.write(jg.encode_vacant([free])[0])  # the PUT without its DEL
    with open_pool(tmp_path, **CFG) as pool:
        st = pool.stats()
        assert st["restore_dropped"] == 0 and st["restore_dropped_by_reason"] == {}, st
        assert st["restored_blocks"] == 10 and set(pool.keys()) == set(keys), st
        _check_held(pool, keys, [])
