"""The launchers' preflight opens the keyring a G4 pool would open, whenever it would open one. Review findings
2026-12-02 (both passed before 2026-12-03): with ``g4.encrypt: false`` and a ``g4.keyring.path`` whose KEK does not
open it the check said nothing, but the pool opens that keyring (keyed tenant names, encrypted blocks) and does not
start; and a dry run left a keyring not made yet to the engine without reading the KEK it would be made with, so a
malformed ``$kek_env`` passed the scripts' dry run and failed the engine."""
from __future__ import annotations

import base64
import json
import os

import pytest

from kvbm_backend.integrations.preflight import check_argv, exit_if_bad

VAR = "KVBM_TEST_KEK"


def _g4(tmp_path, encrypt: bool) -> dict:
    return {"g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": encrypt,
                   "keyring": {"path": str(tmp_path / "keys" / "keyring.json"), "kek_env": VAR}}}


def _argv(g4: dict) -> list[str]:
    return ["serve", "m", "--kv-transfer-config", json.dumps({
        "kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvbm_backend": {"g3": {"enabled": False}, **g4}}})]


def _tier_argv(g4: dict) -> list[str]:
    tier = {"type": "G4Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "g4": g4["g4"]}
    return ["serve", "m", "--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}})]


def _kek() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def test_a_plaintext_g4_with_a_keyring_its_kek_does_not_open_is_refused(tmp_path, monkeypatch, capsys):
    from kvbm_backend.config import load_config
    from kvbm_backend.crypto.keyring import Keyring
    monkeypatch.setenv(VAR, _kek())
    g4 = _g4(tmp_path, encrypt=False)
    (tmp_path / "keys").mkdir(mode=0o700)
    Keyring.from_config(load_config(g4, use_env=False).g4.keyring).close()  # wrapped under the first KEK
    for argv in (_argv(g4), _tier_argv(g4)):
        for create in (True, False):
            assert check_argv(argv, create=create) is None, (argv, create)
    monkeypatch.setenv(VAR, _kek())  # another KEK: the pool would not start
    for argv in (_argv(g4), _tier_argv(g4)):
        for create in (True, False):
            why = check_argv(argv, create=create)
            assert why and "g4.keyring: keyring " in why and "wrapped under KEK" in why and f"${VAR}" in why, why
            assert "g4.encrypt is false" in why, why
    with pytest.raises(SystemExit) as ex:
        exit_if_bad(_argv(g4))
    assert ex.value.code == 2
    assert capsys.readouterr().err.startswith("kvbm-backend: error: kv_connector_extra_config: g4.keyring: keyring ")


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_dry_run_reads_the_kek_a_keyring_not_made_yet_would_be_made_with(tmp_path, monkeypatch, encrypt):
    monkeypatch.setenv(VAR, "not-a-kek!")
    (tmp_path / "keys").mkdir(mode=0o700)
    argv = _argv(_g4(tmp_path, encrypt))
    for create in (False, True):
        why = check_argv(argv, create=create)
        assert why == f"kv_connector_extra_config: g4.keyring: ${VAR}: not valid base64" + (
            "" if encrypt else " (g4.encrypt is false, but a G4 pool opens the keyring g4.keyring.path names: it "
                               "names tenants and opens encrypted blocks with it)"), (create, why)
    assert list((tmp_path / "keys").iterdir()) == []
    monkeypatch.setenv(VAR, _kek())
    assert check_argv(argv, create=False) is None
    assert list((tmp_path / "keys").iterdir()) == []  # a dry run still writes nothing


def test_a_plaintext_g4_without_a_keyring_does_not_read_the_kek(tmp_path, monkeypatch):
    """The pool reads no KEK without a keyring, so the start is not refused for one (doctor reports it)."""
    monkeypatch.setenv(VAR, "not-a-kek!")
    g4 = _g4(tmp_path, encrypt=False)
    del g4["g4"]["keyring"]["path"]
    assert check_argv(_argv(g4), create=False) is None
