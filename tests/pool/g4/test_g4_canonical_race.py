"""``g4.layout: canonical``: a block put twice while the first put is still in write-behind counts ``written``
once. CI (2026-12, 2 busy cores): the TP=1 writer of tests/e2e/test_anytp_e2e.py re-saves the shared prefix of
its second prompt while the first prompt's puts of those blocks are still queued; each block's head parts are
separate create-exclusive objects, so the two puts could each create some of one block's parts and both counted
the block written (``g4_put_written_blocks`` 34 for 32 blocks stored, 64 objects).

Many puts of one block made while its put is in flight all end, holding at most one waiting copy. Review of that
fix: every re-save queued a put holding the caller's buffers, and when the G4 pool answered the queue at once
(closed, circuit breaker open, queue full: a done future) it unwound as one nested callback chain per put: past ~150
queued puts Python's recursion limit was hit inside a Future callback (swallowed by concurrent.futures), and the
rest never ended (the callers' futures, flush and every later put of that block hung). Now at most one put of a
block waits behind the one in flight; a put arriving meanwhile is skipped at once (its buffers free), and the pool's
answers are taken in a loop, not nested callbacks."""
from __future__ import annotations

import os
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


def _canonical(tmp_path, max_inflight: int) -> tuple[Namespace, CanonicalG4]:
    """A canonical G4 pool (4 KV heads on one TP rank) over a ``file://`` store in ``tmp_path``."""
    ns = Namespace(model="m", layout=KvLayout(LAYERS, 2, PAGE, HEADS * D, "bfloat16"), tp_world_size=1)
    cfg = KvbmBackendConfig(model="m", g3={"enabled": False},
                            g4={"enabled": True, "layout": "canonical", "url": f"file://{tmp_path / 'store'}",
                                "keyring": {"path": str(tmp_path / "keyring.json")}, "max_inflight": max_inflight})
    _, g4 = open_tiers(cfg, ns, HEADS)
    assert isinstance(g4, CanonicalG4)
    return ns, g4


def test_a_block_put_again_while_its_put_is_in_flight_counts_written_once(tmp_path):
    ns, g4 = _canonical(tmp_path, 8)
    seqs = list(range(1000, 1096))
    bpb = ns.layout.bytes_per_block
    blocks = [np.random.default_rng(s).integers(0, 256, bpb, dtype=np.uint8) for s in seqs]
    keys = ns.keys(seqs, "t")
    try:
        # each block twice in a row: the second put's head parts queue right behind the first's, both in flight
        futs = [g4.put([k], [b]) for k, b in zip(keys, blocks) for _ in range(2)]
        rs = [f.result(T) for f in futs]
        assert g4.flush(T)
        assert sum(r.dropped for r in rs) == 0, rs
        assert g4.inner.stats()["written"] == len(seqs) * HEADS  # every part created exactly once
        objs = [f for _, _, fs in os.walk(tmp_path / "store") for f in fs if not f.endswith(".json")]
        assert len(objs) == len(seqs) * HEADS
        per_block = [rs[2 * i].written + rs[2 * i + 1].written for i in range(len(seqs))]
        assert [i for i, n in enumerate(per_block) if n != 1] == [], per_block  # written once per block
        assert sum(r.skipped for r in rs) == len(seqs)  # the other put of each block found it stored
    finally:
        g4.close()


def test_puts_waiting_behind_one_put_all_end_when_the_pool_answers_them_at_once(tmp_path):
    ns, g4 = _canonical(tmp_path, 1)
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
