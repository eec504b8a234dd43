"""The confirming re-read of a file store (:meth:`.fs_store.FsStore.stored_matches`), past the page cache.

A G4 reader deletes an object whose frame failed verification only when the store confirms it holds exactly
the bytes read (:mod:`.reader`). On a file store the confirmation is a second read of the file; through the
same client page cache (an NFS mount) that read returns the same cached pages, so a page gone bad in this
client's cache (a bit flip in RAM, a torn page after a network error) would "confirm" corruption the server
does not hold, and the reader would delete a good object. So the re-read bypasses the page cache:

* ``O_DIRECT`` into a 4 KiB-aligned buffer (its length rounded up to whole 4 KiB blocks) where the filesystem
  takes it (ext4, xfs, NFS: the bytes come from the disk or the server, never a cached page);
* else (refused at open, ``EINVAL``/``EOPNOTSUPP``, or at the read, ``EINVAL``: ramfs, some FUSE
  filesystems) ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the range first, which drops the range's clean cached
  pages (on NFS the next read asks the server), then a buffered read. This is best effort: dirty pages (a
  write of this client not yet flushed) and a filesystem whose cache *is* the storage (tmpfs, ramfs) keep
  their pages, and there the re-read is no more independent than the read it confirms.

Before 2026-11-30 the re-read was a plain buffered ``pread``.
"""
from __future__ import annotations

import os
from typing import Callable

from ...io.files import refuses_direct
from ...memory import aligned_empty

Opener = Callable[[str, bool], "tuple[int, bool, int] | None"]  # FsStore._open_file: (fd, is_direct, size)


def reread_matches(open_file: Opener, name: str, want: memoryview, size: int) -> bool:
    """True only when the file ``name`` (opened by ``open_file(name, direct)``: ``(fd, is_direct, size)`` or
    None when absent) is ``size`` bytes and starts with the bytes ``want``, read past the page cache (module
    doc): O_DIRECT where the filesystem takes it, else after ``POSIX_FADV_DONTNEED`` on the range. False on
    any error (a bad read is no proof of bad stored bytes); never raises OSError or ValueError."""
    for direct in (True, False):  # the second: O_DIRECT refused at the read (EINVAL), reopened buffered
        try:
            opened = open_file(name, direct)
        except (OSError, ValueError):
            return False
        if opened is None:
            return False
        fd, is_direct, got_size = opened
        try:
            if got_size != size:
                return False
            if is_direct:
                got = _read_direct(fd, len(want))
                if got is None:
                    continue
                return got == want
            drop_cached(fd, len(want))
            return os.pread(fd, len(want), 0) == want
        except OSError:
            return False
        finally:
            os.close(fd)
    return False


def _read_direct(fd: int, n: int) -> memoryview | None:
    """The first ``n`` bytes (fewer at the file's end) of O_DIRECT ``fd`` read into a 4 KiB-aligned buffer;
    None when the filesystem refuses the O_DIRECT read (EINVAL). Raises OSError otherwise."""
    buf = aligned_empty(max(4096, -(-n // 4096) * 4096))
    got = 0
    try:
        while got < n:
            k = os.preadv(fd, [buf.data[got:]], got)
            if k == 0:
                break
            got += k
    except OSError as e:
        if refuses_direct(e):
            return None
        raise
    return buf.data[:min(got, n)]


def drop_cached(fd: int, n: int) -> None:
    """Ask the kernel to drop the cached pages of bytes 0 to ``n`` of ``fd`` (``POSIX_FADV_DONTNEED``), so the
    next buffered read of them goes to the storage (the server, on NFS). Best effort: never raises."""
    try:
        os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
