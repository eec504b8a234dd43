"""G3 slab files: capacity, lazy growth and slot allocation over the pool's G3 directories.

A pool owns ``files_per_path`` slab files in each configured directory, named ``g3-<namespace fingerprint>-<k>.slab``;
file ``k`` of the directory at position ``d`` of ``g3.paths`` has the file index ``d * files_per_path + k`` in this
run, and :meth:`SlabSet.file_table` names each directory by its real path, so the journal maps an index of an earlier
run to the same file. A slab file is an array of fixed slots of ``frame.slot_bytes(layout.bytes_per_block)`` bytes (4
KiB header + payload padded to 4 KiB), slot ``i`` at byte ``i * slot_bytes``. Files grow lazily in chunks
(``posix_fallocate``), each growth re-checking ``statvfs`` so the filesystem keeps ``min_free_fraction`` free
(invariant 4). A file's share of ``capacity_gb`` (:attr:`SlabFile.max_slots`) is fixed by the configuration; the free
space only caps it for now (:attr:`SlabFile.cap_slots`: what it holds plus its part of the FREE space of its filesystem,
water-filled over the files there by :meth:`SlabSet.recheck_space`, at open and again while the pool runs).

Each directory is a :class:`.dirs.G3Dir` (verified fd, lock, namespace files, safe opens: see :mod:`.dirs`). Slab
files of another namespace are never opened: listed in :attr:`SlabSet.foreign_files`, logged with their bytes.
Metadata writes that failed at open on a full disk are listed in :attr:`SlabSet.metadata_errors` (the pool opens
degraded); the namespace files are written again by :meth:`SlabSet.write_pending_namespaces`.

Blocks past their file's share after ``g3.paths`` or ``files_per_path`` changed are kept while the pool's total
capacity holds them (:mod:`.slab_share`). Settings that shrink the pool give disk back at open (:meth:`SlabSet.trim`,
after the warm restart's journal rewrite): files truncated past their share and last kept block, extra files gone.
"""
from __future__ import annotations

import errno
import heapq
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import numpy.typing as npt

from ...io import probe_o_direct
from ...model.namespace import Namespace
from . import slab_share
from .slab_room import (file_caps, foreign_in, fs_space, journal_bytes_in, keep_free_bytes, slab_bytes_in,
                        slab_keep_free, space_budget, split_room, warn_foreign)
from .dirs import LOCK_NAME, NOSPACE as _NOSPACE, G3Dir, G3LockedError, G3PathError

__all__ = ["LOCK_NAME", "G3LockedError", "G3PathError", "SlabFile", "SlabSet", "fs_space", "keep_free_bytes",
           "o_direct_choice", "slab_bytes_in", "space_budget"]

log = logging.getLogger(__name__)

GROW_BYTES = 64 << 20  # growth chunk per slab file
# While a file's cap is below its share (the filesystem was short), an allocation that comes up short re-reads
# statvfs at most this often (seconds), so the pool grows back once space returns.
RECHECK_SPACE_S = 5.0


def o_direct_choice(directory: str, setting: str) -> bool:
    """Whether the pool opens the slab files of ``directory`` with O_DIRECT for ``g3.o_direct``
    ``setting``: ``on`` True and ``off`` False without a probe; ``auto`` the real probe
    (:func:`kvbm_backend.io.probe_o_direct`), False when the filesystem is full (ENOSPC/EDQUOT: buffered
    I/O works everywhere; logged).

    Raises:
        OSError: the ``auto`` probe failed otherwise (the directory cannot be written: EROFS, EACCES...);
            the pool's open fails with it.
    """
    if setting == "on":
        return True
    if setting == "off":
        return False
    try:
        return probe_o_direct(directory)
    except OSError as e:
        if e.errno not in _NOSPACE:
            raise
        log.warning("G3: cannot probe O_DIRECT in %s (%s); using buffered I/O", directory, e.strerror)
        return False


@dataclass
class SlabFile:
    index: int  # global file index (journal records use it)
    path: str
    directory: str
    fd: int
    o_direct: bool
    slot_bytes: int
    max_slots: int  # configured share of capacity, slots
    size_slots: int = 0  # slots the file currently covers (allocated bytes // slot_bytes)
    cap_slots: int = 0  # slots usable now (max_slots, lowered when the filesystem is short)
    next_unused: int = 0  # high-water mark: slots >= this were never handed out in this run
    free: list[int] = field(default_factory=list)  # heap of released slot indexes < next_unused
    # released slots at or above a lowered cap (< next_unused), handed out again once the cap rises past them
    parked: list[int] = field(default_factory=list)
    # held slots at or past max_slots, kept from an earlier configuration's larger share (slab_share): never
    # handed out again; ``over_top`` is a max-heap (negated) of them for the lazy truncation
    over: set[int] = field(default_factory=set)
    over_top: list[int] = field(default_factory=list)
    lent: int = 0  # free slots of its share held back for other files' blocks past their shares (slab_share)

    def free_count(self, less_lent: bool = True) -> int:
        """Slots it may hand out now: free below its cap, less those lent (``less_lent`` False: not less them)."""
        raw = sum(1 for s in self.free if s < self.cap_slots) + max(0, self.cap_slots - self.next_unused)
        return max(0, raw - self.lent) if less_lent else raw


class SlabSet:
    """The slab files of one pool and their slot allocator (not thread-safe: the pool locks).

    Raises (constructor):
        G3LockedError: a directory is in use by another pool.
        G3PathError: a directory is not this uid's or is writable by group/others, or a G3 file name
            holds a symbolic link, a directory or another non-file.
        ValueError: no directory, or the capacity (configured, or the free space left above the watermark)
            is smaller than one slot per directory.
        OSError: a directory cannot be created or written.
    """

    def __init__(self, paths: list[str], namespace: Namespace, slot_bytes: int, capacity_bytes: int,
                 files_per_path: int, o_direct: str, min_free_fraction: float):
        if not paths:
            raise ValueError("g3.paths: at least one directory is needed")
        self.namespace = namespace
        self.fp = namespace.fingerprint
        self.slot_bytes = slot_bytes
        self.min_free_fraction = min_free_fraction
        # Bytes slab files never take, whatever min_free_fraction says: the journal (43-byte records,
        # rewritten past 4x the index: ~172 B per slot at worst, plus the rewrite's new file) and the
        # namespace/lock files live beside the slabs. Without it a pool with min_free_fraction 0 filled
        # its filesystem with slabs, then every journal append failed: degraded for good, nothing
        # written and nothing evicted (fault campaign, benchmarks/faults.py enospc self_fill).
        self._capacity_bytes = capacity_bytes
        self.paths = [os.path.abspath(p) for p in paths]
        self.files_per_path = files_per_path
        self.trimmed: list[str] = []  # what trim() gave back (files truncated or removed)
        self.over_released = 0  # slots past their file's share emptied since open (slab_share)
        self.files: list[SlabFile] = []
        self.foreign_files: list[str] = []  # other namespaces' slab files (never opened; slab_room.warn_foreign)
        self.foreign_bytes = 0  # disk their slab files and journals hold
        self.o_direct: dict[str, bool] = {}
        self.dirs: dict[str, G3Dir] = {}  # directory -> its opened, verified, locked G3Dir
        self.ids: dict[str, str] = {}  # directory -> its identity in the journal's file table (its real path)
        self._flags: dict[str, int] = {}  # directory -> open flags of its slab files (read-write, O_DIRECT or not)
        self._dev: dict[str, int] = {}  # directory -> st_dev of its filesystem (recheck_space splits its room)
        self._rr = 0
        self._space_checked = time.monotonic()  # last statvfs re-check of files whose cap is below their share
        try:
            self._open(capacity_bytes, files_per_path, o_direct)
        except BaseException:
            self.close()
            raise

    # ---- directories (delegated to their G3Dir) ---------------------------------------------------
    @property
    def metadata_errors(self) -> list[str]:
        """Metadata writes that failed at open on a full disk (lock file, namespace files), per directory
        in :attr:`paths` order; empty when none."""
        return [e for g in self.dirs.values() for e in g.metadata_errors]

    def dir_fd(self, d: str) -> int:
        """The verified fd of directory ``d`` (one of :attr:`paths`)."""
        return self.dirs[d].fd

    def open_in(self, d: str, name: str, flags: int) -> int:
        """:meth:`.dirs.G3Dir.open_in` of directory ``d`` (one of :attr:`paths`): never follows a link.

        Raises:
            G3PathError: ``name`` is a symbolic link, a directory or another non-file, or another
                user's file.
            OSError: anything else (ENOENT without ``O_CREAT``, ENOSPC, EINVAL for O_DIRECT...).
        """
        return self.dirs[d].open_in(name, flags)

    def write_pending_namespaces(self) -> None:
        """Write the namespace files that could not be written at open (no-op when none).

        Raises:
            OSError: still failing (ENOSPC...).
        """
        for d in sorted(self.dirs):
            self.dirs[d].write_pending_namespace()

    # ---- set-up ------------------------------------------------------------------------------
    def _open(self, capacity_bytes: int, files_per_path: int, o_direct: str) -> None:
        owns: dict[str, int] = {}
        for d in self.paths:
            g = self.dirs[d] = G3Dir(d, self.namespace)
            self.ids[d] = os.path.realpath(d)  # unique: two names of one directory cannot both take its lock
            self._dev[d] = os.fstat(g.fd).st_dev  # its filesystem: directories on one share its room
            owns[d], foreign = slab_bytes_in(g.fd, self.fp)
            self.foreign_files += [os.path.join(d, name) for name in foreign]
            self.o_direct[d] = o_direct_choice(d, o_direct)
            self._flags[d] = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.o_direct[d] else 0)  # slab opens
        # each filesystem's room split over its directories (before, each was promised all of it: split_room)
        by_dev: dict[int, list[str]] = {}
        for d in self.paths:
            by_dev.setdefault(self._dev[d], []).append(d)
        got: dict[str, int] = {}
        for ds in by_dev.values():
            free = self._room(ds[0])
            got.update(zip(ds, split_room([owns[d] for d in ds], free, capacity_bytes // len(self.paths))))
        found = [(os.path.join(d, name), n) for d in self.paths for name, n in foreign_in(self.dirs[d].fd, self.fp)]
        self.foreign_bytes = warn_foreign(found, self.fp)  # slab files and journals of other namespaces (logged)
        cap_slots = capacity_bytes // len(self.paths) // self.slot_bytes  # per path
        later: list[tuple[int, str, int, int]] = []  # files without a budget now: created once the open holds
        for pi, d in enumerate(self.paths):
            budget_slots = got[d] // self.slot_bytes
            for k in range(files_per_path):
                # the path's slots spread over its files, the remainder one each to the first files: the files
                # hold exactly the budget, never more (2 slots over 4 files were 1 slot each: twice capacity_gb)
                per_file = slab_share.share(budget_slots, files_per_path, k)
                cap_per_file = slab_share.share(cap_slots, files_per_path, k)
                name = f"g3-{self.fp}-{k}.slab"
                if not self.dirs[d].exists(name) and per_file == 0:
                    if cap_per_file:
                        later.append((pi, d, k, cap_per_file))
                    continue
                self._add_file(pi, d, k, cap_per_file, per_file)
        if not any(f.cap_slots for f in self.files):
            raise ValueError(
                f"g3.capacity_gb: room for no slot of {self.slot_bytes} bytes in {', '.join(self.paths)} "
                f"(configured {capacity_bytes} bytes; free space above the {self.min_free_fraction:.0%} "
                "watermark counts too)")
        for pi, d, k, cap_per_file in later:  # no room now: an empty file that grows once space returns
            try:
                self._add_file(pi, d, k, cap_per_file, 0)
            except OSError as e:
                if e.errno not in _NOSPACE:
                    raise
                log.warning("G3: cannot create slab file %d in %s (%s): the directory uses its other files",
                            k, d, e.strerror)
        self.files.sort(key=lambda f: f.index)
        self.by_index = {f.index: f for f in self.files}
        # caps: what each file holds plus its part of the FREE room (slab_room.file_caps), as while the pool runs; the
        # budget split evenly over a directory's files promised room that was not there (ENOSPC after a restart), and
        # its lower value kept as well left room no file had (files of different sizes; review 2026-12-03)
        self.recheck_space()

    def sync_dirs(self) -> None:
        """``fsync`` each directory: the slab and namespace files the open created are then durable names (a
        power cut in a pool's first run lost them, and every hit the journal recorded in them). Raises OSError."""
        for g in self.dirs.values():
            os.fsync(g.fd)

    def _add_file(self, pi: int, d: str, k: int, share: int, budget: int) -> None:
        """Open (create) slab file ``k`` of directory ``d`` (position ``pi``): ``share`` its slots of
        ``capacity_gb`` (``max_slots``), capped for now (``cap_slots``) by ``budget``, its part of the free
        space at open, or its current size, whichever is more (never more than ``share``).

        Raises:
            G3PathError: the name holds a link or a non-file. OSError: the open failed (ENOSPC...).
        """
        name = f"g3-{self.fp}-{k}.slab"
        fd = self.open_in(d, name, self._flags[d])
        size = os.fstat(fd).st_size
        # Space a slab file holds is the pool's own: the free-space budget never cuts a file below its size. The
        # share stays what capacity_gb grants; the free space only caps it (cap_slots, raised by recheck_space).
        # Before, a pool opened on a filled disk kept that moment's free space as its share (review, 2026-11-30).
        f = SlabFile(index=pi * self.files_per_path + k, path=os.path.join(d, name), directory=d, fd=fd,
                     o_direct=self.o_direct[d], slot_bytes=self.slot_bytes, max_slots=share,
                     size_slots=size // self.slot_bytes)
        f.cap_slots = min(share, max(budget, f.size_slots))
        self.files.append(f)

    def file_table(self) -> tuple[list[str], int]:
        """The journal's file table of this run: each directory's identity (its real path) in :attr:`paths`
        order, and ``files_per_path`` (file index ``d * files_per_path + k``)."""
        return [self.ids[d] for d in self.paths], self.files_per_path

    def keep_mask(self, files: npt.NDArray[np.integer], slots: npt.NDArray[np.integer]) -> npt.NDArray[np.bool_]:
        """Which restored entries (oldest first, each in a file of this run) the pool keeps:
        :func:`.slab_share.keep_mask` over the files' shares (blocks past their file's share are kept while the
        other files' unused shares hold them)."""
        return slab_share.keep_mask(files, slots, {f.index: f.max_slots for f in self.files})

    def restore(self, used: dict[int, set[int]]) -> None:
        """After a journal replay: mark ``used[file_index]`` slots taken and everything else below the
        file's size free. Slots at or past a file's share (kept by :meth:`keep_mask`: ``g3.paths`` or
        ``files_per_path`` changed) are held as over-share slots, each lent a slot by the files with unused
        share (:func:`.slab_share.lend`; logged)."""
        for f in self.files:
            taken = used.get(f.index, set())
            f.over = {s for s in taken if s >= f.max_slots}
            f.over_top = [-s for s in f.over]
            heapq.heapify(f.over_top)
            under = taken - f.over if f.over else taken
            f.next_unused = max(min(f.size_slots, f.cap_slots), max(under, default=-1) + 1)
            f.free = [s for s in range(f.next_unused) if s not in taken]
            f.parked = []
            heapq.heapify(f.free)
        over = sum(len(f.over) for f in self.files)
        lent = slab_share.lend({f.index: f.max_slots - len(used.get(f.index, ())) + len(f.over)
                                for f in self.files}, over)
        for f in self.files:
            f.lent = lent[f.index]
        if over:
            log.warning("G3: kept %d block(s) past their slab file's share of g3.capacity_gb (g3.paths or "
                        "files_per_path changed): they stay readable, are not written again, and give their room "
                        "back as they are evicted; %s lend them room", over,
                        ", ".join(f"{f.path} ({f.lent} slots)" for f in self.files if f.lent)[:600])

    def trim(self) -> None:
        """Give back the disk the configuration no longer grants, once nothing refers to it (call after
        :meth:`restore` and a journal rewrite from the restored index): a file longer than its share is truncated
        past its last block kept past it (:func:`.slab_share.trim_file`, which punches out the slots between), and
        this namespace's slab files with ``k >= files_per_path`` (never opened, so no index entry names them) are
        removed. Listed in :attr:`trimmed` and logged; a failure is logged, never raised."""
        for f in self.files:
            done = slab_share.trim_file(f, self.slot_bytes)
            if done:
                self.trimmed.append(done)
        for d in self.paths:
            self.trimmed += slab_share.remove_beyond(self.dirs[d].fd, d, self.fp, self.files_per_path)
        if self.trimmed:
            log.warning("G3: gave back disk beyond the configured capacity / files_per_path: %s",
                        "; ".join(self.trimmed[:8]))

    # ---- capacity ----------------------------------------------------------------------------
    @property
    def capacity_slots(self) -> int:
        """Slots usable now: caps less what each file really holds back for loans, plus blocks past the shares."""
        return sum(f.cap_slots - min(f.lent, f.free_count(less_lent=False)) + len(f.over) for f in self.files)

    @property
    def max_capacity_slots(self) -> int:
        return sum(f.max_slots for f in self.files)

    def reachable_slots(self) -> int:
        """Slots the files can ever hold: each file's share (``max_slots``), at most its filesystem's size
        (what the index reserves room for at open; ``capacity_gb`` may be far beyond the disks).

        Raises:
            OSError: ``statvfs`` of a directory failed.
        """
        total = {d: fs_space(d)[1] // self.slot_bytes for d in self.paths}
        return sum(min(f.max_slots, total[f.directory]) for f in self.files)

    def free_slots(self) -> int:
        return sum(f.free_count() for f in self.files)

    def recheck_space(self, pending: dict[int, int] | None = None) -> None:
        """Re-read statvfs and let files grow again up to their configured share where space returned (the
        slots parked above a lowered cap are free again once the cap passes them). The room of a filesystem is
        split over its files that can grow (evenly, what one cannot take going to the others; before, each file
        was promised the whole room: ENOSPC instead of evicting). ``pending``: file index -> slots it must hold
        for an allocation in progress. A failed statvfs (a soft NFS mount's EIO) keeps that filesystem's caps
        (before 2026-12-02 it raised out of a put's allocation: the slots taken were lost for good)."""
        self._space_checked = time.monotonic()
        pending = pending or {}
        groups: dict[int, list[SlabFile]] = {}
        for f in self.files:
            groups.setdefault(self._dev.get(f.directory, -1), []).append(f)
        for files in groups.values():
            try:
                room = self._room(files[0].directory)
            except OSError as e:
                log.warning("G3: statvfs of %s failed (%s); its files keep their size caps", files[0].directory, e)
                continue
            for f, cap in zip(files, file_caps(files, room // self.slot_bytes, pending)):
                f.cap_slots = cap
                if f.parked:
                    for s in [s for s in f.parked if s < f.cap_slots]:
                        heapq.heappush(f.free, s)
                    f.parked = [s for s in f.parked if s >= f.cap_slots]

    # ---- allocation --------------------------------------------------------------------------
    def _take(self, f: SlabFile, n: int) -> list[int]:
        """Up to ``n`` slots of file ``f``: contiguous from the high-water mark when possible; never the
        slots it lends (:attr:`SlabFile.lent`)."""
        if f.lent:
            n = min(n, f.free_count())
        out: list[int] = []
        room = f.cap_slots - f.next_unused
        if room > 0:
            k = min(n, room)
            out.extend(range(f.next_unused, f.next_unused + k))
            f.next_unused += k
        while len(out) < n and f.free:
            s = heapq.heappop(f.free)
            if s < f.cap_slots:
                out.append(s)
            elif s < f.next_unused:
                f.parked.append(s)  # beyond a lowered cap: free again once space returns (recheck_space)
        return out

    def allocate(self, n: int, run: int) -> list[tuple[int, int]]:
        """Reserve up to ``n`` slots, ``run`` adjacent slots per file before moving to the next file
        (round-robin striping). Returns (file index, slot) pairs in order; fewer than ``n`` when full.
        Short while the filesystem had lowered a file's cap: statvfs is re-read (at most every
        :data:`RECHECK_SPACE_S` seconds) and the rest taken from the room that returned (before 2026-11-29 the
        pool stayed shrunk for the life of the process: 119 of 958 slots after the disk had emptied)."""
        out = self._allocate(n, run)
        if (len(out) < n and any(f.cap_slots < f.max_slots for f in self.files)
                and time.monotonic() - self._space_checked >= RECHECK_SPACE_S):
            top: dict[int, int] = {}
            for fi, s in out:
                top[fi] = max(top.get(fi, 0), s + 1)
            self.recheck_space(top)
            out += self._allocate(n - len(out), run)
        return out

    def _allocate(self, n: int, run: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        nf = len(self.files)
        misses = 0
        while len(out) < n and misses < nf:
            f = self.files[self._rr % nf]
            self._rr += 1
            got = self._take(f, min(run, n - len(out)))
            if not got:
                misses += 1
                continue
            misses = 0
            out.extend((f.index, s) for s in got)
        return out

    def release(self, slots: Iterable[tuple[int, int]]) -> None:
        """Give slots back (never published, dropped or evicted; none once closed). A slot past its file's share
        (:attr:`SlabFile.over`) is not handed out again: one lent slot goes back to its lender, its bytes are punched
        out and the file truncated once its tail past the share is free (or a growth chunk of it)."""
        for fi, s in slots:
            f = self.by_index.get(fi)
            if f is None or f.fd < 0:  # closed: nothing to give back (a late unpin after close)
                continue
            if s in f.over:
                self._release_over(f, s)
            elif s < f.next_unused:
                heapq.heappush(f.free, s)

    def _release_over(self, f: SlabFile, s: int) -> None:
        f.over.discard(s)
        self.over_released += 1  # its journal record stays until a rewrite (catalog's close)
        slab_share.release_slot(f.fd, s, self.slot_bytes, f.path)  # its disk back now (or its header zeroed)
        for lender in sorted(self.files, key=lambda g: -g.lent)[:1]:  # the file lending most (none once closed)
            lender.lent = max(0, lender.lent - 1)
        while f.over_top and -f.over_top[0] not in f.over:
            heapq.heappop(f.over_top)
        end = max(f.max_slots, -f.over_top[0] + 1 if f.over_top else 0)
        if f.size_slots > end and (not f.over or f.size_slots - end >= GROW_BYTES // self.slot_bytes):
            try:
                os.ftruncate(f.fd, end * self.slot_bytes)
            except OSError as e:
                slab_share.LOG.warning(f"truncate {f.path}", "G3: cannot truncate %s past its share (%s)", f.path, e)
                return
            f.size_slots = end

    def _keep_free(self, total: int, journals: int | None = None) -> int:
        """Bytes of a filesystem of ``total`` bytes that slab growth leaves free: the ``min_free_fraction`` watermark,
        never less than the metadata reserve (256 KiB plus 256 bytes per slot the pool can have on that filesystem),
        less ``journals``, the bytes the pool's journal files there hold (:func:`.slab_room.slab_keep_free`; None:
        those of the filesystem of the first of :attr:`paths`). Raises OSError (a directory cannot be listed)."""
        if journals is None:
            journals = journal_bytes_in(self._dir_fds(self.paths[0]), self.fp)
        return slab_keep_free(keep_free_bytes(total, self._capacity_bytes, self.slot_bytes, self.min_free_fraction),
                              journals)

    def _dir_fds(self, directory: str) -> list[int]:
        return [g.fd for d, g in self.dirs.items() if self._dev.get(d) == self._dev.get(directory)]

    def _room(self, directory: str) -> int:
        """Bytes slab files may still take on the filesystem of ``directory``: its free space less what they leave
        free (:meth:`_keep_free`; negative below it). The journal files are counted before and after statvfs, the
        larger taken (a rewrite renamed meanwhile must not shrink the room). Raises OSError (statvfs, listing)."""
        fds = self._dir_fds(directory)
        journals = journal_bytes_in(fds, self.fp)
        avail, total = fs_space(directory)
        return avail - self._keep_free(total, max(journals, journal_bytes_in(fds, self.fp)))

    def ensure_size(self, fi: int, upto_slot: int) -> None:
        """Grow file ``fi`` so slot ``upto_slot`` exists (chunked ``posix_fallocate``).

        Raises:
            OSError(ENOSPC): the filesystem watermark would be crossed (the file's cap is lowered to its
                current size) or the allocation itself failed.
        """
        f = self.by_index[fi]
        if upto_slot < f.size_slots:
            return
        # lazy: at most 1/8 of the share usable now, never past it (the cap is this file's part of the room)
        limit = max(min(f.cap_slots, f.max_slots), upto_slot + 1)
        chunk = max(1, min(GROW_BYTES // self.slot_bytes, limit // 8))
        want = min(max(upto_slot + 1, f.size_slots + chunk), limit)
        want = max(want, upto_slot + 1)
        grow = (want - f.size_slots) * self.slot_bytes
        room = self._room(f.directory)
        if grow > room:
            need_min = (upto_slot + 1 - f.size_slots) * self.slot_bytes
            if need_min > room:
                f.cap_slots = min(f.cap_slots, f.size_slots)
                raise OSError(errno.ENOSPC, f"G3: growing {f.path} by {need_min} bytes would cross the "
                                            f"{self.min_free_fraction:.0%} free-space watermark (or the metadata reserve)")
            want = min(limit, upto_slot + 1 + max(0, room - need_min) // self.slot_bytes)
            grow = (want - f.size_slots) * self.slot_bytes
        try:
            os.posix_fallocate(f.fd, f.size_slots * self.slot_bytes, grow)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                os.ftruncate(f.fd, want * self.slot_bytes)
            else:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    f.cap_slots = min(f.cap_slots, max(f.size_slots, upto_slot))
                raise
        f.size_slots = want

    # ---- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        self.close_files()
        for g in self.dirs.values():
            g.close()
        self.dirs = {}

    def close_files(self) -> None:
        """Close the slab files' fds, no sync (what a forked child does at the fork, :mod:`.forked`: its copies
        of the directories' fds are closed by :mod:`.dirs`)."""
        for f in self.files:
            try:
                os.close(f.fd)
            except OSError:
                pass
            f.fd = -1  # a late release finds it closed, not an fd number reused by another file
        self.files, self.by_index = [], {}

