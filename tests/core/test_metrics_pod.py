"""One ``metrics.port`` endpoint for the processes of a pod (:mod:`kvbm_backend.metrics_mp`): real processes
(:mod:`tests.helpers.metrics_proc`), a real directory, real sockets; each test has its own ``XDG_RUNTIME_DIR``."""
from __future__ import annotations

import socket
import time
import urllib.request

from tests.helpers.metrics_proc import MetricsProc

HANG_GUARD_S = 120.0  # a bound for what happens at once, on a busy 2-core CI machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _scrape_when_served(port: int) -> dict[str, float]:
    """The page, once some process serves the port (polled; fails after the hang guard)."""
    end = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            return _scrape(port)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _xdg(tmp_path):
    d = tmp_path / "xdg"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


OFFLOADS = "kvbm_offload_blocks_h2d_total"
CAPACITY = "kvbm_backend_g3_capacity_bytes"


def test_a_sibling_serves_when_the_serving_process_dies_and_no_count_is_lost(tmp_path):
    """Review finding (metrics 1): the serving process of a pod died (OOM, crash) while its siblings ran on:
    nothing served the port any more, and the process restarted in its place took the lock and removed the
    dead server's counter files, so the summed counters went down (15 -> 11: a counter reset for Prometheus).
    Now a sibling takes over serving at once, and the counters of processes that ended stay in the sums."""
    port, xdg = _free_port(), _xdg(tmp_path)
    procs = []
    try:
        a = MetricsProc(port, tmp_path / "a.log", xdg)
        procs.append(a)
        b = MetricsProc(port, tmp_path / "b.log", xdg)
        procs.append(b)
        a.cmd("inc 10")
        b.cmd("inc 5")
        page = _scrape(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (15, 2000)
        a.kill()  # the serving process dies; b runs on
        page = _scrape_when_served(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (15, 1000)  # a's counts stay; its capacity went with it
        b.cmd("inc 5")
        assert _scrape(port)[OFFLOADS] == 20
        a2 = MetricsProc(port, tmp_path / "a2.log", xdg)  # the supervisor restarts the process that died
        procs.append(a2)
        a2.cmd("inc 1")
        page = _scrape(port)
        assert (page[OFFLOADS], page['kvbm_backend_g3_load_misses_total{reason="absent"}']) == (21, 4)
    finally:
        for p in procs:
            p.quit()
    b_log, a2_log = (tmp_path / "b.log").read_text(), (tmp_path / "a2.log").read_text()
    assert f"metrics.port {port} is served by process {a.pid} of this pod" in b_log, b_log
    assert f"serving Prometheus metrics on http://127.0.0.1:{port}/metrics" in b_log, b_log
    assert f"took over from process {a.pid}" in b_log, b_log
    assert f"metrics.port {port} is served by process {b.pid} of this pod" in a2_log, a2_log
    assert "ERROR" not in b_log + a2_log


def test_a_new_run_starts_its_counters_from_zero(tmp_path):
    """The counters of a run whose processes have all ended are not carried into the next run (the pod
    restarted: Prometheus expects counters to restart too)."""
    port, xdg = _free_port(), _xdg(tmp_path)
    old = MetricsProc(port, tmp_path / "old.log", xdg)
    try:
        old.cmd("inc 7 corrupt")
        assert _scrape(port)[OFFLOADS] == 7
    finally:
        old.quit()
    new = MetricsProc(port, tmp_path / "new.log", xdg)
    try:
        new.cmd("inc 2")
        page = _scrape_when_served(port)
    finally:
        new.quit()
    assert page[OFFLOADS] == 2 and page[CAPACITY] == 1000
    assert not any("corrupt" in k for k in page), page
