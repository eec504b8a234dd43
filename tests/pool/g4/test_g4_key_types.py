"""G4 keys: numpy integer fields are the same keys, and a delete names every key before it deletes anything.

Before 2026-12-04 ``G4Pool.delete`` of a key no object name can hold (seq_hash outside [0, 2**64) or not an
integer, rank outside [0, 2**32)) failed its future with ``struct.error`` after the keys before it had been deleted
from the store, counting none of them ``deleted``. Real pools on a ``file://`` store.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.model.namespace import BlockKey
from kvbm_backend.pool.g4 import G4Pool
from tests.helpers.pools import G4_TIMEOUT_S, tiny_ns

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
NS = tiny_ns("g4/key-types")
BB = NS.layout.bytes_per_block


def _pool(tmp_path):
    return G4Pool(G4Config(url=f"file://{tmp_path / 'g4'}", encrypt=False, timeout_s=G4_TIMEOUT_S), NS)


def _key(seq, rank=0):
    return BlockKey(NS.fingerprint, "t", rank, seq)


def _block(i):
    return np.full(BB, i % 251, np.uint8)


def _objects(tmp_path):
    return sorted(p for p in (tmp_path / "g4").rglob("*") if p.is_file() and p.name != "namespace.json")


def test_numpy_integer_keys_name_the_same_objects(tmp_path):
    with _pool(tmp_path) as pool:
        assert pool.put([_key(s) for s in range(1, 4)], [_block(s) for s in range(1, 4)]).result(HANG_S).written == 3
        alias = [_key(np.int64(1)), _key(np.uint64(2)), _key(3, rank=np.int32(0))]
        assert pool.lookup_prefix(alias).result(HANG_S) == 3
        out = [np.zeros(BB, np.uint8) for _ in alias]
        assert pool.get(alias, out).result(HANG_S).ok == [True] * 3
        assert all(np.array_equal(o, _block(s)) for o, s in zip(out, range(1, 4)))
        assert pool.put(alias, [_block(s) for s in range(1, 4)]).result(HANG_S).skipped == 3
        assert pool.delete(alias).result(HANG_S) == 3
        assert pool.stats()["deleted"] == 3 and _objects(tmp_path) == []


@pytest.mark.parametrize("bad", [_key(1 << 64), _key(-1), _key(2.5), _key(7, rank=1 << 32)],
                         ids=["seq_2_64", "seq_negative", "seq_float", "rank_2_32"])
def test_a_delete_with_a_key_no_object_can_have_deletes_and_counts_the_others(tmp_path, bad):
    with _pool(tmp_path) as pool:
        held = [_key(s) for s in range(1, 4)]
        assert pool.put(held, [_block(s) for s in range(1, 4)]).result(HANG_S).written == 3
        assert len(_objects(tmp_path)) == 3
        assert pool.delete([held[0], bad, held[1]]).result(HANG_S) == 2  # the bad key: not present
        st = pool.stats()
        assert st["deleted"] == 2 and st.get("delete_errors", 0) == 0, st
        assert pool.lookup_prefix([held[2]]).result(HANG_S) == 1 and len(_objects(tmp_path)) == 1
