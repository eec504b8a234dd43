"""G3Pool: KV blocks in fixed slots of slab files on local/pooled SSD or a mounted filesystem.

Data flow (DESIGN.md): pool -> :mod:`kvbm_backend.transfer` (extents coalesced into ~``io_size_bytes``
ops) -> :mod:`kvbm_backend.io` engine (positioned scatter/gather I/O) -> slab files.

Invariants kept here (each has tests in ``tests/test_g3_*.py``):

1. Never wrong KV: a get is a hit only after the slot's header names exactly the requested key in
   this namespace's layout and the payload's xxh3_128 verifies in the caller's buffer. Anything else
   (corrupt, short, identity, io_error, timeout) is a miss, counted by reason; bad slots are dropped.
   A get is read in chunks; each chunk is checked as a whole (:meth:`ChecksumFrames.verify_many`,
   the same acceptance as the per-block check) on the pool's verifier thread, never on the I/O
   engine's completion thread, and staged blocks are copied to the caller only after they verified.
2. Publish after durable: the index entry and the journal record appear only after the slot's bytes
   were written and ``fdatasync``'ed (``g3.fsync``). The writer is pipelined (see "write path"
   below): a batch goes out in pieces, and a piece is published after an fdatasync of its files that
   started after its writes finished, while later pieces are already being written.
3. Never stall: ``put``/``get``/``lookup_prefix``/``delete`` return Futures at once; offloads wait in
   a bounded write-behind queue (``g3.write_queue_blocks``) and overflow is dropped and counted; loads
   past ``g3.load_timeout_s`` are misses.
4. Capacity is real: slots never exceed ``g3.capacity_gb`` nor the filesystem's free space above
   ``g3.min_free_fraction`` (checked at open and before every file growth); ENOSPC/EDQUOT releases every
   reservation of the batch and degrades the tier (no admission for :attr:`G3Pool.degrade_s` seconds,
   then statvfs is re-read) instead of raising. The metadata path fails the same way: a journal
   append/rewrite or namespace/lock file write that fails (ENOSPC or anything) never raises and never
   leaves a Future unresolved; blocks of a failed journal append are not published (dropped, counted,
   slots released), a ``delete`` keeps its index removal, the tier degrades and the journal is
   rewritten from the index once it can be; a pool opened on a full disk serves what it has and admits
   nothing until space returns.
6. Warm restart: the journal (:mod:`.journal`) is replayed at open and every entry's slot header is
   read and checked before it is served again; unverifiable entries are dropped and counted.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from ...config import G3Config
from ...io import fdatasync, make_engine
from ...memory import aligned_empty, is_aligned
from ...metrics import TierMetrics
from ...model import frame
from ...model.frame import ChecksumFrames, FrameError
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, Namespace, tenant_tag
from ...transfer import Extent, coalesce
from ..base import GetResult, PutResult, SlotLease, completed, is_tensor_batch
from ..deadlines import Deadlines
from . import journal as jr
from .admission import make_admission
from .compact_index import CompactLruIndex
from .index import TagKey
from .slabs import SlabSet
from .staging import shared_staging

log = logging.getLogger(__name__)

HDR = frame.HEADER_BYTES
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)
# FrameError.reason -> miss reason
_MISS_REASON = {"magic": "corrupt", "version": "corrupt", "header_check": "corrupt", "integrity": "corrupt",
                "length": "corrupt", "identity": "identity", "layout": "identity"}


def cut_at(bufs: list[np.ndarray], offset: int, io_size: int) -> list[np.ndarray]:
    """Split ``bufs`` (mapped to file bytes from ``offset``) at absolute file offsets that are multiples
    of ``io_size``, so :func:`coalesce` packs adjacent slots into ops of exactly ``io_size`` bytes."""
    out = []
    pos = offset
    for b in bufs:
        n = b.nbytes
        start = 0
        while start < n:
            take = min(n - start, (pos // io_size + 1) * io_size - pos)
            out.append(b[start:start + take] if (start or take != n) else b)
            start += take
            pos += take
    return out


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

    def __post_init__(self):
        self.ok = [False] * self.n


class G3Pool:
    """The G3 tier: a :class:`~kvbm_backend.pool.base.BlockPool` over slab files.

    Args:
        cfg: ``g3`` section of the config (paths, capacity_gb, files_per_path, io_size_bytes, engine,
            o_direct, io_threads, write_queue_blocks, min_free_fraction, fsync, admission, load_timeout_s).
        namespace: what the blocks mean; keys of another namespace are misses.
        engine: an I/O engine to use (not closed by the pool); default ``make_engine(cfg.engine,
            cfg.io_threads)`` (closed by :meth:`close`).
        registry: a prometheus ``CollectorRegistry`` for the metrics (default: the process registry).

    Raises:
        G3LockedError: a directory is held by another pool/process (G3 is private to one worker).
        G3PathError: a directory is another uid's or writable by group/others, or a G3 file name holds a
            symbolic link / directory / non-file (the message names the path and the fix).
        JournalPathError: the journal path is a directory, a symbolic link or another non-file.
        ValueError: no room for a single slot (capacity or free space).
        OSError: a directory cannot be created or written.
    """

    tier = "G3"
    degrade_s = 5.0  # seconds without admission after ENOSPC
    max_batch_bytes = 256 << 20  # queued offloads merged into one write batch
    # A put batch is written in pieces of ~chunk_bytes, chunks_in_flight at once (all batches); a get
    # in chunks of ~read_chunk_bytes (at most chunk_bytes), read_chunks_in_flight at once per get, each
    # verified on the verifier thread while the next ones are on the wire. Small pieces shorten the
    # unoverlapped head (first piece's checksums before any I/O) and tail (last piece's sync or
    # verification). Measured on the 2-core dev VM, 8192 x 32 KiB blocks, THP staging, medians of 4-5
    # interleaved rounds (GB/s of payload; O_DIRECT baseline ~2.0 write / ~3.1 read in the same runs):
    # write 64 MiB x 3: 1.99, 16 x 4: 1.97, 16 x 6: 2.07, 8 x 8: 1.90; read 64 x 3 verified on the
    # completion thread: 1.47, 16 x 4 on the completion thread: 1.90, 16 x 4 on the verifier: 2.06,
    # 16 x 8: 2.06, 32 x 4: 1.94, 8 x 12: 1.96. Large blocks want more than a few blocks per piece:
    # 256 x 2 MiB blocks, medians of 4 rounds, write / read GB/s: 64 MiB pieces x 3 / x 3: 3.01 / 3.16,
    # 16 MiB x 6 / x 4: 2.27 / 2.84, 32 MiB x 6 / x 4: 2.97 / 3.09, 64 MiB x 6 / x 4: 2.86 / 2.99; so a
    # piece holds at least min_chunk_blocks blocks (2 MiB blocks: ~64 MiB pieces, as before).
    chunk_bytes = 16 << 20
    min_chunk_blocks = 32
    chunks_in_flight = 6
    read_chunk_bytes = 16 << 20
    read_chunks_in_flight = 4
    staging_keep_pieces = 12  # free staging buffers kept for reuse, in pieces of chunk_bytes
    gather_below = 256 << 10  # blocks smaller than this (bytes) are staged, see __init__

    def __init__(self, cfg: G3Config, namespace: Namespace, *, engine=None, registry=None):
        self.cfg = cfg
        self.namespace = namespace
        self._layout = namespace.layout
        self.fp = namespace.fingerprint
        self.block_bytes = self._layout.bytes_per_block
        self.slot_bytes = frame.slot_bytes(self.block_bytes)
        self._stored_padded = frame.align_up(self.block_bytes)
        self._io_size = max(4096, cfg.io_size_bytes // 4096 * 4096)
        self._run = max(1, -(-self._io_size // self.slot_bytes))
        # small or unaligned blocks are gathered into one staged slot image per batch (a copy, but one
        # iovec per I/O); large aligned blocks go zero-copy from/to the caller's buffers
        self._gather = self.block_bytes < self.gather_below or self.block_bytes % frame.ALIGN != 0
        self._zero_pad = np.zeros(self._stored_padded - self.block_bytes, np.uint8)
        self._scratch_pad = np.zeros(self._stored_padded - self.block_bytes, np.uint8)
        self.metrics = TierMetrics("g3", registry)
        self._c: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending = 0
        self._writing = 0
        self._inflight: set[BlockKey] = set()
        self._cancelled: set[BlockKey] = set()
        self._reserved = 0
        self._degraded_until = 0.0
        self._closed = False
        self._stop_sync = False
        self._ready: list[_Piece] = []  # written pieces waiting for the syncer
        self._pieces_writing = 0
        self._err_gen: dict[int, int] = {}  # file index -> failed fdatasync count
        self._ttags: dict[str, bytes] = {}
        self._frames = ChecksumFrames(bytes.fromhex(self.fp), self._layout, namespace.tp_world_size)
        self._staging = shared_staging(self.staging_keep_pieces * self.chunk_bytes
                                       + (self.read_chunks_in_flight + 2) * self.read_chunk_bytes)
        self.index = CompactLruIndex()  # numpy arrays: ~60 bytes per block at 10M (bench --tier index)
        self.admission = make_admission(cfg.admission)
        self._own_engine = engine is None
        self.slabs = SlabSet(cfg.paths, namespace, self.slot_bytes, int(cfg.capacity_gb * 1e9), cfg.files_per_path,
                             cfg.o_direct, cfg.min_free_fraction)
        try:
            self.index.reserve(self.slabs.max_capacity_slots)  # the index's hash table never grows while open
            self.engine = engine if engine is not None else make_engine(cfg.engine, threads=cfg.io_threads)
            self._journal_dirty = False  # records were lost (failed append/rewrite): rewrite before appending
            self._journal_reason = "enospc"  # drop reason of the last journal failure
            self.journal = jr.Journal(self.slabs.paths[0], self.fp, dir_fd=self.slabs.dir_fd(self.slabs.paths[0]))
            self._restore()
            if self.slabs.metadata_errors:  # full disk at open (namespace / lock file): opened degraded
                self._journal_failed(OSError(errno.ENOSPC, "; ".join(self.slabs.metadata_errors)), dirty=False)
        except BaseException:
            self.slabs.close()
            raise
        self._sync_pool = ThreadPoolExecutor(max_workers=min(16, max(1, len(self.slabs.files))),
                                             thread_name_prefix="kvbm-g3-sync")
        # read chunks are verified here, not on the engine's completion thread, so the engine keeps
        # posting and reaping I/O while a chunk's headers/checksums are checked and copied out
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbm-g3-verify")
        self._deadlines = Deadlines("kvbm-g3-deadlines")
        self._device_readers: dict = {}  # str(device) -> DeviceLoader (device_reader)
        self._device_lock = threading.Lock()
        self._device_exec = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbm-g3-device")
        self._writer = threading.Thread(target=self._write_loop, name="kvbm-g3-writer", daemon=True)
        self._syncer = threading.Thread(target=self._sync_loop, name="kvbm-g3-syncer", daemon=True)
        self._writer.start()
        self._syncer.start()
        self._update_gauges()

    # ---- BlockPool -------------------------------------------------------------------------
    @property
    def layout(self) -> KvLayout:
        return self._layout

    def _check_keys(self, keys: Sequence[BlockKey], bufs: Sequence[np.ndarray] | None, what: str,
                    writable: bool = False) -> None:
        if bufs is not None and len(keys) != len(bufs):
            raise ValueError(f"{what}: {len(keys)} keys but {len(bufs)} buffers")
        if bufs is None:
            return
        for i, b in enumerate(bufs):
            if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 1 or not b.flags.c_contiguous:
                raise ValueError(f"{what}: buffer {i} must be a contiguous 1-D uint8 numpy array "
                                 f"(got {type(b).__name__} {getattr(b, 'dtype', '')} {getattr(b, 'shape', '')})")
            if b.nbytes != self.block_bytes:
                raise ValueError(f"{what}: buffer {i} holds {b.nbytes} bytes; this namespace's block is "
                                 f"{self.block_bytes} bytes")
            if writable and not b.flags.writeable:
                raise ValueError(f"{what}: buffer {i} is read-only")

    def contains(self, key: BlockKey) -> bool:
        """True if ``key`` is published in the index (no I/O; the payload is verified only by get)."""
        with self._lock:
            return key in self.index

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> Future:
        """Future of the number of leading ``keys`` held (index only). Found entries become most
        recently used."""
        with self._lock:
            n = self.index.lookup_prefix(keys, self.fp)  # vectorised: all keys probed at once
            self._c["lookup_blocks"] += len(keys)
            self._c["lookup_hits"] += n
        self.metrics.matched_tokens.inc(n * self._layout.page_size)
        self.metrics.hit_rate.record(len(keys), n)
        return completed(n)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray], *,
            dev_checks: Sequence[int] | None = None, bypass_admission: bool = False) -> Future:
        """Offload ``blocks[i]`` (``block_bytes`` uint8 each) under ``keys[i]``; returns Future[PutResult]
        at once. Keys already held or in flight and blocks the admission filter turns away are
        ``skipped``; blocks beyond the queue bound, while degraded, or without room are ``dropped``.
        The buffers are read until the Future completes.

        Args:
            dev_checks: optional :func:`~kvbm_backend.model.frame.device_checksum` of each block (the
                connector computes them on the GPU where the blocks were gathered): their frames then
                carry ``FLAG_DEVCHECK`` and device loads verify them in HBM without a host copy.
            bypass_admission: store without asking the admission filter (promotion of blocks just
                loaded from G4: a block asked for again is a repeat sighting by definition).

        Raises:
            ValueError: mismatched lengths, a wrong-sized buffer, or a key of another namespace.
        """
        keys = list(keys)
        blocks = list(blocks)
        self._check_keys(keys, blocks, "put")
        checks = None if dev_checks is None else [int(c) for c in dev_checks]
        if checks is not None and len(checks) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(checks)} dev_checks")
        for k in keys:
            if k.namespace != self.fp:
                raise ValueError(f"put: key namespace {k.namespace} is not this pool's namespace {self.fp}")
        res = PutResult()
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            now = time.monotonic()
            if self._degraded_until and now >= self._degraded_until:
                self._degraded_until = 0.0
                self.slabs.recheck_space()
                self.metrics.degraded.set(0)
            seen = set()
            ck, cb, cc = [], [], []
            for j, (k, b) in enumerate(zip(keys, blocks)):
                if k in seen or k in self.index or k in self._inflight:
                    res.skipped += 1
                    self._c["offloads_skipped_present"] += 1
                    continue
                seen.add(k)
                if not bypass_admission and not self.admission.admit(k):
                    res.skipped += 1
                    self._c["offloads_skipped_admission"] += 1
                    continue
                ck.append(k)
                cb.append(b)
                if checks is not None:
                    cc.append(checks[j])
            if self._closed:
                reason, room = "closed", 0
            elif self._degraded_until:
                reason, room = "degraded", 0
            else:
                reason, room = "queue_full", max(0, self.cfg.write_queue_blocks - self._pending)
            take_k, take_b = ck[:room], cb[:room]
            dropped = len(ck) - len(take_k)
            if dropped:
                res.dropped += dropped
                self._drop(reason, dropped)
            if take_k:
                self._pending += len(take_k)
                self._inflight.update(take_k)
                self._queue.append(_Job(take_k, take_b, fut, res, cc[:room] if checks is not None else None))
                self._cv.notify_all()
        if not take_k:
            fut.set_result(res)
        return fut

    def get(self, keys: Sequence[BlockKey], out: Sequence) -> Future:
        """Onboard ``keys[i]`` into ``out[i]``; Future[GetResult] at once. ``ok[i]`` is True only for a
        verified block. Absent, foreign, corrupt, short, mismatched, failed or late (past
        ``load_timeout_s``) blocks are misses; bad slots are dropped. After a timeout the read may still
        land in ``out`` (only bytes of the requested key's slot, which stays pinned until then).

        ``out`` is either 1-D uint8 numpy buffers (the host pipeline below) or torch tensors on one
        device (:meth:`device_reader`: slots leased, read straight into device staging, verified on the
        device, copied into ``out[i]`` only once verified; a late read never lands in ``out``).

        Raises:
            ValueError: mismatched lengths or a wrong-sized / read-only buffer (numpy); for tensors the
                future raises ValueError for a tensor of the wrong size, device or layout.
        """
        keys = list(keys)
        out = list(out)
        if is_tensor_batch(out):
            if len(keys) != len(out):
                raise ValueError(f"get: {len(keys)} keys but {len(out)} buffers")
            return self._get_tensors(keys, out)
        self._check_keys(keys, out, "get", writable=True)
        n = len(keys)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        # parallel lists, not a list per block: fewer GC-tracked objects per block (a full collection
        # of a large process stalls every thread; per-block lists made one likely on every big get)
        idx, pk, ps = [], [], []
        with self._lock:
            get, pin = self.index.get, self.index.pin
            for i, k in enumerate(keys):
                slot = get(k, touch=True) if k.namespace == self.fp else None
                if slot is None:
                    continue
                pin(slot)
                idx.append(i)
                pk.append(k)
                ps.append(slot)
            absent = n - len(ps)
            if absent:
                self._miss("absent", absent)
        if not ps:
            fut.set_result(GetResult(ok=[False] * n))
            return fut
        per = self._read_piece_slots
        chunks = [(idx[a:a + per], pk[a:a + per], ps[a:a + per]) for a in range(0, len(ps), per)]
        st = _Read(future=fut, n=n, slots=ps, left=len(chunks), out=out, todo=collections.deque(chunks))
        self._deadlines.add(time.monotonic() + self.cfg.load_timeout_s, lambda: self._read_timeout(st))
        for _ in range(min(max(1, self.read_chunks_in_flight), len(chunks))):
            self._read_submit_next(st)
        return fut

    def keys(self) -> list[BlockKey]:
        """Snapshot of the published keys (index only, no I/O)."""
        with self._lock:
            return [k for k, _ in self.index.items()]

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
        remove it from the index and journal (the slot is freed once its last lease is released)."""
        with self._lock:
            self._c["corrupt"] += 1
            self._c["corrupt:" + reason] += 1
            self._miss(_MISS_REASON.get(reason, "corrupt"))
        self.metrics.corrupt.labels(reason).inc()
        self.delete([key])

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
            try:
                ok = rd.load(keys, out, why)
            except (ValueError, TypeError):
                raise  # bad destination tensors or a wiring bug: the caller must see it
            except Exception as e:  # noqa: BLE001 - storage trouble: misses
                log.warning("G3: device load of %d blocks failed: %s", len(keys), e)
                ok, why = [False] * len(keys), ["io_error"] * len(keys)
            hits = sum(ok)
            with self._lock:
                self._c["hits"] += hits
                self._c["device_loads"] += len(keys)
                self._c["device_hits"] += hits
                # absent keys were counted by lease(), corrupt slots by drop_corrupt()
                for r in why:
                    if r in ("io_error", "short", "timeout", "unverifiable"):
                        self._miss(r)
            self.metrics.onboard_blocks.inc(hits)
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

    def delete(self, keys: Sequence[BlockKey]) -> Future:
        """Remove blocks (queued offloads of these keys are cancelled). Future of how many were held.
        Never raises for storage trouble: the index removal stands; a DEL record that cannot be
        journaled degrades the tier and the journal is rewritten from the index once it can be."""
        n = 0
        recs = []
        with self._lock:
            for k in keys:
                if k in self._inflight:
                    self._cancelled.add(k)
                slot = self.index.get(k)
                if slot is None:
                    continue
                n += 1
                free = self.index.remove(k)
                if free is not None:
                    self.slabs.release([free])
                recs.append(jr.encode(jr.DEL, k))
            self._journal_append(recs)
            self._c["deleted"] += n
        self._update_gauges()
        return completed(n)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued offload is written and published (or dropped).

        Raises:
            TimeoutError: still pending after ``timeout`` seconds.
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending or self._writing:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"G3 flush: {self._pending} offload blocks still pending after {timeout} s")
                self._cv.wait(left)

    def stats(self) -> dict:
        """Counters and gauges. Sizes in bytes; ``*_blocks``/counts in blocks."""
        with self._lock:
            c = dict(self._c)
            d = {
                "tier": self.tier,
                "namespace": self.fp,
                "paths": list(self.slabs.paths),
                "files": len(self.slabs.files),
                "o_direct": dict(self.slabs.o_direct),
                "engine": getattr(self.engine, "name", type(self.engine).__name__),
                "block_bytes": self.block_bytes,
                "slot_bytes": self.slot_bytes,
                "io_size_bytes": self._io_size,
                "blocks": len(self.index),
                "used_bytes": len(self.index) * self.slot_bytes,
                "capacity_blocks": self.slabs.capacity_slots,
                "capacity_bytes": self.slabs.capacity_slots * self.slot_bytes,
                "configured_capacity_blocks": self.slabs.max_capacity_slots,
                "free_slots": self.slabs.free_slots(),
                "reserved_slots": self._reserved,
                "pinned_slots": self.index.pinned,
                "deferred_free_slots": self.index.deferred,
                "pending_blocks": self._pending,
                "degraded": bool(self._degraded_until),
                "admission": self.admission.policy,
                "foreign_files": list(self.slabs.foreign_files),
                "journal_records": self.journal.records,
            }
        for name in ("offloads_written", "offloads_skipped_present", "offloads_skipped_admission", "offloads_dropped",
                     "hits", "misses", "corrupt", "evictions", "bytes_written", "bytes_read", "enospc", "write_errors",
                     "restored_blocks", "restore_dropped", "lookup_blocks", "lookup_hits", "deleted", "late_reads",
                     "device_loads", "device_hits"):
            d[name] = c.get(name, 0)
        d["dropped_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("dropped:")}
        d["misses_by_reason"] = {k[5:]: v for k, v in c.items() if k.startswith("miss:")}
        d["corrupt_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("corrupt:")}
        d["restore_dropped_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("restore:")}
        d["hit_rate"] = d["lookup_hits"] / d["lookup_blocks"] if d["lookup_blocks"] else 0.0
        d["device_paths"] = {dev: {"mode": rd.mode, "reason": rd.mode_reason}
                             for dev, rd in list(self._device_readers.items())}
        return d

    def slot_accounting(self) -> dict:
        """Every slot below each file's cap is exactly one of: published, pinned-deferred, reserved,
        free. ``leaked`` must be 0 (tests assert it)."""
        with self._lock:
            cap = self.slabs.capacity_slots
            free = self.slabs.free_slots()
            used = sum(1 for _, (fi, si) in self.index.items() if si < self.slabs.by_index[fi].cap_slots)
            return {"capacity": cap, "used": used, "free": free, "reserved": self._reserved,
                    "deferred": self.index.deferred,
                    "leaked": cap - used - free - self._reserved - self.index.deferred}

    def close(self) -> None:
        """Write what is queued (bounded by ~``load_timeout_s`` + 10 s, the rest is dropped), then
        release files, the directory locks and threads. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout=self.cfg.load_timeout_s + 10)
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:  # writer did not get to them in time
            self._finish_job_dropped(job, "closed")
        end = time.monotonic() + self.cfg.load_timeout_s + 10
        with self._cv:  # pieces still being written or synced settle first
            while self._writing and time.monotonic() < end:
                self._cv.wait(max(0.0, end - time.monotonic()))
            self._stop_sync = True
            self._cv.notify_all()
        self._syncer.join(timeout=max(0.0, end - time.monotonic()) + 1)
        self._deadlines.close()
        self._device_exec.shutdown(wait=True)
        with self._device_lock:
            for rd in list(self._device_readers.values()):
                rd.close()
            self._device_readers.clear()
        self._sync_pool.shutdown(wait=True)
        if self._own_engine:
            self.engine.close()
        self._verifier.shutdown(wait=True)  # after the engine: its last callbacks may still queue here
        with self._lock:
            if self._journal_dirty:  # last chance to persist removals a failed append lost
                try:
                    self.journal.rewrite(self.index.items())
                    self._journal_dirty = False
                except OSError as e:
                    log.warning("G3: journal %s could not be repaired at close (%s); a restart may find "
                                "deleted blocks again (each is re-verified before use)", self.journal.path, e)
            self.journal.close()
            self.slabs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals: counting ------------------------------------------------------------------
    def _drop(self, reason: str, n: int) -> None:
        self._c["offloads_dropped"] += n
        self._c["dropped:" + reason] += n
        self.metrics.offloads_dropped.labels(reason).inc(n)

    def _miss(self, reason: str, n: int = 1) -> None:
        self._c["misses"] += n
        self._c["miss:" + reason] += n
        self.metrics.misses.labels(reason).inc(n)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.blocks.set(len(self.index))
        m.used_bytes.set(len(self.index) * self.slot_bytes)
        m.capacity_bytes.set(self.slabs.capacity_slots * self.slot_bytes)

    def _journal_append(self, recs: list[bytes]) -> bool:
        """Journal ``recs`` (the caller holds the lock). Never raises: a failed append or rewrite (ENOSPC,
        EIO, anything) goes to :meth:`_journal_failed` (tier degraded, journal marked for repair) and
        False is returned (``recs`` not journaled). A journal marked for repair (or one that could not be
        opened) is first rewritten from the index, with any namespace file still unwritten: records lost
        earlier (DELs) are repaired there."""
        if not recs:
            return True
        try:
            if self._journal_dirty or self.journal.broken or self.journal.fd is None:
                self.slabs.write_pending_namespaces()
                self.journal.rewrite(self.index.items())
                self._journal_dirty = False
                log.warning("G3: journal %s rewritten from the index (repaired)", self.journal.path)
            self.journal.append(recs)
        except Exception as e:  # noqa: BLE001 - storage trouble (or a bug) must not hang callers
            self._journal_failed(e)
            return False
        if self.journal.records > max(65536, 4 * len(self.index)):
            try:
                self.journal.rewrite(self.index.items())
            except Exception as e:  # noqa: BLE001 - compaction failed: the appended journal stays valid
                self._journal_failed(e, dirty=False)
        return True

    def _journal_failed(self, e: BaseException, dirty: bool = True) -> None:
        """The metadata path failed (caller holds the lock): degrade like slab ENOSPC (no admission for
        :attr:`degrade_s`, then statvfs is re-read) and, when ``dirty``, rewrite the journal before the
        next append."""
        nospace = getattr(e, "errno", None) in _NOSPACE
        self._journal_reason = "enospc" if nospace else "journal_error"
        self._journal_dirty = self._journal_dirty or dirty
        self._c["journal_errors"] += 1
        self._c["enospc" if nospace else "write_errors"] += 1
        first = not self._degraded_until
        self._degraded_until = time.monotonic() + self.degrade_s
        self.metrics.degraded.set(1)
        if first or not isinstance(e, OSError):
            log.warning("G3: journal %s: %s; tier degraded for %.1f s (no admission), the journal is rewritten "
                        "once it can be", self.journal.path, e, self.degrade_s, exc_info=not isinstance(e, OSError))

    # ---- internals: restore -------------------------------------------------------------------
    def _restore(self) -> None:
        entries, info = self.journal.load()
        if info["bad_header"]:
            log.warning("G3: journal %s is not this namespace's; ignored", self.journal.path)
        if info["torn_bytes"]:
            log.warning("G3: journal %s: %d torn bytes at the tail ignored", self.journal.path, info["torn_bytes"])
        if info["version"] == 1:
            log.info("G3: journal %s is format version 1 (tenant ids in clear); rewritten as version 2",
                     self.journal.path)
        cand = []
        for key, (fi, si) in entries.items():
            f = self.slabs.by_index.get(fi)
            if f is None or si >= f.max_slots:
                self._c["restore:capacity"] += 1
            elif (si + 1) * self.slot_bytes > f.size_slots * self.slot_bytes:
                self._c["restore:short"] += 1
            else:
                cand.append((key, (fi, si)))
        good = []
        chunk = 4096
        for c0 in range(0, len(cand), chunk):
            part = cand[c0:c0 + chunk]
            hdrs = aligned_empty(len(part) * HDR)
            exts = [Extent(self.slabs.by_index[fi].fd, si * self.slot_bytes, [hdrs[j * HDR:(j + 1) * HDR]])
                    for j, (_, (fi, si)) in enumerate(part)]
            try:
                self.engine.submit(coalesce(exts, self._io_size, write=False)).result()
            except OSError as e:
                log.warning("G3 restore: header reads failed (%s); %d entries dropped", e, len(part))
                self._c["restore:io_error"] += len(part)
                continue
            for j, (key, slot) in enumerate(part):
                try:
                    h = frame.accept(hdrs[j * HDR:(j + 1) * HDR], key, self._layout,
                                     key.tag if type(key) is TagKey else tenant_tag(key.tenant),
                                     world=self.namespace.tp_world_size, stored_len=self.block_bytes)
                    if not h.flags & frame.FLAG_CHECKSUM:
                        raise FrameError("length", "frame carries no checksum")
                except FrameError as e:
                    self._c["restore:" + e.reason] += 1
                    continue
                good.append((key, slot))
        used: dict[int, set[int]] = collections.defaultdict(set)
        self.index.restore_many(good)  # one vectorised build, oldest first
        for key, slot in good:
            used[slot[0]].add(slot[1])
        self.slabs.restore(used)
        self._c["restored_blocks"] = len(good)
        self._c["restore_dropped"] = len(entries) - len(good)
        try:
            self.journal.rewrite(self.index.items())
        except OSError as e:  # full disk at open: serve what is here, admit nothing until it can be written
            self._journal_failed(e)

    # ---- internals: write path ----------------------------------------------------------------
    # Pipeline (invariant 2 kept per piece): the writer thread takes queued offloads as a batch,
    # reserves slots, cuts the batch into pieces of ~chunk_bytes and submits them, at most
    # ``chunks_in_flight`` being written at once across batches. A written piece goes to the syncer
    # thread, which fdatasyncs every file the ready pieces touched (one call per file per round: group
    # commit) and only then publishes those pieces. So the next pieces' writes are in flight while
    # earlier pieces' fdatasync runs. Syncs of one file never overlap (one round at a time): a failed
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
                self._ready.extend(pieces)
                self._cv.notify_all()
            return
        for pc in pieces:
            with self._cv:
                while self._pieces_writing >= self.chunks_in_flight:
                    self._cv.wait()
                if batch.failed is not None:  # an earlier piece failed: the rest is dropped unwritten
                    pc.error = batch.failed
                    self._ready.append(pc)
                    self._cv.notify_all()
                    continue
                self._pieces_writing += 1
                pc.files = tuple(sorted({fi for fi, _ in pc.slots}))
                pc.gens = tuple(self._err_gen.get(fi, 0) for fi in pc.files)
            try:
                ef = self.engine.submit(coalesce(self._write_extents(pc), self._io_size, write=True))
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
            self._ready.append(pc)
            self._cv.notify_all()

    def _sync_loop(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._stop_sync:
                    self._cv.wait()
                if not self._ready:
                    return
                ready, self._ready = self._ready, []
            errs: dict[int, BaseException] = {}
            try:
                if self.cfg.fsync:
                    files = sorted({fi for pc in ready if pc.error is None for fi in pc.files})
                    if files:
                        errs = self._sync_files(files)
            except Exception as e:  # noqa: BLE001 - never publish what was not synced
                log.exception("G3 syncer: fdatasync round failed")
                errs = {fi: e for pc in ready for fi in pc.files}
            try:
                self._settle(ready, errs)
            except Exception:  # noqa: BLE001 - a bug must not kill the syncer (futures would hang)
                log.exception("G3 syncer: settling pieces failed")

    def _sync_files(self, files: list[int]) -> dict[int, BaseException]:
        """fdatasync each slab file (in parallel when several); returns {file index: error}."""
        errs: dict[int, BaseException] = {}
        if len(files) == 1:
            try:
                fdatasync(self.slabs.by_index[files[0]].fd)
            except OSError as e:
                errs[files[0]] = e
        else:
            futs = [(fi, self._sync_pool.submit(fdatasync, self.slabs.by_index[fi].fd)) for fi in files]
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

    def _tag(self, tenant: str) -> bytes:
        t = self._ttags.get(tenant)
        if t is None:
            if len(self._ttags) > 4096:
                self._ttags.clear()
            t = self._ttags[tenant] = tenant_tag(tenant)
        return t

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
            return self._run_extents(pc.slots, stage[:m * sb])
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
                st = aligned_empty(self._stored_padded)
                st[:bb] = block
                st[bb:] = 0
                bufs = [hv, st]
            else:
                bufs = [hv, block] + ([self._zero_pad] if self._zero_pad.nbytes else [])
            off = si * sb
            extents.append(Extent(f.fd, off, cut_at(bufs, off, self._io_size)))
        return extents

    @property
    def _piece_slots(self) -> int:
        return max(1, self.min_chunk_blocks, self.chunk_bytes // self.slot_bytes)

    @property
    def _read_piece_slots(self) -> int:
        return max(1, self.min_chunk_blocks, min(self.chunk_bytes, self.read_chunk_bytes) // self.slot_bytes)

    def _read_extents(self, ch: tuple, out: list, stages: list) -> tuple[list, tuple | None]:
        """Extents reading the chunk's slots (``ch`` = (indexes, keys, slots)) and, for unstaged
        (large) blocks, ``(header views, payload views, staged flags, destinations)``. Staging buffers
        taken from :attr:`_staging` go to ``stages``."""
        sb, bb = self.slot_bytes, self.block_bytes
        if self._gather:
            stage = self._staging.take(self._read_piece_slots * sb)
            stages.append(stage)
            return self._run_extents(ch[2], stage[:len(ch[2]) * sb]), None
        hdrs = self._staging.take(self._read_piece_slots * HDR)
        stages.append(hdrs)
        mv = memoryview(hdrs)
        extents = []
        files = self.slabs.by_index
        hv, pv, staged, dsts = [], [], [], []
        for j, (i, (fi, si)) in enumerate(zip(ch[0], ch[2])):
            f = files[fi]
            h = hdrs[j * HDR:(j + 1) * HDR]
            dst = out[i]
            hv.append(mv[j * HDR:(j + 1) * HDR])
            dsts.append(dst)
            if f.o_direct and not is_aligned(dst):
                staging = aligned_empty(self._stored_padded)
                bufs = [h, staging]
                pv.append(staging[:bb])
                staged.append(True)
            else:
                bufs = [h, dst] + ([self._scratch_pad] if self._scratch_pad.nbytes else [])
                pv.append(dst)
                staged.append(False)
            off = si * sb
            extents.append(Extent(f.fd, off, cut_at(bufs, off, self._io_size)))
        return extents, (hv, pv, staged, dsts)

    def _run_extents(self, slots: list, stage: np.ndarray) -> list:
        """Extents for slots staged in order in ``stage`` (slot j at ``j * slot_bytes``): runs of
        adjacent slots of one file become one buffer, cut at ``io_size`` file boundaries."""
        sb = self.slot_bytes
        out = []
        j0 = 0
        n = len(slots)
        for j in range(1, n + 1):
            if j < n and slots[j][0] == slots[j - 1][0] and slots[j][1] == slots[j - 1][1] + 1:
                continue
            fi, si = slots[j0]
            off = si * sb
            out.append(Extent(self.slabs.by_index[fi].fd, off, cut_at([stage[j0 * sb:j * sb]], off, self._io_size)))
            j0 = j
        return out

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
        extra = None
        try:
            exts, extra = self._read_extents(ch, st.out, stages)
            ef = self.engine.submit(coalesce(exts, self._io_size, write=False))
        except Exception as e:  # noqa: BLE001 - engine refused: the chunk's blocks are misses
            ef = Future()
            ef.set_exception(e)
        ef.add_done_callback(lambda f: self._read_chunk_done(st, ch, extra, f, stages))

    def _read_chunk_done(self, st: _Read, ch: tuple, extra, ef: Future, stages: list) -> None:
        """Engine callback (the engine's completion thread): submit the read's next chunk at once, then
        hand this chunk to the verifier thread, so I/O is never waiting on verification."""
        self._read_submit_next(st)
        exc = ef.exception()
        try:
            self._verifier.submit(self._read_verify, st, ch, extra, exc, stages)
        except RuntimeError:  # verifier shut down (pool closing): verify here
            self._read_verify(st, ch, extra, exc, stages)

    def _read_verify(self, st: _Read, ch: tuple, extra, exc: BaseException | None, stages: list) -> None:
        """Verify one chunk's blocks where they landed (headers and checksums checked for the whole
        chunk at once), copy staged ones out; the last chunk finishes the read."""
        bad: list = []  # (key, slot, reason)
        bad_detail: list = []  # FrameError reasons
        try:
            self._verify_chunk(st, ch, extra, exc, stages, bad, bad_detail)
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

    def _verify_chunk(self, st: _Read, ch: tuple, extra, exc, stages: list, bad: list, bad_detail: list) -> None:
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
        if extra is None:  # staged: slot j at j * slot_bytes of the staging buffer
            stage = stages[0]
            hdrs = stage[:m * sb].reshape(m, sb)
            mv = memoryview(stage)
            payloads = [mv[o:o + bb] for o in range(HDR, m * sb, sb)]
            hviews, staged, dsts = None, None, [st.out[i] for i in idx]
        else:
            hdrs = stages[0][:m * HDR].reshape(m, HDR)
            hviews, payloads, staged, dsts = extra
        good = self._frames.verify_many(hdrs, payloads, [tag(k.tenant) for k in keys], [k.rank for k in keys],
                                        [k.seq_hash for k in keys])
        if all_there and good.all():
            if not st.resolved:
                if staged is None:
                    for d, pl in zip(dsts, payloads):
                        d[:] = pl
                else:
                    for d, pl, sflag in zip(dsts, payloads, staged):
                        if sflag:
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
                    hdr = frame.accept(hdrs[j] if hviews is None else hviews[j], k, self._layout,
                                       tenant_tag(k.tenant), world=self.namespace.tp_world_size,
                                       stored_len=self.block_bytes)
                    if not hdr.flags & frame.FLAG_CHECKSUM:
                        raise FrameError("integrity", "frame carries no checksum")
                    frame.verify_payload(hdr, payload)
                except FrameError as e:
                    reason = _MISS_REASON.get(e.reason, "corrupt")
                    bad_detail.append(e.reason)
            if reason is None:
                ok[i] = True
                if not st.resolved and (staged is None or staged[j]):
                    dsts[j][:] = payload
            else:
                bad.append((k, slot, reason))

    def _read_finish(self, st: _Read) -> None:
        ok, bad, bad_detail = st.ok, st.bad, st.bad_detail
        with st.lock:
            late = st.resolved
            st.resolved = True
        hits = sum(ok)
        with self._lock:
            recs = []
            for slot in st.slots:
                free = self.index.unpin(slot)
                if free is not None:
                    self.slabs.release([free])
            for k, slot, reason in bad:
                if reason in ("corrupt", "identity", "short", "io_error"):
                    free = self.index.remove(k, slot)
                    if free is not None:
                        self.slabs.release([free])
                    recs.append(jr.encode(jr.DEL, k))
                    self._c["corrupt"] += reason != "io_error"
            for r in bad_detail:
                self._c["corrupt:" + r] += 1
                self.metrics.corrupt.labels(r).inc()
            self._journal_append(recs)
            self._c["bytes_read"] += len(st.slots) * self.slot_bytes
            if late:
                self._c["late_reads"] += len(st.slots)
            else:
                self._c["hits"] += hits
            if not late:
                for _, _, reason in bad:
                    self._miss(reason)
            self._update_gauges()
        self.metrics.bytes_read.inc(len(st.slots) * self.slot_bytes)
        if not late:
            self.metrics.onboard_blocks.inc(hits)
            st.future.set_result(GetResult(ok=ok))
        if bad:
            log.warning("G3: %d block(s) failed verification and were dropped: %s", len(bad),
                        collections.Counter(r for _, _, r in bad))
