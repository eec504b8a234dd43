"""What the connector's block identity covers beyond token ids (review findings, 2026-11-29): vLLM's weights
revision, quantization and hf_overrides reach the namespace (they change the KV; an engine with none of them
keeps its fingerprint), a LoRA name pointed at another adapter gets other keys (vLLM's own hash has the path),
and pipeline or context parallelism, whose blocks the keys would not describe, is refused with the field named."""
from __future__ import annotations

from types import SimpleNamespace as S

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402

from kvbm_backend.config import KvbmBackendConfig, load_config  # noqa: E402
from kvbm_backend.integrations.vllm.namespaces import namespace_from_vllm  # noqa: E402
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvbm_backend.model.layout import KvLayout  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402

pytestmark = [pytest.mark.vllm]

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
KCC = S(kv_cache_groups=[KVCacheGroupSpec(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(4)],
                                          kv_cache_spec=SPEC)])


def _vllm(revision=None, quantization=None, hf_overrides=None, pp=1, dcp=1, pcp=1, **mc_fields):
    mc = S(model="meta-llama/Llama-3.1-8B", served_model_name="meta-llama/Llama-3.1-8B", revision=revision,
           quantization=quantization, hf_overrides=hf_overrides or {}, **mc_fields)
    return S(model_config=mc, parallel_config=S(tensor_parallel_size=1, pipeline_parallel_size=pp,
                                                decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp),
             cache_config=S(cache_dtype="auto"))


def _fp(vc, cfg=None):
    return namespace_from_vllm(cfg or KvbmBackendConfig(), vc, KCC).fingerprint


def test_weights_revision_quantization_and_overrides_are_part_of_the_namespace():
    base = _fp(_vllm())
    assert namespace_from_vllm(KvbmBackendConfig(), _vllm(), KCC).revision == "main"  # unchanged for plain engines
    others = [_fp(_vllm(revision="v1")), _fp(_vllm(revision="v2")), _fp(_vllm(quantization="fp8")),
              _fp(_vllm(hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))]
    assert len({base, *others}) == 5
    # an operator's explicit revision is the identity they chose (and wins over vLLM's)
    cfg = load_config({"revision": "r7"}, use_env=False)
    assert _fp(_vllm(revision="v1"), cfg) == _fp(_vllm(revision="v2"), cfg) != base


def test_pipeline_parallelism_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        namespace_from_vllm(KvbmBackendConfig(), _vllm(pp=2), KCC)


def test_context_parallelism_is_refused_with_the_field_named():
    """Under decode (or prefill) context parallelism vLLM's block spans block_size x cp tokens spread over the
    ranks (vllm/v1/core/kv_cache_utils.py resolve_dcp_kv_block_size); the connector's keys describe block_size
    tokens per rank, so it refuses (review finding 2026-11-29: accepted, with the fingerprint of cp=1)."""
    with pytest.raises(ValueError, match="decode_context_parallel_size 2"):
        namespace_from_vllm(KvbmBackendConfig(), _vllm(dcp=2), KCC)
    with pytest.raises(ValueError, match="prefill_context_parallel_size 2"):
        namespace_from_vllm(KvbmBackendConfig(), _vllm(pcp=2), KCC)
    assert namespace_from_vllm(KvbmBackendConfig(), _vllm(dcp=1, pcp=1), KCC).fingerprint == _fp(_vllm())


def test_a_lora_name_pointed_at_another_adapter_gets_other_keys():
    ns = Namespace("m", KvLayout(2, 2, 16, 64, "bfloat16"))
    s = SchedulerSide(ns, 16, None, None)

    def hashes(rid, path):
        req = S(request_id=rid, prompt_token_ids=list(range(100, 140)), cache_salt=None,
                lora_request=S(lora_name="sql", lora_path=path))
        return list(s._state(req).hashes)
    assert hashes("a", "/adapters/sql-v1") != hashes("b", "/adapters/sql-v2")
    assert hashes("c", "/adapters/sql-v1") == hashes("a", "/adapters/sql-v1")


def test_an_explicit_revision_keeps_the_quantization_and_overrides_suffixes(tmp_path):
    """Review finding (2026-12-01): a config that sets ``revision`` (the examples said ``revision: main``) was used
    as it stood, dropping ``+q=``/``+hf=``: an fp8 and a bf16 engine of one model shared G3/G4 blocks (wrong KV).
    The suffixes now follow an explicit revision too; one the operator already wrote in is not added twice."""
    f = tmp_path / "kvbm-backend.yaml"  # a real file, as the examples' ConfigMap / YAML set it
    f.write_text("revision: main\ng3:\n  paths: [" + str(tmp_path / "g3") + "]\n")
    cfg = load_config(str(f), use_env=False)
    assert "revision" in cfg.model_fields_set
    fp8 = namespace_from_vllm(cfg, _vllm(quantization="fp8"), KCC)
    assert fp8.revision == "main+q=fp8"
    assert fp8.fingerprint != _fp(_vllm(), cfg) == _fp(_vllm())  # bf16 keeps "main" (the unset default's)
    rope = namespace_from_vllm(cfg, _vllm(hf_overrides={"rope_scaling": {"factor": 8}}), KCC)
    assert rope.revision.startswith("main+hf=") and rope.revision == namespace_from_vllm(
        KvbmBackendConfig(), _vllm(hf_overrides={"rope_scaling": {"factor": 8}}), KCC).revision
    # the explicit revision still wins over vLLM's --revision; the suffixes are added to it
    r7 = load_config({"revision": "r7"}, use_env=False)
    assert namespace_from_vllm(r7, _vllm(revision="v1", quantization="fp8"), KCC).revision == "r7+q=fp8"
    # an operator who wrote the suffix in keeps that namespace (not "+q=fp8+q=fp8")
    own = load_config({"revision": "main+q=fp8"}, use_env=False)
    assert namespace_from_vllm(own, _vllm(quantization="fp8"), KCC).fingerprint == fp8.fingerprint
    # ... and only that suffix, whole: another method whose name starts alike still gets its own
    assert namespace_from_vllm(own, _vllm(quantization="fp8_e4m3"), KCC).revision == "main+q=fp8+q=fp8_e4m3"


def test_a_config_model_vllm_does_not_serve_is_one_warning_naming_both(caplog):
    """Review finding (2026-12-01): the examples hard-coded ``model: meta-llama/Llama-3.1-8B-Instruct`` beside a
    ``MODEL`` parameter; any other model served through them shared the Instruct model's namespace, silently.
    The config's ``model`` still names the namespace (a local path or an alias may need it: not refused), but
    one that names none of vLLM's names is a WARNING naming both, once per process; a matching one says nothing."""
    import logging
    caplog.set_level(logging.WARNING, logger="kvbm_backend")
    pinned = load_config({"model": "meta-llama/Llama-3.1-8B-Instruct"}, use_env=False)
    for _ in range(2):
        assert namespace_from_vllm(pinned, _vllm(), KCC).model == "meta-llama/Llama-3.1-8B-Instruct"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "'meta-llama/Llama-3.1-8B-Instruct'" in warned[0] and "'meta-llama/Llama-3.1-8B'" in warned[0], warned[0]
    caplog.clear()
    for same in ("meta-llama/Llama-3.1-8B", "/models/Llama-3.1-8B"):  # the served name, a local copy of it
        assert namespace_from_vllm(load_config({"model": same}, use_env=False), _vllm(), KCC).model == same
    local = _vllm()
    local.model_config.model, local.model_config.served_model_name = "/models/llama-8b", "llama"  # an alias
    assert namespace_from_vllm(load_config({"model": "/models/llama-8b"}, use_env=False), local, KCC)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_quantization_config_is_part_of_the_namespace():
    """``--quantization online`` names only the method; ``--quantization-config`` says what is quantized (review
    2026-12-02: three online configs, fp8 / mxfp4 / nothing quantized, shared one fingerprint)."""
    fps = [_fp(_vllm(quantization="online", quantization_config=qc)) for qc in
           ({"linear": "fp8_per_tensor"}, {"linear": "mxfp4"}, {"linear": "fp8_per_tensor", "ignore": ["*"]})]
    assert len(set(fps)) == 3
    assert fps[0] == _fp(_vllm(quantization="online", quantization_config={"linear": "fp8_per_tensor"}))
    assert _fp(_vllm(quantization_config=None)) == _fp(_vllm())  # none: the fingerprint stays


def _longrope(max_model_len):
    rope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0],
            "original_max_position_embeddings": 4096}
    hf = S(rope_parameters=rope, architectures=["Phi3ForCausalLM"])
    return _vllm(max_model_len=max_model_len, hf_text_config=hf, hf_config=hf)


def test_kv_that_max_model_len_chooses_is_part_of_the_namespace():
    """vLLM rotates a LongRoPE model's K with its long factors when ``--max-model-len`` exceeds
    ``original_max_position_embeddings``, its short ones otherwise; Llama 4 tunes its attention temperature past
    32768 tokens (or as its generation config says). Review 2026-12-02: such engines with other lengths shared
    keys and loaded each other's K (Phi-3.5-mini at 4096 and 32768 tokens: one fingerprint)."""
    short, long_ = namespace_from_vllm(KvbmBackendConfig(), _longrope(4096), KCC), \
        namespace_from_vllm(KvbmBackendConfig(), _longrope(32768), KCC)
    assert (short.revision, long_.revision) == ("main+rope=short", "main+rope=long")
    assert short.fingerprint != long_.fingerprint
    assert _fp(_longrope(2048)) == short.fingerprint  # the same choice: the same KV, shared

    def llama4(max_len, gen=None, override=None):
        hf = S(architectures=["Llama4ForConditionalGeneration"])
        return _vllm(max_model_len=max_len, hf_text_config=S(), hf_config=hf,
                     try_get_generation_config=lambda: dict(gen or {}), override_generation_config=override or {})
    revs = [namespace_from_vllm(KvbmBackendConfig(), v, KCC).revision for v in
            (llama4(8192), llama4(65536), llama4(8192, gen={"attn_temperature_tuning": True}),
             llama4(65536, override={"attn_temperature_tuning": False}))]
    assert revs == ["main+attn_t=off", "main+attn_t=on", "main+attn_t=on", "main+attn_t=off"]
    assert namespace_from_vllm(KvbmBackendConfig(), _vllm(max_model_len=65536), KCC).revision == "main"  # others


def test_a_non_causal_kv_cache_is_refused_naming_it():
    """A Prefix-LM's bidirectional prefill (``FullAttentionSpec(non_causal=True)``, vLLM's hrm_text) makes a block's
    KV depend on the tokens after it (vLLM turns its own prefix caching off). Review 2026-12-02: carried as full
    attention, saved and loaded for other prompts sharing the block."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, non_causal=True)
    kcc = S(kv_cache_groups=[KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=spec)])
    with pytest.raises(ValueError, match="non-causal"):
        namespace_from_vllm(KvbmBackendConfig(), _vllm(), kcc)
