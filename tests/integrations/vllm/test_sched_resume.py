"""A request's second ask after vLLM preempted it, and its saves after a block-level load failure, through vLLM's
real ``Scheduler`` with the connector's real scheduler role and a real G3 pool (harness:
``test_sched_lifecycle``)."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvbm_backend.integrations.vllm.metadata import FailedLoad  # noqa: E402
from tests.integrations.vllm.test_sched_lifecycle import BS, HANG_S, _output, _schedule_until, _scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm]


def _setup(tmp_path):
    s = _scheduler(tmp_path)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    sd = s.connector.sched
    a = Request("A", list(range(1000, 1000 + 8 * BS)) + [7] * 5, SamplingParams(max_tokens=4), None, 0,
                block_hasher=hasher)
    hs = [int(h) for h in sd._state(a).hashes]
    assert len(hs) == 8
    return s, sd, a, hs


def _store(sd, hs):
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    bpb = ns.layout.bytes_per_block
    assert g3.put(ns.keys(hs), [np.full(bpb, i, np.uint8) for i in range(len(hs))]).result(HANG_S).written == len(hs)
    g3.flush(HANG_S)
    return g3, ns


def test_a_preempted_request_is_looked_up_again_when_it_resumes(tmp_path):
    """Reviewer (2026-11-30): the connector kept a request's first lookup across vLLM's preemption, so the
    resumed request was answered what G3 held when it first arrived. Here G3 holds nothing then; A's blocks
    reach G3 while it runs (as its saves would); A is preempted and vLLM's prefix cache is reset. Before, the
    resumed A was answered 0 (the stale miss) and recomputed all 8 blocks; now it is looked up again and loads
    them from G3."""
    s, sd, a, hs = _setup(tmp_path)
    try:
        s.add_request(a)
        so = _schedule_until(s, "A")
        assert not so.kv_connector_metadata.loads  # G3 empty: nothing to load
        s.update_from_output(so, _output(s, so))
        _store(sd, hs)
        s.running.remove(a)
        s._preempt_request(a, time.monotonic())
        assert s.reset_prefix_cache()  # vLLM's own cache lost A's blocks: only G3 has them
        so = _schedule_until(s, "A")
        loaded = [h for j in so.kv_connector_metadata.loads for h in j.seq_hashes]
        assert loaded == hs  # before: [] (the first lookup's miss answered again)
    finally:
        s.shutdown()


def test_blocks_recomputed_after_a_block_level_load_failure_are_saved_again(tmp_path):
    """Reviewer (2026-11-30): ``loads_failed`` (a block-level failure: vLLM cuts the request back to its first
    failed block and recomputes from there) did not reset ``saved_upto``: the request was scheduled with its 8
    loaded blocks counted as saved, so the blocks it recomputed (2..7, gone from G3: a miss) were never offered
    again. Now they are saved as they are recomputed."""
    s, sd, a, hs = _setup(tmp_path)
    try:
        g3, ns = _store(sd, hs)
        s.add_request(a)
        so = _schedule_until(s, "A")
        a_blocks = list(s.kv_cache_manager.get_block_ids("A")[0])
        (job,) = so.kv_connector_metadata.loads
        assert job.block_ids == a_blocks[:8]
        assert g3.delete(ns.keys(hs[2:])).result(HANG_S) == 6  # the worker dropped them as unreadable: a miss
        s.update_from_output(so, _output(s, so, invalid=a_blocks[2:8], failed=[FailedLoad("A", "", hs[2], "miss")]))
        assert a.num_computed_tokens == 2 * BS
        so = s.schedule()
        assert so.num_scheduled_tokens["A"] == 64  # blocks 2..5 recomputed this step
        saved = [(blk, h) for j in so.kv_connector_metadata.saves for blk, h in zip(j.block_ids, j.seq_hashes)]
        assert saved == list(zip(a_blocks[2:6], hs[2:6]))  # before: [] (saved_upto stayed 8)
    finally:
        s.shutdown()
