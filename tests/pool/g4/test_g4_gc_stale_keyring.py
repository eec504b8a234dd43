"""gc given a keyring copy one change behind (review finding of 2026-12-01): the operator revokes tenant alice, then
re-creates her (``keys create``: a new key id, the same pseudonym); gc runs with a copy of the keyring taken between
the two (a CronJob's Secret volume not yet synced). That copy shows alice revoked and not re-created, and gc deleted
every block under her pseudonym unread, the blocks sealed under her new key too: good blocks every worker serves
(10 of 10 loads before the pass, 0 of 10 after; ``headers_read`` 0). The revocation record names the revoked key
ids, so gc now reads each such block's frame header and deletes only those sealed under a revoked key; the others
are kept and counted (``revoked_kept``, with a ``warnings`` line). Real file and SeaweedFS stores, real keyring files
(the copy is a real copy of the file and its KEK), real pools, real ``run_gc``."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, provider_for
from kvbm_backend.pool.g4.factory import open_store
from kvbm_backend.pool.g4.gc import LATE_WRITE_S, run_gc
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
OLD = [1, 2, 3]  # alice's blocks sealed under her first key (revoked)
NEW = list(range(10, 20))  # the re-created alice's blocks (her new key)
BOB = [30]


def _store(kind: str, tmp_path, s3_prefix: str, request) -> tuple[str, str | None]:
    if kind == "fs":
        (tmp_path / "store").mkdir()
        return f"file://{tmp_path / 'store'}", None
    sw = request.getfixturevalue("seaweed")
    return sw.url(s3_prefix), sw.endpoint


def _keyring(tmp_path) -> str:
    (tmp_path / "keys").mkdir(mode=0o700)
    return str(tmp_path / "keys" / "kr.json")


def _copy(kr: str, dest_dir) -> Keyring:
    """A copy of the keyring file and its KEK as another host would hold it (a Secret volume): read-only."""
    dest_dir.mkdir(mode=0o700)
    dest = str(dest_dir / "kr.json")
    for suffix in ("", ".kek"):
        shutil.copyfile(kr + suffix, dest + suffix)
        os.chmod(dest + suffix, 0o600)
    return Keyring(dest, provider_for(dest), read_only=True)


def _pool(url: str, endpoint: str | None, kr: str, **kw) -> G4Pool:
    return G4Pool(G4Config(url=url, endpoint_url=endpoint, timeout_s=30.0,
                           keyring={"path": kr, "auto_create_tenants": False}, **kw), namespace())


def _put(p: G4Pool, seqs: list[int], tenant: str) -> None:
    ns, bpb = p.namespace, p.namespace.layout.bytes_per_block
    r = p.put(ns.keys(seqs, tenant=tenant), [payload(s, tenant, bpb) for s in seqs]).result(HANG_S)
    assert r.written == len(seqs), r
    p.flush(HANG_S)


def _loads(p: G4Pool, seqs: list[int], tenant: str) -> int:
    """How many of ``seqs`` load, each with the bytes written."""
    ns, bpb = p.namespace, p.namespace.layout.bytes_per_block
    out = [np.zeros(bpb, np.uint8) for _ in seqs]
    ok = p.get(ns.keys(seqs, tenant=tenant), out).result(HANG_S).ok
    return sum(bool(o) and np.array_equal(b, payload(s, tenant, bpb)) for o, b, s in zip(ok, out, seqs))


@pytest.mark.parametrize("kind", ["fs", "s3"])
def test_gc_with_a_keyring_copy_taken_before_the_re_creation_keeps_the_new_keys_blocks(kind, tmp_path, s3_prefix,
                                                                                      request):
    """alice's 3 blocks under her first key, bob's 1; ``revoke`` alice; the gc host's copy is taken; ``create``
    alice; she writes 10 blocks under her new key, which every worker loads. gc with the stale copy deletes the 3
    revoked blocks (their headers name a revoked key id) and keeps the 10 (``revoked_kept``, a warning naming the
    pseudonym); workers still load all 10. Before: 13 deleted unread, the 10 lost."""
    url, endpoint = _store(kind, tmp_path, s3_prefix, request)
    kr = _keyring(tmp_path)
    admin = Keyring(kr, provider_for(kr))
    admin.create("alice")
    admin.create("bob")
    with _pool(url, endpoint, kr) as p:
        _put(p, OLD, "alice")
        _put(p, BOB, "bob")
    ps = admin.revoke("alice")["pseudonym"]
    stale = _copy(kr, tmp_path / "gc-host")
    admin.create("alice")
    with _pool(url, endpoint, kr) as p:
        _put(p, NEW, "alice")
        assert _loads(p, NEW, "alice") == len(NEW)
    assert ps in stale.revoked() and ps not in {r["pseudonym"] for r in stale.info()}  # revoked, not re-created
    store = open_store(url, endpoint_url=endpoint)
    res = run_gc(store, keyring=stale)
    assert res["deleted_by"]["revoked"] == len(OLD), res  # before: 13, the re-created alice's blocks too
    assert res["revoked_kept"] == len(NEW) and res["headers_read"] == len(OLD) + len(NEW), res
    assert res["scanned_objects"] == len(OLD) + len(NEW) + len(BOB) and res["errors"] == 0, res
    assert [w for w in res["warnings"] if ps in w and "re-created" in w], res
    with _pool(url, endpoint, kr) as p:
        assert _loads(p, NEW, "alice") == len(NEW)  # before: 0
        assert _loads(p, BOB, "bob") == len(BOB)
        assert p.lookup_prefix(p.namespace.keys(OLD, tenant="alice")).result(HANG_S) == 0
    again = run_gc(store, keyring=stale)  # repeatable: nothing more goes
    assert again["deleted_objects"] == 0 and again["revoked_kept"] == len(NEW), again
    fresh = run_gc(store, keyring=Keyring(kr, provider_for(kr), read_only=True))  # the synced copy: re-created
    assert fresh["deleted_objects"] == 0 and fresh["revoked_kept"] == 0 and "warnings" not in fresh, fresh


def _set_revoked_at(kr: str, t: float) -> None:
    """Set every ``revoked_at`` of the keyring to ``t`` (same file discipline: 0600, atomic rename), as ``keys
    revoke`` run at ``t`` would have written it."""
    doc = json.loads(open(kr).read())
    for rec in doc["revoked"].values():
        rec["revoked_at"] = t
    tmp = f"{kr}.edit"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, kr)


def test_plaintext_blocks_of_a_tenant_a_stale_keyring_shows_not_re_created(tmp_path):
    """A plaintext pool with a keyring (checksummed frames name no key). gc's copy shows alice revoked and not
    re-created: her blocks modified up to ``revoked_at`` + LATE_WRITE_S (before the revocation; a late write of a
    worker that had not re-read the keyring) are reclaimed as before; a plaintext block modified later can only be
    the re-created alice's (a pool writes nothing for a revoked tenant once it re-read its keyring): kept, counted
    ``revoked_kept``. Before: all three deleted unread."""
    (tmp_path / "store").mkdir()
    url = f"file://{tmp_path / 'store'}"
    kr = _keyring(tmp_path)
    admin = Keyring(kr, provider_for(kr))
    admin.create("alice")
    revoked_at = time.time() - 2 * LATE_WRITE_S
    with _pool(url, None, kr, encrypt=False) as p:
        _put(p, [1, 2], "alice")
        names = {s: p.object_name(p.namespace.key(s, tenant="alice")) for s in (1, 2, 3)}
    root = tmp_path / "store"
    os.utime(root / names[1], (revoked_at - 60, revoked_at - 60))  # written before the revocation
    os.utime(root / names[2], (revoked_at + LATE_WRITE_S / 2,) * 2)  # a late write, within the window
    admin.revoke("alice")
    _set_revoked_at(kr, revoked_at)
    stale = _copy(kr, tmp_path / "gc-host")
    Keyring(kr, provider_for(kr)).create("alice")
    with _pool(url, None, kr, encrypt=False) as p:
        _put(p, [3], "alice")  # the re-created alice's, now: after revoked_at + LATE_WRITE_S
    res = run_gc(open_store(url), keyring=stale)
    assert res["deleted_by"]["revoked"] == 2 and res["revoked_kept"] == 1 and res["headers_read"] == 3, res
    assert not (root / names[1]).exists() and not (root / names[2]).exists() and (root / names[3]).exists()
    with _pool(url, None, kr, encrypt=False) as p:
        assert _loads(p, [3], "alice") == 1


def test_a_revocation_record_without_key_ids_still_reclaims_every_block_unread(tmp_path):
    """A record written before 2026-11-30 names no key ids: gc cannot tell a revoked key's blocks from others, so a
    tenant its keyring shows not re-created loses every block, unread, as before."""
    (tmp_path / "store").mkdir()
    url = f"file://{tmp_path / 'store'}"
    kr = _keyring(tmp_path)
    admin = Keyring(kr, provider_for(kr))
    admin.create("alice")
    with _pool(url, None, kr) as p:
        _put(p, OLD, "alice")
    admin.revoke("alice")
    doc = json.loads(open(kr).read())
    for rec in doc["revoked"].values():
        rec.pop("key_ids")
    tmp = f"{kr}.edit"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, kr)
    res = run_gc(open_store(url), keyring=Keyring(kr, provider_for(kr), read_only=True))
    assert res["deleted_by"]["revoked"] == len(OLD) and res["headers_read"] == 0 and res["revoked_kept"] == 0, res
