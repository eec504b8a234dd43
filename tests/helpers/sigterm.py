"""Stop a real CLI process with SIGTERM once it has reached a point (what a job runner does to it)."""
from __future__ import annotations

import signal
import subprocess
import time
from typing import Callable


def sigterm_when(argv: list[str], ready: Callable[[], bool], what: str, hang_s: float, poll_s: float = 0.05,
                 **popen) -> tuple[int, str, str]:
    """Start ``argv`` (stdout/stderr captured as text; ``popen``: more ``subprocess.Popen`` arguments), wait until
    ``ready()`` (a hang guard of ``hang_s`` seconds, failing with ``what``; the process must not end before), send
    SIGTERM and return ``(returncode, stdout, stderr)``. The process is killed if anything fails."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        end = time.monotonic() + hang_s
        while not ready():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < end, f"hang guard: {what}"
            time.sleep(poll_s)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=hang_s)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err
