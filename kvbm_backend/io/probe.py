"""File helpers and capability probes: open/preallocate, fdatasync, does a directory take O_DIRECT.

Never assume O_DIRECT: filesystems refuse it at ``open`` (EINVAL: ramfs, tmpfs before Linux 6.6,
some FUSE mounts) or at the first I/O, so :func:`probe_o_direct` really writes and reads an aligned
block in the directory.
"""
from __future__ import annotations

import errno
import mmap
import os
import tempfile

ALIGN = 4096

# errnos meaning "this filesystem does not do that", not a real failure
_UNSUPPORTED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def open_file(path: str, *, o_direct: bool, create: bool = True, size: int | None = None) -> int:
    """Open ``path`` read-write (``O_RDWR | O_CLOEXEC``, plus ``O_DIRECT`` / ``O_CREAT`` mode 0644).

    Args:
        size: if given, bytes to preallocate with ``posix_fallocate`` (so later writes cannot hit
            ENOSPC); falls back to ``ftruncate`` where the filesystem does not support fallocate.
            Never shrinks an existing file.

    Returns:
        The file descriptor (caller closes it).

    Raises:
        OSError: from ``open`` (EINVAL when the filesystem refuses O_DIRECT, ENOENT without
            ``create``) or from preallocation (ENOSPC); the fd is closed before raising.
        ValueError: negative ``size``.
    """
    if size is not None and size < 0:
        raise ValueError(f"size must be >= 0 bytes, got {size}")
    flags = os.O_RDWR | os.O_CLOEXEC
    if o_direct:
        flags |= os.O_DIRECT
    if create:
        flags |= os.O_CREAT
    fd = os.open(path, flags, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fdatasync(fd: int) -> None:
    """``os.fdatasync`` with EINTR retried. Raises OSError (EIO: data may be lost)."""
    while True:
        try:
            os.fdatasync(fd)
            return
        except InterruptedError:
            continue


def probe_o_direct(directory: str) -> bool:
    """True if files in ``directory`` take O_DIRECT: opens a temp file there with O_DIRECT, writes and
    reads back one 4 KiB aligned block, compares, and removes the file (``.kvbm-odirect-probe-<pid>-<random>``:
    one a killed probe left is removed by a G3 pool's open once that pid no longer runs).

    Returns False when the filesystem refuses O_DIRECT (EINVAL/EOPNOTSUPP at open or I/O).

    Raises:
        OSError: the directory is missing or not writable (that is not an O_DIRECT answer).
    """
    # the pid in its name: a pool's open removes the file a killed probe left (pool.g3.dirs, PROBE_STALE_S)
    fd_tmp, path = tempfile.mkstemp(prefix=f".kvbm-odirect-probe-{os.getpid()}-", dir=directory)
    os.close(fd_tmp)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                return False
            raise
        try:
            src = mmap.mmap(-1, ALIGN)  # anonymous mmap: page aligned
            dst = mmap.mmap(-1, ALIGN)
            src.write(os.urandom(ALIGN))
            try:
                if os.pwritev(fd, [src], 0) != ALIGN or os.preadv(fd, [dst], 0) != ALIGN:
                    return False
            except OSError as e:
                if e.errno in _UNSUPPORTED:
                    return False
                raise
            return src[:] == dst[:]
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # removed meanwhile (as stale, by a pool's open): nothing left to remove
