"""A connector that cannot start inside the engine takes the server down with it (issue 22 item 3).

The config passes ``load_config`` and the launcher's preflight (G4 ``file://`` under ``/proc``: the path's
form is right and its parent is a directory, but nothing can be created there), so the connector fails in
vLLM's worker process, after G3 opened. Before the fix vLLM's API server (and Dynamo's worker) stayed up
with the port never bound: the worker's SIGTERM arrived while the failed start's garbage was being freed, its
``SystemExit`` was dropped ("Exception ignored in ... WeakSet._remove"), and the engine core waited on the
worker for good (see :mod:`kvbm_backend.integrations.vllm.start_failure`).

Each test runs the shipped example script as an operator would and requires a non-zero exit within
``HANG_S`` (a hang guard, not a performance bound: a start took 60-280 s on the shared 2-core machine with
torch.compile on; 90 s idle with ``--enforce-eager``), and the
log to name ``g4.url`` and the path in one line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.vllm_runner import vllm_available

from kvbm_backend.apps.engine_model import TINY, write_model_dir

REPO = Path(__file__).resolve().parents[2]
# side: nothing here is timed but the hang guard below, so it runs at nice 10 beside the engine lane
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(900)]
_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

HANG_S = 600
# vLLM's own flag, passed through the example scripts as an operator passes any vLLM flag: without it the CPU
# worker compiles the model with torch.compile before the KV cache (and so the connector) is set up, 54-59 s
# of one core on the idle 2-core VM (2-3x that in CI), which has nothing to do with the start failure under
# test; tests/e2e/test_vllm_serve.py keeps compilation on (the mode users run).
EAGER = ("--enforce-eager",)
BAD_DIR = "/proc/kvbm-backend-start-failure/g4"  # /proc exists and is a directory; mkdir under it fails


def _config(tmp_path: Path) -> Path:
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    cfg = tmp_path / "kvbm.json"
    cfg.write_text(json.dumps({"model": "kvbm-backend/tiny-llama",
                               "g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.2},
                               "g4": {"enabled": True, "url": f"file://{BAD_DIR}", "encrypt": False}}))
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.preflight import check_extra
    check_extra({"config_file": str(cfg)})  # passes the config model and the preflight: it fails later
    assert load_config(cfg, use_env=False).g4.url == f"file://{BAD_DIR}"
    return cfg


def _run(argv: list[str], env: dict, log: Path, cwd: Path) -> tuple[int | None, str]:
    """Run ``argv`` in its own process group; the exit code (None: still running after HANG_S, then
    killed) and the log."""
    with open(log, "wb") as fh:
        p = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        try:
            rc = p.wait(HANG_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever the group left behind
            except ProcessLookupError:
                pass
            p.wait(HANG_S)  # the SIGKILLed group's leader: a hang guard (was 30 s)
    return rc, log.read_text(errors="replace")


def _check(rc: int | None, text: str) -> None:
    assert rc is not None, f"still running after {HANG_S} s (the hang of issue 22 item 3):\n{text[-4000:]}"
    assert rc != 0, text[-4000:]
    named = [ln for ln in text.splitlines() if "g4.url" in ln and BAD_DIR in ln and "cannot create directory" in ln]
    assert named, text[-4000:]


def test_vllm_serve_exits_when_the_connector_cannot_start(tmp_path):
    model = write_model_dir(tmp_path / "model", TINY)
    cfg = _config(tmp_path)
    env = dict(os.environ, MODEL=str(model), PYTHON=sys.executable, KVBM_BACKEND_CONFIG_FILE=str(cfg),
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from kvbm_backend.integrations.dynamo.stack import free_port
    rc, text = _run(["bash", str(REPO / "examples" / "vllm" / "serve_kvbm_backend.sh"), "--host", "127.0.0.1",
                     "--port", str(free_port()), "--dtype", "float32", "--max-model-len", "2048", *EAGER],
                    env, tmp_path / "serve.log", tmp_path)
    _check(rc, text)


def _dynamo_missing() -> str | None:
    import importlib.util as u
    return None if all(u.find_spec(m) for m in ("dynamo.vllm", "dynamo.llm")) else "ai-dynamo not installed"


@pytest.mark.skipif(_dynamo_missing() is not None, reason="ai-dynamo not installed (bash ci/install.sh)")
def test_dynamo_worker_exits_when_the_connector_cannot_start(tmp_path):
    from kvbm_backend.integrations.dynamo.stack import EXAMPLES, RUNTIME_ARGS, free_port, loopback_env
    model = write_model_dir(tmp_path / "model", TINY)
    cfg = _config(tmp_path)
    env = loopback_env(tmp_path / "discovery", {"MODEL": str(model), "KVBM_BACKEND_CONFIG_FILE": str(cfg),
                                                 "DYN_SYSTEM_PORT": str(free_port())})
    rc, text = _run(["bash", str(EXAMPLES / "agg_kvbm_backend.sh"), *RUNTIME_ARGS, "--dtype", "float32",
                     "--block-size", "32", "--max-model-len", "2048", *EAGER], env, tmp_path / "worker.log", tmp_path)
    _check(rc, text)
