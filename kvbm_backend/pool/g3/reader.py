"""G3 read pipeline: host gets (chunked reads verified on the verifier thread), slot leases and the
device reader. Mixed into :class:`~kvbm_backend.pool.g3.pool.G3Pool` (pool lock, slots, engine,
counters: see :mod:`.slots`). Invariant 1 (never wrong KV) is kept here.
"""
from __future__ import annotations

import collections
import logging
import operator
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

from ...memory import aligned_empty
from ...model import frame
from ...model.frame import FrameError
from ...model.namespace import BlockKey
from ...transfer import plan_ops, staged_run_extents
from ..base import GetResult, SlotLease
from . import journal as jr
from .index import TagKey
from .slots import _MISS_REASON, HDR

log = logging.getLogger(__name__)


@dataclass
class _Read:
    future: Future
    n: int
    slots: list  # slots of the present keys (pinned until the read finishes)
    lock: threading.Lock = field(default_factory=threading.Lock)
    left: int = 1  # chunks not yet verified
    out: list = field(default_factory=list)
    todo: collections.deque = field(default_factory=collections.deque)  # chunks not yet submitted
    resolved: bool = False
    timed_out: bool = False
    ok: list = field(default_factory=list)
    bad: list = field(default_factory=list)
    bad_detail: list = field(default_factory=list)
    dups: list = field(default_factory=list)  # (i, j): keys[i] repeats keys[j]

    def __post_init__(self):
        self.ok = [False] * self.n


_U64, _U32 = (1 << 64) - 1, (1 << 32) - 1


def valid_key(k) -> bool:
    """A key a G3 slot can hold: seq_hash an integer in [0, 2**64), rank in [0, 2**32), and a str tenant
    (BlockKey) or a 16-byte tag (a restored :class:`~.index.TagKey`). Anything else is a miss
    (``invalid_key``): never looked up, so it cannot reach (let alone drop) another key's slot."""
    try:
        if not (0 <= operator.index(k.seq_hash) <= _U64 and 0 <= operator.index(k.rank) <= _U32):
            return False
    except TypeError:
        return False
    if type(k) is TagKey:
        return type(k.tag) is bytes and len(k.tag) == 16
    return isinstance(k.tenant, str)



class ReaderMixin:
    """Read path of :class:`~kvbm_backend.pool.g3.pool.G3Pool`."""

    # ---- SlotLeaseSource: in-place reads by the device loader ---------------------------------
    def lease(self, keys: Sequence[BlockKey]) -> list[SlotLease | None]:
        """Pin the slots of ``keys`` for a reader outside the pool (the device loader reads frames
        straight into HBM); None for absent or foreign keys (counted as ``absent`` misses). Every
        lease must go back through :meth:`release`; until then the slot is not evicted or reused. The
        reader verifies header and payload itself (the frame is not trusted)."""
        out: list[SlotLease | None] = []
        absent = 0
        with self._lock:
            get, pin, files = self.index.get, self.index.pin, self.slabs.by_index
            for k in keys:
                slot = get(k, touch=True) if k.namespace == self.fp else None
                if slot is None:
                    out.append(None)
                    absent += 1
                    continue
                pin(slot)
                out.append(SlotLease(k, files[slot[0]].path, slot[1] * self.slot_bytes, self.slot_bytes, slot))
            if absent:
                self._miss("absent", absent)
        return out

    def release(self, leases: Sequence[SlotLease]) -> None:
        """Unpin leases from :meth:`lease` (a slot evicted meanwhile is freed now)."""
        with self._lock:
            for ls in leases:
                free = self.index.unpin(ls.token)
                if free is not None:
                    self.slabs.release([free])

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        """A reader outside the pool found ``key``'s slot bad (``reason``, a FrameError reason):
        remove it from the index and journal (the slot is freed once its last lease is released) once
        the stored bytes are proven bad (:meth:`_prove_bad`): a slot whose frame re-reads and verifies,
        or cannot be read, stays (a miss)."""
        with self._lock:
            slot = self.index.get(key) if valid_key(key) else None
            rec = None if slot is None else self.index.identity(key, slot)
            self._miss(_MISS_REASON.get(reason, "corrupt"))
        if rec is None:
            return
        why = self._prove_bad(slot, rec)
        if why in ("good", "unreadable"):
            log.warning("G3: a device load reported slot %s bad (%s) but it %s; kept", slot, reason,
                        "re-reads and verifies" if why == "good" else "cannot be re-read now")
            return
        with self._lock:  # counted under the reason of the check that found it (the re-read only proves it)
            self._c["corrupt"] += 1
            self._c["corrupt:" + reason] += 1
            free = self.index.remove(key, slot)
            if free is not None:
                self.slabs.release([free])
            self._journal_append([jr.encode(jr.DEL, key)])
            self._c["deleted"] += 1
            self._update_gauges()
        self.metrics.corrupt.labels(reason).inc()

    def device_reader(self, device):
        """The pool's :class:`~kvbm_backend.gpu.loader.DeviceLoader` for ``device`` (created on first
        use: the device path is probed in this pool's first directory and logged once; ``g3.device_path``
        forces a mode). ``get(keys, tensors)`` uses it; callers may call this at start-up so the probe
        and its log line happen before the first request.

        Raises:
            RuntimeError: the pool is closed. ImportError: torch is not installed.
        """
        import torch

        from ...gpu.loader import DeviceLoader
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with self._device_lock:  # one probe per device, never under the pool lock (the probe does I/O)
            if self._closed:
                raise RuntimeError("G3 pool is closed")
            rd = self._device_readers.get(str(dev))
            if rd is None:
                rd = DeviceLoader(self, self._layout, dev, probe_dir=self.slabs.paths[0], mode=self.cfg.device_path,
                                  world=self.namespace.tp_world_size, timeout_s=self.cfg.load_timeout_s, threads=self.cfg.io_threads,
                                  io_bytes=max(self._io_size, 16 << 20))
                self._device_readers[str(dev)] = rd
                log.info("G3 %s: device loads into %s: %s (%s)", self.slabs.paths[0], dev, rd.mode, rd.mode_reason)
        return rd

    def _get_tensors(self, keys: list, out: list) -> Future:
        """``get`` into torch tensors: the device reader on the pool's device-load thread."""
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        try:
            rd = self.device_reader(out[0].device)
        except Exception as e:  # noqa: BLE001 - no device path: every block is a miss, said once per call
            log.warning("G3: device load of %d blocks impossible: %s", len(keys), e)
            fut.set_result(GetResult(ok=[False] * len(keys)))
            return fut

        def run() -> None:
            why: list = []
            io: dict = {}
            try:
                ok = rd.load(keys, out, why, io)
            except (ValueError, TypeError):
                raise  # bad destination tensors or a wiring bug: the caller must see it
            except Exception as e:  # noqa: BLE001 - storage trouble: misses
                log.warning("G3: device load of %d blocks failed: %s", len(keys), e)
                ok, why = [False] * len(keys), ["io_error"] * len(keys)
            hits = sum(ok)
            nread = io.get("bytes_read", 0)
            with self._lock:
                self._c["hits"] += hits
                self._c["bytes_read"] += nread
                self._c["device_loads"] += len(keys)
                self._c["device_hits"] += hits
                # absent keys were counted by lease(), corrupt slots by drop_corrupt()
                for r in why:
                    if r in ("io_error", "short", "timeout", "unverifiable"):
                        self._miss(r)
            self.metrics.onboard_blocks.inc(hits)
            self.metrics.bytes_read.inc(nread)
            fut.set_result(GetResult(ok=list(ok)))

        def guarded() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - ValueError (bad tensors) reaches the caller
                if not fut.done():
                    fut.set_exception(e)

        try:
            self._device_exec.submit(guarded)
        except RuntimeError as e:  # executor shut down: pool closing
            fut.set_result(GetResult(ok=[False] * len(keys)))
            log.warning("G3: device load refused: %s", e)
        return fut

    @property
    def _read_piece_slots(self) -> int:
        return max(1, self.min_chunk_blocks, min(self.chunk_bytes, self.read_chunk_bytes) // self.slot_bytes)

    def _stage_slots(self, n: int) -> int:
        """Slots of the staging buffer for a read chunk of ``n`` slots: the next power of two, at most a
        full piece (:attr:`_read_piece_slots`). A small get (vLLM's tiers issue several gets of a few
        chunks at once) takes a small buffer, and buffers come in few sizes, so they are reused. Before,
        every chunk took a full piece (64 MiB with 2 MiB blocks): concurrent small gets went past the
        kept staging and pre-faulted fresh 64 MiB buffers (~0.1 s each on the dev VM)."""
        return min(self._read_piece_slots, 1 << max(0, int(n) - 1).bit_length())

    def _read_extents(self, ch: tuple, stages: list) -> list:
        """Extents reading the chunk's slots (``ch`` = (indexes, keys, slots)) into one staging buffer
        taken from :attr:`_staging` (appended to ``stages``): slot ``j`` at ``j * slot_bytes``. Every
        block is staged, whatever its size: the caller's buffer receives only verified bytes (a miss
        leaves it untouched, :mod:`kvbm_backend.pool.base`), at the cost of one copy per hit."""
        sb = self.slot_bytes
        stage = self._staging.take(self._stage_slots(len(ch[2])) * sb)
        stages.append(stage)
        return staged_run_extents(ch[2], stage[:len(ch[2]) * sb], sb, self._io_size, self._fd_of)

    # ---- internals: read path -----------------------------------------------------------------
    def _read_timeout(self, st: _Read) -> None:
        with st.lock:
            if st.resolved:
                return
            st.resolved = True
            st.timed_out = True
        with self._lock:
            self._miss("timeout", len(st.slots))
        st.future.set_result(GetResult(ok=[False] * st.n))

    def _read_submit_next(self, st: _Read) -> None:
        """Submit the read's next chunk (at most ``chunks_in_flight`` are in flight per batch)."""
        with st.lock:
            if not st.todo:
                return
            ch = st.todo.popleft()
        stages: list = []
        try:
            exts = self._read_extents(ch, stages)
            ef = self.engine.submit(plan_ops(exts, self._io_size, write=False))
        except Exception as e:  # noqa: BLE001 - engine refused: the chunk's blocks are misses
            ef = Future()
            ef.set_exception(e)
        ef.add_done_callback(lambda f: self._read_chunk_done(st, ch, f, stages))

    def _read_chunk_done(self, st: _Read, ch: tuple, ef: Future, stages: list) -> None:
        """Engine callback (the engine's completion thread): submit the read's next chunk at once, then
        hand this chunk to the verifier thread, so I/O is never waiting on verification."""
        self._read_submit_next(st)
        exc = ef.exception()
        try:
            self._verifier.submit(self._read_verify, st, ch, exc, stages)
        except RuntimeError:  # verifier shut down (pool closing): verify here
            self._read_verify(st, ch, exc, stages)

    def _read_verify(self, st: _Read, ch: tuple, exc: BaseException | None, stages: list) -> None:
        """Verify one chunk's blocks where they landed (headers and checksums checked for the whole
        chunk at once), copy staged ones out; the last chunk finishes the read."""
        bad: list = []  # (key, slot, reason)
        bad_detail: list = []  # FrameError reasons
        try:
            self._verify_chunk(st, ch, exc, stages[0], bad, bad_detail)
        except Exception:  # noqa: BLE001 - a bug must not hang the read: the chunk's blocks miss
            log.exception("G3: verifying a read chunk failed")
            bad.clear()
            for i, k, slot in zip(*ch):
                st.ok[i] = False
                bad.append((k, slot, "io_error"))
        for b in stages:
            self._staging.give(b)
        with st.lock:
            st.bad.extend(bad)
            st.bad_detail.extend(bad_detail)
            st.left -= 1
            last = st.left == 0
        if last:
            self._read_finish(st)

    def _verify_chunk(self, st: _Read, ch: tuple, exc, stage, bad: list, bad_detail: list) -> None:
        """Check the chunk's staged slots (``stage``: slot j at ``j * slot_bytes``) and copy the verified
        payloads to the caller's buffers (none after the read resolved); failures go to ``bad``."""
        ok = st.ok
        idx, keys, slots = ch
        m = len(slots)
        sb, bb = self.slot_bytes, self.block_bytes
        files = self.slabs.by_index
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
        tag = self._tag
        hdrs = stage[:m * sb].reshape(m, sb)
        mv = memoryview(stage)
        payloads = [mv[o:o + bb] for o in range(HDR, m * sb, sb)]
        dsts = [st.out[i] for i in idx]
        tags = [k.tag if type(k) is TagKey else tag(k.tenant) for k in keys]
        good = self._frames.verify_many(hdrs, payloads, tags, [k.rank for k in keys], [k.seq_hash for k in keys])
        if all_there and good.all():
            if not st.resolved:
                for d, pl in zip(dsts, payloads):
                    d[:] = pl
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
                    hdr = frame.accept(hdrs[j], k, self._layout,
                                       tags[j], world=self.namespace.tp_world_size,
                                       stored_len=self.block_bytes)
                    if not hdr.flags & frame.FLAG_CHECKSUM:
                        raise FrameError("integrity", "frame carries no checksum")
                    frame.verify_payload(hdr, payload)
                except FrameError as e:
                    reason = _MISS_REASON.get(e.reason, "corrupt")
                    bad_detail.append(e.reason)
            if reason is None:
                ok[i] = True
                if not st.resolved:
                    dsts[j][:] = payload
            else:
                bad.append((k, slot, reason))

    def _prove_bad(self, slot: tuple, rec: tuple) -> str:
        """Re-read ``slot`` (one synchronous ``preadv`` of the whole slot into a fresh aligned buffer) and
        check it against ``rec`` = (tenant tag, rank, seq_hash), what the index says the slot holds.

        Returns ``"good"`` (the stored frame verifies: the failed read was a read error, or the caller's
        key did not name what the slot holds), ``"unreadable"`` (the re-read failed too: a read error,
        the stored bytes are not proven bad), or the reason the stored bytes are bad: ``"short"`` (the
        file ends inside the slot) or a FrameError reason. Only the last kind may drop a slot.
        The slot must stay pinned (or be otherwise unreusable) meanwhile."""
        fi, si = slot
        f = self.slabs.by_index.get(fi)
        if f is None:
            return "unreadable"
        sb = self.slot_bytes
        buf = aligned_empty(sb)
        try:
            n = os.preadv(f.fd, [buf], si * sb)
        except OSError:
            return "unreadable"
        if n < sb:
            try:
                size = os.fstat(f.fd).st_size
            except OSError:
                return "unreadable"
            return "short" if size < (si + 1) * sb else "unreadable"
        tag, rank, seq = rec
        try:
            hdr = frame.accept(buf[:HDR], TagKey(self.fp, tag, rank, seq), self._layout, tag,
                               world=self.namespace.tp_world_size, stored_len=self.block_bytes)
            if not hdr.flags & frame.FLAG_CHECKSUM:
                raise FrameError("integrity", "frame carries no checksum")
            frame.verify_payload(hdr, buf[HDR:HDR + self.block_bytes])
        except FrameError as e:
            return e.reason
        return "good"

    def _read_finish(self, st: _Read) -> None:
        """Resolve the read: fill repeated keys from their first copy, prove failed slots bad before
        dropping them (:meth:`_prove_bad`, while they are still pinned), unpin, count."""
        ok, bad = st.ok, st.bad
        with st.lock:
            late = st.resolved
            st.resolved = True
        if not late:
            for i, j in st.dups:
                if ok[j]:
                    st.out[i][:] = st.out[j]
                    ok[i] = True
        with self._lock:
            recs = [None if r == "absent" else self.index.identity(k, slot) for k, slot, r in bad]
        drop, why = [], []  # proven bad: (key, slot, FrameError reason or "short"); miss reasons
        for (k, slot, reason), rec in zip(bad, recs):
            proof = "gone" if rec is None else self._prove_bad(slot, rec)
            if proof == "good":
                why.append("identity" if reason == "identity" else "io_error")
            elif proof in ("unreadable", "gone"):
                why.append("io_error" if proof == "unreadable" else reason)
            else:
                drop.append((k, slot, proof))
                why.append("short" if proof == "short" else _MISS_REASON.get(proof, "corrupt"))
        hits = sum(ok)
        with self._lock:
            jrecs = []
            for slot in st.slots:
                free = self.index.unpin(slot)
                if free is not None:
                    self.slabs.release([free])
            for k, slot, proof in drop:
                free = self.index.remove(k, slot)
                if free is not None:
                    self.slabs.release([free])
                jrecs.append(jr.encode(jr.DEL, k))
                self._c["corrupt"] += 1
                self._c["corrupt:" + proof] += 1
                self.metrics.corrupt.labels(proof).inc()
            self._journal_append(jrecs)
            self._c["bytes_read"] += len(st.slots) * self.slot_bytes
            if late:
                self._c["late_reads"] += len(st.slots)
            else:
                self._c["hits"] += hits
                for r in why:
                    self._miss(r)
                dmiss = sum(1 for i, _ in st.dups if not ok[i])
                if dmiss:
                    self._miss("duplicate_of_miss", dmiss)
            self._update_gauges()
        self.metrics.bytes_read.inc(len(st.slots) * self.slot_bytes)
        if not late:
            self.metrics.onboard_blocks.inc(hits)
            st.future.set_result(GetResult(ok=ok))
        if drop:
            log.warning("G3: %d block(s) proven bad on disk and dropped: %s", len(drop),
                        collections.Counter(r for _, _, r in drop))
        if len(drop) < len(bad):
            log.warning("G3: %d block(s) missed but kept (read error or a key naming another block): %s",
                        len(bad) - len(drop), collections.Counter(why))
