"""A native tier's load job whose ``job_timeout_s`` passes while a later piece of it is still being read
(:meth:`~kvbm_backend.integrations.vllm.tier_base.KvbmSecondaryTier._run_load_held`). The chunks of the pieces the
pool verified by then are already in the primary tier: they are reported loaded (``JobResult.successful_keys``, the
module doc of :mod:`kvbm_backend.integrations.vllm.tiering`) and are not cooled; only the late ones fail (a miss,
cooled as any late chunk). Before, the deadline raised out of the job: it failed whole, the verified chunks were
thrown away and cooled for 30 s, and every new request of that prefix recomputed chunks G3 held intact.

Real parts: the tier under vLLM's real offloading spec (:class:`~kvbm_backend.integrations.vllm.tiering_harness.
TieringHarness`), a real G3 pool; the slow disk is the pool's I/O engine holding one read submission (the load's
thread is held inside it while the job's deadline passes, and the read it submits answers only when the test ends).
No duration is asserted, and the outcome does not depend on when threads run: the job's ``job_timeout_s`` is a hang
guard, and its deadline passes when the test moves it to the present while the load's thread is held inside piece
1's read (before 2026-12-04 a 3 s bound had to outlast the load thread's pick-up: a host that froze the thread that
long failed the job as queued and the test waited 600 s for a read never asked)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob  # noqa: E402

from kvbm_backend.integrations.vllm.tiering import G3Tier  # noqa: E402
from tests.helpers.held_io import held_journal_write  # noqa: E402
from tests.integrations.vllm.test_tiering import (CHUNK, HANG_S, g3_tier, harnesses, keys_for,  # noqa: E402,F401
                                                  payloads)
from tests.integrations.vllm.test_tiering_review import _inject_eio  # noqa: E402

pytestmark = [pytest.mark.vllm]

JOB_TIMEOUT_S = HANG_S  # the job's bound as configured: never reached by itself; the test passes the deadline


class LatePiece:
    """A load of two pieces (one chunk each: ``G3Tier.piece_bytes`` is set by the test) whose deadline passes while
    piece 1 is being read: the tier's jobs and ``pool.get`` futures are observed (unchanged); the pool's second read
    submission holds the load's thread inside piece 1's get until :meth:`load` has moved the job's deadline to the
    present, and that read answers only at :meth:`close`."""

    def __init__(self, h, monkeypatch) -> None:
        self.h, tier, pool = h, h.tier, h.tier.pool
        self.jobs: list = []  # the tier's jobs as submitted
        real_queue = tier._tasks.submit
        monkeypatch.setattr(tier._tasks, "submit", lambda job, run: (self.jobs.append(job), real_queue(job, run))[1])
        self.gets: list[Future] = []  # the futures of the load's pool.get calls, one per piece
        real_get = pool.get
        monkeypatch.setattr(pool, "get", lambda bkeys, out: self.gets.append(real_get(bkeys, out)) or self.gets[-1])
        real_submit = pool.engine.submit
        reads = [0]
        self.in_second, self.go_on, self.answer = threading.Event(), threading.Event(), threading.Event()

        def submit(ops):
            ops = list(ops)
            if not ops or ops[0].write:
                return real_submit(ops)
            reads[0] += 1
            if reads[0] != 2:  # piece 0 (and anything later): the disk as it is
                return real_submit(ops)
            self.in_second.set()  # the load's thread, inside piece 1's get: held here past the job's deadline
            self.go_on.wait(HANG_S)
            out: Future = Future()

            def later():  # piece 1's read answers only when the test is done with the job
                self.answer.wait(HANG_S)
                try:
                    out.set_result(real_submit(ops).result())
                except BaseException as e:  # noqa: BLE001
                    out.set_exception(e)
            threading.Thread(target=later, daemon=True).start()
            return out
        monkeypatch.setattr(pool.engine, "submit", submit)

    def load(self, job_id: int, keys: list, rows: list[int]) -> tuple[JobResult, list[bool]]:
        """Run load ``job_id`` of ``keys`` into primary ``rows``: its result, and what piece 0's get verified."""
        tier = self.h.tier
        tier.submit_load(TransferJob(job_id, keys, np.array(rows), True, self.h.context()))
        assert self.in_second.wait(HANG_S), "the load never asked for its second piece"
        first = list(self.gets[0].result(HANG_S).ok)  # piece 0 read (its get resolved)
        (job,) = [j for j in self.jobs if j.meta.job_id == job_id]
        job.deadline.at = time.monotonic()  # the job's deadline passes while its thread is inside piece 1's get
        end = time.monotonic() + HANG_S
        self.go_on.set()
        while True:
            done = [r for r in tier.get_finished_jobs() if r.job_id == job_id]
            if done:
                return done[0], first
            assert time.monotonic() < end, f"load {job_id} never finished"
            time.sleep(0.002)

    def close(self) -> None:
        self.go_on.set()
        self.answer.set()


def test_a_load_past_its_deadline_keeps_the_chunks_verified_before_it(tmp_path, harnesses, monkeypatch, caplog):  # noqa: F811
    """Two chunks in G3, loaded in one job of two pieces (one chunk each). Piece 0 is read and verified; the load's
    thread is held submitting piece 1's read while the job's deadline passes (the test sets it to the present), and
    that read never answers while the test runs. The job fails, but chunk 0 is reported loaded (its bytes in the
    primary) and is not cooling; chunk 1 failed and cools. Counted: one load, one chunk loaded, one failed; the
    WARNING names the bound."""
    monkeypatch.setattr(G3Tier, "piece_bytes", CHUNK)  # one pool.get per chunk
    h = harnesses([g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=JOB_TIMEOUT_S)])
    tier = h.tier
    keys, data = keys_for(2, "late-piece"), payloads(h, 2, seed=21)
    h.store(keys, data)
    h.wait_idle(HANG_S)
    h.reset_primary()
    late = LatePiece(h, monkeypatch)
    rows = [5, 6]
    h.primary[rows] = 0
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            res, first = late.load(901, keys, rows)
    finally:
        late.close()
    assert first == [True]  # piece 0 read and verified
    assert not res.success
    assert list(res.successful_keys or ()) == keys[:1], \
        f"the chunk verified before the deadline was not reported loaded: successful_keys={res.successful_keys}"
    np.testing.assert_array_equal(h.primary[rows[0], :h.chunk_bytes], data[0])
    assert not tier._failed.cooling("", keys[0]), "the chunk verified before the deadline is cooling"
    assert tier._failed.cooling("", keys[1])
    st = tier.kvbm_stats()["tier"]
    assert (st["loads"], st["loads_failed"], st["chunks_loaded"], st["chunks_load_failed"]) == (1, 1, 1, 1), st
    assert f"job_timeout_s ({JOB_TIMEOUT_S:g} s)" in caplog.text and "load of 2 chunks" in caplog.text, caplog.text


def test_an_unreadable_chunk_deleted_after_the_deadline_is_counted_not_logged_failed(tmp_path, harnesses,  # noqa: F811
                                                                                   monkeypatch, caplog):
    """The same late load, piece 0's chunk now on a bad sector (its reads fail with EIO) that has stayed unreadable
    long enough (two earlier failed loads' re-reads, 150 and 300 s before on G3's clock: ``G3Pool.drop_unreadable``):
    the tier asks G3 to delete its block, but the job's deadline has passed, and the deletion (its journal write
    held: a stalled journal) is still running when the job is reported. That is no failed deletion: no ``could not
    delete`` WARNING; once G3 deleted the block it is counted ``blocks_dropped`` and logged ``deleted``. Before
    2026-12-04 the tier logged ``could not delete 1 unreadable blocks`` (a WARNING per such load, not rate-limited)
    and counted 0 while G3 went on and deleted the block."""
    monkeypatch.setattr(G3Tier, "piece_bytes", CHUNK)  # one pool.get per chunk
    t = g3_tier(tmp_path / "g3", io_threads=1, job_timeout_s=JOB_TIMEOUT_S)
    t["g3"]["engine"] = "posix"  # reads through os.preadv/os.pread, where the bad sector is injected
    h = harnesses([t])
    tier, pool = h.tier, h.tier.pool
    keys, data = keys_for(2, "late-bad-piece"), payloads(h, 2, seed=22)
    h.store(keys, data)
    h.wait_idle(HANG_S)
    h.reset_primary()
    bad = tier._block_keys(keys[0], "")
    _inject_eio(monkeypatch, tier, keys[0])
    now = [1000.0]
    monkeypatch.setattr(pool.reader.unreadable, "clock", lambda: now[0])
    for at in (1000.0, 1150.0):  # earlier failed loads' re-reads: kept (docs/invariants.md #1)
        now[0] = at
        assert pool.drop_unreadable(bad).result(timeout=HANG_S) == 0
    now[0] = 1300.0  # this load's re-read: unreadable long enough, deleted
    drops: list[Future] = []  # G3's deletions the tier asked for (observed, unchanged)
    real_drop = pool.drop_unreadable
    monkeypatch.setattr(pool, "drop_unreadable", lambda ks: drops.append(real_drop(ks)) or drops[-1])
    hold = held_journal_write(monkeypatch, pool, HANG_S)  # the deletion's DEL record: a stalled journal
    late = LatePiece(h, monkeypatch)
    try:
        with caplog.at_level("WARNING", logger="kvbm_backend.integrations.vllm.tiering"):
            res, first = late.load(902, keys, [5, 6])
            assert first == [False]  # piece 0 read: its chunk failed (EIO)
            assert len(drops) == 1 and not drops[0].done(), drops  # reported while G3 is still deleting
            failed = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
            assert not failed, f"a deletion still running was logged failed: {failed}"
            hold.release()
            assert drops[0].result(HANG_S) == 1  # G3 deleted the block
            end = time.monotonic() + HANG_S
            while tier.kvbm_stats()["tier"]["blocks_dropped"] != 1:  # counted on G3's thread as it ends
                assert time.monotonic() < end, tier.kvbm_stats()["tier"]
                time.sleep(0.002)
    finally:
        hold.release()
        late.close()
    assert not res.success and not res.successful_keys
    assert not pool.contains(bad[0])
    st = tier.kvbm_stats()["tier"]
    assert (st["loads"], st["loads_failed"], st["chunks_load_failed"], st["blocks_dropped"]) == (1, 1, 2, 1), st
    assert "G3Tier: deleted 1 blocks that failed to load" in caplog.text, caplog.text
    assert "could not delete" not in caplog.text, caplog.text
