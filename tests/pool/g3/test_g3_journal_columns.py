"""The journal's columnar codec (``pool/g3/journal_columns.py``) against the record-by-record reference: the
replay rule of ``journal._apply`` (which version 1 still replays with) and ``journal.encode``, on random record
streams with repeated keys, reused slots, DELs, torn tails and flipped bytes; the rare exact path taken when the
64-bit key mix collides; and a compaction's rewrite of a real pool read back by a restart."""
from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from kvbm_backend.pool.g3 import journal as jr, journal_columns as jc
from kvbm_backend.pool.g3.index import TagKey
from tests.helpers.crash_writer import NS, open_pool, payload

HANG_S = 600.0  # a hang guard, not a bound

FP = NS.fingerprint


def _reference(data: bytes) -> tuple[list, int, int]:
    """Replay ``data`` record by record (``journal._apply``): (entries, records, good bytes)."""
    entries: OrderedDict = OrderedDict()
    by_slot: dict = {}
    pos = n = 0
    size = jr.RECORD_BYTES
    while pos + size <= len(data):
        kind, fi, si, seq, rank, tag = jr._REC.unpack_from(data, pos)
        body = data[pos:pos + jr._REC.size]
        if kind not in (jr.PUT, jr.DEL) or jr._SUM.unpack_from(data, pos + jr._REC.size)[0] != jc.xxhash.xxh3_64_intdigest(body):
            break
        jr._apply(entries, by_slot, kind, TagKey(FP, tag, rank, seq), (fi, si))
        pos += size
        n += 1
    return list(entries.items()), n, pos


def _stream(rnd: random.Random) -> bytes:
    tags = [bytes([t]) * 16 for t in range(3)]
    keys, slots = rnd.randint(1, 40), rnd.randint(1, 25)
    recs = [jr.encode(rnd.choice((jr.PUT, jr.PUT, jr.PUT, jr.DEL)),
                      TagKey(FP, rnd.choice(tags), rnd.randrange(2), rnd.randrange(keys)),
                      (rnd.randrange(3), rnd.randrange(slots))) for _ in range(rnd.randint(0, 300))]
    data = b"".join(recs)
    if data and rnd.random() < 0.3:
        data = data[:rnd.randrange(len(data))]  # a torn tail
    if len(data) > 50 and rnd.random() < 0.3:
        b = bytearray(data)
        b[rnd.randrange(len(b))] ^= 0x5A  # a damaged record ends the replay there
        data = bytes(b)
    return data


@pytest.mark.parametrize("seed", range(0, 400, 40))
def test_columnar_replay_and_encoding_match_the_record_by_record_reference(seed):
    for s in range(seed, seed + 40):
        data = _stream(random.Random(s))
        want, n, good = _reference(data)
        cols, n2, good2 = jc.decode(data)
        assert (n2, good2) == (n, good), s
        assert jc.pairs_of(cols, FP) == want, s
        assert jc.encode(jr.PUT, cols) == b"".join(jr.encode(jr.PUT, k, slot) for k, slot in want), s
        assert jc.encode(jr.PUT, jc.columns_of(want)) == jc.encode(jr.PUT, cols), s


def test_a_collision_of_the_key_mix_falls_back_to_the_exact_sort(monkeypatch):
    """Every key mixed to one value (what a 64-bit collision looks like): runs of equal mixes are not equal keys,
    so the replay sorts by every column instead, and still matches the reference."""
    monkeypatch.setattr(jc, "fmix64_v", lambda x: x * np.uint64(0))
    for s in range(60):
        data = _stream(random.Random(1000 + s))
        want, n, good = _reference(data)
        cols, n2, good2 = jc.decode(data)
        assert (n2, good2) == (n, good) and jc.pairs_of(cols, FP) == want, s


def test_a_restart_restores_what_a_compacted_journal_names_in_lru_order(tmp_path, monkeypatch):
    """A real pool small enough to evict (slots reused: later PUTs take earlier keys' slots), with deletes and
    compactions (the index's columns encoded off the lock): the reopened pool holds exactly the blocks, slots and
    LRU order it held at close, and every block reads back."""
    from kvbm_backend.pool.g3 import catalog
    monkeypatch.setattr(catalog, "COMPACT_MIN_RECORDS", 100)
    with open_pool(tmp_path, capacity_gb=0.002, write_queue_blocks=10_000) as pool:  # ~170 slots
        for k in range(1, 700, 30):
            keys = NS.keys(range(k, k + 30))
            assert pool.put(keys, [payload(x.seq_hash) for x in keys]).result().written == 30
            pool.delete(keys[:3])
        assert pool.flush(timeout=HANG_S)
        held = list(pool.index.items())
        compactions = pool.stats().get("journal_compactions", 0)
    assert len(held) > 100 and compactions >= 1, (len(held), compactions)
    with open_pool(tmp_path, capacity_gb=0.002, write_queue_blocks=10_000) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == len(held) and st.get("restore_dropped", 0) == 0, st
        assert [(k.seq_hash, s) for k, s in pool.index.items()] == [(k.seq_hash, s) for k, s in held]
        keys = [NS.key(k.seq_hash) for k, _ in held]
        out = [np.zeros_like(payload(0)) for _ in keys]
        assert all(pool.get(keys, out).result().ok)
        assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))
