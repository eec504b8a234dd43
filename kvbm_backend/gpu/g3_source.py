"""Adapter: the G3 pool as a :class:`~kvbm_backend.gpu.loader.SlotSource` for the device loader.

Uses the pool's public ``locate`` / ``release_slot`` when it has them (the seam asked of the G3 pool:
``locate(key) -> (path, offset, slot_len) | None`` pinning the slot, ``release_slot(key)`` unpinning
it); until then it pins through the pool's index under the pool's lock exactly as ``G3Pool.get`` does,
so a slot being read into HBM is never evicted and rewritten underneath the read. Corrupt slots are
dropped with the pool's public ``delete`` (which journals the removal).
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
        p = self.pool
        if hasattr(p, "locate"):
            loc = p.locate(key)
            return None if loc is None else SlotLocation(*loc) if not isinstance(loc, SlotLocation) else loc
        with p._lock:
            slot = p.index.get(key, touch=True) if key.namespace == p.fp else None
            if slot is None:
                return None
            p.index.pin(slot)
            f = p.slabs.by_index[slot[0]]
        with self._lock:
            self._pinned.setdefault(key, []).append(slot)
        return SlotLocation(f.path, slot[1] * p.slot_bytes, p.slot_bytes)

    def release(self, key: BlockKey) -> None:
        p = self.pool
        if hasattr(p, "release_slot"):
            p.release_slot(key)
            return
        with self._lock:
            slots = self._pinned.get(key)
            if not slots:
                return
            slot = slots.pop()
            if not slots:
                del self._pinned[key]
        with p._lock:
            free = p.index.unpin(slot)
            if free is not None:
                p.slabs.release([free])

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        self.pool.delete([key]).result(timeout=10)
