"""``config effective``: where each field comes from, when a script default applies, and who an error blames
(:mod:`kvbm_backend.apps.effective`, in process, with real config files). Review findings (2026-11-30):

* a section variable (``KVBM_BACKEND__G3='{"capacity_gb": 5}'``) counted as setting every field of its section,
  so the script's ``g3.paths`` default was dropped (G3 opened in ./kvbm-g3) and the line said
  ``g3.paths=./kvbm-g3 [env KVBM_BACKEND__G3]``;
* a bad ``--default`` was reported as coming from the ``KVBM_BACKEND__...`` variable it is exported as, which the
  operator never set;
* inline JSON text (the connector's ``kvbm_backend``, a tier's ``config``), which the engine loads, was taken for
  a file name and refused (``config file {...}: not found``); a list there was a traceback.
The launch scripts themselves run in tests/examples/test_example_effective.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm_backend.apps.effective import EffectiveError, Source, effective
from kvbm_backend.integrations.vllm.extra_config import config_from_extra, tier_config

HANG_S = 600.0  # a hang guard, not a bound: a CLI run that must end (the unit lane runs at nice 19)
REPO = Path(__file__).resolve().parents[2]

DEFAULTS = {"g3.paths": ["/mnt/nvme0/kvbm"], "g3.capacity_gb": 800}


@pytest.fixture
def bare(tmp_path):
    p = tmp_path / "bare.yaml"
    p.write_text("model: m\n")
    return Source(str(p))


def test_a_section_variable_sets_only_its_fields(bare):
    cfg, exports, where = effective(bare, DEFAULTS, {"KVBM_BACKEND__G3": '{"capacity_gb": 5}'})
    assert exports == {"KVBM_BACKEND__G3__PATHS": '["/mnt/nvme0/kvbm"]'}
    assert (cfg.g3.paths, cfg.g3.capacity_gb) == (["/mnt/nvme0/kvbm"], 5)
    assert (where["g3.paths"], where["g3.capacity_gb"], where["g3.enabled"]) == (
        "script", "env KVBM_BACKEND__G3", "default")


def test_a_section_variable_holding_the_field_wins_and_is_named(bare, tmp_path):
    g3 = str(tmp_path / "env-g3")
    env = {"KVBM_BACKEND__G3": f'{{"paths": ["{g3}"]}}', "DYN_KVBM_DISK_CACHE_GB": "3"}
    cfg, exports, where = effective(bare, DEFAULTS, env)
    assert exports == {} and (cfg.g3.paths, cfg.g3.capacity_gb) == ([g3], 3)
    assert (where["g3.paths"], where["g3.capacity_gb"]) == ("env KVBM_BACKEND__G3", "env DYN_KVBM_DISK_CACHE_GB")
    # the deeper variable wins, and is the one named
    env["KVBM_BACKEND__G3__PATHS"] = f'["{g3}-2"]'
    cfg, _, where = effective(bare, DEFAULTS, env)
    assert cfg.g3.paths == [f"{g3}-2"] and where["g3.paths"] == "env KVBM_BACKEND__G3__PATHS"


def test_a_bad_default_is_blamed_on_the_default_not_a_variable(bare):
    with pytest.raises(EffectiveError, match=r"^g3\.paths \(from --default g3\.paths\): Input should be a valid list"):
        effective(bare, {"g3.paths": "/x"}, {})
    with pytest.raises(EffectiveError, match=r"^nosuch \(from --default nosuch\.field\): Extra inputs"):
        effective(bare, {"nosuch.field": 1}, {})
    # the operator's own variable of that name: the default is not applied, the variable is named
    with pytest.raises(EffectiveError, match=r"^g3\.paths \(from KVBM_BACKEND__G3__PATHS\): Input should be a valid"):
        effective(bare, {"g3.paths": "/x"}, {"KVBM_BACKEND__G3__PATHS": "/y"})


def _cli(ktc: dict, *args: str) -> subprocess.CompletedProcess:
    """``python -m kvbm_backend.apps.effective --for vllm ARGS KTC`` without the caller's kvbm-backend variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.effective", "--for", "vllm", *args,
                           json.dumps(ktc)], capture_output=True, text=True, env=env, timeout=HANG_S)


def test_inline_json_text_is_a_config_as_the_engine_takes_it(tmp_path):
    """Review finding (2026-11-30): the connector's ``kvbm_backend`` (and a tier's ``config``) may be the config's
    JSON text (``config_from_extra`` / ``tier_config`` load it), but ``config effective`` took the text for a file
    name: ``config file {"g3": ...}: not found``, exit 2, so a launch script refused a config the engine accepts."""
    g3 = str(tmp_path / "g3")
    text = json.dumps({"g3": {"paths": [g3], "capacity_gb": 3}})
    engine_cfg, _ = config_from_extra({"kvbm_backend": text})  # what the connector loads
    assert (engine_cfg.g3.paths, engine_cfg.g3.capacity_gb) == ([g3], 3)
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"kvbm_backend": text}}
    r = _cli(ktc, "--default", 'g3.paths=["/mnt/nvme0/kvbm"]', "--default", "g3.capacity_gb=800")
    assert r.returncode == 0, r.stderr
    assert f"g3.paths={g3} [script] g3.capacity_gb=3 [script]" in r.stderr, r.stderr
    assert "export" not in r.stdout  # the inline settings give both fields: no script default applies
    assert tier_config(text).g3.paths == [g3]  # a native tier's config as JSON text, too
    tier = {"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "config": text}
    r = _cli({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"secondary_tiers": [tier]}})
    assert r.returncode == 0 and f"g3.paths={g3} [script]" in r.stderr, r.stderr


@pytest.mark.parametrize("value, why", [
    (["x"], "kv_connector_extra_config.kvbm_backend: expected a mapping, a JSON string or a file path, got list"),
    ('{"g3":', "kv_connector_extra_config.kvbm_backend: inline JSON config: Expecting value"),
])
def test_a_bad_inline_config_is_one_line_naming_the_key(value, why):
    """A ``kvbm_backend`` that is no config was a traceback (a list) or a 'config file ... not found' (bad JSON
    text); now one ``kvbm-backend: error:`` line naming the key, exit 2, as the connector refuses it."""
    r = _cli({"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"kvbm_backend": value}})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"kvbm-backend: error: {why}"), r.stderr


def test_a_tiers_nested_override_merges_field_by_field(tmp_path, monkeypatch):
    """Review finding (2026-11-30): a tier's ``g4: {"keyring": {...}}`` replaced the config's whole keyring section,
    so one keyring field given on the tier (here ``reload_interval_s``) silently reset the file's ``path``,
    ``kek_env`` and ``auto_create_tenants: false`` (true again: client-chosen tenants created) and the operator's
    ``KVBM_BACKEND__G4__KEYRING__MAX_AUTO_TENANTS`` to their defaults; ``config effective`` then refused the
    script (``g4.keyring.path: required``). The docs promise field by field precedence."""
    (tmp_path / "g4").mkdir()
    kr = tmp_path / "kr"
    kr.mkdir(mode=0o700)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"g3: {{enabled: false}}\ng4:\n  enabled: true\n  url: file://{tmp_path / 'g4'}\n"
                        f"  keyring: {{path: {kr / 'keyring.json'}, kek_env: MY_KEK, auto_create_tenants: false}}\n")
    monkeypatch.setenv("KVBM_BACKEND__G4__KEYRING__MAX_AUTO_TENANTS", "7")
    monkeypatch.setenv("MY_KEK", "A" * 43 + "=")  # the named kek_env is set (unset: refused, as the worker does)
    cfg = tier_config(str(cfg_file), g4={"keyring": {"reload_interval_s": 5}})
    k = cfg.g4.keyring
    assert (k.path, k.kek_env, k.auto_create_tenants, k.max_auto_tenants, k.reload_interval_s) == (
        str(kr / "keyring.json"), "MY_KEK", False, 7, 5)
    # config effective merges the tier's keys as the tier does, and names the file's keyring
    tier = {"type": "G4Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "config": str(cfg_file),
            "g4": {"keyring": {"reload_interval_s": 5}}}
    r = _cli({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"secondary_tiers": [tier]}})
    assert r.returncode == 0, r.stderr
    assert f"g4.keyring.path={kr / 'keyring.json'} [file]" in r.stderr, r.stderr


def test_a_tiers_own_keys_win_over_the_environment_as_documented(tmp_path):
    """Review finding (2026-11-30): a native tier's ``g3``/``g4`` keys are merged after the environment
    (``tier_config``), so they override ``KVBM_BACKEND__*``, and ``config effective`` agrees, but
    docs/configuration.md's precedence line ended at ``KVBM_BACKEND__*``. It names the tier keys last now."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: m\ng3:\n  capacity_gb: 3\n")
    tier = {"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "config": str(cfg_file),
            "g3": {"capacity_gb": 7}}
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"secondary_tiers": [tier]}}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    env.update(PYTHONPATH=str(REPO), KVBM_BACKEND__G3__CAPACITY_GB="5")
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.effective", "--for", "vllm", json.dumps(ktc)],
                       capture_output=True, text=True, env=env, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert "g3.capacity_gb=7 [inline]" in r.stderr, r.stderr  # the tier's key, not the variable's 5
    doc = " ".join((REPO / "docs" / "configuration.md").read_text().split())
    line = doc[doc.index("Precedence, later wins"):]
    line = line[:line.index("The effective configuration is logged")]
    assert line.index("`KVBM_BACKEND__*`") < line.index("its own `g3`/`g4` keys"), line


def test_a_dangling_kek_link_is_not_reported_as_a_new_kek(tmp_path, monkeypatch):
    """Review finding (2026-11-30): ``kek_source`` looked for the KEK file with Path.exists, the keyring opener
    (``provider_for``) with os.path.lexists. With no keyring yet and ``kr.json.kek`` a symbolic link to nothing,
    ``config effective`` said ``new file`` and exited 0 while the opener refuses the link: the engine failed
    after the launch script passed. Both now take the link as the KEK file; ``config effective`` names it."""
    from kvbm_backend.crypto.kek import KeyringError, provider_for
    kdir = tmp_path / "k"
    kdir.mkdir(mode=0o700)
    kr, kek = kdir / "kr.json", kdir / "kr.json.kek"
    kek.symlink_to(kdir / "nowhere")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(f"model: m\ng3:\n  enabled: false\ng4:\n  enabled: true\n  url: file://{tmp_path / 'g4'}\n"
                        f"  keyring:\n    path: {kr}\n")  # the default kek_env (a named one unset: refused first)
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    with pytest.raises(KeyringError):  # what the engine would meet
        provider_for(kr)
    r = _cli({"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"config_file": str(cfg_file)}})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"kvbm-backend: error: g4.keyring: KEK file {kek} is a symbolic link to nothing"), \
        r.stderr
    assert not kr.exists() and os.path.islink(kek)  # nothing created


def test_a_named_kek_env_that_is_unset_is_refused_not_reported_as_a_kek_file(tmp_path, monkeypatch):
    """Review finding (2026-12-03): a config naming ``g4.keyring.kek_env: FLEET_KEK`` (a fleet's Secret) whose
    variable is unset made ``config effective`` print ``g4.kek=[new file PATH.kek]`` (or ``[file PATH.kek]``)
    and exit 0, while the worker refuses to start (``Keyring.from_config``: a named kek_env is never replaced by
    the node-local KEK file). Now one error line naming ``g4.keyring.kek_env`` and the variable, exit 2, nothing
    created; with the variable set, or the default's name, the KEK's source as before."""
    var = "KVBM_TEST_FLEET_KEK"
    monkeypatch.delenv(var, raising=False)
    kdir = tmp_path / "k"
    kdir.mkdir(mode=0o700)
    kr = kdir / "kr.json"

    def ktc(kek_env: str | None, encrypt: bool = True) -> dict:
        g4 = {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": encrypt,
              "keyring": {"path": str(kr), **({"kek_env": kek_env} if kek_env else {})}}
        return {"kv_connector": "KvbmBackendConnector",
                "kv_connector_extra_config": {"kvbm_backend": {"g3": {"enabled": False}, "g4": g4}}}

    refused = f"kvbm-backend: error: g4.keyring.kek_env: {var} is not set"
    for encrypt in (True, False):  # a plaintext pool with a keyring opens it too (names tenants, reads blocks)
        r = _cli(ktc(var, encrypt))
        assert r.returncode == 2 and r.stderr.startswith(refused), (encrypt, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
    (kdir / "kr.json.kek").write_text("A" * 43 + "=\n")  # an existing KEK file is no fallback for it either
    (kdir / "kr.json.kek").chmod(0o600)
    r = _cli(ktc(var))
    assert r.returncode == 2 and r.stderr.startswith(refused), r.stderr
    assert sorted(p.name for p in kdir.iterdir()) == ["kr.json.kek"]  # nothing created
    (kdir / "kr.json.kek").unlink()
    r = _cli(ktc("KVBM_BACKEND_KEK"))  # the default's name, given: the KEK file the first worker makes
    assert r.returncode == 0 and f"g4.kek=[new file {kr}.kek]" in r.stderr, r.stderr
    monkeypatch.setenv(var, "A" * 43 + "=")  # set: the environment's KEK
    r = _cli(ktc(var))
    assert r.returncode == 0 and f"g4.kek=[env {var}]" in r.stderr, r.stderr
    assert list(kdir.iterdir()) == []
