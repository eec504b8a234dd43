"""Journal compaction (``catalog.COMPACT_MIN_RECORDS``): the journal is rewritten from the index once it holds
too many records, and no block the index holds may be missing from the rewritten journal, or a warm restart
loses it. The writer journals a group's PUT records first and puts the blocks in the index after (publish after
durable); a compaction run right after that append rewrote the journal without the group (2026-11-29: 1,000 of
1,953 blocks gone after a restart). Real pool, real files, fsync on; the threshold is lowered so the test
compacts after a few hundred records instead of 65,536."""
from __future__ import annotations

import numpy as np

from tests.helpers.crash_writer import NS, open_pool, payload
from kvbm_backend.pool.g3 import catalog

BATCH = 40


def _journal_keys(pool) -> set[tuple[int, int]]:
    entries, _ = pool.journal.load()
    return {(k.rank, k.seq_hash) for k in entries}


def test_compaction_keeps_the_group_whose_append_triggered_it_and_restart_restores_every_block(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(catalog, "COMPACT_MIN_RECORDS", 200)
    pool = open_pool(tmp_path, capacity_gb=0.002, write_queue_blocks=10_000)  # ~170 slots: the LRU evicts
    compactions, k = 0, 1
    try:
        while compactions < 3:
            keys = NS.keys(range(k, k + BATCH))
            before = pool.journal.records
            r = pool.put(keys, [payload(x.seq_hash) for x in keys]).result()
            assert r.written == BATCH, r
            k += BATCH
            held = {(x.rank, x.seq_hash) for x in pool.keys()}
            assert held <= _journal_keys(pool), f"after put ending at {k - 1}: blocks held but not journaled"
            if pool.journal.records < before:  # this put's append compacted the journal
                compactions += 1
                assert {(x.rank, x.seq_hash) for x in keys} <= held  # the newest group is held and journaled
            assert k < 10_000, "the journal was never compacted"
        held_keys = pool.keys()
        assert len(held_keys) > BATCH
    finally:
        pool.close()
    pool = open_pool(tmp_path, capacity_gb=0.002)
    try:
        st = pool.stats()
        assert st["restored_blocks"] == len(held_keys), st
        out = [np.zeros_like(payload(0)) for _ in held_keys]
        ok = pool.get(held_keys, out).result().ok
        assert all(ok)
        assert all(np.array_equal(o, payload(x.seq_hash)) for o, x in zip(out, held_keys))
    finally:
        pool.close()
