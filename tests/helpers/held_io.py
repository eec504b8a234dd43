"""Slow I/O held at the OS boundary on :class:`threading.Event` handshakes, for "never stall decode" tests
(docs/invariants.md #3): :class:`HeldIO` holds the first ``os.<name>`` call on a chosen fd until released, so a test
asserts what returns while another thread is still inside that I/O, never how long anything took; ``guard_s`` is
a hang guard only. :func:`in_background` runs a call on a thread and says when it returned."""
from __future__ import annotations

import os
import threading
from typing import Any, Callable


class HeldIO:
    """Holds the first call of ``os.<name>`` whose fd passes ``match`` until :meth:`release` (every other call
    passes). ``inside`` is set once that call is held; a hold never released fails it after ``guard_s`` seconds."""

    def __init__(self, monkeypatch, name: str, match: Callable[[int], bool], guard_s: float):
        self.inside, self.released, self.real = threading.Event(), threading.Event(), getattr(os, name)
        self.match, self.held = match, False

        def hook(fd, *a):
            if not self.held and self.match(fd):
                self.held = True
                self.inside.set()
                assert self.released.wait(guard_s), "hang guard: the held I/O was never released"
            return self.real(fd, *a)
        monkeypatch.setattr(os, name, hook)

    def release(self) -> None:
        self.released.set()


def held_journal_write(monkeypatch, pool, guard_s: float) -> HeldIO:
    """A :class:`HeldIO` on the first ``os.write`` to G3 ``pool``'s journal (an append, under the pool's lock)."""
    return HeldIO(monkeypatch, "write", lambda fd: fd == pool.cat.journal.fd, guard_s)


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """Run ``fn`` on a daemon thread: ``(thread, done, out)``; ``done`` is set when it returned or raised, with
    ``out["value"]`` its result or ``out["error"]`` the exception."""
    done, out = threading.Event(), {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
        finally:
            done.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, out
