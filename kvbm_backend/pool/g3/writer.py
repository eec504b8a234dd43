""":class:`G3Writer`, the write part of a G3 pool: queued offloads -> batches -> pieces -> writes -> group
fdatasync -> publish -> journal fdatasync -> puts resolved. It owns the write-behind queue, its threads (writer,
syncer, the fdatasync pool) and what is in flight, and changes slot state only through the pool's
:class:`~.catalog.SlotCatalog` under its lock. Invariant 2 (publish after durable) is kept here, per piece."""
from __future__ import annotations

import collections
import errno
import functools
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Hashable, Protocol, Sequence

from ...config import G3Config
from ...deadlines import Deadline
from ...io import IoEngine
from ...log_limits import LimitedLog
from ...memory import BufferPool
from ...model.frame import ChecksumFrames
from ...model.namespace import BlockKey
from ...transfer import plan_ops
from ..base import BlockBuffer, PutResult
from . import journal as jr
from . import journal_sync as js
from . import writer_close as wc
from .catalog import _NOSPACE, SlotCatalog
from .index import valid_key
from .lock_bounded import held_within
from .pieces import PieceFramer, Slot, _Batch, _Job, _Piece, live_blocks
from .writer_late import LatePuts
from .writer_room import batch_room_slots, reserve_room
from ...threads import executor, start_thread

if TYPE_CHECKING:
    from .pool import G3Pool

log = logging.getLogger(__name__)
LOG = LimitedLog(log)  # a failed batch write: one WARNING per pool per minute (a drive gone fails every batch)


class Admission(Protocol):
    """An admission filter (:mod:`.admission`): ``policy`` names it; ``admit(key)``: is an offload of ``key`` stored now."""

    policy: str

    def admit(self, key: Hashable) -> bool: ...


class G3Writer:
    """The write part of a G3 pool (``G3Pool.put`` / ``flush`` / ``close`` delegate to it).

    Args:
        cat: the pool's slot catalog (slot state, counters, the lock every part shares).
        cfg: the ``g3`` config (write_queue_blocks, fsync, group_commit_ms, group_commit_bytes).
        engine: the pool's I/O engine. frames: its :class:`~kvbm_backend.model.frame.ChecksumFrames`.
        staging: its staging :class:`~kvbm_backend.memory.BufferPool`. io_size: bytes per coalesced I/O.
        admission: the admission filter (``admit(key) -> bool``).
        tuning: where the piece sizes (``chunk_bytes``, ``min_chunk_blocks``, ``chunks_in_flight``,
            ``max_batch_bytes``, ``gather_below``) and the durability call (``_fdatasync(fd)``) are read,
            at each use: the pool class (tests change them).
    """

    def __init__(self, cat: SlotCatalog, cfg: G3Config, engine: IoEngine, frames: ChecksumFrames,
                 staging: BufferPool, io_size: int, admission: Admission, tuning: type[G3Pool]) -> None:
        self.cat, self.cfg, self.engine, self.frames = cat, cfg, engine, frames
        self.staging, self.io_size, self.admission, self.tuning = staging, io_size, admission, tuning
        self._run = max(1, -(-io_size // cat.slot_bytes))  # slots per I/O: runs of adjacent slots allocated
        self.framer = PieceFramer(cat, frames, staging, io_size, tuning.gather_below)
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending = 0
        self._writing = 0
        self._inflight: dict[BlockKey, _Job] = {}  # key -> the job that writes it (see put, _release_keys)
        self._cancelled: set[BlockKey] = set()  # in-flight keys deleted meanwhile: their owner job must not publish
        self._stop_sync = False
        self._batches: dict[int, _Batch] = {}  # id -> batch being written (not yet finished)
        self._abandoned = False  # close gave up waiting for what is in flight (see close)
        self._ready: list[_Piece] = []  # written pieces waiting for the syncer
        self._pieces_writing = 0
        self._last_barrier_s = 0.0  # seconds the last group's fdatasyncs took (bounds the next group's wait)
        self._err_gen: dict[int, int] = {}  # file index -> failed fdatasync count
        self.late = LatePuts(cat, self._admit_locked)
        self._sync_pool = executor(min(16, max(1, len(cat.slabs.files))), "kvbm-g3-sync")
        self._writer = start_thread(self._write_loop, name="kvbm-g3-writer")
        self._syncer = start_thread(self._sync_loop, name="kvbm-g3-syncer")

    pending = property(lambda self: self._pending, doc="Offload blocks queued or being written.")

    def unpublished(self) -> list[BlockKey]:
        """Keys queued, being written or handed to the late-put thread (caller holds the lock)."""
        return [*self._inflight, *self.late.keys()]

    def put(self, keys: list[BlockKey], blocks: list[BlockBuffer], checks: list[int] | None,
            bypass_admission: bool) -> Future[PutResult]:
        """``G3Pool.put`` after its argument checks: skip held / in-flight / not admitted keys, drop what
        the queue bound, the degraded state or a closing pool refuses, and keys no slot can hold (``valid_key``:
        dropped one by one, ``invalid_key``), queue the rest; handed off if the lock stays busy (:mod:`.writer_late`)."""
        res = PutResult()
        fut: Future[PutResult] = Future()
        fut.set_running_or_notify_cancel()
        with held_within(self.cat.lock, self.tuning.put_lock_wait_s) as got:
            queued = got and self._admit_locked(keys, blocks, checks, bypass_admission, fut, res)
        if not got:  # the lock stayed busy (a stalled journal I/O, a busy host): invariant 3
            return self.late.hand_off(keys, blocks, checks, bypass_admission, fut, res,
                                      self.cfg.write_queue_blocks - self._pending)
        if not queued:
            fut.set_result(res)
        return fut

    def _admit_locked(self, keys: list[BlockKey], blocks: list[BlockBuffer], checks: list[int] | None,
                      bypass_admission: bool, fut: Future[PutResult], res: PutResult) -> bool:
        """:meth:`put` under the lock (or a late put, :mod:`.writer_late`): queued anything? (else resolve ``fut``)"""
        cat = self.cat
        cat.admitting(time.monotonic())
        seen: set[BlockKey] = set()
        ck: list[BlockKey] = []
        cb: list[BlockBuffer] = []
        cc: list[int] = []
        invalid = 0
        for j, (k, b) in enumerate(zip(keys, blocks)):
            if not valid_key(k):  # no slot can hold it (frame/journal fields): only it is dropped, as in G4
                invalid += 1
                continue
            if k in seen or k in cat.index or (k in self._inflight and k not in self._cancelled):
                res.skipped += 1
                cat.c["offloads_skipped_present"] += 1
                continue
            seen.add(k)
            if not bypass_admission and not self.admission.admit(k):
                res.skipped += 1
                cat.c["offloads_skipped_admission"] += 1
                continue
            ck.append(k)
            cb.append(b)
            if checks is not None:
                cc.append(checks[j])
        if invalid:
            res.dropped += invalid
            cat.drop("invalid_key", invalid)
        if cat.closed:
            reason, room = "closed", 0
        elif cat.degraded_until:
            reason, room = "degraded", 0
        else:
            reason, room = "queue_full", max(0, self.cfg.write_queue_blocks - self._pending)
        take_k, take_b = ck[:room], cb[:room]
        dropped = len(ck) - len(take_k)
        if dropped:
            res.dropped += dropped
            cat.drop(reason, dropped)
        if take_k:
            self._pending += len(take_k)
            job = _Job(take_k, take_b, fut, res, cc[:room] if checks is not None else None)
            for k in take_k:  # a key deleted while in flight and put again: this job writes it, the old one not
                if (old := self._inflight.get(k)) is not None:
                    old.lost.add(k)
                    self._cancelled.discard(k)
                self._inflight[k] = job
            self._queue.append(job)
            cat.cv.notify_all()
        return bool(take_k)

    def cancel(self, key: BlockKey) -> None:
        """``key`` was deleted (caller holds the lock): its queued/in-flight offload is not published, a new put is queued."""
        if key in self._inflight:
            self._cancelled.add(key)
        self.late.cancel(key)

    def _release_keys(self, job: _Job, keys: Sequence[BlockKey]) -> None:
        """``job`` is done with ``keys`` (published, cancelled or dropped). Caller holds the lock."""
        for k in keys:
            if self._inflight.get(k) is job:
                del self._inflight[k]
                self._cancelled.discard(k)

    def _skip_deleted(self, job: _Job, key: BlockKey) -> None:
        """``job`` does not write ``key``: deleted while queued or written (:meth:`cancel`; or put again since,
        ``job.lost``). Skipped in the put's result and counted ``offloads_skipped_deleted``. Caller holds the lock."""
        job.result.skipped += 1
        self.cat.c["offloads_skipped_deleted"] += 1
        self._release_keys(job, [key])

    def flush(self, timeout: float | None = None) -> bool:
        """See ``G3Pool.flush``."""
        end = Deadline(timeout)
        with self.cat.cv:
            while self._pending or self._writing or self.late.blocks:  # late puts: handed off, not yet admitted
                if end.expired():
                    return False
                self.cat.cv.wait(end.left())
        return True

    def close(self, bound_s: float) -> bool:
        """The pool is closing (``cat.closed`` is set): see :func:`.writer_close.close_writer`. Call once."""
        return wc.close_writer(self, bound_s)

    def finish(self) -> None:
        """After :meth:`close` returned False: see :func:`.writer_close.finish_writer`."""
        wc.finish_writer(self)

    def close_sync_pool(self) -> None:
        self.late.close()
        self._sync_pool.shutdown(wait=True)

    # ---- internals: write path ----------------------------------------------------------------
    # Pipeline (invariant 2 kept per piece): the writer thread takes queued offloads as a batch,
    # reserves slots, cuts the batch into pieces of ~chunk_bytes and submits them, at most
    # ``chunks_in_flight`` being written at once across batches. A written piece goes to the syncer
    # thread, which fdatasyncs every file the ready pieces touched (one call per file per round: group
    # commit) and only then publishes those pieces with one journal append, then fdatasyncs the journal
    # once (off the lock) before their puts resolve (journal_sync.py). So the next pieces' writes
    # are in flight while earlier pieces' fdatasync runs. A round waits for pieces still being written
    # (bounded by g3.group_commit_ms / g3.group_commit_bytes, see _group_wait_locked) so that one
    # barrier covers as many blocks as are on their way: durable writes cost a few barriers per
    # second, not one per piece. Syncs of one file never overlap (one round at a time): a failed
    # fdatasync bumps the file's error generation and every piece submitted before that (still
    # unpublished) which wrote the file is dropped, so a write-back error reported to one caller is
    # never missed by another piece.
    def _write_loop(self) -> None:
        while True:
            with self.cat.cv:
                while not self._queue and not self.cat.closed:
                    self.cat.cv.wait()
                if not self._queue:
                    return
                jobs = [self._queue.popleft()]
                sb, cap = self.cat.slot_bytes, min(self.tuning.max_batch_bytes, batch_room_slots(self.cat) * self.cat.slot_bytes)
                nbytes = len(jobs[0].keys) * sb
                while self._queue and nbytes + len(self._queue[0].keys) * sb <= cap:
                    j = self._queue.popleft()
                    jobs.append(j)
                    nbytes += len(j.keys) * sb
                self._writing += 1
                batch = _Batch(jobs)
                self._batches[id(batch)] = batch
            try:
                self._start_batch(batch)
            except Exception:  # noqa: BLE001 - a bug must not hang futures or kill the writer
                log.exception("G3 writer: batch failed")
                batch.broken = True
            finally:
                self._batch_release(batch)

    def _batch_release(self, batch: "_Batch") -> None:
        """The writer is done cutting ``batch`` into pieces (finishes it if every piece settled)."""
        with self.cat.cv:
            batch.left -= 1
            done = self._batch_done_locked(batch) if batch.left == 0 else []
            self.cat.cv.notify_all()
        for job in done:
            if not job.future.done():
                job.future.set_result(job.result)

    def _batch_done_locked(self, batch: "_Batch") -> list[_Job]:
        for job in batch.jobs:
            self._pending -= len(job.keys)
            self._release_keys(job, job.keys)
            if batch.broken:
                left = len(job.keys) - job.result.written - job.result.skipped - job.result.dropped
                if left > 0:
                    job.result.dropped += left
                    self.cat.drop("error", left)
        self._writing -= 1
        self._batches.pop(id(batch), None)
        self.cat.update_gauges()
        return [job for job in batch.jobs if not job.gone]

    def _finish_job_dropped(self, job: _Job, reason: str) -> None:
        with self.cat.cv:
            n = len(job.keys)
            self._pending -= n
            self._release_keys(job, job.keys)
            job.result.dropped += n
            self.cat.drop(reason, n)
            self.cat.cv.notify_all()
        if not job.future.done():
            job.future.set_result(job.result)

    def _start_batch(self, batch: "_Batch") -> None:
        """Reserve slots for the batch's blocks and submit its pieces (returns once all are submitted)."""
        any_checks = any(job.checks is not None for job in batch.jobs)
        with self.cat.lock:
            lj, lk, lb, lc, gone = live_blocks(batch.jobs, self._cancelled)  # per live block: job, key, ...
            for job, k in gone:
                self._skip_deleted(job, k)
            n = len(lk)  # free, evicted, or (pool full of writes in flight) left by them once settled
            slots, evicted_recs = reserve_room(self.cat, n, self._run, lambda: self._abandoned)
            self.cat.c["evictions"] += evicted_recs
            m = len(slots)
            for job, k in zip(lj[m:], lk[m:]):
                job.result.dropped += 1
                self._release_keys(job, [k])
            if n > m:
                self.cat.drop("no_space", n - m)
                del lj[m:], lk[m:], lb[m:], lc[m:]
            per = self._piece_slots
            pieces = [_Piece(batch, lj[a:a + per], lk[a:a + per], lb[a:a + per], slots[a:a + per],
                             lc[a:a + per] if any_checks else None)
                      for a in range(0, m, per)]
            batch.left += len(pieces)
        evictions = self.cat.metrics.evictions
        if evicted_recs and evictions is not None:  # a G3 TierMetrics always has it
            evictions.inc(evicted_recs)
        if not pieces:
            return
        try:
            top: dict[int, int] = {}
            for fi, si in slots:
                if si > top.get(fi, -1):
                    top[fi] = si
            for fi, si in top.items():
                self.cat.slabs.ensure_size(fi, si)
        except Exception as e:  # noqa: BLE001 - ENOSPC from growth, or anything else: the pieces are dropped
            for pc in pieces:
                pc.error = e
            with self.cat.cv:
                batch.failed = e
                for pc in pieces:
                    self._to_ready_locked(pc)
                self.cat.cv.notify_all()
            return
        for pc in pieces:
            with self.cat.cv:
                while self._pieces_writing >= self.tuning.chunks_in_flight:
                    self.cat.cv.wait()
                if batch.failed is not None or self._abandoned:  # an earlier piece failed, or close gave up
                    pc.error = batch.failed or OSError(errno.ESHUTDOWN, "G3 pool closed")
                    self._to_ready_locked(pc)
                    self.cat.cv.notify_all()
                    continue
                self._pieces_writing += 1
                pc.files = tuple(sorted({fi for fi, _ in pc.slots}))
                pc.gens = tuple(self._err_gen.get(fi, 0) for fi in pc.files)
            ef: Future[Any]  # the engine's byte counts (not used here)
            try:
                ef = self.engine.submit(plan_ops(self.framer.extents(pc, self._piece_slots), self.io_size, write=True))
            except Exception as e:  # noqa: BLE001 - engine refused or a bug: this piece is dropped
                ef = Future()
                ef.set_exception(e)
            ef.add_done_callback(functools.partial(self._piece_written, pc))

    def _piece_written(self, pc: "_Piece", ef: Future[Any]) -> None:
        """Engine callback: the piece's writes finished (staging goes back; the syncer takes it on)."""
        e = ef.exception()
        for b in pc.stage:
            self.staging.give(b)
        pc.stage = []
        with self.cat.cv:
            self._pieces_writing -= 1
            if e is not None:
                pc.error = e
                if pc.batch.failed is None:
                    pc.batch.failed = e
            self._to_ready_locked(pc)
            self.cat.cv.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self.cat.cv:
                while not self._ready and not self._stop_sync:
                    self.cat.cv.wait()
                if not self._ready:
                    return
                fsync = self.cfg.fsync and not self._abandoned
                if fsync:
                    self._group_wait_locked()
                ready, self._ready = self._ready, []
                self.cat.c["sync_groups"] += 1
            errs: dict[int, BaseException] = {}
            try:
                if fsync:
                    files = sorted({fi for pc in ready if pc.error is None for fi in pc.files})
                    if files:
                        t0 = time.monotonic()
                        errs = self._sync_files(files)
                        self._last_barrier_s = time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - never publish what was not synced
                log.exception("G3 syncer: fdatasync round failed")
                errs = {fi: e for pc in ready for fi in pc.files}
            try:
                self._settle(ready, errs)
            except Exception:  # noqa: BLE001 - a bug must not kill the syncer (futures would hang)
                log.exception("G3 syncer: settling pieces failed")

    def _group_wait_locked(self) -> None:
        """Group commit (caller holds ``self.cat.cv``; ``self._ready`` is not empty): while pieces are still
        being written (or queued to be), let the group grow so that one barrier covers them too, until the
        oldest waiting piece has waited as long as the last barrier took (never more time waiting than a
        barrier costs: a slow flush is amortised over more blocks, a fast one is not delayed) and at most
        ``g3.group_commit_ms``, or ``g3.group_commit_bytes`` of slots are waiting, or nothing is in flight
        any more (waiting longer would only add latency), or the pool closes."""
        limit_s = min(self.cfg.group_commit_ms / 1e3, self._last_barrier_s)
        if limit_s <= 0:
            return
        end = self._ready[0].ready_at + limit_s
        max_slots = self.cfg.group_commit_bytes // self.cat.slot_bytes if self.cfg.group_commit_bytes else None
        while (self._pieces_writing or self._queue) and not self._stop_sync and (
                max_slots is None or sum(len(pc.slots) for pc in self._ready) < max_slots):
            left = end - time.monotonic()
            if left <= 0:
                return
            self.cat.cv.wait(left)

    def _to_ready_locked(self, pc: "_Piece") -> None:
        """Hand a piece (written, or failed) to the syncer (caller holds ``self.cat.cv``)."""
        pc.ready_at = time.monotonic()
        self._ready.append(pc)

    def _sync_files(self, files: list[int]) -> dict[int, BaseException]:
        """fdatasync each slab file (in parallel when several); returns {file index: error}."""
        errs: dict[int, BaseException] = {}
        if len(files) == 1:
            try:
                self.tuning._fdatasync(self.cat.slabs.by_index[files[0]].fd)
            except OSError as e:
                errs[files[0]] = e
        else:
            sync, by_index = self.tuning._fdatasync, self.cat.slabs.by_index
            futs = [(fi, self._sync_pool.submit(sync, by_index[fi].fd)) for fi in files]
            for fi, fut in futs:
                err = fut.exception()
                if err is not None:
                    errs[fi] = err
        if errs:
            with self.cat.lock:
                for fi in errs:
                    self._err_gen[fi] = self._err_gen.get(fi, 0) + 1
        return errs

    def _settle(self, pieces: list[_Piece], sync_errs: dict[int, BaseException]) -> None:
        """Publish the pieces that were written and synced (journal append + index in one lock hold); release
        and count the others. Then, off the lock, ``fdatasync`` the journal once for the whole round
        (:mod:`.journal_sync`), and only then count the blocks written and finish the batches whose last piece
        this was (their futures resolve stored: no put is reported before its journal record is durable)."""
        with self.cat.cv:
            if self._abandoned:  # close gave up on these: released, never published (their puts are resolved)
                wc.settle_abandoned_locked(self, pieces)
                return
            recs: list[bytes] = []
            pub_j: list[_Job] = []  # publishable blocks (journaled first, then put in the index)
            pub_k: list[BlockKey] = []
            pub_s: list[Slot] = []
            for pc in pieces:
                self.cat.reserved -= len(pc.slots)
                err = pc.error
                if err is None and any(self._err_gen.get(fi, 0) != g for fi, g in zip(pc.files, pc.gens)):
                    err = next((sync_errs[fi] for fi in pc.files if fi in sync_errs), None) or OSError(
                        errno.EIO, "fdatasync failed on a slab file this piece wrote")
                if err is None:
                    cancelled = self._cancelled
                    for job, k, slot in zip(pc.jobs, pc.keys, pc.slots):
                        if k in cancelled or k in job.lost:  # deleted while written: its frame must not come back
                            self.cat.clear_headers([slot])
                            self.cat.slabs.release([slot])
                            self._skip_deleted(job, k)
                            continue
                        pub_j.append(job)
                        pub_k.append(k)
                        pub_s.append(slot)
                        recs.append(jr.encode(jr.PUT, k, slot))
                else:
                    self.cat.release_unpublished(pc.slots)  # a frame may be whole there: headers zeroed
                    reason = "enospc" if getattr(err, "errno", None) in _NOSPACE else "io_error"
                    if not pc.batch.counted:  # counted every batch, logged once a minute (write_errors, enospc)
                        pc.batch.counted, nospace = True, reason == "enospc"
                        self.cat.c["enospc" if nospace else "write_errors"] += 1
                        if nospace:
                            self.cat.degrade()
                        LOG.warning(f"{reason} {self.cat.journal.path}", "G3: write failed (%s); blocks of the batch "
                                    "dropped%s", err, f", tier degraded for {self.cat.degrade_s():.1f} s" * nospace)
                    for job, k in zip(pc.jobs, pc.keys):
                        job.result.dropped += 1
                        self._release_keys(job, [k])
                    self.cat.drop(reason, len(pc.jobs))
            if recs and not self.cat.journal_append(recs):
                # not journaled, so not published: dropped, counted, slots released (tier degraded)
                self.cat.release_unpublished(pub_s)
                for job in pub_j:
                    job.result.dropped += 1
                self.cat.drop(self.cat.journal_reason, len(pub_s))
                recs = []
            else:
                for k, slot in zip(pub_k, pub_s):
                    self.cat.index.put(k, slot)
            for job, k in zip(pub_j, pub_k):  # in the index, or dropped: a later put is not "in flight"
                self._release_keys(job, (k,))
            handle = js.handle_locked(self.cat) if recs and self.cfg.fsync else None
        jerr = js.sync(self.cat, handle) if recs and self.cfg.fsync else None
        done: list[_Job] = []
        with self.cat.cv:
            if jerr is not None:  # the round's records may not be on disk: repair, else withdraw the round
                if not js.repair_or_withdraw_locked(self.cat, jerr, list(zip(pub_j, pub_k, pub_s))):
                    recs = []
            elif handle is not None:
                self.cat.c["journal_syncs"] += 1
            for job in pub_j if recs else ():
                job.result.written += 1
            finished: list[_Batch] = []
            for pc in pieces:
                pc.batch.left -= 1
                if pc.batch.left == 0:
                    finished.append(pc.batch)
            for b in finished:
                done.extend(self._batch_done_locked(b))
            if recs:
                n = len(recs)
                self.cat.c.update(offloads_written=n, bytes_written=n * self.cat.slot_bytes)
                self.cat.metrics.offload_blocks.inc(n)
                self.cat.metrics.bytes_written.inc(n * self.cat.slot_bytes)
                self.cat.update_gauges()
            self.cat.cv.notify_all()
        for job in done:
            if not job.future.done():
                job.future.set_result(job.result)

    @property
    def _piece_slots(self) -> int:
        return max(1, self.tuning.min_chunk_blocks, self.tuning.chunk_bytes // self.cat.slot_bytes)

