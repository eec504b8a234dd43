"""``kvbm_backend.integrations.dynamo.compat.apply`` as a Dynamo worker runs it, in a fresh process with the installed
ai-dynamo and vLLM: our connector's registrations (vLLM's ``KVConnectorFactory``, Dynamo's PD protocol registry) are
made whatever the ai-dynamo version; the version guard covers only the torchvision and zmq shims, and says so.

Review finding (2026-11-30, r10): with ai-dynamo reported as 1.6.2, ``apply()`` returned [] and logged nothing, and
Dynamo's ``make_kv_connector_protocol`` raised "Unsupported kv_connector='KvbmBackendConnector' for PD": the
G4-handoff form's prefill worker refused every request."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("dynamo") is None, reason="ai-dynamo not installed")
HANG_S = 600.0  # a hang guard, not a bound

PROBE = r"""
import json, logging, sys
from types import SimpleNamespace
site = sys.argv[1]
if site:
    sys.path.insert(0, site)  # a dist-info naming another ai-dynamo version, first on the path
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
from importlib.metadata import version
from kvbm_backend.integrations.dynamo import compat
applied = compat.apply()
again = compat.apply()
from dynamo.vllm import kv_connector_protocols as kcp
cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="KvbmBackendConnector",
                                                         kv_connector_extra_config={}))
try:
    proto = type(kcp.make_kv_connector_protocol(cfg)).__name__
except Exception as e:
    proto = f"{type(e).__name__}: {e}"
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
print(json.dumps({"version": version("ai-dynamo"), "applied": applied, "again": again, "protocol": proto,
                  "factory": "KvbmBackendConnector" in KVConnectorFactory._registry}))
"""
REGISTRATIONS = ["vllm.KVConnectorFactory+KvbmBackendConnector", "dynamo.kv_connector_protocols+KvbmBackendConnector"]


def _probe(site: str) -> tuple[dict, str]:
    p = subprocess.run([sys.executable, "-c", PROBE, site], cwd=REPO, capture_output=True, text=True,
                       timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.mark.slow
@pytest.mark.side  # ~40 s (a fresh interpreter importing vLLM and Dynamo); no wall-clock assertion
def test_the_connector_is_registered_for_pd_under_another_dynamo_version(tmp_path):
    dist = tmp_path / "site" / "ai_dynamo-1.6.2.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ai-dynamo\nVersion: 1.6.2\n")
    got, err = _probe(str(tmp_path / "site"))
    assert got["version"] == "1.6.2"
    assert got["applied"] == REGISTRATIONS and got["again"] == [], got  # registered, idempotent; no shim
    assert got["protocol"] == "KvbmBackendConnectorProtocol" and got["factory"], got
    skipped = [ln for ln in err.splitlines() if "not a version the compat shims were written for" in ln]
    assert len(skipped) == 2 and "ai-dynamo 1.6.2" in skipped[0] and "WARNING" in skipped[0], err[-2000:]  # one per call


@pytest.mark.slow
@pytest.mark.side  # ~40 s (a fresh interpreter importing vLLM and Dynamo); no wall-clock assertion
def test_under_the_version_the_shims_were_written_for_everything_is_applied():
    got, err = _probe("")
    if got["version"] != "1.6.1":
        pytest.skip(f"ai-dynamo {got['version']} installed; the shims' guard is 1.6.1")
    assert got["applied"][-2:] == REGISTRATIONS and got["again"] == [], got
    assert got["protocol"] == "KvbmBackendConnectorProtocol" and got["factory"], got
    assert "not a version the compat shims" not in err
