"""Hybrid (sliding-window + full attention) models with speculative decoding: vLLM 0.32 keeps
``SlidingWindowSpec.extra_retained_tokens`` (``num_prefill_lookahead_tokens - 1``: multi-module MTP's
``num_speculative_tokens - 1``) below every sliding window, so for a connector hit of ``n`` blocks its
``SlidingWindowManager`` allocates the blocks of ``sliding_window - 1 + extra`` tokens before ``n``
(``get_num_skipped_tokens``), not only those of the window, and caches every one of them in its prefix cache
once the load is over. A block it allocated that the connector never filled is read by a later request
whose window reaches it (the last test's request ``c``): wrong outputs.

Without an engine (spec decoding needs a draft model): the connector wired by :func:`wire` from vLLM's own
KV cache config, real G3 pools on tmp files, real vLLM ``Request`` objects and vLLM's own
``KVCacheManager`` deciding which blocks it allocates; the worker's writes of the save jobs are put into
the pools directly."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvbm_backend.integrations import tiers  # noqa: E402
from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire  # noqa: E402
from tests.integrations.vllm.test_connector_wiring import _configs, _extra  # noqa: E402

pytestmark = [pytest.mark.vllm]

HANG_S = 600.0  # a hang guard, not a bound: waits for lookups and pool writes that must end
BS, H, D = 32, 2, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _kcc(window: int, extra: int) -> KVCacheConfig:
    """Group 0 sliding (``extra_retained_tokens`` set as vLLM's ``get_kv_cache_configs`` does), group 1 full."""
    kw = dict(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    sw = SlidingWindowSpec(sliding_window=window, extra_retained_tokens=extra, **kw)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(NAMES[::2], sw), KVCacheGroupSpec(NAMES[1::2], FullAttentionSpec(**kw))])


def _engine(kcc: KVCacheConfig, extra: int):
    """vLLM's own KV cache manager as its scheduler builds it with multi-module MTP (``use_eagle``,
    ``num_prefill_lookahead = num_speculative_tokens = extra + 1``), or without speculative decoding."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    return KVCacheManager(kcc, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True,
                          use_eagle=extra > 0, num_prefill_lookahead=extra + 1 if extra else 0)


def _request(rid: str, toks: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256_cbor)
    return Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BS, sha256_cbor))


def _matched(sched, req, local: int = 0):
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        n, a = sched.get_num_new_matched_tokens(req, local)
        if n is not None:
            return n, a
        time.sleep(0.005)
    raise AssertionError("lookup never answered")


def _step(new=(), sched=None):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=b, num_computed_tokens=c) for rid, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=dict(sched or {}))


def test_window_blocks_take_speculative_decodings_retained_tokens():
    """``ceil((window - 1 + retained) / block_size)``: retained from the spec (what vLLM's manager uses) or, for a
    spec without it, from ``VllmConfig.num_prefill_lookahead_tokens - 1``; full groups None."""
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations.vllm.namespaces import group_window_blocks, namespace_from_vllm
    cfg = KvbmBackendConfig(model="m")
    vc = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1))
    for window, extra, want in [(64, 0, 2), (64, 1, 2), (64, 2, 3), (65, 1, 3), (40, 3, 2), (96, 0, 3)]:
        kcc = _kcc(window, extra)
        ns = namespace_from_vllm(cfg, vc, kcc)
        assert group_window_blocks(ns, vc, kcc) == [want, None], (window, extra)
        assert ns == namespace_from_vllm(cfg, vc, _kcc(window, 0))  # the blocks' identity does not change
    kcc = _kcc(64, 0)
    ns = namespace_from_vllm(cfg, vc, kcc)
    mtp = SimpleNamespace(num_prefill_lookahead_tokens=3, **vars(vc))  # num_speculative_tokens=3
    assert group_window_blocks(ns, mtp, kcc) == [3, None]
    assert group_window_blocks(ns, SimpleNamespace(num_prefill_lookahead_tokens=1, **vars(vc)), kcc) == [2, None]


@pytest.mark.parametrize("window, extra, c_hits", [(64, 0, True), (64, 2, True), (65, 1, True), (40, 3, False)],
                         ids=["no-spec", "mtp3", "mtp2-window65", "mtp4-same-blocks"])
def test_hybrid_load_fills_every_sliding_block_vllm_allocates(tmp_path, window, extra, c_hits):
    """Engine A computes a prompt of 6 full blocks and saves (the connector's save jobs, put into G3 as its worker
    would); engine B (same connector pools) gets a 6-block hit, vLLM's manager allocates for it and the connector's
    load jobs must fill exactly the non-null blocks vLLM allocated in every group, each from G3 (stored and probed).
    Then vLLM caches B's blocks and a request ``c`` forking after block 6 takes its sliding window from them: every
    block of it was loaded (old code: with MTP the block ``extra`` tokens below the window was allocated, cached and
    read by ``c`` but never written). ``c_hits`` False: vLLM's EAGLE-style hit needs one block more than B
    keeps there, so ``c`` gets no hit at all (nothing to read)."""
    ktc, vc, _ = _configs(_extra(tmp_path))
    kcc = _kcc(window, extra)
    parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        s, groups = parts.scheduler_role(), parts._groups
        wb = -(-(window - 1 + extra) // BS)  # vLLM's: blocks of sliding_window - 1 + extra_retained_tokens tokens
        toks = list(range(100, 100 + 6 * BS + 5))  # a hit covers 6 blocks ((len - 1) // BS)

        # engine A: nothing stored; computes the prompt in one step and offers its blocks
        ea, ra = _engine(kcc, extra), _request("a", toks)
        assert _matched(s, ra) == (0, False)
        assert ea.allocate_slots(ra, len(toks), 0, ea.get_computed_blocks(ra)[0]) is not None
        s.update_state_after_alloc(ra, ea.get_blocks("a"), 0)
        ids_a = ea.get_blocks("a").get_block_ids()
        meta = s.build_connector_meta(_step(new=[("a", ids_a, 0)], sched={"a": len(toks)}))
        saved = {j.group: [ids_a[j.group].index(b) for b in j.block_ids] for j in meta.saves}
        payload = np.full(groups[0].ns.layout.bytes_per_block, 7, np.uint8)
        for j in meta.saves:  # what the worker writes for these jobs
            g = groups[j.group]
            keys = g.ns.keys(j.seq_hashes, j.tenant, 0, j.digests or None)
            g.g3.put(keys, [payload] * len(keys)).result(HANG_S)
        for g in groups:
            assert g.g3.flush(HANG_S)

        # engine B: the same prompt is a 6-block connector hit; vLLM allocates, the connector plans the loads
        eb, rb = _engine(kcc, extra), _request("b", toks)
        cb, n_local = eb.get_computed_blocks(rb)[:2]
        assert n_local == 0 and _matched(s, rb) == (6 * BS, True)
        assert eb.allocate_slots(rb, 0, 0, cb, num_external_computed_tokens=6 * BS, delay_cache_blocks=True,
                                 skip_zeroing_group_ids=(0, 1)) is not None
        s.update_state_after_alloc(rb, eb.get_blocks("b"), 6 * BS)
        ids_b = eb.get_blocks("b").get_block_ids()
        loads = {j.group: j for j in s.build_connector_meta(_step()).loads if j.req_id == "b"}
        for gi in (0, 1):
            allocated = {i: b for i, b in enumerate(ids_b[gi][:6]) if b != 0}  # vLLM's null block is id 0
            got = {ids_b[gi].index(b): b for b in loads[gi].block_ids}
            assert got == allocated, f"group {gi}: loaded positions {sorted(got)}, vLLM allocated {sorted(allocated)}"
            assert loads[gi].tiers == ["G3"] * len(got)
            assert loads[gi].seq_hashes == [s._reqs["b"].hashes[i] for i in sorted(got)]
        # vLLM's sliding window with its retained tokens is what the connector computed
        assert [i for i, b in enumerate(ids_b[0][:6]) if b != 0] == list(range(6 - wb, 6))

        # the load done and the prompt computed, vLLM caches B's blocks; a request forking after block 6 hits them
        eb.cache_blocks(rb, len(toks))
        hit = eb.get_computed_blocks(_request("c", toks[:6 * BS] + [7] * 9))[0].get_block_ids()
        window_c = [b for b in hit[0] if b != 0]
        assert bool(window_c) is c_hits, f"c's sliding-window hit: {hit[0]}"
        assert set(window_c) <= set(loads[0].block_ids), f"c reads blocks {window_c}, loaded {loads[0].block_ids}"
        assert saved == {0: list(range(6 - wb, 6)), 1: list(range(6))}  # A stored the window B needs
        assert [g.window_blocks for g in s.groups] == [wb, None]
    finally:
        parts.close()
    assert not tiers._shared


def test_hybrid_load_fills_sliding_blocks_allocated_outside_the_probed_window(tmp_path):
    """A scheduler whose sliding window is narrower than what vLLM allocates (here: 2 blocks where vLLM's MTP
    spec keeps 3; a retained-token rule the connector does not know) still plans every block vLLM allocated:
    the unprobed one from G3, where a miss fails the load and vLLM recomputes, never leaving an allocated block
    unwritten (old code: only the probed window [4, 6))."""
    from kvbm_backend.integrations.vllm.scheduler_side import GroupTiers, SchedulerSide
    ktc, vc, _ = _configs(_extra(tmp_path))
    kcc = _kcc(64, 2)
    parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        tgs = parts._groups
        narrow = [GroupTiers(tgs[0].ns, tgs[0].g3, None, 2), GroupTiers(tgs[1].ns, tgs[1].g3, None, None)]
        s = SchedulerSide(parts.ns, BS, narrow[0].g3, None, groups=narrow)
        toks = list(range(300, 300 + 6 * BS + 5))
        hs = s._state(_request("b", toks)).hashes
        payload = np.full(tgs[0].ns.layout.bytes_per_block, 7, np.uint8)
        for g, lo in ((narrow[0], 4), (narrow[1], 0)):
            g.g3.put(g.ns.keys(hs[lo:6]), [payload] * (6 - lo)).result(HANG_S)
            assert g.g3.flush(HANG_S)
        eb, rb = _engine(kcc, 2), _request("b", toks)
        assert _matched(s, rb) == (6 * BS, True)
        assert eb.allocate_slots(rb, 0, 0, eb.get_computed_blocks(rb)[0], num_external_computed_tokens=6 * BS,
                                 delay_cache_blocks=True, skip_zeroing_group_ids=(0, 1)) is not None
        s.update_state_after_alloc(rb, eb.get_blocks("b"), 6 * BS)
        ids = eb.get_blocks("b").get_block_ids()[0]
        job = [j for j in s.build_connector_meta(_step()).loads if j.group == 0][0]
        assert [ids.index(b) for b in job.block_ids] == [3, 4, 5] and job.tiers == ["G3"] * 3
        assert job.seq_hashes == list(hs[3:6])
    finally:
        parts.close()
    assert not tiers._shared
