"""A process of the pod that forks (multiprocessing's fork, an engine forking its workers) while it serves
``metrics.port``, waits to, or while another of its threads is inside :mod:`kvbm_backend.metrics`: real forks
(of this process, or of :mod:`tests.helpers.metrics_proc` processes), real sockets scraped over HTTP, a real
directory (each test has its own ``XDG_RUNTIME_DIR``)."""
from __future__ import annotations

import os
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from tests.helpers.forked import exit_status
from kvbm_backend import metrics, metrics_mp
from tests.helpers.metrics_proc import MetricsProc
from tests.helpers.prom import free_port, scrape

HANG_S = 120.0  # a bound for what happens at once (a child's metrics calls, a sibling taking over serving)
OFFLOADS = "kvbm_offload_blocks_h2d_total"
CAPACITY = "kvbm_backend_g3_capacity_bytes"


def _exit_status(pid: int) -> int | None:
    """``pid``'s exit status once it ended; None when it still ran after :data:`HANG_S` (then killed)."""
    return exit_status(pid, HANG_S)


class _HeldRegistry(CollectorRegistry):
    """Registering a metric here holds the thread :attr:`hold` names inside it (in ``metrics._lock``)."""

    def __init__(self, hold):
        super().__init__()
        self.hold = hold

    def register(self, collector):
        self.hold()
        super().register(collector)


class _HeldGauge(Gauge):
    hold = staticmethod(lambda: None)

    def set(self, value: float) -> None:
        self.hold()
        super().set(value)


@pytest.mark.parametrize("held", ["metrics._lock", "metrics._serve_lock", "HitRate._lock"])
def test_a_child_forked_while_another_thread_is_inside_metrics_can_use_metrics(monkeypatch, held):
    """Review finding (metrics fork 1): metrics.py's module locks (``_lock``: creating series, counting an
    unlisted reason; ``_serve_lock``: serve_once) and each hit rate's lock were plain locks, which a forked
    child inherits as they were: a child forked while another thread held one hung at its first metrics call
    (opening a tier's series, serving, a lookup's hit rate), for ever. Now the child gets new locks at the
    fork. Here a thread of this process is held inside the lock (deterministically) while this process forks;
    the child opens a tier's series, counts, records a hit rate on the parent's window and serves (scraped)."""
    inside, release = threading.Event(), threading.Event()
    holder: list[threading.Thread] = []

    def hold() -> None:
        if holder and threading.current_thread() is holder[0]:
            inside.set()
            release.wait(HANG_S)

    parent_port, child_port = free_port(), free_port()
    real_start = metrics.start_http_server

    def start_http_server(*a, **kw):
        hold()
        return real_start(*a, **kw)

    gauge = _HeldGauge("kvbm_held_hit_rate", "h", registry=CollectorRegistry())
    gauge.hold = hold  # type: ignore[method-assign]
    rate = metrics.HitRate(gauge, window=8)
    rate.record(4, 3)
    if held == "metrics._lock":  # creating a series: inside _get, registering it
        target = lambda: metrics.counter("kvbm_held", "h", registry=_HeldRegistry(hold))  # noqa: E731
    elif held == "metrics._serve_lock":  # serve_once, binding the port
        monkeypatch.setattr(metrics, "start_http_server", start_http_server)
        target = lambda: metrics.serve_once(parent_port, "127.0.0.1")  # noqa: E731
    else:  # a lookup's hit rate, setting its gauge
        target = lambda: rate.record(4, 1)  # noqa: E731
    # the window the child sees: (4, 3), the held thread's (4, 1) if it is inside record, then the child's (4, 0)
    expected = 1 / 8 if held == "HitRate._lock" else 3 / 8
    holder.append(threading.Thread(target=target))
    holder[0].start()
    try:
        assert inside.wait(HANG_S), "the holding thread never got inside"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                tier = metrics.TierMetrics("g3", metrics.new_registry(), reasons={"misses": {"absent": "a"}})
                tier.offload_blocks.inc(3)
                metrics.count_reason(tier.misses, {"absent": "a"}, "absent")
                rate.record(4, 0)
                assert rate.value == pytest.approx(expected)  # the parent's window, the child's lookup
                assert metrics.serve_once(child_port, "127.0.0.1")
                assert scrape(child_port, timeout=HANG_S)  # served by the child, scraped over HTTP
                metrics.stop_serving(child_port, "127.0.0.1")
                code = 0
            finally:
                os._exit(code)
    finally:
        release.set()
        holder[0].join(HANG_S)
        metrics.stop_serving(parent_port, "127.0.0.1")
    assert _exit_status(pid) == 0, f"the child hung (killed after {HANG_S} s) or failed, {held} held at the fork"


def _xdg(tmp_path):
    d = tmp_path / "xdg"
    d.mkdir(mode=0o700)
    return d


def _scrape_when_served(port: int) -> dict[str, float]:
    """The page, once some process serves the port (polled; fails after :data:`HANG_S`)."""
    end = time.monotonic() + HANG_S
    while True:
        try:
            return scrape(port, timeout=HANG_S)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _end(procs: list[MetricsProc]) -> None:
    for p in procs:
        p.quit()
        p.p.stdin.close()  # type: ignore[union-attr]  # ends its children that outlive it


@pytest.mark.slow
def test_a_child_forked_from_the_serving_process_leaves_serving_to_the_pod_when_it_ends(tmp_path):
    """Review finding (metrics fork 2): a child forked without exec from the serving process inherited the
    serve lock's descriptor (close-on-exec covers exec, not fork) and the listening socket, and its module
    state said "serving": when the serving process died, the child kept the lock and the port, so no sibling
    took over (scrapes hung) until the child ended, and the child's own serve_once claimed to serve. Now the
    child closes both at the fork (the parent keeps its lock: an flock belongs to the open file description,
    which the parent's descriptor keeps) and forgets the parent's server: its serve_once joins the pod as
    any process does (waits for the lock). When the serving process dies, a sibling or the child serves."""
    port, xdg = free_port(), _xdg(tmp_path)
    procs: list[MetricsProc] = []
    try:
        a = MetricsProc(port, tmp_path / "a.log", xdg)
        procs.append(a)
        assert a.serving == "serving True"
        b = MetricsProc(port, tmp_path / "b.log", xdg)
        procs.append(b)
        a.cmd("inc 10")
        b.cmd("inc 5")
        ok, child, served = a.cmd("fork 3 outlive serve").split()
        assert (ok, served) == ("ok", "True")
        fd, holder = metrics_mp.take_serve_lock(_dir(xdg, port))
        metrics_mp.drop_serve_lock(fd)
        assert (fd, holder) == (None, str(a.pid))  # the child closed its copy: a still holds the lock
        page = scrape(port, timeout=HANG_S)
        assert (page[OFFLOADS], page[CAPACITY]) == (18, 2500)
        a.kill()  # the serving process dies; its child and b run on
        page = _scrape_when_served(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (18, 1500)  # served again: b's and the child's capacity
        b.cmd("inc 1")
        assert scrape(port, timeout=HANG_S)[OFFLOADS] == 19
    finally:
        _end(procs)
    a_log, b_log = (tmp_path / "a.log").read_text(), (tmp_path / "b.log").read_text()
    waits = f"{child} INFO kvbm_backend: metrics.port {port} is served by process {a.pid} of this pod"
    assert waits in a_log, a_log  # the child's serve_once found the parent serving, as a sibling does
    assert f"took over from process {a.pid}" in a_log + b_log, (a_log, b_log)
    assert "ERROR" not in a_log + b_log


def _dir(xdg, port: int) -> str:
    return os.path.join(str(xdg), f"kvbm-backend-{os.getuid()}", f"metrics-{port}")


@pytest.mark.slow
def test_a_child_forked_from_a_waiting_sibling_does_not_keep_the_lock_it_takes_over(tmp_path):
    """Review finding (metrics fork 2, the waiting side): a sibling waits for the serve lock in a thread,
    blocked on a descriptor a child forked meanwhile inherited. Once the sibling took over serving, the lock
    belonged to the child's copy as well: when the sibling died, the child kept the port's lock and no other
    process served until the child ended. Now the child closes the waiting descriptor at the fork (and its
    state says neither serving nor waiting)."""
    port, xdg = free_port(), _xdg(tmp_path)
    procs: list[MetricsProc] = []
    try:
        a = MetricsProc(port, tmp_path / "a.log", xdg)
        procs.append(a)
        b = MetricsProc(port, tmp_path / "b.log", xdg)  # waits for a's lock
        procs.append(b)
        a.cmd("inc 10")
        b.cmd("inc 5")
        ok, _child = b.cmd("fork 2 outlive").split()
        assert ok == "ok"
        a.kill()  # b alone waits: it serves
        page = _scrape_when_served(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (17, 1500)  # b serves: b's and its child's capacity
        d = MetricsProc(port, tmp_path / "d.log", xdg)  # waits for b's lock
        procs.append(d)
        d.cmd("inc 1")
        b.kill()  # the child of b runs on
        page = _scrape_when_served(port)
        assert (page[OFFLOADS], page[CAPACITY]) == (18, 1500)  # d serves: d's and b's child's capacity
    finally:
        _end(procs)
    b_log, d_log = (tmp_path / "b.log").read_text(), (tmp_path / "d.log").read_text()
    assert f"took over from process {a.pid}" in b_log, b_log
    assert f"took over from process {b.pid}" in d_log, d_log
    assert "ERROR" not in b_log + d_log
