"""Reusable staging buffers for G3 I/O: one process-wide :class:`~kvbm_backend.memory.BufferPool` of
kind ``"thp"`` (pre-faulted host memory on transparent huge pages), kept between batches.

Why reused and pre-faulted: a fresh staging array per piece of a batch costs a page fault per 4 KiB
on first touch (measured on the 2-core dev VM: ~110 us per 36 KiB slot copied into fresh memory vs
~2 us into touched memory), which dominated small-block puts and gets. Why huge pages: O_DIRECT into
4 KiB pages runs at about half speed (measured in :mod:`kvbm_backend.memory`). At most ``keep_bytes``
of free buffers are kept (more are allocated when many pieces are in flight at once and released
when given back over the cap; free buffers of stale sizes are released first: see
:class:`~kvbm_backend.memory.BufferPool`).
"""
from __future__ import annotations

import threading

import numpy as np

from ...memory import BufferPool, hugepage_empty


def populated(nbytes: int) -> np.ndarray:
    """A 2 MiB-aligned, pre-faulted uint8 array of ``nbytes`` on transparent huge pages
    (:func:`kvbm_backend.memory.hugepage_empty`; see the module docstring)."""
    return hugepage_empty(max(nbytes, 1), prefault=True)


def staging_pool(keep_bytes: int) -> BufferPool:
    """A new G3 staging pool: ``BufferPool("thp", keep_bytes)`` (``keep_bytes``: most bytes of free
    buffers kept for reuse)."""
    return BufferPool("thp", keep_bytes, name="g3-staging")


_shared: BufferPool | None = None
_shared_lock = threading.Lock()


def shared_staging(keep_bytes: int) -> BufferPool:
    """The process-wide G3 staging pool (G3 pools of one process share it, so a pool opened again, or
    a second namespace, reuses warm buffers). Its cap only grows: ``max`` of the callers' ``keep_bytes``
    (:meth:`~kvbm_backend.memory.BufferPool.raise_keep`)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = staging_pool(keep_bytes)
        else:
            _shared.raise_keep(keep_bytes)
        return _shared
