"""The worker -> scheduler report channel (:mod:`kvbm_backend.integrations.vllm.report_channel`) against a
scheduler process that stops taking bytes: real Unix socket, real listener in a child process, SIGSTOP."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from kvbm_backend.integrations.vllm import report_channel as rc
from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
KEY = "s" * 24
N = 100_000  # entries of one report: 2.8 MB, far more than a Unix socket's buffer

# the scheduler's end: prints "ready", then one line per report it applied: "<group> <n added> <n removed>"
_LISTENER = """
import sys, threading
from kvbm_backend.integrations.vllm import report_channel as rc
def on_report(g, r, a, rm, snap):
    print(g, len(a), len(rm), flush=True)
lst = rc.ReportListener(sys.argv[1], on_report)
print("ready" if lst.path else "no channel", flush=True)
sys.stdin.read()
for t in threading.enumerate():  # each connection's thread ends when its worker's end is closed
    if t.name == "kvbm-report-recv":
        t.join()
"""


@pytest.fixture
def stalled_scheduler(monkeypatch):
    xdg = tempfile.mkdtemp(prefix="kvbm-rs-")  # short: a Unix socket path has at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=xdg)
    p = subprocess.Popen([sys.executable, "-c", _LISTENER, KEY], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        rc._local.clear()  # the scheduler is another process: only the socket
        live = rc.ReportSender(KEY)  # the channel works: a whole report is applied
        assert live.connect()
        live.send(0, 0, [(b"t" * 16, 0, 1)], [], True)
        assert p.stdout.readline().strip() == "0 1 0"
        live.close()
        yield p
    finally:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except OSError:
            pass
        p.kill()
        p.wait(HANG_S)
        shutil.rmtree(xdg, ignore_errors=True)


def _big_report(seed: int) -> tuple[list, list, bool]:
    return [(b"t" * 16, 0, seed * N + i) for i in range(N)], [], False


def test_a_stalled_scheduler_makes_the_worker_give_the_channel_up(stalled_scheduler, monkeypatch):
    """Review finding (2026-11-30): the worker's pump sent with a blocking ``sendall`` and no timeout, so a
    scheduler process that stopped reading (stopped, hung) blocked the pump thread forever: the channel
    never failed, the worker never went back to the step output (its reports reached nobody) and its
    pending report lists grew without bound. Now a send that the scheduler takes no bytes of for
    ``STALL_S`` seconds fails the channel: ``on_closed`` sends the reports back to the step output. On the
    old code ``on_closed`` is never called (the hang guard fails the test)."""
    monkeypatch.setattr(rc, "STALL_S", 0.5, raising=False)  # (absent in the old code)
    os.kill(stalled_scheduler.pid, signal.SIGSTOP)
    reports = [_big_report(0)]
    closed = threading.Event()
    snd = rc.ReportSender(KEY)
    rc._local.clear()  # the scheduler is another process: only the socket
    assert snd.connect()
    pump = rc.ReportPump(snd, [lambda: reports.pop() if reports else None], 0, interval_s=0.01,
                         on_closed=closed.set)
    try:
        assert closed.wait(HANG_S), "the pump stayed blocked on a scheduler that takes no bytes"
        with pytest.raises(OSError):  # given up: nothing more is sent on a channel that may have cut a message
            snd.send(0, 0, [(b"t" * 16, 0, 1)], [], False)
    finally:
        os.kill(stalled_scheduler.pid, signal.SIGCONT)
        pump.stop()
    out, _ = stalled_scheduler.communicate("", timeout=HANG_S)
    assert out == "", out  # the cut report was dropped by the scheduler, never half-applied


def test_stop_returns_while_the_pump_is_blocked_on_a_stalled_scheduler(stalled_scheduler):
    """Review finding (2026-11-30): ``ReportPump.stop`` (the connector's ``close`` at engine shutdown) joined
    the blocked pump thread for 2 s, then sent the last interval's report itself with a second ``sendall`` on
    the same socket: on a scheduler that takes no bytes it blocked forever (the engine never shut down), and
    its bytes could interleave with the blocked thread's cut message. Now ``stop`` gives the channel up (the
    blocked send returns with an error) and one pump runs at a time. On the old code ``stop`` does not
    return (the hang guard fails the test)."""
    os.kill(stalled_scheduler.pid, signal.SIGSTOP)
    reports = [_big_report(1), _big_report(0)]  # the pump thread blocks on the first; stop() has the second
    snd = rc.ReportSender(KEY)
    rc._local.clear()
    assert snd.connect()
    pump = rc.ReportPump(snd, [lambda: reports.pop() if reports else None], 0, interval_s=0.01)
    t = threading.Thread(target=pump.stop, daemon=True)
    try:
        end = threading.Event()
        for _ in range(int(HANG_S / 0.01)):  # until the pump thread took the first report (and blocks on it)
            if len(reports) < 2 or end.wait(0.01):
                break
        t.start()
        t.join(HANG_S)
        assert not t.is_alive(), "stop() blocked on a scheduler that takes no bytes"
    finally:
        os.kill(stalled_scheduler.pid, signal.SIGCONT)
    out, _ = stalled_scheduler.communicate("", timeout=HANG_S)
    assert out == "", out  # the cut first report is dropped, the second never sent: nothing half-applied
