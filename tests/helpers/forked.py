"""Waiting for a child the test forked itself (``os.fork``): its exit status, or a kill after a hang guard."""
from __future__ import annotations

import os
import signal
import time


def exit_status(pid: int, hang_s: float) -> int | None:
    """``pid``'s exit status once it ended; None when it still ran after ``hang_s`` seconds (then killed:
    a hang guard, not a bound)."""
    end = time.monotonic() + hang_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
