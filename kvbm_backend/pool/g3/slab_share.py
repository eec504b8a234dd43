"""G3 slab shares across configuration changes, and the open's split of a filesystem's room.

**Blocks past a file's share** (invariant 4 "Capacity is real", invariant 6 "G3 warm restart"). A slab file's
share of ``g3.capacity_gb`` is ``capacity // len(g3.paths) // files_per_path`` slots
(:attr:`.slabs.SlabFile.max_slots`). Adding a directory to ``g3.paths`` or raising ``files_per_path`` with the
same ``capacity_gb`` shrinks every existing file's share, though the pool as a whole can still hold every block
it has. Before 2026-12-01 a restart dropped every block past its file's new share (``restore:capacity``) and
truncated the file, while the new directory stayed empty (294 of 700 good blocks lost after adding a drive).
Now such blocks are kept as long as the pool's total stays within its capacity:

* :func:`keep_mask` (at restore, before the index is built): every block inside its file's share is kept; of
  the blocks past it (``over``), as many as the other files' unused shares can make room for, newest first.
  The rest (oldest first) are dropped as ``restore:capacity`` (``capacity_gb`` was lowered, or the pool was
  full). A block past its file's end is dropped as before (``restore:short``).
* :func:`lend`: each kept block past its share borrows one slot of another file's share: ``SlabFile.lent``
  of that file's free slots are held back (water-filling from the files with the most unused share: the new
  directory's). So the slots in use never exceed the configured total (``sum(max_slots)``).
* At runtime a block past its share is never written again: once evicted or deleted, its slot is not handed
  out, one lent slot goes back to its lender (writes move to the new files over time, as LRU evicts), its bytes
  go back to the filesystem at once (:func:`punch`), and the file is truncated down once its tail past the share
  is empty (:meth:`.slabs.SlabSet.release`). The slots in use stay within the configured bytes; the disk does
  not, until those blocks go: the lenders' held-back free slots are not punched (any free slot may be the one
  held back), so the files hold their shares plus the blocks kept past them, up to twice the configured bytes
  when ``capacity_gb`` was halved (review 2026-12-02; the docstring said the disk stayed within it).
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import TYPE_CHECKING, Mapping

import numpy as np
import numpy.typing as npt

from ...log_limits import LimitedLog
from ...memory import aligned_empty
from .slab_room import _SLAB_RE

if TYPE_CHECKING:
    from .slabs import SlabFile

log = logging.getLogger(__name__)
#: what fails per slot released past a share on a failing drive: one WARNING per kind and file per minute
LOG = LimitedLog(log)

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_libc: ctypes.CDLL | None = None


def keep_mask(files: npt.NDArray[np.integer], slots: npt.NDArray[np.integer],
              shares: Mapping[int, int]) -> npt.NDArray[np.bool_]:
    """Which of N restored entries (file index ``files[i]``, slot ``slots[i]``; oldest first, every file in
    ``shares``: file index -> its share ``max_slots``) the pool keeps: every entry inside its file's share,
    and of those past it the newest ones the unused shares of all files (share less the entries inside it)
    make room for. So the kept entries never outnumber ``sum(shares.values())``."""
    n = len(files)
    keep = np.ones(n, bool)
    if not n:
        return keep
    table = np.zeros(max(shares) + 1, np.int64)
    for f, s in shares.items():
        table[f] = s
    fi, si = files.astype(np.int64), slots.astype(np.int64)
    over = np.flatnonzero(si >= table[fi])
    if not len(over):
        return keep
    inside = np.bincount(fi[si < table[fi]], minlength=len(table))
    spare = sum(max(0, s - int(inside[f])) for f, s in shares.items())
    if len(over) > spare:
        keep[over[:len(over) - spare]] = False  # the oldest go
    return keep


def lend(spares: Mapping[int, int], total: int) -> dict[int, int]:
    """Slots each file lends (file index -> count, summing to ``total``) to ``total`` blocks kept past their
    files' shares, from ``spares`` (file index -> slots of its share it does not use): from the files with
    the most spare first, so what each keeps free ends up as even as the spares allow. Never more than the
    spares hold (:func:`keep_mask` keeps no more blocks than that; a shortfall is logged, never raised: the
    pool opens)."""
    spares = {f: max(0, s) for f, s in spares.items()}
    if total > sum(spares.values()):
        log.warning("G3: %d blocks past their files' shares, only %d slots to lend them", total, sum(spares.values()))
        total = sum(spares.values())
    out = {f: 0 for f in spares}
    if total <= 0:
        return out
    lo, hi = 0, max(spares.values())  # the level each file keeps free: the highest lending at least total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(max(0, s - mid) for s in spares.values()) >= total:
            lo = mid
        else:
            hi = mid - 1
    for f, s in spares.items():
        out[f] = max(0, s - lo)
    extra = sum(out.values()) - total
    for f in sorted(out, key=lambda f: -out[f]):  # lent one too many at the level: give those back
        if extra <= 0:
            break
        if out[f] and spares[f] - out[f] == lo:
            out[f] -= 1
            extra -= 1
    return out


def share(slots: int, files: int, k: int) -> int:
    """File ``k``'s share of ``slots`` spread over ``files`` files: ``slots // files``, plus one for the first
    ``slots % files`` files (the shares sum to ``slots``)."""
    return slots // files + (1 if k < slots % files else 0)


def release_slot(fd: int, slot: int, slot_bytes: int, path: str = "") -> None:
    """Empty a slot kept past its file's share once its block left (evicted, deleted): punched out
    (:func:`punch`), or where that fails its frame header zeroed (one 4 KiB write, as
    :meth:`.catalog.SlotCatalog.clear_headers` does), so no header scan finds the block again; the catalog's
    own clear skips such slots. A failed write is logged (at most once a minute per file ``path``: a drive gone
    fails every slot), never raised."""
    if punch(fd, slot * slot_bytes, slot_bytes):
        return
    try:
        zero = aligned_empty(4096)
        zero[:] = 0
        os.pwritev(fd, [zero.data], slot * slot_bytes)
    except OSError as e:
        LOG.warning(f"header {path}", "G3: cannot clear the header of slot %d of %s past its file's share (%s)",
                    slot, path or f"fd {fd}", e)


def punch(fd: int, offset: int, length: int) -> bool:
    """Give ``length`` bytes of a file at ``offset`` back to the filesystem, its size unchanged (Linux
    ``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``; the range then reads as zeros, so no header
    scan finds a block there). False where the filesystem or libc cannot (the bytes stay allocated until the
    file is truncated); never raises."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
            return True
        err = ctypes.get_errno()
    except (OSError, AttributeError) as e:  # no libc fallocate (not Linux)
        err = getattr(e, "errno", 0) or 0
    log.debug("G3: cannot punch %d bytes at %d (%s)", length, offset, os.strerror(err) if err else "no fallocate")
    return False


def trim_file(f: "SlabFile", slot_bytes: int) -> str | None:
    """Give back the disk of slab file ``f`` past its share at open (:meth:`.slabs.SlabSet.trim`, after the
    restore): the slots between its share and its last block kept past it (:attr:`~.slabs.SlabFile.over`)
    that hold none (dropped at restore, or free) are punched out (:func:`punch`), and the file is truncated
    past that block (to its share when it keeps none). Returns what was given back (``"PATH: A -> B slots"``;
    punched slots named too), None when nothing; a failed truncate is logged, never raised."""
    end = max(f.max_slots, max(f.over) + 1 if f.over else 0)
    punched, s = 0, f.max_slots
    while s < min(end, f.size_slots):  # runs of slots holding no kept block
        if s in f.over:
            s += 1
            continue
        e = s
        while e < end and e not in f.over:
            e += 1
        punched += (e - s) if punch(f.fd, s * slot_bytes, (e - s) * slot_bytes) else 0
        s = e
    done = f"{f.path}: {punched} slots past its share punched out" if punched else None
    if f.size_slots > end:
        try:
            os.ftruncate(f.fd, end * slot_bytes)
        except OSError as e:
            log.warning("G3: cannot truncate %s to its capacity share (%s)", f.path, e)
            return done
        done = f"{f.path}: {f.size_slots} -> {end} slots" + (f" ({punched} punched out)" if punched else "")
        f.size_slots = end
        f.cap_slots = min(f.cap_slots, f.max_slots)
    return done


def remove_beyond(dir_fd: int, directory: str, fingerprint: str, files_per_path: int) -> list[str]:
    """Remove this uid's slab files of namespace ``fingerprint`` with ``k >= files_per_path`` from a G3 directory
    (``dir_fd``: its verified fd; never opened by this run, so no index entry names them). Returns what was removed,
    one line each; a failure is logged, never raised."""
    done = []
    for name in sorted(os.listdir(dir_fd)):
        m = _SLAB_RE.match(name)
        if not m or m.group(1) != fingerprint or int(m.group(2)) < files_per_path:
            continue
        try:
            if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid == os.geteuid():
                os.unlink(name, dir_fd=dir_fd)
                done.append(f"{os.path.join(directory, name)}: removed (files_per_path {files_per_path})")
        except OSError as e:
            log.warning("G3: cannot remove %s beyond files_per_path (%s)", os.path.join(directory, name), e)
    return done
