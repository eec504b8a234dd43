"""DEL records a failing journal did not take are counted, and no restart serves a deleted block (review, 2026-12-03).

52b5a08 counted the vacancy records a failing ``SlotCatalog.journal_append`` lost (``vacancies_unjournaled``), but
the DEL records of removed blocks went through the same call and its False was ignored: ``G3Pool.delete`` (a
revoked tenant's purge too), a host get that proves a block bad, ``drop_corrupt`` and ``drop_unreadable``. A lost
DEL means a restart before the journal's repair replays the block's PUT: its zeroed header drops it
(``restore_dropped``, ``magic``), and one whose header could not be zeroed either (``header_clear_errors``) is
indexed again and verified like any. Old code: nothing counted any of it. Now each lost DEL is one slot in
``vacancies_unjournaled`` and the limited WARNING "cannot journal N deleted slot(s) empty" (one per pool per minute,
:mod:`kvbm_backend.pool.g3.vacancy`).

After the restart no deleted block is served: a deleted or corrupt one is a restore drop and a miss; a revoked
tenant's purged block that comes back (journal failing and drive gone at the purge) is refused by the keyring check
(:class:`kvbm_backend.integrations.revoked_tenants.RevokedTenants`, as the connector and the tiering form's G3Tier
ask it before any G3 lookup, load or store) and purged again at the tenant's first sighting, before it is served.

Real pools on real files, a real keyring file. The journal fails as a failing drive makes it: its appends EIO at
``os.write`` (cut back: the journal stays open, the records go through ``journal_append``) and every rewrite's
``fsync`` EIO (the repair compaction and the close's repair fail), so a close leaves the journal as a worker killed
before the repair leaves it. A drive gone is the slab files' descriptors made read-only (every header write fails).
"""
from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from kvbm_backend.crypto.kek import provider_for
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.integrations.revoked_tenants import RevokedTenants
from kvbm_backend.log_limits import LimitedLog
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import vacancy
from kvbm_backend.pool.g3.index import TagKey, tag_of
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from tests.helpers.g3_restart import CFG, HANG_S
from tests.pool.g3.test_g3_broken_logs import _read_only, _read_write

SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)
NEVER_S = 3600.0  # the keyring checks' own interval: never reached, the tests wait for the checks (drain)


@pytest.fixture
def clock(monkeypatch):
    """:mod:`kvbm_backend.pool.g3.vacancy`'s limited logger on a clock that stands still (a run's time decides no line)."""
    now = [1000.0]
    monkeypatch.setattr(vacancy, "LOG", LimitedLog(vacancy.log, clock=lambda: now[0]))
    return now


def _fail_journal(monkeypatch, pool) -> None:
    """Every append to ``pool``'s journal fails (EIO, cut back: not broken), and so does every rewrite's fsync (the
    repair compaction, the close's repair). ``monkeypatch.undo()`` gives the drive back."""
    journal, real_write, real_fsync = os.path.realpath(pool.journal.path), os.write, os.fsync

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == journal:
            raise OSError(errno.EIO, "journal append failing (test)")
        return real_write(fd, data)

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".journal-"):
            raise OSError(errno.EIO, "journal rewrite failing (test)")
        real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)


def _put(pool, keys) -> None:
    r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
    assert (r.written, r.dropped) == (len(keys), 0), r


def _served(pool, keys) -> list[bool]:
    """Which of ``keys`` ``pool`` serves; every block served holds its own bytes."""
    out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
    ok = pool.get(keys, out).result(timeout=HANG_S).ok
    assert all(np.array_equal(o, payload(k.seq_hash)) for o, k, hit in zip(out, keys, ok) if hit)
    return ok


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def _check_restart(tmp_path, held, gone) -> None:
    """A restart before the journal's repair: every block of ``gone`` (deleted, its DEL lost, its header zeroed) is
    a restore drop (``magic``) and a miss; ``held`` are served with their own bytes; nothing leaks."""
    with open_pool(tmp_path, **CFG) as pool:
        st = pool.stats()
        assert st["restore_dropped_by_reason"] == {"magic": len(gone)}, st
        assert set(pool.keys()) == set(held), st
        assert _served(pool, held + gone) == [True] * len(held) + [False] * len(gone)
        acc = pool.cat.accounting()
        assert acc["leaked"] == 0 and acc["used"] == len(held), acc


def test_deletes_a_failing_journal_did_not_take_are_counted_and_stay_gone(tmp_path, caplog, clock, monkeypatch):
    """Five one-block deletes and one of three while every journal append fails. Old code: ``vacancies_unjournaled``
    0 and no line. Now 8 (every lost DEL), one limited line naming the journal's error; the restart before the
    repair drops the 8 (zeroed headers: ``magic``) and serves the 8 blocks held."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    keys = NS.keys(range(1, 17))
    gone, held = keys[:8], keys[8:]
    with open_pool(tmp_path, **CFG) as pool:
        _put(pool, keys)
        _fail_journal(monkeypatch, pool)
        for k in gone[:5]:
            assert pool.delete([k]).result(timeout=HANG_S) == 1
        assert pool.delete(gone[5:]).result(timeout=HANG_S) == 3
        assert not pool.journal.broken  # a failing journal: the DELs went through journal_append
        st = pool.stats()
        assert st["journal_errors"] >= 6 and st["header_clear_errors"] == 0, st
        assert st["vacancies_unjournaled"] == 8, (
            f"vacancies_unjournaled {st['vacancies_unjournaled']} for the 8 DEL records the failing journal lost")
        lines = _lines(caplog, "deleted slot(s) empty")
        assert len(lines) == 1 and "journal append failing (test)" in lines[0], lines
        assert _served(pool, keys) == [False] * 8 + [True] * 8
    monkeypatch.undo()  # after the close: its repair failed too, the journal is left as a killed worker leaves it
    _check_restart(tmp_path, held, gone)


def test_blocks_proven_bad_whose_dels_a_failing_journal_lost_are_counted_and_stay_gone(tmp_path, caplog, clock,
                                                                                        monkeypatch):
    """Three blocks' payloads flipped on disk, the journal failing: a host get proves one bad and drops it, a device
    reader's report (``drop_corrupt``) another, a failed load's ``drop_unreadable`` the third. Old code:
    ``vacancies_unjournaled`` 0. Now 3; after the restart the three are restore drops and misses, never served."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    keys = NS.keys(range(1, 9))
    bad, held = keys[:3], keys[3:]
    with open_pool(tmp_path, **CFG) as pool:
        _put(pool, keys)
        for k in bad:
            fi, si = pool.cat.index.get(k)
            with open(pool.cat.slabs.by_index[fi].path, "r+b") as f:
                f.seek(si * SLOT + frame.HEADER_BYTES + 1234)
                b = f.read(1)
                f.seek(si * SLOT + frame.HEADER_BYTES + 1234)
                f.write(bytes([b[0] ^ 0x08]))
        _fail_journal(monkeypatch, pool)
        assert _served(pool, bad[:1]) == [False]
        pool.drop_corrupt(bad[1], "integrity")
        assert pool.drop_unreadable(bad[2:]).result(timeout=HANG_S) == 1
        assert not any(pool.contains(k) for k in bad)
        st = pool.stats()
        assert st["corrupt"] >= 2 and st["header_clear_errors"] == 0, st
        assert st["vacancies_unjournaled"] == 3, (
            f"vacancies_unjournaled {st['vacancies_unjournaled']} for the 3 DEL records the failing journal lost")
        assert len(_lines(caplog, "cannot journal 1 deleted slot(s) empty")) == 1
    monkeypatch.undo()
    _check_restart(tmp_path, held, bad)


@pytest.mark.parametrize("recreated", [False, True], ids=["revoked", "recreated"])
def test_a_revoked_tenants_purged_blocks_that_come_back_are_never_served(tmp_path, clock, monkeypatch, recreated):
    """A revoked tenant's purge while the journal fails and the drive is gone: its 4 DELs lost (counted: 4) and its
    headers not zeroed (4). The restart indexes the 4 blocks again (by tag; G3 alone would serve them: verified
    like any). The revocation gate purges them again as it starts (G3's tenant label names acme's tag; re-created by
    ``keys create``: the keyring names its id), before any G3 lookup, load or store: gone, then and after the next
    restart; a revoked acme stays refused, a re-created one is served again. Another tenant's blocks are untouched throughout."""
    kr_path = tmp_path / "keys" / "keyring.json"
    kr = Keyring(kr_path, provider_for(kr_path), reload_every_s=0.0)
    for t in ("acme", "globex"):
        kr.create(t)
    acme, globex = NS.keys(range(1, 5), "acme"), NS.keys(range(1, 5), "globex")
    g3 = tmp_path / "g3"
    with open_pool(g3, **CFG) as pool:
        _put(pool, acme + globex)
        _fail_journal(monkeypatch, pool)
        for f in pool.cat.slabs.files:
            _read_only(f.fd, f.path)  # the drive gone: no header can be zeroed
        kr.revoke("acme")
        rt = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
        assert rt.refused("acme")
        rt.drain(HANG_S)  # the purge of the first sighting ran
        rt.close()
        assert not any(pool.contains(k) for k in acme) and all(pool.contains(k) for k in globex)
        st = pool.stats()
        assert (st["header_clear_errors"], st["vacancies_unjournaled"]) == (4, 4), st
        for f in pool.cat.slabs.files:
            _read_write(f)
    monkeypatch.undo()  # the close's repair failed: the journal still holds acme's PUTs, not their DELs
    if recreated:
        kr.create("acme")  # the operator re-creates the tenant (a new key id) while the worker is down
    kr.close()
    kr = Keyring(kr_path, provider_for(kr_path), reload_every_s=0.0)
    try:
        with open_pool(g3, **CFG) as pool:
            # acme's blocks are back (by tag, as every restored key until a request names its id: not asked here,
            # a contains() would adopt them): only the keyring check stands between them and acme's requests
            assert pool.stats()["restored_blocks"] == 8
            assert sum(type(k) is TagKey and k.tag == tag_of("acme") for k in pool.keys()) == 4
            rt = RevokedTenants(kr, [pool], interval_s=NEVER_S, start=False)
            try:  # purged as the gate starts: found by G3's tenant label of acme (re-created: by its id in the keyring)
                assert not any(type(k) is TagKey and k.tag == tag_of("acme") for k in pool.keys())
                assert rt.refused("acme") is not recreated  # a re-created tenant is served again once purged
                rt.drain(HANG_S)
                assert not any(pool.contains(k) for k in acme)
                assert _served(pool, acme + globex) == [False] * 4 + [True] * 4
            finally:
                rt.close()
        with open_pool(g3, **CFG) as pool:  # the purge's DELs were journaled this time: gone for good
            st = pool.stats()
            assert st["restored_blocks"] == 4 and st["restore_dropped"] == 0, st
            assert all(pool.contains(k) for k in globex) and not any(pool.contains(k) for k in acme)
    finally:
        kr.close()
