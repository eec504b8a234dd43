"""Load is not an outage: G4 blocks that expire queued behind reads that answer do not open the breaker.

Reviewer finding (2026-12-01): a G4 load batch (or lookup) that reached its load bound counted one store failure
whatever its missing blocks waited on. With ``g4.max_inflight`` read threads and a store slower than the burst (a
busy mount, a long prompt's hundreds of blocks, the native tiers' background announcements), blocks still queued
behind reads that DO answer expired and opened the breaker: every G4 load and lookup of the worker was then refused
for ``breaker_reset_s``, on a store that never stopped answering. Now an expiry is a failure only when the store is
silent: a request out for half the per-attempt bound without a reply (:mod:`kvbm_backend.pool.g4.silence`); a hung
mount still opens it (tests/pool/g4/test_g4_breaker_silent.py).

Real parts: a ``file://`` G4 store whose object opens block in the kernel (Linux leases, :mod:`tests.helpers.held_open`)
until a releaser lets one through every ``STEP_S``: a mount that answers each read, slowly.
"""
from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from tests.helpers.g4_writer import namespace, payload
from tests.helpers.held_open import HeldOpen
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
TIMEOUT_S = 4.0  # g4.timeout_s (retries 0): the load bound is 4.05 s; a request is silent after 2 s
STEP_S = 0.1  # one held open let through every STEP_S: each read answers within ~2 x STEP_S (2 read threads)
N = 64  # blocks of the burst: about TIMEOUT_S / STEP_S answer within the bound, the rest expire queued


@pytest.mark.slow
def test_a_burst_that_outlasts_the_load_bound_on_a_slow_answering_store_does_not_open_the_breaker(tmp_path):
    """64 blocks loaded at once through 2 read threads from a mount that answers a read every 0.1 s, and a lookup
    queued behind them: both reach the 4.05 s load bound with requests still queued (misses, ``timed_out``), none
    unanswered for 2 s. The breaker stays closed (before: open after the load's expiry, the next load refused,
    ``miss_breaker``), the blocks that came back are the right bytes, and a load right after is served."""
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    cfg = G4Config(url=f"file://{tmp_path / 'mnt'}", timeout_s=TIMEOUT_S, retries=0, breaker_failures=1,
                   breaker_reset_s=3600.0, max_inflight=2, keyring={"path": str(tmp_path / "kr.json")})
    pool = G4Pool(cfg, ns)
    keys = ns.keys(list(range(1, N + 1)), tenant="t")
    blocks = [payload(s, "t", bpb) for s in range(1, N + 1)]
    assert pool.put(keys, blocks).result(timeout=HANG_S).written == N
    old = signal.signal(signal.SIGIO, signal.SIG_IGN)  # every HeldOpen below saves and restores this
    held = [HeldOpen([pool.store._path(pool.object_name(k))]) for k in keys]
    stop = threading.Event()

    def let_through() -> None:  # in the order the batch reads them
        for h in held:
            if stop.wait(STEP_S):
                return
            h.release(restore_sigio=False)  # not the main thread: SIGIO stays ignored until the end
    releaser = threading.Thread(target=let_through, name="test-slow-mount")
    try:
        releaser.start()
        out = [np.zeros(bpb, np.uint8) for _ in keys]
        fut = pool.get(keys, out)
        looked = pool.lookup_prefix(keys[:8])  # its HEADs queue behind the load's reads
        res = fut.result(timeout=HANG_S)
        assert 0 < sum(res.ok) < N and any(res.timed_out), (sum(res.ok), sum(res.timed_out))
        assert all(np.array_equal(o, b) for o, b, ok in zip(out, blocks, res.ok) if ok)
        looked.result(timeout=HANG_S)
        st = pool.stats()
        assert st["miss_timeout"] > 0, st
        assert pool.breaker.state == "closed", f"queueing behind answering reads opened the breaker: {st}"
    finally:
        stop.set()
        releaser.join()
        for h in held:
            h.release(restore_sigio=False)
        signal.signal(signal.SIGIO, old)
    try:
        got = [np.zeros(bpb, np.uint8) for _ in range(4)]
        res = pool.get(keys[:4], got).result(timeout=HANG_S)  # the store is fine: served, not refused
        assert res.ok == [True] * 4 and all(np.array_equal(g, b) for g, b in zip(got, blocks))
        assert pool.stats().get("miss_breaker", 0) == 0 and pool.breaker.state == "closed"
    finally:
        pool.close()
