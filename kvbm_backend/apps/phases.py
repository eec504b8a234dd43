"""Progress lines for long phases (the demo's engine start-up, waits on servers): one line when a phase
starts, one while it is still running every ``every_s`` seconds, and one when it ends, each with the
seconds elapsed since the :class:`Phases` was made, so a slow step is never silence.

Lines look like ``[  12.3 s] starting the Dynamo frontend and 3 workers ...`` and
``[  75.0 s] starting the Dynamo frontend and 3 workers: done in 62.7 s``. ``ci/install.sh`` prints
the same form for its install steps.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator


class Phases:
    """Timestamped progress lines.

    Args:
        write: takes one line (no newline); default: print to stderr, flushed.
        clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, write: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self._write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self._clock = clock
        self.t0 = clock()

    def elapsed(self) -> float:
        """Seconds since this object was made."""
        return self._clock() - self.t0

    def say(self, msg: str) -> None:
        """One line: ``[ELAPSED s] msg``."""
        self._write(f"[{self.elapsed():7.1f} s] {msg}")

    @contextmanager
    def phase(self, name: str) -> Iterator[Callable[[str], None]]:
        """``name ...`` now, ``name: done in S s`` (or ``name: failed after S s``) at the end. Yields a
        ``still(detail)`` callable that prints ``name: still running, S s (detail)``."""
        start = self._clock()
        self.say(f"{name} ...")

        def still(detail: str = "") -> None:
            self.say(f"{name}: still running, {self._clock() - start:.0f} s" + (f" ({detail})" if detail else ""))

        try:
            yield still
        except BaseException:
            self.say(f"{name}: failed after {self._clock() - start:.1f} s")
            raise
        self.say(f"{name}: done in {self._clock() - start:.1f} s")

    def heartbeat(self, still: Callable[[str], None], every_s: float = 15.0) -> Callable[[str], None]:
        """A ``report(detail)`` that forwards to ``still`` at most once per ``every_s`` seconds (for a wait
        loop that calls it on every poll)."""
        last = [self._clock()]

        def report(detail: str = "") -> None:
            now = self._clock()
            if now - last[0] >= every_s:
                last[0] = now
                still(detail)
        return report
