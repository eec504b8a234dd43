"""G3Pool: KV blocks in fixed slots of slab files on local/pooled SSD or a mounted filesystem.

Data flow (DESIGN.md): pool -> :mod:`kvbm_backend.transfer` (extents coalesced into ~``io_size_bytes``
ops) -> :mod:`kvbm_backend.io` engine (positioned scatter/gather I/O) -> slab files.

Invariants kept here (each has tests in ``tests/pool/test_g3_*.py``):

1. Never wrong KV: a get is a hit only after the slot's header names exactly the requested key in
   this namespace's layout and the payload's xxh3_128 verifies in the caller's buffer. Anything else
   (corrupt, short, identity, io_error, timeout) is a miss, counted by reason; bad slots are dropped.
   A get is read in chunks; each chunk is checked as a whole (:meth:`ChecksumFrames.verify_many`,
   the same acceptance as the per-block check) on the pool's verifier thread, never on the I/O
   engine's completion thread, and staged blocks are copied to the caller only after they verified.
2. Publish after durable: the index entry and the journal record appear only after the slot's bytes
   were written and ``fdatasync``'ed (``g3.fsync``). The writer is pipelined (see "write path"
   below): a batch goes out in pieces, and a piece is published after an fdatasync of its files that
   started after its writes finished, while later pieces are already being written. Group commit: a
   written piece waits for pieces still in flight (no longer than the last barrier took, at most
   ``g3.group_commit_ms``, until ``g3.group_commit_bytes`` wait), so one barrier (fdatasync per file +
   one journal append) covers them all.
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

Parts, by job: :class:`G3Pool` is the public API, construction and shutdown. Reads go to one part,
:class:`~kvbm_backend.pool.g3.read.G3Reader` (:mod:`.read`: lease -> plan -> read -> verify -> deliver, for
numpy buffers, device tensors and layer-wise loads; invariant 1), which reaches slot state only through
the slot catalog below. Still mixed into the class: :mod:`.writer` the write pipeline and syncer
(invariant 2); :mod:`.restore` warm restart (invariant 6); :mod:`.slots` the slot catalog (index + slabs +
journal changed under the pool lock, and the counters). Slot I/O planning (slot runs -> coalesced,
aligned ops) is :mod:`kvbm_backend.transfer.slots`.
"""
from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ...config import G3Config
from ...io import fdatasync, make_engine
from ...metrics import TierMetrics
from ...model import frame
from ...model.frame import ChecksumFrames
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, Namespace
from ..base import PutResult, SlotLease, completed
from ...deadlines import Deadline
from . import journal as jr
from .admission import make_admission
from .compact_index import CompactLruIndex
from .read import G3Reader
from .restore import RestoreMixin
from .slabs import SlabSet
from .slots import SlotsMixin
from .staging import shared_staging
from .writer import WriterMixin, _Job, _Piece

log = logging.getLogger(__name__)

__all__ = ["G3Pool"]


class G3Pool(WriterMixin, RestoreMixin, SlotsMixin):
    """The G3 tier: a :class:`~kvbm_backend.pool.base.BlockPool` over slab files.

    Args:
        cfg: ``g3`` section of the config (paths, capacity_gb, files_per_path, io_size_bytes, engine,
            o_direct, io_threads, write_queue_blocks, min_free_fraction, fsync, group_commit_ms,
            group_commit_bytes, admission, load_timeout_s).
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
    gather_below = 256 << 10  # writes of blocks smaller than this (bytes) are staged, see __init__ (reads always are)

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
        # writes: small or unaligned blocks are gathered into one staged slot image per batch (a copy, but
        # one iovec per I/O); large aligned blocks go zero-copy from the caller's buffers. Reads are always
        # staged and copied out once verified (a miss must leave the caller's buffer untouched)
        self._gather = self.block_bytes < self.gather_below or self.block_bytes % frame.ALIGN != 0
        self._zero_pad = np.zeros(self._stored_padded - self.block_bytes, np.uint8)
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
        self._last_barrier_s = 0.0  # seconds the last group's fdatasyncs took (bounds the next group's wait)
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
        self.reader = G3Reader(self)  # the one read path: host gets, device gets, slot leases
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
        recently used. ``keys``: BlockKeys, or a :class:`~kvbm_backend.model.namespace.KeyRun` (the
        compact index probes its uint64 array, no per-key object)."""
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
        ``load_timeout_s``) blocks are misses. A slot is dropped only when its stored bytes are proven
        bad (re-read and checked against what the index says the slot holds): a read error, a timeout
        or a key the caller named wrongly (e.g. a seq_hash outside [0, 2**64): ``invalid_key``) is a
        miss that leaves the slot in place. A key named twice is read once and its later copies are
        filled from the first (both hits, or both misses). Keys :meth:`keys` returned (restored
        :class:`~.index.TagKey` s included) read like any other. After a timeout the read may still
        land in ``out`` (only bytes of the requested key's slot, which stays pinned until then).

        ``out`` is either 1-D uint8 numpy buffers (the host pipeline below) or torch tensors on one
        device (:meth:`device_reader`: slots leased, read straight into device staging, verified on the
        device, copied into ``out[i]`` only once verified; a late read never lands in ``out``).

        Raises:
            ValueError: mismatched lengths or a wrong-sized / read-only buffer (numpy); for tensors the
                future raises ValueError for a tensor of the wrong size, device or layout.
        """
        return self.reader.get(list(keys), list(out))

    # ---- SlotLeaseSource: in-place reads by the device and layer-wise loaders (pool/g3/read) -------
    def lease(self, keys: Sequence[BlockKey]) -> list[SlotLease | None]:
        """Pin the slots of ``keys`` for a reader outside the host pipeline (the device and layer-wise
        loaders read frames straight into their staging); None for absent or foreign keys (counted as
        ``absent`` misses). Every lease must go back through :meth:`release`; until then the slot is not
        evicted or reused. The reader verifies header and payload itself (the frame is not trusted)."""
        return self.reader.lease(keys)

    def release(self, leases: Sequence[SlotLease]) -> None:
        """Unpin leases from :meth:`lease` (a slot evicted meanwhile is freed now)."""
        self.reader.release(leases)

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        """A reader outside the host pipeline found ``key``'s slot bad (``reason``, a FrameError reason):
        remove it from the index and journal (the slot is freed once its last lease is released) once
        the stored bytes are proven bad (re-read and checked): a slot whose frame re-reads and verifies,
        or cannot be read, stays (a miss)."""
        self.reader.drop_corrupt(key, reason)

    def device_reader(self, device):
        """The pool's :class:`~kvbm_backend.pool.g3.read.device.DeviceLoader` for ``device`` (created on
        first use: the device path is probed in this pool's first directory and logged once;
        ``g3.device_path`` forces a mode). ``get(keys, tensors)`` uses it; callers may call this at
        start-up so the probe and its log line happen before the first request.

        Raises:
            RuntimeError: the pool is closed. ImportError: torch is not installed.
        """
        return self.reader.device_reader(device)

    def keys(self) -> list[BlockKey]:
        """Snapshot of the published keys (index only, no I/O)."""
        with self._lock:
            return [k for k, _ in self.index.items()]

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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued offload is written and published (or dropped). Returns False when
        offloads are still pending after ``timeout`` seconds (the BlockPool contract: never raises)."""
        end = Deadline(timeout)
        with self._cv:
            while self._pending or self._writing:
                if end.expired():
                    return False
                self._cv.wait(end.left())
        return True

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
        end = Deadline(self.cfg.load_timeout_s + 10)
        with self._cv:  # pieces still being written or synced settle first
            while self._writing and not end.expired():
                self._cv.wait(end.left())
            self._stop_sync = True
            self._cv.notify_all()
        self._syncer.join(timeout=end.left() + 1)
        self.reader.close_device()
        self._sync_pool.shutdown(wait=True)
        if self._own_engine:
            self.engine.close()
        self.reader.close_verifier()  # after the engine: its last callbacks may still queue there
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

    @staticmethod
    def _fdatasync(fd: int) -> None:
        """``fdatasync(fd)`` through this module's global name (the writer's one durability call; tests
        wrap ``kvbm_backend.pool.g3.pool.fdatasync`` to order or fail syncs). Raises OSError."""
        fdatasync(fd)

