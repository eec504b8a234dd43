"""``kvbm-backend config effective`` through the real entry point (``python -m kvbm_backend.apps.cli config
effective`` in a subprocess):

* from a working directory that was removed under the process (a relative ``g3.paths`` entry then names no
  directory): one ``kvbm-backend: error: g3.paths[0]: ...`` line saying so, exit 2. Before 2026-12-03
  :func:`kvbm_backend.config.dir_problem` let ``os.getcwd()``'s bare ``FileNotFoundError`` out of ``os.path.abspath``
  (a traceback naming neither the field nor the cause, exit 1), in the dry run's preflight too;
* the summary line shows only the sections the config's users open, as its directory checks do
  (:func:`kvbm_backend.apps.effective._skip_dirs`): before 2026-12-03 a G4Tier-only transfer config's line said
  ``g3.enabled=true [default] g3.paths=./kvbm-g3 [default] g3.capacity_gb=10 [default]``, a G3 nothing opens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HANG_S = 600.0  # a hang guard, not a bound (the unit lane runs at nice 19)
MOD = "kvbm_backend.integrations.vllm.tiering"


def _cli(*args: str, removed_cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m kvbm_backend.apps.cli config effective ARGS``; with ``removed_cwd`` the process starts in that
    directory and removes it before exec (``sh``: ``cd DIR && rmdir DIR && exec python ...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    # no empty entry: it names the working directory, which Python cannot make absolute once removed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "kvbm_backend.apps.cli", "config", "effective", *args]
    if removed_cwd is not None:
        removed_cwd.mkdir()
        argv = ["sh", "-c", 'cd "$0" && rmdir "$0" && exec "$@"', str(removed_cwd), *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S, cwd=str(REPO), env=env)


def _connector(kvbm_backend: dict) -> str:
    return json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
                       "kv_connector_extra_config": {"kvbm_backend": kvbm_backend}})


def _tiering(*tiers: dict) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                                     "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
                                                     "cpu_bytes_to_use": 1 << 30, "secondary_tiers": list(tiers)}})


def _one_error(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [x for x in r.stderr.splitlines() if x.startswith("kvbm-backend: error: ")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_a_relative_g3_path_in_a_removed_working_directory_is_a_field_error(tmp_path):
    """Before: exit 1, ``FileNotFoundError: [Errno 2] No such file or directory`` (os.getcwd in abspath)."""
    r = _cli("--for", "vllm", _connector({"g3": {"paths": ["kvbm-g3"]}}), removed_cwd=tmp_path / "gone")
    line = _one_error(r)
    assert line.startswith("kvbm-backend: error: g3.paths[0]: "), line
    assert "working directory has been removed" in line and "give an absolute path" in line, line
    assert "'kvbm-g3'" in line, line
    assert not (tmp_path / "gone").exists()


def test_an_absolute_g3_path_in_a_removed_working_directory_still_works(tmp_path):
    """Only a relative path needs the working directory: an absolute one is judged as before."""
    r = _cli("--for", "vllm", _connector({"g3": {"paths": [str(tmp_path / "g3")]}}), removed_cwd=tmp_path / "gone")
    assert r.returncode == 0, r.stderr
    assert f"g3.paths={tmp_path / 'g3'} [script]" in r.stderr, r.stderr


def test_the_dry_run_preflight_names_the_default_g3_path_in_a_removed_working_directory(tmp_path):
    """The launchers' preflight judges the default ``./kvbm-g3``; before: a traceback there too."""
    ktc = _connector({})
    r = _cli("--dry-run", "vllm", "serve", "m", "--kv-transfer-config", ktc, removed_cwd=tmp_path / "gone")
    line = _one_error(r)
    assert "g3.paths[0]: " in line and "working directory has been removed" in line, line
    assert "the default" in line, line


def _fields(r: subprocess.CompletedProcess) -> list[str]:
    """The field names of the one summary line (``g3.paths=... [default]`` -> ``g3.paths``)."""
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("kvbm-backend effective (")]
    assert len(lines) == 1, r.stderr
    return [w.partition("=")[0] for w in lines[0].partition("): ")[2].split() if "=" in w]


def test_a_g4_tier_only_summary_shows_no_g3_field(tmp_path):
    """Before: ``g3.enabled``, ``g3.paths`` and ``g3.capacity_gb`` (defaults of a G3 nothing opens) led the line."""
    tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": 2,
            "g4": {"enabled": True, "url": f"file://{tmp_path / 'store'}", "encrypt": False}}
    fields = _fields(_cli("--for", "vllm", _tiering(tier)))
    assert [f for f in fields if f.startswith("g3.")] == [], fields
    assert {"g4.enabled", "g4.url", "g4.encrypt"} <= set(fields), fields


def test_a_g3_tier_only_summary_shows_no_g4_pool_field_but_its_keyring(tmp_path):
    """A G3Tier opens no G4 pool; it follows the keyring ``g4.keyring.path`` names (tier_revoked), shown when set."""
    tier = {"type": "G3Tier", "module_path": MOD, "num_kv_heads": 2, "g3": {"paths": [str(tmp_path / "g3")]}}
    fields = _fields(_cli("--for", "vllm", _tiering(tier)))
    assert [f for f in fields if f.startswith("g4.")] == [] and "g3.paths" in fields, fields
    tier["g4"] = {"keyring": {"path": str(tmp_path / "kr" / "keyring.json")}}
    fields = _fields(_cli("--for", "vllm", _tiering(tier)))
    assert [f for f in fields if f.startswith("g4.")] == ["g4.keyring.path"], fields


def test_sections_both_users_open_are_shown_as_before(tmp_path):
    """A config both tiers share, and the connector's: both sections (G4's pool fields only when it is on)."""
    cfg = tmp_path / "kvbm.yaml"
    cfg.write_text(f"g3:\n  paths: [{tmp_path / 'g3'}]\ng4:\n  enabled: true\n  url: file://{tmp_path / 'store'}\n"
                   "  encrypt: false\n")
    both = [{"type": t, "module_path": MOD, "num_kv_heads": 2, "config": str(cfg)} for t in ("G3Tier", "G4Tier")]
    fields = _fields(_cli("--for", "vllm", _tiering(*both)))
    assert {"g3.enabled", "g3.paths", "g3.capacity_gb", "g4.enabled", "g4.url"} <= set(fields), fields
    fields = _fields(_cli("--for", "vllm", _connector({"g3": {"enabled": False}})))
    assert fields == ["g3.enabled", "g4.enabled"], fields
