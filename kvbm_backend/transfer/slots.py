"""Slot I/O planning: fixed-size slots of slab files -> :class:`~.plan.Extent` s -> coalesced, aligned ops.

A G3 pool stores one frame per slot: slot ``si`` of a slab file covers bytes ``[si * slot_bytes,
(si + 1) * slot_bytes)``. A slot is named ``(file index, slot index)``; ``fd_of(file index)`` gives the
file's descriptor. These helpers turn the slots of a write piece or a read chunk into extents, cut at
absolute file offsets that are multiples of ``io_size`` so that :func:`~.plan.coalesce` packs adjacent
slots into ops of exactly ``io_size`` bytes (4 KiB aligned when ``slot_bytes`` and ``io_size`` are).

Two shapes:

* staged (:func:`staged_run_extents`): the slots' frames lie back to back in one host buffer (slot ``j``
  at ``j * slot_bytes``); each run of adjacent slots of one file becomes one extent over one buffer view
  (one iovec per op);
* per slot (:func:`slot_extent`): one slot's own buffers (header, payload, padding), zero copy.

:func:`plan_ops` coalesces either into :class:`~kvbm_backend.io.base.IoOp` s.

The device loader (:mod:`kvbm_backend.gpu`) reads leased slots itself (kvikio into HBM, or ``preadv``
into pinned memory): :func:`group_passes` cuts its rows into staging-sized passes and
:func:`contiguous_runs` gives each pass's reads (runs of adjacent slots of one file, at most
``io_bytes`` each) -- the same run rule as :func:`staged_run_extents`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..io.base import IoOp
from .plan import Extent, coalesce

Slot = tuple  # (file index, slot index)


def cut_at(bufs: list[np.ndarray], offset: int, io_size: int) -> list[np.ndarray]:
    """Split ``bufs`` (mapped to file bytes from ``offset``) at absolute file offsets that are multiples
    of ``io_size`` (> 0 bytes), so :func:`coalesce` packs adjacent slots into ops of exactly ``io_size``
    bytes. Returns views (never copies); an uncut buffer is returned as is."""
    out = []
    pos = offset
    for b in bufs:
        n = b.nbytes
        start = 0
        while start < n:
            take = min(n - start, (pos // io_size + 1) * io_size - pos)
            out.append(b[start:start + take] if (start or take != n) else b)
            start += take
            pos += take
    return out


def slot_extent(fd: int, slot_index: int, slot_bytes: int, bufs: list[np.ndarray], io_size: int) -> Extent:
    """The extent of slot ``slot_index`` of ``fd`` (bytes from ``slot_index * slot_bytes``) over ``bufs``
    (1-D uint8, in file order), cut at ``io_size`` file boundaries."""
    off = slot_index * slot_bytes
    return Extent(fd, off, cut_at(bufs, off, io_size))


def contiguous_runs(spans: Sequence[tuple], max_bytes: int | None = None) -> list[tuple[int, int]]:
    """``[(first, count)]``: maximal runs of consecutive ``spans`` that are adjacent in one file.

    Args:
        spans: ``(file, offset, nbytes)`` in order (``file``: any comparable name: a path or a file
            index; offsets and lengths in bytes). Span ``j`` continues the run of span ``j - 1`` when
            both name the same file and ``offset[j] == offset[j - 1] + nbytes[j - 1]``.
        max_bytes: a run is cut before a span that would take it past ``max_bytes`` bytes (one read
            each); a run always holds at least one span. None: no cut.
    Returns:
        ``(index of the run's first span, number of spans)`` in order; together they cover every span
        exactly once.
    """
    runs = []
    start = size = 0
    for r, (f, off, nb) in enumerate(spans):
        if r:
            pf, poff, pnb = spans[r - 1]
            if not (f == pf and off == poff + pnb and (max_bytes is None or size + nb <= max_bytes)):
                runs.append((start, r - start))
                start, size = r, 0
        size += nb
    if len(spans):
        runs.append((start, len(spans) - start))
    return runs


def file_order(rows: Sequence[int], where: Callable[[int], tuple[str, int]]) -> list[int]:
    """``rows`` sorted by where each one's bytes lie (``where(row)``: ``(file, offset)``), so that slots
    adjacent in a file become adjacent rows and :func:`contiguous_runs` finds them as one read.

    Why: the G3 writer stripes consecutive blocks over the pool's files (block k in file ``k % files``), so in
    key order no two neighbours share a file and every slot would be its own read: for a device load, a
    kvikio read and its future per 2 MiB block, each costing GIL hand-offs (:mod:`kvbm_backend.gpu.rows`)."""
    return sorted(rows, key=where)


def group_passes(rows: Sequence[tuple[int, int]], max_bytes: int) -> list[tuple[list[int], int]]:
    """Rows grouped into passes of one slot length each, at most ``max_bytes`` of staging per pass.

    Args:
        rows: ``(row, slot_len)`` (bytes) in order.
        max_bytes: staging bytes per pass (a pass always holds at least one row).
    Returns:
        ``[(rows, slot_len)]``: lengths in order of first appearance, rows in their input order, each
        length's rows cut every ``max(1, max_bytes // slot_len)`` rows.
    """
    by_len: dict[int, list[int]] = {}
    for row, slot_len in rows:
        by_len.setdefault(slot_len, []).append(row)
    out = []
    for slot_len, same in by_len.items():
        per = max(1, max_bytes // slot_len)
        for a in range(0, len(same), per):
            out.append((same[a:a + per], slot_len))
    return out


def staged_run_extents(slots: Sequence[Slot], stage: np.ndarray, slot_bytes: int, io_size: int,
                       fd_of: Callable[[int], int]) -> list[Extent]:
    """Extents for ``slots`` staged in order in ``stage`` (slot ``j`` at ``j * slot_bytes``; ``stage``
    holds at least ``len(slots) * slot_bytes`` bytes): each maximal run of consecutive slots of one file
    becomes one extent over one view of ``stage``, cut at ``io_size`` file boundaries."""
    out = []
    for j0, cnt in contiguous_runs([(fi, si * slot_bytes, slot_bytes) for fi, si in slots]):
        fi, si = slots[j0]
        off = si * slot_bytes
        out.append(Extent(fd_of(fi), off, cut_at([stage[j0 * slot_bytes:(j0 + cnt) * slot_bytes]], off, io_size)))
    return out


def plan_ops(extents: Sequence[Extent], io_size: int, write: bool) -> list[IoOp]:
    """:func:`coalesce` (same arguments, same errors): adjacent extents merged, ops of ~``io_size``."""
    return coalesce(extents, io_size, write)
