"""Stop a real CLI process with SIGTERM once it has reached a point (what a job runner does to it)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable


def sigterm_when(argv: list[str], ready: Callable[[], bool], what: str, hang_s: float, poll_s: float = 0.05,
                 **popen) -> tuple[int, str, str]:
    """Start ``argv`` (stdout/stderr captured as text; ``popen``: more ``subprocess.Popen`` arguments), wait until
    ``ready()`` (a hang guard of ``hang_s`` seconds, failing with ``what``; the process must not end before), send
    SIGTERM and return ``(returncode, stdout, stderr)``. The process is killed if anything fails.

    It runs with ``PYTHONFAULTHANDLER=1``: a process still running ``hang_s`` seconds after the SIGTERM is sent
    SIGABRT, so Python writes every thread's stack to its stderr, and the AssertionError carries that stderr (CI
    2026-12-01 saw a ``bench --tier g3`` outlive its SIGTERM by 120 s, with nothing to tell where it was)."""
    popen["env"] = {**(popen.get("env") or os.environ), "PYTHONFAULTHANDLER": "1"}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        end = time.monotonic() + hang_s
        while not ready():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < end, f"hang guard: {what}"
            time.sleep(poll_s)
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=hang_s)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack to stderr, then the process dies
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            raise AssertionError(f"hang guard: still running {hang_s:.0f} s after SIGTERM; its stderr (stacks "
                                 f"at SIGABRT last):\n{err[-12000:]}") from None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, out, err
