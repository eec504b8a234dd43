"""A pool's timer thread held on an Event: the bound of a test whose subject is a short bound fires only after the part
that must succeed within it has, however long the busy CI VM froze a thread (13-31 s, 2026-11-29).

A G4 pool's load and lookup bounds (and its writer's settle checks) are callbacks on its one timer thread
(:class:`kvbm_backend.deadlines.Deadlines`, ``G4Pool._deadlines``). :class:`HeldTimer` puts a callback due at once on
it that waits on an Event: while held nothing else due runs (a batch past its bound stays open); :meth:`HeldTimer.release`
lets it go on, running at once what is due. A test holds it, starts the batch, waits for the state the succeeding half
reaches (every read but the stalled one back, a wave answered, a block verified), then releases: the bound then fires
as it would on an idle machine, at its own time or at once if it already passed. Nothing is timed; ``guard_s`` is a
hang guard only."""
from __future__ import annotations

import threading
import time
from typing import Callable

from kvbm_backend.deadlines import Deadlines

GUARD_S = 600.0  # hang guards only


class HeldTimer:
    """Holds ``deadlines``' thread from construction (it waits until the thread is inside the hold) until
    :meth:`release` (idempotent; also on leaving a ``with`` block, so a failing test never leaves it held)."""

    def __init__(self, deadlines: Deadlines, guard_s: float = GUARD_S):
        self.inside, self._go, self._guard_s = threading.Event(), threading.Event(), guard_s
        deadlines.add(0.0, self._hold)  # due before anything the test starts afterwards
        assert self.inside.wait(guard_s), "hang guard: the pool's timer thread never ran the hold"

    def _hold(self) -> None:
        self.inside.set()
        self._go.wait(self._guard_s)

    def release(self) -> None:
        self._go.set()

    def __enter__(self) -> HeldTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def wait_for(cond: Callable[[], bool], what: str, guard_s: float = GUARD_S) -> None:
    """Poll ``cond`` until true (``guard_s``: a hang guard naming ``what``)."""
    guard = time.monotonic() + guard_s
    while not cond():
        assert time.monotonic() < guard, f"hang guard: {what}"
        time.sleep(0.002)
