"""Listing a file store (:class:`.fs_store.FsStore`): its objects, or its writers' temp files, under a name
prefix. Links are never followed and only regular files are objects. A directory that cannot be read
(EACCES; on NFS ESTALE, EIO) is never skipped silently: the listing yields every object it could read, then
raises :class:`~.store.ListIncomplete` naming each such directory (before 2026-11-29 ``os.walk`` skipped
them, and gc and migrate reported success over a partial listing)."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator

from .store import ListIncomplete, ObjectInfo


def is_temp_name(basename: str) -> bool:
    return basename.startswith(".") and basename.endswith(".tmp")


def stat_version(st: os.stat_result) -> str:
    """A listed file's :attr:`~.store.ObjectInfo.version`: ``"{st_ino}:{st_mtime_ns}:{st_size}"`` (a rename
    keeps all three; a file written since differs in one unless it got the freed inode, the same mtime to the
    nanosecond, or to the filesystem's timestamp granularity, and the same size)."""
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def walk(root: Path, url: str, prefix: str, temps: bool) -> Iterator[ObjectInfo]:
    """Objects (``temps``: writer temp files) of the store at ``root`` (``url`` for messages) whose name
    starts with ``prefix``: walks the deepest directory ``prefix`` fully names."""
    d = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    parts = d.split("/") if d else []  # a link at any component under the root: nothing listed
    if any(root.joinpath(*parts[:i + 1]).is_symlink() for i in range(len(parts))):
        return
    failed: list[str] = []

    def unlisted(e: OSError) -> None:
        if not isinstance(e, (FileNotFoundError, NotADirectoryError)):  # gone (pruned meanwhile) or never there
            failed.append(f"cannot list {e.filename}: {e.strerror or e}")

    for dirpath, _dirs, files in os.walk(root.joinpath(*parts), onerror=unlisted):
        for f in files:
            if is_temp_name(f) != temps:
                continue
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, root)
            if not rel.startswith(prefix):
                continue
            try:
                st = os.lstat(p)
            except FileNotFoundError:  # deleted since listed
                continue
            except OSError as e:
                unlisted(e)
                continue
            if stat.S_ISREG(st.st_mode):
                yield ObjectInfo(rel, st.st_size, st.st_mtime, stat_version(st))
    if failed:
        raise ListIncomplete(url, failed)
