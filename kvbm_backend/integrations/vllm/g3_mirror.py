"""The scheduler's copy of the worker's G3 index, when vLLM runs the scheduler and the worker in different
processes (:class:`G3Mirror`); fed by the worker's :class:`~.metadata.KvbmWorkerMeta` reports."""
from __future__ import annotations

import threading
from concurrent.futures import Future

from ...model.namespace import Namespace
from ...pool.base import completed
from .metadata import KvbmWorkerMeta, mirror_id


class G3Mirror:
    """The scheduler's view of the worker's G3 index when the worker runs in another process.

    Fed by :class:`KvbmWorkerMeta` reports (blocks published, blocks that failed to load, and a first
    snapshot of the restored index). It can be stale only towards "present": a block the worker has
    since evicted is planned, fails to load, is recomputed (never wrong KV) and reported removed.
    """

    tier = "G3"

    def __init__(self, namespace: Namespace):
        self.fp = namespace.fingerprint
        self._keys: set[tuple[bytes, int, int]] = set()  # metadata.mirror_id: (tenant tag, rank, seq_hash)
        self._lock = threading.Lock()
        self.ready = False

    def apply(self, meta: KvbmWorkerMeta) -> None:
        with self._lock:
            self._keys.difference_update(meta.removed)
            self._keys.update(meta.added)
            if meta.snapshot:
                self.ready = True

    def __len__(self) -> int:
        return len(self._keys)

    def lookup_prefix(self, keys) -> Future:
        n = 0
        with self._lock:
            for k in keys:
                if k.namespace != self.fp or mirror_id(k) not in self._keys:
                    break
                n += 1
        return completed(n)

    def stats(self) -> dict:
        return {"tier": "G3", "mirror": True, "blocks": len(self._keys), "ready": self.ready}

    def close(self) -> None:
        return
