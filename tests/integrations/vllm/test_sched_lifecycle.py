"""Request lifecycle through vLLM's real ``Scheduler`` (vLLM 0.32's KV cache manager, prefix cache and
``kv_load_failure_policy``) with the connector's real scheduler role and a real G3 pool; the worker's step outputs
are the ones :class:`~kvbm_backend.integrations.vllm.worker_side.WorkerSide` / ``LayerwiseLoads`` send (invalid
block ids, :class:`FailedLoad`)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta  # noqa: E402
from tests.helpers.vllm_sched import runner_output, tiny_scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a G3 put, a lookup); returns as soon as it does
BS, NBLK = 16, 64


def _scheduler(tmp: Path) -> Scheduler:
    """vLLM's Scheduler with KvbmBackendConnector (``uni`` executor: the scheduler role uses the G3 pool itself),
    ``g3.layerwise_load`` on, ``kv_load_failure_policy`` ``recompute``, 64 tokens a step."""
    extra = {"kvbm_backend": {"model": "tiny", "g3": {
        "paths": [str(tmp / "g3")], "capacity_gb": 0.05, "files_per_path": 1, "admission": {"policy": "all"},
        "layerwise_load": True}}}
    return tiny_scheduler(tmp, extra, lambda kw, names: [KVCacheGroupSpec(names, FullAttentionSpec(**kw))],
                          block_size=BS, num_blocks=NBLK, batched_tokens=64)


def _a_held_in_g3(s: Scheduler):
    """Request A (an 8-block prefix and 5 more tokens, vLLM's SHA-256 block hasher) with its 8 blocks in the
    connector's G3: ``(scheduler side, g3, namespace, hasher, prefix tokens, A, A's sequence hashes)``."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    sd = s.connector.sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    prefix = list(range(1000, 1000 + 8 * BS))
    a = Request("A", prefix + [7] * 5, SamplingParams(max_tokens=4), None, 0, block_hasher=hasher)
    hs = [int(h) for h in sd._state(a).hashes]
    assert len(hs) == 8
    bpb = ns.layout.bytes_per_block
    assert g3.put(ns.keys(hs), [np.full(bpb, i, np.uint8) for i in range(8)]).result(HANG_S).written == 8
    g3.flush(HANG_S)
    return sd, g3, ns, hasher, prefix, a, hs


def _output(s: Scheduler, so, invalid=(), failed=()) -> ModelRunnerOutput:
    """The step output a worker sends (:func:`runner_output`) with the connector's load report."""
    return runner_output(s, so, KVConnectorOutput(
        invalid_block_ids=set(invalid),
        kv_connector_worker_meta=KvbmWorkerMeta(failed=list(failed)) if failed else None))


def _schedule_until(s: Scheduler, rid: str):
    """Step (empty outputs) until ``rid`` is scheduled: the connector answers once its lookup is done."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        so = s.schedule()
        if rid in so.num_scheduled_tokens:
            return so
        s.update_from_output(so, _output(s, so))
        time.sleep(0.01)
    raise AssertionError(f"{rid} never scheduled")


@pytest.mark.parametrize("reason", ["miss", "timeout"])
def test_a_failed_layerwise_load_leaves_no_unloaded_block_in_the_engines_prefix_cache(tmp_path, reason):
    """Review finding 2026-11-30 (request lifecycle): vLLM caches a synchronous (layer-wise) load's blocks when
    it schedules it, and with ``kv_load_failure_policy`` ``recompute`` only cuts the failed request back, leaving
    the blocks that never loaded in its prefix cache for that request to recompute. Request A's load fails from
    block 2 on and A is aborted before recomputing: request B with the same prefix then had a local prefix hit
    of all 8 blocks (KV never loaded: B's output computed from it), and the connector offered blocks 2..7 to G3
    from B's engine blocks (``_plan_local_save``, when G3 had dropped them as unreadable): wrong KV stored under
    the right hashes. Now the connector removes A's blocks from the first failed one on from vLLM's prefix cache
    (the scheduler's bound ``BlockPool``): B hits blocks 0..1 only, computes 2.. itself, and no save offers an
    engine block A's load failed to fill."""
    s = _scheduler(tmp_path)
    try:
        sd, g3, ns, hasher, prefix, a, hs = _a_held_in_g3(s)

        s.add_request(a)
        so = _schedule_until(s, "A")
        a_blocks = list(s.kv_cache_manager.get_block_ids("A")[0])
        (job,) = so.kv_connector_metadata.loads
        assert job.layerwise and job.block_ids == a_blocks[:8] and so.num_scheduled_tokens["A"] == 5
        # the worker: blocks 2.. of A's layer-wise load failed (a miss: G3 dropped the unreadable slots, as
        # WorkerSide.drop_unreadable does; a timeout: G3 still holds them)
        if reason == "miss":
            assert g3.delete(ns.keys(hs[2:])).result(HANG_S) == 6
        s.update_from_output(so, _output(s, so, invalid=a_blocks[2:8], failed=[FailedLoad("A", "", hs[2], reason)]))
        assert a.num_computed_tokens == 2 * BS  # vLLM cut A back to its valid prefix
        s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # the client left before A recomputed

        b = Request("B", prefix + [9] * 5, SamplingParams(max_tokens=4), None, 0, block_hasher=hasher)
        assert s.kv_cache_manager.get_computed_blocks(b)[1] == 2 * BS  # vLLM's own prefix hit; before: 8 * BS
        s.add_request(b)
        so = _schedule_until(s, "B")
        (nb,) = so.scheduled_new_reqs
        meta = so.kv_connector_metadata
        saved = [(blk, h) for j in meta.saves for blk, h in zip(j.block_ids, j.seq_hashes)]
        loaded = [(blk, h) for j in meta.loads for blk, h in zip(j.block_ids, j.seq_hashes)]
        if reason == "miss":  # G3 lacks 2..7: B computes them (64 tokens this step: blocks 2..5) and saves those
            assert nb.num_computed_tokens == 2 * BS and not loaded  # before: 8 * BS, blocks 2..7 never loaded
            assert saved == list(zip(nb.block_ids[0][2:6], hs[2:6]))  # before: A's unloaded blocks 2..7 offered
        else:  # G3 still holds 2..7 (a timeout is not a miss): B loads them into its own blocks
            assert loaded == list(zip(nb.block_ids[0][2:8], hs[2:8])) and not saved
    finally:
        s.shutdown()


def test_a_request_that_shared_a_failed_layerwise_loads_blocks_saves_nothing_computed_on_them(tmp_path):
    """Review finding 2026-11-30 (request lifecycle): request C scheduled in the same step as A's synchronous
    (layer-wise) G3 load takes A's blocks, which vLLM caches at allocation, as its local prefix hit. A's load fails
    from block 2 on; vLLM (``recompute``) rolls C back to before the step but leaves C on A's blocks, for A to
    recompute; A is aborted first. C then computes its later blocks on KV that never loaded, and the connector
    offered them (blocks 11..13 and its decode blocks, ``_plan_save``) to G3/G4 under their right hashes: wrong
    KV served to later requests (the worker's guard drops only saves of the failed step and of A). Now C is
    tainted from its first block A's load failed to fill: none of its blocks from there on is saved."""
    s = _scheduler(tmp_path)
    try:
        sd, g3, ns, hasher, prefix, a, hs = _a_held_in_g3(s)
        c = Request("C", prefix + list(range(5000, 5000 + 6 * BS)) + [9] * 5, SamplingParams(max_tokens=4), None,
                    0, block_hasher=hasher)
        hc = [int(h) for h in sd._state(c).hashes]
        assert hc[:8] == hs and len(hc) == 14
        end = time.monotonic() + HANG_S  # both lookups done before the step, so A and C are scheduled together
        while sd.get_num_new_matched_tokens(a, 0)[0] is None or sd.get_num_new_matched_tokens(c, 0)[0] is None:
            assert time.monotonic() < end, "lookups never done"
            time.sleep(0.01)

        s.add_request(a)
        s.add_request(c)
        so = s.schedule()
        assert set(so.num_scheduled_tokens) == {"A", "C"}
        a_blocks = list(s.kv_cache_manager.get_block_ids("A")[0])
        c_blocks = list(s.kv_cache_manager.get_block_ids("C")[0])
        (job,) = so.kv_connector_metadata.loads
        assert job.req_id == "A" and job.layerwise and job.block_ids == a_blocks[:8]
        assert c_blocks[:8] == a_blocks[:8]  # C's local prefix hit: A's blocks, cached before they loaded
        tainted = stats.snapshot().get("layerwise_tainted_requests", 0)
        s.update_from_output(so, _output(s, so, invalid=a_blocks[2:8], failed=[FailedLoad("A", "", hs[2], "timeout")]))
        assert a.num_computed_tokens == 2 * BS and c.num_computed_tokens == 8 * BS  # C stays on A's blocks 2..7
        s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # the client left before A recomputed

        saved: list[int] = []  # C's blocks offered from now on (by index in C's hashes)
        for _ in range(20):
            if c.is_finished():
                break
            so = s.schedule()
            assert "C" in so.num_scheduled_tokens
            saved += [hc.index(int(h)) if int(h) in hc else -1
                      for j in so.kv_connector_metadata.saves if j.req_id == "C" for h in j.seq_hashes]
            s.update_from_output(so, _output(s, so))
        assert c.is_finished() and c.num_computed_tokens >= 14 * BS  # C went on to compute all its blocks
        assert saved == []  # before: [11, 12, 13]: blocks computed on KV A's load never filled
        assert stats.snapshot().get("layerwise_tainted_requests") == tainted + 1  # C
        # nor does vLLM's prefix cache keep them (reachable again once another request recomputes blocks 2..7)
        pool = s.kv_cache_manager.block_pool
        assert [b for b in c_blocks[2:14] if pool.blocks[b].block_hash is not None] == []
    finally:
        s.shutdown()
