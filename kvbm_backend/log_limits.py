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

A kind usually names what it is about (the G3 pools': ``"degraded {journal path}"``), and the limiters are module
globals, so a pool closed and opened again at the same path in one process (tests, a warm restart in place) met the
closed pool's budget: its first "tier degraded" WARNING within the minute was left out (before 2026-12-03). An owner
gives its subjects their own budget with :func:`forget` (every limiter's kinds naming them dropped) when it opens
and when it closes, so kinds of closed owners are not kept either (one entry per kind ever logged, before).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable

__all__ = ["LOG_EVERY_S", "LimitedLog", "forget"]

#: seconds between two lines of one kind
LOG_EVERY_S = 60.0
_ALL: "weakref.WeakSet[LimitedLog]" = weakref.WeakSet()  # every limiter alive (:func:`forget`)
_ALL_MU = threading.Lock()


class LimitedLog:
    """WARNING lines of ``logger``, at most one per kind per ``every_s`` seconds (``clock``: seconds, monotonic).
    Thread-safe; never raises for a full log (what ``logging`` does with a failing handler)."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.every_s, self._clock = logger, float(every_s), clock
        self._mu = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, lines left out since)
        with _ALL_MU:
            _ALL.add(self)

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

    def kinds(self) -> list[str]:
        """The kinds this limiter holds a budget for (logged within its life, not forgotten)."""
        with self._mu:
            return list(self._last)

    def forget(self, subjects: tuple[str, ...]) -> int:
        """Drop the kinds that name one of ``subjects``: the kind is one, or ends with a space and one (``"degraded
        /p/journal.log"`` names ``/p/journal.log``); the next line of each is logged. Returns how many."""
        ends = tuple(" " + s for s in subjects)
        with self._mu:
            gone = [k for k in self._last if k in subjects or k.endswith(ends)]
            for k in gone:
                del self._last[k]
        return len(gone)


def forget(*subjects: str) -> int:
    """Forget, in every :class:`LimitedLog` of the process, the kinds naming one of ``subjects`` (paths, names):
    an owner that opens gets its own budget (a closed one's at the same path is not its), and one that closes
    leaves no entry behind. Lines a forgotten kind left out are not named by a later line (the callers' counters
    counted them). Returns how many kinds were dropped. Never raises for an empty ``subjects``."""
    if not subjects:
        return 0
    with _ALL_MU:
        logs = list(_ALL)
    return sum(lg.forget(subjects) for lg in logs)
