"""``vllm:kvbm_backend_onboard_failed_blocks`` counts what vLLM actually drops of a failed load (review of a0de06e,
2026-12-03), through vLLM's real ``Scheduler`` with the connector's real scheduler role over a real G3 pool; the
workers' step outputs are those ``WorkerSide`` sends (invalid block ids or ``failed_recving``, :class:`FailedLoad`),
aggregated across TP ranks by vLLM's own ``KVOutputAggregator``, and the counters are vLLM's Prometheus logger's
view of the stats the scheduler's outputs carry.

* ``failed_recving`` (models without block-level load errors): vLLM recomputes the whole request (its computed tokens
  set to 0), yet only the blocks from the reported first failed one on were counted (3 of an 8-block load).
* ``kv_load_failure_policy: fail`` (vLLM's default): vLLM finishes the request (``FINISHED_ERROR``) before it hands
  the connector the step's failure reports, which then found no load: 0 counted (a layer-wise load counted its 8
  blocks loaded).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta  # noqa: E402
from tests.helpers.vllm_g3_load import (PromCounters, TpSteps, a_loading, g3_scheduler,  # noqa: E402
                                        load_output, our_loads, ours, request_a_held_in_g3, step_until)
from tests.helpers.vllm_sched import runner_output  # noqa: E402

pytestmark = [pytest.mark.vllm]



@pytest.mark.parametrize(("policy", "recv_failed", "rank0_fails_from", "rank1_fails_from", "failed", "status"), [
    ("recompute", True, 5, None, 8, RequestStatus.RUNNING),       # before: 3 (the reported blocks 5..7 only)
    ("recompute", True, 5, 2, 8, RequestStatus.RUNNING),          # before: 6
    ("fail", True, 5, None, 8, RequestStatus.FINISHED_ERROR),     # before: 3
    ("fail", False, 5, None, 3, RequestStatus.FINISHED_ERROR),    # before: 0 (errored before rank 0's report)
    ("fail", False, 5, 2, 6, RequestStatus.FINISHED_ERROR),       # before: 0 (rank 1's later report: blocks 2..4)
    ("fail", False, None, 2, 6, RequestStatus.FINISHED_ERROR),    # before: 0
], ids=["recompute-recving", "recompute-recving-both", "fail-recving", "fail-blocks-rank0",
        "fail-blocks-rank0-then-rank1", "fail-blocks-rank1"])
def test_failed_blocks_are_what_vllm_recomputes_or_errors(tmp_path, policy, recv_failed, rank0_fails_from,
                                                          rank1_fails_from, failed, status):
    """TP 2: A's 8-block G3 load ends on rank 0 a step before rank 1, each rank failing from the given block on (or
    not), reported as invalid block ids or (``recv_failed``) in ``failed_recving``. ``onboard_failed_blocks`` reads
    ``failed``: every block of a ``failed_recving`` load (vLLM recomputes, or errors, it whole), the blocks from the
    first any rank failed on of a load whose request errored (``kv_load_failure_policy: fail``: vLLM finished A
    before the failure report reached the connector); each block once, none counted loaded when A errored."""
    s = g3_scheduler(tmp_path, policy)
    try:
        a, hs, job = a_loading(s)

        def rank_output(first_failed: int | None) -> KVConnectorOutput:
            return load_output(job, hs, first_failed, recv_failed=recv_failed)

        prom = PromCounters(s)
        step = TpSteps(s, prom).step
        idle = KVConnectorOutput()

        step([rank_output(rank0_fails_from), idle])  # rank 0's load ended; rank 1's still runs
        step([idle, rank_output(rank1_fails_from)])  # rank 1's ended: vLLM has every rank's report
        for _ in range(3):  # A scheduled again (recompute), its stats observed
            step([idle, idle])
        assert a.status == status  # what vLLM did with A
        if status == RequestStatus.RUNNING:
            assert a.num_computed_tokens > 0  # recomputed from its first token
        onboard, nfailed = prom.counts()
        assert nfailed == failed, (onboard, nfailed)  # before: 3 or 6 (failed_recving), 0 (errored)
        assert onboard == 0, (onboard, nfailed)  # vLLM used no block of the load
        step([idle, idle])
        assert prom.counts() == (onboard, nfailed)  # each once
    finally:
        s.connector.shutdown()


def test_a_layerwise_load_that_errors_its_request_counts_failed_not_loaded(tmp_path):
    """``g3.layerwise_load`` with ``kv_load_failure_policy: fail``: A's 8-block G3 load, run in the step that
    schedules A, fails from block 3; vLLM errors A in that step's output before the connector sees the failure report.
    Before, the finished request settled its load as all 8 loaded and the report counted nothing: (8, 0)."""
    s = g3_scheduler(tmp_path, "fail", layerwise=True)
    try:
        assert ours(s).sched.layerwise
        a, hs = request_a_held_in_g3(s)
        s.add_request(a)
        prom = PromCounters(s)
        so = step_until(s, lambda so: bool(our_loads(so)))
        (job,) = our_loads(so)
        assert job.layerwise and "A" in so.num_scheduled_tokens  # loaded in this step
        out = KVConnectorOutput(invalid_block_ids=set(job.block_ids[3:]),
                                kv_connector_worker_meta=KvbmWorkerMeta(failed=[FailedLoad("A", "", hs[3], "miss")]))
        prom.observe(s.update_from_output(so, runner_output(s, so, out)))
        assert a.status == RequestStatus.FINISHED_ERROR
        for _ in range(2):
            so = s.schedule()
            prom.observe(s.update_from_output(so, runner_output(s, so)))
        assert prom.counts() == (0, 5)  # before: (8, 0)
    finally:
        s.connector.shutdown()


def test_failed_recving_counts_every_groups_blocks_once():
    """A model of two KV cache groups (no block-level errors: ``failed_recving``): a load of 8 full-attention blocks
    and a 3-block window, the window's group reported failed from its 2nd block. vLLM recomputes the request whole:
    all 11 blocks count failed, each once (the earlier report's 2 included), none loaded. Before: 2 (the report's)."""
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.load_failures import FAILED_BLOCKS, LOADED_BLOCKS, FailedBlockCount

    hashes = list(range(100, 110))
    c = FailedBlockCount()
    before = stats.get(FAILED_BLOCKS), stats.get(LOADED_BLOCKS)
    c.planned("A", 0, range(0, 8))
    c.planned("A", 1, [5, 6, 7])
    assert c.failed("A", 1, hashes, hashes[6]) == 2
    c.loaded_none("A")  # the step's failed_recving (after its reports)
    assert stats.get(FAILED_BLOCKS) - before[0] == 11  # before: 2
    assert c.failed("A", 0, hashes, hashes[3]) == 0  # a report after it: nothing left to count
    c.step({"A": 16})  # A scheduled again: its load settled
    c.forget("A")
    assert (stats.get(FAILED_BLOCKS) - before[0], stats.get(LOADED_BLOCKS) - before[1]) == (11, 0)
