"""``G3Pool.removed_since``: what left the index (evicted, deleted, proven corrupt), in order, from a cursor, so
the vLLM tiering tier reports removals in O(removals) instead of reading the index (real pool, real files)."""
from __future__ import annotations

import os

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import catalog

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do


def _put(pool, seqs):
    keys = NS.keys(seqs)
    assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == len(keys)
    return keys


def test_evictions_deletes_and_corrupt_drops_are_logged_in_order(tmp_path):
    with open_pool(tmp_path, capacity_gb=0.002) as pool:  # ~170 slots
        cur0 = pool.removal_cursor()
        assert pool.removed_since(cur0) == (cur0, [])
        keys = _put(pool, range(1, 11))
        assert pool.delete(keys[:2]).result() == 2
        cur, log = pool.removed_since(cur0)
        assert cur == pool.removal_cursor() and [(s, r) for _, s, r in log] == [(1, 0), (2, 0)]
        assert [n for n, _, _ in log] == [cur0 + 1, cur0 + 2]
        slot = pool.index.get(keys[2])  # a payload bit flipped on disk: proven bad on read, dropped
        with open(pool.slabs.by_index[slot[0]].path, "r+b") as f:
            pos = slot[1] * frame.slot_bytes(LAYOUT.bytes_per_block) + frame.HEADER_BYTES + 10
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 1]))
            os.fsync(f.fileno())
        assert pool.get([keys[2]], [aligned_empty(LAYOUT.bytes_per_block)]).result(timeout=HANG_S).ok == [False]
        cur2, log = pool.removed_since(cur)
        assert [(s, r) for _, s, r in log] == [(3, 0)]
        for a in range(1000, 1400, 50):  # more than the pool holds: the oldest are evicted
            _put(pool, range(a, a + 50))
        cur3, log = pool.removed_since(cur2)
        evicted = {s for _, s, _ in log}
        assert evicted and all(not pool.contains(NS.key(s)) for s in evicted)
        assert pool.stats()["evictions"] == len(log)


def test_a_reader_further_behind_than_the_log_is_told_to_read_the_index(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "REMOVED_LOG_ENTRIES", 4)
    with open_pool(tmp_path) as pool:
        cur = pool.removal_cursor()
        keys = _put(pool, range(1, 11))
        pool.delete(keys[:6]).result()
        assert pool.removed_since(cur) == (cur + 6, None)
        assert [s for _, s, _ in pool.removed_since(cur + 2)[1]] == [3, 4, 5, 6]
