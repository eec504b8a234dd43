"""G3 prefix lookups that never wait for the pool's lock (docs/invariants.md #3, never stall decode).

vLLM's scheduler thread asks :meth:`.pool.G3Pool.lookup_prefix` (the connector's scheduler role in the
single-GPU ``uni`` deployment, the native ``G3Tier``): an index probe of microseconds. Other threads hold the
same lock (:attr:`.catalog.SlotCatalog.lock`) across journal appends (an ``os.write``; on a stalled NFS mount or
drive, unbounded), so a lookup that waited for it stalled every engine step that long (reviewer, 2026-12-01:
3.9 s with a 2 s ``fsync``). Now a lookup takes the lock only if it is free at once; otherwise it is counted
(``stats()["lookups_deferred"]``) and finished on a thread (``kvbm-g3-lookup``, started when needed, ended when
no lookup waits), and its future resolves once that thread got the lock: the connector's lookup is then not
done yet and ``get_num_new_matched_tokens`` answers None (vLLM asks again next step), as for a G4 lookup.

The request counters (``lookup_blocks`` / ``lookup_hits``) are kept here under a lock of their own, so
counting a lookup never waits for the pool's lock either.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Any, Callable

from ...threads import start_thread
from ..base import completed
from .catalog import SlotCatalog


class G3Lookups:
    """Prefix lookups of one G3 pool's index (:meth:`lookup_prefix`) and their request counters.

    Args:
        cat: the pool's catalog (index and lock).
        fingerprint: the pool's namespace fingerprint (keys of another namespace are not held).
        on_count: called with ``(requested, found)`` for each counted lookup, without any lock held (the
            pool's metrics: matched tokens, hit rate).
    """

    def __init__(self, cat: SlotCatalog, fingerprint: str, on_count: Callable[[int, int], None]):
        self.cat, self.fp, self.on_count = cat, fingerprint, on_count
        self._mu = threading.Lock()  # guards the fields below (never held while waiting for cat.lock)
        self._queue: collections.deque[tuple[Future[int], Any, bool]] = collections.deque()
        self._thread: threading.Thread | None = None
        self.counts = {"lookup_blocks": 0, "lookup_hits": 0, "lookups_deferred": 0}

    def lookup_prefix(self, keys: Any, request: bool) -> Future[int]:
        """Future of the number of leading ``keys`` the index holds (found entries become most recently used);
        ``request``: count it (:meth:`count`). Resolved at once when the pool's lock is free, else once the
        lookup thread got it. Never blocks."""
        lock = self.cat.lock
        if lock.acquire(blocking=False):
            try:
                n = self.cat.index.lookup_prefix(keys, self.fp)  # vectorised: all keys probed at once
            finally:
                lock.release()
            if request:
                self.count(len(keys), n)
            return completed(n)
        fut: Future[int] = Future()
        with self._mu:
            self.counts["lookups_deferred"] += 1
            self._queue.append((fut, keys, request))
            if self._thread is None:
                self._thread = start_thread(self._run, name="kvbm-g3-lookup")
        return fut

    def count(self, requested: int, found: int) -> None:
        """Count a request's lookup: ``requested`` keys, ``found`` leading ones held. Never waits for the
        pool's lock."""
        with self._mu:
            self.counts["lookup_blocks"] += requested
            self.counts["lookup_hits"] += found
        self.on_count(requested, found)

    def snapshot(self) -> dict[str, int]:
        """The counters (``lookup_blocks``, ``lookup_hits``, ``lookups_deferred``)."""
        with self._mu:
            return dict(self.counts)

    def join(self, timeout: float | None) -> None:
        """Wait (pool lock NOT held) up to ``timeout`` s for the lookup thread, if one runs, to end."""
        with self._mu:
            t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self) -> None:
        """The lookup thread: answer the deferred lookups in order, waiting for the pool's lock; end when none
        is left."""
        while True:
            with self._mu:
                if not self._queue:
                    self._thread = None
                    return
                fut, keys, request = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self.cat.lock:
                    n = self.cat.index.lookup_prefix(keys, self.fp)
            except BaseException as e:  # noqa: BLE001 - the caller's future carries it (a lookup error is a miss)
                fut.set_exception(e)
                continue
            if request:
                self.count(len(keys), n)
            fut.set_result(n)
