"""Hybrid models without an engine: namespaces with KV cache groups, the namespace derived from vLLM's own
KV cache specs (and what is refused), the scheduler's window-bounded plans for sliding-window groups
against real G3 pools with real vLLM ``Request`` objects, the connector's hybrid load-failure report,
and the layout presets of hybrid models (``kvbm-backend layouts``)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import KvGroup, Namespace

HANG_S = 600.0  # a hang guard, not a bound: waits for results, flushes and a load's end that must come; returns as soon as they do

pytestmark = [pytest.mark.vllm]

BS = 32
LAY = KvLayout(2, 2, BS, 64, "bfloat16")


def _hybrid_ns(window: int = 64) -> Namespace:
    groups = (KvGroup("sliding", LAY, sliding_window=window), KvGroup("full", LAY))
    return Namespace("m", LAY, groups=groups, group=0)


def test_namespace_groups_fingerprints_and_json():
    plain = Namespace("m", LAY)
    ns = _hybrid_ns()
    g1 = ns.for_group(1)
    # one namespace per group, every one different from the non-hybrid namespace of the same layout
    assert len({plain.fingerprint, ns.fingerprint, g1.fingerprint}) == 3
    assert g1.groups == ns.groups and g1.group == 1 and g1.layout == LAY
    d = json.loads(g1.canonical_json())
    assert d["group"] == 1 and [g["kind"] for g in d["groups"]] == ["sliding", "full"]
    assert d["groups"][0]["sliding_window"] == 64
    assert Namespace.from_dict(d) == g1 and Namespace.from_dict(d).fingerprint == g1.fingerprint
    # without groups the JSON (and fingerprint) is what it was before groups existed
    assert "groups" not in json.loads(plain.canonical_json()) and plain.for_group(0) is plain
    # the window decides the blocks a sliding group needs: ceil((window - 1) / page_size)
    assert ns.groups[0].window_blocks == 2 and _hybrid_ns(65).groups[0].window_blocks == 2
    assert _hybrid_ns(66).groups[0].window_blocks == 3 and ns.groups[1].window_blocks is None
    # another window or another dtype is another namespace
    assert _hybrid_ns(128).fingerprint != ns.fingerprint
    fp8 = KvLayout(2, 2, BS, 64, "float8_e4m3fn")
    assert Namespace("m", fp8).fingerprint != plain.fingerprint
    with pytest.raises(ValueError, match="group"):
        ns.for_group(2)
    with pytest.raises(ValueError, match="layout"):
        Namespace("m", KvLayout(3, 2, BS, 64), groups=ns.groups, group=0)
    with pytest.raises(ValueError, match="sliding_window"):
        KvGroup("full", LAY, sliding_window=64)


def _vllm_cfgs(*specs, layers=2):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    groups = [KVCacheGroupSpec(layer_names=[f"model.layers.{g}.{i}.attn" for i in range(layers)], kv_cache_spec=s)
              for g, s in enumerate(specs)]
    kcc = SimpleNamespace(kv_cache_groups=groups)
    vc = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return vc, kcc


def test_namespace_from_vllm_hybrid_specs_and_refusals():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations.vllm.connector import namespace_from_vllm
    cfg = KvbmBackendConfig(model="m")
    kw = dict(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    sw, full = SlidingWindowSpec(sliding_window=128, **kw), FullAttentionSpec(**kw)
    ns = namespace_from_vllm(cfg, *_vllm_cfgs(sw, full))
    assert [(g.kind, g.sliding_window) for g in ns.groups] == [("sliding", 128), ("full", None)]
    assert ns.groups[0].window_blocks == 4 and ns.layout == ns.groups[0].layout == LAY
    # one full-attention group: the namespace of a non-hybrid model, unchanged
    assert namespace_from_vllm(cfg, *_vllm_cfgs(full)) == Namespace("m", LAY)
    # every layer windowed (one sliding group): still window-bounded
    assert namespace_from_vllm(cfg, *_vllm_cfgs(sw)).groups[0].kind == "sliding"
    # FP8 KV is its own namespace
    fp8 = namespace_from_vllm(cfg, *_vllm_cfgs(FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64,
                                                                 dtype=torch.float8_e4m3fn)))
    assert fp8.layout.dtype == "float8_e4m3fn" and fp8.fingerprint != Namespace("m", LAY).fingerprint
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        namespace_from_vllm(cfg, *_vllm_cfgs(ChunkedLocalAttentionSpec(attention_chunk_size=8192, **kw), full))
    with pytest.raises(ValueError, match="block sizes"):
        namespace_from_vllm(cfg, *_vllm_cfgs(SlidingWindowSpec(sliding_window=128, block_size=64, num_kv_heads=1,
                                                               head_size=64, dtype=torch.bfloat16), full))


def _request(rid, toks):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256_cbor)
    return Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BS, sha256_cbor))


class _Blocks:
    def __init__(self, *ids):
        self.ids = ids

    def get_block_ids(self):
        return tuple(list(x) for x in self.ids)


def _matched(sched, req, local=0):
    for _ in range(2000):
        n, a = sched.get_num_new_matched_tokens(req, local)
        if n is not None:
            return n, a
        time.sleep(0.005)
    raise AssertionError("lookup never answered")


@pytest.fixture
def hybrid_pools(tmp_path):
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.connector import group_g3_config
    from kvbm_backend.integrations.vllm.scheduler_side import GroupTiers
    ns = _hybrid_ns()
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    groups = []
    for gi in range(2):
        gns = ns.for_group(gi)
        g3, _ = open_tiers(group_g3_config(cfg, ns, gi), gns)
        groups.append(GroupTiers(gns, g3, None, gns.groups[gi].window_blocks))
    assert (tmp_path / "g3" / "group0" / "namespace.json").is_file()
    yield ns, groups
    for g in groups:
        g.g3.close()


def test_hybrid_lookup_needs_every_group_and_only_the_window(hybrid_pools):
    """A hit of n blocks needs the full group's blocks [0, n) and the sliding group's window [n - 2, n);
    when the window at the longest full prefix is missing, the hit moves back to a resume point whose
    window is stored. Loads: every full block, only the window of the sliding group (vLLM's null blocks,
    id 0, are never written)."""
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.hashing import sequence_hashes
    ns, groups = hybrid_pools
    sliding, full = groups
    blk = np.zeros(LAY.bytes_per_block, np.uint8)

    toks = list(range(100, 100 + 6 * BS + 5))  # 6 full blocks: a hit covers 6 ((len - 1) // 32)
    hs = sequence_hashes(toks, BS)
    full.g3.put(full.ns.keys(hs[:6]), [blk] * 6).result(HANG_S)
    sliding.g3.put(sliding.ns.keys(hs[4:6]), [blk] * 2).result(HANG_S)   # the window before block 6
    toks_b = list(range(5000, 5000 + 6 * BS + 5))
    hb = sequence_hashes(toks_b, BS)
    full.g3.put(full.ns.keys(hb[:6]), [blk] * 6).result(HANG_S)
    sliding.g3.put(sliding.ns.keys(hb[2:4]), [blk] * 2).result(HANG_S)   # only the window before block 4
    for g in groups:
        g.g3.flush(HANG_S)

    s = SchedulerSide(ns, BS, sliding.g3, None, groups=groups)
    ra = _request("a", toks)
    assert _matched(s, ra) == (6 * BS, True)
    s.update_state_after_alloc(ra, _Blocks([0, 0, 0, 0, 41, 42, 43], [51, 52, 53, 54, 55, 56, 57]), 6 * BS)
    rb = _request("b", toks_b)
    assert _matched(s, rb) == (4 * BS, True)
    s.update_state_after_alloc(rb, _Blocks([0, 0, 61, 62, 63], [71, 72, 73, 74, 75]), 4 * BS)
    loads = s.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                   scheduled_cached_reqs=SimpleNamespace(
                                                       req_ids=[], new_block_ids=[], num_computed_tokens=[]))).loads
    got = sorted((j.req_id, j.group, j.block_ids, j.seq_hashes, j.tiers) for j in loads)
    assert got == [("a", 0, [41, 42], hs[4:6], ["G3"] * 2), ("a", 1, [51, 52, 53, 54, 55, 56], hs[:6], ["G3"] * 6),
                   ("b", 0, [61, 62], hb[2:4], ["G3"] * 2), ("b", 1, [71, 72, 73, 74], hb[:4], ["G3"] * 4)]

    # vLLM reports a's load failed (failed_recving) and asks again: no second try of the same load
    s.load_failed({"a"})
    assert _matched(s, ra) == (0, False)

    # neither the window at 6, nor any other stored: no hit (a full prefix alone is not enough)
    toks_c = list(range(9000, 9000 + 6 * BS + 5))
    full.g3.put(full.ns.keys(sequence_hashes(toks_c, BS)[:6]), [blk] * 6).result(HANG_S)
    full.g3.flush(HANG_S)
    assert _matched(s, _request("c", toks_c)) == (0, False)


def test_hybrid_saves_full_blocks_and_only_the_window(hybrid_pools):
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    ns, groups = hybrid_pools
    s = SchedulerSide(ns, BS, groups[0].g3, None, groups=groups)
    toks = list(range(700, 700 + 5 * BS + 7))  # 5 full blocks
    r = _request("r", toks)
    assert _matched(s, r) == (0, False)
    s.update_state_after_alloc(r, _Blocks([1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]), 0)

    def step(new=(), cached=(), sched=None):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=b, num_computed_tokens=c) for rid, b, c in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[x[0] for x in cached], new_block_ids=[x[1] for x in cached],
                                                  num_computed_tokens=[x[2] for x in cached], resumed_req_ids=set()),
            num_scheduled_tokens=dict(sched or {}))

    # chunked prefill: 3 blocks, then the rest
    meta = s.build_connector_meta(step(new=[("r", ([1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]), 0)],
                                       sched={"r": 3 * BS}))
    assert sorted((j.group, j.block_ids) for j in meta.saves) == [(0, [2, 3]), (1, [11, 12, 13])]
    # by the next step vLLM has null-blocked sliding block 0 (outside the window): not offered again
    meta = s.build_connector_meta(step(cached=[("r", None, 3 * BS)], sched={"r": len(toks) - 3 * BS}))
    assert sorted((j.group, j.block_ids) for j in meta.saves) == [(0, [4, 5]), (1, [14, 15])]
    assert all(j.seq_hashes for j in meta.saves)


def test_grouped_workers_report_a_failed_group_load_per_request(tmp_path):
    """With several groups vLLM 0.32 refuses block-level load errors: a request with a failed block in
    any group is reported in failed_recving (recomputed whole) once every group's load is over."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.connector import group_g3_config
    from kvbm_backend.integrations.vllm.kv_io import EngineKv
    from kvbm_backend.integrations.vllm.metadata import LoadJob
    from kvbm_backend.integrations.vllm.worker_side import GroupedWorkers, WorkerSide
    ns = _hybrid_ns()
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    pools, ws = [], []
    for gi in range(2):
        g3, _ = open_tiers(group_g3_config(cfg, ns, gi), ns.for_group(gi))
        pools.append(g3)
        ws.append(WorkerSide(ns.for_group(gi), 0, g3, None, load_timeout_s=10))
    try:
        gw = GroupedWorkers(ws)
        gw.register([EngineKv.from_tensors([torch.zeros(8, 1, BS, 128, dtype=torch.bfloat16) for _ in range(2)],
                                           8, BS, 1, 64) for _ in range(2)])
        blk = np.full(LAY.bytes_per_block, 3, np.uint8)
        pools[1].put(ns.for_group(1).keys([11, 12]), [blk, blk]).result(HANG_S)  # group 1 has its blocks
        pools[1].flush(HANG_S)
        gw.start_loads([LoadJob("x", [1, 2], [11, 12], ["G3", "G3"], "", group=1),
                        LoadJob("x", [5], [12], ["G3"], "", group=0)])  # group 0's window block is absent
        t = time.monotonic() + HANG_S
        done: set = set()
        failed: set = set()
        while "x" not in done and time.monotonic() < t:
            d, f = gw.take_finished()
            done |= d
            failed |= f
            time.sleep(0.01)
        assert done == {"x"} and failed == {"x"}
    finally:
        gw.shutdown()
        for p in pools:
            p.close()


def test_hybrid_presets_state_full_and_window_bounded_bytes():
    from typer.testing import CliRunner
    from kvbm_backend.apps.cli import app
    from kvbm_backend.model.presets import load_preset
    # per-layer K+V bytes per token (bf16) x layers, from each model's config.json
    want = {"gpt-oss-20b": (12, 12, 128, 2 * 8 * 64 * 2), "gpt-oss-120b": (18, 18, 128, 2 * 8 * 64 * 2),
            "gemma-3-27b": (10, 52, 1024, 2 * 16 * 128 * 2), "gemma-2-9b": (21, 21, 4096, 2 * 8 * 256 * 2)}
    for name, (nf, ns_, w, per) in want.items():
        p = load_preset(name)
        assert (p.full_layers, p.sliding_layers, p.sliding_window) == (nf, ns_, w)
        assert p.full_bytes_per_token == nf * per and p.sliding_bytes_per_token == ns_ * per
        assert p.bytes_per_token == (nf + ns_) * per  # every layer for every token (hybrid manager off)
        # resuming 8K tokens: every token of the full layers, the window of the sliding ones
        assert p.kv_bytes(8192) == nf * per * 8192 + ns_ * per * min(8192, w)
        g = p.group_layouts(page_size=16, tp=2)
        assert g["full"].num_layers == nf and g["sliding"].bytes_per_token * 2 == p.sliding_bytes_per_token
    assert load_preset("llama-3.1-8b").kv_bytes(100) == 100 * load_preset("llama-3.1-8b").bytes_per_token
    r = CliRunner().invoke(app, ["layouts", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    g = rows["gpt-oss-20b"]
    assert (g["full_bytes_per_token"], g["sliding_bytes_per_token"], g["sliding_bytes_max"]) == (24576, 24576, 24576 * 128)
    assert "full_bytes_per_token" not in rows["llama-3.1-8b"]
    r = CliRunner().invoke(app, ["layouts"], env={"COLUMNS": "200"})
    # the human table (report.print_layouts): the hybrid table's full / sliding bytes per token columns,
    # with gpt-oss-20b's values
    assert r.exit_code == 0 and "Hybrid models" in r.output and "gemma-3-27b" in r.output, r.output
    row = next(ln for ln in r.output.splitlines() if ln.split()[:1] == ["gpt-oss-20b"] and "24,576" in ln)
    assert row.split()[1:6] == ["12", "12", "128", "24,576", "24,576"], row


def _hybrid_offloading_config(tmp_path, layers=(2, 2)):
    """vLLM's OffloadingConfig as its offloading connector builds it for a two-group hybrid model under the
    hybrid KV cache manager: one chunk = one group's layers (``worker_kv_bytes_per_block`` = the bytes of
    one block id across the shared tensors = one group's layers)."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    heads, hd, tpb = 2, 64, 16
    worker_bytes = layers[0] * heads * tpb * 2 * hd * 2
    tier = {"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "num_kv_heads": heads,
            "io_threads": 2, "g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "io_threads": 2}}
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=tpb, group_id=g,
                                           layer_names=tuple(f"model.layers.{2 * i + g}.self_attn.attn"
                                                             for i in range(n)))
                     for g, n in enumerate(layers)),
        worker_kv_bytes_per_block=worker_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 32 * worker_bytes, "secondary_tiers": [tier]}, engine_id="kvbm-hybrid-test",
        model=OffloadingModelConfig(name="hybrid", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tpb, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False),
        kv_cache_layout="LBNHC")


def test_tiering_tier_stores_and_loads_every_group_of_a_hybrid_model(tmp_path):
    """G3Tier under vLLM's real TieringOffloadingManager with two KV cache groups: chunks of both groups
    (OffloadKeys differing only in the group index) round-trip exactly; the namespace records the groups."""
    import hashlib
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
    from vllm.v1.kv_offload.base import make_offload_key
    from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness
    h = TieringHarness(_hybrid_offloading_config(tmp_path))
    try:
        tier = h.tier
        assert [g.kind for g in tier.namespace.groups] == ["vllm-offload"] * 2
        assert tier.namespace.groups[1].layers == ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
        assert tier.geometry.num_layers == 2
        digests = [hashlib.sha256(f"h{i}".encode()).digest() for i in range(3)]
        keys = [make_offload_key(d, g) for d in digests for g in (0, 1)]  # the same blocks in both groups
        rng = np.random.default_rng(0)
        data = [rng.integers(0, 256, h.chunk_bytes, dtype=np.uint8) for _ in keys]
        h.store(keys, data)
        h.wait_idle()
        h.reset_primary()
        got = h.load(keys)
        assert len(got) == len(keys)
        for a, b in zip(got, data):
            np.testing.assert_array_equal(a, b)
    finally:
        h.shutdown()
    with pytest.raises(ValueError, match=r"same layer count.*layers \[1, 2\]"):
        TieringHarness(_hybrid_offloading_config(tmp_path / "b", layers=(2, 1)))
