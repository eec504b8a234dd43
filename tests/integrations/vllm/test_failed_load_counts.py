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

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,  # noqa: E402
                                                               SupportsHMA)
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta  # noqa: E402
from tests.helpers.vllm_sched import runner_output, tiny_scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a lookup); returns as soon as it does
BS, NBLK = 16, 64
OURS = {"kv_connector": "KvbmBackendConnector", "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


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


def _scheduler(tmp: Path, multi: bool) -> Scheduler:
    """vLLM's Scheduler of the tiny model (``uni`` executor, ``log_stats`` on: its outputs carry the connector stats
    vLLM's Prometheus logger observes) with our connector over a G3 pool, alone or second in a ``MultiConnector``
    behind :class:`OtherConnector`."""
    extra = {"kvbm_backend": {"model": "tiny", "g3": {"paths": [str(tmp / "g3")], "capacity_gb": 0.05,
                                                      "files_per_path": 1, "admission": {"policy": "all"}}}}
    ours = {**OURS, "kv_connector_extra_config": extra}
    if multi:
        other = {"kv_connector": "OtherConnector", "kv_connector_module_path": __name__, "kv_role": "kv_both"}
        ktc = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"connectors": [other, ours]})
    else:
        ktc = KVTransferConfig(**ours)
    return tiny_scheduler(tmp, extra, lambda kw, names: [KVCacheGroupSpec(names, FullAttentionSpec(**kw))],
                          block_size=BS, num_blocks=NBLK, batched_tokens=64, ktc=ktc, log_stats=True)


def _ours(s: Scheduler) -> KvbmBackendConnector:
    c = s.connector
    return c if isinstance(c, KvbmBackendConnector) else c._connectors[1]


def _request_a_held_in_g3(s: Scheduler):
    """Request A (8 full blocks and 5 more tokens) with its 8 blocks in our connector's G3: ``(A, its hashes)``."""
    init_none_hash(sha256_cbor)
    sd = _ours(s).sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    a = Request("A", list(range(1000, 1000 + 8 * BS)) + [7] * 5, SamplingParams(max_tokens=4), None, 0,
                block_hasher=get_request_block_hasher(BS, sha256_cbor))
    hs = [int(h) for h in sd._state(a).hashes]
    assert len(hs) == 8
    bpb = ns.layout.bytes_per_block
    assert g3.put(ns.keys(hs), [np.full(bpb, i, np.uint8) for i in range(8)]).result(HANG_S).written == 8
    g3.flush(HANG_S)
    return a, hs


def _step_until(s: Scheduler, done):
    """Schedule steps (empty worker outputs) until ``done(scheduler_output)``; returns that output."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        so = s.schedule()
        if done(so):
            return so
        s.update_from_output(so, runner_output(s, so))
        time.sleep(0.01)
    raise AssertionError("never happened")


def _our_loads(so) -> list:
    meta = so.kv_connector_metadata
    meta = meta.metadata[1] if hasattr(meta, "metadata") else meta  # MultiConnector: one metadata per member
    return list(meta.loads)


def test_a_request_another_multiconnector_member_failed_to_load_is_not_our_failed_load(tmp_path):
    """MultiConnector [another connector, ours]: the other member offers A's prompt and loads it (ours, holding A's 8
    blocks in G3, is allocated no external tokens); its load fails and vLLM reports A in ``failed_recving``, which
    MultiConnector hands every member. Before: counted ours (``load_failed_requests`` + 1) and A marked never to load
    again, so when vLLM recomputed A and asked once more, ours answered 0 though G3 held all 8 blocks. Now A is not
    ours: nothing counted, and on that retry ours offers A its G3 hit (a load of 8 blocks)."""
    s = _scheduler(tmp_path, multi=True)
    try:
        a, hs = _request_a_held_in_g3(s)
        failed0 = stats.get("load_failed_requests") or 0
        s.add_request(a)
        so = _step_until(s, lambda so: a.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        assert s.connector._requests_to_connector["A"] == 0 and not _our_loads(so)  # the other member loads A
        # the workers: the other member's load of A finished, failed (recompute policy: A starts over)
        s.update_from_output(so, runner_output(s, so, KVConnectorOutput(finished_recving={"A"},
                                                                         failed_recving={"A"})))
        assert (stats.get("load_failed_requests") or 0) - failed0 == 0  # before: 1
        so = _step_until(s, lambda so: bool(_our_loads(so)) or "A" in so.num_scheduled_tokens)
        loads = _our_loads(so)
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
        a, hs = _request_a_held_in_g3(s)
        s.add_request(a)
        so = _step_until(s, lambda so: bool(_our_loads(so)))
        (job,) = _our_loads(so)
        assert job.req_id == "A" and job.seq_hashes == hs and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        bpb = _ours(s).sched.groups[0].ns.layout.bytes_per_block

        def rank_output(first_failed: int | None, rank: int) -> KVConnectorOutput:
            ok = 8 if first_failed is None else first_failed
            data = {"load_bytes": ok * bpb, "load_jobs": 1}  # what each rank's stats.Interval reports
            if rank == 0:  # block counters: the engine's first worker only
                data.update(load_blocks_ok=ok, load_blocks_failed=8 - ok)
            return KVConnectorOutput(
                finished_recving={"A"}, invalid_block_ids=set(job.block_ids[ok:]),
                kv_connector_stats=stats.KvbmConnectorStats(data=data),
                kv_connector_worker_meta=KvbmWorkerMeta(failed=[FailedLoad("A", "", hs[ok], "miss")])
                if first_failed is not None else None)

        agg = KVOutputAggregator(expected_finished_count=2)
        idle = KVConnectorOutput()
        reg = CollectorRegistry()
        prom = KvbmBackendConnector.build_prom_metrics(
            s.vllm_config, {Counter: functools.partial(Counter, registry=reg), Gauge: Gauge, Histogram: Histogram},
            ["model_name", "engine"], {0: ["m", "0"]})

        def step(outs: list[KVConnectorOutput]) -> None:
            sched_out = s.schedule()
            merged = agg.aggregate([runner_output(s, sched_out, o) for o in outs])
            for eco in s.update_from_output(sched_out, merged).values():
                if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                    prom.observe(eco.scheduler_stats.kv_connector_stats, engine_idx=0)

        step([rank_output(rank0_fails_from, 0), idle])  # rank 0's load ended; rank 1's still runs
        step([idle, rank_output(2, 1)])                  # rank 1's ended: blocks 2.. failed there
        failed = reg.get_sample_value("vllm:kvbm_backend_onboard_failed_blocks_total", {"model_name": "m", "engine": "0"})
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
