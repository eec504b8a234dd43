"""``kvbm-backend config effective`` checks the directories of the sections the transfer config's users open, as the
tiers do (:func:`kvbm_backend.integrations.vllm.extra_config.tier_config`): a config only a G4Tier uses skips
``g3.paths`` (the default ``./kvbm-g3`` included), one only a G3Tier uses skips an enabled ``g4.url`` ``file://``
store's directory; the connector form, and a config both tiers share, check both sections as before.

Finding (2026-12-03): it built one config for both tiers, so a transfer config whose only tier is a G4Tier (with its
own ``g4`` settings) was refused ``g3.paths[0]: ...`` from a working directory where ``./kvbm-g3`` cannot be made
(a read-only root in a container), although the G4Tier starts there (tests/integrations/vllm/
test_tiering_unused_section.py). The unwritable working directory is real (:mod:`tests.helpers.ro_cwd`)."""
from __future__ import annotations

import json

import pytest

from kvbm_backend.apps.effective import main
from tests.helpers import ro_cwd as _ro_cwd

ro_cwd = _ro_cwd.ro_cwd  # the fixture: a working directory where ./kvbm-g3 cannot be created

MOD = "kvbm_backend.integrations.vllm.tiering"


def _tiering(*tiers: dict) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                                     "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
                                                     "cpu_bytes_to_use": 1 << 30, "secondary_tiers": list(tiers)}})


def _run(capsys, ktc: str) -> tuple[int, str, str]:
    rc = main(["--for", "vllm", ktc])
    out, err = capsys.readouterr()
    return rc, out, err


def _kept(out: str) -> list[str]:
    """The tier types left in the printed ``KV_TRANSFER_CONFIG``."""
    import shlex
    line = next(x for x in out.splitlines() if x.startswith("KV_TRANSFER_CONFIG="))
    ktc = json.loads(shlex.split(line.partition("=")[2])[0])
    return [t["type"] for t in ktc["kv_connector_extra_config"]["secondary_tiers"]]


def _shared_g4_file(tmp_path, ro_cwd) -> str:
    """A config file turning G4 on at a ``file://`` store under the unwritable working directory."""
    cfg = tmp_path / "kvbm.yaml"
    cfg.write_text(f"g4:\n  enabled: true\n  url: file://{ro_cwd / 'kvbm-g3' / 'store'}\n  encrypt: false\n")
    return str(cfg)


def test_a_g4_tier_alone_is_not_refused_for_the_default_g3_paths(capsys, tmp_path, ro_cwd):
    """Before: exit 2, ``kvbm-backend: error: g3.paths[0]: ... (got './kvbm-g3')``."""
    tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": 2,
            "g4": {"enabled": True, "url": f"file://{tmp_path / 'store'}", "encrypt": False}}
    rc, out, err = _run(capsys, _tiering(tier))
    assert rc == 0, err
    assert _kept(out) == ["G4Tier"] and "g4.enabled=true" in err and "error" not in err
    assert not (ro_cwd / "kvbm-g3").is_dir()


def test_a_g3_tier_alone_is_not_refused_for_a_shared_configs_g4_store(capsys, tmp_path, ro_cwd):
    """Before: exit 2, ``kvbm-backend: error: g4.url: ...`` (a store the G3Tier never opens)."""
    tier = {"type": "G3Tier", "module_path": MOD, "num_kv_heads": 2, "config": _shared_g4_file(tmp_path, ro_cwd),
            "g3": {"paths": [str(tmp_path / "g3")]}}
    rc, out, err = _run(capsys, _tiering(tier))
    assert rc == 0, err
    assert _kept(out) == ["G3Tier"] and f"g3.paths={tmp_path / 'g3'}" in err


def test_what_a_user_opens_is_still_checked(capsys, tmp_path, ro_cwd):
    """The G4Tier's own store, a config both tiers share (the G4Tier opens its store) and the connector's given
    ``g3.paths`` are refused as before, naming the field."""
    bad_store = f"file://{ro_cwd / 'kvbm-g3' / 'store'}"
    g4tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": 2,
              "g4": {"enabled": True, "url": bad_store, "encrypt": False}}
    rc, _, err = _run(capsys, _tiering(g4tier))
    assert rc == 2 and err.startswith("kvbm-backend: error: g4.url: "), err
    shared = _shared_g4_file(tmp_path, ro_cwd)
    both = [{"type": t, "module_path": MOD, "num_kv_heads": 2, "config": shared} for t in ("G3Tier", "G4Tier")]
    rc, _, err = _run(capsys, _tiering(*both))
    assert rc == 2 and err.startswith(f"kvbm-backend: error: config file {shared}: g4.url: "), err
    connector = json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                            "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
                            "kv_connector_extra_config": {"kvbm_backend": {"g3": {"paths": ["./kvbm-g3"]}}}})
    rc, _, err = _run(capsys, connector)
    assert rc == 2 and err.startswith("kvbm-backend: error: g3.paths[0]: "), err


@pytest.mark.parametrize("form", ["g4tier", "g3tier"])
def test_the_dry_run_preflight_agrees(capsys, tmp_path, ro_cwd, form):
    """``--dry-run`` (the launchers' preflight on the same transfer config) passes what ``config effective`` passes."""
    if form == "g4tier":
        tier = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": 2,
                "g4": {"enabled": True, "url": f"file://{tmp_path / 'store'}", "encrypt": False}}
    else:
        tier = {"type": "G3Tier", "module_path": MOD, "num_kv_heads": 2, "config": _shared_g4_file(tmp_path, ro_cwd),
                "g3": {"paths": [str(tmp_path / "g3")]}}
    ktc = _tiering(tier)
    assert _run(capsys, ktc)[0] == 0
    assert main(["--dry-run", "vllm", "serve", "m", "--kv-transfer-config", ktc]) == 0, capsys.readouterr().err
