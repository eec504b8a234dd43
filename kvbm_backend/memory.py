"""Host buffers aligned for O_DIRECT / GDS (4 KiB)."""
from __future__ import annotations

import numpy as np

ALIGN = 4096


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
