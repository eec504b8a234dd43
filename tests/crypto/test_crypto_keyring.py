"""Keyring and AEAD: wrapped per-tenant keys, file-mode refusal, rotation, revoke, rewrap, use counts, CLI."""
from __future__ import annotations

import base64
import json
import os
import stat

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.crypto.aead import AeadError, new_nonce, open_into, seal_into
from kvbm_backend.crypto.keyring import (Keyring, KeyringError, LocalKek, UnknownTenant, generate_kek_b64,
                                         provider_for)

HANG_S = 600.0  # a hang guard, not a bound: waits for processes and a thread that must end; returns as soon as they do


def _kr(path, **kw) -> Keyring:
    return Keyring(path, provider_for(path), **kw)


def test_aead_roundtrip_and_aad_binding():
    key, nonce = os.urandom(32), new_nonce()
    pt = os.urandom(8192)
    ct = bytearray(len(pt))
    tag = seal_into(key, nonce, b"identity-A", pt, ct)
    assert bytes(ct) != pt and len(tag) == 16
    back = bytearray(len(pt))
    open_into(key, nonce, b"identity-A", tag, ct, back)
    assert bytes(back) == pt
    with pytest.raises(AeadError):
        open_into(key, nonce, b"identity-B", tag, ct, back)
    ct[100] ^= 1
    with pytest.raises(AeadError):
        open_into(key, nonce, b"identity-A", tag, ct, back)
    with pytest.raises(ValueError, match="key"):
        seal_into(b"short", nonce, b"", pt, ct)


def test_keyring_created_0600_and_insecure_modes_refused(tmp_path):
    p = tmp_path / "kr.json"
    kr = _kr(p)
    kr.create("alice")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "kr.json.kek").stat().st_mode) == 0o600
    os.chmod(p, 0o644)
    with pytest.raises(KeyringError, match=r"kr\.json: mode 0644 .*chmod 600"):
        _kr(p)
    os.chmod(p, 0o600)
    os.chmod(tmp_path / "kr.json.kek", 0o640)
    with pytest.raises(KeyringError, match="KEK file .*mode 0640"):
        _kr(p)


def test_wrong_kek_and_missing_kek_are_clear(tmp_path, monkeypatch):
    p = tmp_path / "kr.json"
    _kr(p).create("alice")
    monkeypatch.setenv("KVBM_BACKEND_KEK", generate_kek_b64())
    with pytest.raises(KeyringError, match="wrapped under KEK"):
        _kr(p)
    monkeypatch.setenv("KVBM_BACKEND_KEK", "not base64!!")
    with pytest.raises(KeyringError, match=r"\$KVBM_BACKEND_KEK: not valid base64"):
        _kr(p)
    monkeypatch.delenv("KVBM_BACKEND_KEK")
    os.unlink(tmp_path / "kr.json.kek")
    with pytest.raises(KeyringError, match="no KEK"):
        _kr(p)


def test_keys_are_wrapped_not_stored_in_clear(tmp_path, monkeypatch):
    kek = generate_kek_b64()
    monkeypatch.setenv("KVBM_BACKEND_KEK", kek)
    p = tmp_path / "kr.json"
    kr = _kr(p)
    dk = kr.write_key("alice")
    text = p.read_text()
    assert base64.b64encode(dk.key).decode() not in text and dk.key.hex() not in text
    assert "redacted" in repr(dk) and dk.key.hex() not in repr(dk)
    assert not (tmp_path / "kr.json.kek").exists()  # env KEK: no file written


def test_rotation_keeps_old_versions_and_counts_uses(tmp_path):
    p = tmp_path / "kr.json"
    kr = _kr(p)
    k1 = kr.write_key("alice")
    for _ in range(4):
        kr.write_key("alice")
    kr.rotate("alice")
    k2 = kr.write_key("alice")
    assert (k1.key_id, k1.version) == (k2.key_id, 1) or k2.version == 2
    assert k2.version == 2 and k2.key != k1.key
    kr.close()
    kr2 = _kr(p)  # another process would see the same
    assert kr2.read_key(k1.key_id, 1) == k1.key and kr2.read_key(k2.key_id, 2) == k2.key
    row = kr2.info("alice")
    assert [(v["version"], v["uses"], v["current"]) for v in row["versions"]] == [(1, 5, False), (2, 1, True)]


def test_automatic_rotation_before_nonce_limit(tmp_path):
    p = tmp_path / "kr.json"
    kr = _kr(p, rotate_after_uses=3)
    vers = [kr.write_key("t").version for _ in range(7)]
    assert vers == [1, 1, 1, 2, 2, 2, 3]
    with pytest.raises(KeyringError, match="rotate_after_uses"):
        _kr(tmp_path / "other.json", rotate_after_uses=2 ** 32 + 1)


def test_revoke_crypto_shreds_and_records_pseudonym(tmp_path):
    p = tmp_path / "kr.json"
    kr = _kr(p)
    dk = kr.write_key("alice")
    kr.write_key("bob")
    ps = kr.pseudonym("alice").hex()
    kr.revoke("alice")
    kr2 = _kr(p)
    assert kr2.read_key(dk.key_id, dk.version) is None
    assert ps in kr2.revoked()
    assert [r["tenant"] for r in kr2.info()] == ["bob"]
    assert "wrapped" not in json.dumps(kr2.info())
    # a running process sees the revocation on its next reload
    kr.reload_every_s = 0
    assert kr.read_key(dk.key_id, dk.version) is None


def test_rewrap_under_new_kek_keeps_data_keys(tmp_path):
    p = tmp_path / "kr.json"
    kr = _kr(p)
    dk = kr.write_key("alice")
    ps = kr.pseudonym("alice")
    new = LocalKek.generate_file(tmp_path / "new.kek")
    assert kr.rewrap(new) == 1
    with pytest.raises(KeyringError, match="wrapped under KEK"):
        _kr(p)  # the old KEK file no longer opens it
    kr3 = Keyring(p, LocalKek.from_file(tmp_path / "new.kek"))
    assert kr3.read_key(dk.key_id, dk.version) == dk.key and kr3.pseudonym("alice") == ps


def test_pseudonym_is_keyed_and_stable(tmp_path):
    a, b = _kr(tmp_path / "a.json"), _kr(tmp_path / "b.json")
    assert a.pseudonym("alice") == _kr(tmp_path / "a.json").pseudonym("alice")
    assert a.pseudonym("alice") != b.pseudonym("alice") and len(a.pseudonym("alice")) == 16
    assert b"alice" not in a.pseudonym("alice")


def test_keys_cli_never_prints_key_material(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    p = str(tmp_path / "kr.json")
    r = CliRunner()
    out = []
    for args in (["create", "--tenant", "alice"], ["create", "--tenant", "bob"], ["rotate", "--tenant", "alice"],
                 ["list", "--json"], ["revoke", "--tenant", "bob", "--json"], ["list"]):
        res = r.invoke(app, ["keys", *args, "--keyring", p])
        assert res.exit_code == 0, res.output
        out.append(res.output)
    rows = json.loads(out[3])
    assert {x["tenant"]: x["current_version"] for x in rows} == {"alice": 2, "bob": 1}
    kr = _kr(p)
    secrets_ = [kr.read_key(rows[0]["key_id"], v) for v in (1, 2)]
    doc = json.loads((tmp_path / "kr.json").read_text())
    wrapped = [v["wrapped"] for t in doc["tenants"].values() for v in t["versions"].values()]
    kek = (tmp_path / "kr.json.kek").read_text().strip()
    text = "".join(out)
    for s in secrets_:
        assert base64.b64encode(s).decode() not in text and s.hex() not in text
    for w in wrapped + [kek, doc["pseudonym_key"]]:
        assert w not in text
    assert "bob" not in out[5]
    bad = r.invoke(app, ["keys", "revoke", "--keyring", p, "--tenant", "nobody"])
    assert bad.exit_code == 2 and "no tenant 'nobody'" in " ".join(bad.output.split())
    os.chmod(p, 0o644)
    bad = r.invoke(app, ["keys", "list", "--keyring", p])
    assert bad.exit_code == 2 and "chmod 600" in " ".join(bad.output.split())


_CREATE_RACER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
from kvbm_backend.crypto.keyring import Keyring, provider_for
path, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:
    time.sleep(0.0005)
kr = Keyring(path, provider_for(path))
print(json.dumps({"pseudonym": kr.pseudonym("alice").hex(), "kek": kr.provider.key_id}))
"""


def test_workers_starting_together_create_one_keyring(tmp_path, monkeypatch):
    # CI caught this: 8 workers started at once on a fresh keyring path each tried to create the KEK
    # file and 7 crashed with "already exists". All must start and agree on one KEK and keyring.
    import subprocess
    import sys
    import time
    from pathlib import Path
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    path = tmp_path / "kr.json"
    start = time.time() + 2.0
    root = str(Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, "-c", _CREATE_RACER, str(path), str(start), root],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, e
        outs.append(json.loads(o))
    assert len({o["pseudonym"] for o in outs}) == 1 and len({o["kek"] for o in outs}) == 1
    assert _kr(path).pseudonym("alice").hex() == outs[0]["pseudonym"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["kr.json", "kr.json.kek", "kr.json.lock"]  # no temp left


def test_keyring_config_read_only_auto_create_and_reload_interval(tmp_path, monkeypatch):
    from kvbm_backend.config import KeyringConfig
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    p = tmp_path / "kr.json"
    with pytest.raises(KeyringError, match="no KEK|not found"):
        Keyring.from_config(KeyringConfig(path=str(p), read_only=True))
    assert list(tmp_path.iterdir()) == []  # a read-only keyring generates nothing: no KEK, keyring or lock
    _kr(p).create("alice")
    kr = Keyring.from_config(KeyringConfig(path=str(p), auto_create_tenants=False, reload_interval_s=7))
    assert not kr.read_only and kr.reload_every_s == 7
    with pytest.raises(UnknownTenant, match="auto_create_tenants is off"):
        kr.write_key("bob")
    assert kr.write_key("alice").version == 1
    assert list(json.loads(p.read_text())["tenants"]) == ["alice"]
    ro = Keyring.from_config(KeyringConfig(path=str(p), read_only=True))
    assert ro.read_only and ro.tenant_state("alice") == "active" and ro.tenant_state("bob") == "unknown"
    rot = Keyring.from_config(KeyringConfig(path=str(tmp_path / "rot.json"), rotate_after_uses=2))
    assert [rot.write_key("t").version for _ in range(5)] == [1, 1, 2, 2, 3]


def test_kek_env_and_kek_file_choose_the_key_encryption_key(tmp_path, monkeypatch):
    """``g4.keyring.kek_env`` names the variable the KEK comes from; ``g4.keyring.kek_file`` is used when
    that variable is unset (default ``PATH.kek``). A keyring opened with another KEK is refused."""
    from kvbm_backend.config import KeyringConfig
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    monkeypatch.setenv("TEAM_A_KEK", generate_kek_b64())
    a = tmp_path / "a" / "kr.json"
    kr = Keyring.from_config(KeyringConfig(path=str(a), kek_env="TEAM_A_KEK"))
    alice = kr.write_key("alice")
    assert sorted(p.name for p in a.parent.iterdir() if not p.name.endswith(".lock")) == ["kr.json"]  # no .kek
    again = Keyring.from_config(KeyringConfig(path=str(a), kek_env="TEAM_A_KEK"))
    assert again.write_key("alice").key == alice.key
    with pytest.raises(KeyringError, match=r"no KEK \(set \$KVBM_BACKEND_KEK"):  # the default env is unset
        Keyring.from_config(KeyringConfig(path=str(a)))

    b = tmp_path / "b" / "kr.json"
    kf = tmp_path / "secrets" / "team-b.kek"
    kr = Keyring.from_config(KeyringConfig(path=str(b), kek_file=str(kf)))
    bob = kr.write_key("bob")
    assert kf.is_file() and stat.S_IMODE(kf.stat().st_mode) == 0o600 and not (b.parent / "kr.json.kek").exists()
    assert Keyring.from_config(KeyringConfig(path=str(b), kek_file=str(kf))).write_key("bob").key == bob.key
    with pytest.raises(KeyringError, match="kr.json.kek"):  # the default PATH.kek does not exist
        Keyring.from_config(KeyringConfig(path=str(b)))
    with pytest.raises(KeyringError):  # the env KEK wins over kek_file, and it did not wrap this keyring
        Keyring.from_config(KeyringConfig(path=str(b), kek_env="TEAM_A_KEK", kek_file=str(kf)))


def test_keyring_file_matches_format_md(tmp_path):
    """docs/format.md's keyring members and version rules, checked on a file the code wrote: KEK id,
    wrapped sizes, pseudonyms, key ids, versions; an unknown member survives a write; an unknown format
    or a changed wrapped byte refuses the whole file."""
    import hashlib
    import hmac
    from datetime import datetime, timezone

    from cryptography.hazmat.primitives.keywrap import aes_key_unwrap
    kek = os.urandom(32)
    p = tmp_path / "kr.json"
    kr = Keyring(p, LocalKek(kek))
    kr.create("alice")
    kr.rotate("alice")
    doc = json.loads(p.read_text(encoding="utf-8"))
    assert doc["format"] == "kvbm-backend-keyring/1"
    assert doc["kek_id"] == hmac.new(kek, b"kvbm-backend kek id", hashlib.sha256).digest()[:8].hex()
    w = base64.b64decode(doc["pseudonym_key"], validate=True)
    assert len(doc["pseudonym_key"]) == 56 and len(w) == 40
    pk = aes_key_unwrap(kek, w)
    t = doc["tenants"]["alice"]
    assert t["pseudonym"] == hmac.new(pk, b"alice", hashlib.sha256).digest()[:16].hex()
    assert isinstance(t["key_id"], int) and 0 <= t["key_id"] < 2 ** 32 and t["current"] == 2
    assert sorted(t["versions"]) == ["1", "2"]
    for v in t["versions"].values():
        assert len(v["wrapped"]) == 56 and len(aes_key_unwrap(kek, base64.b64decode(v["wrapped"]))) == 32
        c = datetime.fromisoformat(v["created"])
        assert c.tzinfo == timezone.utc and c.microsecond == 0 and isinstance(v["uses"], int)
    kr.close()
    doc["x-future"] = {"kept": True}
    p.write_text(json.dumps(doc))
    kr = Keyring(p, LocalKek(kek))
    kr.create("bob")
    kr.close()
    assert json.loads(p.read_text())["x-future"] == {"kept": True}
    good = p.read_text()
    for bad in (good.replace("kvbm-backend-keyring/1", "kvbm-backend-keyring/2"),
                good.replace(t["versions"]["1"]["wrapped"],
                             base64.b64encode(bytes([base64.b64decode(t["versions"]["1"]["wrapped"])[0] ^ 1])
                                              + base64.b64decode(t["versions"]["1"]["wrapped"])[1:]).decode())):
        p.write_text(bad)
        with pytest.raises(KeyringError):
            Keyring(p, LocalKek(kek))


def test_persisting_use_counts_holds_up_no_encryption(tmp_path):
    """The periodic persist of use counts runs on its own thread. Here another holder keeps the keyring's
    file lock (as a worker sharing the keyring does during its own persist and fsyncs): encryptions
    still get their keys, and no use is lost once the lock is free. Before, the encryption that found
    the period over persisted inline under the keyring's mutex and blocked every other encryption of
    the process until it got the lock (a CI run measured 3.15 s of every G4 writer waiting)."""
    import fcntl
    import threading

    p = tmp_path / "k.json"
    kr = _kr(p, persist_every_s=0.0)
    kr.write_key("t")
    kr.flush()  # that use is on disk (a background persist of it may have run too: nothing counted twice)
    on_disk = json.loads(p.read_text())["tenants"]["t"]["versions"]["1"]["uses"]
    assert on_disk == 1
    fd = os.open(f"{p}.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        got: list = []
        th = threading.Thread(target=lambda: got.extend(kr.write_key("t") for _ in range(200)), daemon=True)
        th.start()
        th.join(HANG_S)  # inline persists would wait for the lock for as long as it is held
        assert not th.is_alive() and len(got) == 200
        assert json.loads(p.read_text())["tenants"]["t"]["versions"]["1"]["uses"] == on_disk  # not persisted yet
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    kr.close()  # the background persist and close's own flush both merge; nothing counted twice
    assert _kr(p).info("t")["versions"][0]["uses"] == 201


def test_a_deleted_keyring_file_is_never_written_back(tmp_path):
    """Review finding (2026-11-29): an operator deleting the keyring file (a crypto-shred of every tenant,
    the KEK kept) saw a running worker's flush or close write it back from memory, data keys and all. Now
    the missing file is an error: nothing is written, and no key is served once the deletion is seen."""
    import secrets
    path, kek = tmp_path / "keyring.json", LocalKek(secrets.token_bytes(32))
    Keyring(path, kek).create("acme")
    worker = Keyring(path, kek, persist_every_s=3600, reload_every_s=0.0)
    dk = worker.write_key("acme")  # one use pending
    os.remove(path)
    with pytest.raises(KeyringError, match="not found"):
        worker.close()
    assert not path.exists()
    assert worker.read_key(dk.key_id, dk.version, tenant="acme") is None  # fails closed
    with pytest.raises(KeyringError, match="not found"):
        Keyring(path, kek, create=False)


def test_use_counts_survive_a_refused_keyring_change(tmp_path):
    """Review finding (2026-11-29): a keyring change that failed (here a client's tenant id with a surrogate
    pair, which the file cannot keep) dropped every tenant's pending use counts, so keys were used past
    ``rotate_after_uses``. The counts stay pending and reach the file."""
    import secrets
    path, kek = tmp_path / "keyring.json", LocalKek(secrets.token_bytes(32))
    kr = Keyring(path, kek, persist_every_s=3600, rotate_after_uses=1000)
    for _ in range(900):
        kr.write_key("acme")
    with pytest.raises(UnknownTenant):
        kr.write_key("\ud83d\ude00")
    kr.close()
    assert Keyring(path, kek, create=False).info("acme")["versions"][0]["uses"] == 900


def test_revocation_records_its_key_ids_and_a_re_creation_never_reuses_one(tmp_path, monkeypatch):
    """``revoke`` records the tenant's key id under its pseudonym (``key_ids``, docs/format.md), kept across a
    second revocation of the re-created tenant; a re-creation never takes a recorded key id (offered it first,
    ``add_tenant`` draws again): a frame's key id never names both a revoked and a current key, which is what
    gc and the G4 reader delete late writes under a revoked key by (tests/pool/g4/test_g4_revoked_late_writes.py)."""
    from kvbm_backend.crypto import keyring_file
    p = tmp_path / "kr.json"
    kr = Keyring(p, LocalKek(os.urandom(32)))
    first = kr.create("alice")["key_id"]
    ps = kr.revoke("alice")["pseudonym"]
    assert json.loads(p.read_text())["revoked"][ps]["key_ids"] == [first]
    assert kr.revoked_key_ids(ps) == {first} and kr.revoked_key_ids("0" * 32) == frozenset()
    offers = iter([first, first ^ 1])
    monkeypatch.setattr(keyring_file.secrets, "randbits", lambda bits: next(offers))
    second = kr.create("alice")["key_id"]
    assert second == first ^ 1
    kr.revoke("alice")
    assert json.loads(p.read_text())["revoked"][ps]["key_ids"] == sorted({first, second})
    assert kr.revoked_key_ids(ps) == {first, second}
