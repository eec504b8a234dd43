"""The prefill -> decode hand-off through G4 (:mod:`kvbm_backend.integrations.vllm.handoff`) of a hybrid model
(sliding-window and full-attention KV cache groups) whose workers run multi-module MTP speculative decoding with
the same or different ``num_speculative_tokens``, or one of them none at all.

vLLM 0.32 keeps ``num_speculative_tokens - 1`` tokens below every sliding window under multi-module MTP
(``SlidingWindowSpec.extra_retained_tokens``, set by ``get_kv_cache_configs``; 0 at 1), so for a hit it allocates,
loads and caches ``ceil((window - 1 + retained) / block_size)`` sliding blocks. The MTP drafter loads all its modules
whatever ``num_speculative_tokens`` says: the KV cache layers, the namespace and the hand-off identity are the same at
1 and at 3, so such workers pair; a decode worker retaining more than its prefill worker needs sliding blocks below
the window the prefill worker never stored: it computes the prompt (never loading fewer blocks than allocated). Without any speculative decoding the engine
has no drafter layers, so its KV cache, its namespace and its hand-off identity are other ones: such a pair never
matches and the decode worker computes the prompt at once (its drafter's KV can come from no such prefill worker).

Real parts: vLLM's ``VllmConfig``/``SpeculativeConfig`` of a tiny DeepSeek-V3 config with a 3-module MTP drafter
(no weights: nothing runs the model), vLLM's ``get_kv_cache_configs`` making each side's KV cache config (and its
retained tokens) from per-layer specs, vLLM's ``Scheduler`` with ``KvbmBackendConnector``'s scheduler role on both
sides, real G3 pools and a shared G4 ``file://`` store; the worker's part is played by putting the blocks each step's
save jobs name into the pools those jobs are for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvbm_backend.apps.engine_model import TINY_MLA  # noqa: E402
from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.handoff import KEY  # noqa: E402
from tests.helpers.vllm_handoff import handoff_extra, prefill, step_until  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS, NBLK, WINDOW, H, D = 16, 64, 32, 2, 64  # window blocks: 2 at 0 retained tokens, 3 at 1 or 2
MTP_MODULES = 3
TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # 0, 2 sliding; 1, 3 full
DRAFTER = [f"model.layers.{4 + i}.self_attn.attn" for i in range(MTP_MODULES)]  # sliding (as dots3's MTP layers)


def _model_dir(tmp: Path) -> Path:
    """A DeepSeek-V3 ``config.json`` with a 3-module MTP drafter (``num_nextn_predict_layers`` 3): what vLLM's
    ``SpeculativeConfig(method="mtp")`` reads. Its layers are not what the KV cache specs below describe: nothing
    runs the model; the connector takes the KV cache's geometry from the KV cache config (and :func:`_no_mla` keeps
    vLLM from calling it an MLA model, whose prefix loads the connector turns off on CPU)."""
    p = tmp / "model"
    p.mkdir(parents=True, exist_ok=True)
    cfg = TINY_MLA.hf_config("float32")
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               num_nextn_predict_layers=MTP_MODULES)
    (p / "config.json").write_text(json.dumps(cfg))
    return p


def _scheduler(tmp: Path, name: str, spec_tokens: int | None) -> Scheduler:
    """vLLM's Scheduler with KvbmBackendConnector, its own G3 and the shared G4; ``spec_tokens``: MTP's
    ``num_speculative_tokens`` (None: no speculative decoding, so no drafter layers). ``handoff_wait_s`` 0: a decode
    request's wait ends at its first look, complete or not."""
    extra = handoff_extra(tmp, name, "tiny-mtp")
    ktc = KVTransferConfig(kv_connector="KvbmBackendConnector",
                           kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    mc = ModelConfig(model=str(_model_dir(tmp)), dtype="float32", max_model_len=512, skip_tokenizer_init=True)
    pc = ParallelConfig()
    sc = None if spec_tokens is None else SpeculativeConfig(
        method="mtp", num_speculative_tokens=spec_tokens, target_model_config=mc, target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, parallel_config=pc, speculative_config=sc,
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512,
                                                     enable_chunked_prefill=True, is_encoder_decoder=False),
                    kv_transfer_config=ktc)
    vc.cache_config.num_gpu_blocks = NBLK
    vc.parallel_config.distributed_executor_backend = "uni"  # the scheduler role uses the pools itself
    vc.cache_config.kv_cache_layout = "NHD"  # what the engine core resolves before get_kv_cache_configs
    kw = dict(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    names = TARGET + (DRAFTER if sc is not None else [])  # vLLM gives the drafter's layers KV caches of their own
    specs = {n: SlidingWindowSpec(sliding_window=WINDOW, **kw) if i % 2 == 0 or n in DRAFTER
             else FullAttentionSpec(**kw) for i, n in enumerate(names)}
    one = SlidingWindowSpec(sliding_window=WINDOW, **kw).page_size_bytes
    (kcc,) = get_kv_cache_configs(vc, [specs], [NBLK * one * len(names)])
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BS)


@pytest.fixture(autouse=True)
def _no_mla(monkeypatch):
    """vLLM's ``ModelConfig.use_mla`` off (``VLLM_MLA_DISABLE``): the KV cache specs here are K/V attention."""
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")


@pytest.mark.parametrize("pre_spec, dec_spec", [(1, 1), (3, 3), (1, 3), (3, 1)],
                         ids=["both1", "both3", "prefill1-decode3", "prefill3-decode1"])
def test_mtp_pair_hands_off_with_equal_speculative_tokens_and_never_loads_short(tmp_path, pre_spec, dec_spec):
    """Disaggregated pairs with multi-module MTP (review 2026-12-03). vLLM loads every drafter module at any
    ``num_speculative_tokens``, so workers at 1 and at 3 share a namespace and pair; vLLM retains
    ``num_speculative_tokens - 1`` tokens below each sliding window. With equal settings the decode side finds
    every promised block at its first look and loads exactly the blocks vLLM allocated in each group. With other
    settings (documented in docs/operations.md "Speculative decoding": run both with the same
    ``num_speculative_tokens``) the windows differ: the decode side either finds every block it needs (its window
    is the smaller) or computes the prompt (``handoff_timeouts``), and never loads fewer blocks than vLLM allocated
    in a group (an allocated block left unloaded would be cached by vLLM's prefix cache: wrong outputs)."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    prompt = list(range(2000, 2000 + 6 * BS + 5))
    want = (len(prompt) - 1) // BS
    pre, dec = _scheduler(tmp_path, "prefill", pre_spec), None
    try:
        params = prefill(pre, prompt, hasher)
        assert params[KEY]["blocks"] == want
        dec = _scheduler(tmp_path, "decode", dec_spec)
        assert dec.connector.sched.ns == pre.connector.sched.ns  # same drafter layers: one namespace, they pair
        retained = dec.kv_cache_config.kv_cache_groups[0].kv_cache_spec.extra_retained_tokens
        assert retained == dec_spec - 1  # what vLLM itself set (get_kv_cache_configs)
        done, timeouts = stats.get("handoff_complete_requests"), stats.get("handoff_timeouts")
        dec.add_request(Request("d", prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                                None, 0, block_hasher=hasher))
        so = step_until(dec, "d", loads=True)
        loads = {j.group: j for j in so.kv_connector_metadata.loads if j.req_id == "d"}
        kinds = [g.window_blocks is None for g in dec.connector.sched.groups]  # True: full attention
        ids = dec.kv_cache_manager.get_blocks("d").get_block_ids()
        for gi, job in loads.items():
            allocated = [b for b in ids[gi][:want] if b != 0]  # vLLM's null block is id 0
            assert sorted(job.block_ids) == sorted(allocated), f"group {gi}: loaded {job.block_ids}, vLLM {allocated}"
            assert len(job.block_ids) == (want if kinds[gi] else -(-(WINDOW - 1 + retained) // BS))
        if dec_spec <= pre_spec:  # the decode side's window is within what the prefill side stored
            assert sorted(loads) == list(range(len(kinds))), f"decode loads groups {sorted(loads)}"
            assert stats.get("handoff_complete_requests") == done + 1
            assert stats.get("handoff_timeouts") == timeouts
        else:  # it needs a sliding block below the prefill side's window: computed, nothing loaded
            assert loads == {} and stats.get("handoff_timeouts") == timeouts + 1
    finally:
        pre.shutdown()
        if dec is not None:
            dec.shutdown()


@pytest.mark.parametrize("pre_spec, dec_spec", [(None, 3), (3, None)], ids=["prefill-none", "decode-none"])
def test_a_worker_without_speculative_decoding_never_pairs_with_an_mtp_worker(tmp_path, pre_spec, dec_spec):
    """Pinned: a worker without speculative decoding has no drafter layers, so its KV cache config (and each KV cache
    group's layers, hence the namespace and the hand-off's G4 identity) is another than an MTP worker's. Its blocks
    lack the drafter's KV the MTP worker reads, so no such pair can hand off (vLLM's NIXL path needs one KV cache
    layout on both sides too): the decode worker computes the prompt at once, counted
    ``handoff_identity_mismatches``, never waiting ``handoff_wait_s`` and loading nothing."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    prompt = list(range(3000, 3000 + 6 * BS + 5))
    pre, dec = _scheduler(tmp_path, "prefill", pre_spec), None
    try:
        params = prefill(pre, prompt, hasher)
        assert params[KEY]["blocks"] == (len(prompt) - 1) // BS
        dec = _scheduler(tmp_path, "decode", dec_spec)
        assert params[KEY]["namespace"] != dec.connector.sched.ns.fingerprint
        mism, timeouts = stats.get("handoff_identity_mismatches"), stats.get("handoff_timeouts")
        dec.add_request(Request("d", prompt, SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                                None, 0, block_hasher=hasher))
        so = step_until(dec, "d", loads=True)
        assert "d" in so.num_scheduled_tokens and not [j for j in so.kv_connector_metadata.loads if j.req_id == "d"]
        assert so.num_scheduled_tokens["d"] == len(prompt)  # computed whole
        assert stats.get("handoff_identity_mismatches") == mism + 1
        assert stats.get("handoff_timeouts") == timeouts
    finally:
        pre.shutdown()
        if dec is not None:
            dec.shutdown()
