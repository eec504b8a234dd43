"""Two engines given the same explicit ``kv_transfer_config.engine_id`` on one host (two workers of one Dynamo
deployment on one node with a copied config) keep their own worker -> scheduler report channels.

Review finding (2026-11-30): the channel's address came from the engine id, DP rank and namespace alone, so the
second engine's scheduler took the first's socket (unlinked as "stale") and, in one process, its listener; the
first engine's worker then sent its G3 index to the other engine's scheduler, whose mirror took it, and its own
scheduler's mirror stayed empty (every G3 hit of that engine a miss). Now the scheduler draws a token at start and
sends it to its workers in every step's connector metadata; the address includes it.

Real connectors (vLLM's ``KVConnectorBase_V1`` API: ``build_connector_meta``, ``bind_connector_metadata``,
``build_connector_worker_meta``), real G3 pools on tmp files, the ``mp`` executor's split (the worker owns G3,
the scheduler mirrors it), the listener in this process or only its Unix socket (as for another process)."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from kvbm_backend.integrations.vllm import report_channel as rc  # noqa: E402
from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector  # noqa: E402

pytestmark = [pytest.mark.vllm]
HANG_S = 600.0  # a hang guard, not a bound: waits for a report that must come; returns as soon as it does

BS, H, D, NB = 16, 2, 64, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
ENGINE_ID = "copied-config-engine"


def _engine(root: Path):
    extra = {"kvbm_backend": {"model": "kvbm-backend/channel-test",
                              "g3": {"paths": [str(root / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
                                     "admission": {"policy": "all"}}}}
    ktc = KVTransferConfig(kv_connector="KvbmBackendConnector", engine_id=ENGINE_ID,
                           kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    vc = SimpleNamespace(kv_transfer_config=ktc, kv_events_config=None,
                         model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1, distributed_executor_backend="mp"),
                         cache_config=SimpleNamespace(cache_dtype="auto"))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    return (KvbmBackendConnector(vc, KVConnectorRole.SCHEDULER, kcc),
            KvbmBackendConnector(vc, KVConnectorRole.WORKER, kcc))


def _idle_step():
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, finished_req_ids=set(),
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                                 num_computed_tokens=[]))


def _step(sched: KvbmBackendConnector, worker: KvbmBackendConnector) -> None:
    """One engine step's connector calls, as vLLM's model runner makes them (the worker's first report)."""
    worker.bind_connector_metadata(sched.build_connector_meta(_idle_step()))
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()


def _mirror(sched: KvbmBackendConnector):
    return sched.parts._groups[0].g3


def _wait(cond) -> None:
    end = time.monotonic() + HANG_S
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("same_process", [True, False], ids=["listener-in-process", "socket-only"])
def test_two_engines_with_one_engine_id_keep_their_own_report_channels(tmp_path, monkeypatch, same_process):
    # a short runtime dir: the socket path must fit AF_UNIX's 108 bytes, and pytest's tmp_path under the CI
    # lanes' --basetemp does not (the channel is then refused and reports travel with the steps)
    run = tempfile.mkdtemp(prefix="kvrc-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", run)
    engines = [_engine(tmp_path / "a"), _engine(tmp_path / "b")]
    (sa, wa), (sb, wb) = engines
    try:
        assert _mirror(sa) is not _mirror(sb) and not _mirror(sa).ready and not _mirror(sb).ready
        paths = [s.parts._listener.path for s, _ in engines]
        assert all(p and len(p.encode()) < 108 for p in paths), paths  # the Unix socket path limit
        if not same_process:
            rc._local.clear()  # as in other processes: only the sockets
        # one block in each engine's G3 (its worker's pool), before the worker's first report (a snapshot)
        for i, (_, w) in enumerate(engines):
            ns, g3 = w.parts._groups[0].ns, w.parts._groups[0].g3
            assert g3.put(ns.keys([1000 + i]), [np.full(ns.layout.bytes_per_block, i, np.uint8)]).result(HANG_S).written == 1
        _step(sa, wa)  # engine A's worker reports: the snapshot must reach A's scheduler, not B's
        _wait(lambda: _mirror(sa).ready or _mirror(sb).ready)
        assert _mirror(sa).ready and not _mirror(sb).ready, "engine A's report reached engine B's scheduler"
        assert _mirror(sa).stats()["blocks"] == 1
        _step(sb, wb)
        _wait(lambda: _mirror(sb).ready)
        assert _mirror(sb).stats()["blocks"] == 1 and _mirror(sa).stats()["blocks"] == 1
        assert wa.parts._pump is not None and wb.parts._pump is not None  # both use the channel, not the steps
    finally:
        for s, w in engines:
            w.shutdown()
            s.shutdown()
    assert not any(Path(p).exists() for p in paths)  # each scheduler removed its own socket
    shutil.rmtree(run, ignore_errors=True)
