"""Host staging buffers of the device paths, from :class:`~kvbm_backend.memory.BufferPool` (the one
buffer pool of the project): page-locked (``"pinned"``) for a CUDA device, 4 KiB-aligned host memory
(``"host"``) for the CPU.

Why pinned: a host-to-device copy from pageable memory goes through the driver's own bounce buffer in
pieces and cannot run asynchronously; from page-locked memory it is one DMA, ``non_blocking`` on a side
stream. Why pooled: page-locking is a system call per allocation (``cudaHostAlloc``) that costs far more
than reusing a buffer of the same size. ``torch.from_numpy`` of a ``"pinned"`` buffer is a view of the
page-locked memory (``is_pinned()`` holds: checked on an H200 host, torch 2.11), so callers work on
torch tensors.

The pools are process-wide (one per kind); at most :data:`KEEP_BYTES` of free buffers are kept each.
"""
from __future__ import annotations

import threading

import numpy as np

from ..memory import BufferPool

KEEP_BYTES = 256 << 20  # most bytes of free staging buffers kept per kind (bytes)

_pools: dict[str, BufferPool] = {}
_lock = threading.Lock()


def host_staging_pool(pinned: bool) -> BufferPool:
    """The process-wide staging pool: kind ``"pinned"`` if ``pinned`` (a CUDA device's staging; plain
    host memory where CUDA is absent) else ``"host"``."""
    kind = "pinned" if pinned else "host"
    with _lock:
        pool = _pools.get(kind)
        if pool is None:
            pool = _pools[kind] = BufferPool(kind, KEEP_BYTES, name=f"gpu-{kind}-staging")
        return pool


def take_rows(pool: BufferPool, n: int, nbytes: int) -> tuple[np.ndarray, object]:
    """``(buf, rows)``: a buffer of ``n * nbytes`` bytes from ``pool`` and its uint8 torch view
    ``[n, nbytes]`` (rows 4 KiB aligned when ``nbytes`` is a 4 KiB multiple). Give ``buf`` (not the
    view) back to ``pool`` once the last reader/writer of the rows is done, or keep it."""
    import torch
    buf = pool.take(n * nbytes)
    return buf, torch.from_numpy(buf).view(n, nbytes)
