"""The launchers' preflight checks the ``--kv-transfer-config`` vLLM will use: the last one given, under either
spelling (vLLM's parser takes ``--kv_transfer_config`` too). Review finding (2026-11-29): the first was checked,
so an operator's config passed after a launch script's own went unchecked and the engine started with it."""
from __future__ import annotations

import json

from kvbm_backend.integrations.preflight import check_argv


def _ktc(tmp_path, capacity_gb):
    return json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "kvbm_backend": {"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": capacity_gb}}}})


def test_the_last_kv_transfer_config_of_either_spelling_is_checked(tmp_path):
    good, bad = _ktc(tmp_path, 1), _ktc(tmp_path, -1)
    assert check_argv(["serve", "m", "--kv-transfer-config", good]) is None
    for argv in (["--kv-transfer-config", good, "--kv-transfer-config", bad],
                 ["--kv-transfer-config", good, f"--kv_transfer_config={bad}"],
                 ["--kv_transfer_config", bad]):
        why = check_argv(["serve", "m", *argv])
        assert why and "g3.capacity_gb" in why, (argv, why)
    assert check_argv(["serve", "m", "--kv-transfer-config", bad, "--kv-transfer-config", good]) is None
