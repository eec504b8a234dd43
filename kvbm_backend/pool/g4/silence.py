"""Silence versus load: which G4 requests are out on a pool's I/O threads, and since when.

A G4 load or lookup that reaches its load bound with blocks not back is a store failure for the breaker
(:mod:`.breaker`) only when the store is silent: a request sent at least ``silent_s`` ago still has no reply (a
hung mount, a store that stopped answering; nothing else reports a read stuck in the kernel), its own or one of the
requests its blocks are queued behind. Blocks that expired only because they waited for the pool's I/O threads
(``g4.max_inflight``) behind requests that do answer are load, not a fault: before 2026-12-02 a burst of loads or of
lookups (the native tiers' background announcements among them) larger than the store's throughput within the load
bound opened the breaker, and every G4 load and lookup was refused for ``breaker_reset_s``.

``silent_s`` is half of ``g4.timeout_s`` (the per-attempt bound; :data:`SILENT_FRACTION`): a load bound is at least
``timeout_s`` plus a slack, so a request sent when its batch started has been out longer than that when the batch
expires, also where a busy host's thread hand-off delayed the sending.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")

__all__ = ["SILENT_FRACTION", "StoreCalls"]

SILENT_FRACTION = 0.5  # of g4.timeout_s: a request out this long without a reply is silence


class StoreCalls:
    """The store requests a G4 pool's reads and lookups have out (one instance per pool, shared by both: they run
    on the same I/O threads). ``silent_s``: seconds after which a request without a reply is silence (> 0)."""

    def __init__(self, silent_s: float) -> None:
        if not silent_s > 0:
            raise ValueError(f"silent_s: must be > 0 seconds, got {silent_s}")
        self.silent_s = float(silent_s)
        # thread id -> time.monotonic() its request was sent: a thread makes one request at a time; single dict
        # operations (and list() of its values) are atomic under the GIL, so the hot path takes no lock
        self._sent: dict[int, float] = {}

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (one store request), counted out while it runs; its exception propagates."""
        me = threading.get_ident()
        self._sent[me] = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._sent.pop(me, None)

    def silent(self) -> bool:
        """True when a request has been out for ``silent_s`` seconds or more without a reply."""
        now = time.monotonic()
        return now - min(list(self._sent.values()), default=now) >= self.silent_s
