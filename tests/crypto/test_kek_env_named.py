"""A ``g4.keyring.kek_env`` other than the default must be set. Review finding (2026-12-03): a config naming
``kek_env: FLEET_KEK`` (a Kubernetes deployment, the KEK from a Secret: examples/k8s) whose worker lacked that
variable (the Secret not wired into the pod) fell back to the node-local KEK file, and where the keyring did not
exist yet the worker made a keyring and a KEK of its own, silently: every pod then named tenants and sealed blocks
under its own keys and no pod could read another's G4 blocks; ``doctor`` said OK. Now the pool, the launchers'
preflight and ``doctor`` refuse it, naming the field and the variable, and create nothing. The default
``KVBM_BACKEND_KEK`` (given or not: the example configs give it, for dev hosts too) keeps the KEK file as the
fallback, through a tier's config merge too."""
from __future__ import annotations

import base64
import os

import pytest

from kvbm_backend.config import load_config
from kvbm_backend.crypto.keyring import KeyringError
from kvbm_backend.integrations.preflight import check_argv
from kvbm_backend.integrations.vllm.extra_config import tier_config
from kvbm_backend.pool.g4.pool import G4Pool
from tests.integrations.test_preflight_keyring import _argv, _tier_argv
from tests.apps.test_doctor_g4_keyring import _doctor, _one_problem, _verdict
from tests.helpers.g4_writer import namespace

VAR = "KVBM_TEST_FLEET_KEK"
REFUSED = f"g4.keyring.kek_env: {VAR} is not set"


def _g4(tmp_path, **keyring) -> dict:
    store = tmp_path / "store"
    store.mkdir(mode=0o700, exist_ok=True)
    (tmp_path / "keys").mkdir(mode=0o700, exist_ok=True)
    return {"g4": {"enabled": True, "url": f"file://{store}", "dir_fanout": 16,
                   "keyring": {"path": str(tmp_path / "keys" / "keyring.json"), **keyring}}}


@pytest.fixture(autouse=True)
def _no_kek(monkeypatch):
    for v in (VAR, "KVBM_BACKEND_KEK"):
        monkeypatch.delenv(v, raising=False)
    for v in [k for k in os.environ if k.startswith("KVBM_BACKEND__G4__KEYRING")]:
        monkeypatch.delenv(v)


def _open(g4: dict) -> None:
    G4Pool(load_config(g4, use_env=False).g4, namespace()).close()


def test_a_named_kek_env_that_is_unset_refuses_the_pool_and_creates_nothing(tmp_path, monkeypatch):
    name = VAR
    g4 = _g4(tmp_path, kek_env=name)
    with pytest.raises(KeyringError) as ex:
        _open(g4)
    assert str(ex.value).startswith(f"g4.keyring.kek_env: {name} is not set"), ex.value
    assert list((tmp_path / "keys").iterdir()) == []  # no keyring, no KEK file, no lock
    # a tier's config (dumped and reloaded: tier_config) keeps the name
    with pytest.raises(KeyringError, match=f"g4.keyring.kek_env: {name} is not set"):
        G4Pool(tier_config(g4, tier="G4").g4, namespace()).close()
    # the environment names it too
    monkeypatch.setenv("KVBM_BACKEND__G4__KEYRING__KEK_ENV", name)
    with pytest.raises(KeyringError, match=f"g4.keyring.kek_env: {name} is not set"):
        G4Pool(load_config(_g4(tmp_path)).g4, namespace()).close()
    assert list((tmp_path / "keys").iterdir()) == []
    monkeypatch.setenv(name, base64.b64encode(os.urandom(32)).decode())  # set: the keyring is made under it
    _open(g4)
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["keyring.json", "keyring.json.lock"]


def test_kek_env_not_named_still_falls_back_to_the_kek_file(tmp_path):
    g4 = _g4(tmp_path)
    G4Pool(tier_config(g4, tier="G4").g4, namespace()).close()  # through a tier's dump and reload too
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [
        "keyring.json", "keyring.json.kek", "keyring.json.lock"]
    _open(g4)  # the file's KEK opens it again
    (tmp_path / "d").mkdir()  # the default's name given (as the example configs give it): the same fallback
    _open(_g4(tmp_path / "d", kek_env="KVBM_BACKEND_KEK"))
    assert (tmp_path / "d" / "keys" / "keyring.json.kek").exists()


def test_the_preflight_refuses_a_named_kek_env_that_is_unset(tmp_path):
    named, default = _g4(tmp_path, kek_env=VAR), _g4(tmp_path)
    for argv in (_argv(named), _tier_argv(named)):
        for create in (False, True):  # the dry run and the launcher's own check
            why = check_argv(argv, create=create)
            assert why is not None and REFUSED in why, (argv, create, why)
    assert list((tmp_path / "keys").iterdir()) == []
    assert check_argv(_tier_argv(default), create=False) is None  # not named: the KEK file the engine makes
    assert check_argv(_argv(default), create=False) is None
    assert list((tmp_path / "keys").iterdir()) == []


@pytest.mark.slow  # two doctor runs: about 13 s on the 2-core CI box
def test_doctor_reports_a_named_kek_env_that_is_unset_as_one_problem(tmp_path):
    p = _one_problem(_doctor(_g4(tmp_path, kek_env=VAR)))
    assert p.startswith(f"problem: g4 keyring: {REFUSED}"), p
    assert list((tmp_path / "keys").iterdir()) == []
    r = _doctor(_g4(tmp_path))  # not named: the first worker makes the KEK file
    assert _verdict(r)[0] == "OK", r.stdout[-3000:] + r.stderr
