"""G3 keeps a block whose re-read failed with an I/O error (no proof of bad bytes: docs/invariants.md #1) and
deletes it only once it stayed unreadable (``G3Pool.drop_unreadable``, :mod:`kvbm_backend.pool.g3.read.unreadable`).

Review of 2026-12-01, finding 3: the load's read, the get's re-read and ``drop_unreadable``'s re-read run back to
back, and ``drop_unreadable`` deleted unless its re-read verified: a device or NFS hiccup of a few milliseconds
covering the three removed a good block and journaled its DEL. Real pools and slab files in tmp_path; the I/O
errors are injected at the OS boundary (``tests.helpers.eio``); the failed-re-read clock is the pool's own
(``reader.unreadable.clock``), set by the tests, never slept on."""
from __future__ import annotations

import numpy as np
import pytest

from kvbm_backend.pool.g3 import G3Pool
from kvbm_backend.pool.g3.read.unreadable import (UNREADABLE_FORGET_S, UNREADABLE_SPAN_S, UNREADABLE_STRIKES,
                                                  UnreadableBlocks)
from tests.helpers.eio import slot_eio
from tests.helpers.pools import flip_g3_payload, g3_config, tiny_ns

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come
NS = tiny_ns("test/g3-unreadable")
BPB = NS.layout.bytes_per_block


def _open(tmp_path) -> G3Pool:
    return G3Pool(g3_config(tmp_path / "g3", engine="posix"), NS)  # posix: reads through os.preadv


def _payload(seq: int) -> np.ndarray:
    return np.random.default_rng(seq).integers(0, 256, BPB, dtype=np.uint8)


def _stored(pool: G3Pool, n: int = 3):
    keys = NS.keys(range(1, n + 1))
    assert pool.put(keys, [_payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == n
    return keys


def _get(pool: G3Pool, key) -> np.ndarray | None:
    out = np.zeros(BPB, np.uint8)
    return out if pool.get([key], [out]).result(timeout=HANG_S).ok[0] else None


def _drop(pool: G3Pool, key) -> int:
    return pool.drop_unreadable([key]).result(timeout=HANG_S)


def _clock(pool: G3Pool, t0: float = 1000.0) -> list[float]:
    now = [t0]
    pool.reader.unreadable.clock = lambda: now[0]
    return now


def test_a_burst_of_read_errors_keeps_a_good_block(tmp_path, monkeypatch):
    """The reviewer's repro (r2_eio_burst): EIO on the slot's next 3 reads only. The load misses (never wrong KV),
    the delete its caller asks for finds the re-read failing too and keeps the block (before: deleted, a DEL
    journaled); once the burst is over the block loads its exact bytes, also after a restart."""
    pool = _open(tmp_path)
    try:
        keys = _stored(pool)
        with monkeypatch.context() as mp:
            eio = slot_eio(mp, pool, keys[1], times=3)
            assert _get(pool, keys[1]) is None
            assert _drop(pool, keys[1]) == 0
            assert eio.failed == 3, eio
        assert pool.contains(keys[1]), "a good block was deleted after a burst of read errors"
        st = pool.stats()
        assert (st["unreadable_kept"], st["unreadable_deleted"], st["deleted"]) == (1, 0, 0), st
        got = _get(pool, keys[1])
        assert got is not None and np.array_equal(got, _payload(keys[1].seq_hash))
    finally:
        pool.close()
    with _open(tmp_path) as again:  # no DEL was journaled: the restart finds it
        got = _get(again, keys[1])
        assert got is not None and np.array_equal(got, _payload(keys[1].seq_hash))


def test_a_block_that_stays_unreadable_is_deleted_after_strikes_over_the_span(tmp_path, monkeypatch):
    """A slot that never reads again (a dead sector): kept through the failed loads of the first
    ``UNREADABLE_SPAN_S`` (each cools its block for 30 s at the callers, so they are spread out), deleted at the
    first failed re-read once ``UNREADABLE_STRIKES`` have failed over at least that span; its recompute's store
    then writes it again (the slot it gets reads fine)."""
    assert UNREADABLE_STRIKES == 3 and UNREADABLE_SPAN_S == 300.0  # the schedule below
    pool = _open(tmp_path)
    try:
        keys = _stored(pool)
        now = _clock(pool)
        with monkeypatch.context() as mp:
            slot_eio(mp, pool, keys[1])
            for t in (0.0, 30.0, 299.0, 299.5):  # 4 failed loads, all within 300 s of the first: kept
                now[0] = 1000.0 + t
                assert _get(pool, keys[1]) is None
                assert _drop(pool, keys[1]) == 0, t
            assert pool.contains(keys[1])
            now[0] = 1300.0  # unreadable for 300 s, the 5th failed load: deleted
            assert _get(pool, keys[1]) is None
            assert _drop(pool, keys[1]) == 1
        assert not pool.contains(keys[1]) and pool.contains(keys[0]) and pool.contains(keys[2])
        st = pool.stats()
        assert (st["unreadable_kept"], st["unreadable_deleted"], st["deleted"]) == (4, 1, 1), st
        assert len(pool.reader.unreadable) == 0
        assert pool.put([keys[1]], [_payload(keys[1].seq_hash)]).result(timeout=HANG_S).written == 1
        got = _get(pool, keys[1])
        assert got is not None and np.array_equal(got, _payload(keys[1].seq_hash))
    finally:
        pool.close()


def test_a_verifying_re_read_or_an_hour_without_failures_starts_the_count_over(tmp_path, monkeypatch):
    """Failures separated by a re-read that verifies (the outage ended in between) are two episodes, not one
    unreadable block; so are failures more than ``UNREADABLE_FORGET_S`` apart."""
    pool = _open(tmp_path)
    try:
        keys = _stored(pool)
        now = _clock(pool)
        with monkeypatch.context() as mp:
            eio = slot_eio(mp, pool, keys[1])
            for t in (0.0, 100.0, 200.0):
                now[0] = 1000.0 + t
                assert _drop(pool, keys[1]) == 0
            eio.on = False  # the outage is over: the next failed load's re-read verifies (a transient error)
            now[0] = 1250.0
            assert _drop(pool, keys[1]) == 0 and len(pool.reader.unreadable) == 0
            eio.on = True
            for t in (310.0, 400.0, 609.0):  # 3 strikes, 299 s apart: kept (900 s after the first of all)
                now[0] = 1000.0 + t
                assert _drop(pool, keys[1]) == 0
            now[0] = 1609.0 + UNREADABLE_FORGET_S  # an hour after the last failure: a new episode
            assert _drop(pool, keys[1]) == 0
            now[0] += UNREADABLE_SPAN_S - 1
            assert _drop(pool, keys[1]) == 0
            now[0] += 1  # the third of this episode, 300 s after its first
            assert _drop(pool, keys[1]) == 1
        assert not pool.contains(keys[1])
    finally:
        pool.close()


def test_a_re_read_proving_the_bytes_bad_deletes_at_once(tmp_path, monkeypatch):
    """The load failed on a read error, and by the re-read the payload is damaged (a checksum mismatch is a proof):
    deleted at the first call, whatever the failed-re-read record says."""
    pool = _open(tmp_path)
    try:
        keys = _stored(pool)
        with monkeypatch.context() as mp:
            eio = slot_eio(mp, pool, keys[1])
            assert _get(pool, keys[1]) is None
            eio.on = False
        flip_g3_payload(pool, keys[1], BPB)
        assert _drop(pool, keys[1]) == 1 and not pool.contains(keys[1])
        st = pool.stats()
        assert (st["unreadable_kept"], st["unreadable_deleted"], st["deleted"]) == (0, 0, 1), st
    finally:
        pool.close()


def test_unreadable_records_are_bounded_and_checked():
    """At most ``max_entries`` records, oldest forgotten first; a key now in another slot starts over."""
    now = [0.0]
    u = UnreadableBlocks(clock=lambda: now[0], max_entries=2)
    for k in ("a", "b", "c"):
        assert u.failed(k, (0, 1)) is False
    assert len(u) == 2
    now[0] = UNREADABLE_SPAN_S
    assert [u.failed("a", (0, 1)), u.failed("a", (0, 1))] == [False, False]  # "a" was forgotten: 2 strikes
    assert u.failed("b", (0, 2)) is False  # another slot: a new record
    with pytest.raises(ValueError, match="max_entries"):
        UnreadableBlocks(max_entries=0)
