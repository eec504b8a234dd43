"""Issue 22 item 1: the example launch scripts never override the operator's config without saying so.

Every script that hands vLLM a kvbm-backend config runs here as written, with ``KVBM_BACKEND_DRY_RUN=1``: the
script does everything up to its ``exec`` (``ktc``, ``kvbm_backend.apps.effective``, its exports), then execs
``python -m kvbm_backend.apps.effective --dry-run`` instead of the engine, which prints the command and the
kvbm-backend environment and runs the launchers' preflight (keyring and KEK opened as the pool opens them).
From that we rebuild the config exactly as the engine's pools would load it and check it is the user's.
A real engine runs each kind of script in tests/e2e/test_example_scripts.py (Dynamo) and
tests/e2e/test_vllm_serve.py (``vllm serve``).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvbm_backend.config import load_config

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

REPO = Path(__file__).resolve().parents[2]
EX = REPO / "examples"
SCRIPTS = ["dynamo/agg_kvbm_backend.sh", "dynamo/agg_kvbm_multi.sh", "dynamo/disagg_prefill.sh",
           "dynamo/disagg_decode.sh", "dynamo/disagg_prefill_g4.sh", "dynamo/disagg_decode_g4.sh",
           "dynamo/agg_native_tiers.sh", "dynamo/disagg_native_prefill.sh", "dynamo/disagg_native_decode.sh",
           "vllm/serve_kvbm_backend.sh", "vllm/serve_tiering.sh"]
NATIVE = ("dynamo/agg_native_tiers.sh", "dynamo/disagg_native_prefill.sh", "dynamo/disagg_native_decode.sh")
# every script but serve_kvbm_backend.sh (inline settings, which KVBM_BACKEND_CONFIG_FILE replaces whole): what
# examples/README.md promises. Before 2026-11-30 agg_kvbm_multi.sh and the NIXL pair had none (G3 in ./kvbm-g3 of
# the working directory when the YAML named no path), while their headers and the README said they had.
WITH_G3_DEFAULT = {"dynamo/agg_kvbm_backend.sh": ["/mnt/nvme0/kvbm"], "dynamo/disagg_prefill_g4.sh": ["/mnt/nvme0/kvbm"],
                   "dynamo/disagg_decode_g4.sh": ["/mnt/nvme0/kvbm"], "dynamo/agg_kvbm_multi.sh": ["/mnt/nvme0/kvbm"],
                   "dynamo/disagg_prefill.sh": ["/mnt/nvme0/kvbm"], "dynamo/disagg_decode.sh": ["/mnt/nvme0/kvbm"],
                   **{n: ["/mnt/nvme0/kvbm"] for n in NATIVE},
                   "vllm/serve_tiering.sh": ["/mnt/nvme0/kvbm", "/mnt/nvme1/kvbm"]}
G4_HANDOFF = ("dynamo/disagg_prefill_g4.sh", "dynamo/disagg_decode_g4.sh")
CLEAR = ("DYN_KVBM_DISK_CACHE_DIR", "DYN_KVBM_DISK_CACHE_GB", "KVBM_BACKEND_KEK", "KVBM_BACKEND_CPU_BYTES",
         "KVBM_BACKEND_NUM_KV_HEADS",
         "KVBM_BACKEND_STATS_PATH", "KVBM_BACKEND_HANDOFF_WAIT_S", "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER")


def test_every_script_with_our_config_is_covered():
    ours = {p.relative_to(EX).as_posix() for p in EX.rglob("*.sh")
            if "kv_connector_module_path\": \"kvbm_backend" in p.read_text() or "kvbm_backend.integrations.vllm.tiering"
            in p.read_text()}
    assert ours == set(SCRIPTS)
    assert set(SCRIPTS) - set(WITH_G3_DEFAULT) == {"vllm/serve_kvbm_backend.sh"}  # examples/README.md says which


@pytest.fixture
def user(tmp_path):
    """A user's YAML: G3 in a temp dir (0.3 GB), G4 file:// encrypted, keyring with its own KEK file (no env KEK)."""
    from kvbm_backend.config import KeyringConfig
    from kvbm_backend.crypto.keyring import Keyring
    kr = tmp_path / "keys" / "keyring.json"
    Keyring.from_config(KeyringConfig(path=str(kr))).close()  # writes keyring.json + keyring.json.kek (0600)
    assert (tmp_path / "keys" / "keyring.json.kek").is_file()
    y = tmp_path / "user.yaml"
    y.write_text(f"model: m\ng3:\n  paths: [{tmp_path / 'user-g3'}]\n  capacity_gb: 0.3\n"
                 f"g4:\n  enabled: true\n  url: file://{tmp_path / 'g4'}\n  keyring: {{path: {kr}}}\n")
    return y


def run(script: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in CLEAR and not k.startswith("KVBM_BACKEND__")}
    e.update(PYTHON=sys.executable, MODEL=str(tmp_path / "model"), KVBM_BACKEND_DRY_RUN="1",
             PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env)  # a test's MODEL replaces the default one
    return subprocess.run(["bash", str(EX / script)], env=e, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)


def parse(r: subprocess.CompletedProcess) -> tuple[str, dict, dict]:
    """(the one effective line, the exec'd --kv-transfer-config, the kvbm-backend env the engine gets)."""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvbm-backend effective (")]
    assert len(lines) == 1, r.stderr
    out = r.stdout.splitlines()
    argv = shlex.split(next(ln for ln in out if ln.startswith("kvbm-backend dry run: exec "))[len("kvbm-backend dry run: exec "):])
    env_line = next(ln for ln in out if ln.startswith("kvbm-backend dry run: env"))
    env = dict(kv.split("=", 1) for kv in shlex.split(env_line[len("kvbm-backend dry run: env"):]))
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return lines[0], ktc, env


def offloading_extra(ktc: dict) -> dict:
    """The ``OffloadingConnector``'s extra config: top level, or the ``MultiConnector`` child's."""
    if ktc["kv_connector"] == "MultiConnector":
        (ktc,) = [c for c in ktc["kv_connector_extra_config"]["connectors"] if c["kv_connector"] == "OffloadingConnector"]
    return ktc["kv_connector_extra_config"]


def configs_engine_loads(ktc: dict, env: dict) -> list:
    """The configs our connector / tiers build from the exec'd JSON and the environment, as they do."""
    from kvbm_backend.integrations.vllm.extra_config import config_from_extra
    out, kind, extra = [], ktc["kv_connector"], ktc.get("kv_connector_extra_config") or {}
    if kind == "KvbmBackendConnector":
        old = dict(os.environ)
        try:
            os.environ.update(env)
            out.append(config_from_extra(extra)[0])
        finally:
            os.environ.clear()
            os.environ.update(old)
    elif kind == "MultiConnector":
        for c in extra["connectors"]:
            out += configs_engine_loads(c, env)
    elif kind == "OffloadingConnector":
        for tier in extra["secondary_tiers"]:
            out.append(load_config(tier["config"], environ=env))
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_user_yaml_wins_and_is_reported(script, tmp_path, user):
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user))
    assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, env = parse(r)
    g3 = str(tmp_path / "user-g3")
    assert f"g3.paths={g3} [file]" in line and "g3.capacity_gb=0.3 [file]" in line, line
    assert f"g4.url=file://{tmp_path / 'g4'} [file]" in line and "g4.enabled=true [file]" in line, line
    assert f"g4.kek=[file {user.parent / 'keys' / 'keyring.json.kek'}]" in line, line  # no KEK variable needed
    assert "/mnt/nvme" not in line and not any(k.startswith("KVBM_BACKEND__") for k in env), (line, env)
    cfgs = configs_engine_loads(ktc, env)
    assert cfgs and all(c.g3.paths == [g3] and c.g3.capacity_gb == 0.3 and c.g4.url == f"file://{tmp_path / 'g4'}"
                        for c in cfgs)
    if script.endswith("serve_tiering.sh") or script in NATIVE:  # both tiers read the user's file; CPU tier size said
        assert [t["type"] for t in offloading_extra(ktc)["secondary_tiers"]] == ["G3Tier", "G4Tier"]
        assert "cpu_bytes_to_use=68719476736 [script]" in line


@pytest.mark.parametrize("script", SCRIPTS)
def test_environment_beats_the_file_and_says_so(script, tmp_path, user):
    if script.endswith("agg_kvbm_multi.sh"):  # DYN_KVBM_DISK_CACHE_GB would start KVBM's disk tier: refused aloud
        r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user), DYN_KVBM_DISK_CACHE_GB="2")
        assert r.returncode == 0 and "ignoring DYN_KVBM_DISK_CACHE_GB=2" in r.stderr, r.stderr
        line, ktc, env = parse(r)
        assert "g3.capacity_gb=0.3 [file]" in line and "DYN_KVBM_DISK_CACHE_GB" not in env
        return
    other = tmp_path / "env-g3"
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user), DYN_KVBM_DISK_CACHE_DIR=str(other),
            DYN_KVBM_DISK_CACHE_GB="2")
    assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, env = parse(r)
    assert f"g3.paths={other} [env DYN_KVBM_DISK_CACHE_DIR]" in line
    assert "g3.capacity_gb=2 [env DYN_KVBM_DISK_CACHE_GB]" in line
    assert all(c.g3.paths == [str(other)] and c.g3.capacity_gb == 2 for c in configs_engine_loads(ktc, env))


@pytest.mark.parametrize("script", sorted(WITH_G3_DEFAULT))
def test_script_defaults_only_where_nothing_is_given(script, tmp_path):
    bare = tmp_path / "bare.yaml"
    bare.write_text("model: m\n")
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(bare))
    if script in G4_HANDOFF:  # no G4 in the file: the G4 handoff cannot work, refused in one line (exit 2)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
            "kvbm-backend: error: kv_connector_extra_config: g4.enabled: --disaggregation-mode "), r.stderr[-3000:]
    else:
        assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, env = parse(r)
    want = WITH_G3_DEFAULT[script]
    assert f"g3.paths={','.join(want)} [script]" in line and "g3.capacity_gb=800 [script]" in line, line
    assert json.loads(env["KVBM_BACKEND__G3__PATHS"]) == want and "DYN_KVBM_DISK_CACHE_DIR" not in env
    assert all(c.g3.paths == want and c.g3.capacity_gb == 800 for c in configs_engine_loads(ktc, env))
    if script.endswith("serve_tiering.sh") or script in NATIVE:  # no G4 in the file: no G4 tier, and said
        assert [t["type"] for t in offloading_extra(ktc)["secondary_tiers"]] == ["G3Tier"]
        assert "G4Tier left out (g4.enabled=false)" in line
    # one field in the file: only the other one defaults
    bare.write_text("model: m\ng3: {capacity_gb: 0.25}\n")
    line, ktc, env = parse(run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(bare)))
    assert "g3.capacity_gb=0.25 [file]" in line and f"g3.paths={','.join(want)} [script]" in line
    assert "KVBM_BACKEND__G3__CAPACITY_GB" not in env


def test_tiering_takes_the_cpu_tier_size_and_needs_no_kek_variable(tmp_path, user):
    r = run("vllm/serve_tiering.sh", tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user), KVBM_BACKEND_CPU_BYTES="1073741824")
    assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, env = parse(r)
    assert ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] == 1073741824
    assert "cpu_bytes_to_use=1073741824 [env KVBM_BACKEND_CPU_BYTES]" in line
    (user.parent / "keys" / "keyring.json.kek").unlink()  # now the keyring has no KEK: one line, exit 2
    r = run("vllm/serve_tiering.sh", tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user))
    assert r.returncode == 2 and "dry run" not in r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("kvbm-backend: error: g4.keyring: keyring "), r.stderr
    assert "KVBM_BACKEND_KEK" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("script", NATIVE)
def test_native_scripts_take_cpu_bytes_and_kv_heads_from_the_environment(script, tmp_path, user):
    """The OffloadingConnector half (top level, or inside the disaggregated scripts' MultiConnector) gets the CPU
    tier's size and the model's KV heads per rank from the environment (the tiers' "layout" preset goes), and
    keeps what Dynamo's router needs: the G3 tier's events on, self-describing (token ids), G4's off."""
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user), KVBM_BACKEND_CPU_BYTES="67108864",
            KVBM_BACKEND_NUM_KV_HEADS="2")
    assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, env = parse(r)
    extra = offloading_extra(ktc)
    assert extra["cpu_bytes_to_use"] == 67108864 and "cpu_bytes_to_use=67108864 [env KVBM_BACKEND_CPU_BYTES]" in line
    assert "num_kv_heads=2 [env KVBM_BACKEND_NUM_KV_HEADS]" in line, line
    tiers = {t["type"]: t for t in extra["secondary_tiers"]}
    assert all(t["num_kv_heads"] == 2 and "layout" not in t for t in tiers.values()), tiers
    assert extra["spec_name"] == "CpuTieringOffloadingSpec" and extra["self_describing_kv_events"] is True
    assert tiers["G3Tier"]["enable_kv_events"] is True and not tiers["G4Tier"].get("enable_kv_events")
    if script != "dynamo/agg_native_tiers.sh":
        assert [c["kv_connector"] for c in ktc["kv_connector_extra_config"]["connectors"]] == [
            "NixlConnector", "OffloadingConnector"]
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user), KVBM_BACKEND_NUM_KV_HEADS="two")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "kvbm-backend: error: KVBM_BACKEND_NUM_KV_HEADS: need a positive number of KV heads per rank, got 'two'")


@pytest.mark.parametrize("script", ["dynamo/agg_kvbm_backend.sh", "vllm/serve_tiering.sh"])
def test_missing_config_file_is_one_line(script, tmp_path):
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "dry run" not in r.stdout, r.stdout
    err = r.stderr.strip().splitlines()
    assert err == [f"kvbm-backend: error: config file {tmp_path / 'nope.yaml'}: not found (set "
                   f"KVBM_BACKEND_CONFIG_FILE to your kvbm-backend YAML)"]


def test_cli_subcommand_is_the_same_entry(tmp_path, user):
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"config_file": str(user)}}
    exe = Path(sys.executable).with_name("kvbm-backend")
    if not exe.exists():
        pytest.skip("kvbm-backend console script not installed in this environment")
    env = {k: v for k, v in os.environ.items() if k not in CLEAR}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([str(exe), "config", "effective", "--for", "dynamo", "--default", 'g3.paths=["/x"]',
                        json.dumps(ktc)], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert f"g3.paths={tmp_path / 'user-g3'} [file]" in r.stderr and "export" not in r.stdout
    assert r.stdout.startswith("KV_TRANSFER_CONFIG=")


@pytest.mark.parametrize("script", G4_HANDOFF)
def test_the_g4_handoff_scripts_refuse_to_start_without_g4(script, tmp_path, user):
    """Review finding (2026-11-30, r5): ``disagg_prefill_g4.sh`` with a YAML without G4 printed g4.enabled=false
    [default] and exited 0 (the prefill worker then promised blocks no decode worker could read). Now the
    launcher's preflight (the dry run runs it) refuses, one line; with the user's G4 it starts (exit 0)."""
    g3_only = tmp_path / "g3-only.yaml"
    g3_only.write_text(f"model: m\ng3:\n  paths: [{tmp_path / 'g3'}]\n  capacity_gb: 0.3\n")
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(g3_only))
    mode = "prefill" if "prefill" in script else "decode"
    err = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("kvbm-backend: error:")]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err[0].startswith(f"kvbm-backend: error: kv_connector_extra_config: g4.enabled: --disaggregation-mode {mode}")
    assert run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user)).returncode == 0
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user), KVBM_BACKEND_HANDOFF_WAIT_S="601")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "kvbm-backend: error: KVBM_BACKEND_HANDOFF_WAIT_S: expected seconds in [0, 600] (handoff_wait_s), got '601'")


def test_a_worker_made_a_prefill_worker_by_dynamos_variable_is_checked_too(tmp_path, user):
    """Review finding (2026-11-30, dyn): ``agg_kvbm_backend.sh`` (our connector alone) under
    ``DYN_VLLM_DISAGGREGATION_MODE=prefill`` starts a Dynamo prefill worker (``dynamo.vllm`` takes the flag from
    that variable), but the dry run's preflight read only the flag: with G3 alone it exited 0. Now it refuses, one
    line naming the variable; with the user's G4 it passes."""
    g3_only = tmp_path / "g3-only.yaml"
    g3_only.write_text(f"model: m\ng3:\n  paths: [{tmp_path / 'g3'}]\n  capacity_gb: 0.3\n")
    r = run("dynamo/agg_kvbm_backend.sh", tmp_path, KVBM_BACKEND_CONFIG_FILE=str(g3_only),
            DYN_VLLM_DISAGGREGATION_MODE="prefill")
    err = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("kvbm-backend: error:")]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err[0].startswith("kvbm-backend: error: kv_connector_extra_config: g4.enabled: "
                             "DYN_VLLM_DISAGGREGATION_MODE=prefill with"), err
    assert run("dynamo/agg_kvbm_backend.sh", tmp_path, KVBM_BACKEND_CONFIG_FILE=str(user),
               DYN_VLLM_DISAGGREGATION_MODE="prefill").returncode == 0


def test_a_section_variable_leaves_the_scripts_other_defaults(tmp_path):
    """Review finding (2026-11-30): ``KVBM_BACKEND__G3='{"capacity_gb": 5}'`` (a section variable, which sets
    only the fields it holds) was taken as setting every g3 field: the script's ``g3.paths`` default was not
    exported, G3 opened in ./kvbm-g3 under the working directory, and the line blamed the variable for it. The
    same dry run's env line never shows an endpoint's credentials (it goes to the worker's log)."""
    bare = tmp_path / "bare.yaml"
    bare.write_text("model: m\n")
    r = run("dynamo/agg_kvbm_backend.sh", tmp_path, KVBM_BACKEND_CONFIG_FILE=str(bare),
            KVBM_BACKEND__G3='{"capacity_gb": 5}',
            KVBM_BACKEND__G4__ENDPOINT_URL="http://AKIAEXAMPLE:TopSecret123@127.0.0.1:1")
    assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, env = parse(r)
    assert "g3.paths=/mnt/nvme0/kvbm [script]" in line and "g3.capacity_gb=5 [env KVBM_BACKEND__G3]" in line, line
    assert "g3.enabled=true [default]" in line, line
    assert json.loads(env["KVBM_BACKEND__G3__PATHS"]) == ["/mnt/nvme0/kvbm"], env
    assert "KVBM_BACKEND__G3__CAPACITY_GB" not in env  # the operator's 5, not the script's 800
    assert all(c.g3.paths == ["/mnt/nvme0/kvbm"] and c.g3.capacity_gb == 5 for c in configs_engine_loads(ktc, env))
    assert env["KVBM_BACKEND__G4__ENDPOINT_URL"] == "http://127.0.0.1:1"
    assert "TopSecret123" not in r.stdout + r.stderr


@pytest.mark.parametrize("script", [*NATIVE, "vllm/serve_tiering.sh"])
def test_the_native_scripts_leave_out_a_tier_whose_section_is_off_and_say_so(script, tmp_path, user):
    """Review finding (2026-12-01): with ``g3.enabled: false`` (the YAML or ``KVBM_BACKEND__G3__ENABLED``) the
    native scripts kept the G3Tier, which opened G3 anyway, at the script's default /mnt/nvme0/kvbm, 800 GB,
    unchecked. Now the G3Tier is left out as the G4Tier is when G4 is off, the line says so, and the launcher's
    preflight (run by the dry run: exit 0) agrees with what is left; with both off, no tier of ours is left."""
    off = tmp_path / "g3-off.yaml"
    off.write_text(user.read_text().replace("g3:\n", "g3:\n  enabled: false\n", 1))
    for env in ({"KVBM_BACKEND_CONFIG_FILE": str(off)},
                {"KVBM_BACKEND_CONFIG_FILE": str(user), "KVBM_BACKEND__G3__ENABLED": "false"}):
        r = run(script, tmp_path, **env)
        assert r.returncode == 0, r.stderr[-3000:]
        line, ktc, _ = parse(r)
        assert [t["type"] for t in offloading_extra(ktc)["secondary_tiers"]] == ["G4Tier"], line
        assert "G3Tier left out (g3.enabled=false)" in line and "g3.enabled=false [" in line, line
        assert "G4Tier left out" not in line, line
    none = tmp_path / "none.yaml"
    none.write_text("model: m\ng3: {enabled: false}\n")
    r = run(script, tmp_path, KVBM_BACKEND_CONFIG_FILE=str(none))
    assert r.returncode == 0, r.stderr[-3000:]
    line, ktc, _ = parse(r)
    assert offloading_extra(ktc)["secondary_tiers"] == [], line
    assert "G3Tier left out (g3.enabled=false)" in line and "G4Tier left out (g4.enabled=false)" in line, line
    assert not (tmp_path / "user-g3").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_served_model_names_the_namespace(script, tmp_path):
    """Review finding (2026-12-01): serve_kvbm_backend.sh's inline settings and examples/kvbm-backend.yaml (the
    YAML examples/dynamo/README.md starts the workers with) named ``model: meta-llama/Llama-3.1-8B-Instruct``
    beside the scripts' ``MODEL``: a worker serving any other model stored its KV in the Instruct model's
    namespace. Each script runs as written (its inline settings, or the example YAML) with another ``MODEL``;
    every config the engine builds puts the blocks under the model it serves."""
    from kvbm_backend.integrations.vllm.namespaces import namespace_model
    served = "my-org/llama-3.1-8b-finetune"
    overrides = {"KVBM_BACKEND__G3__PATHS": json.dumps([str(tmp_path / "g3")])}
    sources = [{"KVBM_BACKEND_CONFIG_FILE": str(EX / "kvbm-backend.yaml")}]
    if script == "vllm/serve_kvbm_backend.sh":
        sources.append({})  # its inline settings
    for src in sources:
        r = run(script, tmp_path, MODEL=served, **overrides, **src)
        _, ktc, env = parse(r)
        cfgs = configs_engine_loads(ktc, env)
        assert cfgs, r.stderr[-3000:]
        assert [namespace_model(c, served) for c in cfgs] == [served] * len(cfgs), (src, [c.model for c in cfgs])
