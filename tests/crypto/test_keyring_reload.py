"""On-miss keyring reload: a key a reader's keyring does not hold (a tenant another worker just
created on its first write, a version another worker just rotated to) makes the keyring check its
file at once instead of after ``reload_interval_s``, rate-limited per keyring; revocation and fail-
closed semantics unchanged.

The pools here use ``reload_interval_s: 300`` (the most the config allows) so that the periodic reload cannot be what serves a key:
only the on-miss path can. No test waits for a reload by sleeping; the rate limit is checked with the
keyring's own counters (``Keyring.stats()``, ``keyring_*`` in G4 pool stats) and a fake clock.
"""
from __future__ import annotations

import json
import secrets
import time
import types

import pytest

import kvbm_backend.crypto.keyring as keyring_mod
from tests.helpers.g4_writer import namespace, payload, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.aead import new_nonce, seal_into
from kvbm_backend.crypto.keyring import Keyring, KeyringError, TenantRevoked, UnknownTenant, provider_for
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.model.frame import FLAG_ENCRYPTED, HEADER_BYTES, FrameHeader

NEVER_S = 3600.0  # periodic reload interval: never due within a test
POOL_RELOAD_S = 300.0  # the same for pools (g4.keyring.reload_interval_s allows at most 300)


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    return {"url": f"file://{tmp_path / 'store'}", "timeout_s": G4_TIMEOUT_S, "dir_fanout": 16,
            "keyring": {"path": str(tmp_path / "keys" / "keyring.json"), "reload_interval_s": POOL_RELOAD_S}}


def _pool(cfg) -> G4Pool:
    return G4Pool(G4Config(**cfg), namespace())


_put, _read = put_blocks, read_checked


class _Clock:
    """A monotonic clock the test moves by hand (installed as the keyring module's ``time``)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(keyring_mod, "time", types.SimpleNamespace(monotonic=c.monotonic, time=time.time))
    return c


# ---- the reproducer: two workers, one store, one keyring --------------------------------------
def test_new_tenant_written_by_one_pool_is_a_hit_at_once_in_another(cfg):
    with _pool(cfg) as reader, _pool(cfg) as writer:
        assert reader.keyring is not writer.keyring  # two workers: two views of one file
        assert reader.keyring.tenant_state("new-tenant") == "unknown"  # the reader touched its keyring first
        assert _put(writer, [1, 2], "new-tenant").written == 2  # implicit creation by the writer
        assert writer.keyring.tenant_state("new-tenant") == "active"
        assert _read(reader, [1, 2], "new-tenant") == [True, True]  # no sleep: right after the put
        st = reader.stats()
        assert st["hits"] == 2 and st.get("miss_no_key", 0) == 0
        assert st["keyring_miss_reloads"] == 1 and st["keyring_miss_reload_loads"] == 1
        assert reader.keyring.tenant_state("new-tenant") == "active"
        # the key is now held: further reads need no check of the file
        assert _read(reader, [1, 2], "new-tenant") == [True, True]
        assert reader.stats()["keyring_miss_reloads"] == 1


def test_version_rotated_by_another_pool_is_a_hit_at_once(cfg):
    with _pool(cfg) as reader, _pool(cfg) as writer:
        assert _put(writer, [1], "alice").written == 1
        assert _read(reader, [1], "alice") == [True]  # reader holds alice version 1
        reader.keyring.miss_reload_min_s = 0  # this test is about the trigger, not the rate limit
        kid = reader.keyring.info("alice")["key_id"]
        assert writer.keyring.rotate("alice")["current_version"] == 2
        assert _put(writer, [2], "alice").written == 1  # sealed under version 2
        before = reader.stats()["keyring_miss_reload_loads"]
        assert _read(reader, [2, 1], "alice") == [True, True]  # the new version and the old one
        st = reader.stats()
        assert st.get("miss_no_key", 0) == 0 and st["keyring_miss_reload_loads"] == before + 1
        assert reader.keyring.info("alice")["current_version"] == 2
        assert reader.keyring.read_key(kid, 2, tenant="alice") is not None


# ---- the rate limit ------------------------------------------------------------------------------
def _forge_unknown_key_blocks(pool, seqs, tenant) -> int:
    """Blocks for ``tenant`` sealed under a data key no keyring holds (a key id nobody owns): to any
    reader they are ``miss_no_key``. Returns the key id used."""
    ns = namespace()
    kid, dkey = secrets.randbits(32) | 1, secrets.token_bytes(32)
    assert pool.keyring.key_owner(kid) is None
    for s in seqs:
        key = ns.key(s, tenant=tenant)
        hdr = FrameHeader.for_block(key, ns.layout, ns.tp_world_size, pool.pseudonym(tenant))
        hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, kid, 1, new_nonce()
        buf = bytearray(HEADER_BYTES + ns.layout.bytes_per_block)
        hdr.integrity = seal_into(dkey, hdr.nonce, hdr.identity_bytes(), payload(s, tenant, ns.layout.bytes_per_block),
                                  memoryview(buf)[HEADER_BYTES:])
        buf[:HEADER_BYTES] = hdr.pack()
        assert pool.store.put_if_absent(pool.object_name(key), bytes(buf))
    return kid


def test_flood_of_blocks_under_absent_keys_bounds_file_checks(cfg):
    with _pool(cfg) as reader:
        reader.keyring.miss_reload_min_s = NEVER_S  # the whole flood falls in one rate-limit window
        seqs = list(range(100, 164))
        _forge_unknown_key_blocks(reader, seqs, "ghost")
        loads0 = reader.keyring.stats()["loads"]
        for _ in range(4):
            assert _read(reader, seqs, "ghost") == [False] * len(seqs)
        st = reader.stats()
        assert st["miss_no_key"] == 4 * len(seqs) and st["hits"] == 0  # still misses, never wrong KV
        assert st["keyring_miss_reloads"] == 1  # one check of the file for 256 misses
        assert st["keyring_miss_reloads_limited"] == 4 * len(seqs) - 1
        assert st["keyring_loads"] == loads0  # the file did not change: not even re-read
        assert reader.store.head(reader.object_name(namespace().key(100, tenant="ghost"))) is not None  # left for gc


def test_rate_limit_per_interval_with_a_changing_file(tmp_path, clock):
    p = tmp_path / "kr.json"
    op = Keyring(p, provider_for(p))
    kr = Keyring(p, provider_for(p), reload_every_s=NEVER_S, miss_reload_min_s=0.1)
    assert kr.stats() == {"loads": 1, "miss_reloads": 0, "miss_reload_loads": 0, "miss_reloads_limited": 0}
    ghost = secrets.randbits(32) | 1
    for i in range(10):  # the file changes before every miss: only the rate limit bounds the re-reads
        op.create(f"t{i}")
        assert kr.read_key(ghost, 1) is None
    assert kr.stats() == {"loads": 2, "miss_reloads": 1, "miss_reload_loads": 1, "miss_reloads_limited": 9}
    clock.t += 0.05
    assert kr.read_key(ghost, 1) is None and kr.stats()["miss_reloads"] == 1
    clock.t += 0.06  # 0.11 s after the first check
    assert kr.read_key(ghost, 1) is None
    assert kr.stats() == {"loads": 3, "miss_reloads": 2, "miss_reload_loads": 2, "miss_reloads_limited": 10}
    assert [r["tenant"] for r in kr.info()] == [f"t{i}" for i in range(10)]
    # within a window, a tenant created elsewhere waits for the next window (bounded: 0.1 s), no longer
    dk = op.write_key("late")
    assert kr.read_key(dk.key_id, dk.version, tenant="late") is None
    clock.t += 0.15
    assert kr.read_key(dk.key_id, dk.version, tenant="late") == dk.key
    with pytest.raises(KeyringError, match="miss_reload_min_s"):
        Keyring(p, provider_for(p), miss_reload_min_s=-1)


# ---- revocation and fail-closed are unchanged ----------------------------------------------------
def test_revoked_tenant_stays_refused_through_on_miss_reloads(tmp_path, clock):
    p = tmp_path / "kr.json"
    op = Keyring(p, provider_for(p))
    kr = Keyring(p, provider_for(p), reload_every_s=NEVER_S)
    a = op.write_key("alice")
    assert kr.read_key(a.key_id, a.version, tenant="alice") == a.key  # on-miss load: alice created
    op.revoke("alice")
    # the reader's view predates the revocation until a check: a miss on any key brings it in
    clock.t += 1.0
    assert kr.read_key(secrets.randbits(32) | 1, 1) is None
    assert kr.tenant_state("alice") == "revoked"
    for _ in range(3):
        clock.t += 1.0
        assert kr.read_key(a.key_id, a.version, tenant="alice") is None
        assert kr.read_key(a.key_id, a.version + 1, tenant="alice") is None
        with pytest.raises(TenantRevoked):
            kr.write_key("alice")
    assert "alice" not in {r["tenant"] for r in kr.info()}
    op.create("alice")  # explicit re-creation: a new key id; the old one stays unreadable
    clock.t += 1.0
    b = op.write_key("alice")
    assert b.key_id != a.key_id and kr.read_key(b.key_id, b.version, tenant="alice") == b.key
    clock.t += 1.0
    assert kr.read_key(a.key_id, a.version, tenant="alice") is None


def test_revocation_by_another_worker_then_pool_reads(cfg):
    with _pool(cfg) as reader, _pool(cfg) as writer:
        assert _put(writer, [1], "alice").written == 1
        writer.keyring.revoke("alice")
        # the reader never held alice's key: its on-miss check loads a file where alice is revoked
        assert _read(reader, [1], "alice") == [False]
        st = reader.stats()
        assert reader.keyring.tenant_state("alice") == "revoked" and st["hits"] == 0
        assert st["miss_revoked_tenant"] == 1 and st.get("miss_no_key", 0) == 0  # counted by its cause
        assert _read(reader, [1], "alice") == [False] and reader.stats()["miss_revoked_tenant"] == 2


def test_file_that_stops_loading_still_fails_closed_on_miss(tmp_path, clock):
    p = tmp_path / "kr.json"
    op = Keyring(p, provider_for(p))
    a = op.write_key("alice")
    kr = Keyring(p, provider_for(p), reload_every_s=NEVER_S)
    good = p.read_bytes()
    tmp = p.with_name("broken.tmp")
    tmp.write_text("{not json")
    tmp.chmod(0o600)
    tmp.replace(p)
    assert kr.read_key(secrets.randbits(32) | 1, 1) is None  # on-miss check finds the broken file
    assert kr.error is not None and "not valid JSON" in kr.error
    assert kr.read_key(a.key_id, a.version, tenant="alice") is None  # fail closed: nothing served
    assert kr.tenant_state("alice") == "unavailable"
    tmp.write_bytes(good)
    tmp.chmod(0o600)
    tmp.replace(p)
    clock.t += NEVER_S  # recovery is the periodic check's, as before
    assert kr.read_key(a.key_id, a.version, tenant="alice") == a.key and kr.error is None


# ---- the offload side of a read-only keyring ------------------------------------------------------
def test_read_only_keyring_write_key_sees_operator_created_tenant_at_once(tmp_path, clock):
    p = tmp_path / "kr.json"
    op = Keyring(p, provider_for(p))
    op.create("alice")
    kr = Keyring(p, provider_for(p, create=False), read_only=True, reload_every_s=NEVER_S)
    op.create("carol")
    assert kr.write_key("carol").key_id == op.info("carol")["key_id"]  # no UnknownTenant for a known one
    clock.t += 1.0
    for _ in range(5):
        with pytest.raises(UnknownTenant):
            kr.write_key("mallory")  # truly unknown: refused, and the checks stay rate-limited
    assert kr.stats()["miss_reloads"] == 2 and kr.stats()["miss_reloads_limited"] == 4
    op.create("dan")
    op.revoke("dan")  # created and revoked since the last check: refused as revoked, never created
    clock.t += 1.0
    with pytest.raises(TenantRevoked):
        kr.write_key("dan")
    assert kr.tenant_state("dan") == "revoked" and kr.stats()["miss_reloads"] == 3


def test_keys_rewrap_while_a_worker_runs_fails_it_closed_and_the_report_says_so(cfg, tmp_path):
    """``keys rewrap`` (a new KEK) under a running worker: the keyring names one KEK and the worker read its
    KEK once, at start, so at its next reload it fails closed (misses ``keyring_unavailable``, offloads
    dropped), never serves a key, never crashes; restarted with the new KEK, it serves the old blocks again.
    The CLI report says so (``note``; before 2026-11-30 nothing did, docs/configuration.md "KEK rotation")."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    with _pool(cfg) as w:
        assert _put(w, [1], "alice").written == 1
        new_kek = tmp_path / "keys" / "new.kek"
        r = CliRunner().invoke(app, ["keys", "rewrap", "--keyring", cfg["keyring"]["path"],
                                     "--new-kek-file", str(new_kek), "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.output)
        assert rep["rewrapped_keys"] == 1 and "restarted with the new KEK" in rep.get("note", ""), rep
        w.keyring.reload_every_s = 0  # the worker's next periodic check is due
        assert _read(w, [1], "alice") == [False]
        assert "wrapped under KEK" in (w.keyring.error or "") and w.stats()["miss_keyring_unavailable"] == 1
        assert _put(w, [2], "alice").written == 0
    restarted = dict(cfg, keyring=dict(cfg["keyring"], kek_file=str(new_kek)))
    with _pool(restarted) as w2:
        assert _read(w2, [1], "alice") == [True]


def test_keys_revoke_shreds_g4_only_and_the_report_says_g3_copies_stay(cfg, tmp_path):
    """``keys revoke`` through the CLI: the worker's G4 misses the tenant's block from its next reload on, but
    its G3 (local plaintext, no keyring) still serves the copy it holds; the report's ``note`` says so
    (before 2026-11-30 nothing did: docs/configuration.md "Revocation and G3"; a G3 pool alone knows no keyring:
    the vLLM connector's wiring deletes such copies, tests/integrations/vllm/test_revoked_tenants.py)."""
    from typer.testing import CliRunner

    from kvbm_backend.apps.cli import app
    from tests.helpers.pools import open_g3
    with _pool(cfg) as g4, open_g3(tmp_path / "g3", namespace()) as g3:
        assert _put(g4, [1], "alice").written == 1 and _put(g3, [1], "alice").written == 1
        r = CliRunner().invoke(app, ["keys", "revoke", "--keyring", cfg["keyring"]["path"], "--tenant", "alice",
                                     "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.output)
        assert rep["revoked"] is True and "not shredded" in rep.get("note", "") and "g3.paths" in rep["note"], rep
        g4.keyring.reload_every_s = 0
        assert _read(g4, [1], "alice") == [False] and g4.stats()["miss_revoked_tenant"] == 1
        assert _read(g3, [1], "alice") == [True]  # what the note and the docs say: G3 is not reached
