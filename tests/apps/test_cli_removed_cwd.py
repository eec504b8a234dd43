"""``kvbm-backend`` commands in a working directory that has been removed, each through a real subprocess (the process
starts in a new directory and removes it before exec: :func:`tests.apps.test_effective_default_g3_and_removed_cwd._run`).

Follow-ups to 1530061 / 4c55e7a (``config effective``), for the other commands of docs/cli.md:

* a relative path an option names (``keys ... --keyring``, ``--kek-file``, ``--new-kek-file``, ``gc`` / ``g4 migrate
  --keyring``, ``plan --out``, ``plot FILES``, ``replay --trace``, ``doctor --config``) is one ``error: OPTION: 'PATH'
  is relative to the working directory, and this process's working directory has been removed ...`` line, exit 2,
  nothing created (before 2026-12-03: ``keys: [Errno 2] No such file or directory``, "not found", "no KEK", or a
  FileNotFoundError traceback);
* the dry run's preflight refuses a relative ``g4.keyring.path`` / ``kek_file`` there naming the field, as ``config
  effective`` does (before: the dry run passed it, exit 0);
* ``model tiny DIR`` names ``DIR`` the same way (before: the CLI's catch-all naming the command only);
* commands that import torch or vLLM (``doctor``, ``model``, ``bench --tier index``, the launcher's preflight of an
  abbreviated option) run there instead of ending with ``Intel oneMKL FATAL ERROR`` (torch's oneMKL calls
  ``getcwd()`` as it loads; exit 2, no report) or a FileNotFoundError from ``torch._dynamo.config``;
* ``doctor`` reports (exit 1, ``problem:`` lines) instead of aborting: the default ``./kvbm-g3`` and a relative
  keyring are problems naming the path and the cause.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.apps.test_effective_cwd_and_sections import _connector, _one_error, _tiering
from tests.apps.test_effective_default_g3_and_removed_cwd import MOD, REMOVED, _run

REL = "kr/k.json"
GONE = "working directory has been removed"


def _cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m kvbm_backend.apps.cli ARGS`` in a removed working directory."""
    return _run([sys.executable, "-m", "kvbm_backend.apps.cli", *args], (REMOVED, tmp_path / "gone"), env)


def _error(r: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a refused command (exit 2, no traceback, no oneMKL abort)."""
    assert "Traceback" not in r.stderr and "FATAL" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def _assert_names(line: str, option: str, path: str) -> None:
    assert line.startswith(f"error: {option}: '{path}' is relative to the working directory"), line
    assert GONE in line and "give an absolute path" in line and "[Errno" not in line, line


KEYS = {  # argv after the command name, the option named, the relative path; ABS: an absolute directory
    "create": (["keys", "create", "--keyring", REL, "--tenant", "t"], "--keyring", REL),
    "list": (["keys", "list", "--keyring", REL], "--keyring", REL),
    "rotate": (["keys", "rotate", "--keyring", REL], "--keyring", REL),
    "revoke": (["keys", "revoke", "--keyring", REL, "--tenant", "t"], "--keyring", REL),
    "destroy": (["keys", "destroy", "--keyring", REL, "--yes"], "--keyring", REL),
    "create-kek-file": (["keys", "create", "--keyring", "ABS/k.json", "--kek-file", "k.kek", "--tenant", "t"],
                        "--kek-file", "k.kek"),
    "rewrap": (["keys", "rewrap", "--keyring", "ABS/k.json", "--new-kek-file", "new.kek"], "--new-kek-file",
               "new.kek"),
    "gc": (["gc", "--url", "file://STORE", "--keyring", REL, "--dry-run"], "--keyring", REL),
    "migrate": (["g4", "migrate", "--url", "file://STORE", "--keyring", REL, "--dry-run"], "--keyring", REL),
}


@pytest.mark.parametrize("case", sorted(KEYS))
def test_key_commands_name_a_relative_path_in_a_removed_working_directory(tmp_path, case):
    """Before: ``error: keys: [Errno 2] No such file or directory`` (create, destroy, rewrap), ``keyring kr/k.json:
    not found`` (list, rotate, revoke), ``no KEK`` (gc, migrate). Nothing is created beside an absolute keyring."""
    argv, option, path = KEYS[case]
    absdir, store = tmp_path / "abs", tmp_path / "store"
    store.mkdir(mode=0o700)
    if case == "rewrap":  # an existing keyring: only --new-kek-file is relative
        kek = {"KVBM_BACKEND_KEK": base64.b64encode(os.urandom(32)).decode()}
        r = _run([sys.executable, "-m", "kvbm_backend.apps.cli", "keys", "create", "--keyring",
                  str(absdir / "k.json"), "--tenant", "t"], tmp_path, kek)
        assert r.returncode == 0, r.stderr
    else:
        kek = {}
    before = sorted(p.name for p in absdir.iterdir()) if absdir.is_dir() else None
    argv = [a.replace("ABS", str(absdir)).replace("STORE", str(store)) for a in argv]
    _assert_names(_error(_cli(tmp_path, *argv, env=kek)), option, path)
    assert (sorted(p.name for p in absdir.iterdir()) if absdir.is_dir() else None) == before


def test_destroy_keyring_of_a_relative_path_in_a_removed_working_directory(tmp_path):
    """keyring_publish.destroy_keyring: a KeyringError naming the path (before: a bare FileNotFoundError from
    ``Path.absolute()``)."""
    code = ("from kvbm_backend.crypto.keyring_publish import destroy_keyring\n"
            "from kvbm_backend.crypto.kek import KeyringError\n"
            f"try:\n    destroy_keyring({REL!r})\nexcept KeyringError as e:\n    print('KeyringError', e)\n")
    r = _run([sys.executable, "-c", code], (REMOVED, tmp_path / "gone"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith(f"KeyringError keyring: '{REL}' is relative to the working directory"), r.stdout
    assert GONE in r.stdout and "nothing deleted" in r.stdout, r.stdout


PLAN = ["plan", "--synthetic", "--layout", "tiny", "--g3-capacity-gb", "1"]
FILES = {  # argv (GOOD: an existing bench JSON, TMP: the test's directory), the option named, the relative path
    "plan --out": ([*PLAN, "--out", "rel.json"], "--out", "rel.json"),
    "plan --plot": ([*PLAN, "--plot", "rel.png"], "--plot", "rel.png"),
    "plot FILES": (["plot", "rel.json", "--out", "TMP/p.png"], "FILES", "rel.json"),
    "plot --out": (["plot", "GOOD", "--out", "rel.png"], "--out", "rel.png"),
    "replay --trace": (["replay", "--trace", "rel.jsonl", "--layout", "tiny", "--g3-capacity-gb", "1", "--simulate"],
                       "--trace", "rel.jsonl"),
    "plan --trace": (["plan", "--trace", "rel.jsonl", "--layout", "tiny", "--g3-capacity-gb", "1"], "--trace",
                     "rel.jsonl"),
    "doctor --config": (["doctor", "--config", "rel.yaml"], "--config", "rel.yaml"),
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_file_options_name_a_relative_path_in_a_removed_working_directory(tmp_path, case):
    """Before: a FileNotFoundError traceback (plan --out/--plot, plot --out: ``Path.absolute()``), or ``no file`` /
    ``not found`` / ``No such file`` with no word of the working directory."""
    good = tmp_path / "bench.json"
    good.write_text(json.dumps({"write_gbps": 1.0}))
    argv, option, path = FILES[case]
    argv = [a.replace("GOOD", str(good)).replace("TMP", str(tmp_path)) for a in argv]
    _assert_names(_error(_cli(tmp_path, *argv)), option, path)


def test_model_names_a_relative_dir_in_a_removed_working_directory(tmp_path):
    """``model tiny DIR`` with a relative DIR: one line naming the argument, as the options above (before 2026-12-03
    only the CLI's catch-all, ``error: model: this process's working directory has been removed ...``, naming the
    command and not the argument; before that a FileNotFoundError traceback from ``Path.absolute()``)."""
    _assert_names(_error(_cli(tmp_path, "model", "tiny", "reldir")), "DIR", "reldir")


@pytest.mark.slow
def test_commands_importing_torch_run_in_a_removed_working_directory(tmp_path):
    """``model tiny`` at an absolute DIR imports torch (safetensors of a torch model): before, torch's oneMKL ended
    the process (``Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so``, exit 2, nothing written)."""
    out = tmp_path / "m"
    r = _cli(tmp_path, "model", "tiny", str(out))
    assert r.returncode == 0 and "FATAL" not in r.stderr, r.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


@pytest.mark.slow
def test_a_command_importing_vllm_runs_in_a_removed_working_directory(tmp_path):
    """``bench --tier index`` imports vLLM (the G3 mirror): before, ``torch._dynamo.config``'s ``os.getcwd()`` made
    it ``error: bench --tier index: [Errno 2] No such file or directory`` (and torch's oneMKL before that)."""
    r = _cli(tmp_path, "bench", "--tier", "index", "--blocks", "2000", "--json")
    assert r.returncode == 0 and "FATAL" not in r.stderr, r.stderr[-2000:]
    assert json.loads(r.stdout)["tier"] == "index"


@pytest.mark.slow
def test_doctor_reports_in_a_removed_working_directory(tmp_path):
    """Before: ``Intel oneMKL FATAL ERROR`` (gpu_info's ``import torch``), exit 2, no report; with torch fixed, a
    FileNotFoundError traceback from modes_info. Now the report: torch found, the default ``./kvbm-g3`` one problem
    naming the cause, exit 1."""
    r = _cli(tmp_path, "doctor", "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "FATAL" not in r.stderr, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["gpu"]["torch"], res["gpu"]
    assert len(res["problems"]) == 1 and res["problems"][0].startswith("g3 path ./kvbm-g3: "), res["problems"]
    assert GONE in res["problems"][0], res["problems"]


@pytest.mark.slow
@pytest.mark.parametrize("field", ["path", "kek_file"])
def test_doctor_names_a_relative_keyring_in_a_removed_working_directory(tmp_path, field):
    """The G4 keyring check names the field (before: a FileNotFoundError traceback from ``os.path.abspath``)."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    kr = {"path": REL} if field == "path" else {"path": str(tmp_path / "kr" / "k.json"), "kek_file": "k.kek"}
    cfg = json.dumps({"g3": {"paths": [str(tmp_path / "g3")]},
                      "g4": {"enabled": True, "url": f"file://{store}", "encrypt": True, "keyring": kr}})
    r = _cli(tmp_path, "doctor", "--config", cfg)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "FATAL" not in r.stderr, r.stderr[-2000:]
    problems = [x for x in r.stdout.splitlines() if x.startswith("problem: ")]
    rel = REL if field == "path" else "k.kek"
    assert problems == [p for p in problems if p.startswith(f"problem: g4 keyring: g4.keyring.{field}: '{rel}' is "
                                                            "relative to the working directory")], r.stdout
    assert len(problems) == 1 and GONE in problems[0], r.stdout


def _g4(keyring: dict, store: Path) -> dict:
    return {"enabled": True, "url": f"file://{store}", "encrypt": True, "keyring": keyring}


@pytest.mark.parametrize("form", ["connector", "g4tier-kek-file"])
def test_dry_run_and_config_effective_agree_on_a_relative_keyring(tmp_path, form):
    """Both refuse naming the field (before: the dry run's preflight passed it, exit 0, while ``config effective``
    refused it)."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    if form == "connector":
        ktc, field, rel = _connector({"g3": {"enabled": False}, "g4": _g4({"path": REL}, store)}), "path", REL
    else:
        tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": 2,
                "g4": _g4({"path": str(tmp_path / "kr" / "k.json"), "kek_file": "k.kek"}, store)}
        ktc, field, rel = _tiering(tier), "kek_file", "k.kek"
    want = f"g4.keyring.{field}: '{rel}' is relative to the working directory"
    eff = _one_error(_cli(tmp_path, "config", "effective", "--for", "vllm", ktc))
    dry = _one_error(_cli(tmp_path, "config", "effective", "--dry-run", "vllm", "serve", "m",
                          "--kv-transfer-config", ktc))
    assert eff.startswith(f"kvbm-backend: error: {want}"), eff
    assert want in dry and GONE in dry, dry
    assert not (tmp_path / "kr").exists()


@pytest.mark.slow
def test_the_launcher_preflight_reads_an_abbreviated_option_in_a_removed_working_directory(tmp_path):
    """An abbreviated ``--kv-transfer-conf`` is resolved by vLLM's parser (preflight._vllm_values imports vLLM):
    before, torch's oneMKL ended the process there (``Intel oneMKL FATAL ERROR``); now the keyring is judged."""
    ktc = _connector({"g3": {"enabled": False}, "g4": _g4({"path": REL}, tmp_path / "store")})
    r = _run([sys.executable, "-m", "kvbm_backend.integrations.vllm.cli", "serve", "m", "--kv-transfer-conf", ktc],
             (REMOVED, tmp_path / "gone"))
    line = _one_error(r)
    assert f"g4.keyring.path: '{REL}' is relative to the working directory" in line and GONE in line, line


def test_guard_native_imports_does_nothing_in_an_existing_working_directory():
    from kvbm_backend.workdir import guard_native_imports
    before = list(sys.meta_path)
    guard_native_imports()
    assert sys.meta_path == before


REL_CFG = "rel.yaml"
CONFIG_FILE = {  # how a relative kvbm-backend config file reaches load_config: argv after python, the prefix named
    "launcher connector config_file": (["-m", "kvbm_backend.integrations.vllm.cli", "serve", "m", "--kv-transfer-config",
                                        "CONN"], "kv_connector_extra_config.config_file: "),
    "dry run connector config_file": (["-m", "kvbm_backend.apps.cli", "config", "effective", "--dry-run", "vllm", "serve",
                                       "m", "--kv-transfer-config", "CONN"], "kv_connector_extra_config.config_file: "),
    "launcher G3Tier config": (["-m", "kvbm_backend.integrations.vllm.cli", "serve", "m", "--kv-transfer-config",
                                "TIER"], "kv_connector_extra_config: secondary_tiers G3Tier: "),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FILE))
def test_a_relative_config_file_in_a_removed_working_directory_says_why(tmp_path, case):
    """``load_config`` of a relative file there (kvbm_backend.config_sources.config_file): the field that named it,
    then ``config file: 'rel.yaml' is relative to the working directory ... has been removed`` (before 2026-12-03
    ``config file rel.yaml: not found``: the operator looks for a file that is there)."""
    argv, prefix = CONFIG_FILE[case]
    conn = json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
                       "kv_connector_extra_config": {"config_file": REL_CFG}})
    tier = _tiering({"type": "G3Tier", "module_path": MOD, "num_kv_heads": 2, "config": REL_CFG})
    argv = [{"CONN": conn, "TIER": tier}.get(a, a) for a in argv]
    r = _run([sys.executable, *argv], (REMOVED, tmp_path / "gone"))
    line = _one_error(r)
    assert "FATAL" not in r.stderr, r.stderr[-2000:]
    want = f"{prefix}config file: '{REL_CFG}' is relative to the working directory"
    assert line.startswith(f"kvbm-backend: error: {want}"), line
    assert GONE in line and "give an absolute path" in line and "not found" not in line, line


def test_load_config_of_a_relative_file_in_a_removed_working_directory(tmp_path):
    """The library call, whatever the caller: a ConfigError saying why (before: ``config file rel.yaml: not
    found``); an absolute file there still loads."""
    good = tmp_path / "good.yaml"
    good.write_text(f"g3:\n  paths: [{tmp_path / 'g3'}]\n  capacity_gb: 1\n")
    code = ("from kvbm_backend.config import ConfigError, load_config\n"
            f"print(load_config({str(good)!r}, use_env=False).g3.capacity_gb)\n"
            f"try:\n    load_config({REL_CFG!r})\nexcept ConfigError as e:\n    print('ConfigError', e)\n")
    r = _run([sys.executable, "-c", code], (REMOVED, tmp_path / "gone"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    loaded, err = r.stdout.splitlines()
    assert float(loaded) == 1.0, r.stdout
    assert err.startswith(f"ConfigError config file: '{REL_CFG}' is relative to the working directory"), err
    assert GONE in err, err


def test_the_vllm_launcher_refuses_to_start_vllm_in_a_removed_working_directory(tmp_path):
    """``python -m kvbm_backend.integrations.vllm.cli serve`` with absolute paths only: the preflight has nothing to
    refuse, and vLLM cannot start there (torch's oneMKL calls ``getcwd()`` as it loads; the engine's processes
    inherit the directory). One line naming the directory, exit 2, and the preflight runs as a dry run: the keyring
    it would make for the engine is not made. Before 2026-12-03 the preflight made the keyring, then vLLM ended with
    ``Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so`` (exit 2, no ``error:`` line)."""
    store, kr = tmp_path / "store", tmp_path / "kr" / "k.json"
    store.mkdir(mode=0o700)
    ktc = _connector({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 1},
                      "g4": _g4({"path": str(kr)}, store)})
    kek = {"KVBM_BACKEND_KEK": base64.b64encode(os.urandom(32)).decode()}
    gone = tmp_path / "gone"
    r = _run([sys.executable, "-m", "kvbm_backend.integrations.vllm.cli", "serve", str(tmp_path / "model"),
              "--kv-transfer-config", ktc], (REMOVED, gone), kek)
    line = _one_error(r)
    assert "FATAL" not in r.stderr, r.stderr[-2000:]
    assert line == (f"kvbm-backend: error: the working directory {gone} has been removed; vLLM cannot start there: "
                    "cd to a directory that exists"), line
    assert not kr.exists() and not (tmp_path / "kr").exists()


def test_the_dynamo_worker_refuses_to_start_in_a_removed_working_directory(tmp_path):
    """``python -m kvbm_backend.integrations.dynamo.vllm_worker`` imports torch at start (its compat shims): in a
    removed working directory one line naming the directory, exit 2, before that import. Before 2026-12-03 it ended
    with ``Intel oneMKL FATAL ERROR`` (exit 2, no ``error:`` line)."""
    gone = tmp_path / "gone"
    r = _run([sys.executable, "-m", "kvbm_backend.integrations.dynamo.vllm_worker", "--model", str(tmp_path / "m")],
             (REMOVED, gone), {})
    line = _one_error(r)
    assert "FATAL" not in r.stderr, r.stderr[-2000:]
    assert line == (f"kvbm-backend: error: the working directory {gone} has been removed; vLLM cannot start there: "
                    "cd to a directory that exists"), line


def test_config_effective_says_why_a_relative_config_file_is_not_read_in_a_removed_working_directory(tmp_path):
    """``config effective --for vllm`` of a connector's relative ``config_file`` in a removed working directory names
    the cause, not "not found" (before 2026-12-03: ``config file rel.yaml: not found (set KVBM_BACKEND_CONFIG_FILE
    ...)``)."""
    conn = json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                       "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
                       "kv_connector_extra_config": {"config_file": REL_CFG}})
    line = _one_error(_cli(tmp_path, "config", "effective", "--for", "vllm", conn))
    assert f"config file: '{REL_CFG}' is relative to the working directory" in line, line
    assert "has been removed" in line and "not found" not in line, line
