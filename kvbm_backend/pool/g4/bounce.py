"""Reusable bounce buffers for G4 object reads, on transparent huge pages where the kernel allows.

O_DIRECT reads into 4 KiB pages run at less than half speed on the dev/CI VM (measured in
:mod:`kvbm_backend.memory`); allocating per read also costs page faults and an ``munmap`` per object.
So a :class:`BouncePool` is one :func:`~kvbm_backend.memory.hugepage_empty` arena of
``slots * slot_bytes`` (rounded up to 4 KiB), handed out slot by slot.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ...memory import aligned_empty, hugepage_empty

PAGE = 4096


class BouncePool:
    """``slots`` buffers of ``slot_bytes`` (rounded up to 4 KiB), thread-safe.

    :meth:`slot` lends one as a context manager; when all are lent (more concurrent readers than
    ``slots``) it lends a fresh 4 KiB-aligned buffer instead, so callers never wait.

    Raises ValueError for ``slot_bytes`` or ``slots`` < 1.
    """

    def __init__(self, slot_bytes: int, slots: int):
        if slot_bytes < 1 or slots < 1:
            raise ValueError(f"BouncePool: slot_bytes ({slot_bytes}) and slots ({slots}) must be >= 1")
        self.slot_bytes = -(-slot_bytes // PAGE) * PAGE
        self._arena = hugepage_empty(self.slot_bytes * slots)
        self._free = [self._arena[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in range(slots)]
        self._mu = threading.Lock()
        self.overflow = 0  # loans served by a fresh buffer (all slots busy)

    @contextmanager
    def slot(self) -> Iterator[np.ndarray]:
        with self._mu:
            buf = self._free.pop() if self._free else None
            if buf is None:
                self.overflow += 1
        if buf is None:
            yield aligned_empty(self.slot_bytes)
            return
        try:
            yield buf
        finally:
            with self._mu:
                self._free.append(buf)
