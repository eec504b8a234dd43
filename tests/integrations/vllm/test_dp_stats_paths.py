"""vLLM data parallelism (DP > 1): every DP rank is its own engine (an engine-core process with its scheduler and
its TP workers), each with its own connectors, all built from the one ``kv_transfer_config`` of the deployment
(``vllm serve --data-parallel-size N``): the same ``stats_path``. vLLM tells each engine its DP rank in
``parallel_config.data_parallel_index`` (``data_parallel_rank`` too for a MoE model; for a dense model it sets
``data_parallel_rank`` to 0 and ``data_parallel_size`` to 1 in every engine: ``reconfigure_for_independent_dp_rank``)
and appends ``_dp<r>`` to ``engine_id``.

Review finding (2026-12-04): the connector named its counters' files by TP rank alone, so every DP engine wrote
``stats_path`` (and its scheduler ``<stem>.scheduler<ext>``): each write replaced the other engines' counters, and
DP rank 0's worker merged whichever engine's scheduler file was written last. Now DP rank d > 0 adds ``.dp<d>`` to
the stem (``<stem>.dp<d><ext>``, ``<stem>.dp<d>.scheduler<ext>``, ``<stem>.dp<d>.rank<r><ext>``); DP rank 0 keeps
the plain names.

Real connectors (``KvbmBackendConnector``, the ``mp`` executor's split: scheduler and worker roles in their own
processes in vLLM, here both roles of both engines in one), vLLM's own ``ParallelConfig`` set up as vLLM's engine
core sets it for each DP rank, G4 on a ``file://`` store (a DP deployment's one config cannot give the engines
distinct G3 paths: docs/operations.md)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.side]  # no wall-clock assertion: the side lane (docs/testing.md)

BS, H, D, NB = 16, 2, 64, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
DP = 2


def _parallel_config(dp_rank: int, moe: bool) -> ParallelConfig:
    """DP rank ``dp_rank``'s parallel config as vLLM's ``EngineCoreProc.run_engine_core`` leaves it (vLLM 0.32)."""
    pc = ParallelConfig(data_parallel_size=DP, data_parallel_rank=dp_rank, distributed_executor_backend="mp")
    pc.data_parallel_index = dp_rank
    if not moe:  # dense: the DP ranks are independent engines
        pc.reconfigure_for_independent_dp_rank()
    return pc


def _engine(root: Path, stats_path: Path, dp_rank: int, moe: bool):
    extra = {"stats_path": str(stats_path),
             "kvbm_backend": {"model": "kvbm-backend/dp-test", "g3": {"enabled": False},
                              "g4": {"enabled": True, "url": f"file://{root / 'g4'}", "encrypt": False}}}
    ktc = KVTransferConfig(kv_connector="KvbmBackendConnector", engine_id=f"dp-engine_dp{dp_rank}",
                           kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    vc = SimpleNamespace(kv_transfer_config=ktc, kv_events_config=None,
                         model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=_parallel_config(dp_rank, moe),
                         cache_config=SimpleNamespace(cache_dtype="auto"))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    return (KvbmBackendConnector(vc, KVConnectorRole.SCHEDULER, kcc),
            KvbmBackendConnector(vc, KVConnectorRole.WORKER, kcc))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_each_dp_engine_writes_its_own_stats_files(tmp_path, moe):
    out = tmp_path / "s"
    path = out / "kvbm.json"
    stats.reset()
    engines = [_engine(tmp_path, path, r, moe) for r in range(DP)]
    try:
        stats.add(lookup_requests=3, load_blocks_ok=5)
    finally:
        for s, w in engines:
            w.shutdown()  # writes the worker's file, merging its scheduler's as it was at its last write
            s.shutdown()
        stats.reset()
    names = sorted(p.name for p in out.iterdir())
    # before: ['kvbm.json', 'kvbm.scheduler.json'], every DP engine's counters written over the others'
    assert names == ["kvbm.dp1.json", "kvbm.dp1.scheduler.json", "kvbm.json", "kvbm.scheduler.json"], names
    for name in names:
        assert json.loads((out / name).read_text())["lookup_requests"] == 3, name


def test_tp_ranks_of_a_dp_engine_keep_their_dp_rank_in_the_name(tmp_path):
    """TP rank r > 0 of DP engine d > 0 writes ``<stem>.dp<d>.rank<r><ext>``; DP rank 0's ranks keep their names.
    The DP rank is vLLM's ``data_parallel_index`` (a dense model's ``data_parallel_rank`` is 0 in every engine)."""
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, _stats_writer, dp_index
    for moe in (False, True):
        assert [dp_index(SimpleNamespace(parallel_config=_parallel_config(r, moe))) for r in range(DP)] == [0, 1]
    assert dp_index(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))) == 0  # no DP fields
    path = str(tmp_path / "kvbm.json")
    got = {}
    for dp in (0, 1):
        for rank in (0, 1):
            parts = ConnectorParts()
            parts.rank, parts.pool_stats = rank, lambda: {}
            for role, scheduler in (("worker", False), ("scheduler", True)):
                w = _stats_writer(parts, path, split=True, scheduler=scheduler, dp=dp)
                got[(dp, rank, role)] = (w.path and Path(w.path).name, w.merge and Path(w.merge).name)
                w.stop()
    assert got == {(0, 0, "worker"): ("kvbm.json", "kvbm.scheduler.json"),
                   (0, 0, "scheduler"): ("kvbm.scheduler.json", None),
                   (0, 1, "worker"): ("kvbm.rank1.json", None),
                   (0, 1, "scheduler"): ("kvbm.scheduler.json", None),
                   (1, 0, "worker"): ("kvbm.dp1.json", "kvbm.dp1.scheduler.json"),
                   (1, 0, "scheduler"): ("kvbm.dp1.scheduler.json", None),
                   (1, 1, "worker"): ("kvbm.dp1.rank1.json", None),
                   (1, 1, "scheduler"): ("kvbm.dp1.scheduler.json", None)}, got
