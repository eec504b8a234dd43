"""A keyring file replaced under running workers (deleted: a crypto-shred of every tenant; then made anew by
``kvbm-backend keys create``: a new pseudonym key). A running G4 pool must follow the new file at its next
reload: name, tag and find blocks under the new pseudonyms, as a freshly started worker does. Before
2026-11-30 its tenant-name cache (``pool/g4/tenant_names.py``) kept the shredded keyring's pseudonyms and
naming keys: it kept writing under the old names (sealed with the new keys), fresh workers never found those
blocks, and its own offloads of blocks the old generation held were ``skipped_exists`` and their loads
``miss_no_key`` until it restarted (reviewer's r3_keyring_replaced_stale_names.py)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, LocalKek, provider_for
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
RELOAD_S = 0.2  # g4.keyring.reload_interval_s of the running pool
CHANGED = "the keyring's pseudonym key changed"  # the pool's one log line


def _cli(*args: str) -> None:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output


def _until(pred) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < HANG_S, "hang guard"
        time.sleep(0.05)


def _blocks_under(store: Path, ns_fp: str, tag: str) -> int:
    d = store / ns_fp / tag
    return sum(len(files) for _, _, files in os.walk(d)) if d.exists() else 0


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plaintext-keyed-names"])
def test_a_running_pool_follows_a_replaced_keyring_file(tmp_path, monkeypatch, caplog, encrypt):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)  # the KEK file next to the keyring (kept)
    kr = tmp_path / "keys" / "keyring.json"
    store = tmp_path / "store"
    cfg = G4Config(url=f"file://{store}", encrypt=encrypt, dir_fanout=16, timeout_s=30.0,
                   keyring={"path": str(kr), "reload_interval_s": RELOAD_S})
    ns = namespace()
    _cli("keys", "create", "--keyring", str(kr), "--tenant", "alice")
    caplog.set_level(logging.WARNING, logger="kvbm_backend.pool.g4.tenant_names")
    with G4Pool(cfg, ns) as running:
        assert put_blocks(running, [1, 2], "alice").written == 2
        old = running.pseudonym("alice").hex()
        assert _blocks_under(store, ns.fingerprint, old) == 2

        kr.unlink()  # a crypto-shred of every tenant (docs/configuration.md) ...
        _cli("keys", "create", "--keyring", str(kr), "--tenant", "alice")  # ... and a new keyring
        new = Keyring(kr, provider_for(kr)).pseudonym("alice").hex()  # the operator's view of the new file
        assert new != old
        # past the reload interval, the pool's next use of its keyring checks the file (nothing else asks it
        # to: the offload below is the first use; a sleep to be past the interval, no window asserted)
        time.sleep(2 * RELOAD_S)
        # it stores under the new names: seq 1 too (its old-generation block is no obstacle)
        res = put_blocks(running, [1, 3], "alice")
        assert (res.written, res.skipped, res.dropped) == (2, 0, 0)
        assert running.pseudonym("alice").hex() == new and running.keyring.naming_generation() == 1
        assert read_checked(running, [1, 3], "alice") == [True, True]
        assert running.lookup_prefix(ns.keys([1, 3], tenant="alice")).result(timeout=HANG_S) == 2
        st = running.stats()
        assert st.get("skipped_exists", 0) == 0 and st.get("miss_no_key", 0) == 0
        assert _blocks_under(store, ns.fingerprint, old) == 2  # nothing more under the shredded pseudonym
        assert _blocks_under(store, ns.fingerprint, new) == 2
        assert read_checked(running, [2], "alice") == [False]  # the old generation's block: gone with its keys
        running.flush(HANG_S)

        # a worker started on the new file finds what the running one wrote after the swap
        with G4Pool(cfg, ns) as fresh:
            assert fresh.pseudonym("alice").hex() == new
            assert read_checked(fresh, [1, 3], "alice") == [True, True]
            assert fresh.lookup_prefix(ns.keys([1, 3], tenant="alice")).result(timeout=HANG_S) == 2
    said = [r for r in caplog.records if CHANGED in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "alice" not in said[0].getMessage() and old not in said[0].getMessage()  # no tenant, no pseudonym


def test_naming_generation_changes_only_with_the_pseudonym_key(tmp_path, monkeypatch):
    """Rotation, revocation, re-creation and ``rewrap`` keep the pseudonym key (and every name): the
    generation stays; only a file with another pseudonym key moves it, once per change."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    kr = tmp_path / "keys" / "keyring.json"
    _cli("keys", "create", "--keyring", str(kr), "--tenant", "alice")
    k = Keyring(kr, provider_for(kr), reload_every_s=0.0)
    ps0 = k.pseudonym("alice")
    assert k.naming_generation() == 0 and k.naming("alice")[:2] == (0, ps0)
    for cmd in ("rotate", "revoke", "create"):
        loads = k.stats()["loads"]
        _cli("keys", cmd, "--keyring", str(kr), "--tenant", "alice")
        _until(lambda n=loads: k.naming_generation() == 0 and k.stats()["loads"] > n)  # reloaded, same key
    assert k.pseudonym("alice") == ps0
    gens = []
    for _ in range(2):
        kr.unlink()
        _cli("keys", "create", "--keyring", str(kr), "--tenant", "alice")
        _until(lambda: k.naming_generation() == len(gens) + 1)
        gens.append(k.naming("alice"))
    (g1, ps1, nk1), (g2, ps2, nk2) = gens
    assert (g1, g2) == (1, 2) and len({ps0, ps1, ps2}) == 3 and nk1 != nk2
    assert k.name_key(ps2) == nk2 and k.pseudonym("alice") == ps2
    k.rewrap(LocalKek(os.urandom(32), "test"))  # a new KEK: the same pseudonym key, the same names
    assert k.naming_generation() == 2 and k.naming("alice") == (g2, ps2, nk2)
