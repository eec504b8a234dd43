"""A half-open breaker whose probe never gets to run. Review finding (2026-11-30): a G4 batch (get or lookup)
that expires counts as one store failure, but a failure re-opened a half-open breaker only when it came from
the probe (:meth:`CircuitBreaker.allow` had let one out). On a hung mount every read thread is stuck in the
kernel, so a batch queued while the breaker was half-open never reached ``allow``: its expiry failed without a
probe out and the breaker stayed half-open for good. Every later load and lookup was then queued behind the
stuck threads (one more task per block on the executor's queue each time) and waited out the whole load bound
instead of being refused at once, for as long as the mount stayed hung. Any failure while half-open now
re-opens the breaker.

Review finding (2026-12-02): re-opening took a batch's expiry, and until then every call of the half-open window
passed the breaker's check and queued its tasks behind the stuck threads too, holding its caller's buffers; they
stayed queued for as long as the mount hung (a get every 10 ms, 2 read threads: 658 tasks and 82 MiB of caller
buffers in 8 s, growing). While half-open a call now queues work only if a read thread is free for it."""
from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest

from tests.helpers.g4_writer import namespace, payload
from tests.helpers.held_open import HeldOpen
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.breaker import CircuitBreaker
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
RESET_S = 3600.0  # the breaker's reset: the test moves the breaker's clock past it (never waits for it)


def test_a_failure_while_half_open_reopens_without_a_probe_out():
    now = [0.0]
    b = CircuitBreaker(failures=1, reset_s=5.0, clock=lambda: now[0])
    b.failure()
    now[0] = 5.0
    assert b.state == "half_open"
    b.failure("a batch expired: its reads never started")  # no probe was let out
    assert b.state == "open" and not b.allow() and b.opens == 1
    now[0] = 10.0
    assert b.state == "half_open" and b.allow()  # a reset_s after the re-opening: probes again
    b.success()
    assert b.state == "closed"


def _pool_on_a_hanging_mount(tmp_path):
    """A G4 pool on ``file://`` (2 read threads, load bound 0.55 s) holding blocks 1-4, whose breaker's clock the
    test moves (``skew[0]`` seconds ahead), and the mount hung under blocks 1 and 2:
    ``(pool, keys, blocks, skew, held)``."""
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    cfg = G4Config(url=f"file://{tmp_path / 'mnt'}", timeout_s=0.5, retries=0, breaker_failures=1,
                   breaker_reset_s=RESET_S, max_inflight=2, keyring={"path": str(tmp_path / "kr.json")})
    pool = G4Pool(cfg, ns)
    skew = [0.0]
    pool.breaker._clock = lambda: time.monotonic() + skew[0]  # the reset passes when the test says so
    keys = ns.keys([1, 2, 3, 4], tenant="t")
    blocks = [payload(s, "t", bpb) for s in [1, 2, 3, 4]]
    assert pool.put(keys, blocks).result(timeout=HANG_S).written == 4
    return pool, keys, blocks, skew, HeldOpen([pool.store._path(pool.object_name(k)) for k in keys[:2]])


@pytest.mark.slow
def test_loads_on_a_hung_mount_are_refused_while_half_open_and_the_pool_recovers(tmp_path):
    pool, keys, blocks, skew, held = _pool_on_a_hanging_mount(tmp_path)
    bpb, seqs = pool.layout.bytes_per_block, [1, 2, 3, 4]
    try:
        out = [np.zeros(bpb, np.uint8) for _ in range(2)]
        res = pool.get(keys[:2], out).result(timeout=HANG_S)  # both read threads now stuck in open()
        assert res.timed_out == [True, True] and pool.breaker.state == "open"
        skew[0] = RESET_S  # the reset has passed: half-open, the next request may probe
        assert pool.breaker.state == "half_open"
        # a load of two healthy objects: no read thread is free for it, so it is refused at once (before
        # 2026-12-02 its reads queued behind the stuck threads, never started, and its expiry re-opened the
        # breaker: the unit test above keeps that rule for a batch queued while a thread was free)
        fut = pool.get(keys[2:], out)
        assert fut.done() and fut.result().ok == [False, False] and not any(fut.result().timed_out)
        assert pool.lookup_prefix(keys[2:]).done()
        assert pool._io._work_queue.qsize() == 0  # nothing queued behind the stuck reads
        assert pool.breaker.state == "open"  # their requests still unanswered (silent): re-opened, offloads refused
        st = pool.stats()
        assert st["miss_timeout"] == 2 and st["miss_breaker"] == 2, st
    finally:
        held.release()
    skew[0] = 2 * RESET_S  # the mount is back and the reset passed again: the pool recovers by itself
    deadline = time.monotonic() + HANG_S
    got = [np.zeros(bpb, np.uint8) for _ in seqs]
    ok: list[bool] = []
    while time.monotonic() < deadline:
        ok = pool.get(keys, got).result(timeout=HANG_S).ok
        if all(ok):
            break
        skew[0] += RESET_S
        time.sleep(0.1)
    assert ok == [True] * 4 and all(np.array_equal(g, b) for g, b in zip(got, blocks))
    assert pool.breaker.state == "closed"
    pool.close()


@pytest.mark.slow
def test_half_open_windows_queue_nothing_behind_a_hung_mount(tmp_path):
    """Both read threads stuck in the kernel, then 40 half-open windows (the test moves the breaker's clock),
    each with a load of two healthy blocks into fresh buffers: every load is refused at once, nothing queues
    behind the stuck reads and no caller buffer stays referenced. Before 2026-12-02 each window's load queued 2
    tasks holding its buffers (80 tasks queued, 80 buffers held) until the mount came back."""
    pool, keys, _, skew, held = _pool_on_a_hanging_mount(tmp_path)
    bpb = pool.layout.bytes_per_block
    refs: list[weakref.ref] = []
    try:
        res = pool.get(keys[:2], [np.zeros(bpb, np.uint8) for _ in range(2)]).result(timeout=HANG_S)
        assert res.timed_out == [True, True] and pool.breaker.state == "open"
        for _ in range(40):
            skew[0] += RESET_S  # another half-open window
            assert pool.breaker.state == "half_open"
            out = [np.zeros(bpb, np.uint8) for _ in range(2)]
            refs += [weakref.ref(o) for o in out]
            pool.get(keys[2:], out)
            del out
        gc.collect()
        queued, held_bufs = pool._io._work_queue.qsize(), sum(r() is not None for r in refs)
        assert queued == 0 and held_bufs == 0, f"{queued} tasks queued, {held_bufs} caller buffers held"
        assert pool.stats()["miss_breaker"] == 80
    finally:
        held.release()
        pool.close()
