"""Invariant 1 (never wrong KV) on real slab files: bit flips in payload and header, truncated slab
files, swapped slots; live and across a restart. Every case is detected, counted and dropped."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import G3Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

BB = LAYOUT.bytes_per_block
SLOT = frame.slot_bytes(BB)


def _setup(pool, n=8):
    keys = NS.keys(range(1, n + 1))
    assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result().written == n
    where = {k: (pool.slabs.by_index[f].path, s) for k, (f, s) in zip(keys, (pool.index.get(k) for k in keys))}
    return keys, where


def _flip(path, offset, bit=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def _get(pool, keys):
    out = [aligned_empty(BB) for _ in keys]
    got = pool.get(keys, out).result(timeout=HANG_S)
    for k, ok, o in zip(keys, got.ok, out):
        if ok:
            assert np.array_equal(o, payload(k.seq_hash))
    return got.ok


@pytest.mark.parametrize("gather", [True, False], ids=["staged", "zero-copy"])
def test_payload_and_header_bit_flips_live(tmp_path, gather, monkeypatch):
    monkeypatch.setattr(G3Pool, "gather_below", (1 << 30) if gather else 0)
    with open_pool(tmp_path) as pool:
        keys, where = _setup(pool)
        p, s = where[keys[0]]
        _flip(p, s * SLOT + frame.HEADER_BYTES + 1234, bit=3)  # payload
        p, s = where[keys[1]]
        _flip(p, s * SLOT + 40)  # header: sequence-hash field, caught by the header check
        p, s = where[keys[2]]
        _flip(p, s * SLOT + frame.HEADER_BYTES + BB - 1, bit=7)  # last payload byte
        assert _get(pool, keys) == [False, False, False] + [True] * 5
        st = pool.stats()
        assert st["corrupt"] == 3
        assert st["corrupt_by_reason"] == {"integrity": 2, "header_check": 1}
        assert st["misses_by_reason"]["corrupt"] == 3
        assert [pool.contains(k) for k in keys[:3]] == [False] * 3  # dropped
        assert pool.slot_accounting()["leaked"] == 0
        # the slots are reusable and a rewrite is served again
        assert pool.put(keys[:3], [payload(k.seq_hash) for k in keys[:3]]).result().written == 3
        assert all(_get(pool, keys))


def test_swapped_slots_are_identity_misses(tmp_path):
    with open_pool(tmp_path) as pool:
        keys, where = _setup(pool)
        (pa, sa), (pb, sb) = where[keys[3]], where[keys[4]]
        with open(pa, "rb") as f:
            f.seek(sa * SLOT)
            a = f.read(SLOT)
        with open(pb, "rb") as f:
            f.seek(sb * SLOT)
            b = f.read(SLOT)
        with open(pa, "r+b") as f:
            f.seek(sa * SLOT)
            f.write(b)
        with open(pb, "r+b") as f:
            f.seek(sb * SLOT)
            f.write(a)
        ok = _get(pool, keys)
        assert ok[3] is False and ok[4] is False and sum(ok) == 6
        assert pool.stats()["corrupt_by_reason"] == {"identity": 2}


def test_truncated_slab_file_is_short_miss(tmp_path):
    with open_pool(tmp_path, files_per_path=1) as pool:
        keys, where = _setup(pool)
        path = where[keys[0]][0]
        last = max(s for _, s in where.values())
        os.truncate(path, last * SLOT + frame.HEADER_BYTES + 100)  # cut into the last slot's payload
        ok = _get(pool, keys)
        assert ok == [True] * 7 + [False]
        assert pool.stats()["misses_by_reason"]["short"] == 1
        assert not pool.contains(keys[-1])


def test_corruption_across_restart(tmp_path):
    with open_pool(tmp_path) as pool:
        keys, where = _setup(pool, 12)
    p, s = where[keys[0]]
    _flip(p, s * SLOT + 2)  # header magic
    p, s = where[keys[1]]
    _flip(p, s * SLOT + frame.HEADER_BYTES + 77)  # payload: found at first read, not at open
    p, s = where[keys[2]]
    with open(p, "r+b") as f:  # header of another block written over this slot
        f.seek(where[keys[3]][1] * SLOT)
        other = f.read(frame.HEADER_BYTES) if where[keys[3]][0] == p else None
    if other is None:
        with open(where[keys[3]][0], "rb") as f:
            f.seek(where[keys[3]][1] * SLOT)
            other = f.read(frame.HEADER_BYTES)
    with open(p, "r+b") as f:
        f.seek(s * SLOT)
        f.write(other)
    with open(tmp_path / f"journal-{NS.fingerprint}.log", "ab") as f:
        f.write(b"\x01garbage torn tail")
    with open_pool(tmp_path) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == 10 and st["restore_dropped"] == 2
        assert st["restore_dropped_by_reason"] == {"magic": 1, "identity": 1}
        ok = _get(pool, keys)
        assert ok == [False, False, False] + [True] * 9
        assert pool.stats()["corrupt_by_reason"] == {"integrity": 1}
        assert pool.slot_accounting()["leaked"] == 0
    with open_pool(tmp_path) as pool:  # the dropped entries stay dropped
        assert pool.stats()["restored_blocks"] == 9


def test_a_block_written_again_while_its_old_slot_is_proven_bad_is_kept(tmp_path):
    """Review finding (2026-11-29): a slot reported bad is re-read to prove it (``prove_bad``) outside the
    pool's lock; if the key was deleted and written again to another slot meanwhile, the DEL record appended
    for the old slot dropped the new copy at the next restart. The removal and its DEL now happen only while
    the key still maps to the slot proven bad. The concurrent delete + put is run at that very point (inside
    the re-read), on the real pool."""
    pool = open_pool(tmp_path)
    keys, where = _setup(pool, 4)
    k = keys[1]
    path, s = where[k]
    _flip(path, s * SLOT + frame.HEADER_BYTES + 100)  # the payload of k's first copy
    rd = pool.reader
    prove = rd.prove_bad
    new = payload(999)  # k's new content (any bytes: a block written again)

    def user_rewrites_k_during_the_proof(slot, rec, digest=None):
        assert pool.delete([k]).result() == 1
        assert pool.put([k], [new]).result().written == 1
        return prove(slot, rec, digest)
    rd.prove_bad = user_rewrites_k_during_the_proof
    try:
        pool.drop_corrupt(k, "devcheck")  # what a device load reports for the old slot
    finally:
        rd.prove_bad = prove
    out = [aligned_empty(BB)]
    assert pool.get([k], out).result(timeout=HANG_S).ok == [True] and np.array_equal(out[0], new)
    pool.close()
    pool = open_pool(tmp_path)
    try:
        out = [aligned_empty(BB)]
        assert pool.get([k], out).result(timeout=HANG_S).ok == [True] and np.array_equal(out[0], new)  # restart
    finally:
        pool.close()


def test_a_block_written_again_into_the_slot_being_proven_bad_is_kept(tmp_path):
    """Review finding (2026-11-30): ``drop_corrupt`` re-read the slot to prove it bad without pinning it. The
    check above (the key still maps to the slot proven bad) then cannot tell the bad old copy from a good new
    copy written into that very slot meanwhile: deleted during the proof, the slot was free at once, and on a
    full pool the key's new write took it; the proof's verdict on the old bytes then dropped the new copy (and
    journaled DEL). The slot is now pinned during the proof (as the host get does), so a delete meanwhile only
    defers its free and the new copy lands elsewhere. The re-read sees the corrupt old frame, then the user
    deletes and rewrites the key (inside the proof, on the real pool)."""
    slots = 8
    pool = open_pool(tmp_path, capacity_gb=slots * SLOT / 1e9, files_per_path=1)
    keys, where = _setup(pool, slots)  # the pool is full: a freed slot is the next one written
    k = keys[3]
    path, s = where[k]
    _flip(path, s * SLOT + frame.HEADER_BYTES + 100)  # the payload of k's copy
    rd = pool.reader
    prove = rd.prove_bad
    new = payload(999)
    landed = []

    def user_rewrites_k_during_the_proof(slot, rec, digest=None):
        verdict = prove(slot, rec, digest)  # the old, corrupt bytes
        assert verdict == "integrity"
        assert pool.delete([k]).result() == 1
        assert pool.put([k], [new]).result(timeout=HANG_S).written == 1
        landed.append(pool.index.get(k))
        return verdict
    rd.prove_bad = user_rewrites_k_during_the_proof
    try:
        pool.drop_corrupt(k, "integrity")  # what a device load reports for the slot
    finally:
        rd.prove_bad = prove
    assert landed and landed[0] is not None
    out = [aligned_empty(BB)]
    assert pool.get([k], out).result(timeout=HANG_S).ok == [True] and np.array_equal(out[0], new)
    assert pool.slot_accounting()["leaked"] == 0
    pool.close()
    pool = open_pool(tmp_path, capacity_gb=slots * SLOT / 1e9, files_per_path=1)
    try:
        out = [aligned_empty(BB)]
        assert pool.get([k], out).result(timeout=HANG_S).ok == [True] and np.array_equal(out[0], new)  # restart
        assert pool.slot_accounting()["leaked"] == 0
    finally:
        pool.close()
