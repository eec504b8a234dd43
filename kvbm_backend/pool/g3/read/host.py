"""One host get (numpy destinations) of the G3 reader: lease -> plan -> read -> verify -> deliver.

:class:`HostGet` is one ``G3Pool.get(keys, numpy_buffers)`` in flight (invariant 1, never wrong KV):

1. lease: the keys' slots are looked up and pinned under the catalog lock (absent, foreign and invalid
   keys are misses; a key named twice is read once and its later copies filled from the first);
2. plan: chunks of ~``read_chunk_bytes`` slots, each read into one staging buffer
   (:func:`kvbm_backend.transfer.staged_run_extents` -> :func:`~kvbm_backend.transfer.plan_ops`);
3. read: the pool's :mod:`kvbm_backend.io` engine, ``read_chunks_in_flight`` chunks at once;
4. verify: each chunk's headers and xxh3_128 checksums at once
   (:meth:`~kvbm_backend.model.frame.ChecksumFrames.verify_many`) on the reader's verifier thread, never
   on the engine's completion thread;
5. deliver: verified payloads copied into the caller's buffers (a miss leaves its buffer untouched);
   failed slots are re-read and dropped only when proven bad (:meth:`~.reader.G3Reader.prove_bad`).
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence, Union, cast

from ....model import frame
from ....model.frame import FrameError
from ....model.namespace import BlockKey
from ....transfer import Extent, plan_ops, staged_run_extents
from ...base import BlockBuffer, GetResult
from .. import journal as jr, vacancy
from ..index import TagKey, valid_key as valid_key  # re-exported (read/__init__, reader)
from ..catalog import _MISS_REASON, HDR
from ..pieces import Slot

if TYPE_CHECKING:
    from .reader import G3Reader

log = logging.getLogger(__name__)


#: a key a G3 get reads: a BlockKey, or a restored TagKey (tenant tag only) that ``G3Pool.keys`` gave out
G3Key = Union[BlockKey, TagKey]
#: a read chunk: the get's indexes, keys and slots of its blocks (parallel lists)
_Chunk = tuple[list[int], list[G3Key], list[Slot]]
#: a failed block: (key, slot, miss reason)
_Bad = tuple[G3Key, Slot, str]


def same_slot(a: Slot | None, b: Slot) -> bool:
    """``a`` (what the index maps a key to now, or None) is slot ``b``: a proven-bad block is removed and
    journaled DEL only then, never a copy the key got since (deleted and written again elsewhere)."""
    return a is not None and tuple(a) == tuple(b)


class HostGet:
    """One numpy get: ``HostGet(reader, keys, out).start()`` -> Future[GetResult] (see the module doc).

    ``out[i]`` are writable contiguous 1-D uint8 buffers of ``block_bytes`` (checked by the caller)."""

    def __init__(self, reader: G3Reader, keys: Sequence[G3Key], out: list[BlockBuffer]) -> None:
        self.rd = reader
        self.cat = reader.cat  # slot state (under cat.lock)
        self.p = reader.pool  # engine, checksum frames, staging, io size, read tuning, cfg
        self.keys = keys
        self.out = out
        self.n = len(keys)
        self.future: Future[GetResult] = Future()
        self.future.set_running_or_notify_cancel()
        self.lock = threading.Lock()
        self.slots: list[Slot] = []  # slots of the present keys (pinned until the read finishes)
        self.idx: list[int] = []  # the get's index of each slot in slots
        self.left = 0  # chunks not yet verified
        self.todo: collections.deque[_Chunk] = collections.deque()  # chunks not yet submitted
        self.resolved = False
        self.ok = [False] * self.n
        self.delivered: list[int] = []  # indexes whose verified payload was copied into out (under lock)
        self.bad: list[_Bad] = []  # (key, slot, reason)
        self.dups: list[tuple[int, int]] = []  # (i, j): keys[i] repeats keys[j], served by a copy of out[j] (same digest)

    # ---- lease + plan ------------------------------------------------------------------------------
    def start(self) -> Future[GetResult]:
        cat, keys, n = self.cat, self.keys, self.n
        # parallel lists, not a list per block: fewer GC-tracked objects per block (a full collection
        # of a large process stalls every thread; per-block lists made one likely on every big get)
        idx: list[int] = []
        pk: list[G3Key] = []
        ps: list[Slot] = []
        invalid = 0
        # the load's bound starts now: the pool's lock may be held across another thread's journal I/O (a stalled
        # drive: unbounded), so it is waited for within the bound only (docs/invariants.md #3)
        at = time.monotonic() + self.p.cfg.load_timeout_s
        if not cat.lock.acquire(timeout=max(0.0, at - time.monotonic())):
            return self._lock_timeout()
        try:
            get, pin = cat.index.get, cat.index.pin
            first: dict[G3Key, int] = {}
            for i, k in enumerate(keys):
                if k.namespace != cat.fp:
                    continue
                if not valid_key(k):
                    invalid += 1
                    continue
                j = first.get(k)
                if j is not None:
                    self.dups.append((i, j))
                    continue
                slot = get(k, touch=True)
                if slot is None:
                    continue
                first[k] = i
                pin(slot)
                idx.append(i)
                pk.append(k)
                ps.append(slot)
            if invalid:
                cat.miss("invalid_key", invalid)
            cat.c["duplicate_keys"] += len(self.dups)
            absent = n - len(ps) - invalid - len(self.dups)
            if absent:
                cat.miss("absent", absent)
        finally:
            cat.lock.release()
        if not ps:
            self.future.set_result(GetResult(ok=[False] * n))
            return self.future
        per = self.piece_slots
        chunks: list[_Chunk] = [(idx[a:a + per], pk[a:a + per], ps[a:a + per]) for a in range(0, len(ps), per)]
        self.slots, self.idx, self.left, self.todo = ps, idx, len(chunks), collections.deque(chunks)
        self.rd.deadlines.add(at, self._timeout)
        for _ in range(min(max(1, self.p.read_chunks_in_flight), len(chunks))):
            self._submit_next()
        return self.future

    def _lock_timeout(self) -> Future[GetResult]:
        """The pool's lock stayed busy past the load's bound: every key a ``timeout`` miss (not known absent:
        ``timed_out`` True, nothing dropped or cooled as bad), nothing pinned, counted without the lock."""
        self.cat.miss_unlocked("timeout", self.n)
        self.future.set_result(GetResult(ok=[False] * self.n, timed_out=[True] * self.n))
        return self.future

    @property
    def piece_slots(self) -> int:
        """Slots per read chunk."""
        p = self.p
        return max(1, p.min_chunk_blocks, min(p.chunk_bytes, p.read_chunk_bytes) // self.cat.slot_bytes)

    def stage_slots(self, n: int) -> int:
        """Slots of the staging buffer for a read chunk of ``n`` slots: the next power of two, at most a
        full piece (:attr:`piece_slots`). A small get (vLLM's tiers issue several gets of a few chunks at
        once) takes a small buffer, and buffers come in few sizes, so they are reused. Before, every chunk
        took a full piece (64 MiB with 2 MiB blocks): concurrent small gets went past the kept staging and
        pre-faulted fresh 64 MiB buffers (~0.1 s each on the dev VM)."""
        return min(self.piece_slots, 1 << max(0, int(n) - 1).bit_length())

    def _extents(self, ch: _Chunk, stages: list[BlockBuffer]) -> list[Extent]:
        """Extents reading the chunk's slots (``ch`` = (indexes, keys, slots)) into one staging buffer
        taken from the pool's staging (appended to ``stages``): slot ``j`` at ``j * slot_bytes``. Every
        block is staged, whatever its size: the caller's buffer receives only verified bytes (a miss
        leaves it untouched, :mod:`kvbm_backend.pool.base`), at the cost of one copy per hit."""
        cat = self.cat
        sb = cat.slot_bytes
        stage = self.p._staging.take(self.stage_slots(len(ch[2])) * sb)
        stages.append(stage)
        return staged_run_extents(ch[2], stage[:len(ch[2]) * sb], sb, self.p._io_size, cat.fd_of)

    # ---- read ----------------------------------------------------------------------------------------
    def _timeout(self) -> None:
        """The load bound passed: resolve now. Payloads are copied into ``out`` under :attr:`lock` and only
        while unresolved, so nothing lands there after this (the caller may reuse ``out`` at once: a late copy
        into a reused buffer served another block's KV, review 2026-11-29); rows copied before are hits."""
        with self.lock:
            if self.resolved:
                return
            self.resolved = True
            got = list(self.delivered)
        self.cat.miss_unlocked("timeout", len(self.slots) - len(got))  # the timer thread never waits for the lock
        ok = [False] * self.n
        for i in got:
            ok[i] = True
        late = [False] * self.n  # present but not read and verified in time (GetResult.timed_out)
        for i in self.idx:
            late[i] = not ok[i]
        for i, j in self.dups:
            late[i] = late[j]
        self.future.set_result(GetResult(ok=ok, timed_out=late))

    def _submit_next(self) -> None:
        """Submit the get's next chunk (at most ``read_chunks_in_flight`` are in flight per get). A chunk whose
        future is already done when its callback is added (the engine refused it: a closed pool's engine fails
        every submit at once) is handed on here and the next one submitted by this loop. Before (reviewer,
        2026-11-30) that callback ran inline and recursed into this method once per chunk: a get of a few
        hundred chunks hit RecursionError inside ``add_done_callback`` (swallowed by concurrent.futures), and
        the get never resolved, its slots pinned."""
        while True:
            with self.lock:
                if not self.todo:
                    return
                ch = self.todo.popleft()
            stages: list[BlockBuffer] = []
            ef: Future[Any]  # the engine's byte counts (not used: headers and checksums say what arrived)
            try:
                exts = self._extents(ch, stages)
                ef = self.p.engine.submit(plan_ops(exts, self.p._io_size, write=False))
            except Exception as e:  # noqa: BLE001 - engine refused: the chunk's blocks are misses
                ef = Future()
                ef.set_exception(e)
            state = [True, False]  # [still in this loop, done while it was]: read and set under self.lock
            ef.add_done_callback(functools.partial(self._engine_done, ch, stages=stages, state=state))
            with self.lock:
                state[0] = False
                inline = state[1]
            if not inline:
                return
            self._hand_off(ch, ef, stages)

    def _engine_done(self, ch: _Chunk, ef: Future[Any], *, stages: list[BlockBuffer], state: list[bool]) -> None:
        """The chunk's done callback: left to the submitting loop while it is still running (it hands the chunk
        on and submits the next); otherwise :meth:`_chunk_done`."""
        with self.lock:
            if state[0]:
                state[1] = True
                return
        self._chunk_done(ch, ef, stages)

    def _chunk_done(self, ch: _Chunk, ef: Future[Any], stages: list[BlockBuffer]) -> None:
        """Engine callback (the engine's completion thread): submit the next chunk at once, then hand
        this chunk to the verifier thread, so I/O is never waiting on verification."""
        self._submit_next()
        self._hand_off(ch, ef, stages)

    def _hand_off(self, ch: _Chunk, ef: Future[Any], stages: list[BlockBuffer]) -> None:
        """Verify the finished chunk on the verifier thread (here when the verifier is shut down)."""
        exc = ef.exception()
        try:
            self.rd.verifier.submit(self._verify, ch, exc, stages)
        except RuntimeError:  # verifier shut down (pool closing): verify here
            self._verify(ch, exc, stages)

    # ---- verify + deliver ----------------------------------------------------------------------------
    def _verify(self, ch: _Chunk, exc: BaseException | None, stages: list[BlockBuffer]) -> None:
        """Verify one chunk's blocks where they landed (headers and checksums checked for the whole
        chunk at once), copy staged ones out; the last chunk finishes the get."""
        bad: list[_Bad] = []  # (key, slot, reason)
        try:
            self._verify_chunk(ch, exc, stages[0], bad)
        except Exception:  # noqa: BLE001 - a bug must not hang the read: the chunk's blocks miss
            log.exception("G3: verifying a read chunk failed")
            bad.clear()
            for i, k, slot in zip(*ch):
                self.ok[i] = False
                bad.append((k, slot, "io_error"))
        for b in stages:
            self.p._staging.give(b)
        with self.lock:
            self.bad.extend(bad)
            self.left -= 1
            last = self.left == 0
        if last:
            self._finish()

    def _verify_chunk(self, ch: _Chunk, exc: BaseException | None, stage: BlockBuffer, bad: list[_Bad]) -> None:
        """Check the chunk's staged slots (``stage``: slot j at ``j * slot_bytes``) and copy the verified
        payloads to the caller's buffers (none after the get resolved); failures go to ``bad``."""
        cat, ok = self.cat, self.ok
        idx, keys, slots = ch
        m = len(slots)
        sb, bb = cat.slot_bytes, cat.block_bytes
        files = cat.slabs.by_index
        if exc is not None:
            bad.extend((k, slot, "io_error") for k, slot in zip(keys, slots))
            return
        # slots past the end of their file (truncated) are "short": checked per file, once per chunk
        top: dict[int, int] = {}
        for fi, si in slots:
            if si > top.get(fi, -1):
                top[fi] = si
        limit: dict[int, int] = {}
        for fi in top:
            f = files.get(fi)
            try:
                limit[fi] = -1 if f is None else os.fstat(f.fd).st_size // sb - 1
            except OSError:
                limit[fi] = -1
        all_there = all(top[fi] <= limit[fi] for fi in top)
        tag = cat.tag
        hdrs = stage[:m * sb].reshape(m, sb)
        mv = stage.data  # memoryview(stage) (numpy's stubs give ndarray no buffer protocol before 3.12)
        payloads = [mv[o:o + bb] for o in range(HDR, m * sb, sb)]
        dsts = [self.out[i] for i in idx]
        tags = [k.tag if type(k) is TagKey else tag(k.tenant) for k in keys]
        good = self.p._frames.verify_many(hdrs, payloads, tags, [k.rank for k in keys], [k.seq_hash for k in keys],
                                          frame.key_digests(keys))
        if all_there and good.all():
            with self.lock:  # never into out once the get resolved (see _timeout)
                if not self.resolved:
                    for d, pl in zip(dsts, payloads):
                        d[:] = pl
                    self.delivered.extend(idx)
            for i in idx:
                ok[i] = True
            return
        for j in range(m):
            i, k, slot = idx[j], keys[j], slots[j]
            payload = payloads[j]
            reason = None
            if slot[1] > limit.get(slot[0], -1):
                reason = "short" if slot[0] in files else "io_error"
            elif not good[j]:
                try:  # slow path: name the reason (or accept a valid frame of another writer)
                    # accept reads namespace, rank and seq_hash of the key (the tenant is tags[j]): a TagKey has them
                    hdr = frame.accept(hdrs[j], cast(BlockKey, k), cat.layout, tags[j],
                                       world=cat.namespace.tp_world_size, stored_len=bb)
                    if not hdr.flags & frame.FLAG_CHECKSUM:
                        raise FrameError("integrity", "frame carries no checksum")
                    frame.verify_payload(hdr, payload)
                except FrameError as e:
                    reason = _MISS_REASON.get(e.reason, "corrupt")
            if reason is None:
                ok[i] = True
                with self.lock:  # never into out once the get resolved (see _timeout)
                    if not self.resolved:
                        dsts[j][:] = payload
                        self.delivered.append(i)
            else:
                bad.append((k, slot, reason))

    def _finish(self) -> None:
        """Resolve the get: fill repeated keys from their first copy, prove failed slots bad before
        dropping them (while they are still pinned), unpin, count."""
        cat, ok, bad = self.cat, self.ok, self.bad
        with self.lock:
            late = self.resolved
            self.resolved = True
        if not late:
            kd = frame.key_digest
            for i, j in self.dups:  # a repeat naming another token digest is not that block: a miss
                if ok[j] and kd(self.keys[i]) == kd(self.keys[j]):
                    self.out[i][:] = self.out[j]
                    ok[i] = True
        with cat.lock:
            recs = [None if r == "absent" else cat.index.identity(k, slot) for k, slot, r in bad]
        drop: list[_Bad] = []  # proven bad: (key, slot, FrameError reason or "short")
        why: list[str] = []  # miss reasons
        for (k, slot, reason), rec in zip(bad, recs):
            proof = "gone" if rec is None else self.rd.prove_bad(slot, rec, frame.key_digest(k))
            if proof == "good":
                why.append("identity" if reason == "identity" else "io_error")
            elif proof == "other_digest":  # another token sequence's verified block: a miss, kept
                why.append("other_digest")
            elif proof in ("unreadable", "gone"):
                why.append("io_error" if proof == "unreadable" else reason)
            else:
                drop.append((k, slot, proof))
                why.append("short" if proof == "short" else _MISS_REASON.get(proof, "corrupt"))
        hits = sum(ok)
        nbytes = len(self.slots) * cat.slot_bytes
        with cat.lock:
            jrecs: list[bytes] = []
            for slot in self.slots:
                free = cat.index.unpin(slot)
                if free is not None:
                    cat.slabs.release([free])
            for k, slot, proof in drop:
                # the index finds a restored TagKey's entry by its fields (namespace, tag, rank, seq_hash) too;
                # a key deleted and written again elsewhere meanwhile keeps its new copy (and no DEL drops it)
                if not same_slot(cat.index.get(cast(BlockKey, k)), slot):
                    continue
                cat.remove(cast(BlockKey, k), slot)
                jrecs.append(jr.encode(jr.DEL, k))
                cat.count_corrupt(proof)
            vacancy.journal_dels(cat, jrecs)  # not taken: counted (vacancies_unjournaled), logged
            cat.c["bytes_read"] += nbytes
            if late:
                cat.c["late_reads"] += len(self.slots)
            else:
                cat.c["hits"] += hits
                for r in why:
                    cat.miss(r)
                dmiss = sum(1 for i, j in self.dups if not ok[i] and not ok[j])
                if dmiss:
                    cat.miss("duplicate_of_miss", dmiss)
                # a repeat naming another digest than its served first copy: never the copy, the block kept
                other = [frame.key_digest(self.keys[j]) is None for i, j in self.dups if ok[j] and not ok[i]]
                if other.count(False):  # the frame holds the first copy's (nonzero) digest
                    cat.miss("other_digest", other.count(False))
                if other.count(True):
                    cat.miss("token_digest", other.count(True))
            cat.update_gauges()
        cat.metrics.bytes_read.inc(nbytes)
        if not late:
            cat.metrics.onboard_blocks.inc(hits)
            self.future.set_result(GetResult(ok=ok))
        if drop:
            log.warning("G3: %d block(s) proven bad on disk and dropped: %s", len(drop),
                        collections.Counter(r for _, _, r in drop))
        if len(drop) < len(bad):
            log.warning("G3: %d block(s) missed but kept (read error or a key naming another block): %s",
                        len(bad) - len(drop), collections.Counter(why))
