"""Adapter: the G3 pool as a :class:`~kvbm_backend.gpu.loader.SlotSource` for the device loader.

Uses the pool's public ``locate`` (pins the slot, so a slot being read into HBM is never evicted and
rewritten underneath the read) and ``release_slot``. Corrupt slots are dropped with the pool's public
``delete`` (which journals the removal).
"""
from __future__ import annotations

import threading

from ..model.namespace import BlockKey
from .loader import SlotLocation


class G3SlotSource:
    """Args: pool: a :class:`kvbm_backend.pool.g3.pool.G3Pool`."""

    def __init__(self, pool):
        self.pool = pool
        self._pinned: dict[BlockKey, list] = {}
        self._lock = threading.Lock()

    def locate(self, key: BlockKey) -> SlotLocation | None:
        loc = self.pool.locate(key)
        if loc is None:
            return None
        path, offset, slot_len, token = loc
        with self._lock:
            self._pinned.setdefault(key, []).append(token)
        return SlotLocation(path, offset, slot_len)

    def release(self, key: BlockKey) -> None:
        with self._lock:
            tokens = self._pinned.get(key)
            if not tokens:
                return
            token = tokens.pop()
            if not tokens:
                del self._pinned[key]
        self.pool.release_slot(token)

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        self.pool.delete([key]).result(timeout=10)
