"""One thread that calls ``fn()`` at deadlines: load timeouts of G3 and G4 without a thread per request."""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

log = logging.getLogger(__name__)


class Deadlines:
    """Timer wheel of one daemon thread.

    Args:
        name: thread name (shows in py-spy / thread dumps).
    """

    def __init__(self, name: str = "kvbm-deadlines") -> None:
        self._heap: list = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._stop = False
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def add(self, at: float, fn) -> None:
        """Call ``fn()`` once ``time.monotonic() >= at`` (seconds)."""
        with self._cv:
            heapq.heappush(self._heap, (at, next(self._seq), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # noqa: BLE001 - a timer callback must not kill the thread
                log.exception("deadline callback failed")

    def close(self) -> None:
        """Stop the thread; pending callbacks are not called."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._t.join(timeout=5)
