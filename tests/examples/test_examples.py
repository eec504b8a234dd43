"""Every config in examples/ is parsed and loaded (not run): shell scripts pass ``bash -n``, the JSON
they embed is extracted and becomes vLLM's real ``KVTransferConfig`` (MultiConnector children too),
our connector/tier module paths import and hold the named classes, and kvbm-backend YAML loads with
``load_config``."""
from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from kvbm_backend.config import load_config

pytestmark = [pytest.mark.vllm]

EX = Path(__file__).resolve().parents[2] / "examples"
FRONTEND = EX / "dynamo" / "frontend.sh"  # no KV config: checked by test_dynamo_frontend_script
BASELINE = EX / "dynamo" / "agg.sh"  # no KV config either: the demo's baseline worker (test_dynamo_baseline_script)
SCRIPTS = sorted(p for p in EX.rglob("*.sh") if p not in (FRONTEND, BASELINE))
# Dynamo workers start through our launcher: `python -m dynamo.vllm` plus version-guarded compat shims
# (kvbm_backend/integrations/dynamo/compat.py); test_dynamo_worker_launcher checks it is exactly that.
DYNAMO_WORKER = '"$PYTHON" -m kvbm_backend.integrations.dynamo.vllm_worker'
DRY_RUN = '${KVBM_BACKEND_DRY_RUN:+"$PYTHON" -m kvbm_backend.apps.effective --dry-run}'
KTC = 'KV_TRANSFER_CONFIG="$("$PYTHON" -m kvbm_backend.integrations.dynamo.ktc "$KV_TRANSFER_CONFIG")"'
OURS = {"kvbm_backend.integrations.vllm.connector", "kvbm_backend.integrations.vllm.tiering"}
JSON_VAR = re.compile(r"^(\w+_CONFIG)='(\{.*?\})'\s*$", re.S | re.M)


def kv_transfer_configs_in(text: str) -> list[dict]:
    return [json.loads(m.group(2)) for m in JSON_VAR.finditer(text)]


def check_kv_transfer_config(d: dict) -> list[str]:
    """Build vLLM's KVTransferConfig from ``d`` (and each MultiConnector child); import our modules.
    Returns the connector names seen."""
    from vllm.config import KVTransferConfig
    ktc = KVTransferConfig(**d)
    names = [ktc.kv_connector]
    extra = ktc.kv_connector_extra_config
    if ktc.kv_connector == "MultiConnector":
        children = extra["connectors"]
        assert isinstance(children, list) and len(children) >= 2
        for child in children:
            names += check_kv_transfer_config(child)
    if ktc.kv_connector_module_path in OURS:
        mod = importlib.import_module(ktc.kv_connector_module_path)
        assert hasattr(mod, ktc.kv_connector), f"{ktc.kv_connector} not in {ktc.kv_connector_module_path}"
        from kvbm_backend.integrations.vllm.extra_config import EXTRA_KEYS
        assert set(extra) <= EXTRA_KEYS, f"unknown kv_connector_extra_config keys {set(extra) - EXTRA_KEYS}"
        ours = extra.get("kvbm_backend")
        if ours is not None:
            load_config(ours, use_env=False)
        if extra.get("config_file"):
            assert extra["config_file"].endswith((".yaml", ".yml", ".toml", ".json"))
    if ktc.kv_connector == "OffloadingConnector":
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == extra["spec_name"]
        for tier in extra["secondary_tiers"]:
            cls = SecondaryTierFactory.get_tier_class(tier)
            assert cls.__module__ in OURS and cls.__name__ == tier["type"]
            for section in ("g3", "g4"):
                if section in tier:
                    load_config({section: tier[section]}, use_env=False)
            if "layout" in tier:
                from kvbm_backend.model.presets import load_preset
                load_preset(tier["layout"])
    return names


def test_examples_exist():
    names = {p.relative_to(EX).as_posix() for p in EX.rglob("*") if p.is_file()}
    for want in ("kvbm-backend.yaml", "dynamo/agg.sh", "dynamo/agg_kvbm_backend.sh", "dynamo/agg_kvbm_multi.sh",
                 "dynamo/disagg_prefill.sh", "dynamo/disagg_decode.sh", "dynamo/frontend.sh",
                 "dynamo/disagg_prefill_g4.sh", "dynamo/disagg_decode_g4.sh",
                 "vllm/serve_kvbm_backend.sh",
                 "vllm/serve_tiering.sh", "k8s/worker.yaml", "k8s/frontend.yaml", "k8s/etcd.yaml",
                 "k8s/kustomization.yaml", "k8s/Dockerfile", "k8s/README.md", "README.md"):
        assert want in names


def test_every_example_file_is_named_in_a_readme():
    """An operator reading examples/README.md finds every file of examples/: named, in backquotes, in the README.md
    of examples/ or of a directory between (path from that directory). Before 2026-11-30 grafana/kvbm-backend.json
    was in none, and the top table listed 6 of the 11 Dynamo scripts without pointing at dynamo/README.md."""
    missing = []
    for p in sorted(q for q in EX.rglob("*") if q.is_file() and q.name != "README.md" and "__pycache__" not in q.parts):
        dirs = [d for d in p.parents if d == EX or EX in d.parents]
        if not any(f"`{p.relative_to(d).as_posix()}`" in (d / "README.md").read_text()
                   for d in dirs if (d / "README.md").is_file()):
            missing.append(p.relative_to(EX).as_posix())
    assert missing == [], "example files no README names"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(EX).as_posix())
def test_script_syntax_and_embedded_config(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    configs = kv_transfer_configs_in(text)
    assert configs, f"{script.name}: no KV_TRANSFER_CONFIG='{{...}}' block"
    assert '--kv-transfer-config "$KV_TRANSFER_CONFIG"' in text
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert "--connector" not in code  # `--connector kvbm` is rejected by Dynamo 1.6
    names = [n for c in configs for n in check_kv_transfer_config(c)]
    assert "KvbmBackendConnector" in names or "OffloadingConnector" in names
    # every script execs its launcher (or, with KVBM_BACKEND_DRY_RUN, the dry run in front of the same argv:
    # tests/examples/test_example_effective.py) after printing its effective settings
    assert f"exec {DRY_RUN} \\\n" in text and "kvbm_backend.apps.effective --for " in text
    if "dynamo" in script.parts:
        assert f"exec {DRY_RUN} \\\n  {DYNAMO_WORKER}" in text and '"$@"' in code
        if "KvbmBackendConnector" in names:  # native-tier scripts: the tiers' config comes through apps.effective
            assert KTC in text  # KVBM_BACKEND_CONFIG_FILE / _STATS_PATH reach the JSON (tests/e2e/test_dynamo_e2e.py)
    if "multi" in script.name:
        assert names[:3] == ["MultiConnector", "DynamoConnector", "KvbmBackendConnector"]
        dyn = configs[0]["kv_connector_extra_config"]["connectors"][0]
        assert dyn["kv_connector_module_path"] == "kvbm.vllm_integration.connector"
    if "disagg" in script.name and script.name.endswith("_g4.sh"):  # handoff through G4: ours alone
        assert names == ["KvbmBackendConnector"]
        assert configs[0]["kv_connector_extra_config"]["handoff_wait_s"] > 0
        assert "--disaggregation-mode" in text
    elif "disagg" in script.name and "native" in script.name:  # NIXL + vLLM's offloading with our tiers
        assert names[:3] == ["MultiConnector", "NixlConnector", "OffloadingConnector"]
        assert "--disaggregation-mode" in text
    elif "disagg" in script.name:
        assert names[:3] == ["MultiConnector", "NixlConnector", "KvbmBackendConnector"]
        assert "--disaggregation-mode" in text


def test_dynamo_frontend_script():
    subprocess.run(["bash", "-n", str(FRONTEND)], check=True)
    text = FRONTEND.read_text()
    assert '-m dynamo.frontend' in text and '"$@"' in text and "HTTP_PORT" in text


def test_dynamo_baseline_script():
    """agg.sh is the same launcher as agg_kvbm_backend.sh with no KV connector (the demo's baseline)."""
    subprocess.run(["bash", "-n", str(BASELINE)], check=True)
    text = BASELINE.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert f"exec {DYNAMO_WORKER}" in text and '"$@"' in code and "--enable-prefix-caching" in code
    assert "kv-transfer-config" not in code and not kv_transfer_configs_in(text)


def test_dynamo_worker_launcher():
    """The launcher is `python -m dynamo.vllm`: it runs dynamo.vllm's __main__ steps after the shims."""
    import ast
    src = (Path(__file__).resolve().parents[2] / "kvbm_backend/integrations/dynamo/vllm_worker.py").read_text()
    tree = ast.parse(src)
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("dynamo.vllm.main", "main") in imported
    assert ("dynamo.common.snapshot.restore_context", "maybe_run_restore_standby_mode") in imported
    assert "compat.apply()" in src


def test_ktc_env_overrides():
    from kvbm_backend.integrations.dynamo.ktc import apply_env
    ours = {"kv_connector": "KvbmBackendConnector", "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": "/etc/x.yaml"}}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}, ours]}}
    assert apply_env(multi, {}) == multi
    env = {"KVBM_BACKEND_CONFIG_FILE": "/tmp/k.yaml", "KVBM_BACKEND_STATS_PATH": "/tmp/s.json"}
    out = apply_env(multi, env)
    nixl, mine = out["kv_connector_extra_config"]["connectors"]
    assert mine["kv_connector_extra_config"] == {"config_file": "/tmp/k.yaml", "stats_path": "/tmp/s.json"}
    assert nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    inline = {**ours, "kv_connector_extra_config": {"kvbm_backend": {"model": "m"}}}
    assert apply_env(inline, env)["kv_connector_extra_config"] == {"config_file": "/tmp/k.yaml",
                                                                   "stats_path": "/tmp/s.json"}
    check_kv_transfer_config(out)
    waited = apply_env(ours, {"KVBM_BACKEND_HANDOFF_WAIT_S": "30"})["kv_connector_extra_config"]
    assert waited == {"config_file": "/etc/x.yaml", "handoff_wait_s": 30.0}
    for bad in ("-1", "soon", "inf", "nan", "601"):
        with pytest.raises(ValueError, match="KVBM_BACKEND_HANDOFF_WAIT_S"):
            apply_env(ours, {"KVBM_BACKEND_HANDOFF_WAIT_S": bad})
    assert apply_env(ours, {"KVBM_BACKEND_HANDOFF_WAIT_S": "600"})["kv_connector_extra_config"]["handoff_wait_s"] == 600


def test_ktc_refuses_what_the_connector_refuses_in_one_line(monkeypatch, capsys):
    """Review finding (2026-11-30): ``KVBM_BACKEND_HANDOFF_WAIT_S=601`` passed the script (the connector then
    refused it inside vLLM's workers) and ``abc`` ended the script with a traceback. Both are one line now, exit 2,
    with the connector's own bounds."""
    import json as _json

    from kvbm_backend.integrations.dynamo import ktc
    from kvbm_backend.integrations.vllm.extra_config import config_from_extra
    ours = _json.dumps({"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {}})
    for bad in ("abc", "601", "-0.5"):
        monkeypatch.setenv("KVBM_BACKEND_HANDOFF_WAIT_S", bad)
        assert ktc.main([ours]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            f"kvbm-backend: error: KVBM_BACKEND_HANDOFF_WAIT_S: expected seconds in [0, 600] (handoff_wait_s), got {bad!r}"]
    monkeypatch.setenv("KVBM_BACKEND_HANDOFF_WAIT_S", "600")
    assert ktc.main([ours]) == 0
    extra = _json.loads(capsys.readouterr().out)["kv_connector_extra_config"]
    assert config_from_extra({"kvbm_backend": {"model": "m"}, **extra})[1]["handoff_wait_s"] == 600.0  # the connector agrees


def test_kvbm_backend_yaml_loads():
    cfg = load_config(EX / "kvbm-backend.yaml", use_env=False)
    assert cfg.g3.paths and cfg.g4.enabled and cfg.g4.url.startswith("s3://") and cfg.g4.encrypt


# examples/k8s (image, frontend, etcd, worker; schema, Secrets, keyring, the worker's command in dry run):
# tests/examples/test_k8s_example.py, which took over test_kubernetes_worker's keyring/Secret checks.
