"""Follow-ups to the removed-working-directory fix (1530061), each through a real subprocess:

* ``kvbm-backend config effective`` (not the dry run) judges the DEFAULT ``g3.paths`` (``./kvbm-g3``) when a user of
  the config opens G3 (the connector, a G3Tier), with the message the dry run's preflight and the engine give
  (:func:`kvbm_backend.integrations.vllm.extra_config.check_default_g3_paths`). Before 2026-12-03 it exited 0 from a
  working directory where ``./kvbm-g3`` cannot be made (read-only: :mod:`tests.helpers.ro_cwd`; removed), while the
  dry run and the engine refused it;
* a relative ``g4.keyring.path`` while the working directory has been removed: ``config effective`` names the field
  (before: ``g4.kek=[new file ...]``, exit 0) and the launcher's preflight (``python -m
  kvbm_backend.integrations.vllm.cli serve``, which opens the keyring as the engine does) names the path and the
  cause (before: ``g4.keyring: [Errno 2] No such file or directory``, from ``os.getcwd()`` inside
  :func:`kvbm_backend.fsmodes.makedirs_private`);
* doctor's path report (:func:`kvbm_backend.apps.doctor_paths.path_info`, "never raises") on a relative path there
  (before: the FileNotFoundError traceback)."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.apps.test_effective_cwd_and_sections import MOD, _connector, _one_error, _tiering
from tests.helpers import ro_cwd as _ro_cwd

ro_cwd = _ro_cwd.ro_cwd  # the fixture: a working directory where ./kvbm-g3 cannot be created

REPO = Path(__file__).resolve().parents[2]
HANG_S = 600.0  # a hang guard, not a bound (the unit lane runs at nice 19)
REMOVED = "removed"


def _run(argv: list[str], cwd, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``argv`` in the working directory ``cwd``: a path, or ``(REMOVED, dir)``: the process starts in ``dir`` and
    removes it before exec (``sh``: ``cd DIR && rmdir DIR && exec ...``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    # no empty entry: it names the working directory, which Python cannot make absolute once removed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(env_extra or {})
    if isinstance(cwd, tuple):
        gone = cwd[1]
        gone.mkdir()
        argv = ["sh", "-c", 'cd "$0" && rmdir "$0" && exec "$@"', str(gone), *argv]
        cwd = REPO
    return subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S, cwd=str(cwd), env=env)


def _effective(ktc: str, cwd, *defaults: str) -> subprocess.CompletedProcess:
    args = [a for d in defaults for a in ("--default", d)]
    return _run([sys.executable, "-m", "kvbm_backend.apps.cli", "config", "effective", "--for", "vllm", ktc, *args],
                cwd)


def _assert_default_refused(line: str) -> None:
    assert line.startswith("kvbm-backend: error: g3.paths[0]: "), line
    assert "(got './kvbm-g3': the default, relative to the working directory" in line, line
    assert "set g3.paths, or DYN_KVBM_DISK_CACHE_DIR, to a directory this process can write" in line, line


def test_config_effective_refuses_the_default_g3_paths_in_a_read_only_working_directory(ro_cwd):
    """Before: exit 0 (``g3.paths=./kvbm-g3 [default]``); the dry run said ``g3.paths[0]: ...``."""
    line = _one_error(_effective(_connector({}), ro_cwd))
    _assert_default_refused(line)
    assert str(ro_cwd) in line, line
    assert not (ro_cwd / "kvbm-g3").is_dir()


def test_config_effective_refuses_the_default_g3_paths_in_a_removed_working_directory(tmp_path):
    """Before: exit 0. Now the line the dry run gives (test_effective_cwd_and_sections), without its prefix."""
    line = _one_error(_effective(_connector({}), (REMOVED, tmp_path / "gone")))
    _assert_default_refused(line)
    assert "working directory has been removed" in line and "give an absolute path" in line, line


def test_a_g3_tier_with_the_default_paths_is_refused_a_g4_tier_is_not(ro_cwd, tmp_path):
    """A G3Tier opens G3 at the default (inline ``g3`` settings without ``paths`` keep it the default); a G4Tier
    alone never opens G3 (test_effective_unused_section)."""
    g3 = {"type": "G3Tier", "module_path": MOD, "num_kv_heads": 2, "g3": {"capacity_gb": 1}}
    _assert_default_refused(_one_error(_effective(_tiering(g3), ro_cwd)))
    g4 = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": 2,
          "g4": {"enabled": True, "url": f"file://{tmp_path / 'store'}", "encrypt": False}}
    r = _effective(_tiering(g4), ro_cwd)
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr


def test_a_given_path_a_script_default_or_g3_off_passes_there(ro_cwd, tmp_path):
    """Only the default is judged here (a given path is judged at load, as before)."""
    given = str(tmp_path / "g3")
    for ktc, defaults in ((_connector({"g3": {"paths": [given]}}), ()),
                          (_connector({}), (f'g3.paths=["{given}"]',)),
                          (_connector({"g3": {"enabled": False}}), ())):
        r = _effective(ktc, ro_cwd, *defaults)
        assert r.returncode == 0, (ktc, defaults, r.stderr)
    assert not (ro_cwd / "kvbm-g3").is_dir()


def _g4_keyring(path: str, store: Path) -> str:
    return _connector({"g3": {"enabled": False},
                       "g4": {"enabled": True, "url": f"file://{store}", "encrypt": True,
                              "keyring": {"path": path}}})


def test_config_effective_names_a_relative_keyring_path_in_a_removed_working_directory(tmp_path):
    """Before: exit 0, ``g4.kek=[new file kr/keyring.json.kek]`` (the worker then failed opening it)."""
    line = _one_error(_effective(_g4_keyring("kr/keyring.json", tmp_path / "store"), (REMOVED, tmp_path / "gone")))
    assert line.startswith("kvbm-backend: error: g4.keyring.path: 'kr/keyring.json' is relative"), line
    assert "working directory has been removed" in line and "give an absolute path" in line, line


@pytest.mark.parametrize("kek", ["env", "file"])
def test_the_launcher_preflight_names_a_relative_keyring_in_a_removed_working_directory(tmp_path, kek):
    """The preflight opens the keyring as the engine does (create): the KEK file's directory (no ``$KVBM_BACKEND_KEK``)
    or the keyring's (with it) is made by :func:`kvbm_backend.fsmodes.makedirs_private`. Before: ``g4.keyring:
    [Errno 2] No such file or directory``, naming neither the path nor the cause. Since the dry run's agreement
    with ``config effective`` (tests/apps/test_cli_removed_cwd.py) the field is named first, as there."""
    env = {"KVBM_BACKEND_KEK": base64.b64encode(os.urandom(32)).decode()} if kek == "env" else {}
    r = _run([sys.executable, "-m", "kvbm_backend.integrations.vllm.cli", "serve", "m", "--kv-transfer-config",
              _g4_keyring("kr/keyring.json", tmp_path / "store")], (REMOVED, tmp_path / "gone"), env)
    line = _one_error(r)
    assert "g4.keyring.path: 'kr/keyring.json' is relative to the working directory" in line, line
    assert "working directory has been removed" in line and "[Errno" not in line, line


def test_doctor_path_report_of_a_relative_path_in_a_removed_working_directory(tmp_path):
    """path_info never raises: the relative path is a ``dir_problem`` saying why, and the G3 verdict is that line."""
    code = ("import json; from kvbm_backend.apps.doctor_paths import path_info, g3_path_problems; "
            "from kvbm_backend.config import G3Config; info = path_info('g3rel'); "
            "print(json.dumps([info, g3_path_problems(info, G3Config(), 1, configured=False)]))")
    r = _run([sys.executable, "-c", code], (REMOVED, tmp_path / "gone"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    info, problems = json.loads(r.stdout)
    assert info["exists"] is False and "working directory has been removed" in info["dir_problem"], info
    assert problems == [f"g3 path g3rel: {info['dir_problem']}"], problems
