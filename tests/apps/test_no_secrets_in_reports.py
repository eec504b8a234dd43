"""Credentials in an S3 endpoint URL (``http://USER:SECRET@host``, which the config accepts) never reach
``kvbm-backend config effective`` (its line goes to a worker's log) or ``doctor`` (report and JSON). Review
finding (2026-11-29): both printed the endpoint in clear, while the start-up line already redacted it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

REPO = Path(__file__).resolve().parents[2]
SECRET = "SuperSecret123"


@pytest.fixture
def cfg(tmp_path) -> Path:
    p = tmp_path / "kvbm.yaml"
    p.write_text(json.dumps({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 1},
                             "g4": {"enabled": True, "url": "s3://kvbm-bucket/pfx", "encrypt": False,
                                    "endpoint_url": f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:1"}}))
    return p


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM"))}
    env.update(PYTHONPATH=str(REPO), AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], capture_output=True, text=True,
                          env=env, timeout=HANG_S, cwd=str(REPO))


def test_config_effective_redacts_the_endpoint(cfg):
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"config_file": str(cfg)}}
    r = _cli("config", "effective", "--for", "vllm", json.dumps(ktc))
    assert r.returncode == 0, r.stderr
    assert "g4.endpoint_url=http://127.0.0.1:1 [file]" in r.stderr, r.stderr
    assert SECRET not in r.stdout + r.stderr


def test_doctor_redacts_the_endpoint(cfg):
    r = _cli("doctor", "--config", str(cfg), "--json")
    out = r.stdout + r.stderr
    assert "127.0.0.1:1" in out and "not reachable" in out, out[-3000:]
    assert SECRET not in out


def test_doctor_json_names_an_inline_config_without_echoing_it(cfg, tmp_path):
    """Review finding (2026-11-30): ``doctor --json --config '<inline JSON>'`` echoed the raw string in
    "config", endpoint credentials included, while its G4 section redacted them. Now "config" is
    "inline JSON" for an inline config and the absolute path for a file."""
    inline = json.dumps({"g3": {"enabled": False}, "g4": {"enabled": True, "url": "s3://kvbm-bucket/pfx",
                                                          "encrypt": False,
                                                          "endpoint_url": f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:1"}})
    r = _cli("doctor", "--json", "--config", inline)
    assert r.stdout.strip().startswith("{"), r.stderr[-2000:]
    assert SECRET not in r.stdout + r.stderr
    assert json.loads(r.stdout)["config"] == "inline JSON"
    r = _cli("doctor", "--config", inline)  # the table
    assert "127.0.0.1:1" in r.stdout and SECRET not in r.stdout + r.stderr
    r = _cli("doctor", "--json", "--config", str(cfg))
    assert json.loads(r.stdout)["config"] == str(cfg)


def _dry_run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM"))}
    return subprocess.run([sys.executable, "-m", "kvbm_backend.apps.effective", "--dry-run", *argv], capture_output=True,
                          text=True, timeout=HANG_S, cwd=str(cwd), env={**e, "PYTHONPATH": str(REPO), **env})


def test_dry_run_redacts_urls_in_the_command_the_env_and_the_error(tmp_path):
    """Review finding (2026-11-30): ``python -m kvbm_backend.apps.effective --dry-run`` (what the launch scripts exec
    with ``KVBM_BACKEND_DRY_RUN`` set) printed ``env KVBM_BACKEND__G4__ENDPOINT_URL=http://USER:SECRET@...`` as
    given. Every line it prints (the command, the env, the preflight's error) now carries URLs without credentials
    or query; other values unchanged."""
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"kvbm_backend": {
        "g3": {"enabled": False}, "g4": {"enabled": False, "endpoint_url": f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:1"}}}}
    argv = ["vllm", "serve", "m", "--kv-transfer-config", json.dumps(ktc)]
    env = {"KVBM_BACKEND__G4__ENDPOINT_URL": f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:1",
           "KVBM_BACKEND__G4": json.dumps({"url": "s3://kvbm-bucket/pfx"}), "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path)}
    r = _dry_run(argv, env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "kvbm-backend dry run: env " in r.stdout and "KVBM_BACKEND__G4__ENDPOINT_URL=http://127.0.0.1:1" in r.stdout
    assert '"endpoint_url": "http://127.0.0.1:1"' in r.stdout and "s3://kvbm-bucket/pfx" in r.stdout
    assert f"DYN_KVBM_DISK_CACHE_DIR={tmp_path}" in r.stdout and SECRET not in r.stdout + r.stderr
    # the preflight's one-line error quotes the value it refuses: without the credentials either
    env["KVBM_BACKEND__G4__ENDPOINT_URL"] = f"ftp://AKIAEXAMPLE:{SECRET}@127.0.0.1:1"
    r = _dry_run(argv, env, tmp_path)
    assert r.returncode == 2 and "g4.endpoint_url (from KVBM_BACKEND__G4__ENDPOINT_URL)" in r.stderr, r.stderr
    assert "ftp://127.0.0.1:1" in r.stderr and SECRET not in r.stdout + r.stderr


def test_config_effective_error_redacts_the_endpoint(cfg):
    """``config effective``'s one error line quotes a refused endpoint without its credentials."""
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"config_file": str(cfg)}}
    r = _cli("config", "effective", "--for", "vllm", json.dumps(ktc),
             env_extra={"KVBM_BACKEND__G4__ENDPOINT_URL": f"ftp://AKIAEXAMPLE:{SECRET}@127.0.0.1:1"})
    assert r.returncode == 2 and "g4.endpoint_url (from KVBM_BACKEND__G4__ENDPOINT_URL)" in r.stderr, r.stderr
    assert "ftp://127.0.0.1:1" in r.stderr and SECRET not in r.stdout + r.stderr
