"""G4 announcements (``g4.announce``) under vLLM's ``external_launcher`` with TP > 1, every TP rank its own process
hosting a scheduler (kvbm_backend/integrations/vllm/tp_events.py, g4_announce.py, kv_events.py, scheduler_side.py).

Review (2026-12-03):

* every rank's scheduler ran its own G4 announcer: each rank HEADed every rank's G4 slice of the same blocks and
  wrote its own announcement batch of them (TP-fold HEADs and announcement objects, each read by every poller). An
  announcement confirms that G4 holds every rank's slice (the flush HEADs every rank's key), so TP rank 0's alone
  now announces for the engine; every rank still polls and credits.
* the blocks of a step's save plan were learned (KV events, announcer) as planned: blocks the ranks' agreement
  withheld (planned by some rank, offered by none) sat in the events' learned table and the announcer's pending
  list, HEADed with backoff for 600 s, then counted ``announce_dropped_absent``. Now only the blocks offered are.

Review of c457237 (2026-12-03):

* rank 0 announced alone whatever the ranks' hash domains: vLLM draws ``NONE_HASH`` at random per process for a
  non-cryptographic prefix-caching hash when ``PYTHONHASHSEED`` is unset (torchrun does not set it), a poller ignores
  batches of another domain (``announce_ignored_domain``), so rank 1's KV events never carried a G4 block. Now the
  ranks agree once whether they share one domain; if not every rank announces for itself, with one WARNING.
* a block this rank planned as an ordinary save that the agreement offers G4-only was learned for G3 (the events'
  learned table) though no rank writes its G3 slice; now it is only told to the announcer.
* a step whose save agreement failed kept its planned blocks, learned by the next step's offer though never
  offered; now they are dropped.

Two real processes forming vLLM's TP group of 2 on gloo (``tests/helpers/tp_ranks.py``), one real G4 file store
shared by both (its HEADs counted at the store), real scheduler sides, KV events and announcers driven directly (no
background thread); run as a script, this file is one rank."""
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
BS, TENANT = 16, "acme"


def _counting_pool(root: str, ns):
    """A plaintext G4 pool (``g4.announce`` on) over the file store ``root/g4`` both ranks share, whose HEADs are
    counted (``pool.store.heads``)."""
    from kvbm_backend.config import G4Config
    from kvbm_backend.pool.g4.fs_store import FsStore
    from kvbm_backend.pool.g4.pool import G4Pool

    class CountingFs(FsStore):
        heads = 0
        _mu = threading.Lock()

        def head(self, name):
            with self._mu:
                self.heads += 1
            return super().head(name)

    store = CountingFs(f"{root}/g4", fsync=False)
    return G4Pool(G4Config(url=f"file://{root}/g4", encrypt=False, announce=True), ns, store=store)


def _request(rid: str, n_blocks: int, start: int):
    toks = list(range(start, start + n_blocks * BS + 1))
    return SimpleNamespace(request_id=rid, prompt_token_ids=toks, all_token_ids=toks, cache_salt=TENANT,
                           lora_request=None, kv_transfer_params=None, mm_features=[], prompt_embeds=None,
                           block_hashes=[f"{rid}{i}".encode() for i in range(n_blocks)])


def _wire(side, pool, ns):
    """The connector's KV events and G4 announcer of scheduler side ``side`` (as the wiring makes them), driven
    directly: returns the announcer."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
    init_none_hash(sha256_cbor)  # the hash domain (the same on both ranks: sha256's fixed seed)
    ann = G4Announcer(side.events, pool, ns, 0.05, 3600)
    side.events.announcer = ann
    return ann


def _put_slices(pool, ns, hs, rank: int) -> None:
    """What this rank's worker does with an offered save: its slice of blocks ``hs`` written to G4."""
    import numpy as np
    blocks = [np.full(ns.layout.bytes_per_block, i + 1, np.uint8) for i in range(len(hs))]
    assert pool.put(ns.keys(hs, TENANT, rank), blocks).result(HANG_S).written == len(hs)
    assert pool.flush(HANG_S)


def _warnings() -> list:
    """The WARNINGs the connector's logger emits from now on (a list filled as they come)."""
    import logging
    got: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                got.append(record.getMessage())
    logging.getLogger("kvbm_backend.connector").addHandler(Keep())
    return got


def _credited(router, request, n: int) -> list[int]:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return [i for i in range(n) if maybe_convert_block_hash(request.block_hashes[i]) in router.disk]


def _announce_rank(rank: int, root: str, out: str) -> None:
    """Both ranks' scheduler sides plan and offer the same save of request ``a`` (4 blocks), and each rank's worker
    writes its slice to G4; then each rank's announcer flushes once (HEADs counted) and polls. Then request ``b`` (2
    blocks), whose rank-1 slices reach G4 only after rank 0's first flush: rank 0 announces them only once they are
    there. Writes per rank the blocks announced and HEADs of the first flush, the announcement objects in the store,
    and the blocks each rank's events credit (a router's view)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from tests.helpers.kv_router import DiskRouter
    from tests.integrations.vllm.test_external_launcher_saves_tp import _step

    ns = Namespace("kvbm-backend/el-announce", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    pool = _counting_pool(root, ns)
    group = get_tp_group()
    cpu = group.cpu_group
    warned = _warnings()
    try:
        side = SchedulerSide(ns, BS, None, pool, load=False, tp_group=group)
        side.events = G3KvEvents(2, BS, g3=False)
        ann = _wire(side, pool, ns)
        router = DiskRouter()
        a = _request("a", 4, 100)
        assert side.get_num_new_matched_tokens(a, 0) == (0, False)
        side.update_state_after_alloc(a, None, 0)
        meta = side.build_connector_meta(_step([("a", list(range(10, 14)), 0)], {"a": 4 * BS}))
        ha = [int(h) for h in side._reqs["a"].hashes]
        assert sorted(int(h) for j in meta.saves for h in j.seq_hashes) == sorted(ha)  # offered on every rank
        _put_slices(pool, ns, ha, rank)
        dist.barrier(group=cpu)  # every rank's slice is in G4
        h0 = pool.store.heads
        announced = ann.flush()
        heads = pool.store.heads - h0
        dist.barrier(group=cpu)  # every rank flushed
        batches = len(ann.ann.list())
        ann.poll()
        router.apply(side.events.take())
        credited_a = _credited(router, a, 4)

        b = _request("b", 2, 5000)
        side.get_num_new_matched_tokens(b, 0)
        side.update_state_after_alloc(b, None, 0)
        side.build_connector_meta(_step([("b", [20, 21], 0)], {"b": 2 * BS}))
        hb = [int(h) for h in side._reqs["b"].hashes]
        if rank == 0:
            _put_slices(pool, ns, hb, rank)
        dist.barrier(group=cpu)  # rank 0's slices of b are in G4, rank 1's not yet
        early = ann.flush()
        dist.barrier(group=cpu)
        if rank == 1:
            _put_slices(pool, ns, hb, rank)
        dist.barrier(group=cpu)  # now every rank's slice is
        late, end = 0, time.monotonic() + HANG_S
        while rank == 0 and late < 2:  # looked for again after its backoff (an interval or two)
            assert time.monotonic() < end, "b was never announced"
            time.sleep(0.05)
            late += ann.flush()
        dist.barrier(group=cpu)  # rank 0 announced b
        ann.poll()
        router.apply(side.events.take())
        Path(out).write_text(json.dumps({
            "announced": announced, "heads": heads, "batches": batches, "credited_a": credited_a,
            "b_early": early, "b_late": late, "credited_b": _credited(router, b, 2),
            "batches_after": len(ann.ann.list()), "warnings": warned}))
    finally:
        pool.close()


def _withheld_rank(rank: int, root: str, out: str) -> None:
    """The ranks withhold blocks: each rank's scheduler side over its own G3 view (rank 0's shows a 6-block prompt's
    first block held, rank 1's the first 4: as a revocation seen at different times makes the ranks' views differ),
    with G4 (the shared, counted file store) and the connector's KV events and G4 announcer. Request ``a`` is served by
    the engine's prefix cache, so each rank plans the blocks its view says G3 lacks: rank 0 blocks 1-5, rank 1 blocks
    4-5; the ranks offer 4-5 and withhold 1-3. Both ranks' workers then write their slices of the blocks G3 holds for
    both (0) and of those offered (4-5) to G4 and report 4-5 in G3. Writes the blocks the KV events hold learned and
    unpublished, the HEADs and blocks of each rank's announcer flush, and the blocks the events credit."""
    import numpy as np
    import torch.distributed as dist
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

    ns = Namespace("kvbm-backend/el-withheld", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    cfg = load_config({"g3": {"paths": [f"{root}/g3-rank{rank}"], "capacity_gb": 0.05, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    pool = _counting_pool(root, ns)
    cpu = get_tp_group().cpu_group
    try:
        side = SchedulerSide(ns, BS, g3, pool, tp_group=get_tp_group())
        side.events = G3KvEvents(2, BS)
        ann = _wire(side, pool, ns)
        a = _request("a", 6, 100)
        hs = [int(h) for h in side._state(a).hashes]
        held = {0: 1, 1: 4}[rank]
        for r in range(2):  # this rank's view: G3 holds every rank's slice of the first `held` blocks
            res = g3.put(ns.keys(hs[:held], TENANT, r), [np.full(ns.layout.bytes_per_block, i, np.uint8)
                                                         for i in range(held)])
            assert res.result(HANG_S).written == held
        assert g3.flush(HANG_S)
        t = tag_of(TENANT)
        side.apply_g3_report(0, KvbmWorkerMeta(added=[(t, r, hs[0]) for r in range(2)]), rank=None)
        router = DiskRouter()
        assert side.get_num_new_matched_tokens(a, 6 * BS) == (0, False)  # the engine's prefix cache has it all
        side.update_state_after_alloc(a, None, 0)
        meta = side.build_connector_meta(_step([("a", list(range(10, 17)), 6 * BS)], {"a": 1}))
        offered = sorted(hs.index(int(h)) for j in meta.saves for h in j.seq_hashes)
        learned = sorted(i for i in range(6) if (t, hs[i]) in side.events._info)  # learned, not yet published
        _put_slices(pool, ns, [hs[i] for i in [0] + offered], rank)
        dist.barrier(group=cpu)  # every rank's slices of 0 and the offered blocks are in G4
        h0 = pool.store.heads
        announced = ann.flush()
        heads = pool.store.heads - h0
        for r in range(2):  # each rank's worker stored its slice of the offered blocks (the TP exchange: both)
            side.apply_g3_report(0, KvbmWorkerMeta(added=[(t, r, hs[i]) for i in offered]), rank=None)
        router.apply(side.events.take())
        Path(out).write_text(json.dumps({
            "offered": offered, "learned": learned, "announced": announced, "heads": heads,
            "withheld": stats.get("tp_save_withheld_blocks"),
            "credited": _credited(router, a, 6)}))
    finally:
        pool.close()
        g3.close()


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_one_rank_announces_for_every_rank(tmp_path):
    """On the old code both ranks' announcers HEADed both ranks' slices of the 4 blocks (8 HEADs each) and wrote a
    batch each: 2 announcement objects of the same blocks. Now TP rank 0's alone HEADs (every rank's slice: 8) and
    writes (1 object); rank 1 HEADs nothing, and both ranks' pollers credit the 4 blocks. Rank 0 announces a block
    only once every rank's slice is in G4: ``b``'s, not while rank 1's slices are missing, then once they are there."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "announce")
    assert (r0["announced"], r1["announced"]) == (4, 0), "one rank announces the engine's blocks"
    assert (r0["heads"], r1["heads"]) == (8, 0), "only the announcing rank HEADs, every rank's slice"
    assert r0["batches"] == r1["batches"] == 1, "one announcement object for the 4 blocks"
    assert r0["credited_a"] == r1["credited_a"] == [0, 1, 2, 3]
    assert r0["b_early"] == 0 and r0["b_late"] == 2, "b announced only once rank 1's slices are in G4"
    assert r1["b_early"] == r1["b_late"] == 0
    assert r0["credited_b"] == r1["credited_b"] == [0, 1]
    assert r0["batches_after"] == r1["batches_after"] == 2
    assert r0["warnings"] == r1["warnings"] == []  # one hash domain (sha256): nothing to warn of


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_withheld_blocks_are_neither_learned_nor_looked_for_in_g4(tmp_path):
    """On the old code rank 0 learned the withheld blocks 1-3 it planned: they sat in its events' learned table, and
    its announcer HEADed both ranks' slices of them (12 HEADs, not 6), to keep looking for them with backoff for 600
    s; rank 1's announcer HEADed blocks 0-5 (12 HEADs). Now only the offered blocks 4-5 are learned from the plan
    (block 0 from the lookup: G3 holds it), rank 0's flush HEADs blocks 0, 4 and 5 of both ranks (6) and announces
    them, rank 1's none; the events credit 0, 4 and 5 once every rank's G3 holds them."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "withheld")
    assert r0["offered"] == r1["offered"] == [4, 5]
    assert (r0["withheld"], r1["withheld"]) == (3, 0)  # rank 0 planned 1-3: withheld
    assert r0["learned"] == [4, 5], "withheld blocks are never learned"
    assert r1["learned"] == [1, 2, 3, 4, 5]  # its lookup learned 1-3 (its view: G3 holds them), the plan 4-5
    assert (r0["heads"], r1["heads"]) == (6, 0), "no HEAD for a withheld block, none on rank 1"
    assert (r0["announced"], r1["announced"]) == (3, 0)
    assert r0["credited"] == r1["credited"] == [0, 4, 5]


def _domain_rank(rank: int, root: str, out: str) -> None:
    """vLLM's NONE_HASH drawn at random per process (``--prefix-caching-hash-algo xxhash``, ``PYTHONHASHSEED`` unset
    as under torchrun): each rank's process its own hash domain. Both ranks' scheduler sides plan and offer the same
    4-block save, each rank's worker writes its slice, each announcer flushes once (HEADs counted) and polls. Writes
    the rank's domain, blocks announced and HEADs, the WARNINGs logged, and the blocks its KV events credit."""
    import os

    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group
    from vllm.utils.hashing import xxhash
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
    from kvbm_backend.integrations.vllm.g4_records import hash_domain
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from tests.helpers.kv_router import DiskRouter
    from tests.integrations.vllm.test_external_launcher_saves_tp import _step

    os.environ.pop("PYTHONHASHSEED", None)  # as under torchrun
    init_none_hash(xxhash)  # --prefix-caching-hash-algo xxhash: a random NONE_HASH per process
    ns = Namespace("kvbm-backend/el-domain", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    pool = _counting_pool(root, ns)
    group = get_tp_group()
    cpu = group.cpu_group
    warned = _warnings()
    try:
        side = SchedulerSide(ns, BS, None, pool, load=False, tp_group=group)
        side.events = G3KvEvents(2, BS, g3=False)
        ann = G4Announcer(side.events, pool, ns, 0.05, 3600)
        side.events.announcer = ann
        router = DiskRouter()
        a = _request("a", 4, 100)
        assert side.get_num_new_matched_tokens(a, 0) == (0, False)
        side.update_state_after_alloc(a, None, 0)
        side.build_connector_meta(_step([("a", list(range(10, 14)), 0)], {"a": 4 * BS}))
        side.build_connector_meta(_step([], {}))  # agreed once: no collective of it in later steps
        _put_slices(pool, ns, [int(h) for h in side._reqs["a"].hashes], rank)
        dist.barrier(group=cpu)  # every rank's slice is in G4
        h0 = pool.store.heads
        announced = ann.flush()
        heads = pool.store.heads - h0
        dist.barrier(group=cpu)  # every rank flushed
        ann.poll()
        router.apply(side.events.take())
        Path(out).write_text(json.dumps({
            "domain": hash_domain(), "announced": announced, "heads": heads, "warnings": warned,
            "credited": _credited(router, a, 4), "ignored": stats.get("announce_ignored_domain")}))
    finally:
        pool.close()


def _g4_only_rank(rank: int, root: str, out: str) -> None:
    """A hand-off prefill request served by the engine's prefix cache (6 blocks), each rank's scheduler over its own
    G3 view (rank 0's shows block 0 held, rank 1's blocks 0-3) with G4 (announcing, one hash domain): rank 0 plans
    blocks 1-5 as ordinary saves and 0 G4-only, rank 1 plans 4-5 ordinary and 0-3 G4-only; the ranks offer 1-3 and 0
    G4-only, 4-5 ordinary. Writes the offered jobs (block indexes, G4-only), the blocks the KV events hold learned for
    G3 and those the announcer has pending."""
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend.integrations.vllm.handoff import KEY
    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.pool.g3.index import tag_of
    from tests.integrations.vllm.test_external_launcher_saves_tp import _fill, _step, _tiers

    ns, g3, _ = _tiers(rank, root, "el-g4-only", g4=False)
    pool = _counting_pool(root, ns)
    try:
        side = SchedulerSide(ns, BS, g3, pool, tp_group=get_tp_group())
        side.events = G3KvEvents(2, BS)
        ann = _wire(side, pool, ns)
        assert side.hands_off
        a = _request("a", 6, 100)
        a.kv_transfer_params = {KEY: True}
        hs = [int(h) for h in side._state(a).hashes]
        _fill(g3, ns, hs[:{0: 1, 1: 4}[rank]])
        assert side.get_num_new_matched_tokens(a, 6 * BS) == (0, False)  # the engine's prefix cache has it all
        side.update_state_after_alloc(a, None, 0)
        meta = side.build_connector_meta(_step([("a", list(range(10, 17)), 6 * BS)], {"a": 1}))
        t = tag_of(TENANT)
        Path(out).write_text(json.dumps({
            "jobs": [[[hs.index(int(h)) for h in j.seq_hashes], j.g4_only] for j in meta.saves],
            "learned": sorted(i for i in range(6) if (t, hs[i]) in side.events._info),
            "pending": sorted(hs.index(seq) for _, seq in ann._pending)}))
    finally:
        pool.close()
        g3.close()


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_every_rank_announces_for_itself_when_the_ranks_hash_domains_differ(tmp_path):
    """Per-process NONE_HASH: each rank's poller credits only its own domain's batches. On the code of c457237 rank 0
    announced alone and rank 1's KV events credited no G4 block ([] != [0, 1, 2, 3], its batch ignored as another
    domain's). Now the ranks find their domains differ (one all-gather at first use): each announces the 4 blocks
    itself (HEADing every rank's slice), each credits them, and TP rank 0 logs one WARNING naming the remedy."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "domain")
    assert r0["domain"] != r1["domain"]  # the precondition: per-process NONE_HASH
    assert r0["credited"] == [0, 1, 2, 3]
    assert r1["credited"] == [0, 1, 2, 3], f"rank 1's KV events credit {r1['credited']} (ignored batches: " \
                                           f"{r1['ignored']})"
    assert (r0["announced"], r1["announced"]) == (4, 4), "every rank announces for itself"
    assert (r0["heads"], r1["heads"]) == (8, 8)
    assert len(r0["warnings"]) == 1 and r1["warnings"] == [], r0["warnings"] + r1["warnings"]
    assert "PYTHONHASHSEED" in r0["warnings"][0] and "sha256" in r0["warnings"][0]


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_blocks_the_agreement_offers_g4_only_are_announced_but_not_learned_for_g3(tmp_path):
    """Rank 0 planned blocks 1-3 of the hand-off as ordinary G3 + G4 saves, rank 1 G4-only: they are offered G4-only
    on every rank, so no rank writes their G3 slice. On the old code rank 0 learned them for G3 anyway (learned
    [0, 1, 2, 3, 4, 5] != [0, 4, 5]: they sat in the events' learned table until max_pending pushed them out). Now
    rank 0 (the one announcer) tells its announcer blocks 0-5 (all reach G4) and learns for G3 block 0 (its lookup)
    and 4-5 (offered ordinary); rank 1 learned 0-3 from its lookup (its view: G3 holds them) and 4-5, announces
    nothing."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "g4_only")
    assert r0["jobs"] == r1["jobs"] == [[[1, 2, 3], True], [[4, 5], False], [[0], True]], r0["jobs"]
    assert r0["learned"] == [0, 4, 5], "blocks offered G4-only are not learned for G3"
    assert r0["pending"] == [0, 1, 2, 3, 4, 5], "every block reaching G4 is told to the announcer"
    assert (r1["learned"], r1["pending"]) == ([0, 1, 2, 3, 4, 5], [])


def test_a_failed_save_agreement_learns_nothing_of_its_plan_later(tmp_path):
    """The step's save agreement fails (its TP group's CPU process group is no process group: the collective raises,
    RuntimeError). On the old code the blocks that step planned stayed kept for the KV events and the next step's
    offer learned them ([0, 1, 2, 3] learned though never offered); now they are dropped with the failed step."""
    pytest.importorskip("vllm")
    import torch.distributed as dist

    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.pool.g3.index import tag_of
    from tests.helpers.tp_ranks import one_rank_group
    from tests.integrations.vllm.test_external_launcher_saves_tp import _step, _tiers

    group, own = one_rank_group()
    ns, g3, _ = _tiers(0, str(tmp_path), "el-failed-offer", g4=False)
    try:
        side = SchedulerSide(ns, BS, g3, None, tp_group=group)
        side.events = G3KvEvents(1, BS)
        a = _request("a", 4, 100)
        assert side.get_num_new_matched_tokens(a, 0) == (0, False)
        side.update_state_after_alloc(a, None, 0)
        side.tp.group = type(group)(world_size=1, cpu_group=object(), rank_in_group=0)  # a rank gone, say
        with pytest.raises(RuntimeError, match="save plans"):
            side.build_connector_meta(_step([("a", list(range(10, 14)), 0)], {"a": 4 * BS}))
        side.tp.group = group  # the group works again: the next step agrees
        side.build_connector_meta(_step([], {}))
        t, hs = tag_of(TENANT), [int(h) for h in side._reqs["a"].hashes]
        assert [i for i in range(4) if (t, hs[i]) in side.events._info] == []
    finally:
        g3.close()
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":  # argv: rank, port, output JSON, root, mode
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    {"announce": _announce_rank, "withheld": _withheld_rank, "domain": _domain_rank,
     "g4_only": _g4_only_rank}[sys.argv[5]](int(sys.argv[1]), sys.argv[4], sys.argv[3])
