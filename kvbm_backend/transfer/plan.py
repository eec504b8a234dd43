"""Transfer planning: block extents -> coalesced, size-bounded scatter/gather I/O ops.

A pool describes what it wants moved as :class:`Extent` s (one contiguous file range and the host
buffers that map onto it, in order). :func:`coalesce` sorts them by ``(fd, offset)``, merges extents
that touch in the same file into maximal runs, and cuts each run into :class:`~kvbm_backend.io.base.IoOp`
s of about ``io_size`` bytes (DESIGN.md "Transfer lists": ~1 MiB per rank, a setting).

Cuts fall at buffer boundaries where possible; a buffer larger than ``io_size`` is split into
sub-views whose length is ``io_size`` rounded down to 4 KiB (at least 4 KiB), so 4 KiB-aligned inputs
give 4 KiB-aligned ops (O_DIRECT / GDS). An op never holds more than :data:`IOV_MAX` iovecs
(Linux ``IOV_MAX`` = 1024, the most ``preadv``/``pwritev`` accept).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..io.base import IOV_MAX, IoOp

ALIGN = 4096


@dataclass
class Extent:
    """One contiguous file range: ``bufs`` (1-D uint8 host arrays, in order) map to bytes
    ``[offset, offset + sum(len(b)))`` of ``fd``."""

    fd: int
    offset: int  # bytes
    bufs: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs)


def _check_buf(b: np.ndarray, i: int) -> None:
    if not isinstance(b, np.ndarray):
        raise TypeError(f"extent {i}: buffer is {type(b).__name__}, expected a 1-D uint8 numpy array")
    if b.dtype != np.uint8 or b.ndim != 1:
        raise ValueError(f"extent {i}: buffer has dtype {b.dtype} and shape {b.shape}; expected 1-D uint8")
    if not b.flags.c_contiguous:
        raise ValueError(f"extent {i}: buffer is not contiguous (strides {b.strides})")


def coalesce(extents: Sequence[Extent], io_size: int, write: bool) -> list[IoOp]:
    """Plan the I/O for ``extents``.

    Args:
        extents: file ranges with their host buffers; any order; zero-length buffers are ignored.
        io_size: target bytes per op (> 0). Ops hold at most ``max(io_size, 4096)`` bytes and at most
            :data:`IOV_MAX` buffers.
        write: sets :attr:`IoOp.write` on every op.

    Returns:
        Ops sorted by ``(fd, offset)``; every byte of every extent appears in exactly one op, at the
        same file position, and no op spans two files or a gap. Buffers are views, never copies.

    Raises:
        ValueError: ``io_size`` <= 0, a negative offset, a buffer that is not 1-D contiguous uint8, or
            two extents of one fd that overlap (the message names both ranges).
        TypeError: a buffer that is not a numpy array.
    """
    if io_size <= 0:
        raise ValueError(f"io_size must be > 0 bytes, got {io_size}")
    chunk = max(ALIGN, io_size // ALIGN * ALIGN)  # sub-view size for buffers larger than io_size
    limit = max(io_size, ALIGN)

    items = []
    for i, e in enumerate(extents):
        if e.offset < 0:
            raise ValueError(f"extent {i}: negative file offset {e.offset}")
        for b in e.bufs:
            _check_buf(b, i)
        n = e.nbytes
        if n:
            items.append((e.fd, e.offset, n, e.bufs))
    items.sort(key=lambda t: (t[0], t[1]))

    ops: list[IoOp] = []
    cur_fd: int | None = None
    cur_off: int | None = None
    cur: list[np.ndarray] = []
    cur_bytes = 0
    run_end = None  # file offset just past the last byte planned in the current fd

    def flush() -> None:
        nonlocal cur, cur_bytes, cur_off
        if cur:
            assert cur_fd is not None and cur_off is not None  # set when cur's first buffer was taken
            ops.append(IoOp(fd=cur_fd, offset=cur_off, bufs=cur, write=write))
        cur, cur_bytes, cur_off = [], 0, None

    for fd, off, _n, bufs in items:
        if fd == cur_fd and run_end is not None and off < run_end:
            raise ValueError(
                f"extents overlap in fd {fd}: one ends at byte {run_end}, the next starts at byte {off}"
            )
        if fd != cur_fd or off != run_end:  # new run: never merge across a gap or a file
            flush()
            cur_fd = fd
        pos = off
        for b in bufs:
            if b.nbytes == 0:
                continue
            pieces = [b] if b.nbytes <= limit else [b[s:s + chunk] for s in range(0, b.nbytes, chunk)]
            for p in pieces:
                if cur and (cur_bytes + p.nbytes > limit or len(cur) >= IOV_MAX):
                    flush()
                if not cur:
                    cur_off = pos
                cur.append(p)
                cur_bytes += p.nbytes
                pos += p.nbytes
        run_end = pos
    flush()
    return ops
