""":class:`SlotCatalog`: the only owner of G3 slot state -- the index (key -> slot, LRU, pins), the slab
files (free lists, reservations, capacity), the journal, the degraded state and the pool's counters, all
changed under its one lock (:attr:`SlotCatalog.lock`, with :attr:`SlotCatalog.cv` on it).

The writer (:mod:`.writer`), the reader (:mod:`.read`) and warm restart (:mod:`.restore`) are parts that
change slot state only through it, holding its lock. Every method here expects the caller to hold
``lock`` unless its docstring says otherwise.
"""
from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import threading
import time
from typing import Callable, Iterable, Sequence, cast

import numpy as np
import numpy.typing as npt

from ...config import G3Config
from ...memory import aligned_zeros
from ...metrics import TierMetrics, count_reason
from ...model import frame
from ...model.namespace import BlockKey, Namespace, tenant_tag
from . import forked, gauges, journal as jr, vacancy
from .compact_index import CompactLruIndex, Slot
from .forked import ForkedLock
from .index import TagKey
from .journal_home import find_home
from .slabs import SlabSet
from ...threads import start_thread

log = logging.getLogger(__name__)

HDR = frame.HEADER_BYTES
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)
# The journal is compacted (rewritten from the index) once it holds more than this many records and more than
# 4 per block held: appends stay O(1) and a restart replays at most ~4 records per block (a little more while a
# compaction is being written: the old journal keeps taking appends until the new one replaces it).
COMPACT_MIN_RECORDS = 65536
# Removals (evicted, deleted, proven corrupt) the pool remembers for G3Pool.removed_since: 24 bytes-ish of
# tuple each; a reader further behind than this re-reads the index instead.
REMOVED_LOG_ENTRIES = 1 << 18

# FrameError.reason -> miss reason (any other: "corrupt")
_MISS_REASON = {"magic": "corrupt", "version": "corrupt", "header_check": "corrupt", "integrity": "corrupt",
                "length": "corrupt", "identity": "identity", "layout": "identity", "token_digest": "token_digest"}

# Every reason the tier's labelled counters carry, with its meaning (docs/operations.md "Reasons" lists the same:
# tests/core/test_metric_reasons.py). Counted by SlotCatalog.drop / miss / count_corrupt; each series exists at 0
# from the pool's start (TierMetrics reasons=). A reason counted that is not here is logged (metrics.count_reason).
#: ``kvbm_backend_g3_offloads_dropped{reason}``: blocks of a put not stored (writer.py)
DROP_REASONS = {
    "invalid_key": "a key no slot can hold (seq_hash outside [0, 2**64), rank outside [0, 2**32))",
    "queue_full": "the write-behind queue held g3.write_queue_blocks already",
    "degraded": "put while the tier was degraded (degrade_s after ENOSPC or a failed journal write)",
    "closed": "the pool was closing: put after close began, or still queued when close's bound ran out",
    "no_space": "no free slot even after evicting and waiting for the writes in flight (the rest pinned by loads, or a put larger than the pool)",
    "enospc": "ENOSPC/EDQUOT writing or syncing the slab file or appending to the journal (tier degraded)",
    "io_error": "the slab write or its fdatasync failed otherwise (EIO, ...)",
    "journal_error": "the journal append or rewrite failed otherwise than for space (tier degraded)",
    "error": "the writer failed on a bug (logged with its traceback)",
}
#: ``kvbm_backend_g3_load_misses{reason}``: blocks asked for and not served (read/host.py, read/reader.py)
MISS_REASONS = {
    "absent": "not in the index (never stored, evicted, deleted, another namespace)",
    "invalid_key": "a key no slot can hold",
    "timeout": "not read and verified within g3.load_timeout_s (also: the pool's lock stayed busy that long)",
    "io_error": "the read failed (or its slab file is gone); the stored bytes are not proven bad, the slot stays",
    "short": "the slab file ends inside the slot (truncated)",
    "corrupt": "the frame failed its checks (magic, version, header check, length, checksum)",
    "identity": "the frame names another block or layout than the key asked for",
    "unverifiable": "a device load found a frame it cannot verify (encrypted, or without checksum)",
    "token_digest": "the frame was written without a token digest and the request names one (dropped once proven)",
    "other_digest": "a verified frame of another token sequence under this name (another nonzero token digest); kept",
    "duplicate_of_miss": "a key repeated in one get whose first copy missed",
}
#: ``kvbm_backend_g3_corrupt_blocks{reason}``: slots proven bad on disk (re-read), dropped from index and journal
CORRUPT_REASONS = {
    "magic": "the slot holds no frame (magic bytes wrong)",
    "version": "a frame format this reader does not know",
    "header_check": "the header's own checksum does not match",
    "identity": "the frame names another block than the index says the slot holds (or another TP world)",
    "layout": "the frame's layout differs from the namespace's",
    "length": "the frame's lengths do not fit the slot or the layout",
    "integrity": "the payload's xxh3_128 checksum does not match (host check)",
    "devcheck": "the payload's device checksum does not match (a device or layer-wise load)",
    "short": "the slab file ends inside the slot (truncated)",
    "token_digest": "written without a token digest, asked for by a key that names one (re-stored with it)",
}
#: ``TierMetrics`` attribute -> its reasons (``TierMetrics("g3", reasons=REASONS)``)
REASONS = {"offloads_dropped": DROP_REASONS, "misses": MISS_REASONS, "corrupt": CORRUPT_REASONS}


class SlotCatalog:
    """Index + slabs + journal of a G3 pool, its counters and degraded state, under one lock.

    Args:
        cfg: the ``g3`` config (paths, capacity_gb, files_per_path, o_direct, min_free_fraction).
        namespace: the pool's namespace (slot size from its layout).
        metrics: the pool's :class:`~kvbm_backend.metrics.TierMetrics`.
        degrade_s: seconds without admission after ENOSPC or a failed journal write, asked at each
            degradation (the pool's ``degrade_s``, which tests and operators may change while it is open).
    Raises:
        as :class:`~.slabs.SlabSet` and :class:`~.journal.Journal` (lock, path and space errors); nothing
        stays open when it raises.
    """

    def __init__(self, cfg: G3Config, namespace: Namespace, metrics: TierMetrics, degrade_s: Callable[[], float]):
        self.namespace = namespace
        self.layout = namespace.layout
        self.fp = namespace.fingerprint
        self.block_bytes = self.layout.bytes_per_block
        self.slot_bytes = frame.slot_bytes(self.block_bytes)
        self.metrics = metrics
        self.degrade_s = degrade_s
        # a forked child's are a ForkedLock (every call raises G3ForkedError: forget_in_child, :mod:`.forked`)
        self.lock: threading.Lock | ForkedLock = threading.Lock()
        self.cv = threading.Condition(cast(threading.Lock, self.lock))
        self.pid = os.getpid()  # the process that opened the pool
        self.c: collections.Counter[str] = collections.Counter()  # the pool's counters (stats)
        self.closed = False  # the pool is closing: no new device loaders, no new offloads
        self.reserved = 0  # slots reserved for pieces being written (not yet published or released)
        self.degraded_until = 0.0  # time.monotonic() until which nothing is admitted (0: not degraded)
        # called with degraded_until by each degrade(): the pool schedules the window's end on its deadline thread
        self.on_degrade: Callable[[float], None] | None = None
        self.journal_dirty = False  # records were lost (failed append/rewrite): rewrite before appending
        self.journal_reason = "enospc"  # drop reason of the last journal failure
        self.journal_error: BaseException | None = None  # the last journal failure (vacancy.unjournaled names it)
        self.dirty_gen = 0  # journal failures that lost records so far (a compaction installs only if unchanged)
        self._ttags: dict[str, bytes] = {}
        self._compactor: threading.Thread | None = None  # the thread writing a journal compaction, if any
        self._zero: npt.NDArray[np.uint8] = aligned_zeros(HDR)  # one zeroed, aligned header (clear_headers)
        self._cleared: set[int] = set()  # files with headers zeroed since open: fdatasync'ed at close
        self.removed: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=REMOVED_LOG_ENTRIES)
        self.removed_n = 0  # removals noted so far: (number, seq_hash, rank) in ``removed``
        # the removal log's own lock: removed_since (vLLM's scheduler thread) never waits for ``lock``
        self.removed_mu = threading.Lock()
        # counts made without ``lock`` (a load that could not get it in time): stats() adds them to ``c``
        self.side: collections.Counter[str] = collections.Counter()
        self.side_mu = threading.Lock()
        self.index = CompactLruIndex()  # numpy arrays: ~60 bytes per block at 10M (bench --tier index)
        self.slabs = SlabSet(cfg.paths, namespace, self.slot_bytes, round(cfg.capacity_gb * 1e9), cfg.files_per_path,
                             cfg.o_direct, cfg.min_free_fraction)
        try:
            self.index.reserve(self.slabs.reachable_slots())  # the index's hash table never grows while open
            if cfg.fsync:  # the slab and namespace files just created: their entries durable (slabs.sync_dirs)
                self.slabs.sync_dirs()
            # the journal's home: whichever configured directory holds it (the order of g3.paths may have changed)
            self.journal_home = find_home(self.slabs, self.fp, sync=cfg.fsync)
            d = self.journal_home.directory
            self.journal = jr.Journal(d, self.fp, dir_fd=self.slabs.dir_fd(d), files=self.slabs.file_table(),
                                      generation=self.journal_home.generation)
        except BaseException:
            self.slabs.close()
            raise
        forked.opened(self)

    # ---- counting ---------------------------------------------------------------------------------
    def drop(self, reason: str, n: int) -> None:
        """``n`` offloads dropped for ``reason`` (one of :data:`DROP_REASONS`)."""
        self.c["offloads_dropped"] += n
        self.c["dropped:" + reason] += n
        count_reason(self.metrics.offloads_dropped, DROP_REASONS, reason, n)

    def drop_unlocked(self, reason: str, n: int) -> None:
        """:meth:`drop` for a caller that does NOT hold :attr:`lock` (a put that could not get it in time)."""
        with self.side_mu:
            self.side["offloads_dropped"] += n
            self.side["dropped:" + reason] += n
        count_reason(self.metrics.offloads_dropped, DROP_REASONS, reason, n)

    def miss(self, reason: str, n: int = 1) -> None:
        """``n`` loads missed for ``reason`` (one of :data:`MISS_REASONS`)."""
        self.c["misses"] += n
        self.c["miss:" + reason] += n
        count_reason(self.metrics.misses, MISS_REASONS, reason, n)

    def miss_unlocked(self, reason: str, n: int = 1) -> None:
        """:meth:`miss` for a caller that does NOT hold :attr:`lock` (a load that could not get it within its
        deadline): counted in :attr:`side` (``stats()`` adds it to the counters) and in the metrics at once."""
        with self.side_mu:
            self.side["misses"] += n
            self.side["miss:" + reason] += n
        count_reason(self.metrics.misses, MISS_REASONS, reason, n)

    def add_unlocked(self, **counts: int) -> None:
        """``c[name] += n`` for a caller that does NOT hold :attr:`lock` (counted in :attr:`side`)."""
        with self.side_mu:
            self.side.update(counts)

    def count_corrupt(self, reason: str) -> None:
        """One slot proven bad for ``reason`` (one of :data:`CORRUPT_REASONS`) and dropped."""
        self.c["corrupt"] += 1
        self.c["corrupt:" + reason] += 1
        count_reason(self.metrics.corrupt, CORRUPT_REASONS, reason)

    def update_gauges(self, gone: bool = False) -> None:
        """Set the tier's gauges to the sum over this process's G3 pools (``gone``: this one closed; :mod:`.gauges`)."""
        n = len(self.index)
        gauges.publish(self.metrics, self, None if gone else (n, n * self.slot_bytes, self.slabs.capacity_slots
                                                              * self.slot_bytes, int(bool(self.degraded_until))))

    # ---- degraded state ------------------------------------------------------------------------------
    def admitting(self, now: float) -> bool:
        """False while degraded; a degradation past its time ends here (statvfs re-read), at the next put or at
        the window's end (:attr:`on_degrade`), whichever comes first. Call with :attr:`lock` held."""
        if self.degraded_until and now >= self.degraded_until:
            self.degraded_until = 0.0
            self.slabs.recheck_space()
            self.update_gauges()
        return not self.degraded_until

    def degrade(self) -> bool:
        """No admission for ``degrade_s()`` s from now; True if it was not degraded before (``degradations``)."""
        first = not self.degraded_until
        self.c["degradations"] += first
        self.degraded_until = time.monotonic() + self.degrade_s()
        self.update_gauges()
        if self.on_degrade is not None:
            self.on_degrade(self.degraded_until)
        return first

    # ---- journal -------------------------------------------------------------------------------------
    def journal_append(self, recs: list[bytes]) -> bool:
        """Journal ``recs``. Never raises: a failed append or rewrite (ENOSPC, EIO, anything) goes to
        `journal_failed` (tier degraded, journal marked for repair) and False is returned (``recs``
        not journaled). A journal marked for repair (records lost earlier: DELs) is rewritten from the index
        off the lock (a compaction, :meth:`_compact`, with any namespace file still unwritten written first),
        while ``recs`` go on to the old journal (and to the new one once it is in place); one that cannot take
        appends (:attr:`~.journal.Journal.broken`, or not open) is first rewritten here, under the lock."""
        if not recs:
            return True
        if not self.slabs.dirs:  # the pool closed (its files, directories and journal): nothing is journaled now
            return False
        try:
            j = self.journal
            if j.broken or j.fd is None:  # nothing to append to: the repair is written here, under the lock
                self.slabs.write_pending_namespaces()
                j.rewrite(self.index.items())
                self.journal_dirty = False
                log.warning("G3: journal %s rewritten from the index (repaired)", j.path)
            elif self.journal_dirty:  # the old journal takes appends: repaired off the lock (_compact)
                if (j.compaction is None or j.compaction.gen != self.dirty_gen) and not self.closed:
                    self.slabs.write_pending_namespaces()
                    self._compact()
            elif j.compaction is None and not self.closed and j.records > self._compact_at():
                self._compact()
            j.append(recs)
        except Exception as e:  # noqa: BLE001 - storage trouble (or a bug) must not hang callers
            self.journal_failed(e)
            return False
        return True

    def _compact_at(self) -> int:
        """Journal records past which it is rewritten: 4 per block held, at least :data:`COMPACT_MIN_RECORDS` but
        never more than 4 per slot the files may hold now (at least 1024): the metadata reserve slab files leave
        free (:func:`.slab_room.keep_free_bytes`, 256 B per slot) holds such a journal and its rewrite. Before
        2026-12-02 a pool of a few hundred slots filling a small filesystem appended up to 65,536 records (2.8 MB)
        until the journal took the last byte: every append and the repair failed, the tier degraded for good."""
        slots = sum(f.cap_slots for f in self.slabs.files)
        return max(4 * len(self.index), min(COMPACT_MIN_RECORDS, max(1024, 4 * slots)))

    def _compact(self) -> None:
        """Start a compaction: the journal rewritten from a snapshot of the index (one record per block
        held), taken *before* an append, never after one: every caller holds the lock from its append to
        its index change, and the writer journals a group's PUTs first and puts them in the index after
        (publish after durable), so a snapshot right after that append missed the group (found 2026-11-29:
        1,000 of 1,953 blocks gone after a warm restart). Here the index holds everything journaled so far.

        The snapshot is cheap (array copies); encoding and writing it (seconds at millions of blocks, during
        which lookups, gets and puts used to wait for this lock: decode stalled) runs on a thread without the
        lock (:meth:`_run_compaction`), while appends go on to the old journal and are remembered for the
        new one."""
        c = self.journal.begin_compaction(self.index.items())
        c.gen = self.dirty_gen
        t = start_thread(self._run_compaction, args=(c,), name="g3-journal-compaction", start=False)
        self._compactor = t
        t.start()

    def _run_compaction(self, c: jr.Compaction) -> None:
        """The compaction thread: write and fsync the snapshot and the appends made meanwhile without the
        lock, then, holding it, copy the last appends, rename the file over the journal and fsync the
        directory. The old journal stays valid (and gets every append) until that rename, so a crash or a
        failure anywhere before it loses nothing; a failure degrades the tier like a failed rewrite
        (``journal_failed``, the journal not marked for repair) and the temp file is removed. A compaction
        superseded meanwhile (a repair rewrite, close) just removes its temp file, and so does one after whose
        snapshot records were lost (``dirty_gen`` moved on: a failed append). One started while the journal was
        marked for repair (:meth:`journal_append`) is the repair: its snapshot has what the lost records said,
        and once installed the journal is clean again (before 2026-12-01 the repair was rewritten under the lock:
        a slow or stalled disk stalled every lookup, i.e. the engine's steps, that long)."""
        j = self.journal
        try:
            if j.write_snapshot(c):
                with self.lock:
                    pending = j.take_pending(c)
                j.write_caught_up(c, pending)
                with self.lock:
                    if j.compaction is c and c.gen == self.dirty_gen and not (j.broken or j.fd is None):
                        j.finish_compaction(c)
                        if self.journal_dirty:
                            self.journal_dirty = False
                            log.warning("G3: journal %s rewritten from the index (repaired)", j.path)
                        else:
                            self.c["journal_compactions"] += 1
                        return
        except Exception as e:  # noqa: BLE001 - storage trouble (or a bug): the old journal stays valid
            with self.lock:
                live = j.compaction is c and not self.closed
                j.abort_compaction(c)
                if live:
                    self.journal_failed(e, dirty=False)
            return
        with self.lock:
            j.abort_compaction(c)

    def wait_compaction(self, timeout: float | None = None) -> bool:
        """Wait (lock NOT held) until no compaction thread runs; False if one still runs after ``timeout``."""
        t = self._compactor
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def journal_failed(self, e: BaseException, dirty: bool = True) -> None:
        """The metadata path failed: degrade like slab ENOSPC (no admission for ``degrade_s()`` s, then statvfs is
        re-read) and, when ``dirty``, rewrite the journal before the next append. Counted (``journal_errors``; ENOSPC
        in ``enospc`` too, never in the slab writes' ``write_errors``), logged by :func:`.vacancy.journal_degraded`."""
        nospace = getattr(e, "errno", None) in _NOSPACE
        self.journal_reason = "enospc" if nospace else "journal_error"
        self.journal_error = e
        self.journal_dirty = self.journal_dirty or dirty
        self.dirty_gen += dirty  # a compaction snapshot taken before now lacks what was lost: never installed
        self.c.update(journal_errors=1, enospc=nospace)  # no space as for slab files (until 2026-12-03 EIO: write_errors)
        vacancy.journal_degraded(self, e, self.degrade())  # one WARNING per pool per minute (a bug's: each)

    # ---- slots -----------------------------------------------------------------------------------------
    def tag(self, tenant: str) -> bytes:
        """``tenant_tag(tenant)``, cached per pool (at most 4097 ids of at most 256 chars). No lock needed."""
        t = self._ttags.get(tenant)
        if t is None:
            t = tenant_tag(tenant)
            if len(tenant) <= 256:
                if len(self._ttags) > 4096:
                    self._ttags.clear()
                self._ttags[tenant] = t
        return t

    def fd_of(self, file_index: int) -> int:
        """The open descriptor of slab file ``file_index`` (KeyError: no such file). No lock needed."""
        return self.slabs.by_index[file_index].fd

    def release_slots(self, slots: Iterable[Slot]) -> None:
        """Unpin ``slots`` (a slot evicted meanwhile is freed now)."""
        for slot in slots:
            free = self.index.unpin(slot)
            if free is not None:
                self.slabs.release([free])

    def remove(self, key: BlockKey, slot: Slot | None = None) -> None:
        """Remove ``key`` (at ``slot``, if given) from the index; its slot's header is zeroed first
        (:meth:`clear_headers`: a deleted or corrupt block is not found again by a header scan) and the slot is
        freed (or once unpinned)."""
        held = self.index.get(key)
        if held is None or (slot is not None and tuple(held) != tuple(slot)):
            return
        self.clear_headers([held], vacate=False)  # the caller journals the key's DEL
        free = self.index.remove(key, held)
        if free is not None:
            self.slabs.release([free])
        self.note_removed([key])

    def release_unpublished(self, slots: Sequence[Slot]) -> None:
        """Release slots a put reserved and did not publish (its write, slab sync or journal append failed; a
        close abandoned it) or evicted and did not reuse: their headers are zeroed first (:meth:`clear_headers`),
        since a frame may be there whole. Before (reviewer, 2026-11-30) they were released with it: a key
        deleted afterwards (not held: nothing to clear) came back from a restart without the journal. Caller
        holds the lock. A slot past its file's end holds no frame and is not written (a 4 KiB write there would
        allocate space the filesystem may be out of: an ENOSPC-failed write's slots are released here)."""
        ends: dict[int, int] = {}
        for fi in {fi for fi, _ in slots}:
            try:
                ends[fi] = os.fstat(self.fd_of(fi)).st_size
            except (OSError, KeyError):
                ends[fi] = 1 << 62  # unknown: try the write (clear_headers logs a failure)
        self.clear_headers([(fi, si) for fi, si in slots if si * self.slot_bytes < ends[fi]])
        self.slabs.release(slots)

    def clear_headers(self, slots: Iterable[Slot], vacate: bool = True) -> None:
        """Zero the frame header of each of ``slots`` (one 4 KiB ``pwrite`` each, no sync: the file is
        ``fdatasync``'ed by the writer's next barrier on it or at :meth:`close`), so that a header scan
        (:mod:`.scan`: a restart without the journal) cannot bring their blocks back. Call holding the lock
        before the slots are released (a released slot may be written again at once). A reader of such a slot
        meanwhile finds no frame: a miss, never wrong bytes. A failed write is counted and logged
        (:func:`.vacancy.header_not_cleared`), never raised (the journal's DEL record still stands). A slot past
        its file's end holds no frame, and one past its file's share whose block left was emptied when it was
        released (:func:`.slab_share.release_slot`): neither is written (a write would allocate the disk given
        back), the file is still synced at close. ``vacate`` (False when the caller journals the key's DEL):
        journaled empty too (:func:`.vacancy.journal_vacant`; else an evicted block's PUT met the zeroed header at
        the next open, a false ``restore_dropped``, until 2026-12-03)."""
        slots = list(slots)
        for fi, si in slots:
            f = self.slabs.by_index.get(fi)
            if f is not None and (si >= f.size_slots or (si >= f.max_slots and si not in f.over)):
                self._cleared.add(fi)
                continue
            try:
                os.pwritev(self.fd_of(fi), [self._zero.data], si * self.slot_bytes)
                self._cleared.add(fi)
            except (OSError, KeyError) as e:  # counted, logged once a minute: a drive gone fails every slot
                vacancy.header_not_cleared(self, fi, si, e)
        if vacate:  # a repair due too (until 2026-12-03 skipped then: a kill before it, false restore drops)
            vacancy.journal_vacant(self, slots)

    def note_removed(self, keys: Iterable[BlockKey | TagKey]) -> None:
        """Log blocks that left the index (:meth:`~.pool.G3Pool.removed_since`). Caller holds the lock."""
        with self.removed_mu:
            for k in keys:
                self.removed_n += 1
                self.removed.append((self.removed_n, k.seq_hash, k.rank))

    def removed_since(self, cursor: int) -> tuple[int, list[tuple[int, int, int]] | None]:
        """See :meth:`~.pool.G3Pool.removed_since`. Takes only :attr:`removed_mu`, never :attr:`lock` (held by
        other threads across journal I/O): vLLM's scheduler thread asks this every step (docs/invariants.md #3)."""
        with self.removed_mu:
            log, n = self.removed, self.removed_n
            new = n - max(0, cursor)
            if new <= 0:
                return n, []
            if new > len(log):
                return n, None
            return n, list(itertools.islice(log, len(log) - new, len(log)))

    def accounting(self) -> dict[str, int]:
        """Every slot below each file's cap is exactly one of: published, pinned-deferred, reserved,
        free. ``leaked`` must be 0 (tests assert it). Takes the lock."""
        with self.lock:
            cap = self.slabs.capacity_slots
            free = self.slabs.free_slots()
            files = self.slabs.by_index  # a block past its file's share (slab_share) holds a slot lent to it
            used = sum(1 for _, (fi, si) in self.index.items() if si < files[fi].cap_slots or si in files[fi].over)
            return {"capacity": cap, "used": used, "free": free, "reserved": self.reserved,
                    "deferred": self.index.deferred,
                    "leaked": cap - used - free - self.reserved - self.index.deferred}

    def begin_close(self) -> bool:
        """The pool starts closing (``closed`` set, waiters woken): True the first time; False when it was closing
        already, or in a child forked from the opener (the parent's pool is not the child's to close)."""
        if isinstance(self.lock, ForkedLock):
            return False
        with self.cv:
            if self.closed:
                return False
            self.closed = True
            self.cv.notify_all()
        return True

    def forget_in_child(self) -> None:
        """At the fork, in a child forked without exec from the opener (:mod:`.forked`; no other thread runs):
        close the child's copies of the journal's and the slab files' fds (no sync, nothing written; the
        directory locks stay the opener's: :mod:`.dirs`) and make every call of the pool raise
        :class:`~.forked.G3ForkedError` (the lock becomes a :class:`~.forked.ForkedLock`)."""
        self.lock = ForkedLock(
            f"G3 pool {', '.join(self.slabs.paths)} was opened by process {self.pid}; process {os.getpid()} was "
            "forked from it without exec and cannot use it (writes from two processes would corrupt its slots and "
            "journal; this process's copies of its files were closed at the fork). Open a G3 pool of its own, on a "
            "directory of its own, or fork before opening the pool")
        self.cv = threading.Condition(cast(threading.Lock, self.lock))
        self.closed = True
        self.journal.forget()
        self.slabs.close_files()  # (the directories' fds: .dirs closes them at the fork, without unlocking)

    def close(self) -> None:
        """Rewrite the journal from the index if it lost records, holds those of blocks past their share that left
        or lacks the LRU order of hits since the open; close it and the slab files (their directory locks). A
        compaction in progress is cancelled (the old journal holds everything) and waited for. Takes the lock."""
        with self.lock:
            self.closed = True
            self.journal.cancel_compaction()
        self.wait_compaction()
        with self.lock:
            # last chance to persist removals a failed append lost, blocks past their share evicted (no later PUT
            # supersedes their records) and the LRU order (hits have no record: until 2026-12-04 lost at a restart)
            if self.journal_dirty or self.slabs.over_released or self.index.touches:
                try:
                    self.journal.rewrite(self.index.items())
                    self.journal_dirty = False
                except OSError as e:
                    log.warning("G3: journal %s not rewritten at close (%s): a restart may find deleted blocks again "
                                "(each re-verified before use) and an older LRU order", self.journal.path, e)
            for fi in sorted(self._cleared):  # headers zeroed since open: durable before the files close
                try:
                    os.fdatasync(self.fd_of(fi))
                except (OSError, KeyError) as e:
                    log.warning("G3: fdatasync of slab file %d at close failed (%s)", fi, e)
            self._cleared.clear()
            self.journal.shut_down()
            self.slabs.close()
            self.update_gauges(gone=True)
