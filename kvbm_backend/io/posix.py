"""POSIX engine: a thread pool over ``os.preadv`` / ``os.pwritev``.

Each :class:`~kvbm_backend.io.base.IoOp` is one vectored syscall (looped until complete); up to
``threads`` ops run at once. The GIL is released inside the syscalls, so threads overlap real I/O.
``EINTR`` is retried; a partial transfer continues from where it stopped; a read that hits end of
file returns its short count. Errors (``EINVAL`` for a misaligned O_DIRECT op, ``ENOSPC``, ``EIO``)
are raised from the Future, never swallowed and never a hang.
"""
from __future__ import annotations

import errno
import os
from concurrent.futures import Future
from typing import Sequence

from .base import IoOp, gather, submit_each
from ..threads import executor


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes of an iovec list."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    rest = views[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def run_op(op: IoOp) -> int:
    """Run one op synchronously; returns bytes transferred (short only at end of file on reads).

    Raises:
        OSError: from the syscall (errno kept), or ``EIO`` if a write makes no progress.
    """
    try:
        views = [b.data.cast("B") for b in op.bufs if b.nbytes]  # .data: the array's memoryview
    except TypeError as e:  # a strided view (memoryview casts need C-contiguous memory)
        raise OSError(errno.EINVAL, f"buffer is not C-contiguous memory: {e}") from None
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        try:
            if op.write:
                n = os.pwritev(op.fd, views, op.offset + done)
            else:
                n = os.preadv(op.fd, views, op.offset + done)
        except InterruptedError:  # PEP 475 retries already; kept for signal handlers that raise
            continue
        if n == 0:
            if op.write:
                raise OSError(errno.EIO, f"pwritev wrote 0 bytes at offset {op.offset + done} of fd {op.fd}")
            break  # end of file: short read
        done += n
        if done < total:
            if not op.write and op.offset + done >= os.fstat(op.fd).st_size:
                break  # end of file (with O_DIRECT a retry at an unaligned EOF would be EINVAL)
            views = _advance(views, n)
    return done


class PosixEngine:
    """Thread-pool engine. ``threads``: ops in flight at once (>= 1)."""

    name = "posix"

    def __init__(self, threads: int = 8):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = executor(threads, "kvbm-posix-io")

    def submit(self, ops: Sequence[IoOp]) -> Future[list[int]]:
        """Queue ``ops``; returns at once. The Future resolves to bytes per op (in order) after every op
        has finished, or raises the OSError of the lowest-index failed op (also only after all ops
        have finished, so the caller may reuse its buffers as soon as the Future is done)."""
        return gather(submit_each(self._pool, run_op, ops, "posix engine"))

    def close(self) -> None:
        """Wait for queued ops, then stop the threads. Later submits fail with EBADF."""
        self._pool.shutdown(wait=True)
