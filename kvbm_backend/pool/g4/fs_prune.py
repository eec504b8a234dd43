"""Removing the directories a file store's deletions left empty (:meth:`.fs_store.FsStore.prune_dirs`, run by
gc after a pass): object names have directory components (``{ns}/{tenant}/{rank}/{fanout}/...``), and before
2026-11-30 gc deleted the objects but left their emptied directories for ever, so a long-lived shared mount grew
its tree without bound (inodes, and slower walks for every later gc and listing).

Safe while workers write: a directory goes only by ``rmdir``, which the filesystem refuses for a directory
that holds anything (a writer's temp file included), never recursively, and never through a symbolic link
(the parent is opened component by component without following links). A writer that made the directory,
or opened it, just before it went gets ENOENT creating its temp file and makes the directories again
(:meth:`.fs_store.FsStore.put_if_absent`): nothing it publishes is lost. The store root and the directories
right under it (a namespace's, holding its ``namespace.json``) are never removed.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

#: directory components of a name kept whatever they hold: 1 = the root's own subdirectories (namespaces)
KEEP_DEPTH = 1


def prune_empty_dirs(open_dir: Callable[[list[str], bool], int | None], names: Iterable[str]) -> int:
    """Remove the directories of ``names`` (object names, '/'-separated) that are empty, then each removed
    one's parent in turn, deepest first, each directory tried once; never one at depth <= :data:`KEEP_DEPTH`.

    ``open_dir(components, create)``: the store's no-follow directory opener (an fd, or None when absent).
    Returns how many directories were removed. Never raises for a directory that is not empty, is gone, or
    cannot be removed (EACCES, EBUSY, a link, an outage: it stays, and a later pass that deletes under it
    tries again); this is housekeeping, not part of what gc reports as errors."""
    pending: dict[int, set[tuple[str, ...]]] = {}
    for n in names:
        parts = tuple(n.split("/")[:-1])
        if len(parts) > KEEP_DEPTH and not {"", ".", ".."} & set(parts):  # never a path out of the root
            pending.setdefault(len(parts), set()).add(parts)
    removed = 0
    for depth in range(max(pending, default=0), KEEP_DEPTH, -1):
        for d in sorted(pending.get(depth, ())):
            if _rmdir(open_dir, d):
                removed += 1
                if depth - 1 > KEEP_DEPTH:
                    pending.setdefault(depth - 1, set()).add(d[:-1])
    return removed


def _rmdir(open_dir: Callable[[list[str], bool], int | None], d: tuple[str, ...]) -> bool:
    """``rmdir`` of directory ``d`` through its parent's fd: True when removed, False otherwise."""
    try:
        pfd = open_dir(list(d[:-1]), False)
    except OSError:
        return False
    if pfd is None:
        return False
    try:
        os.rmdir(d[-1], dir_fd=pfd)
        return True
    except OSError:  # not empty (ENOTEMPTY/EEXIST), gone, a link (ENOTDIR), refused, an outage: it stays
        return False
    finally:
        os.close(pfd)
