"""I/O engine interface: positioned scatter/gather reads and writes on open file descriptors.

Engines (``posix``: thread pool over ``os.preadv``/``os.pwritev``; ``nixl``: NIXL POSIX backend;
``kvikio``: cuFile, needs the NVIDIA driver) all take the same :class:`IoOp` lists produced by
:mod:`kvbm_backend.transfer` and complete a Future without blocking the caller.
"""
from __future__ import annotations

import errno
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, TypeVar

import numpy as np
import numpy.typing as npt

_T = TypeVar("_T")
_A = TypeVar("_A")


IOV_MAX = 1024  # Linux UIO_MAXIOV: the most iovecs preadv/pwritev take (EINVAL above it); engines refuse more


def check_bufs(op: "IoOp", i: int) -> None:
    """Raise ``OSError(EINVAL)`` naming op ``i`` if it holds more than :data:`IOV_MAX` non-empty buffers or a
    buffer that is not one C-contiguous block of memory (an engine that hands (address, bytes) to a driver
    would otherwise read or write past a strided view's elements)."""
    n = 0
    for b in op.bufs:
        if not b.nbytes:
            continue
        n += 1
        if not getattr(getattr(b, "flags", None), "c_contiguous", False):
            raise OSError(errno.EINVAL, f"op {i}: buffer {n - 1} is not C-contiguous memory")
    if n > IOV_MAX:
        raise OSError(errno.EINVAL, f"op {i}: {n} buffers, more than IOV_MAX {IOV_MAX}")


@dataclass
class IoOp:
    """One positioned I/O: ``bufs`` (iovecs, in order) to/from ``fd`` at ``offset``.

    For O_DIRECT fds, ``offset``, every buffer address and every buffer length are 4 KiB multiples.
    """

    fd: int
    offset: int  # bytes
    bufs: list[npt.NDArray[np.uint8]]  # 1-D uint8 arrays (host); views into caller blocks or staging
    write: bool

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs)


def submit_each(pool: Executor, fn: Callable[[_A], _T], items: Sequence[_A], engine: str) -> list[Future[_T]]:
    """``pool.submit(fn, item)`` for each of ``items``; a submission the pool refuses (``RuntimeError``: it
    was shut down, e.g. by the engine's ``close`` racing this submit) becomes a Future failed with
    ``OSError(EBADF, "<engine> is closed: ...")``, so the ops already submitted are still waited for
    (:func:`gather`) before the caller may reuse its buffers. A raise from the middle of a submit left those
    ops writing into buffers the caller had handed back (review 2026-11-30: kvikio and NIXL GDS engines)."""
    futs: list[Future[_T]] = []
    for item in items:
        try:
            f = pool.submit(fn, item)
        except RuntimeError as e:  # shut down
            f = Future()
            f.set_running_or_notify_cancel()
            f.set_exception(OSError(errno.EBADF, f"{engine} is closed: {e}"))
        futs.append(f)
    return futs


def gather(futs: Sequence[Future[_T]]) -> Future[list[_T]]:
    """One Future for many: resolves, once every one of ``futs`` is done, to their results in order,
    or raises the exception of the lowest-index failed one (only after all finished, so the caller may
    reuse its buffers as soon as it is done). An empty list resolves at once to ``[]``."""
    futs = list(futs)
    out: Future[list[_T]] = Future()
    out.set_running_or_notify_cancel()
    if not futs:
        out.set_result([])
        return out
    left = [len(futs)]
    lock = threading.Lock()

    def one_done(_f: Future[_T]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        err = next((f.exception() for f in futs if f.exception() is not None), None)
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result([f.result() for f in futs])

    for f in futs:
        f.add_done_callback(one_done)
    return out


class IoEngine(Protocol):
    name: str

    def submit(self, ops: Sequence[IoOp]) -> Future[list[int]]:
        """Run all ops (concurrently, up to the engine's queue depth). The Future resolves to a list of
        bytes transferred per op (a short count is returned, not raised) or raises the first OSError."""

    def close(self) -> None: ...
