"""Never stall decode (docs/invariants.md #3): the native ``G3Tier``'s scheduler calls (``take_events`` every step
with KV events on, ``get_finished_jobs``) never wait for the G3 pool's lock, which other threads hold across
journal I/O (reviewer, 2026-12-01, finding 2: ``removed_since`` / ``contains`` waited for the whole stall of a
journal write, i.e. every engine step did). A check the busy pool cannot answer is asked again later: a chunk the
pool holds is never published removed because its lock was busy, and one it dropped is published removed once
the lock is free.

Driven through vLLM's real tiering manager (:mod:`.test_tiering`'s harness) over a real G3 pool; the stall is a
delete's journal ``os.write`` held at the OS boundary on :class:`threading.Event` handshakes (no durations are
asserted; ``GUARD_S`` is a hang guard)."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import Medium  # noqa: E402

from kvbm_backend.integrations.vllm.tier_removals import HeldChunks  # noqa: E402
from kvbm_backend.integrations.vllm.tiering import G3Tier, offload_key_hash  # noqa: E402
from kvbm_backend.model.frame import HEADER_BYTES  # noqa: E402
from tests.helpers.held_io import held_journal_write, in_background  # noqa: E402
from tests.integrations.vllm.test_tiering import g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401

pytestmark = [pytest.mark.vllm]

GUARD_S = 60.0


def _removed(events):
    return sorted(k for e in events if e.medium is Medium.STORAGE and e.removed for k in e.keys)


def _stall_a_delete(monkeypatch, pool, keys):
    """Start deleting ``keys`` on a thread and hold its journal write (the pool's lock held, the removals
    logged). Returns ``(hold, deleter thread, deleted event)``."""
    hold = held_journal_write(monkeypatch, pool, GUARD_S * 3)
    t, done, _ = in_background(lambda: pool.delete(keys).result(GUARD_S))
    assert hold.inside.wait(GUARD_S)
    assert pool.cat.lock.locked()
    return hold, t, done


def test_take_events_returns_while_a_journal_write_holds_the_pool_lock(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """A published chunk whose block was deleted and stored again (a logged removal, held now) and one being
    deleted (its removal logged, its DEL record's write held): the scheduler's ``take_events`` returns while the
    write is held and publishes neither removed (the pool cannot tell now); once the write is through, only the
    deleted chunk is published removed, and the chunk the pool holds never is."""
    monkeypatch.setattr(G3Tier, "reconcile_interval_s", 0.0)
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    keys, data = keys_for(4, "s"), payloads(h, 4)
    h.store(keys, data)
    h.wait_idle()
    assert sorted(k for e in h.manager.take_events() if e.medium is Medium.STORAGE for k in e.keys) == sorted(keys)
    tier, pool = h.tier, h.tier.pool
    again = tier._block_keys(keys[0], "")  # deleted and stored again behind the tier's back: held, removal logged
    buf = [np.empty(pool.block_bytes, np.uint8) for _ in again]
    assert pool.get(again, buf).result(GUARD_S).ok == [True] * len(again)
    assert pool.delete(again).result(GUARD_S) == len(again)
    assert pool.put(again, buf).result(GUARD_S).written == len(again)
    assert pool.flush(GUARD_S)
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(keys[1], ""))
    try:
        t, done, out = in_background(lambda: list(h.manager.take_events()))
        returned = done.wait(GUARD_S)
        still_held = not hold.released.is_set()
    finally:
        hold.release()
    assert returned and still_held, "take_events waited for the stalled journal write (the engine step stalled)"
    assert _removed(out["value"]) == []  # the pool could not tell: nothing published removed yet
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    t.join(GUARD_S)
    assert _removed(h.manager.take_events()) == [keys[1]]  # asked again: the deleted chunk only
    assert _removed(h.manager.take_events()) == []


def test_a_published_check_the_busy_pool_cannot_answer_keeps_the_chunk_and_asks_again(tmp_path, harnesses,  # noqa: F811
                                                                                        monkeypatch):
    """``HeldChunks.published`` (a store job finished: ``get_finished_jobs`` on the scheduler thread) checks its
    chunks when something left the pool since the job's cursor: while the pool's lock is held across a journal
    write it returns at once and keeps the chunk published; the next ``removed`` asks again (held: not removed)."""
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    keys, data = keys_for(2, "p"), payloads(h, 2)
    h.store(keys, data)
    h.wait_idle()
    tier, pool = h.tier, h.tier.pool
    held = HeldChunks(pool, tier.namespace.fingerprint, 1, offload_key_hash, 0.0, tier._block_keys)
    cursor = held.cursor()
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(keys[1], ""))
    try:
        t, done, _ = in_background(lambda: held.published([keys[0]], cursor))  # the cursor moved: it is checked
        returned = done.wait(GUARD_S)
        still_held = not hold.released.is_set()
    finally:
        hold.release()
    assert returned and still_held, "published waited for the stalled journal write"
    assert len(held) == 1  # kept: the pool could not tell
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    t.join(GUARD_S)
    assert held.removed() == [] and len(held) == 1  # asked again: held
    assert pool.delete(tier._block_keys(keys[0], "")).result(GUARD_S) == 1
    assert held.removed() == [keys[0]]


def test_an_index_read_the_busy_pool_cannot_give_now_is_owed_not_waited_for(tmp_path, harnesses,  # noqa: F811
                                                                             monkeypatch):
    """G3's removal log overflowed (more removals than it keeps), so the check must read the whole index, while a
    journal write holds the pool's lock: ``HeldChunks.removed`` (``take_events`` on the scheduler thread) returns
    while the write is held, reporting nothing it cannot tell; the next call, the lock free, reads the index it owes
    and reports every chunk that left. Before 2026-12-02 the index read (``keys()``) waited the whole stall
    (reviewer: 1.5 s per step)."""
    h = harnesses([g3_tier(tmp_path / "g3", enable_kv_events=True)], enable_kv_cache_events=True)
    keys, data = keys_for(6, "o"), payloads(h, 6)
    h.store(keys, data)
    h.wait_idle()
    tier, pool = h.tier, h.tier.pool
    held = HeldChunks(pool, tier.namespace.fingerprint, 1, offload_key_hash, 0.0, tier._block_keys)
    held.published(keys, held.cursor())
    pool.cat.removed = type(pool.cat.removed)(maxlen=2)  # this pool's removal log keeps 2 entries
    for k in keys[:3]:  # 3 removals: the log overflowed
        assert pool.delete(tier._block_keys(k, "")).result(GUARD_S) == 1
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(keys[5], ""))
    try:
        t, done, out = in_background(held.removed)
        returned = done.wait(GUARD_S)
        still_held = not hold.released.is_set()
    finally:
        hold.release()
    assert returned and still_held, "removed() waited for the stalled journal write to read the index"
    assert out.get("value") == [], out
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    t.join(GUARD_S)
    assert sorted(held.removed(), key=keys.index) == keys[:3] + [keys[5]]  # the owed read


def test_a_failed_load_is_reported_while_a_journal_write_holds_the_pool_lock(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """A chunk whose stored payload is corrupt (bit rot) loads and fails; its read returned, then a delete's
    journal write holds the pool's lock. The failed load's job is reported to vLLM's manager (a miss, the request
    recomputes) while the write is still held: the tier's deletion of the blocks that failed
    (``G3Pool.drop_unreadable``) waits for the lock on a thread of its own. Once the write is through, the
    recomputed chunk is stored again and served. Review finding 2026-12-02: ``drop_unreadable`` did its work on
    the caller's thread before returning its future, so the tier's bound on it did nothing: the load thread
    waited for the lock, the job stayed running and the request waited HIT_PENDING for the whole stall, past
    ``job_timeout_s`` (12 s with a 2 s ``job_timeout_s``)."""
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=2.0)])
    keys, data = keys_for(3, "d"), payloads(h, 3)
    h.store(keys, data)
    h.wait_idle()
    tier, pool = h.tier, h.tier.pool
    h.reset_primary()
    fi, si = pool.index.get(tier._block_keys(keys[0], "")[0])
    off = si * pool.slot_bytes + HEADER_BYTES + 100
    fd = os.open(pool.slabs.by_index[fi].path, os.O_RDWR)  # the pool's own fd is O_DIRECT
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)  # one flipped payload byte
    finally:
        os.close(fd)
    real_get, stall = pool.get, {}

    def get(bkeys, out):  # the drive stalls right after the load's read: a delete's journal write holds the lock
        fut = real_get(bkeys, out)
        fut.result(GUARD_S)
        if not stall:
            stall["hold"], stall["t"], stall["done"] = _stall_a_delete(monkeypatch, pool, tier._block_keys(keys[2], ""))
        return fut
    monkeypatch.setattr(pool, "get", get)
    ctx = h.context()
    h.manager.on_new_request(ctx)
    try:
        assert h.lookup_prefix(keys[:1], ctx, timeout=GUARD_S) == 0  # the failed load reported: a miss
        assert stall and not stall["done"].is_set() and pool.cat.lock.locked()  # while the write is still held
    finally:
        if stall:
            stall["hold"].release()
            stall["t"].join(GUARD_S)
        h.manager.on_request_finished(ctx)
    monkeypatch.setattr(pool, "get", real_get)
    h.wait_idle()
    h.store(keys[:1], data[:1])  # the recompute's store writes the chunk again
    h.wait_idle()
    got = h.load(keys[:1], timeout=GUARD_S)
    assert len(got) == 1 and np.array_equal(got[0], data[0])
