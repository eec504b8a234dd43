"""Keyring locking: a tenant's implicit creation (its first offload) writes and fsyncs the keyring file
without the keyring's mutex, so no reader and no other tenant's seal waits for that I/O.

Review finding (2026-12): ``write_key`` created an unknown tenant (file rewrite, fsync, directory fsync)
while holding the mutex that ``tenant_state`` (every G4 load and lookup), ``read_key`` and every seal
take. With the directory fsync slowed to 1.5 s another tenant's present blocks came back as
``miss_timeout`` (lookup 0 of 4), each expired batch counting a G4 breaker failure.

The slow disk is an fsync that blocks on an event until the test lets it go: no timing window. The
waits have generous hang guards (600 s); only a real hang trips them.
"""
from __future__ import annotations

import secrets
import threading
from pathlib import Path

import numpy as np

import kvbm_backend.crypto.kek as kek_mod
import kvbm_backend.crypto.keyring_publish as publish_mod
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, LocalKek
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, payload

GUARD_S = 600.0


def _keyring(path: Path, **kw) -> Keyring:
    return Keyring(path, LocalKek(secrets.token_bytes(32)), reload_every_s=0.0, persist_every_s=3600, **kw)


def _block_keyring_dir_fsync(monkeypatch, keyring_dir: Path) -> tuple[threading.Event, threading.Event]:
    """Make every fsync of ``keyring_dir`` (the last step of a keyring write, after the rename) wait until
    the returned ``release`` is set; ``entered`` is set once one does."""
    entered, release = threading.Event(), threading.Event()
    orig = kek_mod._fsync_dir

    def slow_fsync_dir(d: Path) -> None:
        if Path(d) == keyring_dir and not release.is_set():
            entered.set()
            assert release.wait(GUARD_S), "hang guard: the test never released the keyring fsync"
        orig(d)
    monkeypatch.setattr(kek_mod, "_fsync_dir", slow_fsync_dir)
    return entered, release


def _mutex_is_free(kr: Keyring) -> bool:
    """True when no thread holds the keyring's mutex now (it is taken and given back at once)."""
    if kr._mu.acquire(blocking=False):
        kr._mu.release()
        return True
    return False


def _thread(target, results: dict, name: str) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = target()
        except BaseException as e:  # noqa: BLE001 - reported by the test's assertions
            results[name] = e
    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    return th


def test_implicit_create_fsync_holds_up_no_reader_or_other_tenant(tmp_path, monkeypatch):
    """While a new tenant's first ``write_key`` is inside its keyring fsync, another tenant's
    ``tenant_state``, ``read_key`` and ``write_key`` complete (before: they waited for the fsync)."""
    path = tmp_path / "kr" / "keyring.json"
    kr = _keyring(path)
    kr.create("alice")
    dk = kr.write_key("alice")
    entered, release = _block_keyring_dir_fsync(monkeypatch, path.parent)
    got: dict = {}
    creator = _thread(lambda: kr.write_key("newbie"), got, "creator")
    try:
        assert entered.wait(GUARD_S), f"hang guard: the implicit create never reached its fsync ({got})"
        assert _mutex_is_free(kr), "the keyring mutex is held through the implicit create's fsync"
        readers = _thread(lambda: (kr.tenant_state("alice"), kr.read_key(dk.key_id, dk.version, tenant="alice"),
                                   kr.write_key("alice")), got, "readers")
        readers.join(GUARD_S)
        assert not readers.is_alive(), "hang guard: another tenant's reads waited for the keyring fsync"
        assert creator.is_alive()  # the creation is still inside its fsync: the reads did not wait for it
    finally:
        release.set()
    creator.join(GUARD_S)
    assert not creator.is_alive()
    state, key, sealed = got["readers"]
    assert state == "active" and key == dk.key and (sealed.key_id, sealed.key) == (dk.key_id, dk.key)
    new = got["creator"]
    assert not isinstance(new, BaseException), new
    assert kr.tenant_state("newbie") == "active" and kr.read_key(new.key_id, new.version, tenant="newbie") == new.key
    assert kr.write_key("newbie").key_id == new.key_id


def test_g4_loads_of_other_tenants_go_on_during_an_implicit_create(tmp_path, monkeypatch):
    """The reviewer's reproducer as a test: a G4 pool offloads a new tenant's first block (an implicit
    create) while the keyring's fsync is held; another tenant's present blocks still load and look up
    (before: ``miss_timeout`` for all 4, lookup 0, a breaker failure per batch)."""
    path = tmp_path / "kr" / "keyring.json"
    kr = _keyring(path)
    kr.create("alice")
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": str(path)}, timeout_s=120.0, retries=0)
    with G4Pool(cfg, ns, keyring=kr) as p:
        ka = ns.keys([1, 2, 3, 4], tenant="alice")
        assert p.put(ka, [payload(s, "alice", bpb) for s in (1, 2, 3, 4)]).result(GUARD_S).written == 4
        entered, release = _block_keyring_dir_fsync(monkeypatch, path.parent)
        try:
            fut = p.put(ns.keys([9], tenant="newbie"), [payload(9, "newbie", bpb)])  # implicit create
            assert entered.wait(GUARD_S), "hang guard: the new tenant's offload never reached the keyring fsync"
            assert _mutex_is_free(kr), "the keyring mutex is held through the implicit create's fsync"
            out = [np.zeros(bpb, np.uint8) for _ in ka]
            ok = p.get(ka, out).result(GUARD_S).ok
            found = p.lookup_prefix(ka).result(GUARD_S)
            assert not fut.done()  # the offload is still inside its fsync: the loads did not wait for it
        finally:
            release.set()
        assert list(ok) == [True] * 4 and found == 4
        assert all(np.array_equal(o, payload(s, "alice", bpb)) for o, s in zip(out, (1, 2, 3, 4)))
        assert fut.result(GUARD_S).written == 1
        st = p.stats()
        assert not st.get("miss_timeout") and st.get("breaker_state") == "closed", st
    assert kr.tenant_state("newbie") == "active"


def test_two_threads_creating_one_tenant_get_one_key(tmp_path, monkeypatch):
    """Two first writes of one tenant at once: both decide to create it, the file lock lets one creation
    in, the other finds it under the lock; both get the same key, the file holds one key, both uses count."""
    path = tmp_path / "kr" / "keyring.json"
    kr = _keyring(path)
    first_in, release = threading.Event(), threading.Event()
    second_at_lock = threading.Event()
    orig_write, orig_locked = publish_mod.replace_private_json, kr._locked

    def slow_write(p: Path, doc: object, **kw) -> None:  # the first creation waits before its write (file unchanged)
        if threading.current_thread().name == "first":
            first_in.set()
            assert release.wait(GUARD_S), "hang guard: the test never released the first creation"
        orig_write(p, doc, **kw)

    def locked():
        if threading.current_thread().name == "second":
            second_at_lock.set()  # it decided to create too and now waits for the file lock
        return orig_locked()
    monkeypatch.setattr(publish_mod, "replace_private_json", slow_write)
    monkeypatch.setattr(kr, "_locked", locked)
    got: dict = {}
    first = _thread(lambda: kr.write_key("acme"), got, "first")
    try:
        assert first_in.wait(GUARD_S), f"hang guard: the first creation never reached its write ({got})"
        second = _thread(lambda: kr.write_key("acme"), got, "second")
        assert second_at_lock.wait(GUARD_S), f"hang guard: the second write never reached the file lock ({got})"
        assert kr.tenant_state("acme") == "unknown"  # neither creation is in yet
    finally:
        release.set()
    first.join(GUARD_S)
    second.join(GUARD_S)
    assert not first.is_alive() and not second.is_alive()
    a, b = got["first"], got["second"]
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException), got
    assert (a.key_id, a.version, a.key) == (b.key_id, b.version, b.key)
    kr.close()
    fresh = Keyring(path, kr.provider, create=False)
    row = fresh.info("acme")
    assert len(fresh.info()) == 1 and row["key_id"] == a.key_id and len(row["versions"]) == 1
    assert row["versions"][0]["uses"] == 2
    assert fresh.read_key(a.key_id, a.version, tenant="acme") == a.key
