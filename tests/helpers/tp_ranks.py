"""Two real processes forming vLLM's TP group of 2 on gloo, as vLLM's ``external_launcher`` sets it up on CPU
(tests/integrations/vllm/test_external_launcher_g3_tp.py, test_external_launcher_agree_tp.py,
test_reset_epoch_tp.py). A test file run as a script is one rank: its ``__main__`` calls :func:`join_tp_group`
with its argv's rank and port, does its part and writes its JSON output; the test runs it as both ranks with
:func:`run_tp_ranks`. Imports vLLM lazily."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers.prom import free_port

HANG_S = 600.0  # a hang guard, not a bound: both ranks must finish; returns as soon as they do
REPO = Path(__file__).resolve().parents[2]


def join_tp_group(rank: int, port: int) -> None:
    """This process as TP rank ``rank`` of 2: vLLM's distributed environment (gloo, rendezvous on 127.0.0.1:``port``)
    and its model-parallel state (TP 2)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(tensor_model_parallel_size=2)


def run_tp_ranks(script: str, tmp_path: Path, *args: str) -> tuple:
    """Run ``script`` as TP ranks 0 and 1 at once (argv: rank, a free port, the rank's output JSON path under
    ``tmp_path``, then ``args``; cwd and PYTHONPATH the repository, vLLM logging at WARNING, ``XDG_RUNTIME_DIR`` a
    fresh short directory: a Unix socket path has at most 107 bytes). Both must exit 0 (AssertionError with the tail
    of each one's output otherwise); returns their outputs ``(rank 0's, rank 1's)``, parsed."""
    port = free_port()
    xdg = tempfile.mkdtemp(prefix="kvbm-el-")
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_LOGGING_LEVEL="WARNING", XDG_RUNTIME_DIR=xdg)
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, script, str(r), str(port), str(outs[r]), *args], cwd=str(REPO),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=HANG_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(xdg, ignore_errors=True)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    return r0, r1


def one_rank_group():
    """``(vLLM-shaped TP group of one rank over gloo in this process, whether this call initialised
    torch.distributed)``: the caller destroys the process group when it initialised it. Skips without torch."""
    import pytest
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    dist = torch.distributed
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return SimpleNamespace(world_size=1, cpu_group=dist.group.WORLD, rank_in_group=0), own
