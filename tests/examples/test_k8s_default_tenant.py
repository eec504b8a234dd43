"""The examples/k8s keyring set-up and requests without a ``cache_salt``: they belong to the config's ``tenant``
(default ``""``), and with the ConfigMap's keyring settings (``auto_create_tenants: false``, a read-only Secret)
that tenant must be created like any other. Before, the manifests and README only said ``keys create --tenant
TENANT``: plain OpenAI clients got no G4 offload at all, and the drop's log line did not say that the tenant
missing was the empty default one. Real CLI (``kvbm-backend keys create``), a real ``file://`` G4 pool with the
ConfigMap's own YAML, no mocks."""
from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.config import load_config
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "examples" / "k8s"


def _keys_create(keyring: Path, tenant: str, env: dict) -> None:
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "keys", "create", "--keyring", str(keyring),
                        "--tenant", tenant, "--json"], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                       env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr


def _configmap_config(tmp_path: Path, keyring: Path):
    docs = list(yaml.safe_load_all((K8S / "worker.yaml").read_text()))
    cm = yaml.safe_load(next(d for d in docs if d and d["kind"] == "ConfigMap")["data"]["kvbm-backend.yaml"])
    assert cm["g4"]["keyring"]["auto_create_tenants"] is False  # the premise: tenants only from `keys create`
    # a local store; its load bound no subject here (the ConfigMap's serving one, the 2 s default, turned a read the
    # busy CI VM froze into a miss)
    cm["g4"].update(url=f"file://{tmp_path / 'store'}", endpoint_url=None, timeout_s=G4_TIMEOUT_S)
    cm["g4"]["keyring"].update(path=str(keyring), read_only=True)  # the Secret volume is read-only
    return load_config(cm, use_env=False)


def test_the_k8s_docs_create_the_default_tenant_of_requests_without_a_cache_salt():
    for f in (K8S / "README.md", K8S / "worker.yaml"):
        assert "keys create --keyring ./keyring.json --tenant ''" in f.read_text(), f
    conf = (REPO / "docs" / "configuration.md").read_text()
    row = next(ln for ln in conf.splitlines() if ln.startswith("| `tenant` |"))
    assert "--tenant ''" in row and "dropped_unknown_tenant" in row, row


def test_requests_without_a_cache_salt_need_the_default_tenant_in_the_k8s_keyring(tmp_path, caplog, monkeypatch):
    env = {**os.environ, "KVBM_BACKEND_KEK": base64.b64encode(os.urandom(32)).decode()}
    monkeypatch.setenv("KVBM_BACKEND_KEK", env["KVBM_BACKEND_KEK"])
    (tmp_path / "keys").mkdir(mode=0o700)
    kr = tmp_path / "keys" / "keyring.json"
    _keys_create(kr, "TENANT", env)  # what the manifests said, and only that
    cfg = _configmap_config(tmp_path, kr)
    assert cfg.tenant == ""  # a request without a cache_salt
    caplog.set_level(logging.WARNING, logger="kvbm_backend")
    with G4Pool(cfg.g4, namespace()) as p:
        assert put_blocks(p, [1], "TENANT").written == 1 and read_checked(p, [1], "TENANT") == [True]
        res = put_blocks(p, [2, 3], cfg.tenant)
        assert (res.written, res.dropped) == (0, 2) and p.stats()["dropped_unknown_tenant"] == 2
        lines = [r.getMessage() for r in caplog.records if "dropped_unknown_tenant" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        # the line says it is the empty default tenant and how to create it; the pseudonym, never another id
        assert 'the empty tenant "" (the default `tenant`: every request without a cache_salt has it)' in lines[0]
        assert f"keys create --keyring {kr} --tenant ''" in lines[0], lines[0]
        assert p.pseudonym("").hex() in lines[0] and "TENANT" not in lines[0]
    _keys_create(kr, "", env)  # what the manifests say now
    with G4Pool(cfg.g4, namespace()) as p:
        assert put_blocks(p, [2, 3], cfg.tenant).written == 2
        assert read_checked(p, [2, 3], cfg.tenant) == [True, True]
        assert p.stats().get("dropped_unknown_tenant", 0) == 0


@pytest.mark.parametrize("tenant", ["acme", "x"])
def test_another_tenants_drop_line_names_no_default_and_no_id(tmp_path, caplog, monkeypatch, tenant):
    monkeypatch.setenv("KVBM_BACKEND_KEK", base64.b64encode(os.urandom(32)).decode())
    (tmp_path / "keys").mkdir(mode=0o700)
    kr = tmp_path / "keys" / "keyring.json"
    _keys_create(kr, "TENANT", dict(os.environ))
    cfg = _configmap_config(tmp_path, kr)
    caplog.set_level(logging.WARNING, logger="kvbm_backend")
    with G4Pool(cfg.g4, namespace()) as p:
        assert put_blocks(p, [1], tenant).dropped == 1
        lines = [r.getMessage() for r in caplog.records if "dropped_unknown_tenant" in r.getMessage()]
        assert len(lines) == 1 and p.pseudonym(tenant).hex() in lines[0], caplog.text
        assert "empty tenant" not in lines[0] and "--tenant" not in lines[0], lines[0]
        assert f" {tenant} " not in lines[0] and f"'{tenant}'" not in lines[0]
