"""A leading ``~`` in ``g4.keyring.path`` / ``g4.keyring.kek_file`` (and the key commands' ``--keyring`` /
``--kek-file``) is the home directory for every reader: ``doctor``, ``config effective``, the workers' keyring opener
(``Keyring.from_config``: the G4 pool, a G3Tier, the launchers' preflight) and ``keys``. Before 2026-12-03 doctor
expanded it and reported the keyring in ``$HOME`` OK, while a worker opened ``./~/kr/k.json`` under its working
directory: a new keyring and KEK of its own, silently (its G4 blocks unreadable by the rest of the fleet);
``config effective`` said ``g4.kek=[new file ~/kr/k.json.kek]`` and ``keys create --keyring=~/...`` (no shell
expanding it) made ``./~/...`` too. Real processes, a real ``$HOME`` (the test's), a real ``file://`` store."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.apps.test_doctor_g4 import HANG_S, REPO

KEYRING = "~/kr/k.json"


def _env(home: Path, kek: str | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["HOME"], e["COLUMNS"] = str(home), "200"
    if kek is not None:
        e["KVBM_BACKEND_KEK"] = kek
    return e


def _run(argv: list[str], home: Path, cwd: Path, kek: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S, cwd=str(cwd), env=_env(home, kek))


def _cli(home: Path, cwd: Path, *args: str, kek: str | None = None) -> subprocess.CompletedProcess:
    """``kvbm-backend ARGS`` with ``$HOME`` = ``home``, in ``cwd``."""
    return _run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], home, cwd, kek)


@pytest.fixture
def where(tmp_path):
    """(home, cwd, store URL): a private home directory, an empty working directory, a G4 file store."""
    home, cwd, store = tmp_path / "home", tmp_path / "cwd", tmp_path / "store"
    for d in (home, cwd, store):
        d.mkdir(mode=0o700)
    return home, cwd, f"file://{store}"


def _g4(url: str, kek_file: str | None) -> dict:
    kr = {"path": KEYRING, **({"kek_file": kek_file} if kek_file else {})}
    return {"g3": {"enabled": False}, "g4": {"enabled": True, "url": url, "encrypt": True, "keyring": kr}}


def _connector(cfg: dict) -> str:
    return json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
                       "kv_connector_extra_config": {"kvbm_backend": cfg}})


WORKER = """
import json, sys
from kvbm_backend.config import load_config
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace
pool = G4Pool(load_config(json.loads(sys.argv[1]), use_env=False).g4, namespace())  # as the connector opens G4
print(json.dumps({"path": str(pool.keyring.path), "tenants": [r["tenant"] for r in pool.keyring.info()]}))
pool.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kek_file", [None, "~/kek/k.kek"])
def test_doctor_config_effective_and_the_workers_open_one_tilde_keyring(where, kek_file):
    """One keyring (tenant ``t``) in ``$HOME``, named ``~/kr/k.json`` (and its KEK file ``~/kek/k.kek``) in the config:
    doctor's OK names it, the G4 pool opens it (tenant ``t``), ``config effective`` names its KEK file, and with a
    wrong ``$KVBM_BACKEND_KEK`` doctor and the vLLM launcher's preflight refuse that same file. Nothing is made under
    the working directory. Before: the pool opened a new keyring ``./~/kr/k.json`` (no tenants) and the launcher's
    preflight passed (it made that keyring), ``config effective`` said ``new file ~/kr/k.json.kek``, and with
    ``kek_file`` doctor looked for the KEK file under ``./~/kek`` (``problem: g4 keyring``)."""
    home, cwd, url = where
    kr, kf = home / "kr" / "k.json", home / "kek" / "k.kek" if kek_file else home / "kr" / "k.json.kek"
    made = _cli(home, cwd, "keys", "create", "--keyring", str(kr), "--tenant", "t",
                *(["--kek-file", str(kf)] if kek_file else []))  # absolute, as a shell expands ~
    assert made.returncode == 0 and kr.is_file() and kf.is_file(), made.stderr
    cfg = _g4(url, kek_file)

    doc = _cli(home, cwd, "doctor", "--config", json.dumps(cfg), "--json")
    assert doc.returncode == 0, doc.stdout[-3000:] + doc.stderr[-2000:]
    row = {c["check"]: c for c in json.loads(doc.stdout)["g4"]["checks"]}["keyring"]
    assert row["ok"] and row["detail"].startswith(f"{kr}: loads") and f"from KEK file {kf}" in row["detail"], row
    assert "(1 tenants" in row["detail"], row

    worker = _run([sys.executable, "-c", WORKER, json.dumps(cfg)], home, cwd)
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert json.loads(worker.stdout.strip().splitlines()[-1]) == {"path": str(kr), "tenants": ["t"]}

    eff = _cli(home, cwd, "config", "effective", "--for", "vllm", _connector(cfg))
    assert eff.returncode == 0, eff.stderr[-2000:]
    assert f"g4.kek=[file {kf}]" in eff.stderr, eff.stderr

    wrong = base64.b64encode(os.urandom(32)).decode()
    doc = _cli(home, cwd, "doctor", "--config", json.dumps(cfg), kek=wrong)
    probs = [x for x in doc.stdout.splitlines() if x.startswith("problem: ")]
    assert doc.returncode == 1 and len(probs) == 1, doc.stdout[-3000:] + doc.stderr[-2000:]
    assert probs[0].startswith(f"problem: g4 keyring: keyring {kr}: wrapped under KEK"), probs
    launch = _run([sys.executable, "-m", "kvbm_backend.integrations.vllm.cli", "serve", str(cwd / "no-model"),
                   "--kv-transfer-config", _connector(cfg)], home, cwd, wrong)
    err = [x for x in launch.stderr.splitlines() if x.startswith("kvbm-backend: error: ")]
    assert launch.returncode == 2 and len(err) == 1, launch.stderr[-3000:]
    assert f"g4.keyring: keyring {kr}: wrapped under KEK" in err[0], err
    dry = _cli(home, cwd, "config", "effective", "--dry-run", "vllm", "serve", "m", "--kv-transfer-config",
               _connector(cfg), kek=wrong)  # the scripts' dry run: its preflight reads the same file (before: passed)
    err = [x for x in dry.stderr.splitlines() if x.startswith("kvbm-backend: error: ")]
    assert dry.returncode == 2 and len(err) == 1, dry.stdout[-2000:] + dry.stderr[-3000:]
    assert f"keyring {kr}: wrapped under KEK" in err[0], err
    assert list(cwd.iterdir()) == []  # no ./~ keyring, KEK or lock file


def test_key_commands_expand_a_tilde_no_shell_expanded(where):
    """``--keyring=~/kr/k.json`` (the shell leaves a ``~`` after ``=`` as it is; so does a Kubernetes ``command``):
    ``keys create`` makes the keyring in ``$HOME``, ``keys list`` reads it there, ``--kek-file`` likewise. Before:
    ``./~/kr/k.json`` under the working directory."""
    home, cwd, _ = where
    r = _cli(home, cwd, "keys", "create", f"--keyring={KEYRING}", "--kek-file=~/kek/k.kek", "--tenant", "t", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["keyring"] == str(home / "kr" / "k.json"), r.stdout
    assert (home / "kr" / "k.json").is_file() and (home / "kek" / "k.kek").is_file()
    r = _cli(home, cwd, "keys", "list", f"--keyring={KEYRING}", "--kek-file=~/kek/k.kek", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [row["tenant"] for row in json.loads(r.stdout)] == ["t"], r.stdout
    assert list(cwd.iterdir()) == []
