"""The publish step of :class:`~.fs_store.FsStore`'s create-exclusive put, and its "no room" answers.

* :func:`link_exclusive` -- ``link(temp, final)`` (EEXIST: another writer's copy), then checks that what holds
  the name is a regular file. A concurrent delete (gc, another worker's reader dropping a bad object) can remove
  the name between the ``link`` that met it and that ``stat``: the link is then made again, up to
  :data:`LINK_ATTEMPTS` times (before 2026-12 the ``stat``'s ENOENT escaped as an error: ``dropped_error`` and
  a "check credentials" warning for an ordinary race).
* :data:`FULL_ERRNOS` and :func:`mount_point` -- a write refused for room (full, over quota, read-only) is an
  answer, not an outage (:class:`~.store.StoreFull`), named with the mount that refused it.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from .fs_quarantine import unlink_quiet

#: errnos of a write the filesystem refused for room: no space, over quota, read-only (:class:`~.store.StoreFull`)
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
#: links tried when the name met by EEXIST is deleted before it could be checked (:func:`link_exclusive`)
LINK_ATTEMPTS = 3


def link_exclusive(dfd: int, tmp: str, base: str, refused: Callable[[str], OSError]) -> bool:
    """Publish the temp file ``tmp`` as ``base`` (both in directory ``dfd``) create-exclusive, then unlink ``tmp``.

    Returns True when this call created ``base``; False when a regular file held it (another writer's copy), or
    when a file held it at each of :data:`LINK_ATTEMPTS` links and was deleted each time before it could be
    checked (a create-exclusive PUT that met an object each time: what a store answers then; the name may be empty
    by now: the G4 writer's check finds nothing and publishes again, never counting the block stored,
    :meth:`~.writer.G4Writer._publish_found`). Raises
    ``refused(what)`` when something other than a regular file holds the name, OSError when a step fails."""
    try:
        for _ in range(LINK_ATTEMPTS):
            try:
                os.link(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                return True
            except FileExistsError:
                pass
            try:
                st = os.stat(base, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:  # deleted between the link and this stat: link again
                continue
            if not stat.S_ISREG(st.st_mode):
                raise refused("taken by something that is not a regular file")
            return False
        return False
    finally:
        unlink_quiet(tmp, dfd)


def mount_point(path: Path) -> str:
    """The mount point holding ``path`` (the topmost ancestor on the same device), for log lines; ``path`` itself
    when it cannot be told. Never raises."""
    try:
        p = Path(os.path.realpath(path))
        dev = os.stat(p).st_dev
        while p.parent != p and os.stat(p.parent).st_dev == dev:
            p = p.parent
        return str(p)
    except OSError:
        return str(path)
