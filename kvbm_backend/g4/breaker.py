"""Circuit breaker: stop sending to a store that keeps failing, probe it now and then, recover alone.

States: ``closed`` (all requests pass), ``open`` after ``failures`` consecutive failures (every request
is refused at once for ``reset_s`` seconds: the caller turns it into a miss or a dropped offload),
``half_open`` (one probe request passes; success closes, failure re-opens for another ``reset_s``).
Thread-safe.
"""
from __future__ import annotations

import threading
import time


class CircuitBreaker:
    def __init__(self, failures: int = 5, reset_s: float = 5.0, clock=time.monotonic):
        if failures < 1 or reset_s <= 0:
            raise ValueError(f"breaker: failures >= 1 and reset_s > 0 required, got {failures}, {reset_s}")
        self.failures, self.reset_s, self._clock = failures, reset_s, clock
        self._mu = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probe_out = False
        self.opens = 0  # times it opened
        self.rejected = 0  # requests refused while open

    @property
    def state(self) -> str:
        with self._mu:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.reset_s:
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """True if a request may go out now (counts a rejection otherwise)."""
        with self._mu:
            st = self._state()
            if st == "closed":
                return True
            if st == "half_open" and not self._probe_out:
                self._probe_out = True
                return True
            self.rejected += 1
            return False

    def refuse_if_open(self) -> bool:
        """True (counting a rejection) while ``open``; False when closed or half-open, so a caller can
        refuse at once, before queueing work, and still let :meth:`allow` pick the half-open probe."""
        with self._mu:
            if self._state() == "open":
                self.rejected += 1
                return True
            return False

    def success(self) -> None:
        with self._mu:
            self._consecutive = 0
            self._opened_at = None
            self._probe_out = False

    def failure(self) -> None:
        with self._mu:
            self._consecutive += 1
            if self._probe_out or (self._opened_at is None and self._consecutive >= self.failures):
                if self._opened_at is None:
                    self.opens += 1
                self._opened_at = self._clock()
            self._probe_out = False
