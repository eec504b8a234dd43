"""G3 write pipeline: queued offloads -> batches -> pieces -> writes -> group fdatasync -> publish.

Mixed into :class:`~kvbm_backend.pool.g3.pool.G3Pool` (it uses the pool's lock, slots, engine and
counters; see :mod:`.slots`). Invariant 2 (publish after durable) is kept here, per piece.
"""
from __future__ import annotations

import errno
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ...memory import is_aligned
from ...transfer import plan_ops, slot_extent, staged_run_extents
from ..base import PutResult
from . import journal as jr
from .slots import _NOSPACE, HDR

log = logging.getLogger(__name__)


@dataclass
class _Job:
    keys: list
    blocks: list
    future: Future
    result: PutResult
    checks: list | None = None  # per block: device_checksum of the payload, or None


@dataclass
class _Batch:
    """Offload jobs written together; finished (counts, futures) when its last piece settles."""
    jobs: list
    left: int = 1  # pieces not yet settled, plus 1 while the writer is still submitting pieces
    failed: BaseException | None = None  # first write failure: later pieces are not submitted
    counted: bool = False  # the failure was counted (once per batch)
    broken: bool = False  # the writer hit a bug: blocks not accounted for are dropped ("error")


@dataclass
class _Piece:
    """~``chunk_bytes`` of a batch: written together, published together after their fdatasync."""
    batch: _Batch
    jobs: list  # per block: its job (parallel lists, not a tuple per block: fewer GC-tracked objects)
    keys: list
    blocks: list
    slots: list  # (file index, slot), one per block
    checks: list | None = None  # per block: device_checksum or None (None: no block has one)
    files: tuple = ()  # file indexes written
    gens: tuple = ()  # the files' fdatasync error generations when the piece was submitted
    error: BaseException | None = None
    stage: list = field(default_factory=list)  # staging buffers, given back once written
    ready_at: float = 0.0  # time.monotonic() when it was handed to the syncer



class WriterMixin:
    """Write path of :class:`~kvbm_backend.pool.g3.pool.G3Pool` (``put`` queues, this writes)."""

    # ---- internals: write path ----------------------------------------------------------------
    # Pipeline (invariant 2 kept per piece): the writer thread takes queued offloads as a batch,
    # reserves slots, cuts the batch into pieces of ~chunk_bytes and submits them, at most
    # ``chunks_in_flight`` being written at once across batches. A written piece goes to the syncer
    # thread, which fdatasyncs every file the ready pieces touched (one call per file per round: group
    # commit) and only then publishes those pieces with one journal append. So the next pieces' writes
    # are in flight while earlier pieces' fdatasync runs. A round waits for pieces still being written
    # (bounded by g3.group_commit_ms / g3.group_commit_bytes, see _group_wait_locked) so that one
    # barrier covers as many blocks as are on their way: durable writes cost a few barriers per
    # second, not one per piece. Syncs of one file never overlap (one round at a time): a failed
    # fdatasync bumps the file's error generation and every piece submitted before that (still
    # unpublished) which wrote the file is dropped, so a write-back error reported to one caller is
    # never missed by another piece.
    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                jobs = [self._queue.popleft()]
                nbytes = len(jobs[0].keys) * self.slot_bytes
                while self._queue and nbytes + len(self._queue[0].keys) * self.slot_bytes <= self.max_batch_bytes:
                    j = self._queue.popleft()
                    jobs.append(j)
                    nbytes += len(j.keys) * self.slot_bytes
                self._writing += 1
            batch = _Batch(jobs)
            try:
                self._start_batch(batch)
            except Exception:  # noqa: BLE001 - a bug must not hang futures or kill the writer
                log.exception("G3 writer: batch failed")
                batch.broken = True
            finally:
                self._batch_release(batch)

    def _batch_release(self, batch: "_Batch") -> None:
        """The writer is done cutting ``batch`` into pieces (finishes it if every piece settled)."""
        with self._cv:
            batch.left -= 1
            done = self._batch_done_locked(batch) if batch.left == 0 else []
            self._cv.notify_all()
        for job in done:
            if not job.future.done():
                job.future.set_result(job.result)

    def _batch_done_locked(self, batch: "_Batch") -> list:
        for job in batch.jobs:
            self._pending -= len(job.keys)
            self._inflight.difference_update(job.keys)
            self._cancelled.difference_update(job.keys)
            if batch.broken:
                left = len(job.keys) - job.result.written - job.result.skipped - job.result.dropped
                if left > 0:
                    job.result.dropped += left
                    self._drop("error", left)
        self._writing -= 1
        self._update_gauges()
        return batch.jobs

    def _finish_job_dropped(self, job: _Job, reason: str) -> None:
        with self._cv:
            n = len(job.keys)
            self._pending -= n
            self._inflight.difference_update(job.keys)
            self._cancelled.difference_update(job.keys)
            job.result.dropped += n
            self._drop(reason, n)
            self._cv.notify_all()
        if not job.future.done():
            job.future.set_result(job.result)

    def _start_batch(self, batch: "_Batch") -> None:
        """Reserve slots for the batch's blocks and submit its pieces (returns once all are submitted)."""
        lj: list = []  # per live block: job, key, block, device checksum (parallel lists)
        lk: list = []
        lb: list = []
        lc: list = []
        any_checks = any(job.checks is not None for job in batch.jobs)
        evicted_recs = 0
        with self._lock:
            cancelled = self._cancelled
            for job in batch.jobs:
                jc = job.checks if job.checks is not None else [None] * len(job.keys)
                if not cancelled:
                    lj.extend([job] * len(job.keys))
                    lk.extend(job.keys)
                    lb.extend(job.blocks)
                    lc.extend(jc)
                    continue
                for k, b, c in zip(job.keys, job.blocks, jc):
                    if k in cancelled:
                        job.result.skipped += 1
                    else:
                        lj.append(job)
                        lk.append(k)
                        lb.append(b)
                        lc.append(c)
            n = len(lk)
            slots = self.slabs.allocate(n, self._run)
            if len(slots) < n:
                ev = self.index.evict(n - len(slots))
                for _, s in ev:
                    self.slabs.release([s])
                evicted_recs = len(ev)
                slots += self.slabs.allocate(n - len(slots), self._run)
            self._reserved += len(slots)
            self._c["evictions"] += evicted_recs
            m = len(slots)
            for job in lj[m:]:
                job.result.dropped += 1
            if n > m:
                self._drop("no_space", n - m)
                del lj[m:], lk[m:], lb[m:], lc[m:]
            per = self._piece_slots
            pieces = [_Piece(batch, lj[a:a + per], lk[a:a + per], lb[a:a + per], slots[a:a + per],
                             lc[a:a + per] if any_checks else None)
                      for a in range(0, m, per)]
            batch.left += len(pieces)
        if evicted_recs:
            self.metrics.evictions.inc(evicted_recs)
        if not pieces:
            return
        try:
            top: dict[int, int] = {}
            for fi, si in slots:
                if si > top.get(fi, -1):
                    top[fi] = si
            for fi, si in top.items():
                self.slabs.ensure_size(fi, si)
        except Exception as e:  # noqa: BLE001 - ENOSPC from growth, or anything else: the pieces are dropped
            for pc in pieces:
                pc.error = e
            with self._cv:
                batch.failed = e
                for pc in pieces:
                    self._to_ready_locked(pc)
                self._cv.notify_all()
            return
        for pc in pieces:
            with self._cv:
                while self._pieces_writing >= self.chunks_in_flight:
                    self._cv.wait()
                if batch.failed is not None:  # an earlier piece failed: the rest is dropped unwritten
                    pc.error = batch.failed
                    self._to_ready_locked(pc)
                    self._cv.notify_all()
                    continue
                self._pieces_writing += 1
                pc.files = tuple(sorted({fi for fi, _ in pc.slots}))
                pc.gens = tuple(self._err_gen.get(fi, 0) for fi in pc.files)
            try:
                ef = self.engine.submit(plan_ops(self._write_extents(pc), self._io_size, write=True))
            except Exception as e:  # noqa: BLE001 - engine refused or a bug: this piece is dropped
                ef = Future()
                ef.set_exception(e)
            ef.add_done_callback(lambda f, pc=pc: self._piece_written(pc, f))

    def _piece_written(self, pc: "_Piece", ef: Future) -> None:
        """Engine callback: the piece's writes finished (staging goes back; the syncer takes it on)."""
        e = ef.exception()
        for b in pc.stage:
            self._staging.give(b)
        pc.stage = []
        with self._cv:
            self._pieces_writing -= 1
            if e is not None:
                pc.error = e
                if pc.batch.failed is None:
                    pc.batch.failed = e
            self._to_ready_locked(pc)
            self._cv.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._stop_sync:
                    self._cv.wait()
                if not self._ready:
                    return
                if self.cfg.fsync:
                    self._group_wait_locked()
                ready, self._ready = self._ready, []
                self._c["sync_groups"] += 1
            errs: dict[int, BaseException] = {}
            try:
                if self.cfg.fsync:
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
        """Group commit (caller holds ``self._cv``; ``self._ready`` is not empty): while pieces are still
        being written (or queued to be), let the group grow so that one barrier covers them too, until the
        oldest waiting piece has waited as long as the last barrier took (never more time waiting than a
        barrier costs: a slow flush is amortised over more blocks, a fast one is not delayed) and at most
        ``g3.group_commit_ms``, or ``g3.group_commit_bytes`` of slots are waiting, or nothing is in flight
        any more (waiting longer would only add latency), or the pool closes."""
        limit_s = min(self.cfg.group_commit_ms / 1e3, self._last_barrier_s)
        if limit_s <= 0:
            return
        end = self._ready[0].ready_at + limit_s
        max_slots = self.cfg.group_commit_bytes // self.slot_bytes if self.cfg.group_commit_bytes else None
        while (self._pieces_writing or self._queue) and not self._stop_sync and (
                max_slots is None or sum(len(pc.slots) for pc in self._ready) < max_slots):
            left = end - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def _to_ready_locked(self, pc: "_Piece") -> None:
        """Hand a piece (written, or failed) to the syncer (caller holds ``self._cv``)."""
        pc.ready_at = time.monotonic()
        self._ready.append(pc)

    def _sync_files(self, files: list[int]) -> dict[int, BaseException]:
        """fdatasync each slab file (in parallel when several); returns {file index: error}."""
        errs: dict[int, BaseException] = {}
        if len(files) == 1:
            try:
                self._fdatasync(self.slabs.by_index[files[0]].fd)
            except OSError as e:
                errs[files[0]] = e
        else:
            futs = [(fi, self._sync_pool.submit(self._fdatasync, self.slabs.by_index[fi].fd)) for fi in files]
            for fi, fut in futs:
                e = fut.exception()
                if e is not None:
                    errs[fi] = e
        if errs:
            with self._lock:
                for fi in errs:
                    self._err_gen[fi] = self._err_gen.get(fi, 0) + 1
        return errs

    def _settle(self, pieces: list, sync_errs: dict) -> None:
        """Publish the pieces that were written and synced (index + journal in one lock hold); release
        and count the others; finish batches whose last piece this was."""
        done: list = []
        with self._cv:
            recs = []
            pub_j: list = []  # publishable blocks (journaled first, then put in the index)
            pub_k: list = []
            pub_s: list = []
            finished: list = []
            for pc in pieces:
                self._reserved -= len(pc.slots)
                err = pc.error
                if err is None and any(self._err_gen.get(fi, 0) != g for fi, g in zip(pc.files, pc.gens)):
                    err = next((sync_errs[fi] for fi in pc.files if fi in sync_errs), None) or OSError(
                        errno.EIO, "fdatasync failed on a slab file this piece wrote")
                if err is None:
                    cancelled = self._cancelled
                    for job, k, slot in zip(pc.jobs, pc.keys, pc.slots):
                        if cancelled and k in cancelled:
                            self.slabs.release([slot])
                            job.result.skipped += 1
                            continue
                        pub_j.append(job)
                        pub_k.append(k)
                        pub_s.append(slot)
                        recs.append(jr.encode(jr.PUT, k, slot))
                else:
                    self.slabs.release(pc.slots)
                    reason = "enospc" if getattr(err, "errno", None) in _NOSPACE else "io_error"
                    if not pc.batch.counted:
                        pc.batch.counted = True
                        self._c["enospc" if reason == "enospc" else "write_errors"] += 1
                        if reason == "enospc":
                            self._degraded_until = time.monotonic() + self.degrade_s
                            self.metrics.degraded.set(1)
                            log.warning("G3: %s; tier degraded for %.1f s, blocks of the batch dropped", err,
                                        self.degrade_s)
                        else:
                            log.warning("G3: write failed (%s); blocks of the batch dropped", err)
                    for job in pc.jobs:
                        job.result.dropped += 1
                    self._drop(reason, len(pc.jobs))
                pc.batch.left -= 1
                if pc.batch.left == 0:
                    finished.append(pc.batch)
            if recs and not self._journal_append(recs):
                # not journaled, so not published: dropped, counted, slots released (tier degraded)
                self.slabs.release(pub_s)
                for job in pub_j:
                    job.result.dropped += 1
                self._drop(self._journal_reason, len(pub_s))
                recs = []
            else:
                for job, k, slot in zip(pub_j, pub_k, pub_s):
                    self.index.put(k, slot)
                    job.result.written += 1
            for b in finished:
                done.extend(self._batch_done_locked(b))
            if recs:
                n = len(recs)
                self._c["offloads_written"] += n
                self._c["bytes_written"] += n * self.slot_bytes
                self.metrics.offload_blocks.inc(n)
                self.metrics.bytes_written.inc(n * self.slot_bytes)
                self._update_gauges()
            self._cv.notify_all()
        for job in done:
            if not job.future.done():
                job.future.set_result(job.result)

    def _write_extents(self, pc: "_Piece") -> list:
        """Frames (header with the payload's xxh3_128, payload, zero pad) of the piece's blocks into its
        slots. Staging/header buffers come from :attr:`_staging` and are listed in ``pc.stage``."""
        sb, bb = self.slot_bytes, self.block_bytes
        m = len(pc.keys)
        now = time.time_ns()
        wh = self._frames.write_header
        digest = xxhash.xxh3_128_digest
        if self._gather:  # small blocks: one staged slot image per piece, one iovec per I/O
            stage = self._staging.take(self._piece_slots * sb)
            pc.stage.append(stage)
            s2 = stage[:m * sb].reshape(m, sb)
            np.stack(pc.blocks, out=s2[:, HDR:HDR + bb])
            if sb - HDR > bb:
                s2[:, HDR + bb:] = 0
            mv = memoryview(stage)
            off = 0
            checks = pc.checks or [None] * m
            for key, block, dc in zip(pc.keys, pc.blocks, checks):
                wh(mv, off, self._tag(key.tenant), key.rank, key.seq_hash, digest(block), now, dc)
                off += sb
            return staged_run_extents(pc.slots, stage[:m * sb], sb, self._io_size, self._fd_of)
        hdrs = self._staging.take(self._piece_slots * HDR)
        pc.stage.append(hdrs)
        mv = memoryview(hdrs)
        extents = []
        files = self.slabs.by_index
        checks = pc.checks or [None] * m
        for j, (key, block, (fi, si), dc) in enumerate(zip(pc.keys, pc.blocks, pc.slots, checks)):
            f = files[fi]
            wh(mv, j * HDR, self._tag(key.tenant), key.rank, key.seq_hash, digest(block), now, dc)
            hv = hdrs[j * HDR:(j + 1) * HDR]
            if f.o_direct and not is_aligned(block):
                st = self._staging.take(self._stored_padded)  # aligned; back once the piece is written
                pc.stage.append(st)
                st[:bb] = block
                st[bb:] = 0
                bufs = [hv, st]
            else:
                bufs = [hv, block] + ([self._zero_pad] if self._zero_pad.nbytes else [])
            extents.append(slot_extent(f.fd, si, sb, bufs, self._io_size))
        return extents

    @property
    def _piece_slots(self) -> int:
        return max(1, self.min_chunk_blocks, self.chunk_bytes // self.slot_bytes)

