"""A warm restart keeps the G3 pool's LRU order, hits included (real pool, real slab files and journal).

Review finding (2026-12-04): the journal records a block's PUT, never its hits (a prefix lookup or a load makes the
block most recently used), and a clean close rewrote it only when it had lost records. So a restart ordered the blocks
by their last write: the prefix every request hit, written first, came back least recently used and was the first
block evicted once the pool was full again (every later request then missed from its first block). Now ``close``
rewrites the journal from the index, in LRU order, when blocks were hit since the open.
"""
from __future__ import annotations

import numpy as np

from tests.helpers.crash_writer import NS, open_pool, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
CAP = 0.001  # GB: 81 slots of 12 KiB


def _put(pool, keys) -> None:
    for i in range(0, len(keys), 10):
        part = keys[i:i + 10]
        assert pool.put(part, [payload(k.seq_hash) for k in part]).result(timeout=HANG_S).written == len(part)


def test_blocks_hit_before_a_clean_close_are_not_the_first_evicted_after_the_restart(tmp_path):
    with open_pool(tmp_path, capacity_gb=CAP, files_per_path=1) as pool:
        n = pool.stats()["capacity_blocks"]
        keys = NS.keys(range(1, n + 1))
        _put(pool, keys)  # the pool is full: 1 is the least recently used, n the most
        hot, loaded = keys[:4], keys[4:6]
        assert pool.lookup_prefix(hot).result(timeout=HANG_S) == len(hot)  # a request's prefix hit
        out = [np.zeros_like(payload(0)) for _ in loaded]
        assert all(pool.get(loaded, out).result(timeout=HANG_S).ok)  # a load hits too
        order = [k.seq_hash for k, _ in pool.cat.index.items()]
        assert order[-6:] == [k.seq_hash for k in hot + loaded], order

    with open_pool(tmp_path, capacity_gb=CAP, files_per_path=1) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == n and st["restore_dropped"] == 0, st
        restored = [k.seq_hash for k, _ in pool.cat.index.items()]
        assert restored == order, f"restored LRU order (oldest first) {restored[:8]}..., before the close {order[:8]}..."
        new = NS.keys(range(10_001, 10_009))
        _put(pool, new)  # evicts the 8 least recently used blocks
        assert pool.lookup_prefix(hot).result(timeout=HANG_S) == len(hot), "the prefix hit before the close was evicted"
        assert {k.seq_hash for k in pool.keys()} == set(order[len(new):]) | {k.seq_hash for k in new}
        assert pool.slot_accounting()["leaked"] == 0
