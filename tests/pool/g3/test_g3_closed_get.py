"""A get on a closed G3 pool: every engine submit fails at once (the posix engine's threads are stopped: EBADF),
so each read chunk's future is already done when its callback is added, and that callback ran inline and
submitted the next chunk. Before (reviewer, 2026-11-30) that recursed once per chunk: a get of a few hundred
chunks hit RecursionError inside ``Future.add_done_callback`` (logged and swallowed by concurrent.futures), so
the chunk was never counted, the get never resolved and its slot pins stayed held. Chunks whose future is done
are now handled by a loop. Real pool, real slab files, the real posix engine (closed by the pool's close)."""
from __future__ import annotations

import sys

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame

HANG_S = 120.0  # a hang guard, not a bound: the get must resolve; on the old code it never did
N = 1500  # blocks, one per read chunk: far more chunks than sys.getrecursionlimit() / 3 frames


def test_a_large_get_on_a_closed_pool_resolves_as_misses_and_unpins(tmp_path):
    assert N * 3 > sys.getrecursionlimit()
    pool = open_pool(tmp_path, capacity_gb=0.05)
    keys = NS.keys(range(1, N + 1))
    with pool:
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=600).written == N
        pool.min_chunk_blocks = 1  # one block per read chunk (instance attributes: the pool's read tuning)
        pool.read_chunk_bytes = frame.slot_bytes(LAYOUT.bytes_per_block)
    out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys]
    res = pool.get(keys, out).result(timeout=HANG_S)
    assert res.ok == [False] * N
    assert pool.cat.index.pinned == 0
