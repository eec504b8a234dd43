"""Connector pieces without an engine: KV gather/scatter against the KVBM block layout, config errors,
the namespace derived from vLLM's KV cache spec, and the scheduler-side plans against real G3 pools."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvbm_backend.config import ConfigError
from kvbm_backend.integrations.vllm.connector import config_from_extra
from kvbm_backend.integrations.vllm.kv_io import EngineKv, detect_engine_layout, numpy_staging, split_blocks
from kvbm_backend.model.layout import KvLayout, engine_page_to_region
from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (results, flushes, answers, reports, processes); returns as soon as it does
POLLS = 60_000  # scheduler polls 10 ms apart until an answer: >= HANG_S (was 200-500: 2-5 s)

pytestmark = [pytest.mark.vllm]

L, NB, H, N, D = 3, 10, 2, 32, 64


def _cpu_kv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(NB, H, N, 2 * D, generator=g).to(dtype) for _ in range(L)]


def test_cpu_layout_gather_matches_kvbm_block_semantics():
    ts = _cpu_kv()
    kv = EngineKv.from_tensors(ts, NB, N, H, D)
    assert kv.engine_layout == "cpu"
    assert kv.layout == KvLayout(L, 2, N, H * D, "float32")
    arr, host = numpy_staging(2 * kv.layout.bytes_per_block)
    kv.gather([7, 3], host)
    blk = kv.layout.view(split_blocks(arr, kv.layout, 2)[1]).view(np.float32)  # [L, 2, N, H*D] of block 3
    for li in range(L):
        # the CPU backend's own view: [nb, H, 2N, D] split into K (rows < N) and V (rows >= N)
        page = ts[li].view(NB, H, 2 * N, D)[3]
        k_nhd = page[:, :N].permute(1, 0, 2).numpy()  # [N, H, D]
        v_nhd = page[:, N:].permute(1, 0, 2).numpy()
        np.testing.assert_array_equal(blk[li, 0], engine_page_to_region(k_nhd, "NHD"))
        np.testing.assert_array_equal(blk[li, 1], engine_page_to_region(v_nhd, "NHD"))


@pytest.mark.parametrize("shape_kind", ["kv_first", "block_first"])
def test_gpu_layouts_gather_matches_kvbm_block_semantics(shape_kind):
    """FlashAttention-style layouts: block b of layer l holds K then V, each ``[page, heads * head_dim]`` of
    the engine's ``[block_size, heads, head_dim]`` page (written straight into the staging's strided views)."""
    g = torch.Generator().manual_seed(2)
    shape = {"kv_first": (2, NB, N, H, D), "block_first": (NB, 2, N, H, D)}[shape_kind]
    ts = [torch.randn(*shape, generator=g) for _ in range(L)]
    kv = EngineKv.from_tensors(ts, NB, N, H, D)
    assert kv.engine_layout == shape_kind
    arr, host = numpy_staging(3 * kv.layout.bytes_per_block)
    kv.gather([5, 0, 8], host)
    for i, b in enumerate((5, 0, 8)):
        blk = kv.layout.view(split_blocks(arr, kv.layout, 3)[i]).view(np.float32)  # [L, 2, N, H*D]
        for li in range(L):
            for o in range(2):
                page = ts[li][o, b] if shape_kind == "kv_first" else ts[li][b, o]  # [N, H, D]
                np.testing.assert_array_equal(blk[li, o], page.reshape(N, H * D).numpy())


@pytest.mark.parametrize("shape_kind", ["cpu", "kv_first", "block_first"])
def test_scatter_inverts_gather(shape_kind):
    g = torch.Generator().manual_seed(1)
    shape = {"cpu": (NB, H, N, 2 * D), "kv_first": (2, NB, N, H, D), "block_first": (NB, 2, N, H, D)}[shape_kind]
    src = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(L)]
    dst = [torch.zeros_like(t) for t in src]
    a = EngineKv.from_tensors(src, NB, N, H, D)
    b = EngineKv.from_tensors(dst, NB, N, H, D)
    assert a.engine_layout == shape_kind
    _, host = numpy_staging(3 * a.layout.bytes_per_block)
    a.gather([1, 4, 9], host)
    b.scatter(host, [2, 5, 0])
    for s, d in zip(src, dst):
        blk_axis = 1 if shape_kind == "kv_first" else 0
        for i, j in ((1, 2), (4, 5), (9, 0)):
            assert torch.equal(s.select(blk_axis, i), d.select(blk_axis, j))
        untouched = [k for k in range(NB) if k not in (2, 5, 0)]
        assert all(not d.select(blk_axis, k).any() for k in untouched)


@pytest.mark.parametrize("shape_kind", ["cpu", "kv_first"])
def test_scatter_and_scatter_layer_take_an_index_made_once(shape_kind):
    """``block_index`` gives the engine block ids as an int64 tensor on the engine's device (a tensor already
    there is passed through); scatter and scatter_layer write the same bytes from it as from a list of ids
    (layer-wise loads make it once per job instead of once per layer: on CUDA ``torch.as_tensor(ids,
    device=...)`` waited for the forward's queued kernels every layer)."""
    g = torch.Generator().manual_seed(3)
    shape = {"cpu": (NB, H, N, 2 * D), "kv_first": (2, NB, N, H, D)}[shape_kind]
    src = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(L)]
    a = EngineKv.from_tensors(src, NB, N, H, D)
    by_list = EngineKv.from_tensors([torch.zeros_like(t) for t in src], NB, N, H, D)
    by_idx = EngineKv.from_tensors([torch.zeros_like(t) for t in src], NB, N, H, D)
    idx = by_idx.block_index([7, 3, 1])
    assert idx.dtype == torch.long and idx.device == by_idx.device and idx.tolist() == [7, 3, 1]
    assert by_idx.block_index(idx) is idx
    _, host = numpy_staging(3 * a.layout.bytes_per_block)
    a.gather([0, 2, 4], host)
    by_list.scatter(host, [7, 3, 1])
    by_idx.scatter(host, idx)
    assert all(torch.equal(x, y) for x, y in zip(by_list.tensors, by_idx.tensors))
    lb = a.layout.bytes_per_block // L
    rows = host.view(3, L, lb)
    for t in by_idx.tensors:
        t.zero_()
    for li in range(L):
        by_idx.scatter_layer(li, rows[:2, li].contiguous(), idx[:2])
    assert all(torch.equal(x.select(1 if shape_kind == "kv_first" else 0, b), y.select(
        1 if shape_kind == "kv_first" else 0, b)) for x, y in zip(by_list.tensors, by_idx.tensors) for b in (7, 3))
    assert not any(t.select(1 if shape_kind == "kv_first" else 0, 1).any() for t in by_idx.tensors)


def test_unknown_engine_layout_names_the_shape():
    with pytest.raises(ValueError, match=r"shape \(10, 64, 2\)"):
        detect_engine_layout((10, 64, 2), NB, N, H, D)


def test_extra_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        config_from_extra({"kvbm": {}})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.kvbm_backend: g3.capacity_gb"):
        config_from_extra({"kvbm_backend": {"g3": {"capacity_gb": -1}}})
    with pytest.raises(ConfigError, match="config_file"):
        config_from_extra({"config_file": str(tmp_path / "missing.yaml")})
    with pytest.raises(ConfigError, match="max_pending_save_bytes"):
        config_from_extra({"max_pending_save_bytes": "lots"})
    for v in (True, False, 0, -1, 1.5):  # true is an int in Python: it was taken as 1 byte, every save dropped
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config.max_pending_save_bytes: expected a positive"):
            config_from_extra({"max_pending_save_bytes": v})
    with pytest.raises(ConfigError, match="either"):
        config_from_extra({"kvbm_backend": {}, "config_file": "x.yaml"})
    f = tmp_path / "c.json"
    f.write_text('{"model": "m", "g3": {"paths": ["/tmp/x"]}}')
    cfg, opts = config_from_extra({"config_file": str(f), "save": False})
    assert cfg.model == "m" and opts["save"] is False and opts["load"] is True


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def test_scheduler_plans_g3_then_g4_and_saves_only_new_blocks(tmp_path):
    """Scheduler side against real pools: a prefix of 3 blocks in G3, the next 2 only in G4."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    lay = KvLayout(2, 2, 32, 64, "bfloat16")
    ns = Namespace("m", lay)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}},
                       "g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False,
                              "timeout_s": 60}}, use_env=False)  # a G4 lookup the busy CI VM froze: not a miss
    g3, g4 = open_tiers(cfg, ns)
    try:
        toks = list(range(100, 100 + 32 * 6 + 5))  # 6 full blocks + 5 tokens
        hs = sequence_hashes(toks, 32)
        blk = [np.full(lay.bytes_per_block, i, np.uint8) for i in range(6)]
        assert g3.put(ns.keys(hs[:3]), blk[:3]).result(HANG_S).written == 3
        assert g4.put(ns.keys(hs[:5]), blk[:5]).result(HANG_S).written == 5
        g3.flush(HANG_S)
        s = SchedulerSide(ns, 32, g3, g4)
        req = SimpleNamespace(request_id="r1", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        n, is_async = None, False
        for _ in range(POLLS):
            n, is_async = s.get_num_new_matched_tokens(req, 32)  # engine already has block 0
            if n is not None:
                break
            import time
            time.sleep(0.01)
        assert (n, is_async) == (4 * 32, True)
        s.update_state_after_alloc(req, _Blocks([10, 11, 12, 13, 14, 15, 16]), 4 * 32)
        out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=([10, 11, 12, 13, 14, 15, 16],),
                                                                  num_computed_tokens=5 * 32)],
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                    resumed_req_ids=set()),
                              num_scheduled_tokens={"r1": 37})
        meta = s.build_connector_meta(out)
        (ld,) = meta.loads
        assert ld.block_ids == [11, 12, 13, 14] and ld.tiers == ["G3", "G3", "G4", "G4"] and ld.seq_hashes == hs[1:5]
        (sv,) = meta.saves  # only block 5 (the one computed this step) is saved
        assert sv.block_ids == [15] and sv.seq_hashes == [hs[5]]
        assert s.request_finished(req, []) == (False, None)
    finally:
        g3.close()
        g4.close()


def test_a_request_the_engines_prefix_cache_covers_counts_its_local_hit_blocks_once(tmp_path):
    """Review finding 2026-11-30: a request whose every loadable block the engine's own prefix cache held returned
    before its lookup was counted, so ``local_hit_blocks`` (the demo's "engine" tier) missed every engine hit
    (kvbm_backend: hit_rate 0.495, engine tier 0.0). Real G3 pool (holding 2 of the 4 blocks): the covered request
    counts once, with its 4 local blocks and no tier found; a partly covered one is counted as before."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace
    import time

    lay = KvLayout(2, 2, 32, 64, "bfloat16")
    ns = Namespace("m", lay)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, g4 = open_tiers(cfg, ns)
    keys = ("lookup_requests", "lookup_blocks", "local_hit_blocks", "g3_found_blocks", "g4_found_blocks")
    try:
        toks = list(range(300, 300 + 32 * 4 + 5))  # 4 full blocks + 5 tokens: 4 loadable blocks
        hs = sequence_hashes(toks, 32)
        assert g3.put(ns.keys(hs[:2]), [np.full(lay.bytes_per_block, i, np.uint8) for i in range(2)]
                      ).result(HANG_S).written == 2
        g3.flush(HANG_S)
        s = SchedulerSide(ns, 32, g3, g4)
        before = {k: stats.get(k) for k in keys}
        req = SimpleNamespace(request_id="local", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        assert s.get_num_new_matched_tokens(req, 4 * 32) == (0, False)
        assert s.get_num_new_matched_tokens(req, 4 * 32) == (0, False)  # asked again: counted once
        got = {k: stats.get(k) - before[k] for k in keys}
        assert got == {"lookup_requests": 1, "lookup_blocks": 4, "local_hit_blocks": 4, "g3_found_blocks": 0,
                       "g4_found_blocks": 0}, got
        short = SimpleNamespace(request_id="short", prompt_token_ids=toks[:20], cache_salt=None, lora_request=None)
        assert s.get_num_new_matched_tokens(short, 0) == (0, False)  # no full block to look up: not counted
        assert stats.get("lookup_requests") - before["lookup_requests"] == 1
        part = SimpleNamespace(request_id="part", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        n = None
        for _ in range(POLLS):
            n, _ = s.get_num_new_matched_tokens(part, 32)  # the engine has block 0, G3 blocks 0-1
            if n is not None:
                break
            time.sleep(0.01)
        assert n == 32
        got = {k: stats.get(k) - before[k] for k in keys}
        assert got == {"lookup_requests": 2, "lookup_blocks": 8, "local_hit_blocks": 5, "g3_found_blocks": 2,
                       "g4_found_blocks": 0}, got
    finally:
        g3.close()


def _step(new=(), cached=(), sched=None):
    """A SchedulerOutput-shaped object: ``new`` = [(req_id, block_ids, num_computed)],
    ``cached`` = [(req_id, new_block_ids or None, num_computed)], ``sched`` = {req_id: tokens}."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[(list(b),) if b is not None else None for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set()),
        num_scheduled_tokens=dict(sched or {}))


@pytest.mark.parametrize("save_decode", [True, False])
def test_decode_blocks_are_saved_with_the_chained_identity(tmp_path, save_decode):
    """Blocks filled by generated tokens are saved under the hashes a next turn's prompt will have
    (prompt + answer), only once every token of the block is known and its KV computed."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.hashing import salt_bytes, salt_hash, sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    bs = 32
    ns = Namespace("m", KvLayout(2, 2, bs, 64, "bfloat16"))
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1}}, use_env=False)
    g3, g4 = open_tiers(cfg, ns)
    try:
        s = SchedulerSide(ns, bs, g3, g4, save_decode=save_decode)
        prompt = list(range(1000, 1000 + 2 * bs + 10))  # 2 full prompt blocks + 10 tokens
        req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, all_token_ids=list(prompt),
                              cache_salt="alice", lora_request=None)
        assert s.get_num_new_matched_tokens(req, 0) in ((0, False), (None, False))
        s.update_state_after_alloc(req, _Blocks([1, 2, 3]), 0)
        meta = s.build_connector_meta(_step(new=[("r", [1, 2, 3], 0)], sched={"r": len(prompt)}))
        assert [sv.block_ids for sv in meta.saves] == [[1, 2]]
        saved = list(meta.saves[0].seq_hashes)
        # decode: one token per step; vLLM appends the sampled token before scheduling the next step
        out = list(range(5000, 5000 + 2 * bs))
        blocks = [1, 2, 3]
        for t in out:
            req.all_token_ids.append(t)
            n_tok = len(req.all_token_ids)
            nb = None
            if (n_tok - 1) // bs + 1 > len(blocks):
                nb = [10 + len(blocks)]
                blocks += nb
            # computed before this step: every token but the newest; this step computes the newest
            meta = s.build_connector_meta(_step(cached=[("r", nb, n_tok - 1)], sched={"r": 1}))
            for sv in meta.saves:
                assert sv.tenant == "alice"
                saved += sv.seq_hashes
                assert sv.block_ids == blocks[len(saved) - len(sv.seq_hashes):len(saved)]
        full_known = len(req.all_token_ids) // bs
        want = sequence_hashes(req.all_token_ids, bs, salt=salt_hash(salt_bytes("alice", None)))
        if save_decode:
            assert saved == want[:full_known] and full_known == 4  # the 2 answer-filled blocks too
        else:
            assert saved == want[:2]  # prompt blocks only
        # async scheduling: a step may compute positions whose token ids are not known yet (the
        # placeholder of the token being sampled); a block is never saved before all its ids are known
        n_before = len(saved)
        meta = s.build_connector_meta(_step(cached=[("r", [99], len(req.all_token_ids) + bs - 2)], sched={"r": 4}))
        assert sum(len(sv.seq_hashes) for sv in meta.saves) == 0 and len(saved) == n_before
    finally:
        g3.close()


def test_kv_connector_stats_report_worker_counter_deltas():
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector

    iv = stats.Interval()
    iv.delta()
    stats.add(load_blocks_ok=3, load_bytes=3 * 4096, lookup_requests=1, save_blocks=2)
    d = iv.delta()
    assert d == {"load_blocks_ok": 3, "load_bytes": 3 * 4096, "save_blocks": 2}  # scheduler counters excluded
    assert iv.delta() == {}
    a = KvbmBackendConnector.build_kv_connector_stats(d)
    b = KvbmBackendConnector.build_kv_connector_stats({"load_blocks_ok": 1, "save_dropped_blocks": 4})
    r = a.aggregate(b).reduce()
    assert r["load_blocks_ok"] == 4 and r["save_dropped_blocks"] == 4 and not a.is_empty()
    a.reset()
    assert a.is_empty()
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    assert isinstance(a, KVConnectorStats)


# ---- MLA (DeepSeek-V2/V3/R1): one latent per token, KVBM outer_dim 1 --------------------------------
MLA_C = 576  # kv_lora_rank 512 + qk_rope_head_dim 64


@pytest.mark.parametrize("shape", [(NB, 1, 16, MLA_C), (NB, 16, MLA_C)], ids=["vllm032-4d", "3d"])
def test_mla_gather_matches_kvbm_block_semantics_and_scatter_inverts(shape):
    """vLLM 0.32's CPU MLA cache is ``[num_blocks, 1, block_size, 576]`` per layer (older / GPU MLA
    backends: ``[num_blocks, block_size, 576]``); the KVBM block is ``[layer, 1, page, 576]``."""
    g = torch.Generator().manual_seed(2)
    src = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(L)]
    kv = EngineKv.from_tensors(src, NB, 16, 1, MLA_C)  # MLA decided from the shape
    assert kv.engine_layout == "mla"
    assert kv.layout == KvLayout(L, 1, 16, MLA_C, "bfloat16")
    assert kv.layout.bytes_per_block == L * 16 * MLA_C * 2
    arr, host = numpy_staging(3 * kv.layout.bytes_per_block)
    kv.gather([8, 0, 5], host)
    blocks = split_blocks(arr, kv.layout, 3)
    for bi, eb in enumerate([8, 0, 5]):
        blk = kv.layout.view(blocks[bi])  # [L, 1, page, 576 * 2 bytes]
        for li in range(L):
            page = src[li][eb].reshape(16, MLA_C)  # token-major latent rows
            want = page.contiguous().view(torch.uint8).numpy()
            np.testing.assert_array_equal(blk[li, 0], want)
    dst = [torch.zeros_like(t) for t in src]
    EngineKv.from_tensors(dst, NB, 16, 1, MLA_C, mla=True).scatter(host, [1, 2, 3])
    for s, d in zip(src, dst):
        for i, j in ((8, 1), (0, 2), (5, 3)):
            assert torch.equal(s[i], d[j])
        assert all(not d[k].any() for k in range(NB) if k not in (1, 2, 3))


def test_mla_non_contiguous_engine_tensor_round_trips():
    """Layer views into one shared buffer with a block stride larger than the block (vLLM's
    layer-interleaved allocations) gather and scatter through their strides."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(NB, L, 16, MLA_C, generator=g).to(torch.float16)  # block-major across layers
    src = [base[:, li].unsqueeze(1) for li in range(L)]  # [NB, 1, 16, 576], not contiguous
    assert not src[0].is_contiguous()
    kv = EngineKv.from_tensors(src, NB, 16, 1, MLA_C, mla=True)
    _, host = numpy_staging(2 * kv.layout.bytes_per_block)
    kv.gather([4, 9], host)
    base2 = torch.zeros_like(base)
    dst = [base2[:, li].unsqueeze(1) for li in range(L)]
    EngineKv.from_tensors(dst, NB, 16, 1, MLA_C, mla=True).scatter(host, [4, 9])
    assert torch.equal(base2[[4, 9]], base[[4, 9]])
    assert not base2[[0, 1, 2, 3, 5, 6, 7, 8]].any()


def test_mla_wrong_shape_or_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"shape \(10, 1, 16, 512\): not a known vLLM MLA layout"):
        detect_engine_layout((NB, 1, 16, 512), NB, 16, 1, MLA_C, mla=True)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        detect_engine_layout((NB, 1, 16, MLA_C), NB, 16, 2, MLA_C, mla=True)
    # a K/V cache is never taken for MLA, nor MLA for K/V
    assert detect_engine_layout((NB, 1, 16, 2 * MLA_C), NB, 16, 1, MLA_C) == "cpu"
    with pytest.raises(ValueError, match="not a known vLLM MLA layout"):
        detect_engine_layout((NB, 1, 16, 2 * MLA_C), NB, 16, 1, MLA_C, mla=True)


def _vllm_cfgs(spec, tp=1, layers=2):
    """(vllm_config, kv_cache_config) stand-ins holding only what namespace_from_vllm reads, around a
    real vLLM KV cache spec."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    kcc = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)])
    vc = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return vc, kcc


@pytest.mark.parametrize("tp", [1, 2])
def test_namespace_from_vllm_mla_spec_is_one_replicated_latent(tp):
    """vLLM's own MLAAttentionSpec (what the CPU engine builds for DeepSeek-V2: num_kv_heads=1,
    head_size=576, block_size=16) gives outer_dim 1, inner_dim 576 on every rank; a K/V spec of the same
    numbers gives outer_dim 2, so the two never share a namespace."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations.vllm.connector import namespace_from_vllm
    cfg = KvbmBackendConfig(model="m")
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=MLA_C, dtype=torch.bfloat16)
    ns = namespace_from_vllm(cfg, *_vllm_cfgs(mla, tp=tp))
    assert ns.layout == KvLayout(2, 1, 16, MLA_C, "bfloat16") and ns.tp_world_size == tp
    assert ns.layout.bytes_per_token == 2 * MLA_C * 2
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=MLA_C, dtype=torch.bfloat16)
    ns_kv = namespace_from_vllm(cfg, *_vllm_cfgs(full, tp=tp))
    assert ns_kv.layout.outer_dim == 2 and ns_kv.fingerprint != ns.fingerprint


def test_model_and_revision_from_the_config_name_the_namespace():
    """``model`` and ``revision`` are part of the namespace: blocks of other weights are never hits.
    ``model`` unset: vLLM's served model name."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations.vllm.connector import namespace_from_vllm
    vc = _vllm_cfgs(FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))
    ns = namespace_from_vllm(KvbmBackendConfig(model="org/llama", revision="r2"), *vc)
    assert (ns.model, ns.revision) == ("org/llama", "r2")
    main = namespace_from_vllm(KvbmBackendConfig(model="org/llama"), *vc)
    assert main.revision == "main" and main.fingerprint != ns.fingerprint
    assert ns.key(7).seq_hash == main.key(7).seq_hash and ns.key(7) != main.key(7)
    assert namespace_from_vllm(KvbmBackendConfig(), *vc).model == "m"


def test_prometheus_counters_follow_connector_stats():
    """vLLM's MultiConnector asserts that a member connector that reports stats has Prometheus
    metrics (build_prom_metrics); they count in KVBM terms per engine."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
    from kvbm_backend.integrations.vllm.stats import PROM_COUNTERS

    prom = KvbmBackendConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                                                   {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                                                   ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    try:
        stats = KvbmBackendConnector.build_kv_connector_stats({"load_verified_blocks_every_rank": 5,
                                                               "load_bytes": 5 << 20, "save_dropped_blocks": 1,
                                                               "g4_put_dropped_blocks": 2})
        prom.observe(stats.data, engine_idx=1)
        prom.observe(stats, engine_idx=1)  # MultiConnector may hand over the stats object itself

        def val(name, engine):
            return REGISTRY.get_sample_value(f"{name}_total", {"model_name": "m", "engine": engine})
        assert val("vllm:kvbm_backend_onboard_blocks", "1") == 10
        assert val("vllm:kvbm_backend_onboard_bytes", "1") == 10 << 20
        assert val("vllm:kvbm_backend_offload_dropped_blocks", "1") == 6
        assert val("vllm:kvbm_backend_onboard_blocks", "0") == 0
    finally:
        for name, _, _ in PROM_COUNTERS:
            for c in list(REGISTRY._names_to_collectors.values()):
                if getattr(c, "_name", None) == name:
                    REGISTRY.unregister(c)
                    break


def test_replicated_mla_blocks_share_one_g4_name_per_block():
    from kvbm_backend.model.namespace import Namespace
    mla = Namespace("m", KvLayout(2, 1, 16, 576, "bfloat16"), tp_world_size=4)
    kv = Namespace("m", KvLayout(2, 2, 16, 64, "bfloat16"), tp_world_size=4)
    assert [mla.shared_rank(r) for r in range(4)] == [0, 0, 0, 0]
    assert [kv.shared_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_g3_contents_become_vllm_kv_events_the_router_can_match(tmp_path):
    """G3 -> KV events: blocks a request finds in G3 (or saves and the worker reports written) are published
    as vLLM ``BlockStored`` with ``medium="DISK"``, vLLM's own block hashes (as its GPU events carry them),
    the blocks' token ids (the router hashes those itself) and the parent chain; a block G3 drops (deleted,
    evicted, corrupt) is published ``BlockRemoved``; a block planned for saving but never written is not
    published. Real G3 pool, real vLLM Request/hashing, Dynamo's router hash; no Dynamo process."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.request import Request

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.integrations.vllm.scheduler_side import G3KvEvents, SchedulerSide
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    bs = 16
    lay = KvLayout(2, 2, bs, 64, "bfloat16")
    ns = Namespace("m", lay)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(bs, sha256_cbor)

    def req(rid, toks):
        return Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=hasher)

    try:
        toks = list(range(500, 500 + 4 * bs + 3))     # 4 full blocks
        hs = sequence_hashes(toks, bs)
        blk = [np.full(lay.bytes_per_block, i, np.uint8) for i in range(4)]
        assert g3.put(ns.keys(hs[:3]), blk[:3]).result(HANG_S).written == 3  # G3 holds blocks 0-2
        g3.flush(HANG_S)
        worker = WorkerSide(ns, 0, g3, None, report_g3=True)
        worker.reconcile_interval_s = 0.0
        sched = SchedulerSide(ns, bs, g3, None)
        sched.events = G3KvEvents(1, bs, FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64,
                                                           dtype=torch.bfloat16))
        sched.update_connector_output(worker.worker_meta())  # the snapshot: nothing learned yet, no event
        assert sched.take_events() == []

        r = req("a", toks)
        want = [maybe_convert_block_hash(h) for h in r.block_hashes]
        for _ in range(POLLS):
            n, _ = sched.get_num_new_matched_tokens(r, 0)
            if n is not None:
                break
            import time
            time.sleep(0.01)
        assert n == 3 * bs
        (ev,) = sched.take_events()
        assert isinstance(ev, BlockStored) and ev.medium == "DISK" and ev.locality == "LOCAL"
        assert ev.block_hashes == want[:3] and ev.parent_block_hash is None and ev.block_size == bs
        assert ev.token_ids == toks[:3 * bs] and ev.kv_cache_spec_kind is not None
        # the router's own hash of the published tokens is the hash of the prompt's blocks (what it matches)
        from dynamo._core import compute_block_hash_for_seq
        assert compute_block_hash_for_seq(ev.token_ids, bs) == compute_block_hash_for_seq(toks, bs)[:3]
        # the batch vLLM's ZMQ publisher sends round-trips through msgspec
        import msgspec
        raw = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[ev]))
        back = msgspec.msgpack.decode(raw, type=KVEventBatch)
        assert back.events[0].block_hashes == want[:3] and back.events[0].medium == "DISK"

        # block 3 is planned for saving (learned) but not written: no event until the worker reports it
        sched.update_state_after_alloc(r, _Blocks([1, 2, 3, 4, 5]), 0)
        sched.build_connector_meta(_step(new=[("a", [1, 2, 3, 4, 5], 3 * bs)], sched={"a": bs + 3}))
        sched.update_connector_output(worker.worker_meta())
        assert sched.take_events() == []
        assert g3.put(ns.keys(hs[3:4]), blk[3:4]).result(HANG_S).written == 1
        g3.flush(HANG_S)
        from kvbm_backend.integrations.vllm.metadata import mirror_id
        worker._added.append(mirror_id(ns.keys(hs[3:4])[0]))  # what the worker's put callback records
        sched.update_connector_output(worker.worker_meta())
        (ev,) = sched.take_events()
        assert isinstance(ev, BlockStored) and ev.block_hashes == want[3:4] and ev.parent_block_hash == want[2]
        assert ev.token_ids == toks[3 * bs:4 * bs]

        # G3 drops blocks by itself (here: deleted, as eviction and corrupt drops do): published removed
        g3.delete(ns.keys(hs[1:3])).result(HANG_S)
        meta = worker.worker_meta()
        assert isinstance(meta, KvbmWorkerMeta) and len(meta.removed) == 2
        sched.update_connector_output(meta)
        (ev,) = sched.take_events()
        assert isinstance(ev, BlockRemoved) and sorted(ev.block_hashes) == sorted(want[1:3]) and ev.medium == "DISK"
        assert sched.events.published() == 2
        # a removal of a block never published is not an event; nothing twice
        sched.update_connector_output(KvbmWorkerMeta(removed=[mirror_id(ns.keys(hs[1:2])[0])]))
        assert sched.take_events() == []
        # the engine's prefix cache was reset (vLLM published AllBlocksCleared, which Dynamo's router applies
        # to every tier): what G3 still holds (blocks 0 and 3) is published again
        ev = sched.take_events(engine_cache_reset=True)
        assert [e.block_hashes for e in ev] == [want[0:1], want[3:4]] and all(e.medium == "DISK" for e in ev)
        assert ev[1].parent_block_hash == want[2] and ev[1].token_ids == toks[3 * bs:4 * bs]
    finally:
        g3.close()


def test_g3_kv_events_need_every_tp_rank():
    """With TP > 1 a block is a G3 hit only when every rank holds its slice: stored once all ranks report
    it, removed as soon as one rank loses it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.integrations.vllm.scheduler_side import G3KvEvents

    ev = G3KvEvents(2, 4)
    r = SimpleNamespace(block_hashes=[b"h0", b"h1"], all_token_ids=list(range(8)), lora_request=None,
                        cache_salt=None, mm_features=[], prompt_embeds=None, num_prompt_tokens=8)
    ev.learn("", r, [11, 12], 0, 2)
    from kvbm_backend.pool.g3.index import tag_of
    t = tag_of("")
    ev.apply(KvbmWorkerMeta(added=[(t, 0, 11), (t, 0, 12)]))
    assert ev.take() == []
    ev.apply(KvbmWorkerMeta(added=[(t, 1, 11), (t, 1, 12)]))
    (s,) = ev.take()
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv
    assert isinstance(s, BlockStored) and s.block_hashes == [conv(b"h0"), conv(b"h1")] and s.token_ids == list(range(8))
    ev.apply(KvbmWorkerMeta(removed=[(t, 1, 12)]))
    (rm,) = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == [conv(b"h1")]


def test_a_router_credit_stays_while_any_holder_of_its_vllm_hash_does():
    """The router keeps one credit per (worker, vLLM hash, medium). G3 and the G4 announcements both publish
    ``DISK`` blocks, and two tenants' G3 blocks share a vLLM hash when requests carry no cache salt:
    ``BlockRemoved`` goes out only when the last holder of the hash goes. Review finding (2026-11-29): a G3
    eviction withdrew the credit of a block G4 still announced, an expired announcement that of a block G3
    held, and one tenant's eviction that of the other tenant's block."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.integrations.vllm.scheduler_side import G3KvEvents
    from kvbm_backend.pool.g3.index import tag_of

    def req():
        return SimpleNamespace(block_hashes=[b"h0"], all_token_ids=list(range(4)), lora_request=None,
                               cache_salt=None, mm_features=[], prompt_embeds=None, num_prompt_tokens=4)

    def kinds(evs):
        return [(type(e).__name__, list(e.block_hashes)) for e in evs]

    h = conv(b"h0")
    ann = (h, None, list(range(4)), None, None, None)  # a G4 announcement of the same block
    ev = G3KvEvents(1, 4)
    a, b = tag_of("alice"), tag_of("bob")
    ev.learn("alice", req(), [11], 0, 1)
    ev.apply(KvbmWorkerMeta(added=[(a, 0, 11)]))
    assert kinds(ev.take()) == [("BlockStored", [h])]
    ev.emit_announced([ann], [])  # G4 announces it too: the router already credits it
    assert ev.take() == []
    ev.apply(KvbmWorkerMeta(removed=[(a, 0, 11)]))  # G3 evicts it; G4 still announces it
    assert ev.take() == []
    ev.emit_announced([], [h])  # the announcement expires: nothing holds it any more
    (rm,) = ev.take()
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == [h]
    # the other way round, and two tenants of one vLLM hash
    ev.emit_announced([ann], [])
    (st,) = ev.take()
    assert isinstance(st, BlockStored) and st.block_hashes == [h]
    ev.learn("alice", req(), [11], 0, 1)
    ev.learn("bob", req(), [21], 0, 1)
    ev.apply(KvbmWorkerMeta(added=[(a, 0, 11), (b, 0, 21)]))
    assert ev.take() == []
    ev.emit_announced([], [h])
    ev.apply(KvbmWorkerMeta(removed=[(a, 0, 11)]))
    assert ev.take() == []  # bob's G3 block still holds the hash
    ev.republish()  # after a prefix-cache reset: each held hash once
    assert kinds(ev.take()) == [("BlockStored", [h])]
    ev.apply(KvbmWorkerMeta(removed=[(b, 0, 21)]))
    assert kinds(ev.take()) == [("BlockRemoved", [h])]
    ev.apply(KvbmWorkerMeta(removed=[(b, 0, 21)]))  # a repeated report removes nothing twice
    assert ev.take() == []


def test_a_failed_load_is_never_offered_again_to_its_request_and_cools_down_for_others(tmp_path):
    """Issue 26 A: vLLM reschedules a request whose load failed and asks for its match again. The worker's
    report (``KvbmWorkerMeta.failed``) makes the scheduler answer 0 for that request, cut other requests'
    prefixes at the failed block for the cool-down, and not cut them for a timeout (slow, not bad)."""
    import time

    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta
    from kvbm_backend.integrations.vllm.scheduler_side import FailedBlocks, SchedulerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    lay = KvLayout(2, 2, 32, 64, "bfloat16")
    ns = Namespace("m", lay)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    try:
        toks = list(range(100, 100 + 32 * 6 + 5))
        hs = sequence_hashes(toks, 32)
        assert g3.put(ns.keys(hs), [np.full(lay.bytes_per_block, i, np.uint8) for i in range(6)]).result(HANG_S).written == 6
        g3.flush(HANG_S)
        s = SchedulerSide(ns, 32, g3, None)

        def ask(rid):
            req = SimpleNamespace(request_id=rid, prompt_token_ids=toks, cache_salt=None, lora_request=None)
            for _ in range(POLLS):
                n, _ = s.get_num_new_matched_tokens(req, 0)
                if n is not None:
                    return n
                time.sleep(0.01)
            raise AssertionError("lookup never finished")

        assert ask("r1") == 6 * 32
        s.update_connector_output(KvbmWorkerMeta(failed=[FailedLoad("r1", "", hs[2], "miss")]))
        assert ask("r1") == 0                    # the same request: recomputed, never offered the load again
        assert ask("r2") == 2 * 32               # another one: the prefix ends before the failed block
        s.failed_blocks.cooldown_s = 0.0
        s.update_connector_output(KvbmWorkerMeta(failed=[FailedLoad("r2", "", hs[2], "miss")]))
        assert ask("r3") == 6 * 32               # cool-down over: looked at (and verified by a load) again
        s.update_connector_output(KvbmWorkerMeta(failed=[FailedLoad("r3", "", hs[0], "timeout")]))
        assert ask("r3") == 0 and ask("r4") == 6 * 32  # a timeout stops its request only
    finally:
        g3.close()
    fb = FailedBlocks(cooldown_s=60, max_entries=100)
    for i in range(10_000):
        fb.add(f"tenant-{i}", i)
    assert len(fb) == 100 and fb.first_in("tenant-9999", [9999], 0, 1) == 0 and fb.first_in("tenant-0", [0], 0, 1) == 1


def test_failed_loads_travel_in_the_worker_report_in_every_mode():
    """The worker's report carries failed loads whether or not it reports G3 (shared-pool mode too), and
    TP ranks' reports aggregate them."""
    from kvbm_backend.integrations.vllm.metadata import FailedLoad, KvbmWorkerMeta
    a = KvbmWorkerMeta(failed=[FailedLoad("r", "t", 1, "miss")])
    b = KvbmWorkerMeta(added=[(b"x" * 16, 1, 5)], failed=[FailedLoad("r", "t", 2, "miss")])
    m = a.aggregate(b)
    assert [f.first_failed for f in m.failed] == [1, 2] and m.added == b.added


def test_g3_kv_events_leave_while_the_engine_does_not_step(tmp_path):
    """Issue 26 B: G3 events reached Dynamo's router only with the next engine step. The connector finds
    vLLM's publisher on the scheduler calling take_events (caller_publisher) and IdlePublisher publishes
    what is pending once no step took events for idle_s. Real vLLM ZmqEventPublisher, real ZMQ subscriber."""
    import sys
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents, IdlePublisher, caller_publisher
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.pool.g3.index import tag_of

    ep = f"ipc://{tmp_path}/kv-events"  # vLLM binds ipc endpoints (it connects to a tcp host:port)
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=ep)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    class FakeScheduler:  # stands where vLLM's Scheduler calls the connector's take_events
        kv_event_publisher = pub

        def update_from_output(self, f):
            return f(sys._getframe(0))

    try:
        assert caller_publisher(FakeScheduler().update_from_output(lambda fr: fr)) is pub

        class FakeMulti:  # vLLM's MultiConnector.take_events between the scheduler and us
            def take_events(self):
                return sys._getframe(0)

        assert caller_publisher(FakeScheduler().update_from_output(lambda fr: FakeMulti().take_events())) is pub
        assert caller_publisher(sys._getframe(0)) is None
        bs = 16
        init_none_hash(sha256_cbor)
        toks = list(range(1000, 1000 + 3 * bs + 1))
        r = Request("r", toks, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(bs, sha256_cbor))
        ev = G3KvEvents(1, bs)
        idle = IdlePublisher(ev, idle_s=0.3)
        hs = sequence_hashes(toks, bs)
        ev.learn("", r, hs, 0, 3)
        idle.take()  # a step took events: nothing pending yet
        time.sleep(0.5)  # let the subscription reach the publisher
        idle.capture(pub)
        ev.apply(KvbmWorkerMeta(added=[(tag_of(""), 0, h) for h in hs[:3]]))  # written after the last step
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        got = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        end = time.monotonic() + HANG_S
        while not got and time.monotonic() < end:
            if poller.poll(200):
                frames = sub.recv_multipart()
                batch = dec.decode(frames[-1])
                got = [e for e in batch.events if isinstance(e, BlockStored)]
        assert got and sum(len(e.block_hashes) for e in got) == 3 and got[0].medium == "DISK", got
        idle.stop()
    finally:
        sub.close(0)
        ctx.term()
        pub.shutdown()


def test_report_channel_round_trip_and_refusals(tmp_path, monkeypatch):
    """The worker -> scheduler report channel: reports cross a real Unix socket in order, malformed ones are
    refused without stopping the channel, and a directory others may enter is not used."""
    import os
    import time

    from kvbm_backend.integrations.vllm import report_channel as rc

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    got = []
    lst = rc.ReportListener("k" * 24, lambda *a: got.append(a))
    try:
        assert lst.path and oct(os.stat(lst.path).st_mode & 0o777) == "0o600"
        rc._local.clear()  # as in another process: only the socket
        snd = rc.ReportSender("k" * 24)
        assert snd.connect() and snd._sock is not None
        e = (b"t" * 16, 1, 2**64 - 1)
        snd.send(0, 1, [e], [], True)
        snd._sock.sendall(b"\x05\x00\x00\x00" + b"x" * 5)  # malformed: refused, channel goes on
        snd.send(2, 0, [], [e, e], False)
        end = time.monotonic() + HANG_S
        while len(got) < 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert got == [(0, 1, [e], [], True), (2, 0, [], [e, e], False)]
        with pytest.raises(ValueError):
            rc.decode(rc.encode(0, 0, [e], [], False)[4:-1])
        snd.close()
    finally:
        lst.close()
    assert not os.path.exists(lst.path)
    os.chmod(tmp_path / f"kvbm-backend-{os.getuid()}", 0o777)
    assert rc.socket_path("x") is None  # others may enter: not used


def test_report_channel_carries_a_large_snapshot_in_pieces_and_falls_back_to_steps(tmp_path, monkeypatch):
    """Review finding (2026-11-29): a report was one message and one over ``MAX_ENTRIES`` (a restored G3 of more
    than 4.2M blocks per rank; lowered to 8 here) was refused: the channel closed, the pump stopped, the worker
    kept reporting nowhere and the scheduler's mirror stayed empty (no G3 hit ever). Now a report goes in
    pieces, and a channel that fails sends the worker's reports back to the step output with a new snapshot.
    Real G3 pool, real Unix socket, the scheduler's G3Mirror."""
    import time

    import numpy as np

    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm import report_channel as rc
    from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    import shutil
    import tempfile
    xdg = tempfile.mkdtemp(prefix="kvbm-rc-")  # short: a Unix socket path has at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    monkeypatch.setattr(rc, "MAX_ENTRIES", 8)
    assert [(len(a), len(r), s) for a, r, s in rc.pieces(list(range(20)), [1, 2], True, 8)] == \
        [(0, 2, True), (8, 0, False), (8, 0, False), (4, 0, False)]
    lay = KvLayout(2, 2, 16, 64, "bfloat16")
    ns = Namespace("m", lay)
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
                              "admission": {"policy": "all"}}}, use_env=False)
    g3, _ = open_tiers(cfg, ns)
    hs = sequence_hashes(list(range(1000, 1000 + 16 * 24)), 16)
    blk = [np.full(lay.bytes_per_block, i, np.uint8) for i in range(24)]
    assert g3.put(ns.keys(hs[:20]), blk[:20]).result(HANG_S).written == 20
    mirror = G3Mirror(ns)
    lst = rc.ReportListener("m" * 24, lambda g, r, a, rm, snap: mirror.apply(KvbmWorkerMeta(a, rm, snap), rank=r))
    rc._local.clear()  # the worker is another process: only the socket
    ws = WorkerSide(ns, 0, g3, None, report_g3=True)
    pump = rc.start_worker_reports("m" * 24, [ws], 0)
    try:
        assert pump is not None and ws.report_by_channel
        end = time.monotonic() + HANG_S
        while len(mirror) < 20 and time.monotonic() < end:
            time.sleep(0.05)
        assert mirror.ready and len(mirror) == 20
        assert mirror.lookup_prefix(ns.keys(hs[:20])).result() == 20
        lst.close()  # the scheduler's end goes away: the next reports fail
        i = 20
        while ws.report_by_channel and time.monotonic() < end:
            assert g3.put(ns.keys(hs[i:i + 1]), blk[i:i + 1]).result(HANG_S).written == 1
            ws._g3_written(ns.keys(hs[i:i + 1]))  # what the completed save reports
            i = min(i + 1, 23)
            time.sleep(0.3)
        assert not ws.report_by_channel
        meta = ws.worker_meta()  # back in the step output: a whole snapshot
        assert meta is not None and meta.snapshot and len(meta.added) == len(g3.keys())
    finally:
        pump.stop() if pump is not None else None
        lst.close()
        ws.shutdown()
        g3.close()
        shutil.rmtree(xdg, ignore_errors=True)


def test_package_logs_go_through_vllms_logger_once():
    """Issue 22 item 4: the vLLM plugin routes ``kvbm_backend.*`` records to vLLM's ``vllm`` logger's handlers
    (its format and level) where the root logger has no handler (``vllm serve``: they were dropped, warnings
    printed bare), and leaves them to propagation where it has one (Dynamo's root handler, pytest's caplog):
    never twice."""
    import logging

    from kvbm_backend.integrations.vllm import plugin

    class Catch(logging.Handler):
        def __init__(self):
            super().__init__()
            self.got = []

        def emit(self, record):
            self.got.append(record.getMessage())

    root, vl, lg = logging.getLogger(), logging.getLogger("vllm"), logging.getLogger("kvbm_backend")
    saved = (list(root.handlers), list(vl.handlers), vl.level, vl.propagate, list(lg.handlers), lg.level)
    try:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.setLevel(logging.NOTSET)
        cv, cr = Catch(), Catch()
        vl.handlers, vl.propagate = [cv], False
        vl.setLevel(logging.INFO)
        assert plugin.route_logs() and not plugin.route_logs()  # installed once
        logging.getLogger("kvbm_backend.tiers").info("kvbm_backend tiers open: x")
        logging.getLogger("kvbm_backend.tiers").debug("below vLLM's level")
        assert cv.got == ["kvbm_backend tiers open: x"]
        root.addHandler(cr)  # an application (Dynamo, pytest) with a root handler: propagation only
        logging.getLogger("kvbm_backend.connector").warning("w")
        assert cv.got == ["kvbm_backend tiers open: x"] and cr.got == ["w"]
    finally:
        root.handlers[:] = saved[0]
        vl.handlers, vl.level, vl.propagate = saved[1], saved[2], saved[3]
        lg.handlers[:] = saved[4]
        lg.setLevel(saved[5])


_WORKER_LOG = r"""
import logging, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # as an engine core or worker process does (vllm/v1/engine/core.py)
from kvbm_backend.integrations.vllm import plugin
from kvbm_backend.pool.g4.breaker import CircuitBreaker
from kvbm_backend.pool.g4.events import OperatorLog
if sys.argv[1] == "dynamo":  # Dynamo's main process: vLLM's handler with Dynamo's formatter
    from dynamo.runtime.logging import VllmColorFormatter
    for h in logging.getLogger("vllm").handlers:
        h.setFormatter(VllmColorFormatter())
plugin.route_logs()
logging.getLogger("kvbm_backend.connector").info("kvbm_backend tiers open: x")
CircuitBreaker(1, 5.0, name="G4 s3://b/p").failure(OSError("timed out"))
OperatorLog("G4 s3://b/p", None, "ns").store_error(OSError("AccessDenied"))
logging.getLogger("vllm.v1.engine.core").warning("vLLM's own warning")
logging.getLogger("vllm.v1.engine.core").error("vLLM's own error")
"""


@pytest.mark.parametrize("fmt", ["vllm", "vllm_color", "dynamo"])
def test_worker_log_filter_finds_the_packages_warnings_in_vllms_and_dynamos_formats(tmp_path, fmt):
    """The Dynamo e2e failure message lists a worker's kvbm_backend WARNING/ERROR lines
    (tests/helpers/worker_logs.py). In a real worker's log (a process with vLLM's logging and the plugin's
    route: ``[breaker.py:134]``; Dynamo's formatter: ``breaker._fail:``; colours) they do not say
    ``kvbm_backend``: CI printed ``prefill_warnings: []`` for a worker whose circuit breaker had opened.
    The breaker's and the operator log's lines are found; vLLM's own and INFO lines are not."""
    import os
    import subprocess
    import sys

    from tests.helpers.worker_logs import kvbm_warnings
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CONFIGURE_LOGGING": "1",
           "VLLM_LOGGING_COLOR": "1" if fmt == "vllm_color" else "0"}
    with open(log, "wb") as f:
        subprocess.run([sys.executable, "-c", _WORKER_LOG, fmt], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                       check=True, timeout=HANG_S)
    text = log.read_text()
    assert "circuit breaker OPEN" in text and "vLLM's own warning" in text, text
    got = kvbm_warnings(log)
    assert len(got) == 2, (got, text)
    assert "circuit breaker OPEN" in got[0] and "the store refuses requests" in got[1], got
    assert not any("kvbm_backend" in ln for ln in got), got  # what the old filter looked for


_SCHED = r"""
import sys
from kvbm_backend.integrations.vllm import stats
stats.add(lookup_requests=2, lookup_blocks=12, load_planned_g3_blocks=4)
stats.set_info(role="scheduler", only_scheduler=1)
w = stats.StatsWriter(sys.argv[1], extra=lambda: {"g3": {"tier": "G3", "mirror": True, "lookup_blocks": 12,
                                                         "lookup_hits": 4, "hit_rate": 4 / 12},
                                                  "g4": {"tier": "G4", "lookup_blocks": 8, "lookup_hits": 0}})
w.maybe_write(force=True)
w.stop()
"""


def test_stats_path_holds_both_roles_counters(tmp_path):
    """Issue 22 item 9: with the roles in two processes the scheduler writes ``<stem>.scheduler<ext>`` (a real
    second process here) and the worker's writer merges it into ``stats_path``: both roles' counters, the
    G3 pool's lookups (counted by the scheduler's mirror) in the worker pool's stats, nothing counted twice
    over repeated writes."""
    import json
    import subprocess
    import sys
    from kvbm_backend.integrations.vllm import stats
    repo = REPO
    path, sched = tmp_path / "s" / "stats.json", tmp_path / "s" / "stats.scheduler.json"
    stats.reset()
    stats.add(load_g3_blocks_ok=4, g3_put_written_blocks=6)
    stats.set_info(role="worker")
    w = stats.StatsWriter(str(path), interval_s=60, merge=str(sched),
                          extra=lambda: {"g3": {"tier": "G3", "hits": 4, "bytes_read": 4096, "lookup_blocks": 0,
                                                "lookup_hits": 0, "hit_rate": 0.0}})
    try:
        w.maybe_write(force=True)  # the scheduler's file does not exist yet: the worker's counters alone
        assert json.loads(path.read_text())["load_g3_blocks_ok"] == 4
        subprocess.run([sys.executable, "-c", _SCHED, str(sched)], check=True, cwd=repo, timeout=HANG_S,
                       env={**__import__("os").environ, "PYTHONPATH": str(repo)})
        for _ in range(2):
            w.maybe_write(force=True)
        st = json.loads(path.read_text())
    finally:
        w.stop()
        stats.reset()
    assert st["load_g3_blocks_ok"] == 4 and st["g3_put_written_blocks"] == 6
    assert st["lookup_requests"] == 2 and st["load_planned_g3_blocks"] == 4
    assert st["info"]["role"] == "worker" and st["info"]["only_scheduler"] == 1
    g3 = st["pools"]["g3"]
    assert g3["hits"] == 4 and g3["lookup_blocks"] == 12 and g3["lookup_hits"] == 4 and g3["hit_rate"] == 4 / 12
    assert st["pools"]["g4"]["lookup_blocks"] == 8  # a pool only the scheduler has
    assert json.loads(sched.read_text())["lookup_requests"] == 2  # its own file is left as it wrote it


def test_external_launcher_stats_count_each_event_once(tmp_path):
    """vLLM's ``external_launcher`` with TP > 1: every process hosts the scheduler and one rank's worker, and the
    counters are the process's. Review finding (2026-11-29): the wiring split the file names by TP alone, so the
    scheduler wrote the process's counters to ``.scheduler`` and rank 0's worker merged that file into its own,
    identical snapshot: every counter in ``stats_path`` doubled. The real writers of both roles, as wired."""
    import json
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, _stats_writer
    path = tmp_path / "s" / "kvbm.json"
    sched, work = ConnectorParts(), ConnectorParts()
    for p in (sched, work):
        p.pool_stats = lambda: {}
    stats.reset()
    ws = _stats_writer(sched, str(path), split=True, scheduler=True, same_process=True)
    ww = _stats_writer(work, str(path), split=True, scheduler=False, same_process=True)
    try:
        stats.add(lookup_requests=1, load_blocks_ok=4)
        for w in (ws, ww, ws, ww):
            w.maybe_write(force=True)
        out = json.loads(path.read_text())
    finally:
        ws.stop()
        ww.stop()
        stats.reset()
    assert (out["lookup_requests"], out["load_blocks_ok"]) == (1, 4)
    assert not (tmp_path / "s" / "kvbm.scheduler.json").exists()


def test_mirror_is_ready_once_every_tp_rank_sent_its_snapshot():
    """With TP > 1 each rank's worker reports by the channel on its own; the first rank's snapshot alone
    must not make the mirror ready (a lookup then missed the other rank's blocks: the TP=2 engine test
    loaded 11 of 30 blocks). A step's report (every rank's, aggregated by vLLM) makes it ready at once."""
    from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta
    from kvbm_backend.model.namespace import Namespace

    ns = Namespace("m", KvLayout(2, 2, 32, 64, "bfloat16"), tp_world_size=2)
    m = G3Mirror(ns)
    m.apply(KvbmWorkerMeta(snapshot=True), rank=0)
    assert not m.ready
    m.apply(KvbmWorkerMeta(snapshot=True), rank=0)  # the same rank again: still waiting for rank 1
    assert not m.ready
    m.apply(KvbmWorkerMeta(snapshot=True), rank=1)
    assert m.ready
    m2 = G3Mirror(ns)
    m2.apply(KvbmWorkerMeta(snapshot=True))
    assert m2.ready


def test_a_preempted_request_resumed_on_other_blocks_saves_from_its_new_blocks(tmp_path):
    """Preemption (vLLM frees the request's blocks and gives them to others): the resumed request's block ids
    are the whole new list (``CachedRequestData.resumed_req_ids``), so a block saved after the resume is
    gathered from the new engine block at its position, never from a freed one; blocks saved before the
    preemption are not offered again."""
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.hashing import sequence_hashes
    from kvbm_backend.model.namespace import Namespace

    bs = 16
    ns = Namespace("m", KvLayout(2, 2, bs, 64, "bfloat16"))
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1}}, use_env=False)
    g3, g4 = open_tiers(cfg, ns)
    try:
        s = SchedulerSide(ns, bs, g3, g4)
        prompt = list(range(300, 300 + 4 * bs + 3))
        req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, all_token_ids=list(prompt), cache_salt=None,
                              lora_request=None)
        s.get_num_new_matched_tokens(req, 0)
        s.update_state_after_alloc(req, _Blocks([1, 2, 3, 4, 5]), 0)
        # a chunk of 2 blocks, then preempted: its blocks 1..5 are freed
        meta = s.build_connector_meta(_step(new=[("r", [1, 2, 3, 4, 5], 0)], sched={"r": 2 * bs}))
        assert [sv.block_ids for sv in meta.saves] == [[1, 2]]
        # resumed (recomputed from 0) on blocks 40..44: only blocks 2 and 3 are new, from engine blocks 42, 43
        resumed = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={"r": 4 * bs},
                                  scheduled_cached_reqs=SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"},
                                                                        new_block_ids=[([40, 41, 42, 43, 44],)],
                                                                        num_computed_tokens=[0]))
        meta = s.build_connector_meta(resumed)
        assert [sv.block_ids for sv in meta.saves] == [[42, 43]]
        assert list(meta.saves[0].seq_hashes) == sequence_hashes(prompt, bs)[2:4]
    finally:
        g3.close()


_TWO_RESETS = r"""
import sys
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
from vllm.v1.core.block_pool import BlockPool
from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
seen = []
sched = SimpleNamespace(idle_events=None, take_events=lambda engine_cache_reset=False: seen.append(engine_cache_reset) or [])
unseen = 0
for _ in range(20):
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True)
    conn = SimpleNamespace(sched=sched)  # the connector's state these two methods use
    KvbmBackendConnector.bind_gpu_block_pool(conn, pool)
    KvbmBackendConnector.take_events(conn)  # a step: no reset
    assert pool.reset_prefix_cache() and pool.reset_prefix_cache()  # twice, before the next step
    KvbmBackendConnector.take_events(conn)
    KvbmBackendConnector.take_events(conn)  # and a step after that: no reset
    assert seen[-1] is False and seen[-3] is False
    unseen += seen[-2] is not True
print(unseen)
"""


def test_two_prefix_cache_resets_between_steps_republish_g3():
    """vLLM's ``reset_prefix_cache`` replaces its hash map and publishes AllBlocksCleared, after which the connector
    publishes G3's blocks again. Two resets between steps (the engine idle: Dynamo's ``clear_kv_blocks`` twice) are
    seen as a reset too, 20 times of 20 (review 2026-12-02: compared by ``id()``, the second new map often took the
    freed first one's address: 18 of 20 unseen, the router left without the worker's G3 and G4 credits). In a
    fresh interpreter, whose allocator reuses addresses as a worker's does (this process's heap did not)."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", _TWO_RESETS, str(Path(__file__).resolve().parents[3])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "0", r.stdout
