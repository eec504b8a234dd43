"""Host buffers aligned for O_DIRECT / GDS (4 KiB), buffers on transparent huge pages, and
:class:`BufferPool`, the one pool of reusable staging buffers every tier uses.

Why huge pages for I/O buffers: an O_DIRECT transfer is DMA'd to/from the pages it is given; over 4 KiB
pages a 1-2 MiB I/O is hundreds of segments, more than a virtio-blk request takes (``max_segments``
254), so the kernel pins every page and splits it into several requests. Measured on the 2-core dev/CI
VM (ext4 on virtio): G3 staging, 256 MiB in 1 MiB O_DIRECT reads, 8 in flight: 1.12-1.39 GB/s into
4 KiB pages vs 2.25-2.82 into THP-backed memory (plain O_DIRECT baseline 2.30-2.77); G4 bounce
buffers, 64 objects of 2 MiB + 4 KiB, 8 in flight: 1.30 vs 2.98 GB/s (baseline 2.85). With THP off
(``never``) the buffers are still aligned and correct, only slower.
"""
from __future__ import annotations

import mmap
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np

ALIGN = 4096
HUGE = 2 << 20  # PMD huge page on x86-64 / arm64 with 4 KiB base pages, bytes


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose data pointer is ``align``-aligned."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


def aligned_zeros(nbytes: int, align: int = ALIGN) -> np.ndarray:
    a = aligned_empty(nbytes, align)
    a[:] = 0
    return a


def is_aligned(buf: np.ndarray, align: int = ALIGN) -> bool:
    """True if the buffer's address and length are multiples of ``align``."""
    return buf.ctypes.data % align == 0 and buf.nbytes % align == 0


def hugepage_empty(nbytes: int, *, prefault: bool = False) -> np.ndarray:
    """A uint8 array of ``nbytes``, 2 MiB aligned, in an anonymous private ``mmap`` advised for
    transparent huge pages (``MADV_HUGEPAGE``; shared maps get no THP). ``prefault``: touch every
    page now (zero-filled) rather than during the first I/O. Falls back to a 4 KiB-aligned numpy
    buffer where ``mmap`` is not available. Raises ValueError for ``nbytes`` < 1."""
    if nbytes < 1:
        raise ValueError(f"hugepage_empty: nbytes must be >= 1, got {nbytes}")
    try:
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError, AttributeError):
        arr = aligned_empty(nbytes)
    else:
        raw = np.frombuffer(m, dtype=np.uint8)  # keeps ``m`` alive
        off = (-raw.ctypes.data) % HUGE
        try:
            m.madvise(mmap.MADV_HUGEPAGE, off, nbytes)  # ``off`` is a multiple of the page size
        except (AttributeError, OSError, ValueError):
            pass  # no THP here: 4 KiB pages, slower DMA but correct
        arr = raw[off:off + nbytes]
    if prefault:
        arr[::4096] = 0
    return arr


KINDS = ("host", "thp", "pinned")


def _pinned_empty(nbytes: int) -> np.ndarray:
    """A page-locked uint8 array (``torch.empty(pin_memory=True)``, viewed as numpy; the array keeps the
    tensor alive); a 4 KiB-aligned host array where torch or CUDA is absent (same bytes, slower DMA)."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    except Exception:  # noqa: BLE001 - no torch / no driver: plain host memory is correct, only slower
        pass
    return aligned_empty(nbytes)


def _alloc(kind: str, nbytes: int) -> np.ndarray:
    if kind == "thp":
        return hugepage_empty(max(nbytes, 1), prefault=True)[:nbytes]
    if kind == "pinned":
        return _pinned_empty(nbytes)
    return aligned_empty(nbytes)


class BufferPool:
    """Reusable host buffers for staging I/O: the one buffer pool of the project (G3 staging, G4 bounce
    buffers, the vLLM tier's block images, device-path host staging). Thread-safe; never blocks.

    Policy: free buffers are kept in lists by exact size (bytes); at most ``keep_bytes`` of free buffers
    allocated past the arena are kept, and a buffer given back over that cap first releases kept buffers
    of *other* sizes (the sizes in use change, e.g. write pieces vs read chunks; keeping only stale sizes
    would make every take allocate anew). The ``arena`` buffers are allocated once, pre-faulted, and
    always kept: the steady state then costs no allocation and no page fault.

    Args:
        kind: ``"host"`` (4 KiB aligned, for O_DIRECT), ``"thp"`` (2 MiB aligned, pre-faulted, on
            transparent huge pages: O_DIRECT into it runs ~2x faster on virtio, see the module docstring)
            or ``"pinned"`` (page-locked for CUDA copies; ``"host"`` memory where CUDA is absent).
        keep_bytes: most bytes of free non-arena buffers kept (bytes, >= 0).
        arena: ``(count, nbytes)``: ``count`` buffers of ``nbytes`` allocated now in one mapping.
        name: shown in :meth:`stats`.
    Raises:
        ValueError: unknown ``kind``, negative ``keep_bytes`` or a bad ``arena``.
    """

    def __init__(self, kind: str = "host", keep_bytes: int = 0, *, arena: tuple[int, int] | None = None,
                 name: str = "buffers") -> None:
        if kind not in KINDS:
            raise ValueError(f"BufferPool.kind: {kind!r} is not one of {KINDS}")
        if keep_bytes < 0:
            raise ValueError(f"BufferPool.keep_bytes: must be >= 0, got {keep_bytes}")
        self.kind, self.keep_bytes, self.name = kind, int(keep_bytes), name
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()
        self._arena_lo = self._arena_hi = 0
        self.arena_bytes = 0
        self.allocated = 0  # buffers allocated past the arena (tests and stats)
        self.reused = 0  # takes served from a free list
        if arena is not None:
            count, nbytes = (int(x) for x in arena)
            if count < 0 or nbytes < 1:
                raise ValueError(f"BufferPool.arena: need (count >= 0, nbytes >= 1), got {arena}")
            if count:
                slab = _alloc(kind, count * nbytes)
                if kind != "thp":
                    slab[::4096] = 0  # fault every page now, not in the first I/O
                self._arena = slab
                self._arena_lo, self._arena_hi = slab.ctypes.data, slab.ctypes.data + slab.nbytes
                self.arena_bytes = slab.nbytes
                self._free[nbytes] = [slab[i * nbytes:(i + 1) * nbytes] for i in range(count)]

    def _in_arena(self, buf: np.ndarray) -> bool:
        return self._arena_lo <= buf.ctypes.data < self._arena_hi

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly ``nbytes`` (contents: whatever its last user left). Reuses a free
        buffer of that size, else allocates one (never waits)."""
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                buf = lst.pop()
                if not self._in_arena(buf):
                    self._kept -= nbytes
                self.reused += 1
                return buf
            self.allocated += 1
        return _alloc(self.kind, nbytes)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`take`; its last reader/writer must be done with it. Buffers
        past the cap are dropped (freed when unreferenced)."""
        n = buf.nbytes
        with self._lock:
            if self._in_arena(buf):
                self._free.setdefault(n, []).append(buf)
                return
            if self._kept + n > self.keep_bytes and n <= self.keep_bytes:
                for size in list(self._free):
                    lst = self._free[size]
                    while size != n and self._kept + n > self.keep_bytes:
                        i = next((j for j, b in enumerate(lst) if not self._in_arena(b)), None)
                        if i is None:
                            break
                        lst.pop(i)
                        self._kept -= size
                    if not lst:
                        del self._free[size]
            if self._kept + n <= self.keep_bytes:
                self._free.setdefault(n, []).append(buf)
                self._kept += n

    def raise_keep(self, keep_bytes: int) -> int:
        """Raise the cap on kept free buffers to at least ``keep_bytes`` (bytes; never lowers it: a pool
        shared by several users keeps what the most demanding one asked for). Returns the cap now.
        Thread-safe."""
        with self._lock:
            self.keep_bytes = max(self.keep_bytes, int(keep_bytes))
            return self.keep_bytes

    @contextmanager
    def lend(self, nbytes: int) -> Iterator[np.ndarray]:
        """:meth:`take` as a context manager: the buffer is given back on exit."""
        buf = self.take(nbytes)
        try:
            yield buf
        finally:
            self.give(buf)

    def clear(self) -> None:
        """Drop every kept buffer allocated past the arena (arena buffers stay)."""
        with self._lock:
            for size in list(self._free):
                self._free[size] = [b for b in self._free[size] if self._in_arena(b)]
                if not self._free[size]:
                    del self._free[size]
            self._kept = 0

    def stats(self) -> dict:
        """``{name, kind, arena_bytes, kept_bytes, allocated, reused}`` (bytes and counts)."""
        with self._lock:
            return {"name": self.name, "kind": self.kind, "arena_bytes": self.arena_bytes,
                    "kept_bytes": self._kept, "allocated": self.allocated, "reused": self.reused}
