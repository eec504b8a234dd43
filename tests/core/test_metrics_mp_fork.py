"""Processes forked from a process whose series live in :mod:`kvbm_backend.metrics_mp` files: real forks of
this process, a real directory; the page is what the serving process's registry collects."""
from __future__ import annotations

import os
import signal
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from tests.helpers.forked import exit_status
from kvbm_backend import metrics_mp

HANG_S = 120.0  # a bound for what happens at once (a child's first write, a child's exit)


def _dir(tmp_path) -> str:
    d = tmp_path / "metrics"
    d.mkdir(mode=0o700)
    return str(d)


def _exit_status(pid: int) -> int | None:
    """``pid``'s exit status once it ended; None when it still ran after :data:`HANG_S` (then killed)."""
    return exit_status(pid, HANG_S)


def _page(d: str) -> tuple[float | None, float | None]:
    reg = metrics_mp.registry_for(d)
    return reg.get_sample_value("kvbm_x_total"), reg.get_sample_value("kvbm_cap")


def test_a_child_forked_while_another_thread_writes_a_series_can_write(tmp_path, monkeypatch):
    """Review finding (metrics_mp 2): the lock of the values was a plain lock that a forked child inherits
    as it was: a child forked while another thread was writing a value (held the lock) hung at its first
    write, for ever. Now the child gets new locks at the fork. Here the writing thread is held inside the
    lock while this process forks."""
    d = _dir(tmp_path)
    metrics_mp.begin(d)
    c = metrics_mp.metric_classes(d)[Counter]("kvbm_x", "x", registry=CollectorRegistry())
    inside, release = threading.Event(), threading.Event()
    writer: list[threading.Thread] = []
    real_write = MmapedDict.write_value

    def write_value(self, key, value, timestamp):
        if writer and threading.current_thread() is writer[0]:
            inside.set()
            release.wait(HANG_S)
        return real_write(self, key, value, timestamp)

    monkeypatch.setattr(MmapedDict, "write_value", write_value)
    writer.append(threading.Thread(target=c.inc, args=(1,)))
    writer[0].start()
    try:
        assert inside.wait(HANG_S)  # the writer is inside the value lock
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                c.inc(2)
                code = 0
            finally:
                os._exit(code)
    finally:
        release.set()
        writer[0].join(HANG_S)
    assert _exit_status(pid) == 0, "the child's first inc() hung (or failed)"
    assert _page(d)[0] == 3


def test_a_forked_child_that_writes_no_series_does_not_keep_its_parent_live(tmp_path):
    """Review finding (metrics_mp 3): liveness is an flock on a descriptor that a forked child inherits
    (close-on-exec drops it across exec, not fork), so a helper forked without exec kept its ended parent
    live: the parent's capacity stayed summed until the helper ended. Now a child closes the inherited
    descriptor at the fork; that leaves the parent's lock held (an flock belongs to the open file description,
    still open in the parent): the parent counts as live while it lives, after a child closed its copy and
    after a child ended. Its counts stay in the sums once it ended."""
    d = _dir(tmp_path)
    ready_r, ready_w = os.pipe()
    p_life_r, p_life_w = os.pipe()  # the parent P runs until this process closes p_life_w
    c_life_r, c_life_w = os.pipe()  # P's helper child likewise
    p = os.fork()
    if p == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(p_life_w)
            os.close(c_life_w)
            metrics_mp.begin(d)
            cls = metrics_mp.metric_classes(d)
            cls[Counter]("kvbm_x", "x", registry=CollectorRegistry()).inc(5)
            cls[Gauge]("kvbm_cap", "c", registry=CollectorRegistry(), multiprocess_mode="livesum").set(1000)
            for lives_on in (False, True):  # a child that ends at once, then a helper that lives on
                child = os.fork()
                if child == 0:
                    if lives_on:  # running: its fork hook closed its copy of P's lock (else P stays live)
                        os.write(ready_w, b"c")
                    os.close(ready_w)
                    if lives_on:
                        signal.alarm(int(HANG_S) * 2)
                        os.read(c_life_r, 1)
                    os._exit(0)
                if not lives_on:
                    os.waitpid(child, 0)
            os.write(ready_w, b"x")
            os.read(p_life_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(p_life_r)
    os.close(c_life_r)
    try:
        # P is ready, and its helper has run (2026-12-02: on a busy host the helper was not scheduled at all before
        # P ended, so its copy of P's lock, closed by its fork hook when it first runs, kept P live)
        assert sorted([os.read(ready_r, 1), os.read(ready_r, 1)]) == [b"c", b"x"]
        assert _page(d) == (5, 1000)  # P lives: its children closed their copies of its lock, one ended
        os.close(p_life_w)
        p_life_w = -1
        assert _exit_status(p) == 0
        assert _page(d) == (5, None)  # P ended, its helper lives on: P's capacity is gone, its counts stay
    finally:
        for fd in (ready_r, p_life_w, c_life_w):
            if fd >= 0:
                os.close(fd)


def test_files_an_earlier_version_named_by_pid_alone_are_an_ended_processs(tmp_path):
    """Files named by the pid alone (``counter_<pid>.db``, renamed ``counter_<pid>-<n>.db``,
    ``live_<pid>.lock``: what a directory that persisted across an upgrade holds) are an ended process's: its
    live gauges are dropped, its counters summed, and a new run removes them all."""
    d = _dir(tmp_path)
    for name, key in (("counter_77.db", mmap_key("kvbm_x", "kvbm_x_total", (), (), "x")),
                      ("counter_77-1.db", mmap_key("kvbm_x", "kvbm_x_total", (), (), "x")),
                      ("gauge_livesum_77.db", mmap_key("kvbm_cap", "kvbm_cap", (), (), "c"))):
        f = MmapedDict(os.path.join(d, name))
        f.write_value(key, 4.0, 0.0)
        f.close()
    open(os.path.join(d, "live_77.lock"), "w").close()
    assert _page(d) == (8, None)
    metrics_mp.begin(d)
    assert _page(d) == (None, None)
    assert os.listdir(d) == [f"live_{metrics_mp._id()}.lock"]  # this process's alone
