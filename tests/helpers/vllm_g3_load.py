"""A G3 load of request A through vLLM's real ``Scheduler`` with our connector's scheduler role over a real G3 pool,
the TP ranks' step outputs played as ``WorkerSide`` sends them (invalid block ids or ``failed_recving``,
:class:`FailedLoad`, interval stats) and aggregated by vLLM's own ``KVOutputAggregator``, the counters read as vLLM's
Prometheus logger sees them (tests/integrations/vllm/test_failed_load_counts.py,
test_onboard_blocks_every_rank.py, test_onboard_failed_recomputed_or_errored.py)."""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvbm_backend.integrations.vllm import stats
from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta
from tests.helpers.vllm_sched import runner_output, tiny_scheduler

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a lookup); returns as soon as it does
BS, NBLK = 16, 64  # tokens a block, the engine's KV cache blocks
OURS = {"kv_connector": "KvbmBackendConnector", "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
A_BLOCKS = 8  # request A's full blocks, all held in G3


def g3_scheduler(tmp: Path, policy: str = "recompute", *, layerwise: bool = False,
                 before: tuple[dict[str, Any], ...] = ()) -> Scheduler:
    """vLLM's Scheduler of the tiny model (``uni`` executor, ``log_stats`` on: its outputs carry the connector stats
    vLLM's Prometheus logger observes) with our connector over a G3 pool in ``tmp / "g3"``, ``kv_load_failure_policy``
    ``policy``; ``layerwise``: ``g3.layerwise_load`` (a G3 hit loaded inside the step that schedules it; 256 tokens a
    step, else 64). ``before``: other connectors' configs (``kv_connector``, ``kv_connector_module_path``,
    ``kv_role``): ours then runs last in a ``MultiConnector`` behind them."""
    extra = {"kvbm_backend": {"model": "tiny", "g3": {"paths": [str(tmp / "g3")], "capacity_gb": 0.05,
                                                      "files_per_path": 1, "admission": {"policy": "all"},
                                                      "layerwise_load": layerwise}}}
    ours = {**OURS, "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}
    if before:
        ktc = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_load_failure_policy=policy,
                               kv_connector_extra_config={"connectors": [*before, ours]})
    else:
        ktc = KVTransferConfig(**ours)
    return tiny_scheduler(tmp, extra, lambda kw, names: [KVCacheGroupSpec(names, FullAttentionSpec(**kw))],
                          block_size=BS, num_blocks=NBLK, batched_tokens=256 if layerwise else 64, ktc=ktc,
                          log_stats=True)


def ours(s: Scheduler) -> KvbmBackendConnector:
    """Our connector of ``s`` (the last member of a ``MultiConnector``)."""
    c = s.connector
    return c if isinstance(c, KvbmBackendConnector) else c._connectors[-1]


def request_a_held_in_g3(s: Scheduler):
    """Request A (8 full blocks and 5 more tokens) with its 8 blocks in our connector's G3: ``(A, its hashes)``."""
    init_none_hash(sha256_cbor)
    sd = ours(s).sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    a = Request("A", list(range(1000, 1000 + A_BLOCKS * BS)) + [7] * 5, SamplingParams(max_tokens=4), None, 0,
                block_hasher=get_request_block_hasher(BS, sha256_cbor))
    hs = [int(h) for h in sd._state(a).hashes]
    assert len(hs) == A_BLOCKS
    bpb = ns.layout.bytes_per_block
    assert g3.put(ns.keys(hs), [np.full(bpb, i, np.uint8) for i in range(A_BLOCKS)]).result(HANG_S).written == A_BLOCKS
    g3.flush(HANG_S)
    return a, hs


def step_until(s: Scheduler, done: Callable[[Any], bool]):
    """Schedule steps (empty worker outputs) until ``done(scheduler_output)``; returns that output. AssertionError
    after ``HANG_S`` seconds (a hang guard)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        so = s.schedule()
        if done(so):
            return so
        s.update_from_output(so, runner_output(s, so))
        time.sleep(0.01)
    raise AssertionError("never happened")


def our_loads(so) -> list:
    """Our connector's load jobs in the scheduler output ``so``."""
    meta = so.kv_connector_metadata
    meta = meta.metadata[-1] if hasattr(meta, "metadata") else meta  # MultiConnector: one metadata per member
    return list(meta.loads)


def a_loading(s: Scheduler):
    """Request A held in G3 (:func:`request_a_held_in_g3`) added to ``s`` and stepped until our connector plans its
    load, checked: one load job, of A's 8 hashes, A waiting for it (``WAITING_FOR_REMOTE_KVS``). ``(A, its hashes,
    the load job)``."""
    a, hs = request_a_held_in_g3(s)
    s.add_request(a)
    so = step_until(s, lambda so: bool(our_loads(so)))
    (job,) = our_loads(so)
    assert job.req_id == "A" and job.seq_hashes == hs and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return a, hs, job


def interval_data(rank: int, first_failed: int | None, bytes_per_block: int, *, g3: bool = False) -> dict:
    """What TP rank ``rank``'s ``stats.Interval`` reports for its load of A's 8 blocks failing from block
    ``first_failed`` on (None: all verified): bytes and jobs on every rank, the block counters (``g3``: also
    ``load_g3_blocks_ok``) on the engine's first worker only."""
    ok = A_BLOCKS if first_failed is None else first_failed
    data = {"load_bytes": ok * bytes_per_block, "load_jobs": 1}
    if rank == 0:
        data.update(load_blocks_ok=ok, load_blocks_failed=A_BLOCKS - ok)
        if g3:
            data.update(load_g3_blocks_ok=ok)
    return data


def load_output(job, hashes: list[int], first_failed: int | None, *, recv_failed: bool = False,
                data: dict | None = None) -> KVConnectorOutput:
    """One TP rank's connector output in the step its load ``job`` (of ``hashes``) ends, failing from block
    ``first_failed`` on (None: all verified): the load finished, the failed blocks as invalid block ids or
    (``recv_failed``) the request in ``failed_recving``, the :class:`FailedLoad` report, ``data`` as its stats."""
    ok = len(hashes) if first_failed is None else first_failed
    bad = first_failed is not None
    return KVConnectorOutput(
        finished_recving={job.req_id}, invalid_block_ids=set() if recv_failed else set(job.block_ids[ok:]),
        failed_recving={job.req_id} if bad and recv_failed else set(),
        kv_connector_stats=None if data is None else stats.KvbmConnectorStats(data=data),
        kv_connector_worker_meta=KvbmWorkerMeta(failed=[FailedLoad(job.req_id, "", hashes[ok], "miss")]) if bad
        else None)


class PromCounters:
    """vLLM's Prometheus logger of the connector's counters (model ``m``, engine 0) on a registry of its own,
    observing every scheduler output it is given."""

    def __init__(self, s: Scheduler) -> None:
        self.reg = CollectorRegistry()
        self.prom = KvbmBackendConnector.build_prom_metrics(
            s.vllm_config, {Counter: functools.partial(Counter, registry=self.reg), Gauge: Gauge, Histogram: Histogram},
            ["model_name", "engine"], {0: ["m", "0"]})

    def observe(self, eco_by_client) -> None:
        """Observe the connector stats of ``update_from_output``'s result (engine core outputs by client)."""
        for eco in eco_by_client.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.prom.observe(eco.scheduler_stats.kv_connector_stats, engine_idx=0)

    def value(self, name: str) -> float | None:
        """Counter ``name``'s total (None: never observed)."""
        return self.reg.get_sample_value(f"{name}_total", {"model_name": "m", "engine": "0"})

    def counts(self) -> tuple[float | None, float | None]:
        """``(onboard_blocks, onboard_failed_blocks)``."""
        return tuple(self.value(f"vllm:kvbm_backend_{n}") for n in ("onboard_blocks", "onboard_failed_blocks"))


class TpSteps:
    """The engine's steps over ``ranks`` TP workers: each schedules, merges the ranks' outputs with vLLM's
    ``KVOutputAggregator``, hands the result to the scheduler and has ``prom`` observe it."""

    def __init__(self, s: Scheduler, prom: PromCounters, ranks: int = 2) -> None:
        self.s, self.prom = s, prom
        self.agg = KVOutputAggregator(expected_finished_count=ranks)

    def step(self, outs: list[KVConnectorOutput]):
        """One step, ``outs`` the ranks' connector outputs in rank order; returns the step's scheduler output."""
        s = self.s
        sched_out = s.schedule()
        self.prom.observe(s.update_from_output(sched_out, self.agg.aggregate([runner_output(s, sched_out, o)
                                                                              for o in outs])))
        return sched_out
