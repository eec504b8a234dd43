"""``g4.layout: canonical``: a put waiting behind an earlier put of its block (test_g4_canonical_race.py) holds its copy
of the block's parts, so it counts against ``g4.write_queue_blocks`` (in parts) like the parts queued in the G4 pool.
Review (2026-12): it was outside the bound, so up to one more block per distinct block in flight was held beyond it
(the G4 writer only saw the puts handed to it). Now a block whose parts do not fit beside the parts of the pool's
puts not ended is dropped at once, ``dropped_queue_full``, as the writer drops.

And ``close()`` waits (within its bound) for those waiting puts: before, only the G4 pool's own queue was waited
for, so a put issued from behind its block's put while the pool closed ended ``dropped_closed``."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvbm_backend.config import KvbmBackendConfig
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4.canonical import CanonicalG4
from tests.helpers.pools import G4_TIMEOUT_S

HEADS, D, LAYERS, PAGE = 4, 16, 2, 8
T = 600  # hang guard only (was 60)


def _canonical(tmp_path, **g4: object) -> tuple[Namespace, CanonicalG4]:
    """A canonical G4 pool (4 KV heads on one TP rank: 4 parts per block) over a ``file://`` store, one put
    thread, the start-up check done (the put thread is idle); its load bound (``timeout_s``: G4_TIMEOUT_S, was the
    2 s default) is no subject here."""
    ns = Namespace(model="m", layout=KvLayout(LAYERS, 2, PAGE, HEADS * D, "bfloat16"), tp_world_size=1)
    cfg = KvbmBackendConfig(model="m", g3={"enabled": False},
                            g4={"enabled": True, "layout": "canonical", "url": f"file://{tmp_path / 'store'}",
                                "keyring": {"path": str(tmp_path / "keyring.json")}, "max_inflight": 1,
                                "timeout_s": G4_TIMEOUT_S, **g4})
    _, pool = open_tiers(cfg, ns, HEADS)
    assert isinstance(pool, CanonicalG4)
    assert pool.flush(T)
    return ns, pool


def _block(ns: Namespace, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, ns.layout.bytes_per_block, dtype=np.uint8)


@pytest.mark.parametrize("order", ["waiting_first", "queued_first"])
def test_a_put_waiting_behind_its_block_counts_against_the_write_queue_bound(tmp_path, order):
    ns, g4 = _canonical(tmp_path, write_queue_blocks=2 * HEADS)  # room for two blocks' parts
    gate = threading.Event()
    g4.inner._io_put.submit(gate.wait, T)  # the one put thread is busy: puts stay queued
    ka, kb = ns.keys([1, 2], "t")
    a, b = _block(ns, 1), _block(ns, 2)
    try:
        first = g4.put([ka], [a])  # 4 parts queued in the G4 pool
        if order == "waiting_first":
            again = g4.put([ka], [a])  # waits behind `first`, holding its 4 parts: the bound is reached
            late = g4.put([kb], [b])  # before: handed to the pool (it saw 4 parts of 8), 12 parts held
        else:
            late = g4.put([kb], [b])  # 8 parts queued in the pool: the bound is reached
            again = g4.put([ka], [a])  # before: waited all the same, 12 parts held
        futs = [first, again, late]
        held = [f for f in futs if not f.done()]  # puts still holding their parts (the caller's buffers too)
        assert len(held) * HEADS <= 2 * HEADS, [f.done() for f in futs]
        over = late if order == "waiting_first" else again
        assert over.done() and over.result(0).dropped == 1, over
        assert g4.inner.stats()["dropped_queue_full"] == HEADS  # the writer's reason, counted in parts as it does
        assert g4.stats()["pending_put_blocks"] == 2 * HEADS  # the waiting put's parts show as pending
        gate.set()
        rs = [f.result(T) for f in futs]
        assert g4.flush(T)
        if order == "waiting_first":  # `again` found a's parts stored; b was not stored
            assert [(r.written, r.skipped, r.dropped) for r in rs] == [(1, 0, 0), (0, 1, 0), (0, 0, 1)], rs
        else:  # a and b stored, each counted written once; the waiting put of a dropped
            assert [(r.written, r.skipped, r.dropped) for r in rs] == [(1, 0, 0), (0, 0, 1), (1, 0, 0)], rs
        assert g4.stats()["pending_put_blocks"] == 0 and g4._held == 0
        assert g4.put([kb], [b]).result(T).dropped == 0  # room again: a later save of b stores it (or finds it)
        assert g4.lookup_prefix([ka, kb]).result(T) == 2
    finally:
        gate.set()
        g4.close(T)


def test_close_waits_for_puts_waiting_behind_their_block(tmp_path):
    ns, g4 = _canonical(tmp_path)
    gate = threading.Event()
    g4.inner._io_put.submit(gate.wait, T)  # the firsts stay queued in the pool, the seconds wait behind them
    seqs = list(range(10, 15))
    keys = ns.keys(seqs, "t")
    blocks = [_block(ns, s) for s in seqs]
    futs = [g4.put([k], [b]) for k, b in zip(keys, blocks) for _ in range(2)]
    closer = threading.Thread(target=g4.close, args=(T,))
    try:
        closer.start()  # before: the G4 pool's flush saw only the firsts; the seconds were issued as it closed
        gate.set()
        closer.join(T)
        assert not closer.is_alive()
        assert all(f.done() for f in futs)
        rs = [f.result(0) for f in futs]
        assert [(r.written, r.skipped, r.dropped) for r in rs] == [(1, 0, 0), (0, 1, 0)] * len(seqs), rs
        assert g4.inner.stats().get("dropped_closed", 0) == 0
    finally:
        gate.set()
        closer.join(T)
