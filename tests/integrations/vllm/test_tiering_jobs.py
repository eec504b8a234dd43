"""Never stall decode (docs/invariants.md #3) in the native tiers' jobs (:mod:`kvbm_backend.integrations.vllm.tier_jobs`;
reviewer, 2026-12-01): a load never waits behind stores; a store's thread is not parked until its put is durable;
a G3 put does not wait for a stalled pool's lock (it is handed to the pool's late-put thread); a job's
``job_timeout_s`` is enforced while it waits for a thread; a job past its deadline gives its staging back once
the pool is done with it.

Driven through vLLM's real tiering manager (:mod:`.test_tiering`'s harness) over a real G3 pool, or the tier's
``submit_load`` directly where the manager cannot make the case (:mod:`.test_tiering_review` does the same). Slow
storage is a ``fdatasync`` or a journal ``os.write`` held on :class:`threading.Event` handshakes: no durations are
asserted; ``GUARD_S`` is a hang guard ("X happened while the I/O was still held")."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvbm_backend.pool.g3 import G3Pool  # noqa: E402
from tests.helpers.held_io import in_background  # noqa: E402
from tests.integrations.vllm.test_tiering import g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401
from tests.integrations.vllm.test_tiering_lock_stall import _stall_a_delete  # noqa: E402

pytestmark = [pytest.mark.vllm]

GUARD_S = 60.0


def _held_fdatasync(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every G3 slab ``fdatasync`` waits for ``release`` (a disk whose syncs hang; reads are fine). Returns
    ``(inside, release)``: ``inside`` is set once one is held."""
    inside, release = threading.Event(), threading.Event()
    real = G3Pool._fdatasync

    def held(fd):
        inside.set()
        release.wait(GUARD_S * 3)
        real(fd)
    monkeypatch.setattr(G3Pool, "_fdatasync", staticmethod(held))
    return inside, release


def test_a_load_completes_while_stores_wait_on_a_held_fdatasync(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """One I/O thread; two cascades wait on a held ``fdatasync``: a promotion of two chunks G3 holds completes (its
    bytes right) while the sync is still held. Before, loads queued behind stores on one FIFO executor, each store
    parking its thread until its put was durable (reviewer: a 2-chunk load took 3.7 s behind 2 stores)."""
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=GUARD_S * 10)])  # no job times out
    hot, data = keys_for(2, "hot"), payloads(h, 2)
    h.store(hot, data)
    h.wait_idle(GUARD_S)
    h.reset_primary()  # durable in G3, gone from the CPU tier
    inside, release = _held_fdatasync(monkeypatch)
    try:
        for i in range(2):
            h.store(keys_for(2, f"cold{i}"), payloads(h, 2, 10 + i))
        assert inside.wait(GUARD_S), "no cascade reached the pool's fdatasync"
        t, done, out = in_background(lambda: h.load(hot, timeout=GUARD_S * 2))
        loaded = done.wait(GUARD_S)
        still_held = not release.is_set()
    finally:
        release.set()
    assert loaded and still_held and "error" not in out, f"the load waited for the stores' fdatasync: {out}"
    assert [bytes(x) for x in out["value"]] == [bytes(d) for d in data]
    t.join(GUARD_S)
    h.wait_idle(GUARD_S)
    st = h.tier.kvbm_stats()["tier"]
    assert (st["stores"], st["stores_failed"], st["loads"], st["loads_failed"]) == (3, 0, 1, 0), st


def test_a_store_thread_is_free_once_its_puts_are_out(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """One I/O thread, a held ``fdatasync``: the second cascade's blocks reach the pool while the first cascade's
    sync is still held (the first job's thread did not wait for its put); both jobs then succeed."""
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=GUARD_S * 10)])  # no job times out
    pool = h.tier.pool
    inside, release = _held_fdatasync(monkeypatch)
    try:
        h.store(keys_for(2, "a"), payloads(h, 2))
        assert inside.wait(GUARD_S)
        h.store(keys_for(2, "b"), payloads(h, 2, 1))
        end = time.monotonic() + GUARD_S
        while pool.writer.pending < 4 and time.monotonic() < end:  # 2 jobs x 2 blocks queued or being written
            time.sleep(0.005)
        both_out = pool.writer.pending == 4
        still_held = not release.is_set()
    finally:
        release.set()
    assert both_out and still_held, f"the second store's put waited for the first's fdatasync: {pool.writer.pending}"
    h.wait_idle(GUARD_S)
    st = h.tier.kvbm_stats()["tier"]
    assert (st["stores"], st["stores_failed"], st["chunks_stored"]) == (2, 0, 4), st


def test_a_store_during_a_journal_stall_is_handed_off_neither_waited_for_nor_dropped(tmp_path, harnesses,  # noqa: F811
                                                                                     monkeypatch):
    """The pool's lock held across a stalled journal write (a delete's), one I/O thread: a cascade's G3 put does not
    wait for it on the store's thread but is handed to the pool's late-put thread, so a second cascade's put is
    handed off too while the write is still held; once it returns both jobs succeed, their blocks stored, none
    dropped. Before 2026-12-01 the put waited for the lock without a bound (the job, its I/O thread and vLLM's pin
    waited out the stall); on 2026-12-01 its blocks were dropped after 0.5 s (``lock_busy``, the job failed)."""
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=GUARD_S * 10)])  # no job times out
    tier, pool = h.tier, h.tier.pool
    first = keys_for(1, "d")
    h.store(first, payloads(h, 1))
    h.wait_idle(GUARD_S)
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(first[0], ""))
    want = 4 * tier.geometry.copies  # 2 jobs x 2 chunks, each chunk one block per copy
    try:
        h.store(keys_for(2, "s"), payloads(h, 2, 1))
        h.store(keys_for(2, "t"), payloads(h, 2, 3))
        end = time.monotonic() + GUARD_S
        while pool.writer.late.blocks < want and time.monotonic() < end:
            time.sleep(0.005)
        handed_off = pool.writer.late.blocks
        still_held = not hold.released.is_set()
    finally:
        hold.release()
    assert handed_off == want and still_held, f"a store's put waited for the stalled journal write: {handed_off}"
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    h.wait_idle(GUARD_S)
    st = tier.kvbm_stats()
    assert (st["tier"]["stores"], st["tier"]["stores_failed"], st["tier"]["chunks_stored"]) == (3, 0, 5), st["tier"]
    assert st["pool"]["dropped_by_reason"] == {}, st["pool"]


def test_a_queued_load_fails_at_its_deadline_while_the_job_ahead_is_stuck(tmp_path, harnesses, monkeypatch,  # noqa: F811
                                                                          caplog):
    """One I/O thread; load 901 is stuck asking G3 for a block (the pool's lock held across a stalled journal write;
    ``g3.load_timeout_s`` 120 s); load 902, queued behind it, is reported failed at its ``job_timeout_s`` (0.5 s)
    while the write is still held, without asking the pool. Before, a queued job's deadline was checked only when
    a thread took it up: a request waited ``HIT_PENDING`` the whole stall (reviewer: 14.7 s with 2 s)."""
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=0.5)])
    tier, pool = h.tier, h.tier.pool
    keys, other = keys_for(2, "q"), keys_for(1, "d")
    h.store(keys + other, payloads(h, 3))
    h.wait_idle(GUARD_S)
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(other[0], ""))
    done: dict = {}
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            tier.submit_load(TransferJob(901, keys[:1], np.array([5]), True, h.context()))
            tier.submit_load(TransferJob(902, keys[1:], np.array([6]), True, h.context()))
            end = time.monotonic() + GUARD_S
            while 902 not in done and time.monotonic() < end:
                done.update({r.job_id: r.success for r in tier.get_finished_jobs()})
                time.sleep(0.002)
            still_held = not hold.released.is_set()
    finally:
        hold.release()
    assert done.get(902) is False and still_held, f"the queued load waited for the job ahead: {done}"
    assert 901 not in done  # it runs (it may be copying into the primary): never reported before it returns
    assert "job 902 (load of 1 chunks) failed: job_timeout_s (0.5 s) passed while it was queued" in caplog.text
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    end = time.monotonic() + GUARD_S
    while 901 not in done:
        assert time.monotonic() < end, "load 901 never finished"
        done.update({r.job_id: r.success for r in tier.get_finished_jobs()})
        time.sleep(0.002)
    st = tier.kvbm_stats()["tier"]
    assert st["loads"] == 2 and st["loads_failed"] >= 1, st
    # 902's chunk was never read: its failure is load, not a verdict on the chunk. A new request (the CPU tier
    # emptied, so it asks G3) is offered and loads it. Before 2026-12-02 it was cooled for 30 s like an unreadable
    # chunk: every new request recomputed it though G3 held it (reviewer 2026-12-02)
    assert not tier._failed.cooling("", keys[1]), "the chunk of a load the pool never saw was cooled"
    h.reset_primary()
    assert h.lookup_prefix(keys[1:], ctx=h.context()) == 1


def test_a_timed_out_store_gives_its_staging_back_once_the_pool_is_done(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """A store past its ``job_timeout_s`` (a held ``fdatasync``) fails; once the sync is through and the pool has
    resolved the put, every buffer of the pre-faulted staging arena is free again (taking them all allocates
    nothing). Before, a timed-out job never gave its buffers back: the arena shrank for good after every stall."""
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=0.5, staging_mb=0.25)])
    tier = h.tier
    sp, nb = tier._staging, tier.geometry.rank_bytes
    arena = sp.arena_bytes // nb
    assert arena == 8  # 0.25 MiB of 32 KiB chunks
    inside, release = _held_fdatasync(monkeypatch)
    try:
        h.store(keys_for(4, "s"), payloads(h, 4))
        assert inside.wait(GUARD_S)
        h.wait_idle(GUARD_S)  # the job fails at its deadline while the sync is held
        assert not release.is_set()
    finally:
        release.set()
    assert tier.kvbm_stats()["tier"]["stores_failed"] == 1
    assert tier.pool.flush(GUARD_S)

    def arena_whole() -> bool:
        before = sp.stats()["allocated"]
        bufs = [sp.take(nb) for _ in range(arena)]
        for b in bufs:
            sp.give(b)
        return sp.stats()["allocated"] == before
    end = time.monotonic() + GUARD_S  # the give-back runs on the pool's thread as it resolves the put
    while not arena_whole():
        assert time.monotonic() < end, "the timed-out job's staging never came back"
        time.sleep(0.01)
