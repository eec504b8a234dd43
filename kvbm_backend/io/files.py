"""Read-only file descriptors with O_DIRECT where the filesystem takes it: the one open / fallback rule.

Filesystems refuse O_DIRECT either at ``open`` (EINVAL / EOPNOTSUPP: ramfs, tmpfs before Linux 6.6, some
FUSE mounts) or at the first read (EINVAL). Both mean "read this file buffered", never a failure:

* :func:`open_for_read` -- one open, O_DIRECT if asked and taken, else buffered; says which it got.
* :func:`refuses_direct` -- is this OSError the filesystem refusing O_DIRECT (at open or at a read)?
* :class:`ReadFiles` -- a thread-safe cache of such fds by path for a reader that keeps files open (the G3
  readers: device loads, layer-wise loads): one open per (path, mode), a path whose filesystem refused
  O_DIRECT is read buffered from then on, :meth:`ReadFiles.preadv` retries a refused O_DIRECT read
  buffered once.

O_DIRECT reads need 4 KiB-aligned offsets, lengths and buffer addresses (:data:`ALIGN`); callers that cannot
promise that ask for a buffered fd (``direct=False``).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from collections import Counter
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import numpy.typing as npt

from .probe import ALIGN

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

__all__ = ["ALIGN", "READ_FLAGS", "open_for_read", "refuses_direct", "ReadFiles"]

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_REFUSED_AT_OPEN = (errno.EINVAL, errno.EOPNOTSUPP)


def refuses_direct(e: OSError, *, at_open: bool = False) -> bool:
    """True if ``e`` is the filesystem refusing O_DIRECT: EINVAL (or, ``at_open``, EOPNOTSUPP too)."""
    return e.errno in (_REFUSED_AT_OPEN if at_open else (errno.EINVAL,))


def open_for_read(path: str, direct: bool, *, flags: int = READ_FLAGS, dir_fd: int | None = None) -> tuple[int, bool]:
    """Open ``path`` read-only (``flags``, default ``O_RDONLY | O_CLOEXEC | O_NOFOLLOW``), with O_DIRECT if
    ``direct`` and the filesystem takes it at open.

    Returns:
        ``(fd, is_direct)``; the caller closes ``fd``.
    Raises:
        OSError: from ``open`` (ENOENT, EACCES, ELOOP...), never for a refused O_DIRECT.
    """
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, dir_fd=dir_fd), True
        except OSError as e:
            if not refuses_direct(e, at_open=True):
                raise
    return os.open(path, flags, dir_fd=dir_fd), False


class ReadFiles:
    """Read fds of files by path, O_DIRECT where asked and the filesystem takes it, else buffered.

    Thread-safe; fds stay open until :meth:`close` (a fd given out may be in use by another thread, so
    one whose filesystem refused O_DIRECT at a read is kept, not closed, and no longer handed out).

    Args:
        counters: a Counter that receives ``files_o_direct`` / ``files_buffered`` (files opened each way;
            an O_DIRECT file refused at its first read moves from the one to the other). Default: a new
            one, :attr:`counters`.
        direct: False: never O_DIRECT, whatever a caller asks (``g3.o_direct: off``: the G3 readers follow the
            setting as the slab files' own fds do).
    """

    def __init__(self, counters: Counter[str] | None = None, *, direct: bool = True):
        self.direct = direct
        self._fds: dict[tuple[str, bool], int] = {}
        self._no_direct: set[str] = set()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter() if counters is None else counters

    def fd(self, path: str, direct: bool) -> tuple[int, bool]:
        """``(fd, is_direct)`` for ``path``: O_DIRECT if ``direct``, this object allows it (:attr:`direct`) and
        ``path``'s filesystem has not refused it, else buffered. Raises OSError from ``open``."""
        with self._lock:
            direct = direct and self.direct and path not in self._no_direct
            fd = self._fds.get((path, direct))
            if fd is not None:
                return fd, direct
            if not direct:
                fd = os.open(path, READ_FLAGS)
                is_direct = False
            else:
                fd, is_direct = open_for_read(path, True)
                if not is_direct:
                    self._no_direct.add(path)
                    old = self._fds.get((path, False))
                    if old is not None:  # a buffered fd of it exists already: use that one
                        os.close(fd)
                        return old, False
            self.counters["files_o_direct" if is_direct else "files_buffered"] += 1
            self._fds[(path, is_direct)] = fd
            return fd, is_direct

    def refuse_direct(self, path: str) -> None:
        """The filesystem opened ``path`` O_DIRECT but refused a read (EINVAL): buffered from now on (the
        O_DIRECT fd stays open until :meth:`close`; another thread may still be reading with it)."""
        with self._lock:
            if path in self._no_direct:
                return
            self._no_direct.add(path)
            if (path, True) in self._fds:
                self.counters["files_o_direct"] -= 1
        log.info("reads of %s: O_DIRECT refused by the filesystem, buffered reads", path)

    def preadv(self, path: str, bufs: Sequence[npt.NDArray[np.uint8]], offset: int, direct: bool) -> int:
        """``os.preadv`` of ``bufs`` at ``offset`` of ``path`` (O_DIRECT per :meth:`fd`); a read the
        filesystem refuses with EINVAL on an O_DIRECT fd is retried once buffered. Returns bytes read
        (short at end of file). Raises OSError (the buffered retry's, or any other)."""
        # numpy arrays are writable buffers; numpy's stubs declare it only for Python >= 3.12
        iov = cast("Sequence[WriteableBuffer]", bufs)
        fd, is_direct = self.fd(path, direct)
        try:
            return os.preadv(fd, iov, offset)
        except OSError as e:
            if not (is_direct and refuses_direct(e)):
                raise
        self.refuse_direct(path)
        return os.preadv(self.fd(path, False)[0], iov, offset)

    def open_fds(self) -> list[int]:
        """Every fd currently open (for engines that registered them, e.g. kvikio's ``forget_fd``)."""
        with self._lock:
            return list(set(self._fds.values()))

    def close(self) -> None:
        """Close every fd. Idempotent; the object may be used again afterwards (fds reopen)."""
        with self._lock:
            fds, self._fds = set(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
