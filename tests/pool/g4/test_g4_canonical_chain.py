"""``g4.layout: canonical``: many puts of one block made while its put is in flight all end, holding at most one
waiting copy.

A block put again while its earlier put is in flight waits for that put (:mod:`kvbm_backend.pool.g4.canonical`).
When the G4 pool answers the waiting puts at once (closed, circuit breaker open, queue full: a done future), the
whole queue used to unwind on one stack, one nested callback chain per put: past ~150 queued puts Python's recursion
limit was hit inside a Future callback (swallowed by concurrent.futures, logged only), and the rest of the queue
never ended: the callers' futures, flush and every later put of that block hung. Now at most one put of a block
waits behind the one in flight; a put arriving meanwhile is skipped at once (its buffers free), and the pool's
answers are taken in a loop, not nested callbacks."""
from __future__ import annotations

import threading

import numpy as np

from kvbm_backend.config import KvbmBackendConfig
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4.canonical import CanonicalG4

HEADS, D, LAYERS, PAGE = 4, 16, 2, 8
T = 60  # hang guard only
N = 1500  # puts of one block made while its first put is in flight


def test_puts_waiting_behind_one_put_all_end_when_the_pool_answers_them_at_once(tmp_path):
    ns = Namespace(model="m", layout=KvLayout(LAYERS, 2, PAGE, HEADS * D, "bfloat16"), tp_world_size=1)
    cfg = KvbmBackendConfig(model="m", g3={"enabled": False},
                            g4={"enabled": True, "layout": "canonical", "url": f"file://{tmp_path / 'store'}",
                                "keyring": {"path": str(tmp_path / "keyring.json")}, "max_inflight": 1})
    _, g4 = open_tiers(cfg, ns, HEADS)
    assert isinstance(g4, CanonicalG4)
    assert g4.flush(T)  # the start-up check is done: the put thread is idle
    gate = threading.Event()
    g4.inner._io_put.submit(gate.wait, T)  # the one put thread is busy: the first put stays queued
    key = ns.keys([7], "t")[0]
    block = np.random.default_rng(7).integers(0, 256, ns.layout.bytes_per_block, dtype=np.uint8)
    try:
        futs = [g4.put([key], [block]) for _ in range(N)]  # the first queued in the pool, one waiting behind it
        assert [f.result(0).skipped for f in futs[2:]] == [1] * (N - 2)  # the rest skipped at once
        assert len(g4._inflight[key]) == 2  # no copy held per re-save
        g4.inner.writer.close()  # the pool answers the waiting put at once (dropped_closed)
        gate.set()
        rs = [f.result(T) for f in futs]  # before: a chain of N nested callbacks, RecursionError, the rest hung
        assert [r.dropped for r in rs[:2]] == [1, 1], rs[:3]
        assert g4.flush(T)
        assert not g4._inflight  # nothing held for the block
    finally:
        gate.set()
        g4.close()
