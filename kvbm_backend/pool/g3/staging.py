"""Reusable staging buffers for G3 I/O: pre-faulted host memory on transparent huge pages, kept
between batches.

Why reused and pre-faulted: a fresh staging array per piece of a batch costs a page fault per 4 KiB
on first touch (measured on the 2-core dev VM: ~110 us per 36 KiB slot copied into fresh memory vs
~2 us into touched memory), which dominated small-block puts and gets.

Why huge pages: O_DIRECT I/O is DMA'd to/from the pages it is given; a 1 MiB I/O over 4 KiB pages is
256 segments and the virtio disk splits it into several requests. Measured on the dev VM (ext4 on
virtio, 256 MiB in 1 MiB O_DIRECT reads, 8 in flight, 3 rounds): into 4 KiB-page ``MAP_POPULATE``
staging 1.12-1.30 GB/s (preadv) / 1.16-1.39 (posix engine), into THP-backed memory 2.25-2.69 /
2.70-2.82, plain O_DIRECT baseline 2.30-2.77 (same finding as :mod:`kvbm_backend.g4.bounce`). So a
buffer is an anonymous private ``mmap`` aligned to 2 MiB, ``madvise(MADV_HUGEPAGE)``-d, then touched
once per page. With THP off the buffers are still page aligned and correct, only slower. At most
``keep_bytes`` of free buffers are kept (more are allocated when many pieces are in flight at once
and released when given back over the cap).
"""
from __future__ import annotations

import mmap
import threading

import numpy as np

HUGE = 2 << 20  # PMD huge page on x86-64 / arm64 with 4 KiB base pages, bytes
_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)


def populated(nbytes: int) -> np.ndarray:
    """A 2 MiB-aligned, pre-faulted uint8 array of ``nbytes`` (anonymous private mmap advised for
    transparent huge pages; see the module docstring). Raises OSError if the mapping fails."""
    nbytes = max(nbytes, 1)
    mm = mmap.mmap(-1, nbytes + HUGE, flags=_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    raw = np.frombuffer(mm, dtype=np.uint8)  # keeps ``mm`` alive
    off = (-raw.ctypes.data) % HUGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, nbytes)
    except (AttributeError, OSError, ValueError):
        pass  # no THP here: 4 KiB pages, slower DMA but correct
    arr = raw[off:off + nbytes]
    arr[::4096] = 0  # fault every page in now, not during I/O
    return arr


class StagingPool:
    """Free lists of staging buffers by exact size. Thread-safe.

    Args:
        keep_bytes: most bytes of free buffers kept for reuse (bytes).
    """

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers ever allocated (tests and stats)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of exactly ``nbytes`` (contents are whatever the last user left)."""
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                self._kept -= nbytes
                return lst.pop()
            self.allocated += 1
        return populated(nbytes)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`take` (its last reader/writer must be done with it). Over the
        cap, free buffers of other sizes are released first (the sizes in use change, e.g. write
        pieces vs read chunks; keeping only stale sizes would make every take allocate anew)."""
        n = buf.nbytes
        with self._lock:
            if self._kept + n > self.keep_bytes and n <= self.keep_bytes:
                for size in list(self._free):
                    lst = self._free[size]
                    while size != n and lst and self._kept + n > self.keep_bytes:
                        lst.pop(0)
                        self._kept -= size
                    if not lst:
                        del self._free[size]
            if self._kept + n <= self.keep_bytes:
                self._free.setdefault(n, []).append(buf)
                self._kept += n

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._kept = 0


_shared: StagingPool | None = None
_shared_lock = threading.Lock()


def shared_staging(keep_bytes: int) -> StagingPool:
    """The process-wide staging pool (G3 pools of one process share it, so a pool opened again, or a
    second namespace, reuses warm buffers). Its cap only grows: ``max`` of the callers' ``keep_bytes``."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = StagingPool(keep_bytes)
        else:
            _shared.keep_bytes = max(_shared.keep_bytes, keep_bytes)
        return _shared
