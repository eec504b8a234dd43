"""Issue 10, keyring hardening: revocation reaches running pools within the keyring reload interval,
revoked tenants are never re-created implicitly, ``g4.keyring.auto_create_tenants``, key ids bound to
their tenant, and a read-only shared keyring (forced, and on a real read-only bind mount)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config, KeyringConfig
from kvbm_backend.crypto.aead import new_nonce, seal_into
from kvbm_backend.crypto.kek import KEYRING_TMP_MARK
from kvbm_backend.crypto.names import MAX_AUTO_TENANT_BYTES
from kvbm_backend.crypto.keyring import (Keyring, KeyringError, TenantRevoked, UnknownTenant, dir_is_read_only,
                                         provider_for)
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.model.frame import FLAG_ENCRYPTED, HEADER_BYTES, FrameHeader
from tests.helpers.g4_target import g4_target

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

pytestmark = [pytest.mark.slow]

RELOAD_S = 0.5  # g4.keyring.reload_interval_s used here: the stated revocation bound
SLACK_S = 1.0  # scheduling slack on 2 shared cores


@pytest.fixture(params=["fs", "s3"])
def target(request, tmp_path, s3_prefix):
    return g4_target(request, tmp_path, s3_prefix, timeout_s=5.0, reload_interval_s=RELOAD_S)


def _pool(kw, **keyring_over) -> G4Pool:
    d = dict(kw)
    d["keyring"] = {**kw["keyring"], **keyring_over}
    return G4Pool(G4Config(**d), namespace())


_put, _read = put_blocks, read_checked


def _operator(path) -> Keyring:
    """The operator's own view of the keyring file (another process: its own memory)."""
    return Keyring(path, provider_for(path))


def _keys_cli(*args) -> str:
    res = CliRunner().invoke(app, ["keys", *args])
    assert res.exit_code == 0, res.output
    return res.output


def _until(pred, bound_s: float) -> float:
    """Seconds until ``pred()`` held; fails if not within ``bound_s``."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < bound_s, f"not within {bound_s} s"
        time.sleep(0.05)
    return time.monotonic() - t0


# ---- 3. revocation reaches running pools -------------------------------------------------------
def test_revocation_reaches_running_pool_within_reload_interval(target, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kr_path = target["keyring"]["path"]
    ns = namespace()
    with _pool(target) as p:
        assert p.keyring.auto_create_tenants  # the default: even so, a revoked tenant is never re-created
        assert _put(p, [1, 2, 3], "alice").written == 3 and _put(p, [9], "bob").written == 1
        assert _read(p, [1, 2, 3], "alice") == [True] * 3  # keys now cached in this pool
        alice_key_id = p.keyring.info("alice")["key_id"]
        _keys_cli("revoke", "--keyring", kr_path, "--tenant", "alice")
        took = _until(lambda: _read(p, [1], "alice") == [False], RELOAD_S + SLACK_S)
        assert took <= RELOAD_S + SLACK_S
        assert _read(p, [1, 2, 3], "alice") == [False] * 3
        assert p.lookup_prefix(ns.keys([1, 2, 3], tenant="alice")).result(timeout=HANG_S) == 0
        res = _put(p, [4, 5], "alice")
        assert (res.written, res.dropped) == (0, 2)
        st = p.stats()
        assert st["miss_revoked_tenant"] >= 4 and st["dropped_revoked_tenant"] == 2
        assert _read(p, [9], "bob") == [True]  # other tenants unaffected
        doc = json.loads(Path(kr_path).read_text())
        assert "alice" not in doc["tenants"] and p.pseudonym("alice").hex() in doc["revoked"]
        # the revoked key is gone from memory too: no frame can be opened with it
        assert p.keyring.read_key(alice_key_id, 1) is None
        # only the operator brings the tenant back: a new key id; old blocks stay unreadable
        _keys_cli("create", "--keyring", kr_path, "--tenant", "alice")
        _until(lambda: p.keyring.tenant_state("alice") == "active", RELOAD_S + SLACK_S)
        assert p.keyring.info("alice")["key_id"] != alice_key_id
        assert _put(p, [6], "alice").written == 1 and _read(p, [6], "alice") == [True]
        assert _read(p, [1], "alice") == [False] and p.stats()["miss_no_key"] >= 1


def test_revoked_tenant_never_recreated_by_write_key(tmp_path):
    p = tmp_path / "kr.json"
    kr = Keyring(p, provider_for(p), reload_every_s=0)
    kr.write_key("alice")
    _operator(p).revoke("alice")
    with pytest.raises(TenantRevoked):
        kr.write_key("alice")
    assert kr.tenant_state("alice") == "revoked"
    # a process whose view predates the revocation still cannot re-create it (checked under the lock)
    stale = Keyring(p, provider_for(p), reload_every_s=3600)
    stale._doc["revoked"] = {}
    stale._doc["tenants"].pop("alice", None)
    with pytest.raises(TenantRevoked):
        stale.write_key("alice")
    assert "alice" not in json.loads(p.read_text())["tenants"]
    kr.create("alice")  # explicit: allowed
    assert kr.write_key("alice").version == 1 and kr.tenant_state("alice") == "active"


def test_rotation_due_after_a_revocation_elsewhere_is_revoked_and_never_logs_the_tenant(tmp_path, caplog):
    """A worker whose view predates a revocation (within reload_every_s) and whose key version reached
    rotate_after_uses: its next seal rotates, the rotation's locked re-read finds the tenant revoked. That is
    TenantRevoked (``dropped_revoked_tenant``), and neither the error nor the operator log names the tenant id
    (a cache_salt value): before, a plain KeyringError ``no tenant 'alice@...'`` was logged as dropped_keyring."""
    tenant = "alice@secret-customer.example"
    p = tmp_path / "kr.json"
    stale = Keyring(p, provider_for(p), rotate_after_uses=2, reload_every_s=3600)
    stale.create(tenant)
    stale.write_key(tenant), stale.write_key(tenant)  # version 1 reached rotate_after_uses
    _operator(p).revoke(tenant)
    with pytest.raises(TenantRevoked) as ei:
        stale.write_key(tenant)
    assert tenant not in str(ei.value) and stale.pseudonym(tenant).hex() in str(ei.value)
    with pytest.raises(KeyringError) as ei:  # an operator rotating an unknown tenant: the pseudonym too
        stale.rotate("bob@secret-customer.example")
    assert "bob@" not in str(ei.value)

    d = tmp_path / "pool"
    kr_path = d / "kr.json"
    kr = Keyring(kr_path, provider_for(kr_path), rotate_after_uses=1, reload_every_s=3600)
    cfg = G4Config(url=f"file://{d / 'store'}", keyring={"path": str(kr_path)}, timeout_s=60.0)
    with caplog.at_level(logging.WARNING, logger="kvbm_backend"), G4Pool(cfg, namespace(), keyring=kr) as pool:
        assert _put(pool, [1], tenant).written == 1
        _operator(kr_path).revoke(tenant)
        assert _put(pool, [2], tenant).dropped == 1
        st = pool.stats()
        assert st["dropped_revoked_tenant"] == 1 and st.get("dropped_keyring", 0) == 0, st
    lines = [r.getMessage() for r in caplog.records if "dropped_revoked_tenant" in r.getMessage()]
    assert len(lines) == 1 and kr.pseudonym(tenant).hex() in lines[0], lines
    assert not [r.getMessage() for r in caplog.records if tenant in r.getMessage()]


def test_keyring_that_stops_loading_fails_closed(tmp_path):
    p = tmp_path / "keys" / "kr.json"
    cfg = {"url": f"file://{tmp_path / 'store'}", "keyring": {"path": str(p), "reload_interval_s": RELOAD_S}}
    with _pool(cfg) as pool:
        assert _put(pool, [1], "alice").written == 1 and _read(pool, [1], "alice") == [True]
        good = p.read_bytes()
        tmp = p.with_name("broken.tmp")
        tmp.write_text("{not json")
        os.chmod(tmp, 0o600)
        os.replace(tmp, p)
        _until(lambda: _read(pool, [1], "alice") == [False], RELOAD_S + SLACK_S)
        assert _put(pool, [2], "alice").dropped == 1
        st = pool.stats()
        assert st["keyring_ok"] is False and st["miss_keyring_unavailable"] >= 1 and st["dropped_keyring"] == 1
        tmp.write_bytes(good)
        os.chmod(tmp, 0o600)
        os.replace(tmp, p)
        _until(lambda: _read(pool, [1], "alice") == [True], RELOAD_S + SLACK_S)
        assert pool.stats()["keyring_ok"] is True


# ---- 2. auto_create_tenants ---------------------------------------------------------------------
def test_auto_create_tenants_off_drops_counts_and_logs_once(target, caplog, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    assert KeyringConfig().auto_create_tenants is True  # documented default (README)
    kr_path = target["keyring"]["path"]
    _keys_cli("create", "--keyring", kr_path, "--tenant", "alice")
    before = json.loads(Path(kr_path).read_text())["tenants"].keys()
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.pool.g4.pool"), \
            _pool(target, auto_create_tenants=False) as p:
        assert _put(p, [1], "alice").written == 1 and _read(p, [1], "alice") == [True]
        for seqs in ([10, 11], [12]):
            res = _put(p, seqs, "mallory")
            assert (res.written, res.dropped) == (0, len(seqs))
        assert _read(p, [10, 11], "mallory") == [False, False]
        assert p.stats()["dropped_unknown_tenant"] == 3
        assert json.loads(Path(kr_path).read_text())["tenants"].keys() == before  # nothing created
        lines = [r.getMessage() for r in caplog.records if "dropped_unknown_tenant" in r.getMessage()]
        assert len(lines) == 1 and p.pseudonym("mallory").hex() in lines[0]
        assert "mallory" not in lines[0]  # tenant ids (cache_salt values) are never logged
        _keys_cli("create", "--keyring", kr_path, "--tenant", "mallory")
        _until(lambda: _put(p, [13], "mallory").written == 1, RELOAD_S + SLACK_S)
        assert _read(p, [13], "mallory") == [True]


def test_max_auto_tenants_bounds_the_tenants_a_flood_creates(target, caplog, monkeypatch):
    """Issue 26 item 5 (keyring): distinct cache_salts (tenants) offloading through a writable keyring with
    auto-creation create at most ``g4.keyring.max_auto_tenants`` entries; the rest are dropped
    (``dropped_unknown_tenant``), logged with the bound; existing tenants keep writing and ``keys create``
    still adds one past the bound."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    assert KeyringConfig().max_auto_tenants == 4096  # documented default (README)
    kr_path = target["keyring"]["path"]
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.pool.g4.pool"), _pool(target, max_auto_tenants=5) as p:
        assert _put(p, [1], "control").written == 1
        res = [_put(p, [2], f"salt-{i}") for i in range(20)]
        assert sum(r.written for r in res) == 4 and sum(r.dropped for r in res) == 16
        assert p.stats()["dropped_unknown_tenant"] == 16
        assert len(json.loads(Path(kr_path).read_text())["tenants"]) == 5
        assert _put(p, [3], "control").written == 1 and _read(p, [1, 3], "control") == [True, True]
        lines = [r.getMessage() for r in caplog.records if "max_auto_tenants=5" in r.getMessage()]
        assert lines and "salt-" not in " ".join(lines)  # tenant ids (cache_salt values) are never logged
        _keys_cli("create", "--keyring", kr_path, "--tenant", "salt-19")  # the operator is not limited
        _until(lambda: _put(p, [4], "salt-19").written == 1, RELOAD_S + SLACK_S)
        assert _read(p, [4], "salt-19") == [True]



def test_a_long_tenant_id_is_never_created_implicitly(target, caplog, monkeypatch):
    """A worker never writes a client's very long cache_salt (tenant id) into the keyring file: every
    creation rewrites that file and every worker re-reads it, so before 2026-11-30 ``max_auto_tenants``
    salts of 1 MB made it 4 GB (each 100 KB salt here added 100 KB). An id over ``MAX_AUTO_TENANT_BYTES``
    (UTF-8 bytes) is dropped as an unknown tenant, logged by pseudonym with that reason; one at the bound
    is created as before, and ``keys create`` still takes a long id."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kr_path = target["keyring"]["path"]
    at_bound, long_ids = "é" * (MAX_AUTO_TENANT_BYTES // 2), [f"{i}" + "x" * 100_000 for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.pool.g4.pool"), _pool(target) as p:
        assert _put(p, [1], at_bound).written == 1 and _read(p, [1], at_bound) == [True]
        res = [_put(p, [2], t) for t in long_ids + ["é" * (MAX_AUTO_TENANT_BYTES // 2) + "x"]]
        assert [r.dropped for r in res] == [1, 1, 1, 1] and p.stats()["dropped_unknown_tenant"] == 4
        assert set(json.loads(Path(kr_path).read_text())["tenants"]) == {at_bound}
        assert Path(kr_path).stat().st_size < 20_000
        lines = [r.getMessage() for r in caplog.records if "dropped_unknown_tenant" in r.getMessage()]
        assert lines and all(f"over {MAX_AUTO_TENANT_BYTES} bytes" in x and "xxxx" not in x for x in lines)
        _keys_cli("create", "--keyring", kr_path, "--tenant", long_ids[0])  # the operator is not limited
        _until(lambda: _put(p, [3], long_ids[0]).written == 1, RELOAD_S + SLACK_S)
        assert _read(p, [3], long_ids[0]) == [True]


# ---- 4. a key id serves only its own tenant -----------------------------------------------------
def test_blob_sealed_with_other_tenants_key_is_a_miss(target):
    ns = namespace()
    with _pool(target) as p:
        _put(p, [1], "alice")
        _put(p, [2], "bob")
        bob = p.keyring.write_key("bob")  # an insider holding B's data key forges a block for A
        key = ns.key(50, tenant="alice")
        hdr = FrameHeader.for_block(key, ns.layout, ns.tp_world_size, p.pseudonym("alice"))
        hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, bob.key_id, bob.version, new_nonce()
        evil = np.full(ns.layout.bytes_per_block, 0x41, np.uint8)
        buf = bytearray(HEADER_BYTES + ns.layout.bytes_per_block)
        hdr.integrity = seal_into(bob.key, hdr.nonce, hdr.identity_bytes(), evil, memoryview(buf)[HEADER_BYTES:])
        buf[:HEADER_BYTES] = hdr.pack()
        name = p.object_name(key)
        assert p.store.put_if_absent(name, bytes(buf))
        out = [np.zeros(ns.layout.bytes_per_block, np.uint8)]
        assert p.get([key], out).result(timeout=HANG_S).ok == [False]
        assert not np.array_equal(out[0], evil)
        st = p.stats()
        assert st["corrupt_key_owner"] == 1 and st["hits"] == 0
        assert p.store.head(name) is None  # dropped, so alice's own block can be published there
        assert p.keyring.read_key(bob.key_id, bob.version, tenant="alice") is None
        assert p.keyring.read_key(bob.key_id, bob.version, tenant="bob") == bob.key
        assert _read(p, [1], "alice") == [True] and _read(p, [2], "bob") == [True]


# ---- 1. read-only keyrings ----------------------------------------------------------------------
def _listing(d: Path) -> dict:
    return {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in sorted(d.iterdir())}


def test_forced_read_only_keyring_never_writes(tmp_path):
    d = tmp_path / "keys"
    p = d / "kr.json"
    op = _operator(p)
    op.create("alice")
    os.unlink(f"{p}.lock")
    snap = _listing(d)
    kr = Keyring(p, provider_for(p, create=False), read_only=True, reload_every_s=0.2, rotate_after_uses=3)
    assert kr.read_only
    dk = kr.write_key("alice")
    assert kr.read_key(dk.key_id, dk.version, tenant="alice") == dk.key
    with pytest.raises(UnknownTenant, match="read-only"):
        kr.write_key("carol")  # auto_create_tenants is on, but a read-only keyring creates nothing
    for fn in (lambda: kr.create("carol"), lambda: kr.rotate("alice"), lambda: kr.revoke("alice"),
               lambda: kr.rewrap(kr.provider)):
        with pytest.raises(KeyringError, match="read-only"):
            fn()
    kr.write_key("alice")
    kr.write_key("alice")  # 3 uses in this process: the limit
    with pytest.raises(KeyringError, match="keys rotate"):
        kr.write_key("alice")
    kr.flush()
    kr.close()
    assert _listing(d) == snap  # no lock file, no temp file, no use-count write
    # changes made where the keyring is writable reach it within its reload interval
    op.create("carol")
    op.rotate("alice")
    _until(lambda: kr.tenant_state("carol") == "active", 0.2 + SLACK_S)
    assert kr.write_key("alice").version == 2
    op.revoke("carol")
    _until(lambda: kr.tenant_state("carol") == "revoked", 0.2 + SLACK_S)
    with pytest.raises(KeyringError, match="not found"):
        Keyring(tmp_path / "absent" / "kr.json", provider_for(p), read_only=True)


def _ro_bind_mount(src: Path, dst: Path) -> None:
    dst.mkdir()
    r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    r = subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["umount", str(dst)], check=False)
        pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")


def test_shared_keyring_on_read_only_mount(tmp_path, monkeypatch):
    """The documented fleet set-up: operator writes the keyring elsewhere, workers see it on a
    read-only mount (a Kubernetes Secret volume behaves the same)."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    src, ro = tmp_path / "operator", tmp_path / "mnt"
    op = _operator(src / "keyring.json")
    op.create("alice")
    op.create("bob")
    _ro_bind_mount(src, ro)
    try:
        with pytest.raises(OSError):
            (ro / "probe").write_text("x")  # root too: EROFS
        assert dir_is_read_only(ro / "keyring.json") and not dir_is_read_only(src / "keyring.json")
        snap = _listing(src)
        cfg = {"url": f"file://{tmp_path / 'store'}",
               "keyring": {"path": str(ro / "keyring.json"), "reload_interval_s": RELOAD_S}}
        with _pool(cfg) as p:
            assert p.stats()["keyring_read_only"] is True
            assert _put(p, [1, 2], "alice").written == 2 and _put(p, [3], "bob").written == 1
            assert _read(p, [1, 2], "alice") == [True, True]
            assert _put(p, [7], "carol").dropped == 1  # unknown: cannot be created on a read-only keyring
            assert p.stats()["dropped_unknown_tenant"] == 1
            assert _keys_cli("list", "--keyring", str(ro / "keyring.json"), "--json")
            bad = CliRunner().invoke(app, ["keys", "revoke", "--keyring", str(ro / "keyring.json"), "--tenant", "bob"])
            assert bad.exit_code == 2 and "read-only" in " ".join(bad.output.split())
            # the operator revokes bob and adds carol where the keyring is writable
            op.revoke("bob")
            op.create("carol")
            _until(lambda: _read(p, [3], "bob") == [False], RELOAD_S + SLACK_S)
            assert _put(p, [4], "bob").dropped == 1 and p.stats()["dropped_revoked_tenant"] == 1
            _until(lambda: _put(p, [7], "carol").written == 1, RELOAD_S + SLACK_S)
            assert _read(p, [7], "carol") == [True] and _read(p, [1], "alice") == [True]
        # the pool wrote nothing beside the keyring: no lock, no temp, no use counts
        after = _listing(src)
        assert set(after) == set(snap) and "keyring.json.lock" in snap  # the operator's own lock only
        assert not any(n.endswith(".tmp") or KEYRING_TMP_MARK in n for n in after)
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_kubernetes_secret_volume_update_is_seen(tmp_path, monkeypatch):
    """A Secret volume as the kubelet writes it: ``keyring.json -> ..data/keyring.json`` and
    ``..data -> ..<timestamp>``, files 0400; an update writes a new timestamp directory and renames a
    new ``..data`` symlink over the old one. The worker's read-only keyring follows it."""
    op_path = tmp_path / "operator" / "keyring.json"
    op = _operator(op_path)
    op.create("alice")
    op.create("bob")
    vol = tmp_path / "secret-volume"
    vol.mkdir()

    def publish(ts: str) -> None:  # kubelet AtomicWriter, in short
        d = vol / f"..{ts}"
        d.mkdir()
        (d / "keyring.json").write_bytes(op_path.read_bytes())
        os.chmod(d / "keyring.json", 0o400)
        os.symlink(f"..{ts}", vol / "..data_tmp")
        os.replace(vol / "..data_tmp", vol / "..data")

    publish("2025_01_01_00_00_00.1")
    os.symlink("..data/keyring.json", vol / "keyring.json")
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kr = Keyring(vol / "keyring.json", provider_for(op_path, create=False), read_only=True, reload_every_s=0.2)
    bob = kr.write_key("bob")
    assert kr.read_key(bob.key_id, bob.version, tenant="bob") == bob.key
    op.revoke("bob")
    publish("2025_01_01_00_01_00.2")
    _until(lambda: kr.read_key(bob.key_id, bob.version, tenant="bob") is None, 0.2 + SLACK_S)
    with pytest.raises(TenantRevoked):
        kr.write_key("bob")
    assert kr.write_key("alice").version == 1
