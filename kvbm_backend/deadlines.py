"""Deadlines, one implementation for the whole project.

:class:`Deadline`: a point in ``time.monotonic()`` time with the seconds left to it -- every bounded wait
(flush, load, lookup, close) computes what it may still wait with it. :class:`Deadlines`: one thread that
calls ``fn()`` at deadlines -- load timeouts of G3 and G4 without a thread per request.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from .threads import start_thread

log = logging.getLogger(__name__)


class Deadline:
    """A deadline ``timeout_s`` seconds from now (``None``: never).

    Args:
        timeout_s: seconds from now (>= 0 is meaningful; a negative value is already expired), or None.
    """

    __slots__ = ("at",)

    def __init__(self, timeout_s: float | None) -> None:
        self.at = None if timeout_s is None else time.monotonic() + timeout_s  # monotonic seconds

    def left(self) -> float | None:
        """Seconds left, never negative (0.0 once passed); None for no deadline. The value to pass as
        ``timeout=`` to ``Future.result`` / ``Condition.wait`` / ``Thread.join``."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed (never for None)."""
        return self.at is not None and time.monotonic() >= self.at


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
        self._t = start_thread(self._run, name=name)

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
