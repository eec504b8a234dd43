"""After a failed connector start, a stop request ends the process even when Python drops the SystemExit of
the signal handler (issue 22 item 3; :mod:`kvbm_backend.integrations.vllm.start_failure`).

The child process below does what vLLM's worker does (a SIGTERM handler that raises SystemExit once) and
takes its SIGTERM while a weakref callback runs, as the hung worker of the issue did: Python prints
"Exception ignored in ..." and the SystemExit is lost. Real processes and signals, nothing mocked."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for a process that must end; returns as soon as it does

CHILD = r"""
import os, signal, sys, threading, time, weakref
once = threading.Event()
def vllm_like(signum, frame):  # vllm/v1/executor/multiproc_executor.py worker_main: SystemExit, once only
    if not once.is_set():
        once.set()
        raise SystemExit()
signal.signal(signal.SIGTERM, vllm_like)
if sys.argv[1] == "armed":
    from kvbm_backend.integrations.vllm.start_failure import arm_exit_on_stop
    assert arm_exit_on_stop(grace_s=2.0)
class Garbage:
    pass
def freed(_ref):  # the signal arrives while a weakref callback runs: its SystemExit is "ignored"
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        pass
g = Garbage()
r = weakref.ref(g, freed)
del g
print("survived the signal", flush=True)
time.sleep(120)
"""


def _start(mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_a_lost_systemexit_still_ends_an_armed_process():
    p = _start("armed")
    try:
        out, err = p.communicate(timeout=HANG_S)  # 2 s grace
    finally:
        p.kill()
    assert "survived the signal" in out and "Exception ignored" in err, err  # the loss really happened
    assert p.returncode == 1, err


def test_without_arming_the_process_lives_on():
    """The control: the same child without arm_exit_on_stop is still alive well past the grace period
    (this is the hang; the test above would fail without the fix)."""
    p = _start("plain")
    try:
        t0 = time.monotonic()
        line = p.stdout.readline()
        assert "survived the signal" in line, p.stderr.read()
        time.sleep(max(0.0, 8.0 - (time.monotonic() - t0)))
        assert p.poll() is None
    finally:
        p.kill()
        p.communicate()


def test_release_partial_releases_the_tiers_a_failed_start_took(tmp_path):
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations import tiers
    from kvbm_backend.integrations.vllm.start_failure import release_partial
    from tests.helpers.pools import tiny_ns
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.01}}, use_env=False)
    ns = tiny_ns("start-failure/model")
    g3, _ = tiers.shared_tiers(cfg, ns)

    class Half:  # a connector whose start failed after its first group's tiers were taken
        _groups = [(ns, cfg, g3, None)]

    half = Half()
    release_partial(half)
    assert half._groups == [] and tiers._skey(cfg, ns) not in tiers._shared
    assert g3._closed  # the last reference closed the pool
