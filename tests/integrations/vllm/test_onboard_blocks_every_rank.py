"""``vllm:kvbm_backend_onboard_blocks`` counts the blocks every TP rank loaded, each once (review 2026-12-03), through
vLLM's real ``Scheduler`` with the connector's real scheduler role over a real G3 pool; the workers' step outputs are
those ``WorkerSide`` sends (invalid block ids, :class:`FailedLoad`, interval stats with TP rank 0's block counters),
aggregated across TP ranks by vLLM's own ``KVOutputAggregator``, and the counters are vLLM's Prometheus logger's view
of the stats the scheduler's outputs carry (every worker's and the scheduler connector's).

Before, ``onboard_blocks`` was TP rank 0's ``load_blocks_ok``: a block rank 0 loaded but rank 1 failed to load (vLLM
recomputes it) counted in ``onboard_blocks`` and in ``onboard_failed_blocks``.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta  # noqa: E402
from tests.helpers.vllm_g3_load import (BS, PromCounters, TpSteps, a_loading, g3_scheduler,  # noqa: E402
                                        interval_data, load_output, our_loads, ours, request_a_held_in_g3,
                                        step_until)
from tests.helpers.vllm_sched import runner_output  # noqa: E402

pytestmark = [pytest.mark.vllm]


@pytest.mark.parametrize(("rank0_fails_from", "rank1_fails_from", "recv_failed", "loaded"), [
    (None, 2, False, 2),   # before: 8 (rank 0 loaded all 8; blocks 2..7 counted loaded and failed)
    (5, 2, False, 2),      # before: 5
    (2, None, False, 2),
    (None, None, False, 8),
    (None, 5, True, 0),    # failed_recving (a model without block-level errors): recomputed whole; before: 8
], ids=["rank1-only", "both-rank1-first", "rank0-only", "none-failed", "failed-recving"])
def test_onboard_blocks_counts_what_every_rank_loaded_once(tmp_path, rank0_fails_from, rank1_fails_from, recv_failed,
                                                           loaded):
    """TP 2: A's 8-block G3 load ends on rank 0 a step before rank 1, each rank failing from the given block on (or
    not). vLLM keeps the blocks before the first one any rank failed on (``loaded``), and once it schedules A again
    ``vllm:kvbm_backend_onboard_blocks`` reads ``loaded`` (each block once) and ``onboard_failed_blocks`` what the
    ranks' reports failed, so a block never counts in both."""
    s = g3_scheduler(tmp_path)
    try:
        a, hs, job = a_loading(s)
        bpb = ours(s).sched.groups[0].ns.layout.bytes_per_block

        def rank_output(first_failed: int | None, rank: int) -> KVConnectorOutput:
            return load_output(job, hs, first_failed, recv_failed=recv_failed,
                               data=interval_data(rank, first_failed, bpb, g3=True))

        prom = PromCounters(s)
        step = TpSteps(s, prom).step
        idle = KVConnectorOutput()
        val = prom.value

        step([rank_output(rank0_fails_from, 0), idle])  # rank 0's load ended; rank 1's still runs
        step([idle, rank_output(rank1_fails_from, 1)])  # rank 1's ended: vLLM has every rank's report
        assert a.num_computed_tokens == loaded * BS  # what vLLM kept
        so = step([idle, idle])  # A scheduled again: its load is settled
        assert "A" in so.num_scheduled_tokens
        step([idle, idle])  # (the scheduler's stats of that step reach the logger with its output)
        onboard = val("vllm:kvbm_backend_onboard_blocks")
        failed = val("vllm:kvbm_backend_onboard_failed_blocks")
        assert onboard == loaded, (onboard, failed)  # before: rank 0's count (8, or 5)
        if not recv_failed:
            assert onboard + failed == 8, (onboard, failed)  # each block in one of them, never both
        step([idle, idle])
        assert val("vllm:kvbm_backend_onboard_blocks") == loaded  # counted once
    finally:
        s.connector.shutdown()


def test_a_load_of_a_request_aborted_while_it_ran_is_not_counted_loaded(tmp_path):
    """A is aborted while its TP 2 load runs: vLLM never uses the blocks (it frees them when every rank is done), so
    ``onboard_blocks`` does not count them, though rank 0 reported all 8 loaded."""
    s = g3_scheduler(tmp_path)
    try:
        a, _ = request_a_held_in_g3(s)
        s.add_request(a)
        step_until(s, lambda so: bool(our_loads(so)))
        prom = PromCounters(s)
        steps = TpSteps(s, prom)
        s.finish_requests("A", RequestStatus.FINISHED_ABORTED)
        done = KVConnectorOutput(finished_recving={"A"},
                                 kv_connector_stats=stats.KvbmConnectorStats(data={"load_blocks_ok": 8}))
        for outs in ([done, KVConnectorOutput()], [KVConnectorOutput(), KVConnectorOutput(finished_recving={"A"})],
                     [KVConnectorOutput(), KVConnectorOutput()]):
            steps.step(outs)
        assert "A" not in s.requests
        assert prom.value("vllm:kvbm_backend_onboard_blocks") == 0
    finally:
        s.connector.shutdown()


@pytest.mark.parametrize(("fails_from", "max_tokens", "loaded"), [(None, 4, 8), (3, 4, 3), (None, 1, 8)],
                         ids=["verified", "failed-from-3", "finished-in-its-step"])
def test_a_layerwise_load_is_counted_after_its_step(tmp_path, fails_from, max_tokens, loaded):
    """``g3.layerwise_load`` (one rank, no async scheduling): A's 8-block G3 hit is loaded inside the step that
    schedules it, its failures reported in that step's output. ``onboard_blocks`` counts what vLLM kept once that
    output is in (at the next step), also when the output finishes A (``max_tokens`` 1: its step is its last)."""
    s = g3_scheduler(tmp_path, layerwise=True)
    try:
        assert ours(s).sched.layerwise
        a, hs = request_a_held_in_g3(s)
        a.max_tokens = max_tokens
        s.add_request(a)
        prom = PromCounters(s)
        observe = prom.observe
        so = step_until(s, lambda so: bool(our_loads(so)))
        (job,) = our_loads(so)
        assert job.layerwise and "A" in so.num_scheduled_tokens  # loaded in this step
        ok = 8 if fails_from is None else fails_from
        out = KVConnectorOutput(
            invalid_block_ids=set(job.block_ids[ok:]),
            kv_connector_stats=stats.KvbmConnectorStats(data={"load_blocks_ok": ok, "load_blocks_failed": 8 - ok}),
            kv_connector_worker_meta=KvbmWorkerMeta(failed=[FailedLoad("A", "", hs[ok], "miss")])
            if fails_from is not None else None)
        observe(s.update_from_output(so, runner_output(s, so, out)))
        assert ("A" not in s.requests) is (max_tokens == 1)
        for _ in range(2):
            so = s.schedule()
            observe(s.update_from_output(so, runner_output(s, so)))
        onboard = prom.value("vllm:kvbm_backend_onboard_blocks")
        assert onboard == loaded
    finally:
        s.connector.shutdown()
