"""Tidy-ups of the TP agreements under vLLM's ``external_launcher`` with TP > 1 (every TP rank its own process with
its own scheduler; kvbm_backend/integrations/vllm/reset_epoch.py, tp_agree.py, tp_sched.py, kv_events.py).

Review (2026-12-03):

* ``reset_epoch.agreed`` made its own "TP group of more than one" decision (it asked vLLM for a TP group and
  broadcast wherever the process had one) beside the wiring's ``external_launcher`` decision, which every other
  agreement follows (``SchedulerSide.tp``): the two could disagree (a scheduler wired under ``mp`` in a process with
  a TP group of 2 broadcast its epoch). Now the reset broadcasts over the group the wiring gave the scheduler side,
  and only then.
* the answer a scheduler side's match agreement settled (so that the wiring's agreement right after skips its
  collective) lived in a module-level dict keyed by ``id(group)``: one settled and never taken (a scheduler side
  driven without the wiring's agreement) was answered by any later agreement over that group, without a collective:
  a rank whose answer matched it skipped the all-reduce the other ranks entered. Now the settlement belongs to the
  one agreement object the side and the wiring share, and any later agreement drops it.
* KV events learn a block when its save is planned; whether a block the ranks withheld (planned by some rank's
  scheduler only, offered by none) could be announced as stored: it cannot, a G3 block is published only once every
  rank's G3 report holds it (and a G4 block only once G4 holds every rank's slice); the test here holds that line.

Two real processes forming vLLM's TP group of 2 on gloo (``tests/helpers/tp_ranks.py``); run as a script, this file
is one rank."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
AGREE_GUARD_S = 60.0  # a hang guard on one collective whose partner may never come (the old code): not a bound
BS, TENANT = 16, "acme"


def _reset_rank(rank: int, root: str, out: str) -> None:
    """The scheduler role wired (``wire``) in a process with vLLM's TP group of 2, under ``mp`` and under
    ``external_launcher``, reset once each (``reset_tiers``): writes per backend whether the wiring agrees over the TP
    group (the scheduler side's ``tp``), whether its match agreement is the side's own, and the epoch the reset
    started."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbm_backend.integrations.vllm import reset_epoch
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire
    from tests.integrations.vllm.test_external_launcher_g3_tp import _configs

    res = {}
    for backend in ("mp", "external_launcher"):
        ktc, vc, kcc = _configs(f"{root}/g3-{backend}-rank{rank}")
        vc.parallel_config.distributed_executor_backend = backend
        parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
        try:
            side = parts.scheduler_role()
            shared = side.tp is not None and parts.match_agree is getattr(side.tp, "match_agree", None)
            res[backend] = {"wired_tp": side.tp is not None, "shared_match_agree": shared,
                            "epoch": reset_epoch.reset(side, engine_cleared=True)}
        finally:
            parts.close()
    Path(out).write_text(json.dumps(res))


def _settled_rank(rank: int, root: str, out: str) -> None:
    """A scheduler side given the TP group (as the wiring does under ``external_launcher``) agrees a request's match
    (its G3 is empty: ``(0, False)`` on both ranks) and no wiring takes the settled answer. Then a later agreement over
    the same TP group (a fresh ``TpMatchAgree``, as a later wiring makes) of different answers: rank 0 ``(0, False)``,
    the settled one, rank 1 ``(4 blocks, async)``. Every rank must enter that all-reduce and get the fewest, ``(0,
    False)``. Writes each rank's answer, or how it failed (the agreement runs under a hang guard)."""
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.integrations.vllm.tp_agree import TpMatchAgree
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    ns = Namespace("kvbm-backend/el-settled", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    cfg = load_config({"g3": {"paths": [f"{root}/g3-rank{rank}"], "capacity_gb": 0.05, "files_per_path": 1}},
                      use_env=False)
    g3, _ = open_tiers(cfg, ns)
    group = get_tp_group()
    try:
        side = SchedulerSide(ns, BS, g3, None, tp_group=group)
        req = SimpleNamespace(request_id="a", prompt_token_ids=list(range(100, 100 + 4 * BS + 1)), cache_salt=TENANT,
                              lora_request=None, kv_transfer_params=None)
        end = time.monotonic() + HANG_S
        while (ans := side.get_num_new_matched_tokens(req, 0))[0] is None:  # agreed: both ranks loop alike
            assert time.monotonic() < end, "a's lookup never ended"
            time.sleep(0.01)
        later = TpMatchAgree(group)
        mine = ans if rank == 0 else (4 * BS, True)
        got: dict = {}

        def agree() -> None:
            try:
                got["answer"] = list(later.agree(*mine))
            except RuntimeError as e:
                got["error"] = str(e)[:300]
        t = threading.Thread(target=agree, daemon=True)
        t.start()
        t.join(AGREE_GUARD_S)
        Path(out).write_text(json.dumps({"settled": list(ans), "mine": list(mine),
                                         **(got if got else {"error": "the agreement never ended"})}))
    finally:
        g3.close()


def _events_rank(rank: int, root: str, out: str) -> None:
    """Withheld saves and KV events: each rank's scheduler side over its own G3 view (rank 0's shows a 6-block
    prompt's first 4 blocks held, rank 1's only the first: as a revocation seen at different times makes the ranks'
    views differ) with the connector's G3 KV events; the G3 reports every rank's scheduler gets (the TP exchange):
    block 0 held by both ranks, blocks 1-3 by rank 0 only. Request ``a`` is served by the engine's prefix cache
    (all 6 blocks), so each rank plans the blocks its view says G3 lacks: rank 0 blocks 4-5, rank 1 blocks 1-5 (it
    learns 1-5 for the events); the ranks offer 4-5 and withhold 1-3. Then both ranks' workers report what they
    stored, the offered blocks. Writes the offered blocks and the vLLM hashes the events credited (a router's view)
    after the plan and after the reports."""
    import numpy as np
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.pool.g3.index import tag_of
    from tests.helpers.kv_router import DiskRouter
    from tests.integrations.vllm.test_external_launcher_saves_tp import _step

    ns = Namespace("kvbm-backend/el-events", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    cfg = load_config({"g3": {"paths": [f"{root}/g3-rank{rank}"], "capacity_gb": 0.05, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    try:
        side = SchedulerSide(ns, BS, g3, None, tp_group=get_tp_group())
        side.events = G3KvEvents(2, BS)
        toks = list(range(100, 100 + 6 * BS + 1))
        a = SimpleNamespace(request_id="a", prompt_token_ids=toks, all_token_ids=toks, cache_salt=TENANT,
                            lora_request=None, kv_transfer_params=None, mm_features=[], prompt_embeds=None,
                            block_hashes=[f"a{i}".encode() for i in range(6)])
        hs = [int(h) for h in side._state(a).hashes]
        held = {0: 4, 1: 1}[rank]
        for r in range(2):  # this rank's view: G3 holds every rank's slice of the first `held` blocks
            keys = ns.keys(hs[:held], TENANT, r)
            res = g3.put(keys, [np.full(ns.layout.bytes_per_block, i, np.uint8) for i in range(held)])
            assert res.result(HANG_S).written == held
        assert g3.flush(HANG_S)
        t = tag_of(TENANT)
        side.apply_g3_report(0, KvbmWorkerMeta(added=[(t, r, hs[0]) for r in range(2)]), rank=None)
        side.apply_g3_report(0, KvbmWorkerMeta(added=[(t, 0, h) for h in hs[1:4]]), rank=None)
        router = DiskRouter()
        assert side.get_num_new_matched_tokens(a, 6 * BS) == (0, False)  # the engine's prefix cache has it all
        side.update_state_after_alloc(a, None, 0)
        meta = side.build_connector_meta(_step([("a", list(range(10, 17)), 6 * BS)], {"a": 1}))
        offered = sorted(hs.index(int(h)) for j in meta.saves for h in j.seq_hashes)
        router.apply(side.take_events())
        after_plan = sorted(router.disk)
        for r in range(2):  # each rank's worker stored its slice of the offered blocks (the TP exchange: both)
            side.apply_g3_report(0, KvbmWorkerMeta(added=[(t, r, hs[i]) for i in offered]), rank=None)
        router.apply(side.take_events())
        Path(out).write_text(json.dumps({
            "offered": offered, "after_plan": [str(h) for h in after_plan],
            "after_reports": [str(h) for h in sorted(router.disk)],
            "credited_blocks": sorted(i for i in range(6) if _vh(a, i) in router.disk),
            "withheld": stats.get("tp_save_withheld_blocks")}))
    finally:
        g3.close()


def _vh(request, i: int):
    """Block ``i``'s vLLM hash as the events carry it."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash(request.block_hashes[i])


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_the_reset_epoch_is_agreed_exactly_where_the_wiring_agrees(tmp_path):
    """On the old code the scheduler wired under ``mp`` (no TP agreement: its scheduler is the engine's only one)
    still broadcast its reset epoch over the process's TP group: both ranks reset to rank 0's epoch, a decision the
    wiring did not make. Now the epochs are agreed exactly where the wiring hands the scheduler side the TP group
    (``external_launcher``), and the wiring's match agreement is the scheduler side's own (its settled answers)."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "reset")
    for backend in ("mp", "external_launcher"):
        wired = r0[backend]["wired_tp"]
        assert wired == r1[backend]["wired_tp"] == (backend == "external_launcher")
        agreed = r0[backend]["epoch"] == r1[backend]["epoch"]
        assert agreed == wired, f"{backend}: the wiring agrees over the TP group: {wired}, the reset epoch: {agreed}"
        assert r0[backend]["epoch"] and r1[backend]["epoch"]
    assert r0["external_launcher"]["shared_match_agree"] and r1["external_launcher"]["shared_match_agree"]


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_a_settled_match_answer_never_answers_a_later_agreement(tmp_path):
    """On the old code the answer the scheduler side settled, never taken, stayed in the module's dict under the
    group's id: the later agreement on rank 0 (whose answer equalled it) returned it without the all-reduce, and rank
    1 entered that all-reduce alone (it failed once rank 0's process was gone, or waited). Now both ranks agree: the
    fewest tokens, ``(0, False)``."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "settled")
    assert r0["settled"] == r1["settled"] == [0, False]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["answer"] == r1["answer"] == [0, False]


def test_the_wirings_match_agreement_takes_the_sides_settled_answer_once(tmp_path, monkeypatch):
    """The pairing the wiring relies on (``ConnectorParts.get_num_new_matched_tokens``): the scheduler side's match
    agreement settles its answer, and the wiring's agreement right after (the same object,
    ``SchedAgree.match_agree``) returns it without a second all-reduce; only once: the next call of the same answer
    all-reduces, as does a fresh agreement over the same group (before 2026-12-03 a fresh one took the settled answer
    when nothing had taken it). A TP group of one over gloo; the all-reduces counted at ``torch.distributed``."""
    pytest.importorskip("vllm")
    import torch.distributed as dist

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.integrations.vllm.tp_agree import TpMatchAgree
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from tests.helpers.tp_ranks import one_rank_group

    ns = Namespace("kvbm-backend/el-pairing", KvLayout(2, 2, BS, 64, "bfloat16"))
    g3, _ = open_tiers(load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05,
                                           "files_per_path": 1}}, use_env=False), ns)
    group, own = one_rank_group()
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    try:
        side = SchedulerSide(ns, BS, g3, None, tp_group=group)
        req = SimpleNamespace(request_id="a", prompt_token_ids=list(range(100, 100 + 4 * BS + 1)), cache_salt=TENANT,
                              lora_request=None, kv_transfer_params=None)
        end = time.monotonic() + HANG_S
        while (ans := side.get_num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() < end, "a's lookup never ended"
            time.sleep(0.01)
        assert ans == (0, False)
        wiring = side.tp.match_agree
        n = len(calls)
        assert wiring.agree(*ans) == ans and len(calls) == n  # the settled answer: no second collective
        assert wiring.agree(*ans) == ans and len(calls) == n + 1  # taken once only
        side.get_num_new_matched_tokens(req, 0)  # settles again, and nothing takes it
        n = len(calls)
        assert TpMatchAgree(group).agree(*ans) == ans and len(calls) == n + 1  # a fresh agreement all-reduces
    finally:
        g3.close()
        if own:
            dist.destroy_process_group()


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_withheld_saves_are_never_published_as_stored(tmp_path):
    """The ranks withhold blocks 1-3 (rank 1 planned them, and learned them for the KV events); the events credit
    block 0 (every rank's G3 holds it) and, once every rank's worker reports them stored, the offered blocks 4-5:
    never the withheld ones (rank 0's G3 alone holds their slices). Holds on the old code too: publication waits for
    every rank's report, whatever was learned when planning (see the module doc)."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "events")
    assert r0["offered"] == r1["offered"] == [4, 5]
    assert (r0["withheld"], r1["withheld"]) == (0, 3)  # rank 1 planned 1-3: withheld
    assert r0["after_plan"] == r1["after_plan"]
    assert r0["credited_blocks"] == r1["credited_blocks"] == [0, 4, 5]


if __name__ == "__main__":  # argv: rank, port, output JSON, root, mode
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    {"reset": _reset_rank, "settled": _settled_rank, "events": _events_rank}[sys.argv[5]](
        int(sys.argv[1]), sys.argv[4], sys.argv[3])
