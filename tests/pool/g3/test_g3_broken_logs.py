"""A steady broken state logs once a minute per pool and kind, and counts every occurrence (review, 2026-12-03).

While the G3 journal takes no appends (broken: an append failed and could not be cut back; its rewrite failing too)
every put's failed journal append releases its slots and :func:`kvbm_backend.pool.g3.vacancy.journal_vacant`
logged a WARNING ("cannot journal N emptied slot(s) empty") each time: one line per put, per block when puts carry
one, and nothing counted them. A drive gone did the same with every header write (a delete, a failed write's
slots: "cannot clear the header of removed slot") and every batch write ("write failed"), a failing journal drive
with every round's barrier ("fdatasync failed; rewritten from the index"), a failing drive under slots kept past
a shrunk share with each of those ("cannot clear the header of slot N ... past its file's share"). Now each is a
:class:`kvbm_backend.log_limits.LimitedLog` line, one per kind and pool per minute (the next says how many were
left out), and ``stats()`` counts every one: ``vacancies_unjournaled``, ``header_clear_errors``,
``write_errors``, ``journal_errors``. The same holds for the "tier degraded" WARNING of a journal that stays
broken (one per degradation, i.e. per put once ``degrade_s`` is over, until late 2026-12-03), counted
``degradations``; a journal failure that is not an OSError (a bug) is still logged every time, with its traceback.

Real pools on real files. The journal is broken the way a failing or read-only drive breaks it: its descriptor
made read-only (``dup2``: every write EBADF, the cut-back ``ftruncate`` EINVAL, so the journal marks itself broken)
and a directory swapped in at its name (every repair rewrite's rename fails: EISDIR); a drive gone is the slab
files' descriptors made read-only (every ``pwritev``, ``fallocate`` and ``ftruncate`` fails). The failing journal
barrier is ``os.fdatasync`` failing with EIO for the journal's file, as tests/pool/g3/test_g3_journal_sync.py
does. The limiters' clocks are frozen (a test's run time never decides a line), then moved past the minute. Each
test ends with the drive or journal back and a restart that serves exactly the blocks held: nothing good lost,
nothing gone served.

The counters count what their docs/operations.md row says (review, 2026-12-03): a vacancy record lost by a
failing journal's append (not yet broken: the records went through ``SlotCatalog.journal_append``) is counted in
``vacancies_unjournaled`` like one a broken journal refused (before: not counted); a journal failure is counted
in ``journal_errors`` and, when it is for space, in ``enospc``, never in the slab files' ``write_errors`` (before:
a failing journal barrier with healthy slab files counted ``write_errors`` every round). A slab ENOSPC
degradation follows the rule of a journal's: its WARNING ("write failed ... tier degraded") one per pool per
minute, every degradation counted (``degradations``, ``enospc``).
"""
from __future__ import annotations

import errno
import logging
import os

import pytest

from kvbm_backend.log_limits import LimitedLog
from kvbm_backend.pool.g3 import journal_sync, slab_share, vacancy, writer
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.g3_restart import CFG, HANG_S, SLOTS, check_restored
from tests.pool.g3.test_g3_enospc import EnospcEngine

N = 30  # occurrences of each kind: many more than the one line a minute that may be logged


@pytest.fixture
def clock(monkeypatch):
    """The G3 modules' limited loggers, on one clock that stands still until a test moves it (seconds)."""
    now = [1000.0]
    for mod in (vacancy, writer, journal_sync, slab_share):
        # raising=False: the code before the fix has no LOG; then its WARNINGs go out unlimited
        monkeypatch.setattr(mod, "LOG", LimitedLog(mod.log, clock=lambda: now[0]), raising=False)
    return now


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def _put_one(pool, seq: int) -> tuple[int, int]:
    r = pool.put(NS.keys([seq]), [payload(seq)]).result(timeout=HANG_S)
    return r.written, r.dropped


def _read_only(fd: int, path: str) -> None:
    """Make ``fd`` a read-only descriptor of ``path`` (same number): writes fail as on a read-only drive."""
    ro = os.open(path, os.O_RDONLY)
    try:
        os.dup2(ro, fd)
    finally:
        os.close(ro)


def _read_write(f) -> None:
    """Give slab file ``f`` (a :class:`~kvbm_backend.pool.g3.slabs.SlabFile`) its writable descriptor back (same
    number, O_DIRECT as the pool opened it): the drive back after :func:`_read_only`."""
    rw = os.open(f.path, os.O_RDWR | (getattr(os, "O_DIRECT", 0) if f.o_direct else 0))
    try:
        os.dup2(rw, f.fd)
    finally:
        os.close(rw)


def test_a_failing_journal_append_counts_and_logs_the_emptied_slots_it_did_not_take(tmp_path, caplog, clock,
                                                                                   monkeypatch):
    """The pool full, 8 blocks deleted (free slots inside the slab file); then the slab files fail every write and
    the journal every append (EIO; its cut-back works: the journal stays open, not broken, so the vacancy records
    go through ``SlotCatalog.journal_append``). One put: its slab write fails, its slot's header cannot be zeroed,
    and the slot's vacancy record is lost with the failed append. Old code: ``vacancies_unjournaled`` 0 and no
    "cannot journal" line (``journal_append`` swallowed the failure). Now 1, the line names the append's error. The
    drive back, a restart serves exactly the blocks held."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    keys = NS.keys(range(1, SLOTS + 1))  # the slab file grown to every slot: a freed slot is inside it
    with open_pool(tmp_path, **CFG) as pool:
        pool.degrade_s = 0.0
        r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (SLOTS, 0)
        assert pool.delete(keys[:8]).result(timeout=HANG_S) == 8
        journal, real_write = os.path.realpath(pool.journal.path), os.write

        def write(fd, data):
            if os.readlink(f"/proc/self/fd/{fd}") == journal:
                raise OSError(errno.EIO, "journal append failing (test)")
            return real_write(fd, data)

        for f in pool.cat.slabs.files:
            _read_only(f.fd, f.path)
        monkeypatch.setattr(os, "write", write)
        assert _put_one(pool, 1000) == (0, 1)
        monkeypatch.undo()
        assert not pool.journal.broken  # a failing journal, not a broken one: the journal_append path
        st = pool.stats()
        assert (st["header_clear_errors"], st["journal_errors"]) == (1, 1), st
        assert st["vacancies_unjournaled"] == 1, (
            f"vacancies_unjournaled {st['vacancies_unjournaled']} for the 1 slot whose vacancy record the failed append lost")
        lines = _lines(caplog, "emptied slot(s) empty")
        assert len(lines) == 1 and "journal append failing (test)" in lines[0], lines
        for f in pool.cat.slabs.files:
            _read_write(f)  # the drive back: the clean close repairs the journal from the index
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, keys[8:], keys[:8] + NS.keys([1000]))


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC], ids=["eio", "enospc"])
def test_a_failing_journal_barrier_counts_journal_errors_not_slab_write_errors(tmp_path, caplog, clock, monkeypatch,
                                                                              err):
    """The journal's ``fdatasync`` fails every round while the slab files are healthy (every put stored, through
    the repair). ``write_errors`` counts slab write failures only (docs/operations.md): it stays 0; every round is
    in ``journal_errors``, and a journal out of space in ``enospc`` too (a full journal drive is no space, as a
    full slab drive is). Old code: ``write_errors`` N for the EIO journal."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    n = 5
    with open_pool(tmp_path, **CFG) as pool:
        pool.degrade_s = 0.0
        journal, real_fdatasync = os.path.realpath(pool.journal.path), os.fdatasync

        def fdatasync(fd):
            if os.readlink(f"/proc/self/fd/{fd}") == journal:
                raise OSError(err, "journal drive failing (test)")
            real_fdatasync(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        keys = NS.keys(range(1, n + 1))
        for k in keys:
            assert _put_one(pool, k.seq_hash) == (1, 0)
        monkeypatch.undo()
        st = pool.stats()
        nospace = n if err == errno.ENOSPC else 0
        got = (st["journal_errors"], st["write_errors"], st["enospc"])
        assert got == (n, 0, nospace), f"(journal_errors, write_errors, enospc) {got} with no slab write failing"
        assert st["dropped_by_reason"] == {}, st
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, keys, [])


def test_slab_enospc_degradations_log_once_a_minute_and_count_every_one(tmp_path, caplog, clock):
    """Slab writes failing ENOSPC: each put (``degrade_s`` 0: admitted again at once) degrades the tier anew. As
    for a journal that stays broken, the degradation's WARNING ("write failed ...; tier degraded") is one per pool
    per minute and every degradation is counted: two within a minute, one line, ``degradations`` and ``enospc``
    2; a minute later the next line says one was left out. (A review of 113c274 asked for a line per slab ENOSPC
    degradation; cdfd060's rule, one per pool per minute, supersedes it.) The blocks held survive a restart."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    held = NS.keys(range(1, 9))
    eng = EnospcEngine(threads=2)
    try:
        with open_pool(tmp_path, engine=eng, **CFG) as pool:
            eng.full = False
            r = pool.put(held, [payload(k.seq_hash) for k in held]).result(timeout=HANG_S)
            assert (r.written, r.dropped) == (8, 0)
            eng.full = True
            pool.degrade_s = 0.0  # each put admitted again at once: each meets ENOSPC, a new degradation
            for seq in (1000, 1001):
                assert _put_one(pool, seq) == (0, 1)
            lines = _lines(caplog, "tier degraded")
            assert len(lines) == 1 and "write failed" in lines[0] and "No space left" in lines[0], lines
            st = pool.stats()
            assert (st["degradations"], st["enospc"], st["write_errors"]) == (2, 2, 0), st
            assert st["dropped_by_reason"] == {"enospc": 2}, st
            clock[0] += 61.0
            assert _put_one(pool, 1002) == (0, 1)
            lines = _lines(caplog, "tier degraded")
            assert len(lines) == 2 and "(1 more like it in the last 61 s" in lines[1], lines
            st = pool.stats()
            assert (st["degradations"], st["enospc"]) == (3, 3), st
            eng.full = False
    finally:
        eng.close()
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, held, NS.keys([1000, 1001, 1002]))


def _flood_broken_journal(pool, caplog, clock, text: str, counter: str) -> str:
    """Break ``pool``'s journal for good (:func:`_break_journal`; ``degrade_s`` 0: every put meets it), put N one-block
    batches (each dropped, ``journal_error``), and check the WARNINGs containing ``text``: one line, ``counter`` and
    ``journal_errors`` N; a minute later the next put's line says N - 1 were left out, ``counter`` N + 1. Returns the
    journal's path (``os.rmdir`` it to give the drive back)."""
    pool.degrade_s = 0.0
    path = _break_journal(pool)
    for i in range(N):
        assert _put_one(pool, 1000 + i) == (0, 1)
    assert pool.journal.broken
    lines = _lines(caplog, text)
    assert len(lines) == 1, f"{len(lines)} lines for {N} puts: {lines[:3]}"
    st = pool.stats()
    assert (st[counter], st["journal_errors"]) == (N, N), st
    assert st["dropped_by_reason"] == {"journal_error": N}, st
    clock[0] += 61.0
    assert _put_one(pool, 2000) == (0, 1)
    lines = _lines(caplog, text)
    assert len(lines) == 2 and f"({N - 1} more like it in the last 61 s" in lines[1], lines
    assert pool.stats()[counter] == N + 1
    return path


def test_a_broken_journal_logs_its_unjournaled_vacancies_once_a_minute_and_counts_every_slot(tmp_path, caplog,
                                                                                             clock):
    """Old code: N lines "cannot journal 1 emptied slot(s) empty" for N one-block puts, nothing counted. Now one
    line; ``vacancies_unjournaled`` N and ``journal_errors`` N; a minute later the next line says N-1 were left out."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    held = NS.keys(range(1, 17))
    with open_pool(tmp_path, **CFG) as pool:
        r = pool.put(held, [payload(k.seq_hash) for k in held]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (16, 0)
        path = _flood_broken_journal(pool, caplog, clock, "emptied slot(s) empty", "vacancies_unjournaled")
        os.rmdir(path)  # the drive back: the clean close repairs the journal from the index
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, held, NS.keys([*range(1000, 1000 + N), 2000]))


def _break_journal(pool) -> str:
    """Break ``pool``'s journal for good (its fd read-only, a directory at its name: every repair's rename fails);
    returns its path (``os.rmdir`` it to give the drive back)."""
    path = os.path.realpath(pool.journal.path)
    _read_only(pool.journal.fd, path)
    os.rename(path, path + ".moved")
    os.mkdir(path)
    return path


def test_a_journal_that_stays_broken_logs_tier_degraded_once_a_minute_and_counts_every_degradation(tmp_path, caplog,
                                                                                                  clock):
    """While the journal stays broken every put after the degraded window (``degrade_s``; 0 here, so every put)
    degrades the tier again. Old code: one "tier degraded" WARNING per degradation (N puts: N lines; 720 an hour
    per pool at the 5 s default) and no count of degradations. Now one line per pool per minute, ``degradations``
    N, and a minute later the next line says N-1 were left out. The blocks held before survive a restart."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    held = NS.keys(range(1, 17))
    with open_pool(tmp_path, **CFG) as pool:
        r = pool.put(held, [payload(k.seq_hash) for k in held]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (16, 0)
        path = _flood_broken_journal(pool, caplog, clock, "tier degraded", "degradations")
        assert path in _lines(caplog, "tier degraded")[0] and "(degradations)" in _lines(caplog, "tier degraded")[0]
        os.rmdir(path)  # the drive back: the clean close repairs the journal from the index
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, held, NS.keys([*range(1000, 1000 + N), 2000]))
        assert pool.stats()["degradations"] == 0  # counted per pool since open


def test_a_journal_failure_that_is_not_an_oserror_is_logged_every_time_with_its_traceback(tmp_path, caplog, clock):
    """A journal failure that is not an OSError is a bug: never rate-limited, each logged with its traceback (the
    limiter is for a steady broken drive). Counted in ``journal_errors``; ``degradations`` counts the one change
    from admitting to degraded (the later failures fall inside its window: 1 h here). A restart keeps the blocks."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    held = NS.keys(range(1, 9))
    n = 5
    with open_pool(tmp_path, **CFG) as pool:
        r = pool.put(held, [payload(k.seq_hash) for k in held]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (8, 0)
        pool.degrade_s = 3600.0
        for i in range(n):
            try:
                raise RuntimeError(f"a bug in the journal path ({i})")
            except RuntimeError as e:
                with pool.cat.lock:
                    pool.cat.journal_failed(e)
        recs = [r for r in caplog.records if "tier degraded" in r.getMessage()]
        assert len(recs) == n and all(r.exc_info and r.exc_info[0] is RuntimeError for r in recs), recs
        st = pool.stats()
        assert (st["degradations"], st["journal_errors"], st["degraded"]) == (1, n, True), st
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, held, [])


def test_a_drive_gone_logs_its_header_and_write_failures_once_a_minute_and_counts_every_one(tmp_path, caplog,
                                                                                            clock):
    """Old code: a "cannot clear the header of removed slot" line per deleted block and a "write failed" line per
    put; nothing counted the headers. Now one line each; ``header_clear_errors`` counts every slot, ``write_errors``
    every batch. The deletes stand (journaled), the failed puts store nothing."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    held = NS.keys(range(1, 41))
    gone = held[:N]
    with open_pool(tmp_path, **CFG) as pool:
        r = pool.put(held, [payload(k.seq_hash) for k in held]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (40, 0)
        pool.degrade_s = 0.0
        for f in pool.cat.slabs.files:
            _read_only(f.fd, f.path)
        for k in gone:
            assert pool.delete([k]).result(timeout=HANG_S) == 1
        lines = _lines(caplog, "cannot clear the header of removed slot")
        assert len(lines) == 1, f"{len(lines)} lines for {N} deletes: {lines[:3]}"
        assert pool.stats()["header_clear_errors"] == N
        failed = NS.keys(range(1000, 1000 + N))
        for k in failed:
            assert _put_one(pool, k.seq_hash) == (0, 1)
        lines = _lines(caplog, "write failed")
        assert len(lines) == 1, f"{len(lines)} lines for {N} failed puts: {lines[:3]}"
        st = pool.stats()
        assert st["write_errors"] == N and st["dropped_by_reason"] == {"io_error": N}, st
        assert st["header_clear_errors"] >= N, st
        clock[0] += 61.0
        assert _put_one(pool, 5000) == (0, 1)
        lines = _lines(caplog, "write failed")
        assert len(lines) == 2 and f"({N - 1} more like it" in lines[1], lines
    with open_pool(tmp_path, **CFG) as pool:  # the deleted blocks' headers are intact: their DELs keep them gone
        check_restored(pool, held[N:], gone + failed + NS.keys([5000]))


def _fail_barrier(monkeypatch, pool) -> None:
    """Make ``pool``'s journal barrier (``os.fdatasync`` of its journal) fail with EIO; its repair rewrite works."""
    journal, real_fdatasync = os.path.realpath(pool.journal.path), os.fdatasync

    def fdatasync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == journal:
            raise OSError(errno.EIO, "journal drive failing (test)")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)


def test_a_failing_journal_barrier_logs_its_repairs_once_a_minute_and_counts_every_one(tmp_path, caplog, clock,
                                                                                       monkeypatch):
    """The journal's ``fdatasync`` fails every round (EIO) while its rewrite works: every round's records are made
    durable by the repair (the puts store their blocks). Old code: N lines "fdatasync failed; rewritten from the
    index"; now one, ``journal_errors`` N."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    with open_pool(tmp_path, **CFG) as pool:
        pool.degrade_s = 0.0
        _fail_barrier(monkeypatch, pool)
        keys = NS.keys(range(1, N + 1))
        for k in keys:
            assert _put_one(pool, k.seq_hash) == (1, 0)
        monkeypatch.undo()
        lines = _lines(caplog, "fdatasync failed")
        assert len(lines) == 1, f"{len(lines)} lines for {N} rounds: {lines[:3]}"
        assert pool.stats()["journal_errors"] == N
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, keys, [])


def test_slots_past_a_shrunk_share_on_a_drive_gone_log_once_a_minute(tmp_path, caplog, clock):
    """Blocks kept past their file's share (``files_per_path`` raised at a restart) on a drive gone: each delete's
    slot release (punch, then header write) failed with a WARNING per slot. Old code: one line per block; now one.
    The deletes stand: a restart serves exactly the blocks left."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    cap = dict(capacity_gb=CFG["capacity_gb"])
    keys = NS.keys(range(1, 41))
    with open_pool(tmp_path, files_per_path=1, **cap) as pool:
        r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
        assert (r.written, r.dropped) == (40, 0)
    with open_pool(tmp_path, files_per_path=2, **cap) as pool:
        at = {k: tuple(pool.cat.index.get(k)) for k in keys}  # (file index, slot)
        over = [k for k in keys if at[k][1] >= pool.cat.slabs.by_index[at[k][0]].max_slots]
        assert len(over) >= 10, len(over)
        for f in pool.cat.slabs.files:
            _read_only(f.fd, f.path)
        for k in over:
            assert pool.delete([k]).result(timeout=HANG_S) == 1
        lines = _lines(caplog, "cannot clear the header of slot")
        assert len(lines) == 1, f"{len(lines)} lines for {len(over)} slots: {lines[:3]}"
        assert len(_lines(caplog, "cannot clear the header of removed slot")) == 1
        assert pool.stats()["header_clear_errors"] == len(over)
    with open_pool(tmp_path, files_per_path=2, **cap) as pool:
        check_restored(pool, [k for k in keys if k not in over], over)


def test_each_kind_of_unjournaled_slot_has_its_own_line_a_minute(tmp_path, caplog, clock):
    """Emptied, withdrawn and deleted slots the journal did not take are each one WARNING a minute per pool: a
    "deleted" line within the minute of an "emptied" one is not swallowed by it (review of 2026-12-03: one key for
    all three), and each names what a restart does with such a block."""
    with open_pool(tmp_path, **CFG) as pool:
        cat = pool.cat
        with caplog.at_level(logging.WARNING):
            for what in ("emptied", "withdrawn", "deleted", "deleted"):
                vacancy.unjournaled(cat, 2, OSError(errno.EIO, "test"), what)
        lines = _lines(caplog, "cannot journal")
        assert [w for w in ("emptied", "withdrawn", "deleted") for ln in lines if f" {w} slot(s)" in ln] == \
            ["emptied", "withdrawn", "deleted"], lines
        assert all("verified again" in ln for ln in lines), lines
        assert pool.stats()["vacancies_unjournaled"] == 8


def _kinds(lg: LimitedLog) -> list[str]:
    """The kinds ``lg`` holds a budget for (the code before 2026-12-03 has no ``kinds()``: its dict)."""
    return lg.kinds() if hasattr(lg, "kinds") else list(lg._last)


def test_a_pool_reopened_at_the_same_path_has_its_own_degraded_warning_budget(tmp_path, caplog, clock, monkeypatch):
    """A pool closed and opened again at the same paths in one process (a warm restart in place, tests) gets its own
    "tier degraded" budget: its first degradation is logged though the closed pool's line was logged a moment
    before (the limiters' clock stands still). Old code: the limiter's kind, ``"degraded {journal path}"``, was the
    closed pool's budget: the new pool's first line was left out (1 line, not 2). And a closed pool leaves no kind
    behind in any limiter (each kind naming its journal or a slab file was kept for the process's life)."""
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g3")
    limiters = (vacancy.LOG, writer.LOG, journal_sync.LOG, slab_share.LOG)
    held: list[str] = []  # kinds of closed pools still held by a limiter (asserted last: the log lines first)
    for round_ in range(2):
        with open_pool(tmp_path, **CFG) as pool:
            path = pool.journal.path
            subjects = (path, *(f.path for f in pool.cat.slabs.files))
            with monkeypatch.context() as m:  # not undo(): that would put back the limiters the clock fixture froze
                _fail_barrier(m, pool)
                assert _put_one(pool, 1 + round_) == (1, 0)  # stored through the repair, the tier degraded
            assert pool.stats()["degradations"] == 1
            lines = _lines(caplog, "tier degraded")
            assert len(lines) == round_ + 1, f"pool {round_ + 1}'s first degradation not logged: {lines}"
            assert path in lines[-1] and "(degradations)" in lines[-1], lines
            assert any(k.endswith(path) for lg in limiters for k in _kinds(lg))
        held += [k for lg in limiters for k in _kinds(lg) if k.endswith(subjects)]
    assert not held, f"kinds of closed pools kept: {held}"
    with open_pool(tmp_path, **CFG) as pool:
        check_restored(pool, NS.keys([1, 2]), [])


def test_forget_drops_only_the_kinds_naming_its_subjects(clock):
    """:func:`kvbm_backend.log_limits.forget` drops, in every limiter, the kinds that are or end with a subject
    (after a space), whatever else a kind holds (a path with spaces), and no other kind: "/a/j.log" is not
    "/a/j.log2" nor "x/a/j.log"."""
    from kvbm_backend import log_limits
    lg = LimitedLog(logging.getLogger("test.forget"), clock=lambda: clock[0])
    kinds = ["degraded /a/j.log", "/a/j.log", "vacancy emptied /a/j.log", "degraded /a/j.log2", "degraded x/a/j.log",
             "header /b c/s.slab", "other"]
    for k in kinds:
        assert lg.warning(k, "line %s", k)
    assert log_limits.forget("/a/j.log", "/b c/s.slab") >= 4
    assert sorted(lg.kinds()) == sorted(["degraded /a/j.log2", "degraded x/a/j.log", "other"])
    assert log_limits.forget() == 0 and lg.warning("degraded /a/j.log", "logged again") and not lg.warning("other", "")
