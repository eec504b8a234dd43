"""G3 slab space: the free space of a filesystem, the part slab files leave free, the room a directory's
slab files may take at open, and how the room of one filesystem is split over its directories and its slab files.

**Room of a filesystem at open** (:func:`split_room`): several ``g3.paths`` on one filesystem share its free
space; before 2026-12-01 each was promised all of it at open (35 MiB promised on a 20 MiB tmpfs), so the first
fill hit ENOSPC, dropped a batch and degraded the tier instead of evicting. The budgets decide which slab files the
open creates now and whether the pool has room for a slot at all; the files' caps are then :func:`file_caps`
(:meth:`.slabs.SlabSet.recheck_space`: what each holds plus its part of the FREE space only). Before 2026-12-03 the
budget split evenly over the directory's files was the cap: a file full of blocks kept its size (no room), the
directory's free space went to its other files plus the full file's bytes they did not hold, so a reopen on a
filesystem full of the pool's own slabs promised room that was not there (``capacity_blocks`` above it) and its first
puts hit ENOSPC: a batch dropped and the tier degraded instead of evicting. The lower of the two, kept for a day,
left free room to no file when a directory's files held different sizes (``capacity_blocks`` 626 where 646 fit).

**The metadata reserve counts the journal already there** (:func:`slab_keep_free`, :func:`journal_bytes_in`): the
reserve slab files leave free (:func:`keep_free_bytes`) is for the journal, its rewrite and its ``.gen`` markers.
Before 2026-12-03 the room was the free space less the whole reserve while those files already sat on the
filesystem, so each journal append took room the caps had promised to the slabs: on every first fill of a
filesystem smaller than ``capacity_gb`` (an 8 MiB tmpfs) the last growth of a slab file was refused, a batch dropped
``enospc`` and the tier degraded instead of evicting. Now slab files leave free the reserve less the bytes the
pool's journal files hold (at least :data:`META_FLOOR`), so the journal's growth no longer moves the slabs' room.

**Files of another namespace** (:func:`foreign_in`, :func:`warn_foreign`): a change of model, revision,
dtype, page size or TP size gives the pool a new namespace fingerprint, and the old namespace's slab files and
journal stay in the directory: never opened, never removed, their space not the new pool's (it gets what is
left; before 2026-12-01 only the slab files' names were logged, so ``capacity_bytes`` fell short of
``capacity_gb`` with no word of why). They are logged with their bytes at every open and counted in ``stats()``
(``foreign_files``, ``foreign_bytes``). They are not removed automatically: the directory's lock
(:mod:`.dirs`) proves no live pool uses them, but not that none will (two revisions or page sizes deployed in
turn on one node each find their warm blocks again; a ``model`` or ``revision`` set wrong by mistake would
otherwise wipe the cache it meant to use); the operator removes them.

Used by :class:`.slabs.SlabSet` (which re-exports these names) and ``kvbm-backend doctor``
(:mod:`kvbm_backend.apps.doctor_paths`: :func:`space_budget`, :func:`slab_bytes_in`).
"""
from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from .slabs import SlabFile

log = logging.getLogger(__name__)

_SLAB_RE = re.compile(r"^g3-([0-9a-f]{16})-(\d+)\.slab$")
_JOURNAL_RE = re.compile(r"^journal-([0-9a-f]{16})\.log$")
# the journal, its generation marker and a rewrite's temp file (journal.py, journal_gen.py): what the reserve is for
_JOURNAL_FILES_RE = re.compile(r"^(?:journal-([0-9a-f]{16})\.(?:log|gen)|\.journal-([0-9a-f]{16})\.\d+\.[0-9a-f]{32}\.tmp)$")
# bytes slab files leave free whatever the journal files hold already (they stay within the reserve by design: the
# journal is rewritten past 4 records per slot, catalog._compact_at; this only keeps a journal grown past it some room)
META_FLOOR = 128 << 10


def fs_space(directory: str) -> tuple[int, int]:
    """``(available_bytes, total_bytes)`` of the filesystem holding ``directory`` (statvfs, unprivileged)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def keep_free_bytes(total: int, capacity_bytes: int, slot_bytes: int, min_free_fraction: float) -> int:
    """Bytes of a filesystem of ``total`` bytes that slab files leave free: the ``min_free_fraction``
    watermark, and never less than the metadata reserve (256 KiB plus 256 bytes per slot of
    ``slot_bytes`` the pool, ``capacity_bytes`` in all, can have on that filesystem)."""
    slots = min(capacity_bytes, total) // max(1, slot_bytes)
    return max(int(min_free_fraction * total), (256 << 10) + 256 * slots)


def space_budget(directory: str, own: int, capacity_bytes: int, n_paths: int, slot_bytes: int,
                 min_free_fraction: float) -> tuple[int, int]:
    """``(budget, room)`` in bytes of one of ``n_paths`` G3 directories at open: ``room`` is the space slab
    files may take there (``own``: bytes its slab files already hold, plus the free space, less
    :func:`slab_keep_free`: the reserve less the journal files there; negative when the filesystem is below it),
    ``budget`` the slot bytes the pool gives the directory (``room`` capped at its share ``capacity_bytes //
    n_paths``, at least 0). A budget under ``slot_bytes`` in every directory makes the open fail
    (``g3.capacity_gb: room for no slot``).

    Raises:
        OSError: ``statvfs`` of ``directory`` failed.
    """
    try:  # every namespace's journal files, as ``own`` is in doctor (it knows no model)
        journals = journal_bytes_in([directory])
    except OSError:  # cannot be listed: the whole reserve kept, as before they counted
        journals = 0
    avail, total = fs_space(directory)
    room = own + avail - slab_keep_free(keep_free_bytes(total, capacity_bytes, slot_bytes, min_free_fraction), journals)
    return max(0, min(capacity_bytes // n_paths, room)), room


def journal_bytes_in(dirs: Sequence[int | str], fingerprint: str | None = None) -> int:
    """Disk bytes (allocated blocks) the journal files of namespace ``fingerprint`` (None: of every namespace) hold
    in directories ``dirs`` (fds or paths): ``journal-<fp>.log``, ``journal-<fp>.gen`` and a rewrite's temp file
    ``.journal-<fp>.<pid>.<hex>.tmp``; a file gone meanwhile (a rewrite's rename) counts 0.

    Raises:
        OSError: a directory cannot be listed, or a file's ``stat`` failed otherwise than ENOENT.
    """
    held = 0
    for d in dirs:
        for name in os.listdir(d):
            m = _JOURNAL_FILES_RE.match(name)
            if not m or (fingerprint is not None and fingerprint not in m.groups()):
                continue
            try:
                st = (os.stat(name, dir_fd=d, follow_symlinks=False) if isinstance(d, int)
                      else os.stat(os.path.join(d, name), follow_symlinks=False))
            except FileNotFoundError:
                continue
            held += st.st_blocks * 512
    return held


def slab_keep_free(keep: int, journals: int) -> int:
    """Bytes slab files still leave free on a filesystem whose :func:`keep_free_bytes` is ``keep`` and where the
    pool's journal files (:func:`journal_bytes_in`) hold ``journals`` bytes: ``keep`` less them (they are what
    the reserve is for, already taken from the free space), never less than :data:`META_FLOOR` (nor than
    ``keep`` when that is smaller)."""
    return max(keep - journals, min(keep, META_FLOOR))


def slab_bytes_in(dir_fd: int | str, fingerprint: str | None = None) -> tuple[int, list[str]]:
    """Disk bytes (allocated blocks) the slab files of namespace ``fingerprint`` hold in a directory
    (``dir_fd``: an fd or a path), and the names of the other namespaces' slab files there.
    ``fingerprint`` None: every namespace's slab files count (nothing is foreign)."""
    own, foreign = 0, []
    for name in sorted(os.listdir(dir_fd)):
        m = _SLAB_RE.match(name)
        if not m:
            continue
        if fingerprint is not None and m.group(1) != fingerprint:
            foreign.append(name)
            continue
        if isinstance(dir_fd, int):
            own += os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
        else:
            own += os.stat(os.path.join(dir_fd, name), follow_symlinks=False).st_blocks * 512
    return own, foreign


def water_fill(wants: Sequence[int], room: int) -> list[int]:
    """Split ``room`` (>= 0) over claimants wanting ``wants[i]`` (>= 0) each: evenly, what one does not want
    going to the others. Returns each one's part (sums to at most ``room``, each at most its want)."""
    parts = [0] * len(wants)
    left = len(wants)
    for i in sorted(range(len(wants)), key=lambda i: wants[i]):
        parts[i] = min(wants[i], room // left)
        room -= parts[i]
        left -= 1
    return parts


def split_room(owns: Sequence[int], free: int, share: int) -> list[int]:
    """Space budgets (bytes) at open of directories on one filesystem: directory ``i`` holds ``owns[i]``
    bytes of slab files already; ``free`` is the filesystem's free space less what slab files leave free
    (:func:`.slabs.keep_free_bytes`; negative below it); ``share`` each directory's share of
    ``capacity_gb``. Each budget is its own bytes plus its part of ``free`` (split by :func:`water_fill` over
    what each lacks to its share), at most ``share`` and at least 0, so the budgets of one filesystem never
    promise its free space twice. Below the watermark (``free < 0``) each keeps ``own + free``, as one
    directory alone did."""
    if free <= 0:
        return [max(0, min(share, own + free)) for own in owns]
    parts = water_fill([max(0, share - own) for own in owns], free)
    return [max(0, min(share, own + part)) for own, part in zip(owns, parts)]


def file_caps(files: Sequence["SlabFile"], room: int, pending: Mapping[int, int]) -> list[int]:
    """Caps (slots, :attr:`.slabs.SlabFile.cap_slots`) of the slab files of one filesystem, ``room`` slots free
    there beyond what slab files leave free (negative below it). Each file keeps what it holds (its size, at most its
    share; a cap already below its size stays) plus its part of the FREE room only, water-filled over what each
    lacks to its share (:func:`water_fill`), so the caps past the sizes never exceed ``room``. ``pending``: file
    index -> slots an allocation in progress must hold; those past a file's end take their room first."""
    base = [max(f.size_slots, min(pending.get(f.index, 0), f.max_slots)) for f in files]
    room = max(0, room - sum(b - f.size_slots for b, f in zip(base, files)))
    parts = water_fill([max(0, f.max_slots - b) for f, b in zip(files, base)], room)
    return [max(min(f.max_slots, b + p), min(f.cap_slots, f.size_slots)) for f, b, p in zip(files, base, parts)]


def foreign_in(dir_fd: int, fingerprint: str) -> list[tuple[str, int]]:
    """The slab files and journals of namespaces other than ``fingerprint`` in a G3 directory (``dir_fd``, its
    verified fd): ``(name, disk bytes)`` each (allocated blocks), by name; a file gone meanwhile is left out."""
    out = []
    for name in sorted(os.listdir(dir_fd)):
        m = _SLAB_RE.match(name) or _JOURNAL_RE.match(name)
        if m and m.group(1) != fingerprint:
            try:
                out.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512))
            except FileNotFoundError:
                continue
    return out


def warn_foreign(found: Sequence[tuple[str, int]], fingerprint: str) -> int:
    """Log the files of other namespaces in the pool's directories (``found``: ``(path, bytes)``; nothing when
    empty) with their bytes, and what an operator does about them. Returns their bytes in all."""
    held = sum(n for _, n in found)
    if found:
        log.warning("G3: %d file(s) of another namespace (not %s) hold %d bytes in g3.paths, space this pool cannot "
                    "use (a change of model, revision, dtype, page size or TP size leaves them): %s. Remove them "
                    "(with their namespace-<fingerprint>.json and tenants-<fingerprint>) once no worker of that "
                    "namespace will open these directories again", len(found), fingerprint, held,
                    ", ".join(f"{p} ({n} bytes)" for p, n in found[:8]) + (", ..." if len(found) > 8 else ""))
    return held
