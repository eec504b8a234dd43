"""A create-exclusive offload that finds an object under its name counted the block stored (``skipped_exists``)
whatever that object was, so callers (the native G4Tier: chunks_stored, KV 'stored' events) reported blocks the
pool then never served (review finding of 2026-11-30). Now the writer reads the existing object's frame header
(one ranged GET) and checks it as the reader would: an object this pool will not serve is ``skipped_unservable``
and the block is reported not stored (``PutResult.dropped``); one it serves stays ``skipped_exists``. Real file://
stores and SeaweedFS; the revoked-key case is tests/pool/g4/test_g4_revoked_late_writes.py."""
from __future__ import annotations

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_target import g4_target
from tests.helpers.g4_writer import namespace, put_blocks, read_checked


@pytest.fixture(params=["fs", "s3"])
def target(request, tmp_path, s3_prefix):
    """(cfg kwargs) for one store kind; keyring in tmp_path (:func:`tests.helpers.g4_target.g4_target`)."""
    return g4_target(request, tmp_path, s3_prefix)


def _pool(kw, **over) -> G4Pool:
    return G4Pool(G4Config(**{**kw, **over}), namespace())


def _name(p: G4Pool, seq: int, tenant: str) -> str:
    return p.object_name(namespace().key(seq, tenant=tenant))


def test_a_plaintext_frame_in_an_encrypted_pool_is_not_reported_stored(target):
    """g4.encrypt switched on: the plaintext copies hold the names. Before: put said skipped 3 (stored) and
    skipped_exists 3, while every load missed. Now: dropped 3 (not stored), skipped_unservable 3; once a load
    dropped the plaintext copies (deleted_unencrypted) the offloads are written, and a later offload of those
    blocks is skipped_exists (the pool serves what is there)."""
    seqs = [1, 2, 3]
    with _pool(target, encrypt=False) as plain:
        assert put_blocks(plain, seqs, "alice").written == 3
    with _pool(target) as enc:
        res = put_blocks(enc, seqs, "alice")
        assert (res.written, res.skipped, res.dropped) == (0, 0, 3), res
        st = enc.stats()
        assert st["skipped_unservable"] == 3 and st["skipped_exists"] == 0, st
        assert st["skipped"] == 3 and st["dropped"] == 0, st  # counted skipped in stats, not a drop reason
        assert read_checked(enc, seqs, "alice") == [False] * 3 and enc.stats()["deleted_unencrypted"] == 3
        assert put_blocks(enc, seqs, "alice").written == 3
        res = put_blocks(enc, seqs, "alice")
        assert (res.written, res.skipped, res.dropped) == (0, 3, 0), res
        st = enc.stats()
        assert st["skipped_exists"] == 3 and st["skipped_unservable"] == 3, st
        assert read_checked(enc, seqs, "alice") == [True] * 3


@pytest.mark.parametrize("encrypt", [False, True])
def test_another_blocks_frame_or_a_garbled_header_under_the_name_is_not_reported_stored(target, encrypt):
    """An object under alice's name that holds bob's frame (another tenant's identity) or a frame whose header
    fails its check: the reader never serves either, so the offload is not reported stored. alice's own copy
    (written before) is skipped_exists."""
    with _pool(target, encrypt=encrypt) as p:
        assert put_blocks(p, [1, 2, 3], "bob").written == 3
        assert put_blocks(p, [3], "alice").written == 1
        bob1 = bytes(p.store.get(_name(p, 1, "bob")))
        bad = bytearray(p.store.get(_name(p, 2, "bob")))
        bad[100] ^= 0xFF  # inside the header: its own check fails
        assert len(bad) > HEADER_BYTES
        assert p.store.put_if_absent(_name(p, 1, "alice"), bob1)
        assert p.store.put_if_absent(_name(p, 2, "alice"), bytes(bad))
        res = put_blocks(p, [1, 2, 3], "alice")
        assert (res.written, res.skipped, res.dropped) == (0, 1, 2), res
        st = p.stats()
        assert st["skipped_unservable"] == 2 and st["skipped_exists"] == 1, st
        assert read_checked(p, [1, 2, 3], "alice") == [False, False, True]
