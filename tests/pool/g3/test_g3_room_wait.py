"""A G3 pool full of writes still in flight: a new batch waits for them to settle (their blocks become evictable)
instead of being dropped ``no_space`` (:mod:`kvbm_backend.pool.g3.writer_room`).

The landing CI of 2026-12-01 failed ``test_g3_stays_within_its_bound_vllm_fs_tier_does_not``: on the busy VM
5 of 12 store jobs of a native ``G3Tier`` with room for 11 chunks were dropped ``no_space``, because slow
fdatasyncs kept two earlier batches reserved. Here the slab fdatasyncs are held on an Event, so the state is
made, not timed: ``GUARD_S`` is a hang guard only."""
from __future__ import annotations

import threading

import numpy as np

from kvbm_backend.deadlines import Deadline
from kvbm_backend.io import fdatasync as real_fdatasync
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g3 import pool as pool_mod
from tests.helpers.pools import open_g3

GUARD_S = 60.0
LAY = KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=2048, dtype="float16")  # 256 KiB blocks
NS = Namespace(model="t/room", revision="r", layout=LAY, tp_world_size=1)
SLOTS = 11


def _pool(tmp_path):
    pool = open_g3(tmp_path / "g3", NS, capacity_gb=LAY.bytes_per_block * (SLOTS + 0.5) / 1e9)
    assert pool.stats()["capacity_blocks"] == SLOTS
    return pool


def _blocks(j: int, n: int):
    return [NS.key(1000 * j + i, "", 0) for i in range(n)], [np.full(LAY.bytes_per_block, j + 1, np.uint8)
                                                             for _ in range(n)]


def _wait_reserved(pool, n: int) -> None:
    """Poll until ``reserved_slots`` is ``n`` (hang guard ``GUARD_S``)."""
    end = Deadline(GUARD_S)
    while pool.stats()["reserved_slots"] != n:
        assert not end.expired(), f"hang guard: reserved_slots never reached {n}: {pool.stats()}"
        threading.Event().wait(0.01)


def test_a_batch_that_finds_the_pool_full_of_writes_in_flight_waits_for_them_not_dropped(tmp_path, monkeypatch):
    gate = threading.Event()

    def held(fd):  # every slab/journal fdatasync waits for the gate: the writes stay in flight (reserved)
        assert gate.wait(GUARD_S), "hang guard: the fdatasyncs were never released"
        real_fdatasync(fd)
    monkeypatch.setattr(pool_mod, "fdatasync", held)
    pool = _pool(tmp_path)
    try:
        futs = []
        for j, reserved in enumerate((5, 10, SLOTS)):  # 3 puts of 5 blocks, each its own batch: 15 > 11 slots
            keys, blocks = _blocks(j, 5)
            futs.append(pool.put(keys, blocks))
            _wait_reserved(pool, reserved)
        # the third batch holds the last free slot and waits: nothing is published yet, nothing to evict
        st = pool.stats()
        assert st["blocks"] == 0 and st["dropped_by_reason"] == {}, st
        assert not any(f.done() for f in futs)
        gate.set()
        res = [f.result(GUARD_S) for f in futs]
        assert [(r.written, r.dropped) for r in res] == [(5, 0)] * 3, res
        st = pool.stats()
        assert st["dropped_by_reason"] == {} and st["evictions"] == 4 and st["blocks"] == SLOTS, st
        keys, _ = _blocks(2, 5)
        out = [np.zeros(LAY.bytes_per_block, np.uint8) for _ in keys]
        got = pool.get(keys, out).result(GUARD_S)
        assert got.ok == [True] * 5 and all((b == 3).all() for b in out)
    finally:
        gate.set()
        pool.close()


def test_a_put_larger_than_the_pool_drops_its_excess_no_space_and_does_not_wait(tmp_path):
    """Nothing else in flight: what cannot fit is dropped at once (``no_space``), the rest written."""
    pool = _pool(tmp_path)
    try:
        keys, blocks = _blocks(0, SLOTS + 2)
        r = pool.put(keys, blocks).result(GUARD_S)
        assert (r.written, r.dropped) == (SLOTS, 2), r
        assert pool.stats()["dropped_by_reason"] == {"no_space": 2}
    finally:
        pool.close()
