"""G3 warm restart (invariant 6): replay the journal, re-read and check every referenced slot header,
rebuild the index and the slab free lists. Run once by :class:`~kvbm_backend.pool.g3.pool.G3Pool` at open,
on its :class:`~.catalog.SlotCatalog`."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from ...model.frame import FrameError
from . import journal_columns as jc, journal_gen
from .index import TagKey
from .catalog import SlotCatalog
from .journal import FileTable
from .journal_home import remove_stale
from .scan import check_header, read_headers, scan, written_by_g3

log = logging.getLogger(__name__)

_GONE = -1  # a journal's file index whose directory is no longer configured
_NO_FILE = 1 << 20  # one no file of this run has (past the u16 file index): counted as restore:capacity


def restore(cat: SlotCatalog, threads: int) -> None:
    """Replay ``cat``'s journal: every entry whose slot header reads back and checks (identity, layout,
    lengths, a checksum flag) is published again; the others are dropped and counted (``restore:<reason>``,
    ``restored_blocks``, ``restore_dropped``), except one whose header no read returned (EIO, short, after the
    re-reads of :func:`.scan.read_headers`): that proves nothing, so it is published unverified, journaled and
    its slot kept (``restore_unverified``; every load verifies it, and one still unreadable then goes by the
    runtime policy, :mod:`.read.unreadable`). Before 2026-12-01 it was dropped and its slot reused. The journal is rewritten from the rebuilt index (a failure
    degrades the tier, never raises); once it is, slab space the configuration no longer grants is given back
    (:meth:`~.slabs.SlabSet.trim`) and journals of the namespace in other directories are removed
    (:func:`.journal_home.remove_stale`). Blocks past their file's share of ``capacity_gb`` (``g3.paths`` or
    ``files_per_path`` changed) are kept while the pool's total capacity holds them (:mod:`.slab_share`); the
    oldest of the rest are dropped (``restore:capacity``).
    A version-3 journal's file indexes are mapped to this run's files by
    its file table (directory real path, slab number), so the order of ``g3.paths`` does not matter; entries of
    a directory no longer configured are dropped (``restore:path_removed``). Slab files no journal covers (none
    found, its header unreadable, or a directory its file table does not name, one read as moved included), and
    those of a directory holding another journal of the namespace (one that lost: a wrong pick then costs
    no blocks, :mod:`.journal_home`), are scanned: their slot headers not already restored from the journal are indexed (:func:`.scan.scan`, before the journal's blocks in LRU order). ``threads``: header
    reads in flight (the pool's ``g3.io_threads``; :func:`.scan.read_headers`)."""
    cols, info = cat.journal.load_columns()
    cols = cols.take(~journal_gen.is_vacancy(cols.tags, cols.ranks))  # live only when a crash cut its DEL off
    if info["bad_header"]:
        log.warning("G3: journal %s is not this namespace's; ignored", cat.journal.path)
    if info["torn_bytes"]:
        log.warning("G3: journal %s: %d torn bytes at the tail ignored", cat.journal.path, info["torn_bytes"])
    if info["version"] == 1:
        log.info("G3: journal %s is format version 1 (tenant ids in clear); rewritten as version 3",
                 cat.journal.path)
    remap = _file_map(cat, info["files"])
    cand = cols.take(_placed(cat, cols, remap))
    ok = np.zeros(len(cand), bool)
    unverified = 0
    for c0, rows, readable in read_headers(cat, threads, list(zip(cand.files.tolist(), cand.slots.tolist()))):
        part = cand.take(slice(c0, c0 + len(rows)))
        fast = written_by_g3(cat, rows, part.tags, part.ranks, part.seqs)
        ok[c0:c0 + len(rows)] = ~readable | fast  # an unread header proves nothing: kept unverified
        unverified += int((~readable).sum())
        for j in np.flatnonzero(readable & ~fast).tolist():  # another writer's frame, or the reason it fails
            try:
                check_header(cat, rows[j], TagKey(cat.fp, bytes(part.tags[j]), int(part.ranks[j]), int(part.seqs[j])))
            except FrameError as e:
                cat.c["restore:" + e.reason] += 1
            else:
                ok[c0 + j] = True
    good = cand.take(ok)
    journaled = len(good)
    if unverified:
        cat.c["restore_unverified"] += unverified
        log.warning("G3: %d journaled block(s) whose slot header could not be read at restart are kept unverified "
                    "(every load verifies them; one still unreadable then goes by the unreadable-block policy)",
                    unverified)
    covered = _covered(cat, info, remap)
    losers = set(cat.journal_home.stale)  # directories holding a journal that lost: scanned whichever won
    bare = [f for f in cat.slabs.files if f.index not in covered or f.directory in losers]
    if bare:  # files no journal covers: their slot headers are the index (scan.py)
        held = {k for k, _ in jc.pairs_of(good, cat.fp)}
        good = jc.JournalColumns.concat([jc.columns_of(scan(cat, threads, bare, held)), good])
    fit = cat.slabs.keep_mask(good.files, good.slots)  # past a file's share: kept while the pool has room
    _count(cat, "restore:capacity", ~fit)
    good = good.take(fit)
    cat.index.restore_arrays(cat.fp, good.tags, good.ranks, good.seqs, good.files, good.slots, info["tenants"])
    cat.slabs.restore({f: set(good.slots[good.files == f].tolist()) for f in np.unique(good.files).tolist()})
    cat.c["restored_blocks"] = len(good)
    cat.c["restore_dropped"] = len(cols) - journaled + int((~fit).sum())
    try:
        cat.journal.rewrite(cat.index.items())
    except OSError as e:  # full disk at open: serve what is here, admit nothing until it can be written
        cat.journal_failed(e)
    else:  # the journal names no slot past a lowered capacity, nor a file past files_per_path: give them back
        cat.slabs.trim()
        remove_stale(cat.slabs, cat.fp, cat.journal_home)  # the rewritten journal is the newest: no stale one left


def _placed(cat: SlotCatalog, cols: jc.JournalColumns, remap: list[int] | None) -> npt.NDArray[np.bool_]:
    """Which journal entries name a slot this run has: their file indexes mapped to this run's (``remap``,
    :func:`_file_map`; ``cols.files`` rewritten in place) and the slot inside the file's size (a slot past the
    file's share is placed too: :meth:`~.slabs.SlabSet.keep_mask` decides once the headers check). The others
    are counted: ``restore:path_removed`` (the directory is no longer configured), ``restore:capacity`` (no
    such file), ``restore:short`` (past the file's end)."""
    fi = cols.files.astype(np.int64)
    if remap is not None:  # the index of this run of the file the journal named
        table = np.asarray(remap + [_NO_FILE], np.int64)
        fi = table[np.minimum(fi, len(remap))]
    gone = fi == _GONE
    n_files = max(cat.slabs.by_index, default=-1) + 1
    max_slots, size_slots = np.full(n_files + 1, -1, np.int64), np.zeros(n_files + 1, np.int64)
    for idx, f in cat.slabs.by_index.items():
        max_slots[idx], size_slots[idx] = f.max_slots, f.size_slots
    at = np.where((fi >= 0) & (fi < n_files), fi, n_files)  # n_files: no such file (max_slots -1)
    si = cols.slots.astype(np.int64)
    capacity = ~gone & (max_slots[at] < 0)
    short = ~gone & ~capacity & (si >= size_slots[at])
    _count(cat, "restore:path_removed", gone)
    _count(cat, "restore:capacity", capacity)
    _count(cat, "restore:short", short)
    keep: npt.NDArray[np.bool_] = ~(gone | capacity | short)
    cols.files[keep] = fi[keep]
    return keep


def _count(cat: SlotCatalog, reason: str, where: npt.NDArray[np.bool_]) -> None:
    """Count the True entries of ``where`` under ``reason`` (a reason seen 0 times stays absent from stats)."""
    n = int(where.sum())
    if n:
        cat.c[reason] += n


def _covered(cat: SlotCatalog, info: dict[str, Any], remap: list[int] | None) -> set[int]:
    """File indexes of this run a journal covers: none without a journal (absent, or its header unreadable:
    ``version`` 0), every file for versions 1 and 2 (positions in the configured list), and for version 3 the
    files its file table maps to (:func:`_file_map`) in a directory it names. The others are scanned
    (:mod:`.scan`), the files of a directory read as moved included: the pairing is a guess, and the directory
    may instead be one left out for a run that came back (``g3.paths`` [a, b] -> [a, c] -> [a, b]: the journal
    names a and c), whose blocks only its slot headers know. Before, such files counted as covered: every block
    of the returning directory was dropped and its slots reused (found in review, 2026-11-30)."""
    if info["version"] == 0:
        return set()
    if remap is None:
        return set(cat.slabs.by_index)
    if info["files"] is None:  # version 1/2 found outside the first path: a positional map, no directory moved
        return {fi for fi in remap if fi in cat.slabs.by_index}
    dirs, per_path = info["files"]
    named = set(dirs) & set(cat.slabs.file_table()[0])  # directories of this run the journal names
    return {fi for i, fi in enumerate(remap) if fi in cat.slabs.by_index and dirs[i // per_path] in named}


def _file_map(cat: SlotCatalog, files: FileTable | None) -> list[int] | None:
    """For a version-3 journal's file table ``files``: the file index of this run for each of its file
    indexes: the same directory (by real path) and the same slab number ``k``. A directory the journal names
    that is no longer configured was moved (copied to a new node, mounted elsewhere) when a configured directory
    the journal does not name is there to take its place: such directories are paired in the order of each list.
    The others were removed: :data:`_GONE` (logged). An index whose ``k`` is past ``files_per_path`` maps to no
    file of this run. Versions 1 and 2 (no table): :func:`_positional_map`. A wrong pairing costs no bytes (every
    entry is checked against its slot header) and no blocks: a paired directory's files are scanned too
    (:func:`_covered`)."""
    if files is None:
        return _positional_map(cat)
    dirs, per_path = files
    now_dirs = cat.slabs.file_table()[0]
    pos = {ident: d for d, ident in enumerate(now_dirs)}
    named = set(dirs)
    moved = dict(zip((d for d in dirs if d not in pos), (j for j, d in enumerate(now_dirs) if d not in named)))
    pos.update(moved)
    now = cat.slabs.files_per_path
    out = [_GONE if dirs[i // per_path] not in pos else
           (pos[dirs[i // per_path]] * now + i % per_path if i % per_path < now else _NO_FILE)
           for i in range(len(dirs) * per_path)]
    if moved:
        log.warning("G3: the journal names %d director(ies) no longer in g3.paths, read as moved to the configured "
                    "one(s) it does not name: %s", len(moved),
                    ", ".join(f"{d} -> {now_dirs[j]}" for d, j in list(moved.items())[:4]))
    gone = [d for d in dirs if d not in pos]
    if gone:
        log.warning("G3: the journal names %d director(ies) no longer in g3.paths (%s): their blocks are dropped",
                    len(gone), ", ".join(gone[:4]))
    return out


def _positional_map(cat: SlotCatalog) -> list[int] | None:
    """A version-1/2 journal's file indexes are positions in the list of paths it was written with, and those
    versions always kept the journal in that list's first path. Found elsewhere (the list changed order since),
    its home is moved to position 0 and the other paths kept in their order: right for two paths, a guess beyond
    (a wrong guess costs hits, never bytes: every record is checked against its slot header). None when the home
    is first: positions as configured."""
    paths, home = cat.slabs.paths, cat.journal_home.directory
    if home == paths[0] or home not in paths:
        return None
    log.info("G3: journal %s (format version 1/2) is not in the first of g3.paths: read as written when %s was first",
             cat.journal.path, home)
    old = [home] + [p for p in paths if p != home]  # the list it was written with, as a version-3 file table
    return _file_map(cat, ([cat.slabs.ids[p] for p in old], cat.slabs.files_per_path))
