"""``kvbm-backend doctor``'s G4 ``keyring`` check says what a worker would do with the keyring and KEK it is given,
through the real entry point (review findings 2026-12-02, both "OK" before 2026-12-03):

* ``g4.encrypt: false`` with a ``g4.keyring.path``: the G4 pool still opens that keyring (keyed tenant names,
  encrypted blocks it finds, revoked tenants) and does not start when its KEK does not open it, so a wrong KEK
  is one problem, as with ``g4.encrypt: true``.
* a keyring not made yet (the first worker creates it) and ``$KVBM_BACKEND_KEK`` not a KEK: the worker fails
  reading the variable, so it is one problem naming it; with no keyring at all (``g4.encrypt: false``, no path)
  a malformed variable is a problem too (set for nothing, usable by nothing), a valid one a note."""
from __future__ import annotations

import base64
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from tests.apps.test_doctor_g4 import HANG_S, REPO, _keyring, _verdict, _wrong_kek

BAD_KEK = "not-a-kek!"  # not base64


def _doctor(cfg: dict, kek: str | None = None) -> subprocess.CompletedProcess:
    """``kvbm-backend doctor`` of ``cfg`` (G3 off), ``$KVBM_BACKEND_KEK`` set to ``kek`` (None: unset)."""
    cfg = {"g3": {"enabled": False}, **cfg}
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["COLUMNS"] = "200"
    if kek is not None:
        e["KVBM_BACKEND_KEK"] = kek
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", "--config", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=HANG_S, cwd=str(REPO), env=e)


def _one_problem(r: subprocess.CompletedProcess) -> str:
    last, probs = _verdict(r)
    assert (r.returncode, last, len(probs)) == (1, "1 problem", 1), r.stdout[-3000:] + r.stderr
    return probs[0]


def _store(tmp_path: Path) -> str:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    return f"file://{store}"


def test_a_plaintext_pool_with_a_keyring_its_kek_does_not_open_is_a_problem(tmp_path):
    url, kr = _store(tmp_path), _keyring(tmp_path)
    cfg = {"g4": {"enabled": True, "url": url, "encrypt": False, "keyring": {"path": kr}}}
    r = _doctor(cfg)
    last, probs = _verdict(r)
    assert (r.returncode, last, probs) == (0, "OK", []), r.stdout[-3000:] + r.stderr
    _wrong_kek(kr)
    p = _one_problem(_doctor(cfg))
    assert p.startswith(f"problem: g4 keyring: keyring {kr}: wrapped under KEK"), p
    assert "g4.encrypt is false" in p and "g4.keyring.path" in p, p


def test_a_malformed_kek_variable_beside_a_keyring_not_made_yet_is_a_problem(tmp_path):
    url = _store(tmp_path)
    (tmp_path / "keys").mkdir(mode=0o700)
    kr = str(tmp_path / "keys" / "kr.json")
    for encrypt in (True, False):
        p = _one_problem(_doctor({"g4": {"enabled": True, "url": url, "encrypt": encrypt, "keyring": {"path": kr}}},
                                 kek=BAD_KEK))
        assert p.startswith("problem: g4 keyring: $KVBM_BACKEND_KEK: not valid base64: the first worker creates "
                            f"keyring {kr} with this KEK"), (encrypt, p)
    assert list((tmp_path / "keys").iterdir()) == []  # doctor creates nothing


def test_a_malformed_kek_variable_without_a_keyring_is_a_problem_a_valid_one_a_note(tmp_path):
    cfg = {"g4": {"enabled": True, "url": _store(tmp_path), "encrypt": False}}
    p = _one_problem(_doctor(cfg, kek=BAD_KEK))
    assert p.startswith("problem: g4 keyring: $KVBM_BACKEND_KEK: not valid base64: no worker can use it"), p
    r = _doctor(cfg, kek=base64.b64encode(secrets.token_bytes(32)).decode())
    last, probs = _verdict(r)
    assert (r.returncode, last, probs) == (0, "OK", []), r.stdout[-3000:] + r.stderr
