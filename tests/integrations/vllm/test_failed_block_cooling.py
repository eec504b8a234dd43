"""The scheduler's cool-down after a failed load (:class:`~kvbm_backend.integrations.vllm.failed_blocks.FailedBlocks`)
on hybrid models and at TP > 1.

* A hit with sliding-window groups is cut before a cooling block too, its windows probed at the cut point
  (:class:`~kvbm_backend.integrations.vllm.lookup.PrefixLookup`): before 2026-12-03 the cut was skipped for every hit
  with windows, so every request of a hybrid model's prompt was offered the block whose load had just failed,
  loaded it in vain and recomputed it. Driven through vLLM's real ``Scheduler`` (tiny model, ``uni`` executor,
  ``kv_load_failure_policy=recompute``) and, without an engine, through ``SchedulerSide`` over real G3 pools.
* ``load_failed_blocks_cooled`` counts a block once when it starts cooling: every TP rank reports the same failed
  block (before 2026-12-03 each report counted: N per block at TP N).
* A block whose load failed in a sliding-window group cuts only hits whose window of that group reads it (from
  2026-12-03 to 2026-12-03 every hit at it: longer prompts recomputed everything); a hybrid model's hand-off whose hit
  stops at a cooling block ends at once as a cooled timeout (meanwhile it waited the whole ``handoff_wait_s``), a cut
  counted once per request; a re-cut result is probed within ``max_probes`` of its own."""
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
SLIDING, FULL = 0, 1  # the fixture's KV cache groups: a failed load is reported for one of them


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
    """6 full blocks stored, block 3 cooling (an earlier request's load of it in the full group missed). Prompt a: the
    sliding group holds the windows before 6 and before 3: the hit is 3 blocks, window [1, 3) (before 2026-12-03: 6,
    block 3 loaded). Prompt b: only the window before 6: none is stored before 3 nor before 1, so no hit (never KV
    the windows cannot use)."""
    s = hybrid
    ta, tb = list(range(100, 100 + 6 * UBS + 5)), list(range(5000, 5000 + 6 * UBS + 5))
    ha = _store(s, ta, range(6), [1, 2, 4, 5])
    hb = _store(s, tb, range(6), [4, 5])
    s.loads_failed([FailedLoad("earlier", "", ha[3], "miss"), FailedLoad("earlier2", "", hb[3], "miss")], FULL)
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
    s.loads_failed([FailedLoad("other", "", hs[3], "miss")], FULL)  # another request's load of block 3 missed
    cuts = stats.get(CUTS) or 0
    assert _matched(s, r) == (3 * UBS, True) and s._reqs["a"].hit == (3, 3, {0: (1, 2)})
    assert _matched(s, r) == (3 * UBS, True) and (stats.get(CUTS) or 0) - cuts == 1  # counted once
    s.update_state_after_alloc(r, _Blocks([0, 41, 42, 0], [51, 52, 53, 0]), 3 * UBS)
    assert _planned(s) == [("a", 0, hs[1:3]), ("a", 1, hs[:3])]


# ---- a sliding-window group's failed block; a hybrid model's hand-off wait (review of be01c04) --------------------
NB = 8  # blocks of the prompts below (a hand-off's promise)
TOKS8 = list(range(100, 100 + NB * UBS + 5))


def test_failed_blocks_cut_a_hit_only_where_the_failed_groups_window_reads_the_block():
    """:meth:`FailedBlocks.first_in` with the groups' windows (group 0: 2 blocks, 1: full attention, 2: 4 blocks): a
    block failed in a sliding-window group cuts a hit only when that group's window before the hit's end contains it,
    the cut moving down as long as the shorter hit's window reads another cooling block; a full-attention group's, an
    unknown group's or a group-less failure cuts every hit at the block, as does any failure without windows
    (:class:`FailedChunks`' use, a dense model). Before 2026-12-03 the group was not recorded: every failure cut
    every hit at its block."""
    hs = list(range(10, 20))
    fb = FailedBlocks(cooldown_s=60, windows=[2, None, 4])
    assert fb.add("t", hs[3], group=0) is True
    assert [fb.first_in("t", hs, 0, m) for m in (10, 6, 5, 4, 3)] == [10, 6, 3, 3, 3]  # before: 3 for 10 and 6
    assert fb.first_in("t", hs, 4, 10) == 10 and fb.first_in("u", hs, 0, 5) == 5  # not scanned; another tenant
    fb.add("t", hs[5], group=0)
    assert fb.first_in("t", hs, 0, 6) == 3  # cut at 5, whose window [3, 5) reads 3: cut again
    assert fb.first_in("t", hs, 0, 8) == 8 and fb.first_in("t", hs, 0, 7) == 3  # 7: cut at 5, then at 3
    fb.add("t", hs[7], group=2)  # a 4-block window reads 7 from every hit ending in 8..11
    assert fb.first_in("t", hs, 0, 10) == 3 and fb.first_in("t", hs, 7, 10) == 7 and fb.first_in("t", hs, 8, 10) == 10
    assert fb.add("t", hs[5], group=1) is False  # block 5 now failed in the full group too: every hit at 5 is cut
    assert fb.first_in("t", hs, 0, 10) == 3 and fb.first_in("t", hs, 4, 10) == 5
    for group in (None, 1, 7):  # unknown (no group, one the windows do not name) or full attention: every hit
        fb = FailedBlocks(cooldown_s=60, windows=[2, None])
        fb.add("t", hs[2], group=group)
        assert fb.first_in("t", hs, 0, 10) == 2, group
    fb = FailedBlocks(cooldown_s=60, windows=[2, None])
    fb.add("t", hs[2])
    fb.add("t", hs[2], group=0)  # a group named later does not narrow a group-less failure
    assert fb.first_in("t", hs, 0, 10) == 2
    fb = FailedBlocks(cooldown_s=60)  # no windows (FailedChunks, a dense model): the group does not matter
    fb.add("t", hs[2], group=0)
    assert fb.first_in("t", hs, 0, 10) == 2


def test_a_sliding_groups_failed_block_does_not_cut_a_hit_whose_window_never_reads_it(hybrid):
    """An earlier request loaded the sliding group's window [1, 3) of a 3-block prefix and its load of block 1 *in the
    sliding group* missed (the sliding group's G3 lost it), reported for group 0. A request of the 8-block prompt
    loads the full group's blocks 0..7 (stored, none failed) and the sliding window [6, 8) (stored): it never reads
    the sliding block that failed and gets its 8 blocks, no cut (from be01c04 to 2026-12-03: cut at 1, its window
    probed at [0, 1) and answered 0: the whole prompt recomputed for the cool-down). A request of the 3-block prefix,
    whose window [1, 3) reads it, is cut before it (window [0, 1)); a failure of block 7 in the sliding group cuts the
    8-block prompt's hit at 7 (window [5, 7))."""
    s = hybrid
    hs = _store(s, TOKS8, range(NB), [0, 2, 4, 5, 6, 7])  # sliding block 1 gone (the failed load's miss)
    s.loads_failed([FailedLoad("earlier", "", hs[1], "miss")], SLIDING)
    cuts = stats.get(CUTS) or 0
    assert _matched(s, _request("b", TOKS8, UBS)) == (NB * UBS, True), s._reqs["b"].hit  # before: (0, False)
    assert s._reqs["b"].hit == (NB, NB, {SLIDING: (6, 2)}) and (stats.get(CUTS) or 0) == cuts
    short = TOKS8[:3 * UBS + 5]
    assert _matched(s, _request("p", short, UBS)) == (UBS, True) and s._reqs["p"].hit == (1, 1, {SLIDING: (0, 1)})
    assert (stats.get(CUTS) or 0) - cuts == 1
    s.loads_failed([FailedLoad("earlier", "", hs[7], "miss")], SLIDING)
    assert _matched(s, _request("c", TOKS8, UBS)) == (7 * UBS, True) and s._reqs["c"].hit == (7, 7, {SLIDING: (5, 2)})
    assert (stats.get(CUTS) or 0) - cuts == 2


def test_a_recut_result_is_probed_with_probes_of_its_own(hybrid):
    """A resolved windowed hit that took 2 probes (window [4, 6) lacks 5: probed again at 5) is cut when block 3 starts
    cooling, and its windows are probed at the cut within ``max_probes`` of their own: [1, 3) lacks 1, so the hit
    moves to 1 (window [0, 1)). Before, the re-cut went on counting the first resolution's probes, and with
    ``max_probes`` 2 it answered 0 at its first window miss."""
    s = hybrid
    toks = list(range(100, 100 + 6 * UBS + 5))
    hs = _store(s, toks, range(6), [0, 2, 3, 4])
    r = _request("a", toks, UBS)
    assert _matched(s, r) == (5 * UBS, True) and s._reqs["a"].hit == (5, 5, {SLIDING: (3, 2)})
    look = s._reqs["a"].lookup
    assert look is not None and look.probes == 2
    look.max_probes = 2  # the re-cut needs 2 probes: at 3, then at 1
    s.loads_failed([FailedLoad("other", "", hs[3], "miss")], FULL)
    assert _matched(s, r) == (UBS, True) and s._reqs["a"].hit == (1, 1, {SLIDING: (0, 1)})  # before: (0, False)


@pytest.fixture
def handoff_clock(hybrid):
    """The ``hybrid`` SchedulerSide with hand-off waits of 600 s of the test's clock (``now[0]``)."""
    from kvbm_backend.integrations.vllm import handoff
    handoff.LOG.reset()
    now = [0.0]
    hybrid.handoff = handoff.HandoffWaits(600.0, clock=lambda: now[0])
    yield hybrid, now
    handoff.LOG.reset()


def _handoff_req(rid: str):
    from kvbm_backend.integrations.vllm.handoff import KEY
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKS8, cache_salt=None, lora_request=None,
                           kv_transfer_params={KEY: {"blocks": NB, "block_size": UBS}})


HANDOFF_KEYS = ("handoff_timeouts", "handoff_cooled_timeouts", "handoff_wait_s", "handoff_complete_requests", CUTS)


@pytest.mark.parametrize("full_stored", [NB, 3], ids=["past-the-cooling-block", "up-to-it"])
def test_a_hybrid_handoff_whose_hit_stops_at_a_cooling_block_ends_at_once_as_cooled(handoff_clock, caplog,
                                                                                     full_stored):
    """A prefill worker handed off 8 blocks of a hybrid model: the full-attention blocks (all 8, or those before block
    3 only) and the sliding window before the resume point (blocks 6, 7) are stored, as the prefill side stores them.
    Block 3 of the full group cools after an earlier request's failed load: no hit goes past it, and the window at 3
    is not stored, so the look answers 0. The wait ends at that first look, a cooled timeout (``handoff_timeouts``,
    ``handoff_cooled_timeouts``, 0 s waited; its WARNING names block 3; one cut counted when the hit was cut, none
    when it ended at the block anyway), as for a dense model. From be01c04 to 2026-12-03 it waited the whole
    ``handoff_wait_s`` (600 s of the wait's clock), a cut counted per look, and ended as a plain timeout: the look's
    hit (0) never reached the cooling block's index."""
    import logging
    s, now = handoff_clock
    hs = _store(s, TOKS8, range(full_stored), [6, 7])
    s.loads_failed([FailedLoad("earlier", "", hs[3], "miss")], FULL)
    before = {k: stats.get(k) or 0 for k in HANDOFF_KEYS}
    req, t0 = _handoff_req("d"), time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        while (ans := s.get_num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() - t0 < HANG_S, "no answer"
            now[0] += 1.0
            time.sleep(0.002)
    got = {k: (stats.get(k) or 0) - before[k] for k in HANDOFF_KEYS}
    assert ans == (0, False)
    assert got == {"handoff_timeouts": 1, "handoff_cooled_timeouts": 1, "handoff_wait_s": 0.0,
                   "handoff_complete_requests": 0, CUTS: 1 if full_stored > 3 else 0}, got
    msgs = [r.getMessage() for r in caplog.records if "request d " in r.getMessage()]
    assert len(msgs) == 1 and "block 3" in msgs[0] and "keeping up" not in msgs[0], msgs


def test_a_hybrid_handoff_cut_by_a_sliding_block_waits_for_the_rest_and_counts_no_cut_of_other_looks(handoff_clock):
    """Block 2 failed in the sliding group: the hand-off's looks while only the full blocks before 3 are stored are cut
    at 2 (window [1, 3) reads it) and answer 0, but the promise's hit, window [6, 8), never reads block 2: the request
    keeps waiting, and once the prefill's other blocks land its look finds all 8 (``handoff_complete_requests``). Only
    the look that ended the wait counts as the request's: no cut (its hit was not cut), however many looks before it
    were cut. From be01c04 to 2026-12-03 block 2 cut every hit, so the wait ran the whole 600 s of its clock, a cut
    counted per look, and the request recomputed everything."""
    s, now = handoff_clock
    hs = _store(s, TOKS8, range(3), [6, 7])
    s.loads_failed([FailedLoad("earlier", "", hs[2], "miss")], SLIDING)
    before = {k: stats.get(k) or 0 for k in HANDOFF_KEYS}
    req, t0, asked, landed = _handoff_req("w"), time.monotonic(), 0, False
    while (ans := s.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() - t0 < HANG_S, "no answer"
        asked += 1
        st = s._reqs["w"]
        if not landed and asked >= 20 and st.hit is not None:  # the prefill's write-behind lands the rest
            assert st.hit == (0, 0, {}) and s.failed_blocks.first_for(st, 3, UBS) == 2  # the looks before: cut at 2
            _store(s, TOKS8, range(3, NB), [6, 7])
            landed = True
        now[0] += 1.0
        time.sleep(0.002)
    got = {k: (stats.get(k) or 0) - before[k] for k in HANDOFF_KEYS}
    assert ans == (NB * UBS, True), (ans, got)
    assert got["handoff_complete_requests"] == 1 and got["handoff_timeouts"] == 0 and got[CUTS] == 0, got
