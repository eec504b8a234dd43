"""A hand-edited keyring file with a member missing or mistyped (docs/format.md, "G4 keyring") is refused as a
whole with a KeyringError naming the file and the member. Before (2026-12) a file without ``tenants`` or a
tenant's ``current`` (and others below) loaded; the first use raised a bare KeyError/TypeError/ValueError: a
traceback from ``kvbm-backend keys``, an exception out of a running worker's G4 offload after its reload.

A worker whose file turns malformed fails closed as for any file that stops loading (docs/format.md: no key
served, not even one of the copy loaded before), logs the error once, keeps running, and serves again once the
file is fixed. Real files, real KEK, real G4 pools on a ``file://`` store.
"""
from __future__ import annotations

import base64
import copy
import json
import logging
import types
import time

import pytest
from typer.testing import CliRunner

import kvbm_backend.crypto.keyring as keyring_mod
from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, KeyringError, provider_for
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S

TENANT = "tenant-q7"  # an id no message may show (tenant ids stay inside the keyring)
NEVER_S = 3600.0


def _doc(tmp_path):
    """A keyring at ``tmp_path/keys/kr.json`` holding TENANT (two versions) and a revoked tenant; its path
    and document."""
    p = tmp_path / "keys" / "kr.json"
    kr = Keyring(p, provider_for(p))
    kr.create(TENANT)
    kr.rotate(TENANT)
    kr.create("gone")
    kr.revoke("gone")
    kr.close()
    return p, json.loads(p.read_text())


def _t(d):
    return d["tenants"][TENANT]


def _set(obj, name, value):
    obj[name] = value


def _dup_key_id(d):
    d["tenants"]["other"] = dict(copy.deepcopy(_t(d)), pseudonym="0" * 32)


def _flip_wrapped(d):
    raw = bytearray(base64.b64decode(_t(d)["versions"]["1"]["wrapped"]))
    raw[3] ^= 1
    _t(d)["versions"]["1"]["wrapped"] = base64.b64encode(bytes(raw)).decode()


# (case id, edit of the document, the member the message must name)
CASES = [
    ("no_tenants", lambda d: d.pop("tenants"), "tenants: missing"),
    ("tenants_a_list", lambda d: _set(d, "tenants", []), "tenants: an array"),
    ("tenant_entry_a_list", lambda d: _set(d["tenants"], TENANT, []), "tenants[#1 in file order]: an array"),
    ("no_current", lambda d: _t(d).pop("current"), ".current: missing"),
    ("current_a_string", lambda d: _set(_t(d), "current", "2"), ".current: a string"),
    ("current_true", lambda d: _set(_t(d), "current", True), ".current: a boolean"),
    ("current_names_no_version", lambda d: _set(_t(d), "current", 3), ".current: 3 names no version"),
    ("no_key_id", lambda d: _t(d).pop("key_id"), ".key_id: missing"),
    ("key_id_past_u32", lambda d: _set(_t(d), "key_id", 2 ** 32), f".key_id: {2 ** 32}"),
    ("key_id_twice", _dup_key_id, ".key_id: "),
    ("no_pseudonym", lambda d: _t(d).pop("pseudonym"), "tenants[#1 in file order].pseudonym: missing"),
    ("pseudonym_not_hex", lambda d: _set(_t(d), "pseudonym", "alice"), ".pseudonym: a string"),
    ("no_versions", lambda d: _t(d).pop("versions"), ".versions: missing"),
    ("versions_empty", lambda d: _set(_t(d), "versions", {}), ".versions: an object"),
    ("version_named_01", lambda d: _set(_t(d)["versions"], "01", _t(d)["versions"]["1"]), ".versions.01: a version"),
    ("version_a_list", lambda d: _set(_t(d)["versions"], "1", []), ".versions.1: an array"),
    ("no_wrapped", lambda d: _t(d)["versions"]["1"].pop("wrapped"), ".versions.1.wrapped: missing"),
    ("wrapped_not_base64", lambda d: _set(_t(d)["versions"]["2"], "wrapped", "@@@@"), ".versions.2.wrapped: not base64"),
    ("wrapped_changed", _flip_wrapped, ".versions.1.wrapped: KEK from"),
    ("no_created", lambda d: _t(d)["versions"]["1"].pop("created"), ".versions.1.created: missing"),
    ("uses_a_string", lambda d: _set(_t(d)["versions"]["1"], "uses", "7"), ".versions.1.uses: a string"),
    ("uses_negative", lambda d: _set(_t(d)["versions"]["1"], "uses", -1), ".versions.1.uses: -1"),
    ("no_pseudonym_key", lambda d: d.pop("pseudonym_key"), "pseudonym_key: missing"),
    ("no_kek_id", lambda d: d.pop("kek_id"), "kek_id: missing"),
    ("revoked_a_list", lambda d: _set(d, "revoked", []), "revoked: an array"),
    ("revoked_no_time", lambda d: next(iter(d["revoked"].values())).pop("revoked_at"), ".revoked_at: missing"),
    ("revoked_key_ids_a_string", lambda d: _set(next(iter(d["revoked"].values())), "key_ids", "1,2"),
     ".key_ids: a string"),
    ("revoked_by_tenant_id", lambda d: _set(d["revoked"], "alice", {"revoked_at": 1.0}), "revoked[#2 in file order]"),
]
IDS = [c[0] for c in CASES]


def _write(p, doc) -> None:
    """Replace the keyring file as an operator's editor would (a new file, mode 0600, renamed over it)."""
    tmp = p.with_name("edited.tmp")
    tmp.write_text(json.dumps(doc))
    tmp.chmod(0o600)
    tmp.replace(p)


@pytest.mark.parametrize("edit,names", [c[1:] for c in CASES], ids=IDS)
def test_a_malformed_keyring_file_is_refused_naming_the_file_and_the_member(tmp_path, monkeypatch, edit, names):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    p, doc = _doc(tmp_path)
    wrapped = [v["wrapped"] for t in doc["tenants"].values() for v in t["versions"].values()]
    edit(doc)
    _write(p, doc)
    with pytest.raises(KeyringError) as ei:
        Keyring(p, provider_for(p), reload_every_s=NEVER_S)
    msg = str(ei.value)
    assert str(p) in msg and names in msg, msg
    assert TENANT not in msg and not any(w in msg for w in wrapped), msg  # no tenant id, no key material


def test_unknown_members_and_records_without_key_ids_still_load(tmp_path, monkeypatch):
    """What the format allows is not refused: members a reader does not know, ``uses`` absent, ``revoked``
    absent, revocation records written before 2026-11-30 (no ``key_ids``)."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    p, doc = _doc(tmp_path)
    doc["x-future"] = [1, 2]
    _t(doc)["x-note"] = "hand-written"
    _t(doc)["versions"]["1"].pop("uses")
    next(iter(doc["revoked"].values())).pop("key_ids")
    _write(p, doc)
    kr = Keyring(p, provider_for(p), reload_every_s=NEVER_S)
    assert kr.info(TENANT)["current_version"] == 2 and kr.write_key(TENANT).version == 2
    doc.pop("revoked")
    _write(p, doc)
    assert Keyring(p, provider_for(p)).revoked() == {}


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


@pytest.mark.parametrize("edit,names", [c[1:] for c in CASES if c[0] in ("no_tenants", "no_current", "no_wrapped")],
                         ids=["no_tenants", "no_current", "no_wrapped"])
def test_a_worker_whose_keyring_turns_malformed_fails_closed_logs_and_recovers(tmp_path, monkeypatch, caplog, edit,
                                                                               names):
    """The on-miss reload (a key this keyring does not hold) and the periodic one find the edited file: no
    exception from read_key, tenant_state or write_key other than KeyringError; no key served; one ERROR line
    naming the file and the member; the file fixed, the keys are served again."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    clock = _Clock()
    monkeypatch.setattr(keyring_mod, "time", types.SimpleNamespace(monotonic=clock.monotonic, time=time.time))
    p, doc = _doc(tmp_path)
    good = p.read_bytes()
    kr = Keyring(p, provider_for(p), reload_every_s=NEVER_S)
    dk = kr.write_key(TENANT)
    edit(doc)
    _write(p, doc)
    with caplog.at_level(logging.ERROR, logger=keyring_mod.__name__):
        assert kr.read_key(dk.key_id + 1, 1) is None  # a key it does not hold: the on-miss check reads the file
        assert kr.error is not None and str(p) in kr.error and names in kr.error, kr.error
        assert kr.read_key(dk.key_id, dk.version, tenant=TENANT) is None  # fail closed
        assert kr.tenant_state(TENANT) == "unavailable"
        with pytest.raises(KeyringError, match="tenants|current|wrapped"):
            kr.write_key(TENANT)
        clock.t += NEVER_S  # the periodic check: same file, same error, logged once
        assert kr.read_key(dk.key_id, dk.version, tenant=TENANT) is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(p) in errors[0] and names in errors[0] and TENANT not in errors[0], errors
    assert kr.info(TENANT)["current_version"] == 2  # the last good copy is what it holds (not served meanwhile)
    _write(p, json.loads(good))
    clock.t += NEVER_S
    assert kr.read_key(dk.key_id, dk.version, tenant=TENANT) == dk.key and kr.error is None
    assert kr.write_key(TENANT).key == dk.key


def test_a_g4_worker_whose_keyring_loses_a_tenants_current_drops_offloads_and_misses(tmp_path, monkeypatch):
    """A running G4 pool: after the edit its reload fails closed; its offloads are dropped (``dropped_keyring``)
    and its loads miss (``miss_keyring_unavailable``), none raises; the file fixed, it serves its block again."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kp = tmp_path / "keys" / "kr.json"
    cfg = {"url": f"file://{tmp_path / 'store'}", "timeout_s": G4_TIMEOUT_S, "dir_fanout": 16,
           "keyring": {"path": str(kp), "reload_interval_s": 300.0}}
    with G4Pool(G4Config(**cfg), namespace()) as w:
        assert put_blocks(w, [1], "alice").written == 1
        good = kp.read_bytes()
        doc = json.loads(good)
        doc["tenants"]["alice"].pop("current")
        _write(kp, doc)
        w.keyring.reload_every_s = 0  # the worker's next periodic check is due
        assert read_checked(w, [1], "alice") == [False]
        assert ".current: missing" in (w.keyring.error or "") and w.stats()["miss_keyring_unavailable"] == 1
        r = put_blocks(w, [2], "alice")
        assert r.written == 0 and r.dropped == 1 and w.stats().get("dropped_keyring") == 1, (r, w.stats())
        _write(kp, json.loads(good))
        assert read_checked(w, [1], "alice") == [True] and w.keyring.error is None


@pytest.mark.parametrize("args", [["list"], ["list", "--json"], ["rotate"], ["create", "--tenant", "bob"],
                                  ["revoke", "--tenant", TENANT]], ids=["list", "list-json", "rotate", "create",
                                                                        "revoke"])
@pytest.mark.parametrize("case", ["no_tenants", "no_current", "tenants_a_list"])
def test_keys_cli_on_a_malformed_keyring_exits_2_naming_the_member(tmp_path, monkeypatch, args, case):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    p, doc = _doc(tmp_path)
    edit, names = {c[0]: c[1:] for c in CASES}[case]
    edit(doc)
    _write(p, doc)
    edited = p.read_bytes()
    r = CliRunner().invoke(app, ["keys", *args, "--keyring", str(p)])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, r.output, r.exception)
    assert out.startswith("error: keyring ") and str(p) in out and names in out, out
    assert "Traceback" not in r.output and TENANT not in out
    assert p.read_bytes() == edited  # refused before anything was written
