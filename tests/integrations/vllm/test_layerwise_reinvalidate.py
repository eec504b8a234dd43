"""A failed layer-wise (synchronous) load's unloaded blocks that another request shares, through vLLM's real
``Scheduler`` with the connector in both roles (:mod:`tests.helpers.lifecycle_sim`: CPU KV tensors, a forward that
checks every position it reads holds its prefix's KV) (lifecycle review 2026-12-01, finding 1).

r0's layer-wise G3 load fails at block 1; r2 took r0's blocks 0..2 as its local prefix hit in the same
step. vLLM (``recompute``) rolls r0 back to block 1 and leaves r2 on the shared block, for r0 to recompute it. Before
the fix, r0 aborted or preempted first left r2 computing and decoding on the block's stale bytes, with no error ever
reported again. Now the connector reports the block again in the step r2 reads it (``Unrecomputed``): vLLM rolls r2
back, and r2 recomputes it."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.failed_blocks import Unrecomputed  # noqa: E402
from tests.helpers.lifecycle_sim import BS, HANG_S, Sim, build, hasher, looked_up, mkreq, warm  # noqa: E402

pytestmark = [pytest.mark.vllm]

def _shared_failed_load(tmp: Path, leave, save: bool = True) -> tuple[list[str], int, int]:
    """r0's layer-wise load fails at block 1 while r2 shares its blocks 0..2; ``leave(s)`` takes r0 away before it
    recomputes. ``save`` False: the connector loads only (``kv_connector_extra_config`` ``{"save": false}``; G3 was
    written while it saved). Returns (the wrong reads vLLM kept, how many it discarded, blocks reported again)."""
    s, w, kvs = build(tmp, 40, 64, extra_g3={"layerwise_load": True})
    sim, h, sd = Sim(s, w, kvs), hasher(), s.connector.sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    prompt = list(range(1000, 1000 + 4 * BS))
    try:
        warm(sim, prompt + [7] * 5, h)
        sd.save_enabled = save  # what {"save": false} sets at start
        for t in kvs.values():  # an engine block's bytes from before: visible where nothing loaded or computed
            t.fill_(-1.0)
        r0 = mkreq("r0", prompt + [8] * 5, 4, h)
        looked_up(sd, r0)
        s.add_request(r0)
        s.add_request(mkreq("r2", prompt[:3 * BS] + [9] * 5, 6, h))
        hs = list(sd._reqs["r0"].hashes)

        def evict_block1(so):
            assert [j.layerwise for j in so.kv_connector_metadata.loads] == [True]
            assert g3.delete(ns.keys(hs[1:2])).result(HANG_S) == 1  # G3 lost it between the lookup and the load
        sim.step(evict_block1)
        assert s.requests["r0"].num_computed_tokens == BS and s.requests["r2"].num_computed_tokens == 3 * BS
        again = stats.snapshot().get("layerwise_reinvalidated_blocks", 0)
        leave(s)
        for _ in range(30):
            if not s.requests:
                break
            sim.step()
        assert not s.requests
        assert not len(getattr(sd, "unrecomputed", ()))  # nothing kept once recomputed
        return sim.errors, sim.rolled_back, stats.snapshot().get("layerwise_reinvalidated_blocks", 0) - again
    finally:
        w.shutdown()
        s.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("save", [True, False], ids=["saving", "load_only"])
def test_a_request_sharing_a_failed_layerwise_load_never_reads_unloaded_kv_once_the_failed_one_is_aborted(tmp_path,
                                                                                                          save):
    """Also with saving off (review 2026-12-02: a load-only connector tracked no engine block ids, so nothing was
    reported again and r2 decoded on block 1's stale bytes)."""
    errors, rolled_back, again = _shared_failed_load(
        tmp_path, lambda s: s.finish_requests("r0", RequestStatus.FINISHED_ABORTED), save)  # the client left first
    assert errors == []  # before: r2 read block 1's stale bytes in every step until it finished
    assert rolled_back >= 1 and again == 2  # r2's one step over blocks 1, 2 discarded, then recomputed


def test_a_request_sharing_a_failed_layerwise_load_never_reads_unloaded_kv_once_the_failed_one_is_preempted(tmp_path):
    def preempt(s):
        r0 = s.requests["r0"]
        s.running.remove(r0)
        s._preempt_request(r0, time.monotonic())  # vLLM's own preemption (memory pressure), before r0 recomputes
    errors, rolled_back, again = _shared_failed_load(tmp_path, preempt)
    assert errors == []
    assert rolled_back >= 1 and again == 2


def test_a_load_only_connector_evicts_a_failed_layerwise_loads_unloaded_blocks(tmp_path):
    """Saving off (``{"save": false}``): r0's layer-wise load fails at block 1 and r0 is aborted before it
    recomputes; r3, the same prompt, comes next. It is not served the never-loaded blocks from vLLM's prefix cache
    (review 2026-12-02: the connector tracked no engine block ids when not saving, so it evicted none and r3 read
    engine block 6's stale bytes at position 16, no load error ever reported)."""
    s, w, kvs = build(tmp_path, 40, 64, extra_g3={"layerwise_load": True})
    sim, h, sd = Sim(s, w, kvs), hasher(), s.connector.sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    prompt = list(range(1000, 1000 + 4 * BS))
    try:
        warm(sim, prompt + [7] * 5, h)  # G3 holds the prompt's 4 blocks (written while saving)
        sd.save_enabled = False  # what {"save": false} sets at start
        for t in kvs.values():
            t.fill_(-1.0)
        r0 = mkreq("r0", prompt + [8] * 5, 4, h)
        looked_up(sd, r0)
        s.add_request(r0)
        hs = list(sd._reqs["r0"].hashes)

        def evict_block1(so):
            assert [j.layerwise for j in so.kv_connector_metadata.loads] == [True]
            assert g3.delete(ns.keys(hs[1:2])).result(HANG_S) == 1  # G3 lost it between the lookup and the load
        sim.step(evict_block1)
        assert s.requests["r0"].num_computed_tokens == BS  # vLLM rolled r0 back to its first failed block
        s.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
        s.add_request(mkreq("r3", prompt + [9] * 5, 2, h))
        for _ in range(30):
            if not s.requests:
                break
            sim.step()
        assert not s.requests
        assert sim.errors == []
    finally:
        w.shutdown()
        s.shutdown()
        shutil.rmtree(tmp_path, ignore_errors=True)


def _out(new=(), cached=(), sched=None, resumed=()):
    """A ``SchedulerOutput``'s fields :meth:`Unrecomputed.step` reads: ``new``/``cached``: (req id, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached], resumed_req_ids=set(resumed)),
        num_scheduled_tokens=sched or {})


def test_unrecomputed_reports_a_block_read_before_any_holder_recomputed_it():
    reqs = {"r0": object(), "r2": object(), "r3": object()}
    u = Unrecomputed()
    u.add(6, {"r0": 1, "r2": 1, "r3": 1})  # engine block 6: index 1 of each
    # r0 recomputes it in part (8 of 16 tokens) in a step r2 reads all of it: reported (the argued variant)
    assert u.step(_out(cached=[("r0", 16), ("r2", 48)], sched={"r0": 8, "r2": 1}), reqs, 16) == [6]
    # r2 reads only what r0 recomputed: not reported; r3 not scheduled: reads nothing
    assert u.step(_out(cached=[("r2", 24)], sched={"r2": 1}), reqs, 16) == []
    # r0 is resumed with new blocks (preempted): it no longer holds block 6; r3 reads it: reported
    assert u.step(_out(cached=[("r0", 0), ("r3", 48)], sched={"r0": 64, "r3": 1}, resumed={"r0"}), reqs, 16) == [6]
    # r3 (rolled back by that report) recomputes the rest; r2 reads it in the same step: done, forgotten
    assert u.step(_out(cached=[("r3", 16), ("r2", 48)], sched={"r3": 32, "r2": 1}), reqs, 16) == []
    assert len(u) == 0


def test_unrecomputed_credits_no_recompute_by_a_request_that_reads_another_unloaded_block():
    """What a request computes over unloaded KV is wrong KV: its writes recompute nothing."""
    u = Unrecomputed()
    u.add(5, {"r0": 1, "r2": 1})
    u.add(6, {"r2": 2, "r3": 1})  # r2 holds block 5 (not recomputed) before block 6
    assert u.step(_out(cached=[("r2", 20)], sched={"r2": 28}), {"r0": 0, "r2": 0, "r3": 0}, 16) == [5]
    assert len(u) == 2  # block 6 still owed


def test_unrecomputed_forgets_a_block_no_request_holds_any_more():
    """Every holder gone (finished): the block may be freed and reused by a request that computes it itself; it is
    never reported again (a report would at worst roll that one back: a recompute, never wrong KV)."""
    u = Unrecomputed()
    u.add(6, {"r0": 1, "r2": 1})
    assert u.step(_out(new=[("r4", 0)], sched={"r4": 64}), {"r4": object()}, 16) == []
    assert len(u) == 0
