"""The in-memory G3 index: key -> slot in LRU order, with read pins.

A slot being read is pinned; eviction never picks a pinned slot, and a pinned slot that is deleted
or found corrupt is freed only when its last reader unpins it, so a reader is never handed a slot
that is being overwritten. Not thread-safe: the pool holds its lock around every call.
"""
from __future__ import annotations

from collections import OrderedDict

from ...model.namespace import BlockKey

Slot = tuple[int, int]


class LruIndex:
    def __init__(self) -> None:
        self._map: "OrderedDict[BlockKey, Slot]" = OrderedDict()
        self._pins: dict[Slot, int] = {}
        self._deferred: set[Slot] = set()  # removed from the map while pinned: free on last unpin

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._map

    def get(self, key: BlockKey, touch: bool = False) -> Slot | None:
        s = self._map.get(key)
        if s is not None and touch:
            self._map.move_to_end(key)
        return s

    def put(self, key: BlockKey, slot: Slot) -> None:
        self._map[key] = slot
        self._map.move_to_end(key)

    def items(self):
        """(key, slot) oldest first."""
        return list(self._map.items())

    def remove(self, key: BlockKey, slot: Slot | None = None) -> Slot | None:
        """Remove ``key`` (only if it still maps to ``slot`` when given). Returns the slot to free now,
        or None (absent, or pinned: freed by the last :meth:`unpin`)."""
        s = self._map.get(key)
        if s is None or (slot is not None and s != slot):
            return None
        del self._map[key]
        if self._pins.get(s):
            self._deferred.add(s)
            return None
        return s

    def pin(self, slot: Slot) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: Slot) -> Slot | None:
        """Returns the slot if it must be freed now (it was removed while pinned)."""
        n = self._pins.get(slot, 0) - 1
        if n > 0:
            self._pins[slot] = n
            return None
        self._pins.pop(slot, None)
        if slot in self._deferred:
            self._deferred.discard(slot)
            return slot
        return None

    @property
    def pinned(self) -> int:
        return len(self._pins)

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    def evict(self, n: int) -> list[tuple[BlockKey, Slot]]:
        """Remove up to ``n`` least recently used unpinned entries; returns them."""
        out = []
        for key, slot in self._map.items():
            if len(out) >= n:
                break
            if not self._pins.get(slot):
                out.append((key, slot))
        for key, _ in out:
            del self._map[key]
        return out
