"""Reopening a G3 pool with changed settings (real pool, real slab files, fsync on).

Lowering ``g3.capacity_gb`` or ``g3.files_per_path`` gives the disk back at open: before, the slab files kept
their full size (5x the configured capacity after a 5x cut) and files past a lowered ``files_per_path`` stayed
forever. Blocks that still fit stay readable.
"""
from __future__ import annotations

import os

import numpy as np

from tests.helpers.crash_writer import NS, open_pool, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

BIG, SMALL = 0.01, 0.002  # GB: ~813 and ~162 slots of 12 KiB


def _slabs(d) -> dict[str, int]:
    """Slab file name -> bytes allocated on disk (st_blocks * 512)."""
    return {n: os.stat(os.path.join(d, n)).st_blocks * 512 for n in sorted(os.listdir(d)) if n.endswith(".slab")}


def _check_readable(pool, keys) -> None:
    out = [np.zeros_like(payload(0)) for _ in keys]
    assert all(pool.get(keys, out).result(timeout=HANG_S).ok)
    assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))


def test_lowering_capacity_and_files_per_path_gives_the_disk_back(tmp_path):
    keys = NS.keys(range(1, 801))
    with open_pool(tmp_path, capacity_gb=BIG, files_per_path=2) as pool:
        for i in range(0, len(keys), 200):
            part = keys[i:i + 200]
            assert pool.put(part, [payload(k.seq_hash) for k in part]).result(timeout=HANG_S).written == len(part)
        slots = {k.seq_hash: pool.cat.index.get(k) for k in keys}
    assert sum(_slabs(tmp_path).values()) > 4 * SMALL * 1e9

    with open_pool(tmp_path, capacity_gb=SMALL, files_per_path=2) as pool:
        cap = {f.index: f.max_slots for f in pool.cat.slabs.files}
        fits = {h for h, (fi, si) in slots.items() if si < cap[fi]}
        held = pool.keys()
        assert {k.seq_hash for k in held} == fits and 0 < len(fits) < len(keys)
        _check_readable(pool, held)
        assert sum(_slabs(tmp_path).values()) <= SMALL * 1e9, _slabs(tmp_path)
        more = NS.keys(range(1001, 1101))  # the pool goes on writing (and evicting) within the new capacity
        assert pool.put(more, [payload(k.seq_hash) for k in more]).result(timeout=HANG_S).written == len(more)
        assert pool.slot_accounting()["leaked"] == 0
        assert sum(_slabs(tmp_path).values()) <= SMALL * 1e9, _slabs(tmp_path)
        in_file0 = [k for k in pool.keys() if pool.cat.index.get(k)[0] == 0]

    with open_pool(tmp_path, capacity_gb=SMALL, files_per_path=1) as pool:
        assert list(_slabs(tmp_path)) == [f"g3-{NS.fingerprint}-0.slab"]  # file 1 is past files_per_path
        assert sum(_slabs(tmp_path).values()) <= SMALL * 1e9
        assert {k.seq_hash for k in pool.keys()} == {k.seq_hash for k in in_file0}
        _check_readable(pool, pool.keys())
