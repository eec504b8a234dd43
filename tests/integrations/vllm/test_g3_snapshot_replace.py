"""A rank's snapshot after its report channel failed replaces that rank's entries in the scheduler's G3 mirror
and KV events (:meth:`G3Mirror.apply`, :meth:`G3KvEvents.apply`)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvbm_backend.model.layout import KvLayout

pytest.importorskip("vllm")

HANG_S = 600.0  # a hang guard, not a bound


def test_snapshot_after_a_lost_channel_report_replaces_the_ranks_entries(tmp_path):
    """TP=2. Rank 0's G3 holds A, B (its first snapshot, by the report channel); rank 1 reports A, B, C. A and B
    are published (every rank holds them). Rank 0's G3 then drops B and writes C; the channel report carrying
    that is lost (the channel failed: ``resend_snapshot``, reports back to the step output) and rank 0's next
    report is a fresh snapshot {A, C} in the step output. The mirror must hold rank 0's A and C, not B (before
    the fix it kept B: a snapshot only added), rank 1's entries untouched; the KV events must withdraw B
    (``BlockRemoved``) and publish C (learned, now held by both ranks), and keep A published. Real G3 pool,
    real WorkerSide reports, real SchedulerSide / G3Mirror / G3KvEvents."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    import torch

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
    from kvbm_backend.integrations.vllm.scheduler_side import G3KvEvents, G3Mirror, SchedulerSide
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    bs = 4
    lay = KvLayout(2, 2, bs, 64, "bfloat16")
    ns = Namespace("m", lay, tp_world_size=2)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    try:
        toks = list(range(100, 100 + 3 * bs))
        hs = sequence_hashes(toks, bs)  # blocks A, B, C
        k0 = ns.keys(hs, "", 0)
        blk = [np.full(g3.layout.bytes_per_block, i, np.uint8) for i in range(3)]
        assert g3.put(k0[:2], blk[:2]).result(HANG_S).written == 2  # rank 0's G3: A, B
        g3.flush(HANG_S)
        worker = WorkerSide(ns, 0, g3, None, report_g3=True)
        worker.reconcile_interval_s = 0.0
        worker.report_by_channel = True
        mirror = G3Mirror(ns)
        sched = SchedulerSide(ns, bs, mirror, None)
        ev = sched.events = G3KvEvents(2, bs, FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64,
                                                               dtype=torch.bfloat16))
        rep = worker.take_g3_report()  # the first snapshot, by the channel
        assert rep is not None and rep[2] and sorted(rep[0]) == sorted(map(mirror_id, k0[:2]))
        sched.apply_g3_report(0, KvbmWorkerMeta(*rep), rank=0)
        ids1 = [mirror_id(k) for k in ns.keys(hs, "", 1)]
        sched.apply_g3_report(0, KvbmWorkerMeta(added=ids1, snapshot=True), rank=1)
        assert mirror.ready
        r = SimpleNamespace(block_hashes=[b"hA", b"hB", b"hC"], all_token_ids=toks, lora_request=None,
                            cache_salt=None, mm_features=[], prompt_embeds=None, num_prompt_tokens=len(toks))
        hA, hB, hC = map(maybe_convert_block_hash, r.block_hashes)  # as vLLM publishes them
        ev.learn("", r, hs, 0, 3)  # a request's blocks: A, B held by both ranks are published, C is not
        (st,) = ev.take()
        assert isinstance(st, BlockStored) and st.block_hashes == [hA, hB]

        # rank 0's G3 drops B and holds C; the channel report saying so is lost with the channel
        assert g3.delete(k0[1:2]).result(HANG_S) == 1
        assert g3.put(k0[2:3], blk[2:3]).result(HANG_S).written == 1
        g3.flush(HANG_S)
        worker._added.append(mirror_id(k0[2]))  # what the worker's put callback records
        lost = worker.take_g3_report()
        assert lost is not None and mirror_id(k0[1]) in lost[1] and mirror_id(k0[2]) in lost[0]
        worker.resend_snapshot()  # start_worker_reports' on_closed: back to the step output, a new snapshot
        worker.report_by_channel = False
        meta = worker.worker_meta()
        assert meta is not None and meta.snapshot and meta.snap_ranks == [0]
        assert sorted(meta.added) == sorted(map(mirror_id, (k0[0], k0[2])))
        sched.update_connector_output(meta)  # vLLM's aggregated step output: rank None

        def held(key) -> bool:
            return mirror.lookup_prefix([key], request=False).result() == 1

        assert [held(k) for k in k0] == [True, False, True]  # rank 0: A, C; not B
        assert all(held(k) for k in ns.keys(hs, "", 1))  # rank 1's entries untouched
        assert len(mirror) == 5
        evs = ev.take()
        removed = [h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes]
        stored = [h for e in evs if isinstance(e, BlockStored) for h in e.block_hashes]
        assert removed == [hB] and stored == [hC]
        assert ev.published() == 2  # A and C

        # the withdrawn B is learned again: when rank 0 holds it again it is published again
        sched.apply_g3_report(0, KvbmWorkerMeta(added=[mirror_id(k0[1])]))
        (st,) = ev.take()
        assert isinstance(st, BlockStored) and st.block_hashes == [hB]
    finally:
        g3.close()


def test_a_ranks_first_snapshot_drops_nothing_and_repeats_replace():
    """A rank's first snapshot (at start: by the channel with its rank, or in the step output naming it in
    ``snap_ranks``) only adds; another rank's entries are never dropped; a later snapshot of the rank
    replaces its entries. Also: a snapshot aggregated from several ranks' step outputs names them all."""
    from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.model.namespace import Namespace, tenant_tag

    ns = Namespace("m", KvLayout(2, 2, 4, 64, "bfloat16"), tp_world_size=2)
    t = tenant_tag("")
    m = G3Mirror(ns)
    start = KvbmWorkerMeta(added=[(t, 0, 1)], snapshot=True, snap_ranks=[0]).aggregate(
        KvbmWorkerMeta(added=[(t, 1, 1), (t, 1, 2)], snapshot=True, snap_ranks=[1]))
    assert start.snap_ranks == [0, 1]
    m.apply(KvbmWorkerMeta(added=[(t, 0, 5)]))  # a report before any snapshot is kept by a first snapshot
    m.apply(start)
    assert len(m) == 4 and m.ready
    m.apply(KvbmWorkerMeta(added=[(t, 1, 3)], snapshot=True), rank=1)  # rank 1 again, by the channel
    assert len(m) == 3
    m.apply(KvbmWorkerMeta(added=[], snapshot=True, snap_ranks=[0]))  # rank 0 again: its G3 is empty now
    assert len(m) == 1


@pytest.mark.parametrize("tp", [2, 8, 16, 64, 100])
def test_rank_masks_drop_rank_agrees_with_a_dict_of_rank_sets(tp):
    """:meth:`RankMasks.drop_rank` against a dict of rank sets: rank ``r`` leaves every mask, emptied
    fingerprints are deleted (small fingerprints share home cell 0: the deletion re-places one long cluster),
    the others keep their masks; it returns the fingerprints that had ``r``. TP 100: object-array masks."""
    import random

    from kvbm_backend.integrations.vllm.rank_masks import RankMasks

    rng = random.Random(tp)
    rm, ref = RankMasks(tp), {}
    fps = [rng.randrange(1, 1 << 64) for _ in range(3000)] + list(range(1, 300))
    ranks = [rng.randrange(tp) for _ in fps]
    rm.set_bits(np.array(fps, np.uint64), ranks)
    for f, r in zip(fps, ranks):
        ref.setdefault(f, set()).add(r)
    for r in (0, tp - 1, tp // 2, 0, tp, -1):
        had = sorted(rm.drop_rank(r).tolist())
        assert had == sorted(f for f, s in ref.items() if r in s)
        for f in list(ref):
            ref[f].discard(r)
            if not ref[f]:
                del ref[f]
        assert len(rm) == len(ref)
        keys = list(ref)
        assert rm.masks(np.array(keys, np.uint64)) == [sum(1 << x for x in ref[f]) for f in keys]
