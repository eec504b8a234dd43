"""Admission filters for offloads: which blocks are worth writing.

KVBM's default (``policy: frequency``) writes a block on its second sighting: the first offload of a
sequence hash is only remembered, a later one is admitted. The memory of sightings is a bounded LRU
of ``tracker_entries`` keys, so a block seen once long ago counts as new again.
``policy: all`` admits every offload.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable

from ...config import AdmissionConfig


class AdmitAll:
    policy = "all"

    def admit(self, key: Hashable) -> bool:
        return True


class FrequencyFilter:
    """Admit ``key`` once it has been offered ``min_sightings`` times (counting this one).

    Thread-safe. Memory: at most ``tracker_entries`` keys (LRU by last sighting).
    """

    policy = "frequency"

    def __init__(self, min_sightings: int = 2, tracker_entries: int = 1_000_000):
        if min_sightings < 1:
            raise ValueError(f"admission.min_sightings: must be >= 1, got {min_sightings}")
        if tracker_entries < 1:
            raise ValueError(f"admission.tracker_entries: must be >= 1, got {tracker_entries}")
        self.min_sightings = min_sightings
        self.tracker_entries = tracker_entries
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, key: Hashable) -> bool:
        """Record one sighting of ``key``; True if it has now been seen ``min_sightings`` times."""
        with self._lock:
            n = min(self._seen.pop(key, 0) + 1, self.min_sightings)
            self._seen[key] = n  # kept once admitted: a dropped or evicted block is admitted again at once
            while len(self._seen) > self.tracker_entries:
                self._seen.popitem(last=False)
            return n >= self.min_sightings

    def __len__(self) -> int:
        return len(self._seen)


def make_admission(cfg: AdmissionConfig) -> AdmitAll | FrequencyFilter:
    """The filter named by ``cfg.policy`` (``frequency`` or ``all``)."""
    if cfg.policy == "all" or cfg.min_sightings <= 1:
        return AdmitAll()
    return FrequencyFilter(cfg.min_sightings, cfg.tracker_entries)
