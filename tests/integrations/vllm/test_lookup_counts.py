"""A request's prefix lookup counts once in ``kvbm_matched_tokens`` and the tiers' hit rates, whatever its TP size.
Review finding (2026-11-29): the scheduler looks every TP rank's keys up (and every KV cache group's), and each
pool lookup counted itself, so at TP=2 a 4-block hit counted 8 blocks' tokens; asks for a prompt the engine's
own prefix cache serves (vLLM is told 0) counted their G3 share each time. The real SchedulerSide, its G3 mirror
(as the scheduler process has it) and a G4 pool on a file store; requests as vLLM hands them (token ids)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from kvbm_backend import metrics
from kvbm_backend.config import load_config
from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.pools import G4_TIMEOUT_S, LOOKUP_S

BS = 32
HANG_S = 600.0  # a hang guard, not a bound


def _ask(s: SchedulerSide, req, computed: int) -> int:
    """vLLM's get_num_new_matched_tokens, asked again while the lookup runs (as vLLM does each step)."""
    for _ in range(20000):
        n, _ = s.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n
        time.sleep(0.005)
    raise AssertionError("the lookup never resolved")


def test_tp2_hit_counts_each_block_once_and_local_hits_count_nothing(tmp_path):
    reg = metrics.new_registry()
    ns = Namespace("m", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    toks = list(range(100, 100 + BS * 4 + 5))  # 4 full blocks
    hs = sequence_hashes(toks, BS)
    mirror = G3Mirror(ns, registry=reg)  # G3 (the worker's, as reported to the scheduler): blocks 0-1, both ranks
    mirror.apply(KvbmWorkerMeta([mirror_id(k) for r in range(2) for k in ns.keys(hs[:2], rank=r)], [], True))
    cfg = load_config({"g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False,
                              "timeout_s": G4_TIMEOUT_S}}, use_env=False)  # counts, not the load bound
    g4 = G4Pool(cfg.g4, ns, registry=reg)  # G4: blocks 2-3, both ranks
    try:
        bpb = ns.layout.bytes_per_block
        for r in range(2):
            keys = ns.keys(hs[2:4], rank=r)
            assert g4.put(keys, [np.full(bpb, 7, np.uint8)] * 2).result(HANG_S).written == 2
        s = SchedulerSide(ns, BS, mirror, g4, lookup_timeout_s=LOOKUP_S)
        req = SimpleNamespace(request_id="r1", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        assert _ask(s, req, 0) == 4 * BS
        assert metrics.sample_value(reg, "kvbm_matched_tokens_total") == 4 * BS  # not 8 * BS (two ranks)
        assert metrics.sample_value(reg, "kvbm_disk_cache_hit_rate") == 2 / 4  # G3: 2 of the request's 4 blocks
        assert metrics.sample_value(reg, "kvbm_object_cache_hit_rate") == 2 / 2  # G4: both of the 2 G3 lacked
        st = mirror.stats()
        assert (st["lookup_blocks"], st["lookup_hits"]) == (4, 2)

        # a second request whose blocks the engine's own prefix cache holds: vLLM is told 0, nothing is counted
        req2 = SimpleNamespace(request_id="r2", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        for _ in range(3):
            assert s.get_num_new_matched_tokens(req2, 4 * BS) == (0, False)
        assert metrics.sample_value(reg, "kvbm_matched_tokens_total") == 4 * BS
        assert mirror.stats()["lookup_blocks"] == 4
    finally:
        g4.close()


def test_tp2_ranks_that_disagree_count_the_prefix_every_rank_holds(tmp_path):
    """Review finding (2026-11-30): the request's lookup was counted by TP rank 0's pool lookup alone, so when the
    ranks' G3 differ (rank 1's offload of a block dropped, or evicted there first) the blocks rank 0 holds beyond
    the hit counted as matched G3 tokens, and G4 then counted the same blocks again: a 4-block hit (2 from G3, 2
    from G4) counted 6 blocks' tokens and a G3 hit rate of 4/4."""
    reg = metrics.new_registry()
    ns = Namespace("m", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    toks = list(range(300, 300 + BS * 4 + 5))  # 4 full blocks
    hs = sequence_hashes(toks, BS)
    mirror = G3Mirror(ns, registry=reg)  # G3: rank 0 holds blocks 0-3, rank 1 only 0-1
    mirror.apply(KvbmWorkerMeta([mirror_id(k) for k in ns.keys(hs[:4], rank=0)]
                                + [mirror_id(k) for k in ns.keys(hs[:2], rank=1)], [], True))
    cfg = load_config({"g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False,
                              "timeout_s": G4_TIMEOUT_S}}, use_env=False)  # counts, not the load bound
    g4 = G4Pool(cfg.g4, ns, registry=reg)  # G4: blocks 2-3, both ranks
    try:
        bpb = ns.layout.bytes_per_block
        for r in range(2):
            assert g4.put(ns.keys(hs[2:4], rank=r), [np.full(bpb, 7, np.uint8)] * 2).result(HANG_S).written == 2
        s = SchedulerSide(ns, BS, mirror, g4, lookup_timeout_s=LOOKUP_S)
        req = SimpleNamespace(request_id="r1", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        assert _ask(s, req, 0) == 4 * BS
        assert metrics.sample_value(reg, "kvbm_matched_tokens_total") == 4 * BS  # was 6 * BS
        assert metrics.sample_value(reg, "kvbm_disk_cache_hit_rate") == 2 / 4  # was 4 / 4
        assert metrics.sample_value(reg, "kvbm_object_cache_hit_rate") == 2 / 2
        st = mirror.stats()
        assert (st["lookup_blocks"], st["lookup_hits"]) == (4, 2)  # was (4, 4)
    finally:
        g4.close()


def test_tp2_g3_only_hit_counts_the_shorter_rank(tmp_path):
    """Without G4: rank 0's G3 holds 3 blocks, rank 1's 1; the request's hit is 1 block, and so is what counts
    (was 3 blocks' tokens, hit rate 3/3)."""
    reg = metrics.new_registry()
    ns = Namespace("m", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    toks = list(range(700, 700 + BS * 3))
    hs = sequence_hashes(toks, BS)
    mirror = G3Mirror(ns, registry=reg)
    mirror.apply(KvbmWorkerMeta([mirror_id(k) for k in ns.keys(hs[:3], rank=0)]
                                + [mirror_id(k) for k in ns.keys(hs[:1], rank=1)], [], True))
    s = SchedulerSide(ns, BS, mirror, None)
    req = SimpleNamespace(request_id="r1", prompt_token_ids=toks + [1], cache_salt=None, lora_request=None)
    assert _ask(s, req, 0) == 1 * BS
    assert metrics.sample_value(reg, "kvbm_matched_tokens_total") == 1 * BS  # was 3 * BS
    assert metrics.sample_value(reg, "kvbm_disk_cache_hit_rate") == 1 / 3  # was 3 / 3
    assert (mirror.stats()["lookup_blocks"], mirror.stats()["lookup_hits"]) == (3, 1)
