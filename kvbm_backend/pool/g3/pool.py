"""G3Pool: KV blocks in fixed slots of slab files on local/pooled SSD or a mounted filesystem.

Data flow (DESIGN.md): pool -> :mod:`kvbm_backend.transfer` (extents coalesced into ~``io_size_bytes``
ops) -> :mod:`kvbm_backend.io` engine (positioned scatter/gather I/O) -> slab files.

Invariants kept here (each has tests in ``tests/pool/g3/test_g3_*.py``):

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
3. Never stall: ``put``/``get``/``lookup_prefix``/``delete`` return Futures (a ``get`` within
   ``g3.load_timeout_s``: the catalog lock, held by other threads across journal I/O, is waited for that long
   at most); offloads wait in a bounded write-behind queue (``g3.write_queue_blocks``) and overflow is dropped
   and counted; loads past ``g3.load_timeout_s`` are misses. What vLLM's scheduler thread asks (``lookup_prefix``,
   ``removed_since``, ``holds``/``contains``, ``stats``) never waits for a busy lock long (:mod:`.lock_bounded`).
4. Capacity is real: slots never exceed ``g3.capacity_gb`` nor the filesystem's free space above
   ``g3.min_free_fraction`` (checked at open and before every file growth); ENOSPC/EDQUOT releases every
   reservation of the batch and degrades the tier (no admission for :attr:`G3Pool.degrade_s` seconds,
   then statvfs is re-read) instead of raising. The metadata path fails the same way: a journal
   append/rewrite or namespace/lock file write that fails (ENOSPC or anything) never raises and never
   leaves a Future unresolved; blocks of a failed journal append are not published (dropped, counted,
   slots released), a ``delete`` keeps its index removal, the tier degrades and the journal is
   rewritten from the index once it can be; a pool opened on a full disk serves what it has and admits
   nothing until space returns.
6. Warm restart: the journal (:mod:`.journal`), found in whichever directory of ``g3.paths`` holds it
   (:mod:`.journal_home`: the order of the list may change), is replayed at open and every entry's slot
   header is read and checked before it is served again; unverifiable entries are dropped and counted.

Parts, by job (each owns its state; the pool is a thin facade that builds them, delegates and composes
``stats``): :class:`~.catalog.SlotCatalog` the only owner of slot state (index + slabs + journal changed
under its one lock, the degraded state, the counters); :class:`~.writer.G3Writer` the write pipeline and
syncer (invariant 2; :mod:`.pieces` the frames a piece writes); :class:`~kvbm_backend.pool.g3.read.G3Reader`
the one read path (:mod:`.read`: lease -> plan -> read -> verify -> deliver, for numpy buffers, device
tensors and layer-wise loads; invariant 1); :func:`.restore.restore` warm restart (invariant 6). Slot I/O
planning (slot runs -> coalesced, aligned ops) is :mod:`kvbm_backend.transfer.slots`.
"""
from __future__ import annotations

import errno
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, Sequence, cast

from ...config import G3Config
from ...io import IoEngine, fdatasync, make_engine
from ...log_limits import forget as forget_logged
from ...metrics import TierMetrics
from ...model.frame import ChecksumFrames
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, Namespace
from ..base import BlockBuffer, GetDestinations, GetResult, PutResult, SlotLease, completed
from . import journal as jr, vacancy
from .admission import make_admission
from .catalog import REASONS, SlotCatalog
from .entry import check_buffers, int_keys, lookup_keys
from .lock_bounded import LOCK_WAIT_S, PUT_LOCK_WAIT_S, StatsCache, held_within, holds, pool_stats
from .lookup_defer import G3Lookups
from .read import G3Reader
from .read.device import DeviceLoader
from .read.layerwise import LayerwiseLoad
from .restore import restore
from .staging import shared_staging
from .writer import Admission, G3Writer
from ...threads import executor, start_thread

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry
    from .compact_index import CompactLruIndex
    from .journal import Journal
    from .slabs import SlabSet

log = logging.getLogger(__name__)

__all__ = ["G3Pool"]


class G3Pool:
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
        JournalPathError: the journal path in one of the directories is a directory, a symbolic link or another
            non-file.
        ValueError: no room for a single slot (capacity or free space).
        OSError: a directory cannot be created or written.

    Keys: every call takes a key's ``rank`` and ``seq_hash`` as any integral type (a numpy integer too: made ints at
    its entry, :mod:`.entry`, before any effect); one no slot can hold (out of range, not an integer) is a miss, not
    held, or an ``invalid_key`` drop of that key alone; an item that is no key, or a key whose tenant is not a str,
    raises TypeError before any effect.

    In a child forked without exec from the process that opened it every call raises G3ForkedError (:mod:`.forked`).
    """

    tier = "G3"
    degrade_s = 5.0  # seconds without admission after ENOSPC
    put_lock_wait_s = PUT_LOCK_WAIT_S  # a put's wait for the lock on its caller's thread, then handed off
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

    def __init__(self, cfg: G3Config, namespace: Namespace, *, engine: IoEngine | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.namespace = namespace
        self.fp = namespace.fingerprint
        self.metrics = TierMetrics("g3", registry, reasons=REASONS)
        self._io_size = cfg.io_size_bytes  # a positive multiple of 4096: G3Config validates it
        self._frames = ChecksumFrames(bytes.fromhex(self.fp), namespace.layout, namespace.tp_world_size)
        self._staging = shared_staging(self.staging_keep_pieces * self.chunk_bytes
                                       + (self.read_chunks_in_flight + 2) * self.read_chunk_bytes)
        # the parts: the slot catalog (the only owner of slot state), the writer, the reader
        self.cat = SlotCatalog(cfg, namespace, self.metrics, lambda: self.degrade_s)
        self._log_subjects = (self.cat.journal.path, *(f.path for f in self.cat.slabs.files))  # its WARNINGs' kinds
        forget_logged(*self._log_subjects)  # name these: their budgets are this pool's alone (a closed one's: not)
        self._lookups = G3Lookups(self.cat, self.fp, self._count_metrics)
        self.block_bytes, self.slot_bytes = self.cat.block_bytes, self.cat.slot_bytes
        self._own_engine = engine is None
        try:
            self.engine = engine if engine is not None else make_engine(cfg.engine, threads=cfg.io_threads)
            restore(self.cat, cfg.io_threads)
            if self.cat.slabs.metadata_errors:  # full disk at open (namespace / lock file): opened degraded
                with self.cat.lock:
                    self.cat.journal_failed(OSError(errno.ENOSPC, "; ".join(self.cat.slabs.metadata_errors)),
                                            dirty=False)
        except BaseException:
            self.cat.journal.shut_down()
            self.cat.slabs.close()
            raise
        self.writer = G3Writer(self.cat, cfg, self.engine, self._frames, self._staging, self._io_size,
                               make_admission(cfg.admission), type(self))
        self.reader = G3Reader(self.cat, self)  # the one read path: host gets, device gets, slot leases
        # a degraded window ends when it is due, not at the next put: the degraded gauge and stats() of an idle
        # tier went back to 0 only once something was offloaded again (found in review, 2026-11-29)
        self.cat.on_degrade = lambda until: self.reader.deadlines.add(until, self._degraded_due)
        if self.cat.degraded_until:  # opened degraded (a full disk at open)
            self.cat.on_degrade(self.cat.degraded_until)
        self.cat.update_gauges()
        self._stats = StatsCache()
        self.stats()  # the snapshot stats() answers from while the lock stays busy
        self._drop_mu = threading.Lock()
        self._drops: ThreadPoolExecutor | None = None  # drop_unreadable's thread, made on first use

    # ---- the parts' state, as the pool's (tests, the connector, the tiering tier read these) -------------
    @property
    def index(self) -> CompactLruIndex:
        """The slot catalog's index (:class:`~.compact_index.CompactLruIndex`; tests may put a wrapper in)."""
        return self.cat.index

    @index.setter
    def index(self, index: CompactLruIndex) -> None:
        self.cat.index = index

    @property
    def slabs(self) -> SlabSet:
        """The slot catalog's slab files (:class:`~.slabs.SlabSet`)."""
        return self.cat.slabs

    @property
    def journal(self) -> Journal:
        """The slot catalog's journal (:class:`~.journal.Journal`)."""
        return self.cat.journal

    @property
    def admission(self) -> Admission:
        """The writer's admission filter."""
        return self.writer.admission

    @property
    def _closed(self) -> bool:
        return self.cat.closed

    @property
    def _gather(self) -> bool:
        return self.writer.framer.gather

    # ---- BlockPool -------------------------------------------------------------------------
    @property
    def layout(self) -> KvLayout:
        return self.namespace.layout

    def _degraded_due(self) -> None:
        with self.cat.lock:
            if not self.cat.closed:
                self.cat.admitting(time.monotonic())

    def contains(self, key: BlockKey) -> bool:
        """True if ``key`` is known published in the index (no I/O; the payload is verified only by get). Waits at
        most :data:`~.lock_bounded.LOCK_WAIT_S` for the pool's lock and answers False past it (not known held:
        a caller that takes False for "gone" asks :meth:`holds`, which tells "unknown" apart)."""
        got = holds(self.cat, int_keys([key], "contains"))
        return bool(got and got[0])

    def holds(self, keys: Sequence[BlockKey], timeout_s: float | None = LOCK_WAIT_S) -> list[bool] | None:
        """Whether the index holds each of ``keys`` (no I/O), or None when the pool's lock stayed busy
        ``timeout_s`` seconds (held by another thread across journal I/O: unknown, ask again later). vLLM's
        scheduler thread asks this (the native ``G3Tier``'s removal checks), so it waits a bound, never the
        journal's stall (docs/invariants.md #3; :mod:`.lock_bounded`)."""
        return holds(self.cat, int_keys(keys, "holds"), timeout_s)

    def lookup_prefix(self, keys: Sequence[BlockKey], *, request: bool = True) -> Future[int]:
        """Future of the number of leading ``keys`` held (index only). Found entries become most
        recently used. ``keys``: BlockKeys, or a :class:`~kvbm_backend.model.namespace.KeyRun` (the
        compact index probes its uint64 array, no per-key object). ``request`` False: not counted
        (``lookup_blocks`` / ``lookup_hits``, ``kvbm_matched_tokens``, the hit rate; see :class:`BlockPool`).
        Never waits for the pool's lock: while another thread holds it the future resolves later
        (:mod:`.lookup_defer`, counted ``lookups_deferred``)."""
        return self._lookups.lookup_prefix(lookup_keys(keys), request)

    def count_lookup(self, requested: int, found: int) -> None:
        """Count a request's lookup settled elsewhere (:meth:`BlockPool.count_lookup`); never waits for the lock."""
        self._lookups.count(requested, found)

    def _count_metrics(self, requested: int, found: int) -> None:
        self.metrics.matched_tokens.inc(found * self.layout.page_size)
        self.metrics.hit_rate.record(requested, found)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[BlockBuffer], *,
            dev_checks: Sequence[int] | None = None, bypass_admission: bool = False) -> Future[PutResult]:
        """Offload ``blocks[i]`` (``block_bytes`` uint8 each) under ``keys[i]``; returns Future[PutResult]
        at once. Keys already held or in flight, blocks the admission filter turns away, and keys
        deleted (:meth:`delete`) while queued or being written (not stored) are ``skipped`` (``stats()``
        ``offloads_skipped_present``, ``_admission``, ``_deleted``; ``skipped`` sums them); blocks beyond the queue bound, while degraded, or without room are ``dropped``, and
        so is a key no slot can hold (seq_hash outside [0, 2**64), rank outside [0, 2**32): ``invalid_key``,
        only that key, as G4 does). The buffers are read until the Future completes.

        Args:
            dev_checks: optional :func:`~kvbm_backend.model.frame.device_checksum` of each block (the
                connector computes them on the GPU where the blocks were gathered): their frames then
                carry ``FLAG_DEVCHECK`` and device loads verify them in HBM without a host copy.
            bypass_admission: store without asking the admission filter (promotion of blocks just
                loaded from G4: a block asked for again is a repeat sighting by definition).

        Raises:
            ValueError: mismatched lengths, a wrong-sized buffer, or a key of another namespace.
        """
        keys = int_keys(keys, "put", tenants=False)
        blocks = list(blocks)
        check_buffers(keys, blocks, "put", self.block_bytes)
        checks = None if dev_checks is None else [int(c) for c in dev_checks]
        if checks is not None and len(checks) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(checks)} dev_checks")
        for k in keys:
            if k.namespace != self.fp:
                raise ValueError(f"put: key namespace {k.namespace} is not this pool's namespace {self.fp}")
        return self.writer.put(keys, blocks, checks, bypass_admission)

    def get(self, keys: Sequence[BlockKey], out: GetDestinations) -> Future[GetResult]:
        """Onboard ``keys[i]`` into ``out[i]``; Future[GetResult] at once. ``ok[i]`` is True only for a
        verified block. Absent, foreign, corrupt, short, mismatched, failed or late (past
        ``load_timeout_s``) blocks are misses. A slot is dropped only when its stored bytes are proven
        bad (re-read and checked against what the index says the slot holds): a read error, a timeout
        or a key the caller named wrongly (e.g. a seq_hash outside [0, 2**64): ``invalid_key``) is a
        miss that leaves the slot in place. A key named twice is read once and its later copies are
        filled from the first (both hits, or both misses). Keys :meth:`keys` returned (restored
        :class:`~.index.TagKey` s included) read like any other. Once the future resolved nothing more is
        written into ``out`` (a timed-out get: blocks copied in before the bound are hits, the rest misses),
        so the caller may reuse its buffers at once.

        ``out`` is either 1-D uint8 numpy buffers (the host pipeline below) or torch tensors on one
        device (:meth:`device_reader`: slots leased, read straight into device staging, verified on the
        device, copied into ``out[i]`` only once verified; a late read never lands in ``out``).

        Raises:
            ValueError: mismatched lengths or a wrong-sized / read-only buffer (numpy); for tensors the
                future raises ValueError for a tensor of the wrong size, device or layout.
        """
        return self.reader.get(int_keys(keys, "get", tenants=False), out)

    # ---- SlotLeaseSource: in-place reads by the device and layer-wise loaders (pool/g3/read) -------
    def lease(self, keys: Sequence[BlockKey], timeout_s: float | None = None) -> list[SlotLease | None]:
        """Pin the slots of ``keys`` for a reader outside the host pipeline (the device and layer-wise
        loaders read frames straight into their staging); None for absent or foreign keys (counted as
        ``absent`` misses). Every lease must go back through :meth:`release`; until then the slot is not
        evicted or reused. The reader verifies header and payload itself (the frame is not trusted).
        Raises TimeoutError when the pool's lock stays busy ``timeout_s`` seconds (default ``g3.load_timeout_s``),
        held by another thread across journal I/O: nothing leased, the keys counted ``timeout`` misses
        (docs/invariants.md #3)."""
        return self.reader.lease(int_keys(keys, "lease"), self.cfg.load_timeout_s if timeout_s is None else timeout_s)

    def release(self, leases: Sequence[SlotLease]) -> None:
        """Unpin leases from :meth:`lease` (a slot evicted meanwhile is freed now)."""
        self.reader.release(leases)

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        """A reader outside the host pipeline found ``key``'s slot bad (``reason``, a FrameError reason):
        remove it from the index and journal (the slot is freed once its last lease is released) once
        the stored bytes are proven bad (re-read and checked, the slot pinned meanwhile; dropped only if ``key``
        still maps to it): a slot whose frame re-reads and verifies, or cannot be read, stays (a miss)."""
        self.reader.drop_corrupt(int_keys([key], "drop_corrupt")[0], reason)

    def drop_unreadable(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Delete the blocks of ``keys`` whose load failed other than by a timeout once a fresh synchronous
        re-read proves their stored bytes bad (a FrameError reason, ``short``, ``token_digest``): removed as
        :meth:`delete` removes them. A slot that re-reads good stays (the failed read was transient); one the
        re-read cannot read either (an I/O error: no proof) stays too (``unreadable_kept``) until it has stayed
        unreadable over several failed loads and minutes (``unreadable_deleted``: :mod:`.read.unreadable`,
        docs/invariants.md #1). Future of how many were deleted, resolved on a thread of its own
        (``kvbm-g3-drop``): the re-reads and the pool's lock (held across journal writes: unbounded on a stalled
        drive) never hold the caller, who waits as long as its own bound allows (before 2026-12-02 the work ran
        on the caller's thread: a native ``G3Tier`` load that failed reported its job only once a 12 s journal
        stall ended, its request waiting past ``job_timeout_s``). 0 once the pool is closed. Never raises for
        storage trouble."""
        keys = int_keys(keys, "drop_unreadable")
        with self._drop_mu:
            if self._closed:
                return completed(0)
            if self._drops is None:
                self._drops = executor(1, "kvbm-g3-drop")
            return self._drops.submit(lambda: 0 if self._closed else self.reader.drop_unreadable(keys))

    def device_reader(self, device: str | torch.device) -> DeviceLoader:
        """The pool's :class:`~kvbm_backend.pool.g3.read.device.DeviceLoader` for ``device`` (created on
        first use: the device path is probed in this pool's first directory and logged once;
        ``g3.device_path`` forces a mode). ``get(keys, tensors)`` uses it; callers may call this at
        start-up so the probe and its log line happen before the first request.

        Raises:
            RuntimeError: the pool is closed. ImportError: torch is not installed.
        """
        return self.reader.device_reader(device)

    def layerwise_load(self, keys: Sequence[BlockKey], device: str | torch.device, *, timeout_s: float | None = None,
                       min_read: int | None = None) -> LayerwiseLoad:
        """Start a layer-wise load of ``keys`` into ``device`` (a ``torch.device`` or its name: ``cuda:N``, or
        ``cpu``, host memory, the same code) and return it at once: slots leased, reads ordered by layer group
        on this pool's reader threads (``g3.io_threads``, made on first use, with the slab fds and the host
        staging; pinned on CUDA). :meth:`~.read.layerwise.LayerwiseLoad.wait_layer` (``l``) gives layer ``l``
        of every block as an ``[n, layer_bytes]`` uint8 tensor on ``device`` before later layers are in (NOT
        yet verified); :meth:`~.read.layerwise.LayerwiseLoad.finish` verifies every payload, drops slots proven
        bad, releases the leases and gives one reason per key (None: verified). The
        :class:`~kvbm_backend.pool.base.LayerwiseLoading` of :class:`~kvbm_backend.pool.base.G3Extensions`.

        Args:
            timeout_s: the load's deadline in seconds (default ``g3.load_timeout_s``); later reads are
                ``timeout`` rows.
            min_read: bytes per read at least (layers grouped up to it; default
                :data:`kvbm_backend.transfer.layers.DEFAULT_MIN_READ`).
        Raises:
            RuntimeError: the pool is closed. ImportError: torch is not installed. ValueError: the layout's
            block is not whole layers. TypeError: a wiring bug in the leases (nothing stays leased).
        """
        return self.reader.layerwise_load(int_keys(keys, "layerwise_load"), device, timeout_s=timeout_s,
                                          min_read=min_read)

    def keys(self) -> list[BlockKey]:
        """Snapshot of the published keys (index only, no I/O; waits for the pool's lock)."""
        return cast("list[BlockKey]", self._keys(None))  # no bound: never None

    def keys_within(self, wait_s: float) -> list[BlockKey] | None:
        """:meth:`keys`, waiting at most ``wait_s`` seconds for the pool's lock (held across journal I/O by other
        threads); None past it (ask again later). For callers on vLLM's scheduler or forward thread (docs/invariants.md
        #3): before 2026-12-02 their index reads waited a drive's whole stall (reviewer: 1.5 s per step)."""
        return self._keys(wait_s)

    def _keys(self, wait_s: float | None) -> list[BlockKey] | None:
        with held_within(self.cat.lock, wait_s) as got:
            # restored keys are TagKeys (tenant tag, no tenant string): they stand in for BlockKeys here (same
            # namespace / rank / seq_hash fields, ``tenant`` a placeholder naming the tag) and every G3 call takes
            # them back (see get), so the protocol's list[BlockKey] holds them by this cast
            return cast("list[BlockKey]", [k for k, _ in self.cat.index.items()]) if got else None

    def unpublished_keys(self) -> list[BlockKey]:
        """Keys of offloads queued, being written or handed to the late-put thread: not published yet (no I/O; waits
        for the pool's lock as :meth:`keys` does). :meth:`delete` of them cancels those writes (a tenant's purge)."""
        with self.cat.lock:
            return self.writer.unpublished()

    def removal_cursor(self) -> int:
        """The cursor :meth:`removed_since` would return now (removals logged so far)."""
        return self.cat.removed_n

    def removed_since(self, cursor: int) -> tuple[int, list[tuple[int, int, int]] | None]:
        """Blocks that left the index (evicted, deleted, proven corrupt) after ``cursor`` (a value this method
        returned; 0 at first): ``(new cursor, [(number, seq_hash, rank), ...])`` in order, each removal's
        ``number`` above ``cursor``; None instead of the list when more than ``catalog.REMOVED_LOG_ENTRIES``
        happened since (read :meth:`keys` then). O(removals since), no I/O: the vLLM tiering tier reports
        its removals from it without scanning the index on the scheduler thread: it takes the removal log's own
        lock, never the pool's (held across journal I/O)."""
        return self.cat.removed_since(cursor)

    def delete(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Remove blocks (queued offloads of these keys are cancelled, a cancelled write's slot is cleared too, and a
        later ``put`` of such a key is queued anew: before 2026-11-30 it was answered ``skipped`` and never stored;
        the cancelled write is ``skipped`` in its own put's result, counted ``offloads_skipped_deleted``);
        their slot headers are zeroed first, so no restart brings them back, even one without the journal
        (:meth:`.catalog.SlotCatalog.clear_headers`). Future of how many were held.
        Never raises for storage trouble: the index removal stands; a DEL record the journal does not take degrades
        the tier, is counted (``vacancies_unjournaled``), and the journal is rewritten from the index once it can be."""
        n = 0
        recs: list[bytes] = []
        cat = self.cat
        keys = int_keys(keys, "delete")  # before any effect (:mod:`.entry`)
        with cat.lock:
            if not cat.slabs.dirs:  # closed: nothing is held (and no file, nor the journal, is written)
                return completed(0)
            for k in keys:
                self.writer.cancel(k)
                if cat.index.get(k) is None:
                    continue
                n += 1
                cat.remove(k)  # its header zeroed: a scan without the journal does not find it again
                recs.append(jr.encode(jr.DEL, k))
            vacancy.journal_dels(cat, recs)  # not taken: counted (vacancies_unjournaled), logged
            cat.c["deleted"] += n
        cat.update_gauges()
        return completed(n)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued offload is written and published (or dropped). Returns False when
        offloads are still pending after ``timeout`` seconds (the BlockPool contract: never raises)."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Write what is queued (bounded by ~``load_timeout_s`` + 10 s, the rest is dropped), then
        release files, the directory locks and threads; returns within ~2 x (``load_timeout_s`` + 10) s even
        when writes or flushes hang: every put is resolved then (blocks not yet stored dropped, ``closed``,
        never published later), and the slab files and directory locks are released only once the hung I/O
        returned (a ``kvbm-g3-close`` thread waits for it). Idempotent; does nothing in a forked child."""
        if not self.cat.begin_close():  # closed already, or a forked child's copy (:mod:`.forked`): nothing to do
            return
        if self.writer.close(self.cfg.load_timeout_s + 10):
            self._release()
        else:
            start_thread(self._release_late, name="kvbm-g3-close")

    def _release_late(self) -> None:
        self.writer.finish()
        self._release()

    def _release(self) -> None:
        cat = self.cat
        self.reader.close_device()
        self.writer.close_sync_pool()
        if self._own_engine:
            self.engine.close()
        self.reader.close_verifier()  # after the engine: its last callbacks may still queue there
        cat.close()
        forget_logged(*self._log_subjects)  # a closed pool keeps no budget (nor leaves one to the next at its paths)
        self._lookups.join(1.0)  # a deferred lookup has the lock by now (its future resolves)
        with self._drop_mu:
            if self._drops is not None:
                self._drops.shutdown(wait=False)  # a queued drop finds the pool closed: 0

    def stats(self) -> dict[str, Any]:
        """Counters and gauges. Sizes in bytes; ``*_blocks``/counts in blocks. Never waits for a busy pool lock
        longer than :data:`~.lock_bounded.LOCK_WAIT_S`: then the gauges are the last read's (``stats_stale``
        True; :func:`~.lock_bounded.pool_stats`)."""
        return pool_stats(self, self._stats)

    def slot_accounting(self) -> dict[str, int]:
        """Every slot below each file's cap is exactly one of: published, pinned-deferred, reserved,
        free. ``leaked`` must be 0 (tests assert it)."""
        return self.cat.accounting()

    def __enter__(self) -> G3Pool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @staticmethod
    def _fdatasync(fd: int) -> None:
        """``fdatasync(fd)`` through this module's global name (the writer's one durability call; tests
        wrap ``kvbm_backend.pool.g3.pool.fdatasync`` to order or fail syncs). Raises OSError."""
        fdatasync(fd)

