"""Invariant 2 for the journal: a put is reported stored (its future resolves with the block written) only
after the block's journal record is on disk AND an ``fdatasync`` of the journal started after that record
was written. Before (found in review, 2026-11-30) journal appends were never synced until close: a power cut
lost recently published blocks from the journal, and a restart, which trusts the journal for the files it
covers (no rescan), lost their hits. The barrier is one per group-commit round, not one per block.

Power loss cannot be simulated here; the real ``os.fdatasync`` is wrapped to record which file it synced and
how long that file was when the call started, and the put's done callback reads the journal through a
separate fd at the moment the put resolves. Faults (EIO from the journal's barrier and from the repair's
fsync) are injected the same way, as a failing disk would return them."""
from __future__ import annotations

import errno
import itertools
import os
import threading

import numpy as np

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from kvbm_backend.pool.g3 import journal as jr
from kvbm_backend.pool.g3 import journal_columns as jc

HANG_S = 600.0  # a hang guard, not a bound


class SyncSpy:
    """Wraps ``os.fdatasync``: records (order, path, file size when the call started) of each successful call;
    ``fail_journal`` > 0 makes that many calls on the journal fail with ``fail_errno`` (EIO unless set; not calling
    the real one)."""

    def __init__(self, monkeypatch, journal_path: str):
        self.real = os.fdatasync
        self.journal = os.path.realpath(journal_path)
        self.seq = itertools.count()
        self.lock = threading.Lock()
        self.calls: list[tuple[int, str, int]] = []
        self.fail_journal = 0
        self.fail_errno = errno.EIO
        monkeypatch.setattr(os, "fdatasync", self)

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        size = os.fstat(fd).st_size
        if path == self.journal and self.fail_journal > 0:
            self.fail_journal -= 1
            raise OSError(self.fail_errno, "injected journal fdatasync failure")
        self.real(fd)
        with self.lock:
            self.calls.append((next(self.seq), path, size))

    def journal_syncs(self) -> list[tuple[int, str, int]]:
        with self.lock:
            return [c for c in self.calls if c[1] == self.journal]

    def mark(self) -> int:
        with self.lock:
            return next(self.seq)


def _journal_seqs(pool) -> tuple[set[int], int]:
    """The sequence hashes of the live PUT entries of the pool's journal as on disk now (read through a new fd),
    and the byte length of the file."""
    with open(pool.journal.path, "rb") as f:
        data = f.read()
    head = jr.parse_header(data, pool.cat.fp)
    assert head is not None
    cols, _, _ = jc.decode(memoryview(data)[head[1]:])
    return set(np.asarray(cols.seqs).tolist()), len(data)


def test_put_resolves_only_after_its_journal_records_are_fdatasynced(tmp_path, monkeypatch):
    """At the moment a put resolves, the journal file (read through another fd) holds every block's record,
    and an fdatasync of the journal that started with the file at least that long ran before: the records
    are durable. The old code resolved puts with the records only in the page cache (no journal fdatasync
    before close): this test failed on it."""
    with open_pool(tmp_path) as pool:
        spy = SyncSpy(monkeypatch, pool.journal.path)
        for round_ in range(3):
            keys = NS.keys(range(100 * round_ + 1, 100 * round_ + 41))
            seen: dict[str, object] = {}
            called = threading.Event()

            def at_resolve(f, seen=seen, called=called):
                seen["order"] = spy.mark()
                seen["seqs"], seen["size"] = _journal_seqs(pool)
                called.set()

            fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
            fut.add_done_callback(at_resolve)
            assert fut.result(timeout=HANG_S).written == len(keys)
            assert called.wait(HANG_S)
            assert {k.seq_hash for k in keys} <= seen["seqs"], "put resolved before its records were in the journal"
            durable = [c for c in spy.journal_syncs() if c[0] < seen["order"] and c[2] >= seen["size"]]
            assert durable, (f"round {round_}: put resolved stored, but no fdatasync of the journal covering its "
                             f"records ran before (journal syncs: {spy.journal_syncs()})")
        assert pool.stats()["journal_syncs"] == len(spy.journal_syncs())


def test_journal_is_synced_once_per_round_not_per_block(tmp_path, monkeypatch):
    """256 blocks in one put are one piece and one group-commit round: one journal fdatasync, not 256. Over
    many small puts every journal fdatasync is one round's (``journal_syncs`` <= ``sync_groups``)."""
    with open_pool(tmp_path) as pool:
        spy = SyncSpy(monkeypatch, pool.journal.path)
        keys = NS.keys(range(1, 257))
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 256
        st = pool.stats()
        assert len(spy.journal_syncs()) == 1 == st["journal_syncs"] == st["sync_groups"]
        more = NS.keys(range(1000, 1064))
        futs = [pool.put([k], [payload(k.seq_hash)]) for k in more]
        assert sum(f.result(timeout=HANG_S).written for f in futs) == 64
        st = pool.stats()
        assert 2 <= len(spy.journal_syncs()) == st["journal_syncs"] <= st["sync_groups"]


def test_failed_journal_fdatasync_is_repaired_by_a_rewrite_before_the_put_resolves(tmp_path, monkeypatch):
    """The journal's barrier fails (EIO): the tier degrades and the journal is rewritten from the index (temp
    file, fsync, rename) before the put resolves, so the blocks are reported stored durably and a restart finds
    them."""
    keys = NS.keys(range(1, 33))
    with open_pool(tmp_path) as pool:
        spy = SyncSpy(monkeypatch, pool.journal.path)
        spy.fail_journal = 1
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 32
        assert pool.cat.c["journal_errors"] == 1 and pool.stats()["degraded"]
        assert {k.seq_hash for k in keys} <= _journal_seqs(pool)[0]
        monkeypatch.undo()
    with open_pool(tmp_path) as pool:
        assert pool.stats()["restored_blocks"] == 32
        out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
        assert all(pool.get(keys, out).result(timeout=HANG_S).ok)


def _fail_barrier_and_repair(monkeypatch, pool, barrier_err: int = errno.EIO, rewrite_err: int = errno.EIO) -> SyncSpy:
    """Make ``pool``'s next journal barrier (``os.fdatasync`` of its journal) fail with ``barrier_err`` and every
    fsync of a repair rewrite (a ``.journal-*`` file) fail with ``rewrite_err``, until ``monkeypatch.undo()``. The
    :class:`SyncSpy` watching the barrier."""
    spy = SyncSpy(monkeypatch, pool.journal.path)
    spy.fail_journal, spy.fail_errno = 1, barrier_err
    real_fsync = os.fsync

    def failing_fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".journal-"):
            raise OSError(rewrite_err, "injected journal rewrite fsync failure")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    return spy


def _put_failed_round(monkeypatch, pool, keys, **errs: int):
    """Put ``keys`` (their :func:`payload`) into ``pool`` while its journal's barrier and repair fail
    (:func:`_fail_barrier_and_repair` with ``errs``), then ``monkeypatch.undo()``: the PutResult (hang guard
    :data:`HANG_S` s) and ``pool.stats()`` after."""
    _fail_barrier_and_repair(monkeypatch, pool, **errs)
    res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
    monkeypatch.undo()
    return res, pool.stats()


def test_failed_journal_fdatasync_and_failed_repair_withdraw_the_round(tmp_path, monkeypatch):
    """The journal's barrier fails and so does the repair rewrite (its fsync): the round's blocks are taken out
    of the index and the put counts them dropped (``journal_error``), never stored."""
    keys = NS.keys(range(1, 33))
    with open_pool(tmp_path) as pool:
        _fail_barrier_and_repair(monkeypatch, pool)
        res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
        assert (res.written, res.dropped) == (0, 32)
        assert pool.stats()["dropped_by_reason"].get("journal_error") == 32
        assert not any(pool.contains(k) for k in keys)
        assert pool.cat.accounting()["leaked"] == 0
        monkeypatch.undo()


def test_a_failed_barrier_whose_repair_fails_too_counts_one_journal_error(tmp_path, monkeypatch):
    """The journal's barrier fails (EIO) and so does the repair rewrite (its fsync: EIO, or ENOSPC): one failure of
    the journal, counted once in ``journal_errors`` (old code: 2, the barrier's error and the rewrite's each), the
    round dropped for the rewrite's reason, ``enospc`` only for the rewrite's ENOSPC. Nothing is stored, nothing
    leaks, and a restart serves none of the round's blocks."""
    for seqs, rewrite_err, reason in ((range(1, 9), errno.EIO, "journal_error"),
                                      (range(101, 109), errno.ENOSPC, "enospc")):
        keys = NS.keys(seqs)
        with open_pool(tmp_path) as pool:
            res, st = _put_failed_round(monkeypatch, pool, keys, rewrite_err=rewrite_err)
            assert (res.written, res.dropped) == (0, 8)
            assert st["journal_errors"] == 1, f"journal_errors {st['journal_errors']} for one failed barrier + repair"
            assert st["enospc"] == (reason == "enospc"), st
            assert st["dropped_by_reason"] == {reason: 8}, st
            assert pool.cat.accounting()["leaked"] == 0
        with open_pool(tmp_path) as pool:
            out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
            assert not any(pool.get(keys, out).result(timeout=HANG_S).ok)


def test_a_barrier_out_of_space_whose_repair_meets_eio_still_counts_enospc(tmp_path, monkeypatch):
    """The journal's barrier fails for space (ENOSPC, then EDQUOT) and the repair rewrite's fsync with EIO: one
    journal failure (``journal_errors`` 1), counted ``enospc`` and its round dropped for ``enospc`` (the drive is full,
    whatever the rewrite met after). Code from 0686707 kept only the rewrite's errno: ``enospc`` 0, reason
    ``journal_error``, the no-space condition not counted at all."""
    for seqs, barrier_err in ((range(201, 209), errno.ENOSPC), (range(301, 309), errno.EDQUOT)):
        keys = NS.keys(seqs)
        with open_pool(tmp_path) as pool:
            res, st = _put_failed_round(monkeypatch, pool, keys, barrier_err=barrier_err)
            assert (res.written, res.dropped) == (0, 8)
            assert st["journal_errors"] == 1, st
            assert st["enospc"] == 1, f"enospc {st['enospc']} after a barrier's {errno.errorcode[barrier_err]}"
            assert st["dropped_by_reason"] == {"enospc": 8}, st
            assert pool.cat.accounting()["leaked"] == 0
        with open_pool(tmp_path) as pool:
            out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
            assert not any(pool.get(keys, out).result(timeout=HANG_S).ok)
