"""Group commit in the G3 writer (``g3.group_commit_ms``, ``g3.group_commit_bytes``): a written piece
waits for pieces still being written so that one barrier (fdatasync per file + one journal append)
publishes them together, at most ``group_commit_ms`` and never past ``group_commit_bytes`` waiting;
nothing is published before the barrier that covers it. Real posix engine and real fdatasync; the
engine holds back the second piece's write until the test releases it (a slow disk, deterministic)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.io import fdatasync as real_fdatasync
from kvbm_backend.io.posix import PosixEngine
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3 import pool as pool_mod

SLOT = frame.slot_bytes(LAYOUT.bytes_per_block)
PIECE = 3  # blocks per piece (chunk_bytes = 3 slots)


class HoldSecondWrite(PosixEngine):
    """Posix engine; the second write submission starts only once :attr:`release` is set. Records when
    the first write finished (``first_done``)."""

    def __init__(self):
        super().__init__(threads=2)
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
            if n == 1:
                self.first_done = time.monotonic()
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result())

        if n == 2:
            def later():
                self.release.wait(30)
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
    monkeypatch.setattr(pool_mod, "fdatasync", lambda fd: (syncs.append((fd, time.monotonic())), real_fdatasync(fd)))
    return syncs


def _wait_visible(pool, key, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pool.contains(key):
            return time.monotonic()
        time.sleep(0.002)
    return None


def test_group_commit_ms_bounds_the_wait_for_pieces_in_flight(tmp_path, pieces):
    """The first piece waits for the held second one, but no longer than group_commit_ms: it is
    published (alone, its own barrier) while the second is still held, not before the bound."""
    eng = HoldSecondWrite()
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=1, group_commit_ms=300, group_commit_bytes=0) as pool:
            keys = NS.keys(range(1, 2 * PIECE + 1))
            fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
            seen = _wait_visible(pool, keys[0], 20)
            assert seen is not None and not eng.release.is_set()
            assert seen - eng.first_done >= 0.25, "published before group_commit_ms although a piece was in flight"
            assert all(pool.contains(k) for k in keys[:PIECE]) and not any(pool.contains(k) for k in keys[PIECE:])
            assert pool.stats()["sync_groups"] == 1 and len(pieces) == 1  # one barrier so far, of the first piece
            eng.release.set()
            assert fut.result(timeout=30).written == 2 * PIECE
            assert pool.stats()["sync_groups"] == 2
            out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
            assert all(pool.get(keys, out).result(timeout=30).ok)
    finally:
        eng.release.set()
        eng.close()


def test_group_commit_ms_groups_pieces_under_one_barrier(tmp_path, pieces):
    """A piece released well inside group_commit_ms joins the first one's group: one fdatasync and
    one journal append publish both; with group_commit_ms = 0 each piece has its own barrier."""
    for ms, groups in ((1000, 1), (0, 2)):
        pieces.clear()
        eng = HoldSecondWrite()
        try:
            with open_pool(tmp_path / f"ms{ms}", engine=eng, files_per_path=1, group_commit_ms=ms,
                           group_commit_bytes=0) as pool:
                keys = NS.keys(range(1, 2 * PIECE + 1))
                fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
                if ms:
                    time.sleep(0.3)
                    assert not pool.contains(keys[0])  # waiting for its group, not published
                else:
                    assert _wait_visible(pool, keys[0], 20) is not None  # no wait: published alone
                journal_before = pool.journal.records
                eng.release.set()
                assert fut.result(timeout=30).written == 2 * PIECE
                st = pool.stats()
                assert st["sync_groups"] == groups and len(pieces) == groups, (ms, st["sync_groups"], pieces)
                assert pool.journal.records - journal_before == (2 * PIECE if ms else PIECE)
        finally:
            eng.release.set()
            eng.close()


def test_group_commit_bytes_starts_the_barrier_without_waiting(tmp_path, pieces):
    """Once group_commit_bytes of slots are waiting, the barrier starts at once even though
    group_commit_ms (1 s, the most allowed) has not passed and a piece is still in flight."""
    eng = HoldSecondWrite()
    try:
        with open_pool(tmp_path, engine=eng, files_per_path=1, group_commit_ms=1000,
                       group_commit_bytes=PIECE * SLOT) as pool:
            keys = NS.keys(range(1, 2 * PIECE + 1))
            fut = pool.put(keys, [payload(k.seq_hash) for k in keys])
            assert _wait_visible(pool, keys[0], 20) is not None and not eng.release.is_set()
            assert pieces[0][1] - eng.first_done < 0.5, "the barrier waited although group_commit_bytes were ready"
            eng.release.set()
            assert fut.result(timeout=30).written == 2 * PIECE and pool.stats()["sync_groups"] == 2
    finally:
        eng.release.set()
        eng.close()


def test_group_commit_settings_validated():
    from pydantic import ValidationError

    from crash_writer import config
    with pytest.raises(ValidationError):
        config("/tmp/x", group_commit_ms=-1)
    with pytest.raises(ValidationError):
        config("/tmp/x", group_commit_ms=1001)
    with pytest.raises(ValidationError):
        config("/tmp/x", group_commit_bytes=-1)
