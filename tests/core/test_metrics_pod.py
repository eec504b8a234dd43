"""One ``metrics.port`` endpoint for the processes of a pod (:mod:`kvbm_backend.metrics_mp`): real processes
(:mod:`tests.helpers.metrics_proc`), a real directory, real sockets; each test has its own ``XDG_RUNTIME_DIR``."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.helpers.metrics_proc import MetricsProc
from tests.helpers.prom import free_port as _free_port, scrape as _scrape

HANG_GUARD_S = 600.0  # a bound for what happens at once: generous, the unit lane runs at nice 19 on a busy 2-core VM


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


def _rename_files_of(xdg, pid: int, to: int) -> int:
    """Give every file of process ``pid`` (ended) the name process ``to`` would have: what a later process
    with the same pid finds (pids repeat in a fresh PID namespace). Returns how many were renamed."""
    n = 0
    for f in xdg.rglob(f"*_{pid}.*"):
        f.rename(f.with_name(f.name.replace(f"_{pid}.", f"_{to}.")))
        n += 1
    return n


def test_processes_with_the_pids_of_an_earlier_run_start_from_zero(tmp_path):
    """Review finding (metrics 2): a container restarted with a persisting XDG_RUNTIME_DIR (or /tmp) runs in
    a fresh PID namespace, so its processes get the pids of the previous run's: a process reopened its dead
    namesake's files and continued its counters, and the old labelled series (load_misses{reason="corrupt"})
    were served again. A process whose pid still had files was also taken for a live member of the run, so
    the earlier run's files were not cleaned at all. Now liveness is a flock each process holds, and the new
    run starts from zero. Here z gets x's files and w (running, not yet started) y's."""
    port, xdg = _free_port(), _xdg(tmp_path)
    x = MetricsProc(port, tmp_path / "x.log", xdg)
    y = MetricsProc(port, tmp_path / "y.log", xdg)
    try:
        x.cmd("inc 7 corrupt")
        y.cmd("inc 4 corrupt")
        assert _scrape(port)[OFFLOADS] == 11
    finally:
        x.quit()
        y.quit()
    z = MetricsProc(port, tmp_path / "z.log", xdg, start=False)
    w = MetricsProc(port, tmp_path / "w.log", xdg, start=False)
    try:
        assert _rename_files_of(xdg, x.pid, z.pid) >= 3 and _rename_files_of(xdg, y.pid, w.pid) >= 3
        assert z.start() and w.start()
        z.cmd("inc 2")
        w.cmd("inc 1")
        page = _scrape(port)
    finally:
        z.quit()
        w.quit()
    assert (page[OFFLOADS], page[CAPACITY]) == (3, 2000), page
    assert not any("corrupt" in k for k in page), page


def test_a_namesake_of_a_process_that_ended_in_this_run_leaves_its_counts_in_the_sums(tmp_path):
    """A pid reused while the run goes on (d ended, n got its pid): n starts from zero and d's counts stay
    in the sums (never removed while a process of the run lives); d's capacity is not counted again."""
    port, xdg = _free_port(), _xdg(tmp_path)
    s = MetricsProc(port, tmp_path / "s.log", xdg)
    procs = [s]
    try:
        s.cmd("inc 5")
        d = MetricsProc(port, tmp_path / "d.log", xdg)
        procs.append(d)
        d.cmd("inc 3 corrupt")
        d.quit()
        n = MetricsProc(port, tmp_path / "n.log", xdg, start=False)
        procs.append(n)
        assert _rename_files_of(xdg, d.pid, n.pid) >= 3
        assert n.start()
        page = _scrape(port)
        assert (page[OFFLOADS], page['kvbm_backend_g3_load_misses_total{reason="corrupt"}']) == (8, 1), page
        assert page[CAPACITY] == 2000, page
        n.cmd("inc 1")
        assert _scrape(port)[OFFLOADS] == 9
    finally:
        for p in procs:
            p.quit()


def test_a_forked_child_is_a_live_process_of_the_pod(tmp_path):
    """A process forked after its series exist writes its own files and holds its own live lock: its live
    gauges count while it lives, and its counters add to the sums."""
    port, xdg = _free_port(), _xdg(tmp_path)
    p = MetricsProc(port, tmp_path / "p.log", xdg)
    try:
        p.cmd("inc 5")
        assert p.cmd("fork 3").startswith("ok ")
        page = _scrape(port)
    finally:
        p.quit()
    assert (page[OFFLOADS], page[CAPACITY]) == (8, 1500), page


def test_an_address_that_cannot_be_served_is_one_error_and_a_sibling_serves(tmp_path):
    """Review finding (metrics 3): serve_once caught only OSError; an address getaddrinfo refuses with a
    UnicodeError ("bad..addr", now refused by the config as well) escaped it with the serve lock still held:
    no ERROR line, and the pod's other processes were told the port is served while nothing served it. Now
    any failure to serve is the documented ERROR, the lock is released, and a sibling serves."""
    port, xdg = _free_port(), _xdg(tmp_path)
    bad = MetricsProc(port, tmp_path / "bad.log", xdg, start=False, addr="bad..addr")
    procs = [bad]
    try:
        assert not bad.start() and bad.serving == "serving False", bad.serving
        good = MetricsProc(port, tmp_path / "good.log", xdg)
        procs.append(good)
        good.cmd("inc 2")
        bad.cmd("inc 3")
        assert _scrape(port)[OFFLOADS] == 5
    finally:
        for p in procs:
            p.quit()
    bad_log, good_log = (tmp_path / "bad.log").read_text(), (tmp_path / "good.log").read_text()
    errors = [ln for ln in bad_log.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and f"metrics.port {port}: cannot serve" in errors[0], bad_log
    assert "WITHOUT a metrics endpoint" in errors[0]
    assert f"serving Prometheus metrics on http://127.0.0.1:{port}/metrics" in good_log, good_log


def _unshare_pid() -> tuple[str, ...]:
    """A command prefix that runs a process as pid 1 of a new PID namespace (skips where that is refused)."""
    cmd = ("unshare", "--pid", "--fork", "--kill-child")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    if subprocess.run([*cmd, "true"], capture_output=True, timeout=HANG_GUARD_S).returncode != 0:
        pytest.skip("unshare --pid refused (needs root or user namespaces)")
    return cmd


def test_two_live_processes_with_one_pid_keep_their_own_series(tmp_path):
    """Review finding (metrics_mp 1): two containers of a pod sharing the directory have their own PID
    namespaces, so two live processes can have one pid (here both are pid 1). The second took the first's
    files for a dead namesake's: it renamed the first's counter file, removed its capacity gauge (capacity
    1000 instead of 2000), and both wrote counter_1.db. Now each process's files carry a random part of its
    own: both count, both capacities are summed, the first's counts stay in the sums once it ends, and a new
    run still starts from zero."""
    ns = _unshare_pid()
    port, xdg = _free_port(), _xdg(tmp_path)
    a = MetricsProc(port, tmp_path / "a.log", xdg, prefix=ns)
    procs = [a]
    try:
        b = MetricsProc(port, tmp_path / "b.log", xdg, prefix=ns)
        procs.append(b)
        assert a.pid == b.pid == 1
        a.cmd("inc 5")
        b.cmd("inc 7")
        page = _scrape(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (12, 2000), page
        a.cmd("inc 1")
        b.cmd("inc 1")
        page = _scrape(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (14, 2000), page
        a.quit()  # the serving process ends; b serves
        page = _scrape_when_served(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (14, 1000), page
    finally:
        for p in procs:
            p.quit()
    c = MetricsProc(port, tmp_path / "c.log", xdg)
    try:
        c.cmd("inc 2")
        page = _scrape_when_served(port)
    finally:
        c.quit()
    assert (page[OFFLOADS], page[CAPACITY]) == (2, 1000), page


HIT_RATES = ("kvbm_disk_cache_hit_rate", "kvbm_object_cache_hit_rate")
THROTTLED = tuple(f'kvbm_backend_g4_throttled_total{{op="{op}"}}' for op in ("get", "head", "put"))


def test_the_hit_rates_and_throttle_counts_are_on_the_page_at_zero_before_any_traffic(tmp_path):
    """Review finding (observability 2): on the pod's shared page the hit-rate gauges (most recent value of
    the pod's processes) were absent until a process first counted a lookup, since MultiProcessCollector
    shows only a value stamped later than 0 and an unset gauge is stamped 0; and no
    ``kvbm_backend_g4_throttled_total{op}`` series existed until the store first throttled (the dashboard
    said "No data"). Now each is on the page at 0 from the start; a hit rate a process records wins over
    the 0 of a process that started after it."""
    port, xdg = _free_port(), _xdg(tmp_path)
    procs = []
    try:
        a = MetricsProc(port, tmp_path / "a.log", xdg)
        procs.append(a)
        page = _scrape(port)
        assert [page.get(k) for k in HIT_RATES + THROTTLED] == [0.0] * 5, page
        a.cmd("hit 4 3")
        assert _scrape(port)["kvbm_disk_cache_hit_rate"] == 0.75
        b = MetricsProc(port, tmp_path / "b.log", xdg)  # a later process: its own hit rate, not set yet
        procs.append(b)
        page = _scrape(port)
        assert [page.get(k) for k in HIT_RATES + THROTTLED] == [0.75, 0.0, 0.0, 0.0, 0.0], page
        b.cmd("hit 4 1")
        assert _scrape(port)["kvbm_disk_cache_hit_rate"] == 0.25
    finally:
        for p in procs:
            p.quit()


def test_a_full_metrics_filesystem_is_a_warning_and_the_process_serves_its_own_series(tmp_path):
    """Review finding (metrics_mp 2): prometheus_client maps its files sparse, and the first write to a page
    of one on a full filesystem (a full /tmp or $XDG_RUNTIME_DIR) is a SIGBUS: the engine process died at
    start ("Bus error", exit 135, no Python error, no log line). Now the files are allocated before they are
    mapped: a full filesystem is one WARNING naming metrics.port and the cause, and the process runs on with
    its series in memory, served on the port. Here the process runs in a mount namespace of its own where
    ``XDG_RUNTIME_DIR`` is a 256 KiB tmpfs filled up before it starts."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=HANG_GUARD_S).returncode != 0:
        pytest.skip("unshare -rm refused (needs user namespaces)")
    full = ("unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$XDG_RUNTIME_DIR" && '
            '{ head -c 1048576 /dev/zero > "$XDG_RUNTIME_DIR/fill" 2>/dev/null; exec "$@"; }', "sh")
    port = _free_port()
    p = MetricsProc(port, tmp_path / "p.log", _xdg(tmp_path), prefix=full)
    try:
        assert p.serving == "serving True", p.log.read_text()
        assert p.cmd("inc 4") == "ok"
        page = _scrape(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (4, 1000), page
        log = p.log.read_text()
        assert f"metrics.port {port}: no multiprocess metrics directory" in log, log
        assert "No space left on device" in log, log
    finally:
        p.quit()
    assert p.p.returncode == 0, (p.p.returncode, p.log.read_text())


def test_a_series_file_that_grows_stays_allocated_on_disk(tmp_path):
    """The same finding, for a file that outgrows its first 64 KiB: prometheus_client grows it with a
    truncate (sparse: the new pages, once written through the map, are a SIGBUS on a full filesystem); the
    package's dict allocates the grown size first. A real file on the test's filesystem: every byte of its
    size is allocated (``st_blocks``) after 100 KiB of series."""
    from kvbm_backend.metrics_mp import _AllocatedDict

    path = str(tmp_path / "counter_1.0000000000000000.db")
    d = _AllocatedDict(path)
    try:
        for i in range(1000):  # ~100 bytes each
            d.write_value(f'["kvbm_test", "kvbm_test_total", {{"n": "{i:08d}"}}, "a test series"]', i, 0.0)
        st = os.stat(path)
        assert st.st_size > 1 << 16, st.st_size
        assert st.st_blocks * 512 >= st.st_size, (st.st_blocks * 512, st.st_size)
    finally:
        d.close()
    assert sorted(os.listdir(tmp_path)) == ["counter_1.0000000000000000.db"]  # no temporary file left
