"""Open a file by absolute path in one system call, following no symbolic link at any component: Linux
``openat2(2)`` with ``RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` (kernel 5.6+), called through ctypes.

O_DIRECT (``direct``) follows :mod:`kvbm_backend.io.files`' rule by leaving the refusal to it: a filesystem
that refuses O_DIRECT at open raises here like any other error, and the caller opens through
:func:`kvbm_backend.io.files.open_for_read`, which reads that file buffered.

Why (issue 24 item 4): :class:`~kvbm_backend.pool.g4.fs_store.FsStore` refuses links under its root by
opening each path component with ``O_NOFOLLOW`` directory fds: for a G4 object four directories deep that is
11 ``open``/``close`` calls before the read. Each call releases and retakes the GIL, and with many I/O threads
every retake waits its turn: on a 16-core host, 2 MiB blocks from tmpfs, that walk plus the read and an
in-place GCM open ran 9.6 GB/s on 16 threads (5.9 cores busy) against 13.5 GB/s (8.8 cores) with one
``openat2`` in its place (the same read and open otherwise). The kernel makes the same check in one call.

:func:`open_no_symlinks` raises :class:`Unsupported` where the kernel or a seccomp filter refuses
``openat2`` (ENOSYS, EPERM) or libc is not reachable; callers then keep their component walk.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os

__all__ = ["Unsupported", "available", "clear_nonblock", "open_no_symlinks", "preadv_clearing"]

SYS_OPENAT2 = 437  # the same number on every Linux architecture (added after the syscall tables were unified)
AT_FDCWD = -100
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04


class Unsupported(OSError):
    """``openat2`` is not available here (kernel before 5.6, a seccomp filter, no libc)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall() -> "ctypes._NamedFuncPointer | None":
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall  # a ctypes.CDLL call releases the GIL
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall() if os.uname().sysname == "Linux" else None
# open flags -> (the open_how handed to the kernel, read-only once made; a reference to it)
_hows: dict[int, tuple[_OpenHow, object]] = {}
_NR, _CWD, _HOW_SIZE = ctypes.c_long(SYS_OPENAT2), ctypes.c_int(AT_FDCWD), ctypes.c_size_t(ctypes.sizeof(_OpenHow))
_supported: bool | None = None if _syscall is not None else False


def available() -> bool:
    """False once an ``openat2`` call was refused as unsupported (or where there is none); else True."""
    return _supported is not False


def open_no_symlinks(path: bytes, flags: int, direct: bool = False) -> int:
    """The fd of ``path`` (absolute, bytes) opened with ``flags`` (``os.O_*``; O_DIRECT too when ``direct``),
    refusing a symbolic link or magic link at any component of the path, the last one included (``ELOOP``).

    Raises:
        Unsupported: no ``openat2`` here (and from then on, without a system call).
        OSError: the kernel's error otherwise, with its errno (ENOENT, ELOOP, ENOTDIR, EINVAL...).
        ValueError: ``path`` holds a NUL byte (as ``os.open``: C would read the path only up to it, another file).
    """
    global _supported
    if b"\0" in path:
        raise ValueError(f"embedded null byte in path {path!r}")
    if direct:
        flags |= os.O_DIRECT
    if _syscall is None or _supported is False:
        raise Unsupported(errno.ENOSYS, "openat2 is not available")
    made = _hows.get(flags)
    if made is None:
        how = _OpenHow(flags, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        made = _hows.setdefault(flags, (how, ctypes.pointer(how)))
    fd = int(_syscall(_NR, _CWD, ctypes.c_char_p(path), made[1], _HOW_SIZE))
    if fd >= 0:
        _supported = True
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and not _supported:
        _supported = False
        raise Unsupported(err, f"openat2: {os.strerror(err)}")
    raise OSError(err, os.strerror(err), os.fsdecode(path))


def clear_nonblock(fd: int, is_direct: bool) -> None:
    """Clear O_NONBLOCK on ``fd`` opened for reading (``F_SETFL`` sets only the status flags: of those such an
    fd has O_DIRECT, kept when ``is_direct``, and O_NONBLOCK). Raises OSError."""
    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT if is_direct else 0)


def preadv_clearing(fd: int, buffers: list[memoryview], offset: int, is_direct: bool) -> int:
    """``os.preadv(fd, buffers, offset)`` on a regular file that may still have O_NONBLOCK from its open: the
    flag does nothing to a regular file's reads (open(2)), so the reader saves the ``fcntl`` that clears it
    (one GIL round trip per block) and clears it only if a read ever answers EAGAIN, then reads again."""
    try:
        return os.preadv(fd, buffers, offset)
    except BlockingIOError:
        clear_nonblock(fd, is_direct)
        return os.preadv(fd, buffers, offset)
