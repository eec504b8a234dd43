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

Two real processes, each with vLLM's model-parallel state on gloo (``tests/helpers/tp_ranks.py``); run as a script,
this file is one rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks

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
        side = SchedulerSide(ns, BS, g3, None)
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
    once each (one step disagreed; rank 1 withheld 3 blocks); ``b``'s step, planned alike, is kept whole."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "saves")
    assert r0["plans"] == r1["plans"], "the TP ranks' schedulers planned different saves"
    (step1, step2), hs = r0["plans"], r0["hashes"]
    assert step1 == [["a", [14, 15], hs[4:6]]]
    assert [(j[0], j[1]) for j in step2] == [("b", [20, 21])]
    assert (r0["disagreed"], r0["withheld"], r1["disagreed"], r1["withheld"]) == (1, 0, 1, 3)


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


def test_save_plan_records_round_trip_and_refuse_truncated_bytes():
    """The save plans the ranks compare (binary records, no pickles): every block's identity round-trips, a plan
    without digests too; truncated bytes are a ValueError naming what is wrong."""
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.tp_sched import block_entries, encode_saves
    jobs = [SaveJob("r1", [3, 4], [2**64 - 1, 5], "t", group=1, digests=b"\x01" * 32),
            SaveJob("rü", [9], [7], "", g4_only=True)]
    assert block_entries(encode_saves(jobs)) == {("r1", "t", 1, False, 3, 2**64 - 1, b"\x01" * 16),
                                                 ("r1", "t", 1, False, 4, 5, b"\x01" * 16),
                                                 ("rü", "", 0, True, 9, 7, b"")}
    assert block_entries(b"") == set()
    with pytest.raises(ValueError, match="truncated"):
        block_entries(encode_saves(jobs)[:-3])



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


if __name__ == "__main__":  # argv: rank, port, output JSON, root, mode
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    {"saves": _saves_rank, "counts": _counts_rank, "staging": _staging_rank}[sys.argv[5]](int(sys.argv[1]), sys.argv[4], sys.argv[3])
