"""Who counts a failed load, and how often (review 2026-12-03), through vLLM's real ``Scheduler`` with the connector's
real scheduler role over a real G3 pool; the workers' step outputs are those ``WorkerSide`` sends (invalid block ids,
:class:`FailedLoad`, interval stats), aggregated across TP ranks by vLLM's own ``KVOutputAggregator``.

* Under vLLM's ``MultiConnector`` a request another member failed to load (``failed_recving``, which every member is
  handed) was this connector's failure: counted ``load_failed_requests`` and refused the G3 hit it had when vLLM asked
  again.
* ``vllm:kvbm_backend_onboard_failed_blocks`` was TP rank 0's count of failed blocks: a load only rank 1 failed, which
  the engine recomputed, read 0.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,  # noqa: E402
                                                               SupportsHMA)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from tests.helpers.vllm_g3_load import (BS, PromCounters, TpSteps, a_loading, g3_scheduler,  # noqa: E402
                                        interval_data, load_output, our_loads, ours, request_a_held_in_g3,
                                        step_until)
from tests.helpers.vllm_sched import runner_output  # noqa: E402

pytestmark = [pytest.mark.vllm]


class OtherConnector(KVConnectorBase_V1, SupportsHMA):
    """Another ``MultiConnector`` member (as NIXL or LMCache): offers every prompt whole, loaded asynchronously, the
    first time it is asked about a request; its loads are reported by the test's worker outputs."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.asked: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id in self.asked:
            return 0, False
        self.asked.add(request.request_id)
        return len(request.prompt_token_ids) - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self):
        pass


def _scheduler(tmp, multi: bool):
    """vLLM's Scheduler of the tiny model with our connector over a G3 pool (:func:`g3_scheduler`), alone or second
    in a ``MultiConnector`` behind :class:`OtherConnector`."""
    other = {"kv_connector": "OtherConnector", "kv_connector_module_path": __name__, "kv_role": "kv_both"}
    return g3_scheduler(tmp, before=(other,) if multi else ())


def test_a_request_another_multiconnector_member_failed_to_load_is_not_our_failed_load(tmp_path):
    """MultiConnector [another connector, ours]: the other member offers A's prompt and loads it (ours, holding A's 8
    blocks in G3, is allocated no external tokens); its load fails and vLLM reports A in ``failed_recving``, which
    MultiConnector hands every member. Before: counted ours (``load_failed_requests`` + 1) and A marked never to load
    again, so when vLLM recomputed A and asked once more, ours answered 0 though G3 held all 8 blocks. Now A is not
    ours: nothing counted, and on that retry ours offers A its G3 hit (a load of 8 blocks)."""
    s = _scheduler(tmp_path, multi=True)
    try:
        a, hs = request_a_held_in_g3(s)
        failed0 = stats.get("load_failed_requests") or 0
        s.add_request(a)
        so = step_until(s, lambda so: a.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert s.connector._requests_to_connector["A"] == 0 and not our_loads(so)  # the other member loads A
        # the workers: the other member's load of A finished, failed (recompute policy: A starts over)
        s.update_from_output(so, runner_output(s, so, KVConnectorOutput(finished_recving={"A"},
                                                                         failed_recving={"A"})))
        assert (stats.get("load_failed_requests") or 0) - failed0 == 0  # before: 1
        so = step_until(s, lambda so: bool(our_loads(so)) or "A" in so.num_scheduled_tokens)
        loads = our_loads(so)
        assert [(j.req_id, j.seq_hashes) for j in loads] == [("A", hs)]  # before: no load, A recomputed whole
    finally:
        s.connector.shutdown()


@pytest.mark.parametrize("rank0_fails_from", [None, 5])
def test_onboard_failed_blocks_counts_every_ranks_failed_blocks_once(tmp_path, rank0_fails_from):
    """TP 2: A's 8-block G3 load fails on rank 1 from block 2 on (rank 0: all verified, or failed from block 5),
    each rank reporting when its own load ends (rank 0 a step before rank 1). vLLM recomputes blocks 2..7, and
    ``vllm:kvbm_backend_onboard_failed_blocks`` (vLLM's Prometheus logger observing the stats the scheduler's outputs
    carry: every worker's and the scheduler connector's) reads 6. Before: TP rank 0's count of its own failed blocks,
    0 (or 3)."""
    s = _scheduler(tmp_path, multi=False)
    try:
        a, hs, job = a_loading(s)
        bpb = ours(s).sched.groups[0].ns.layout.bytes_per_block

        def rank_output(first_failed: int | None, rank: int) -> KVConnectorOutput:
            return load_output(job, hs, first_failed, data=interval_data(rank, first_failed, bpb))

        prom = PromCounters(s)
        step = TpSteps(s, prom).step
        idle = KVConnectorOutput()

        step([rank_output(rank0_fails_from, 0), idle])  # rank 0's load ended; rank 1's still runs
        step([idle, rank_output(2, 1)])                  # rank 1's ended: blocks 2.. failed there
        failed = prom.value("vllm:kvbm_backend_onboard_failed_blocks")
        assert failed == 6, failed  # blocks 2..7, each once; before: 0 (or rank 0's 3)
        assert a.num_computed_tokens == 2 * BS  # what vLLM kept: the blocks every rank verified
    finally:
        s.connector.shutdown()


def test_an_interval_counts_from_its_construction_not_the_processes_earlier_engines():
    """The counters are the process's: a connector made after another engine's in the same process (a second ``LLM``,
    a test after another) reported, in its first interval to vLLM, every count of the earlier ones (here: the 7 blocks
    an earlier engine loaded and the 4 that failed). Now an interval starts from the counts
    at its construction, the worker's and the scheduler's alike."""
    stats.add(load_blocks_ok=7, load_blocks_failed=4)
    worker = stats.Interval(first=True)
    assert worker.delta() == {}  # before: {"load_blocks_ok": 7, "load_blocks_failed": 4} (every earlier count)
    stats.add(load_blocks_ok=2)
    assert worker.delta() == {"load_blocks_ok": 2}
