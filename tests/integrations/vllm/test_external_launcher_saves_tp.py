"""The TP ranks' save plans and lookup counters agree under vLLM's ``external_launcher`` with TP > 1
(kvbm_backend/integrations/vllm/tp_sched.py).

Under ``external_launcher`` every TP rank is its own process with its own scheduler, and each rank's worker stores
that rank's slice of the blocks its own scheduler planned. Review findings (2026-12-03, after the load agreement):

* the save plans were not agreed: a plan's inputs that run on each process's clock (the revoked tenants' keyring
  checks decide whether the engine's prefix-cache hits are offered to G3) can make one rank plan a block slice another
  skips; the block is then stored on some ranks only, and every later lookup of it misses (a hit needs every rank's
  slice): capacity wasted, hits lost;
* the lookup counters (``g3_found_blocks``, ``g4_found_blocks``, ...) counted each rank's own answer, not the one the
  ranks agreed and loaded: summed over the ranks they disagreed with the loads.

Review findings on that agreement (2026-12-03):

* the plans were intersected with each block's path (``SaveJob.g4_only``): a hand-off's block one rank planned G4-only
  and another as an ordinary save was offered nowhere (G4 got no slice, the decode worker waited and recomputed),
  ``handoff_g4_offered_blocks`` counted it anyway, and a hand-off's promise still counted blocks the agreement
  withheld;
* on an MLA model a G4-only job staged on rank 0 only left rank 1 more of the agreed staging budget for the next job;
* a closed worker not yet garbage-collected shrank the staging room every rank agreed, and the scheduler side agreed
  wherever its process had a TP group, not only under ``external_launcher`` as the wiring decides.

Second review (2026-12-03):

* a hand-off's block one rank planned G4-only and another skipped because it loaded it from G4 (so every rank's
  slice is in G4) was withheld, and the promise N was cut there, dropping the blocks the prefill computed in that
  step too: now the ranks' G4-only blocks are offered on every rank (their union) and only withheld ordinary saves
  cut N;
* a ``max_pending_save_bytes`` of 2**64 or more (accepted as "no bound") broke the load-result gather at every step
  with ``struct.error``: the room is clamped, and a rank's results that cannot be encoded are a named RuntimeError;
* ``save_local_hit_blocks`` counted blocks when planned, withheld ones too: now when offered.

Two real processes, each with vLLM's model-parallel state on gloo (``tests/helpers/tp_ranks.py``); run as a script,
this file is one rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, one_rank_group, run_tp_ranks

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
BS, TENANT = 16, "acme"
BPB = 2 * 2 * BS * 64 * 2  # bytes per block of a rank: 2 layers, K and V, 16 tokens, 1 KV head of 64, bfloat16
HELD = {0: 4, 1: 1}  # leading prompt blocks each rank's scheduler sees in G3 (every rank's slices)


def _step(new: list, sched: dict) -> SimpleNamespace:
    """A scheduler output of new requests only (``(req id, engine block ids, computed tokens)``)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=sched, finished_req_ids=set())


def _saves_rank(rank: int, root: str, out: str) -> None:
    """One TP rank's scheduler side over its own G3 view (as a revocation seen at different times makes the ranks'
    views differ): rank 0's shows a 6-block prompt's first 4 blocks held, rank 1's only the first. Step 1: request
    ``a`` is served by the engine's prefix cache (all 6 blocks), so the blocks G3 lacks are offered from the engine's
    blocks. Step 2: request ``b`` computes 2 new blocks (every rank plans the same). Writes each step's save plan."""
    import numpy as np

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    ns = Namespace("kvbm-backend/el-saves", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    cfg = load_config({"g3": {"paths": [f"{root}/g3-rank{rank}"], "capacity_gb": 0.05, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    try:
        side = SchedulerSide(ns, BS, g3, None, tp_group=_tp_group())
        a = SimpleNamespace(request_id="a", prompt_token_ids=list(range(100, 100 + 6 * BS + 1)), cache_salt=TENANT,
                            lora_request=None, kv_transfer_params=None)
        hs = [int(h) for h in side._state(a).hashes]
        held, bpb = HELD[rank], ns.layout.bytes_per_block
        for r in range(2):
            keys = ns.keys(hs[:held], TENANT, r)
            assert g3.put(keys, [np.full(bpb, i, np.uint8) for i in range(held)]).result(HANG_S).written == held
        assert g3.flush(HANG_S)
        plans = []
        assert side.get_num_new_matched_tokens(a, 6 * BS) == (0, False)  # the engine's prefix cache has it all
        side.update_state_after_alloc(a, None, 0)
        meta = side.build_connector_meta(_step([("a", list(range(10, 17)), 6 * BS)], {"a": 1}))
        plans.append([[j.req_id, j.block_ids, [str(h) for h in j.seq_hashes]] for j in meta.saves])
        local_saved = stats.get("save_local_hit_blocks")
        b = SimpleNamespace(request_id="b", prompt_token_ids=list(range(900, 900 + 2 * BS + 1)), cache_salt=TENANT,
                            lora_request=None, kv_transfer_params=None)
        end = time.monotonic() + HANG_S
        while side.get_num_new_matched_tokens(b, 0)[0] is None:  # the G3 lookup runs on the pool's thread
            assert time.monotonic() < end, "b's lookup never ended"
            time.sleep(0.01)
        side.update_state_after_alloc(b, None, 0)
        meta = side.build_connector_meta(_step([("b", [20, 21, 22], 0)], {"b": 2 * BS + 1}))
        plans.append([[j.req_id, j.block_ids, [str(h) for h in j.seq_hashes]] for j in meta.saves])
        Path(out).write_text(json.dumps({"plans": plans, "hashes": [str(h) for h in hs],
                                         "disagreed": stats.get("tp_save_disagreed_steps"),
                                         "local_saved": local_saved,
                                         "withheld": stats.get("tp_save_withheld_blocks")}))
    finally:
        g3.close()


def _staging_rank(rank: int, root: str, out: str) -> None:
    """One TP rank's worker role (wired, G3 in its own directory) with an 8-block save staging bound. Both ranks save
    the same 4-block job ``x``; rank 1's hand-off of it is held (its puts slower: 4 blocks of its room still taken),
    rank 0's ends. Then the step's ``get_transfer_results`` (the ranks' load results and, now, staging rooms agreed),
    and both save the same 6-block job ``y``. Writes the blocks each rank staged and dropped, and its G3 blocks."""
    import threading

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire
    from tests.integrations.vllm.test_external_launcher_g3_tp import _configs

    kvbm = {"model": "kvbm-backend/external-launcher-test",
            "g3": {"paths": [f"{root}/g3"], "capacity_gb": 0.05, "files_per_path": 1, "admission": {"policy": "all"}}}
    ktc, vc, kcc = _configs("", kvbm, max_pending_save_bytes=8 * BPB)
    kcc.num_blocks = 32
    parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    try:
        assert parts.ns.layout.bytes_per_block == BPB
        names = list(kcc.kv_cache_groups[0].layer_names)
        parts.register_kv_caches({n: torch.randn(2, 32, BS, 1, 64).to(torch.bfloat16) for n in names}, kcc)
        w = parts.worker_role().workers[0]
        g3, gate = parts._groups[0].g3, threading.Event()
        if rank == 1:  # its hand-offs on the save thread, held: x's blocks stay pending
            w.offloads.defer = True
            w.offloads._thread.submit(gate.wait, HANG_S)
        hx = _hashes(list(range(100, 100 + 4 * BS)))
        hy = _hashes(list(range(100, 100 + 10 * BS)))[4:]
        parts.worker_role().save([SaveJob("x", [1, 2, 3, 4], hx, TENANT)])
        end = time.monotonic() + HANG_S
        while rank == 0 and w.offloads.pending_bytes:  # rank 0's puts of x end
            assert time.monotonic() < end, "x's puts never ended"
            time.sleep(0.01)
        parts.take_finished()  # the step's get_transfer_results
        before = stats.snapshot()
        parts.worker_role().save([SaveJob("y", [5, 6, 7, 8, 9, 10], hy, TENANT)])
        after = stats.snapshot()
        gate.set()
        assert w.flush_saves(HANG_S) and g3.flush(HANG_S)
        Path(out).write_text(json.dumps({k: after.get(k, 0) - before.get(k, 0)
                                         for k in ("save_blocks", "save_dropped_full_blocks")}
                                        | {"g3_blocks": g3.stats()["blocks"]}))
    finally:
        gate.set()
        parts.close()


def _tp_group():
    """vLLM's TP group of this rank's process, as the wiring hands it to the scheduler side under external_launcher."""
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group()


def _tiers(rank: int, root: str, name: str, g4: bool = True):
    """``(namespace, g3, g4)`` of TP rank ``rank``: its own G3 pool under ``root``, the shared file:// G4 store."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    ns = Namespace(f"kvbm-backend/{name}", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    tree = {"g3": {"paths": [f"{root}/g3-rank{rank}"], "capacity_gb": 0.05, "files_per_path": 1,
                   "admission": {"policy": "all"}}}
    if g4:
        tree["g4"] = {"enabled": True, "encrypt": False, "url": f"file://{root}/g4"}
    return (ns, *open_tiers(load_config(tree, use_env=False), ns))


def _fill(pool, ns, hashes: list[int], ranks=(0, 1)) -> None:
    """``pool`` holds ``hashes``' blocks of TP ranks ``ranks`` (every rank's slice: the scheduler looks for all)."""
    import numpy as np
    bpb = ns.layout.bytes_per_block
    for r in ranks:
        res = pool.put(ns.keys(hashes, TENANT, r), [np.full(bpb, i, np.uint8) for i in range(len(hashes))])
        assert res.result(HANG_S).written == len(hashes)
    assert pool.flush(HANG_S)


def _handoff_request(rid: str, blocks: int):
    """A prefill request that hands off (``kv_transfer_params[KEY] is True``), ``blocks`` full prompt blocks + 1."""
    from kvbm_backend.integrations.vllm.handoff import KEY
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(100, 100 + blocks * BS + 1)),
                           cache_salt=TENANT, lora_request=None, kv_transfer_params={KEY: True})


def _handoff_paths_rank(rank: int, root: str, out: str) -> None:
    """A hand-off prefill request served by the engine's prefix cache (all 6 blocks), each rank's scheduler over its
    own G3 view: rank 0's shows blocks 0-3 held, rank 1's block 0. Rank 0 plans blocks 0-3 G4-only and 4-5 ordinary,
    rank 1 block 0 G4-only and 1-5 ordinary: every rank plans every block for G4. Writes the step's offered jobs,
    the counters, and the hand-off's promise N."""
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.handoff import KEY
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide

    ns, g3, g4 = _tiers(rank, root, "el-saves-handoff")
    try:
        side = SchedulerSide(ns, BS, g3, g4, tp_group=_tp_group())
        assert side.hands_off
        a = _handoff_request("a", 6)
        hs = [int(h) for h in side._state(a).hashes]
        _fill(g3, ns, hs[:HELD[rank]])
        assert side.get_num_new_matched_tokens(a, 6 * BS) == (0, False)  # the engine's prefix cache has it all
        side.update_state_after_alloc(a, None, 0)
        meta = side.build_connector_meta(_step([("a", list(range(10, 17)), 6 * BS)], {"a": 1}))
        params = side.request_finished(a, [])[1]
        Path(out).write_text(json.dumps({
            "jobs": [[j.block_ids, [str(h) for h in j.seq_hashes], j.g4_only] for j in meta.saves],
            "hashes": [str(h) for h in hs[:6]], "promised": params[KEY]["blocks"],
            "counters": {k: stats.get(k) for k in ("handoff_g4_offered_blocks", "tp_save_disagreed_steps",
                                                   "tp_save_withheld_blocks", "handoff_promise_cut_blocks")}}))
    finally:
        g3.close()
        g4.close()


P3 = {0: 4, 1: 2}  # leading prompt blocks each rank's scheduler finds in G3 (G4 holds the first 6)


def _handoff_promise_rank(rank: int, root: str, out: str) -> None:
    """A 10-block hand-off prefill request whose first 6 prompt blocks G4 holds (every rank's slice) and each rank's
    G3 view the first ``P3[rank]``: both ranks agree to load 6, rank 0 blocks 0-3 from G3 and 4-5 from G4, rank 1
    blocks 0-1 from G3 and 2-5 from G4. Each rank plans G4-only the blocks it did not load from G4 (rank 0: 0-3,
    rank 1: 0-1), and the step computes blocks 6-9 (ordinary saves on every rank). Writes the offered jobs, the
    counters, the hand-off's promise N, and how many of blocks 2-3 G4 holds with every rank's slice."""
    import torch.distributed as dist

    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.handoff import KEY
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide

    ns, g3, g4 = _tiers(rank, root, "el-saves-promise")
    try:
        group = _tp_group()
        side = SchedulerSide(ns, BS, g3, g4, tp_group=group)
        a = _handoff_request("a", 10)
        hs = [int(h) for h in side._state(a).hashes]
        _fill(g3, ns, hs[:P3[rank]])
        _fill(g4, ns, hs[:6], ranks=(rank,))  # each rank its own slice in the shared store
        dist.barrier(group=group.cpu_group)  # both slices are there before either rank looks
        end = time.monotonic() + HANG_S
        while (ans := side.get_num_new_matched_tokens(a, 0))[0] is None:  # agreed: both ranks loop alike
            assert time.monotonic() < end, "a's lookup never ended"
            time.sleep(0.01)
        ids = list(range(10, 21))
        side.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: (ids,)), ans[0])
        # the step computes blocks 6-9 (and the prompt's last token)
        meta = side.build_connector_meta(_step([("a", ids, 6 * BS)], {"a": 4 * BS + 1}))
        params = side.request_finished(a, [])[1]
        runs = ns.rank_runs(hs[2:4], TENANT)[1]
        in_g4 = min(g4.lookup_prefix(r, request=False).result(HANG_S) for r in runs)
        Path(out).write_text(json.dumps({
            "answer": list(ans), "jobs": [[j.block_ids, j.g4_only] for j in meta.saves],
            "promised": params[KEY]["blocks"], "blocks_2_3_in_g4": in_g4,
            "counters": {k: stats.get(k) for k in ("handoff_g4_offered_blocks", "tp_save_disagreed_steps",
                                                   "tp_save_withheld_blocks", "handoff_promise_cut_blocks")}}))
    finally:
        g3.close()
        g4.close()


def _backend_rank(rank: int, root: str, out: str) -> None:
    """The scheduler role wired in a process with vLLM's TP group of 2, under ``mp`` and under
    ``external_launcher``: whether its scheduler side agrees saves and matches over the TP group."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire
    from tests.integrations.vllm.test_external_launcher_g3_tp import _configs

    agrees = {}
    for backend in ("mp", "external_launcher"):
        ktc, vc, kcc = _configs(f"{root}/g3-{backend}-rank{rank}")
        vc.parallel_config.distributed_executor_backend = backend
        parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
        try:
            agrees[backend] = [parts.scheduler_role().tp is not None, parts.match_agree is not None]
        finally:
            parts.close()
    Path(out).write_text(json.dumps(agrees))


def _hashes(toks: list[int]) -> list[int]:
    from kvbm_backend.model.hashing import sequence_hashes
    return [int(h) for h in sequence_hashes(toks, BS)]


def _counts_rank(rank: int, root: str, out: str) -> None:
    """The hand-off scenario of test_external_launcher_agree_tp.py (rank 0's G4 holds the 4 promised blocks, rank 1's
    the first 2; the ranks agree to load 2), with the connector's lookup counters added to its output."""
    from kvbm_backend.integrations.vllm import stats
    from tests.integrations.vllm.test_external_launcher_agree_tp import _match_rank

    _match_rank(rank, root, out)
    d = json.loads(Path(out).read_text())
    d["counters"] = {k: stats.get(k) for k in ("lookup_requests", "lookup_blocks", "local_hit_blocks",
                                               "g3_found_blocks", "g4_found_blocks")}
    Path(out).write_text(json.dumps(d))


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_ranks_offer_the_same_saves_under_external_launcher(tmp_path):
    """On the old code rank 0 offered blocks 4-5 of ``a`` (its view: G3 holds 0-3) and rank 1 blocks 1-5: blocks 1-3
    were stored on rank 1 only, never a hit. Now every rank offers only the blocks every rank planned (4-5), counted
    once each (one step disagreed; rank 1 withheld 3 blocks), and each counts 2 ``save_local_hit_blocks``, the blocks
    offered (before 2026-12-03 rank 1 counted the 5 it planned); ``b``'s step, planned alike, is kept whole."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "saves")
    assert r0["plans"] == r1["plans"], "the TP ranks' schedulers planned different saves"
    (step1, step2), hs = r0["plans"], r0["hashes"]
    assert step1 == [["a", [14, 15], hs[4:6]]]
    assert [(j[0], j[1]) for j in step2] == [("b", [20, 21])]
    assert (r0["disagreed"], r0["withheld"], r1["disagreed"], r1["withheld"]) == (1, 0, 1, 3)
    # prefix-cache blocks G3 lacked, counted as offered (on the old code as planned: rank 1 counted 5, 3 withheld)
    assert (r0["local_saved"], r1["local_saved"]) == (2, 2)


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_ranks_count_the_agreed_lookup_under_external_launcher(tmp_path):
    """On the old code rank 0 counted 4 G4 blocks found (its own answer) and rank 1 counted 2, while both loaded 2.
    Now every rank counts the agreed hit: 2 blocks, one request, each once."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "counts")
    assert r0["planned"] == r1["planned"] == [2]
    assert r0["counters"] == r1["counters"]
    assert r0["counters"] == {"lookup_requests": 1, "lookup_blocks": 4, "local_hit_blocks": 0, "g3_found_blocks": 0,
                              "g4_found_blocks": 2}


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_ranks_stage_the_same_saves_under_external_launcher(tmp_path):
    """On the old code each rank's staging bound decided alone: rank 0 (its earlier puts done) staged all 6 blocks of
    ``y``, rank 1 (4 blocks of its room still pending) 4: blocks 5-6 of ``y`` were stored on rank 0 only, never a
    hit. Now both stage within the least room any rank had at the step's agreement: 4 blocks each, 2 dropped
    (counted), and both G3 pools hold the same 8 blocks."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "staging")
    assert r0 == r1, "the TP ranks' workers staged different saves"
    assert r0 == {"save_blocks": 4, "save_dropped_full_blocks": 2, "g3_blocks": 8}


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_handoff_blocks_every_rank_plans_for_g4_are_offered_g4_only_on_every_rank(tmp_path):
    """Every rank plans all 6 blocks of the hand-off for G4, on different paths (rank 0: 0-3 G4-only, 4-5 ordinary;
    rank 1: 0 G4-only, 1-5 ordinary). On the old code the intersection compared the path too: blocks 1-3 were
    offered nowhere (rank 0 offered [4, 5] and [0], G4 got no slice of 1-3), rank 0 counted 4 blocks offered to G4
    alone and rank 1 one. Now both offer the same jobs, rank 0's: 4-5 ordinary, 0-3 G4-only (G4-only where any rank
    planned it so), each rank counts the 4 G4-only blocks offered, nothing is withheld, and N promises all 6."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "handoff_paths")
    assert r0["jobs"] == r1["jobs"], "the TP ranks offered different save jobs"
    hs = r0["hashes"]
    assert r0["jobs"] == [[[14, 15], hs[4:6], False], [[10, 11, 12, 13], hs[:4], True]], r0["jobs"]
    for r in (r0, r1):
        assert r["counters"] == {"handoff_g4_offered_blocks": 4, "tp_save_disagreed_steps": 1,
                                 "tp_save_withheld_blocks": 0, "handoff_promise_cut_blocks": 0}
        assert r["promised"] == 6


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_handoff_blocks_a_rank_loaded_from_g4_are_offered_g4_only_on_every_rank_and_keep_the_promise(tmp_path):
    """Rank 0 plans blocks 0-3 of the hand-off G4-only, rank 1 blocks 0-1: it loaded 2-5 from G4, which proves G4
    holds every rank's slice of them. On the old code blocks 2-3 were withheld and N cut to 2 on both ranks (8 blocks
    counted cut), so the decode worker recomputed blocks 2-9, blocks 6-9 too, which every rank computed and wrote to
    G4 in that very step. Now the ranks' G4-only blocks (0-3) are offered G4-only on every rank, nothing is withheld,
    and N promises all 10 blocks."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "handoff_promise")
    assert r0["answer"] == r1["answer"] == [6 * BS, True]
    assert r0["blocks_2_3_in_g4"] == r1["blocks_2_3_in_g4"] == 2  # every rank's slice of blocks 2-3 is in G4
    assert r0["jobs"] == r1["jobs"], "the TP ranks offered different save jobs"
    assert r0["jobs"] == [[[10, 11, 12, 13], True], [[16, 17, 18, 19], False]], r0["jobs"]
    assert (r0["promised"], r1["promised"]) == (10, 10), (
        f"promise cut to {r0['promised']}, {r1['promised']} (cut {r0['counters']['handoff_promise_cut_blocks']}) "
        f"at blocks G4 holds with every slice; jobs {r0['jobs']}")
    for r in (r0, r1):
        assert r["counters"] == {"handoff_g4_offered_blocks": 4, "tp_save_disagreed_steps": 1,
                                 "tp_save_withheld_blocks": 0, "handoff_promise_cut_blocks": 0}


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_scheduler_side_agrees_only_under_external_launcher(tmp_path):
    """One decision for every TP agreement: in a process with vLLM's TP group of 2, the scheduler side agrees saves
    and matches under ``external_launcher`` only, as the wiring's own agreements do. On the old code it asked vLLM
    for a TP group itself and agreed under ``mp`` too (its collectives then run where no other rank joins them)."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "backend")
    assert r0 == r1 == {"mp": [False, False], "external_launcher": [True, True]}


def test_agreed_save_plan_is_rank0s_jobs_with_one_path_per_block():
    """The agreement of gathered plans, as every rank computes it: the blocks every rank planned, whatever path each
    chose, G4-only where any rank planned them G4-only, as rank 0's jobs in rank 0's order (cut where the path
    changes); the blocks some rank planned and another did not are withheld. Every rank gets the same plan."""
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.tp_sched import agree_plans
    d = bytes(range(16)) * 6
    r0 = [SaveJob("a", [14, 15], [4, 5], "t", digests=d[:32]), SaveJob("a", [10, 11, 12, 13], [0, 1, 2, 3], "t",
                                                                       g4_only=True, digests=d[:64]),
          SaveJob("b", [20, 21], [8, 9], "t")]
    r1 = [SaveJob("a", [11, 12, 13, 14, 15], [1, 2, 3, 4, 5], "t", digests=d[:80]),
          SaveJob("a", [10], [0], "t", g4_only=True, digests=d[:16]), SaveJob("b", [20], [8], "t")]
    kept, withheld = agree_plans([r0, r1])
    assert kept == [SaveJob("a", [14, 15], [4, 5], "t", digests=d[:32]),
                    SaveJob("a", [10, 11, 12, 13], [0, 1, 2, 3], "t", g4_only=True, digests=d[:64]),
                    SaveJob("b", [20], [8], "t")]
    assert withheld == {("b", "t", 0, 21, 9, b"")}
    # rank 1's plan first (as rank 0): its ordinary job is cut where the path changes
    kept, _ = agree_plans([r1, r0])
    assert kept == [SaveJob("a", [11, 12, 13], [1, 2, 3], "t", g4_only=True, digests=d[:48]),
                    SaveJob("a", [14, 15], [4, 5], "t", digests=d[:32]),
                    SaveJob("a", [10], [0], "t", g4_only=True, digests=d[:16]), SaveJob("b", [20], [8], "t")]
    # another digest is another block: withheld, never offered under the other's identity
    kept, withheld = agree_plans([[SaveJob("c", [1], [7], "t", digests=b"\x01" * 16)],
                                  [SaveJob("c", [1], [7], "t", digests=b"\x02" * 16)]])
    assert kept == [] and len(withheld) == 2


def test_agreed_save_plan_offers_every_ranks_g4_only_blocks_and_withholds_only_ordinary_saves():
    """A hand-off's block one rank planned G4-only and another did not plan (it loaded it from G4: every slice is
    there) is offered G4-only on every rank, the union of the ranks' G4-only blocks, after rank 0's jobs where only a
    later rank planned it; an ordinary save not every rank planned is withheld. On the old code the G4-only blocks 2-3
    were withheld too."""
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.tp_sched import agree_plans
    r0 = [SaveJob("a", [10, 11, 12, 13], [0, 1, 2, 3], "t", g4_only=True), SaveJob("a", [16, 17], [6, 7], "t")]
    r1 = [SaveJob("a", [10, 11], [0, 1], "t", g4_only=True), SaveJob("a", [16], [6], "t"),
          SaveJob("b", [30, 31], [20, 21], "t", g4_only=True)]
    for plans in ([r0, r1], [r0, r1, r1]):
        kept, withheld = agree_plans(plans)
        assert kept == [SaveJob("a", [10, 11, 12, 13], [0, 1, 2, 3], "t", g4_only=True), SaveJob("a", [16], [6], "t"),
                        SaveJob("b", [30, 31], [20, 21], "t", g4_only=True)], kept
        assert withheld == {("a", "t", 0, 17, 7, b"")}, withheld
    # rank 1's plan first: its jobs first, rank 0's G4-only blocks 2-3 after them
    kept, _ = agree_plans([r1, r0])
    assert kept == [SaveJob("a", [10, 11], [0, 1], "t", g4_only=True), SaveJob("a", [16], [6], "t"),
                    SaveJob("b", [30, 31], [20, 21], "t", g4_only=True),
                    SaveJob("a", [12, 13], [2, 3], "t", g4_only=True)]


def test_handoff_promise_is_cut_only_at_withheld_ordinary_saves(tmp_path):
    """The promise cut every rank applies after the agreement (:func:`tp_sched.cut_promises`), on a real scheduler
    side (G3 and a file:// G4; no TP group needed for the cut itself): blocks 2-3 offered G4-only on every rank (only
    rank 0 planned them) cut nothing, N = 10; an ordinary save of block 7 only rank 0 planned, withheld, cuts N to 7
    (counted). Rank 1's request without a hand-off is never cut."""
    pytest.importorskip("vllm")
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.handoff import KEY
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.integrations.vllm.tp_sched import agree_plans, cut_promises

    ns, g3, g4 = _tiers(0, str(tmp_path), "el-saves-cut")
    try:
        side = SchedulerSide(ns, BS, g3, g4)
        assert side.hands_off
        promised = []
        for rid, ordinary in (("a", 2), ("b", 1)):  # rank 1 planned blocks 6-7 ordinary for a, block 6 for b
            req = _handoff_request(rid, 10)
            hs = [int(h) for h in side._state(req).hashes]
            r0 = [SaveJob(rid, [10, 11, 12, 13], hs[:4], TENANT, g4_only=True),
                  SaveJob(rid, [16, 17], hs[6:8], TENANT)]
            r1 = [SaveJob(rid, [10, 11], hs[:2], TENANT, g4_only=True),
                  SaveJob(rid, [16, 17][:ordinary], hs[6:6 + ordinary], TENANT)]
            _, withheld = agree_plans([r0, r1])
            before = stats.get("handoff_promise_cut_blocks") or 0
            cut_promises(side.promises, side._reqs, withheld)
            promised.append((side.request_finished(req, [])[1][KEY]["blocks"],
                             (stats.get("handoff_promise_cut_blocks") or 0) - before))
        assert promised == [(10, 0), (7, 3)], promised
        plain = SimpleNamespace(request_id="c", prompt_token_ids=list(range(10 * BS + 1)), cache_salt=TENANT,
                                lora_request=None, kv_transfer_params=None)
        side._state(plain)
        cut_promises(side.promises, side._reqs, {("c", TENANT, 0, 10, 1, b"")})
        assert side.request_finished(plain, []) == (False, None)
    finally:
        g3.close()
        g4.close()


def test_local_hit_saves_are_counted_as_offered_without_tp(tmp_path):
    """Without a TP group the offered plan is the planned one: the engine's prefix-cache blocks G3 lacks (5 of 6:
    G3 holds block 0) are counted ``save_local_hit_blocks`` at the step that offers them, as before the count moved
    to :func:`tp_sched.offer`; a later step offers none of them again and counts none."""
    pytest.importorskip("vllm")
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide

    ns, g3, _ = _tiers(0, str(tmp_path), "el-saves-local", g4=False)
    try:
        side = SchedulerSide(ns, BS, g3, None)
        a = SimpleNamespace(request_id="a", prompt_token_ids=list(range(100, 100 + 6 * BS + 1)), cache_salt=TENANT,
                            lora_request=None, kv_transfer_params=None)
        _fill(g3, ns, [int(h) for h in side._state(a).hashes][:1])
        assert side.get_num_new_matched_tokens(a, 6 * BS) == (0, False)
        side.update_state_after_alloc(a, None, 0)
        before = stats.get("save_local_hit_blocks") or 0
        meta = side.build_connector_meta(_step([("a", list(range(10, 17)), 6 * BS)], {"a": 1}))
        assert [j.block_ids for j in meta.saves] == [[11, 12, 13, 14, 15]]
        assert (stats.get("save_local_hit_blocks") or 0) - before == 5
        side.build_connector_meta(_step([], {}))
        assert (stats.get("save_local_hit_blocks") or 0) - before == 5
    finally:
        g3.close()


def test_save_plan_records_round_trip_and_refuse_truncated_bytes():
    """The save plans the ranks compare (binary records, no pickles): every job round-trips, a plan without digests
    too; truncated or malformed bytes are a ValueError naming what is wrong."""
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.tp_sched import decode_saves, encode_saves
    jobs = [SaveJob("r1", [3, 4], [2**64 - 1, 5], "t", group=1, digests=b"\x01" * 32),
            SaveJob("rü", [9], [7], "", g4_only=True)]
    assert decode_saves(encode_saves(jobs)) == jobs
    assert decode_saves(b"") == []
    for cut in (3, 20, len(encode_saves(jobs[1:])) - 1):
        with pytest.raises(ValueError, match="truncated or malformed"):
            decode_saves(encode_saves(jobs)[:-cut])
    with pytest.raises(ValueError, match="malformed at byte 0"):
        decode_saves(b"\x00" * 8 + b"\x07" + b"\x00" * 12)  # flags: a digest size no plan has


def test_mla_ranks_stage_the_same_blocks_after_a_g4_only_handoff_job(tmp_path):
    """An MLA model's replicated block goes to G4 from rank 0 only: a hand-off's G4-only job is staged on rank 0 and
    not on rank 1. On the old code rank 1 skipped it before touching the agreed staging budget, so it entered the
    step's next (computed) job with 4 more blocks of budget: it staged 6 blocks of it, rank 0 4 (blocks 5-6 in rank
    1's G3 only, never a hit). Now every rank charges the G4-only job's share: both stage 4.

    Two Offloads of one MLA namespace, one per TP rank as each rank's worker holds them, with the budget every rank
    agreed (8 blocks); real G3 pools (one per rank) and one file:// G4 store; the engine KV a CPU stand-in."""
    pytest.importorskip("vllm")
    import torch

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.offloads import Offloads, set_staging_budgets
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    ns = Namespace("kvbm-backend/el-saves-mla", KvLayout(2, 1, BS, 64, "bfloat16"), tp_world_size=2)  # MLA
    bpb = ns.layout.bytes_per_block
    pools, offs = [], []
    for r in range(2):
        cfg = load_config({"g3": {"paths": [f"{tmp_path}/g3-rank{r}"], "capacity_gb": 0.05, "files_per_path": 1,
                                  "admission": {"policy": "all"}},
                           "g4": {"enabled": True, "encrypt": False, "url": f"file://{tmp_path}/g4"}}, use_env=False)
        g3, g4 = open_tiers(cfg, ns)
        pools += [g3, g4]
        offs.append(Offloads(ns, r, g3, g4, max_pending_bytes=8 * bpb))
    kv = SimpleNamespace(num_blocks=32, layout=ns.layout, device=torch.device("cpu"),
                         gather=lambda ids, out: out.copy_(torch.zeros(len(ids) * bpb, dtype=torch.uint8)))
    try:
        hs = [int(h) for h in sequence_hashes(list(range(100, 100 + 10 * BS)), BS)]
        handoff = SaveJob("h", [0, 1, 2, 3], hs[:4], TENANT, g4_only=True)  # blocks from the prefix cache
        computed = SaveJob("h", [4, 5, 6, 7, 8, 9], hs[4:10], TENANT)
        set_staging_budgets({ns.fingerprint: 8 * bpb})  # the step's agreement: every rank's least room
        staged = []
        for o in offs:  # each rank's worker, the same step's jobs in the same order
            o.save(handoff, kv, False)  # rank 0 stages it (G4's writer), rank 1 does not
            b = stats.get("save_blocks") or 0
            o.save(computed, kv, False)  # G3 on every rank: the ranks must keep the same blocks
            staged.append((stats.get("save_blocks") or 0) - b)
        assert staged == [4, 4], f"of the computed job rank 0 staged {staged[0]} blocks, rank 1 {staged[1]}"
    finally:
        for o in offs:
            o.flush(HANG_S)
            o.close()
        for p in pools:
            p.close()


def test_closed_offloads_offer_no_staging_room():
    """A closed worker still referenced (not garbage-collected yet) is not one of this process's workers to the TP
    ranks' staging agreement. On the old code its smaller bound (2 blocks) was this rank's room for the namespace, so
    every rank staged within 2 blocks though the live worker had 8; and it took the agreed budget too."""
    pytest.importorskip("torch")
    from kvbm_backend.integrations.vllm.offloads import Offloads, set_staging_budgets, staging_rooms
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    ns = Namespace("kvbm-backend/el-saves-closed", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    bpb = ns.layout.bytes_per_block
    old = Offloads(ns, 0, None, None, max_pending_bytes=2 * bpb)
    old.close()
    live = Offloads(ns, 0, None, None, max_pending_bytes=8 * bpb)
    try:
        assert staging_rooms()[ns.fingerprint] == 8 * bpb
        set_staging_budgets({ns.fingerprint: 5 * bpb})
        assert (live.budget, old.budget) == (5 * bpb, None)
    finally:
        live.close()



def test_staging_rooms_records_round_trip_and_refuse_malformed_bytes():
    """The staging rooms the ranks' workers exchange ahead of their load results: round-trip, the rest of the blob
    kept; another magic or truncated bytes are a ValueError naming what is wrong."""
    from kvbm_backend.integrations.vllm.tp_agree import encode_rooms, split_rooms
    blob = encode_rooms({"fp-b": 2**40, "fp-a": 0}) + b"rest"
    assert split_rooms(blob) == ({"fp-a": 0, "fp-b": 2**40}, b"rest")
    assert split_rooms(encode_rooms({})) == ({}, b"")
    with pytest.raises(ValueError, match="not"):
        split_rooms(b"kvL1" + blob[4:])
    with pytest.raises(ValueError, match="truncated"):
        split_rooms(encode_rooms({"fp": 1})[:-3])
    # a room past 8 bytes (a max_pending_save_bytes meant as "no bound") is sent as the most 8 bytes carry
    assert split_rooms(encode_rooms({"fp": 10**20}))[0] == {"fp": 2**64 - 1}


def test_a_staging_bound_past_64_bits_goes_through_the_load_result_gather():
    """A ``max_pending_save_bytes`` the config accepts of 2**64 bytes or more (a huge number meant as "no bound"): on
    the old code ``encode_rooms`` raised ``struct.error: argument out of range`` from every ``get_finished`` of every
    rank (outside the agreement's try), so the engine died at its first step. Now the room is clamped to what 8 bytes
    carry and the agreed budget is set. A TP group of one over gloo (the gather is the same collective)."""
    pytest.importorskip("vllm")  # tp_agree imports the connector's metadata (vLLM)
    import torch.distributed as dist

    from kvbm_backend.integrations.vllm.extra_config import config_from_extra
    from kvbm_backend.integrations.vllm.offloads import Offloads
    from kvbm_backend.integrations.vllm.tp_agree import TpLoadAgree
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    huge = config_from_extra({"max_pending_save_bytes": 10**20})[1]["max_pending_save_bytes"]
    assert huge == 10**20  # accepted
    ns = Namespace("kvbm-backend/el-saves-huge-room", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    group, own = one_rank_group()
    o = Offloads(ns, 0, None, None, max_pending_bytes=huge)
    try:
        assert TpLoadAgree(group).agree(set(), set(), set(), []) == (set(), set())
        assert o.budget == 2**64 - 1
    finally:
        o.close()
        if own:
            dist.destroy_process_group()


def test_load_results_that_cannot_be_encoded_are_a_named_runtime_error():
    """A rank's load results that do not fit their records (here a negative engine block id) are a RuntimeError
    naming what could not be encoded, as the agreement's other failures are (on the old code the raw
    ``struct.error`` escaped), and nothing is exchanged."""
    pytest.importorskip("vllm")
    import torch.distributed as dist

    from kvbm_backend.integrations.vllm.tp_agree import TpLoadAgree

    group, own = one_rank_group()
    try:
        with pytest.raises(RuntimeError, match="load results .* could not be encoded"):
            TpLoadAgree(group).agree(set(), set(), {-1}, [])
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":  # argv: rank, port, output JSON, root, mode
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    {"saves": _saves_rank, "counts": _counts_rank, "staging": _staging_rank, "handoff_paths": _handoff_paths_rank,
     "handoff_promise": _handoff_promise_rank, "backend": _backend_rank}[sys.argv[5]](int(sys.argv[1]), sys.argv[4],
                                                                                      sys.argv[3])
