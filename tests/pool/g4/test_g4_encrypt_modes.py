"""G4 pools of both ``g4.encrypt`` settings on one store and keyring (review findings of 2026-11-30, reproduced on
real file stores and SeaweedFS): a pool switched to encryption drops the plaintext blocks it can never serve
instead of keeping them for good, a fleet mid-rollout converges without deleting blocks the other setting
serves, and a plaintext pool with a keyring honours a tenant's revocation."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from kvbm_backend.config import G4Config
from kvbm_backend.model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameHeader
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_target import g4_target

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do


@pytest.fixture(params=["fs", "s3"])
def target(request, tmp_path, s3_prefix):
    """(cfg kwargs) for one store kind; keyring in tmp_path (:func:`tests.helpers.g4_target.g4_target`)."""
    return g4_target(request, tmp_path, s3_prefix)


def _pool(kw, **over) -> G4Pool:
    return G4Pool(G4Config(**{**kw, **over}), namespace())


def _flags(p: G4Pool, seq: int, tenant: str) -> int | None:
    raw = p.store.get(p.object_name(namespace().key(seq, tenant=tenant)))
    return None if raw is None else FrameHeader.unpack(bytes(raw)[:HEADER_BYTES]).flags


def _lookup(p: G4Pool, seqs, tenant) -> int:
    return p.lookup_prefix(namespace().keys(seqs, tenant=tenant)).result(timeout=HANG_S)


def test_a_pool_switched_to_encryption_replaces_its_plaintext_blocks(target):
    """g4.encrypt false -> true with the same keyring (same keyed names). Before: the plaintext objects were
    never served and never deleted, so under create-exclusive every later run's offloads were skipped_exists,
    its lookups hits and its loads misses, for good. Now the first load drops them (the store confirms the
    bytes first) and the next offload writes the encrypted copy, served from then on."""
    seqs = [1, 2, 3]
    with _pool(target, encrypt=False) as plain:
        assert put_blocks(plain, seqs, "alice").written == 3
    with _pool(target) as enc:
        # the plaintext copies hold the names: not stored (before: skipped 3, as if stored)
        assert put_blocks(enc, seqs, "alice").dropped == 3 and enc.stats()["skipped_unservable"] == 3
        assert _lookup(enc, seqs, "alice") == 3  # a HEAD cannot tell: one miss per block, below
        assert read_checked(enc, seqs, "alice") == [False] * 3
        st = enc.stats()
        assert st["miss_unencrypted_object"] == 3 and st["deleted_unencrypted"] == 3, st
        assert st.get("hits", 0) == 0 and st.get("deleted_corrupt", 0) == 0
        assert [_flags(enc, s, "alice") for s in seqs] == [None] * 3
        assert put_blocks(enc, seqs, "alice").written == 3  # the recomputed blocks' offloads go in
    with _pool(target) as enc:  # a later run
        assert _lookup(enc, seqs, "alice") == 3
        assert read_checked(enc, seqs, "alice") == [True] * 3
        assert [_flags(enc, s, "alice") for s in seqs] == [FLAG_ENCRYPTED] * 3
        assert enc.stats().get("miss_unencrypted_object", 0) == 0


def test_a_fleet_mid_rollout_converges_on_encrypted_blocks_both_settings_serve(target, tmp_path):
    """Workers of both settings on one store and keyring. Plaintext workers serve encrypted blocks (the shared
    keyring opens them) and never delete one they cannot open: a keyring copy without the tenant's data key
    (same pseudonym key: same names) misses (miss_no_key) and leaves it. Encrypted workers delete plaintext
    blocks only, and their encrypted rewrite is then served by both: no block of either kind ping-pongs."""
    kr = target["keyring"]["path"]
    with _pool(target, encrypt=False) as plain:  # creates the keyring; a copy made now has no key for alice
        assert put_blocks(plain, [20], "alice").written == 1  # plaintext: creates no data key
    stale_dir = tmp_path / "stale"
    stale_dir.mkdir(mode=0o700)
    stale = stale_dir / "keyring.json"
    for src, dst in ((kr, stale), (kr + ".kek", str(stale) + ".kek")):
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o600)
    with _pool(target) as enc, _pool(target, encrypt=False) as plain, \
            _pool(target, encrypt=False, keyring={"path": str(stale)}) as blind:
        assert put_blocks(enc, [10, 11], "alice").written == 2
        assert read_checked(plain, [10, 11], "alice") == [True, True]  # plaintext workers serve them
        assert put_blocks(plain, [10, 11], "alice").skipped == 2
        assert read_checked(blind, [10, 11], "alice") == [False, False]
        assert blind.stats()["miss_no_key"] == 2 and blind.stats().get("deleted_corrupt", 0) == 0
        assert [_flags(enc, s, "alice") for s in (10, 11)] == [FLAG_ENCRYPTED] * 2  # left where they are
        assert read_checked(enc, [10, 11], "alice") == [True, True]
        # a plaintext worker's block: encrypted workers drop it once, rewrite it, and then both serve that
        assert _flags(enc, 20, "alice") == FLAG_CHECKSUM
        assert read_checked(enc, [20], "alice") == [False] and enc.stats()["deleted_unencrypted"] == 1
        assert put_blocks(enc, [20], "alice").written == 1
        assert read_checked(plain, [20], "alice") == [True] and read_checked(enc, [20], "alice") == [True]
        assert put_blocks(plain, [20], "alice").skipped == 1
        assert _flags(enc, 20, "alice") == FLAG_ENCRYPTED
        for p in (plain, blind):
            assert p.stats().get("deleted_corrupt", 0) == 0 and p.stats().get("deleted_unencrypted", 0) == 0


def test_a_plaintext_pool_with_a_keyring_honours_revocation(target):
    """g4.encrypt false with a keyring (keyed names). Before: the pool never asked its keyring about tenants, so a
    revoked tenant's blocks were still found and served and its offloads written. Now as in encrypted pools:
    lookups and loads miss (miss_revoked_tenant), offloads are dropped (dropped_revoked_tenant); other
    tenants, and unknown ones (no data key needed), are served; gc --keyring reclaims the revoked blocks."""
    with _pool(target, encrypt=False) as p:
        p.keyring.create("alice")
        p.keyring.create("bob")
        assert put_blocks(p, [1], "alice").written == 1 and put_blocks(p, [2], "bob").written == 1
        assert read_checked(p, [1], "alice") == [True]
        p.keyring.revoke("alice")
        assert _lookup(p, [1], "alice") == 0
        assert read_checked(p, [1], "alice") == [False]
        assert put_blocks(p, [3], "alice").dropped == 1
        st = p.stats()
        assert st["miss_revoked_tenant"] == 1 and st["dropped_revoked_tenant"] == 1, st
        assert _flags(p, 1, "alice") == FLAG_CHECKSUM and _flags(p, 3, "alice") is None  # kept for gc; not written
        assert _lookup(p, [2], "bob") == 1 and read_checked(p, [2], "bob") == [True]
        assert put_blocks(p, [4], "bob").written == 1
        assert put_blocks(p, [5], "carol").written == 1 and read_checked(p, [5], "carol") == [True]  # unknown
        res = run_gc(p.store, keyring=p.keyring)
        assert res["deleted_by"]["revoked"] == 1 and _flags(p, 1, "alice") is None, res
        p.keyring.create("alice")  # re-created by the operator: served and written again
        assert put_blocks(p, [1], "alice").written == 1 and read_checked(p, [1], "alice") == [True]


def test_a_plaintext_pool_with_a_keyring_fails_closed_while_it_does_not_load(tmp_path):
    """As encrypted pools: a keyring file that stops loading (it may hold a revocation the pool cannot see) makes
    loads and lookups miss (miss_keyring_unavailable) and drops offloads (dropped_keyring) until it loads again.
    Before: the plaintext pool never asked its keyring and served on."""
    path = tmp_path / "keys" / "kr.json"
    reload_s = 0.05
    cfg = {"url": f"file://{tmp_path / 'store'}", "encrypt": False, "timeout_s": 60.0,
           "keyring": {"path": str(path), "reload_interval_s": reload_s}}

    def replace(data: bytes) -> None:
        tmp = path.with_name("next.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        time.sleep(2 * reload_s)  # at least one reload interval: the pool's next keyring call re-reads the file

    with _pool(cfg) as p:
        assert put_blocks(p, [1], "alice").written == 1 and read_checked(p, [1], "alice") == [True]
        good = path.read_bytes()
        replace(b"{not json")
        assert read_checked(p, [1], "alice") == [False]
        assert _lookup(p, [1], "alice") == 0 and put_blocks(p, [2], "alice").dropped == 1
        st = p.stats()
        assert st["keyring_ok"] is False and st["miss_keyring_unavailable"] == 1 and st["dropped_keyring"] == 1, st
        replace(good)
        assert read_checked(p, [1], "alice") == [True] and put_blocks(p, [2], "alice").written == 1
