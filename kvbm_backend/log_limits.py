"""WARNING lines a condition repeats per request, per block or per call, at most one per kind per minute
(docs/operations.md "Logs an operator sees": once per state change, never once per request).

Some conditions are found per request or per call: a decode request whose prefill worker's blocks did not all
arrive in time, hand-off parameters a client sent malformed, a layer-wise load with failed blocks (the connector,
``integrations/vllm``); a G3 journal that takes no appends or a slab drive gone (``pool/g3``: every put, every
emptied slot meets it again). Each used to log one WARNING per occurrence, so a slow G4, a misbehaving client or
a broken G3 journal grew the log at the request (or block) rate. With :class:`LimitedLog` the first of a kind is
logged, later ones within :data:`LOG_EVERY_S` are counted, and the next line logged says how many were left out;
the callers' counters count every one. Below every layer (no ``kvbm_backend`` import): the pools and the
integrations use it alike.
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
    """WARNING lines of ``logger``, at most one per kind per ``every_s`` seconds (``clock``: seconds, monotonic).
    Thread-safe; never raises for a full log (what ``logging`` does with a failing handler)."""

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
