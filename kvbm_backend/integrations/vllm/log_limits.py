"""The connector's per-request WARNING lines, at most one per kind per minute (docs/operations.md "Logs an
operator sees": once per state change, never once per request).

Some conditions are found per request: a decode request whose prefill worker's blocks did not all arrive within
``handoff_wait_s`` (or whose wait G4's open circuit breaker or a cooling failed block cut short), hand-off parameters a client sent malformed or for another block size, a layer-wise load with
failed blocks. Each used to log one WARNING per request, so a slow G4 or a misbehaving client grew the log at the
request rate (found in review, 2026-11-29: 100 lines for 50 timed-out and 50 malformed requests). Now the first
of a kind is logged with its request, later ones within :data:`LOG_EVERY_S` are counted, and the next line logged
says how many were left out. The connector's counters (``handoff_timeouts``, ``load_blocks_failed``...) count
every one.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["LOG_EVERY_S", "LimitedLog"]

#: seconds between two lines of one kind
LOG_EVERY_S = 60.0


class LimitedLog:
    """WARNING lines of ``logger``, at most one per kind per ``every_s`` seconds (``clock``: seconds, monotonic)."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.every_s, self._clock = logger, float(every_s), clock
        self._mu = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, lines left out since)

    def warning(self, kind: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless a line of ``kind`` was logged less than ``every_s`` ago (then it is counted
        and named by the next line of its kind). Returns whether it was logged."""
        now = self._clock()
        with self._mu:
            last, held = self._last.get(kind, (None, 0))
            if last is not None and now - last < self.every_s:
                self._last[kind] = (last, held + 1)
                return False
            self._last[kind] = (now, 0)
        if held and last is not None:
            msg += " (%d more like it in the last %.0f s were counted, not logged: one line per %.0f s)"
            args = (*args, held, now - last, self.every_s)
        self._log.warning(msg, *args)
        return True

    def reset(self) -> None:
        """Forget what was logged (the next line of every kind is logged)."""
        with self._mu:
            self._last.clear()
