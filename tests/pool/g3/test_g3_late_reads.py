"""A host get that times out (``g3.load_timeout_s``) never writes into the caller's buffers after its future
resolved: the caller may reuse them at once. Review finding (2026-11-29): the verifier thread checked
``resolved`` and then copied without a lock, so a timeout between the two let a late copy land in a buffer
the vLLM tiering tier had already handed to its next store, which G3 then stored under another key: wrong
KV. The race is made certain by a preemption point right after the verifier reads ``resolved`` (the thread
sleeps there, as if descheduled); everything else is the real pool on real files."""
from __future__ import annotations

import threading
import time

import numpy as np

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from kvbm_backend.pool.g3.read import host

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does

BB = LAYOUT.bytes_per_block


class _PreemptedRead:
    """``HostGet.resolved`` with a preemption point: the first read of False on a verifier thread while
    ``armed`` is set sleeps ``pause_s`` before returning."""

    def __init__(self, pause_s: float):
        self.pause_s = pause_s
        self.armed = threading.Event()
        self.hit = threading.Event()
        self.timed_out = threading.Event()

    def __get__(self, obj, typ=None):
        if obj is None:
            return self
        v = obj.__dict__["_resolved"]
        if not v and self.armed.is_set() and threading.current_thread().name.startswith("kvbm-g3-verify"):
            self.armed.clear()
            self.hit.set()
            self.timed_out.wait(self.pause_s)  # descheduled until the load bound passed (at most pause_s:
        return v                               # the fixed pool holds the get's lock here, so it cannot pass)

    def __set__(self, obj, v):
        obj.__dict__["_resolved"] = v


def test_nothing_lands_in_out_after_a_timed_out_get_resolved(tmp_path, monkeypatch):
    pre = _PreemptedRead(pause_s=1.0)
    monkeypatch.setattr(host.HostGet, "resolved", pre, raising=False)
    real_timeout = host.HostGet._timeout

    def timeout_after_the_check(self):  # the bound passes while the verifier is preempted, never before it
        pre.hit.wait(HANG_S)             # got there (on a busy machine it might not have reached it in 0.3 s)
        pre.timed_out.set()
        real_timeout(self)
    monkeypatch.setattr(host.HostGet, "_timeout", timeout_after_the_check)
    with open_pool(tmp_path, load_timeout_s=0.3) as pool:
        keys = NS.keys(range(1, 5))
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result().written == 4
        out = [aligned_empty(BB) for _ in keys]
        for o in out:
            o[:] = 0
        pre.armed.set()
        t0 = time.monotonic()
        res = pool.get(keys, out).result(timeout=60)
        assert pre.hit.is_set()  # the verifier was preempted between its check and its copy
        snap = [o.copy() for o in out]
        time.sleep(1.5)  # the preempted verifier has long resumed by now
        for i, (o, s, k) in enumerate(zip(out, snap, keys)):
            assert np.array_equal(o, s), f"row {i} written after the get resolved"
            if res.ok[i]:
                assert np.array_equal(o, payload(k.seq_hash))
            else:
                assert not o.any()  # a miss leaves the buffer untouched
        assert time.monotonic() - t0 < 30
