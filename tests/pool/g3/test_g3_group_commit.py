"""Group commit in the G3 writer (``g3.group_commit_ms``, ``g3.group_commit_bytes``): a written piece
waits for pieces still being written so that one barrier (fdatasync per file + one journal append)
publishes them together, at most ``group_commit_ms`` and at most as long as the previous barrier took,
and never past ``group_commit_bytes`` waiting; nothing is published before the barrier that covers it.
Real posix engine and real fdatasync (made slow by a sleep before it, as a slow flush); the engine
holds back one piece's write until the test releases it (a slow disk, deterministic). Tests whose check is
"did not wait" run the writer on a clock that stands still except by each slow flush's duration (``frozen``):
a writer that wrongly waits then waits until the test releases the held piece, so the check needs no
wall-clock margin (CI, 2026-11-29 review: margins of 0.1-0.5 s on a busy 2-core runner at nice 19)."""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future

import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.io import fdatasync as real_fdatasync
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3 import pool as pool_mod
from kvbm_backend.pool.g3 import writer as writer_mod

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (results, a publication, the test's release); returns as soon as it does

SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)
PIECE = 3  # blocks per piece (chunk_bytes = 3 slots)


class HoldSecondWrite(PosixEngine):
    """Posix engine; write submission number ``hold`` starts only once :attr:`release` is set. Records
    when write number ``hold - 1`` finished (``first_done``)."""

    def __init__(self, hold: int = 3):
        super().__init__(threads=2)
        self.hold = hold
        self.release = threading.Event()
        self.first_done = None
        self._writes = 0
        self._lock = threading.Lock()

    def submit(self, ops):
        ops = list(ops)
        if not ops or not ops[0].write:
            return super().submit(ops)
        with self._lock:
            self._writes += 1
            n = self._writes
        out: Future = Future()

        def finish(f):
            if n == self.hold - 1:
                self.first_done = time.monotonic()
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result())

        if n == self.hold:
            def later():
                self.release.wait(HANG_S)
                super(HoldSecondWrite, self).submit(ops).add_done_callback(finish)
            threading.Thread(target=later, daemon=True).start()
        else:
            super().submit(ops).add_done_callback(finish)
        return out


@pytest.fixture
def pieces(monkeypatch):
    monkeypatch.setattr(G3Pool, "chunk_bytes", PIECE * SLOT)
    monkeypatch.setattr(G3Pool, "min_chunk_blocks", 1)
    monkeypatch.setattr(G3Pool, "chunks_in_flight", 2)
    syncs = []

    def slow_sync(fd):  # a slow flush: every barrier takes >= SLOW_S, so the next group may wait that long
        syncs.append((fd, time.monotonic()))
        if isinstance(writer_mod.time, _Clock):
            writer_mod.time.now += SLOW_S  # on the writer's frozen clock the flush took SLOW_S
        else:
            time.sleep(SLOW_S)
        real_fdatasync(fd)

    monkeypatch.setattr(pool_mod, "fdatasync", slow_sync)
    return syncs


SLOW_S = 1.5


class _Clock:
    """The writer's ``time`` module in ``frozen`` tests: ``monotonic()`` stands still unless advanced."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self):
        return self.now


@pytest.fixture
def frozen(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(writer_mod, "time", clock)
    return clock


def _first_barrier(pool, syncs):
    """One piece alone (write number 1), so the pool has seen a barrier take >= SLOW_S."""
    k = NS.keys([10_000 + i for i in range(PIECE)])
    assert pool.put(k, [payload(x.seq_hash) for x in k]).result(timeout=HANG_S).written == PIECE
    assert len(syncs) == 1 and pool.stats()["sync_groups"] == 1


def _wait_visible(pool, key, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pool.contains(key):
            return time.monotonic()
        time.sleep(0.002)
    return None


def test_group_commit_ms_bounds_the_wait_for_pieces_in_flight(tmp_path, pieces):
    """A piece waits for the held next one, but no longer than group_commit_ms (0.3 s; the last barrier
    took >= 1.5 s): it is published (alone, its own barrier) while the next is still held, not before
    the bound."""
    eng = HoldSecondWrite()
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=1, group_commit_ms=300, group_commit_bytes=0) as pool:
            _first_barrier(pool, pieces)
            keys = NS.keys(range(1, 2 * PIECE + 1))
            fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
            seen = _wait_visible(pool, keys[0], HANG_S)
            assert seen is not None and not eng.release.is_set()
            assert seen - eng.first_done >= 0.25, "published before group_commit_ms although a piece was in flight"
            assert all(pool.contains(k) for k in keys[:PIECE]) and not any(pool.contains(k) for k in keys[PIECE:])
            assert pool.stats()["sync_groups"] == 2 and len(pieces) == 2  # the first put's, then this piece's
            eng.release.set()
            assert fut.result(timeout=HANG_S).written == 2 * PIECE
            assert pool.stats()["sync_groups"] == 3
            out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
            assert all(pool.get(keys, out).result(timeout=HANG_S).ok)
    finally:
        eng.release.set()
        eng.close()


def test_group_commit_ms_groups_pieces_under_one_barrier(tmp_path, pieces, frozen):
    """A piece released inside the wait bound (1 s; the last barrier took 1.5 s; the writer's clock stands
    still meanwhile) joins the waiting one's group: one fdatasync and one journal append publish both; with
    group_commit_ms = 0 each piece has its own barrier."""
    for ms, groups in ((1000, 2), (0, 3)):
        pieces.clear()
        eng = HoldSecondWrite()
        try:
            with open_pool(tmp_path / f"ms{ms}", engine=eng, files_per_path=1, group_commit_ms=ms,
                           group_commit_bytes=0) as pool:
                _first_barrier(pool, pieces)
                keys = NS.keys(range(1, 2 * PIECE + 1))
                fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
                if ms:
                    time.sleep(0.4)
                    assert not pool.contains(keys[0])  # waiting for its group, not published
                else:
                    assert _wait_visible(pool, keys[0], HANG_S) is not None  # no wait: published alone
                journal_before = pool.journal.records
                eng.release.set()
                assert fut.result(timeout=HANG_S).written == 2 * PIECE
                st = pool.stats()
                assert st["sync_groups"] == groups and len(pieces) == groups, (ms, st["sync_groups"], pieces)
                assert pool.journal.records - journal_before == (2 * PIECE if ms else PIECE)
        finally:
            eng.release.set()
            eng.close()


def test_group_commit_bytes_starts_the_barrier_without_waiting(tmp_path, pieces, frozen):
    """Once group_commit_bytes of slots are waiting, the barrier starts at once even though the wait
    bound (1 s: group_commit_ms, the most allowed; the last barrier took 1.5 s) has not passed and a
    piece is still in flight: on the writer's frozen clock a writer that waited would publish only after
    the held piece is released."""
    eng = HoldSecondWrite()
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=1, group_commit_ms=1000,
                       group_commit_bytes=PIECE * SLOT) as pool:
            _first_barrier(pool, pieces)
            keys = NS.keys(range(1, 2 * PIECE + 1))
            fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
            assert _wait_visible(pool, keys[0], HANG_S) is not None and not eng.release.is_set(), \
                "the barrier waited although group_commit_bytes were ready"
            eng.release.set()
            assert fut.result(timeout=HANG_S).written == 2 * PIECE and pool.stats()["sync_groups"] == 3
    finally:
        eng.release.set()
        eng.close()


def test_group_commit_settings_validated():
    from pydantic import ValidationError

    from tests.helpers.crash_writer import config
    with pytest.raises(ValidationError):
        config("/tmp/x", group_commit_ms=-1)
    with pytest.raises(ValidationError):
        config("/tmp/x", group_commit_ms=1001)
    with pytest.raises(ValidationError):
        config("/tmp/x", group_commit_bytes=-1)


def test_no_wait_without_a_slow_barrier(tmp_path, monkeypatch, pieces, frozen):
    """The wait is bounded by the last barrier's duration: with fast barriers (0 s on the writer's frozen
    clock), a piece is published while the next one is still held, although group_commit_ms is 1 s (a
    writer that waited would publish only after the release)."""
    monkeypatch.setattr(sys.modules[__name__], "SLOW_S", 0.0)
    eng = HoldSecondWrite(hold=2)
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=1, group_commit_ms=1000, group_commit_bytes=0) as pool:
            keys = NS.keys(range(1, 2 * PIECE + 1))
            fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
            seen = _wait_visible(pool, keys[0], HANG_S)
            assert seen is not None and not eng.release.is_set()
            eng.release.set()
            assert fut.result(timeout=HANG_S).written == 2 * PIECE
    finally:
        eng.release.set()
        eng.close()
