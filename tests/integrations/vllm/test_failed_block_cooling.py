"""The scheduler's cool-down after a failed load (:class:`~kvbm_backend.integrations.vllm.failed_blocks.FailedBlocks`)
on hybrid models and at TP > 1.

* A hit with sliding-window groups is cut before a cooling block too, its windows probed at the cut point
  (:class:`~kvbm_backend.integrations.vllm.lookup.PrefixLookup`): before 2026-12-03 the cut was skipped for every hit
  with windows, so every request of a hybrid model's prompt was offered the block whose load had just failed,
  loaded it in vain and recomputed it. Driven through vLLM's real ``Scheduler`` (tiny model, ``uni`` executor,
  ``kv_load_failure_policy=recompute``) and, without an engine, through ``SchedulerSide`` over real G3 pools.
* ``load_failed_blocks_cooled`` counts a block once when it starts cooling: every TP rank reports the same failed
  block (before 2026-12-03 each report counted: N per block at TP N)."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.failed_blocks import FailedBlocks  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta  # noqa: E402
from kvbm_backend.model.hashing import sequence_hashes  # noqa: E402
from kvbm_backend.model.layout import KvLayout  # noqa: E402
from kvbm_backend.model.namespace import KvGroup, Namespace  # noqa: E402
from tests.helpers.vllm_sched import runner_output, tiny_scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound
BS, NBLK, WINDOW = 16, 64, 32
N = 8  # full blocks of the prompt, all held in G3 (both groups)
CUTS = "lookup_failed_block_cuts"


def _hybrid_scheduler(tmp: Path) -> Scheduler:
    """vLLM's Scheduler with our connector over a hybrid KV cache (group 0 sliding window, group 1 full
    attention), one G3 pool per group."""
    extra = {"kvbm_backend": {"model": "tiny", "g3": {"paths": [str(tmp / "g3")], "capacity_gb": 0.05,
                                                      "files_per_path": 1, "admission": {"policy": "all"}}}}
    return tiny_scheduler(tmp, extra, lambda kw, names: [
        KVCacheGroupSpec(names[0::2], SlidingWindowSpec(sliding_window=WINDOW, **kw)),
        KVCacheGroupSpec(names[1::2], FullAttentionSpec(**kw))], block_size=BS, num_blocks=NBLK, batched_tokens=64)


def _request(rid: str, prompt: list[int], bs: int = BS) -> Request:
    init_none_hash(sha256_cbor)
    return Request(rid, prompt, SamplingParams(max_tokens=4), None, 0,
                   block_hasher=get_request_block_hasher(bs, sha256_cbor))


def _loads(so) -> list:
    return list(so.kv_connector_metadata.loads)


def _step_until_load(s: Scheduler, rid: str):
    """Step until our connector plans a load for ``rid`` or vLLM schedules it (computed: no load)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        so = s.schedule()
        if any(j.req_id == rid for j in _loads(so)) or rid in so.num_scheduled_tokens:
            return so
        s.update_from_output(so, runner_output(s, so))
        time.sleep(0.01)
    raise AssertionError(f"{rid}: never scheduled nor loaded")


def test_a_hybrid_models_failed_block_is_not_offered_to_the_next_request(tmp_path):
    """Hybrid model (a sliding-window and a full-attention group). G3 holds every block of a prompt in both groups.
    Request A loads it; the full group's block 3 fails to load (a read error G3 keeps: it is still in the index),
    reported as ``GroupedWorkers`` does (``failed_recving`` + a ``miss`` FailedLoad of group 1). vLLM recomputes A;
    the client aborts A. Request B of the same tenant and the same prompt arrives within the cool-down: its hit ends
    before the block that just failed (as for a model of one group: ``test_failed_load_paths``), its window loaded
    from before it, one cut counted. Before 2026-12-03 the cool-down was skipped for every hit with windows: B was
    offered the whole prompt again and its load plan included the failed block."""
    s = _hybrid_scheduler(tmp_path)
    try:
        sd = s.connector.sched
        prompt = list(range(1000, 1000 + N * BS)) + [7] * 5
        a = _request("A", prompt)
        hs = [int(h) for h in sd._state(a).hashes]
        assert len(hs) == N
        for g in sd.groups:  # every block of both groups in G3
            bpb = g.ns.layout.bytes_per_block
            assert g.g3.put(g.ns.keys(hs), [np.full(bpb, i, np.uint8) for i in range(N)]).result(HANG_S).written == N
            g.g3.flush(HANG_S)
        s.add_request(a)
        so = _step_until_load(s, "A")
        jobs = {j.group: j for j in _loads(so) if j.req_id == "A"}
        assert set(jobs) == {0, 1} and jobs[1].seq_hashes == hs  # the full group loads all 8
        bad = 3
        # the workers: A's load ended, group 1 failed from block 3 (a miss), reported per request
        meta = KvbmWorkerMeta()
        meta.others = {1: KvbmWorkerMeta(failed=[FailedLoad("A", jobs[1].tenant, hs[bad], "miss",
                                                            jobs[1].digest_of(bad))])}
        s.update_from_output(so, runner_output(s, so, KVConnectorOutput(
            finished_recving={"A"}, failed_recving={"A"}, kv_connector_worker_meta=meta)))
        assert sd.failed_blocks.first_in(jobs[1].tenant, hs, 0, N) == bad  # the block cools
        s.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # the client gives up on A

        cuts = stats.get(CUTS) or 0
        b = _request("B", prompt)
        s.add_request(b)
        so = _step_until_load(s, "B")
        planned = {j.group: j.seq_hashes for j in _loads(so) if j.req_id == "B"}
        full = planned.get(1, [])
        assert hs[bad] not in full, (f"B is offered the block whose load failed a moment ago (cooling): "
                                     f"planned {len(full)} full-group blocks, "
                                     f"{CUTS} +{(stats.get(CUTS) or 0) - cuts}")
        # the hit ends before the cooling block; the window group loads the window before that end
        assert full == hs[:bad] and planned.get(0) and set(planned[0]) <= set(hs[:bad]), planned
        assert (stats.get(CUTS) or 0) - cuts == 1
    finally:
        s.shutdown()


@pytest.mark.parametrize("same_step", [True, False], ids=["same-step", "rank1-a-step-later"])
def test_a_block_every_tp_rank_failed_on_is_counted_cooled_once(tmp_path, same_step):
    """TP 2, a dense model: A's 8-block G3 load fails from block 2 on on BOTH ranks (a G4 object ``gc`` deleted
    between lookup and read, a tenant's key revoked, a block G3 lost on every rank: each rank's slice fails alike),
    each rank reporting its ``miss`` (``FailedLoad``) as ``WorkerSide`` does; vLLM's ``KVOutputAggregator`` merges
    them. One block starts one cool-down, and it is counted once, as the failed blocks are
    (``load_failed_blocks_any_rank`` reads 6, ``load_failed_requests`` 1). Before 2026-12-03
    ``load_failed_blocks_cooled`` counted once per TP rank's report: 2 at TP 2, N at TP N."""
    from vllm.v1.outputs import KVConnectorOutput as Out

    from tests.helpers.vllm_g3_load import PromCounters, TpSteps, a_loading, g3_scheduler, load_output

    s = g3_scheduler(tmp_path)
    try:
        a, hs, job = a_loading(s)
        step = TpSteps(s, PromCounters(s)).step
        before = {k: stats.get(k) or 0 for k in ("load_failed_blocks_cooled", "load_failed_requests",
                                                 "load_failed_blocks_any_rank")}
        if same_step:
            step([load_output(job, hs, 2), load_output(job, hs, 2)])
        else:
            step([load_output(job, hs, 2), Out()])
            step([Out(), load_output(job, hs, 2)])
        got = {k: (stats.get(k) or 0) - v for k, v in before.items()}
        assert got["load_failed_blocks_any_rank"] == 6 and got["load_failed_requests"] == 1, got
        assert got["load_failed_blocks_cooled"] == 1, got
    finally:
        s.connector.shutdown()


def test_failed_blocks_add_says_whether_a_block_starts_cooling():
    """:meth:`FailedBlocks.add` answers True only for a block not cooling (what ``load_failed_blocks_cooled``
    counts); an expired entry a lookup has not swept yet is not cooling, and its digests are not carried into the
    new cool-down."""
    fb = FailedBlocks(cooldown_s=60)
    assert fb.add("t", 10, b"\x01" * 16) is True
    assert fb.add("t", 10, b"\x01" * 16) is False  # another TP rank's report of the same load
    assert fb.add("t", 10) is False and fb.add("u", 10) is True  # another tenant's block is another entry
    fb = FailedBlocks(cooldown_s=0.0)  # every entry expired at once
    assert fb.add("t", 10, b"\x01" * 16) is True
    fb.cooldown_s = 60.0
    assert fb.add("t", 10, b"\x02" * 16) is True  # expired, not yet swept: starts cooling anew
    assert fb.first_in("t", [10], 0, 1, lambda i: b"\x02" * 16) == 0
    assert fb.first_in("t", [10], 0, 1, lambda i: b"\x01" * 16) == 1  # the expired failure's digest is gone


# ---- without an engine: SchedulerSide over real G3 pools of a hybrid namespace ------------------------------------
UBS = 32
LAY = KvLayout(2, 2, UBS, 64, "bfloat16")


@pytest.fixture
def hybrid(tmp_path):
    """SchedulerSide over a hybrid namespace (group 0: sliding window of 2 blocks, group 1: full attention), one
    real G3 pool per group."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.connector import group_g3_config
    from kvbm_backend.integrations.vllm.scheduler_side import GroupTiers, SchedulerSide
    ns = Namespace("m", LAY, groups=(KvGroup("sliding", LAY, sliding_window=64), KvGroup("full", LAY)), group=0)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    groups = []
    for gi in range(2):
        gns = ns.for_group(gi)
        g3, _ = open_tiers(group_g3_config(cfg, ns, gi), gns)
        groups.append(GroupTiers(gns, g3, None, gns.groups[gi].window_blocks))
    assert groups[0].window_blocks == 2
    s = SchedulerSide(ns, UBS, groups[0].g3, None, groups=groups)
    s.failed_blocks.cooldown_s = HANG_S  # cooling for the whole test, however slow the machine
    yield s
    for g in groups:
        g.g3.close()


def _store(s, toks: list[int], full: range, sliding: list[int]) -> list[int]:
    """Blocks ``full`` of the full group and ``sliding`` of the sliding group of prompt ``toks`` in G3."""
    hs = sequence_hashes(toks, UBS)
    blk = np.zeros(LAY.bytes_per_block, np.uint8)
    sl, fu = s.groups
    fu.g3.put(fu.ns.keys([hs[i] for i in full]), [blk] * len(full)).result(HANG_S)
    sl.g3.put(sl.ns.keys([hs[i] for i in sliding]), [blk] * len(sliding)).result(HANG_S)
    for g in s.groups:
        g.g3.flush(HANG_S)
    return hs


def _matched(s, req):
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        n, a = s.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n, a
        time.sleep(0.005)
    raise AssertionError("lookup never answered")


def _planned(s) -> list:
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]))
    return sorted((j.req_id, j.group, j.seq_hashes) for j in s.build_connector_meta(out).loads)


class _Blocks:
    def __init__(self, *ids):
        self.ids = ids

    def get_block_ids(self):
        return tuple(list(x) for x in self.ids)


def test_a_windowed_hit_ends_before_a_cooling_block_its_window_probed_there(hybrid):
    """6 full blocks stored, block 3 cooling (an earlier request's load missed it). Prompt a: the sliding group holds
    the windows before 6 and before 3: the hit is 3 blocks, window [1, 3) (before 2026-12-03: 6, block 3 loaded).
    Prompt b: only the window before 6: none is stored before 3 nor before 1, so no hit (never KV the windows
    cannot use)."""
    s = hybrid
    ta, tb = list(range(100, 100 + 6 * UBS + 5)), list(range(5000, 5000 + 6 * UBS + 5))
    ha = _store(s, ta, range(6), [1, 2, 4, 5])
    hb = _store(s, tb, range(6), [4, 5])
    s.loads_failed([FailedLoad("earlier", "", ha[3], "miss"), FailedLoad("earlier2", "", hb[3], "miss")])
    cuts = stats.get(CUTS) or 0
    ra = _request("a", ta, UBS)
    assert _matched(s, ra) == (3 * UBS, True)
    assert s._reqs["a"].hit == (3, 3, {0: (1, 2)})
    s.update_state_after_alloc(ra, _Blocks([0, 41, 42, 0], [51, 52, 53, 0]), 3 * UBS)
    assert _planned(s) == [("a", 0, ha[1:3]), ("a", 1, ha[:3])]
    assert _matched(s, _request("b", tb, UBS)) == (0, False)
    assert (stats.get(CUTS) or 0) - cuts == 2


def test_a_block_cooling_after_a_windowed_hit_resolved_cuts_it_when_vllm_asks_again(hybrid):
    """vLLM asks again for a request it could not allocate yet (the resolved lookup is kept): a block of its hit
    that started cooling meanwhile cuts the hit, its windows probed at the cut point, before any load is planned
    (before 2026-12-03 a windowed result was never cut: the load included the failed block)."""
    s = hybrid
    toks = list(range(100, 100 + 6 * UBS + 5))
    hs = _store(s, toks, range(6), [1, 2, 4, 5])
    r = _request("a", toks, UBS)
    assert _matched(s, r) == (6 * UBS, True) and s._reqs["a"].hit == (6, 6, {0: (4, 2)})
    s.loads_failed([FailedLoad("other", "", hs[3], "miss")])  # another request's load of block 3 missed
    cuts = stats.get(CUTS) or 0
    assert _matched(s, r) == (3 * UBS, True) and s._reqs["a"].hit == (3, 3, {0: (1, 2)})
    assert _matched(s, r) == (3 * UBS, True) and (stats.get(CUTS) or 0) - cuts == 1  # counted once
    s.update_state_after_alloc(r, _Blocks([0, 41, 42, 0], [51, 52, 53, 0]), 3 * UBS)
    assert _planned(s) == [("a", 0, hs[1:3]), ("a", 1, hs[:3])]
