"""The connector's per-interval stats under TP > 1: vLLM sums every worker's ``KvbmConnectorStats``
(``KVOutputAggregator``) and each TP rank moves its slice of every block, so the ``vllm:kvbm_backend_*_blocks``
counters count each block once only when one worker reports block counts (the engine's first: TP rank 0, PP
rank 0). Before 2026-11-30 every rank reported them: 10 blocks loaded at TP 4 read 40."""
from __future__ import annotations

import functools
import socket
from types import SimpleNamespace

import pytest

from kvbm_backend.integrations.vllm import stats

HANG_S = 600.0  # a hang guard, not a bound: waits for worker processes that must answer; returns as soon as they do


def _aggregate_like_vllm(per_rank: list[stats.KvbmConnectorStats]):
    """vLLM's own aggregation of the workers' outputs (what the engine core hands to the Prometheus logger)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    outs = [ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
                              prompt_logprobs_dict={}, pooler_output=None,
                              kv_connector_output=KVConnectorOutput(kv_connector_stats=s)) for s in per_rank]
    agg = KVOutputAggregator(len(per_rank)).aggregate(outs)
    return agg.kv_connector_output.kv_connector_stats


def test_block_counters_count_each_block_once_when_vllm_sums_the_tp_workers():
    """TP 4: each rank loads and saves its slice of 10 blocks. After vLLM's sum, the Prometheus block counters
    read 10 (blocks of KV offloaded; blocks loaded are the scheduler's count), the byte counter every rank's bytes."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    tp, blocks, rank_bytes = 4, 10, 10 * 65536
    ivs = [stats.Interval(first=(r == 0)) for r in range(tp)]
    for iv in ivs:
        iv.delta()
    # the counters are this process's: one add stands for what each rank's worker counts in its own process
    stats.add(load_blocks_ok=blocks, load_g3_blocks_ok=blocks, load_bytes=rank_bytes, save_blocks=blocks,
              g3_put_written_blocks=blocks, g3_put_written_bytes=rank_bytes, save_jobs=1)
    per_rank = [stats.KvbmConnectorStats(data=iv.delta()) for iv in ivs]
    assert "load_blocks_ok" not in per_rank[1].data and per_rank[1].data["load_bytes"] == rank_bytes
    total = _aggregate_like_vllm(per_rank)
    reg = CollectorRegistry()
    prom = stats.KvbmPromMetrics(SimpleNamespace(kv_transfer_config=None), {Counter: functools.partial(Counter, registry=reg), Gauge: Gauge,
                                        Histogram: Histogram}, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(total.data, engine_idx=0)

    def val(name):
        return reg.get_sample_value(f"{name}_total", {"model_name": "m", "engine": "0"})
    # onboard_blocks: the scheduler's count since 2026-12-03 (test_onboard_blocks_every_rank.py), not the workers'
    assert val("vllm:kvbm_backend_onboard_blocks") == 0
    assert val("vllm:kvbm_backend_offload_blocks") == blocks
    assert val("vllm:kvbm_backend_g3_written_blocks") == blocks
    assert val("vllm:kvbm_backend_onboard_bytes") == tp * rank_bytes
    r = total.reduce()
    assert r["load_g3_blocks_ok"] == blocks and r["save_jobs"] == tp  # vLLM's log line: blocks once, jobs per rank


def _rank_worker(rank: int, port: int, q) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
    iv = stats.Interval()  # as the connector makes it: which worker it is comes from vLLM's TP group
    iv.delta()
    stats.add(load_blocks_ok=10, load_bytes=10 * 4096)
    q.put((rank, iv.delta()))


@pytest.mark.slow
def test_only_tp_rank_0_reports_block_counters_in_a_real_vllm_tp_group():
    """Two processes in a real vLLM TP group of 2 (gloo, CPU): the connector's default interval stats carry the
    block counters on TP rank 0 only, the bytes on both."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank_worker, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        got = dict(q.get(timeout=HANG_S) for _ in ps)
    finally:
        for p in ps:
            p.join(HANG_S)
    assert got[0] == {"load_blocks_ok": 10, "load_bytes": 10 * 4096}
    assert got[1] == {"load_bytes": 10 * 4096}
