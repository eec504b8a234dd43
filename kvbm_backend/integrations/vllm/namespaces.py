"""From vLLM's KV cache config to this engine's KV namespaces: one :class:`~.geometry.EngineGeometry` and
:class:`~kvbm_backend.model.namespace.KvGroup` per KV cache group, the engine's
:class:`~kvbm_backend.model.namespace.Namespace`, and the G3 config of each group and TP rank.

Hybrid models (vLLM's hybrid KV cache manager, several KV cache groups: gpt-oss's alternating
sliding-window/full attention, Gemma 2/3's sliding/full patterns, all-sliding models): each group has its own
namespace (the structure of all groups plus the group's index and layout: :meth:`Namespace.for_group`), its
own pools (G3 under ``<path>/group<g>``, capacity split by weight: full-attention groups 1, sliding-window
groups ``sliding_capacity_weight``, default 0.25) and the same KVBM sequence hashes. Refused, with the
reason: KV cache specs other than full attention, sliding window and MLA (Mamba/linear attention state,
chunked local attention (Llama 4), cross-attention, sink/ring specs) and groups with different block sizes.

Tensor parallelism (TP = N > 1): every rank's worker keeps a private G3 pool under ``<path>/tp<N>-rank<r>``
with ``capacity_gb / N`` (:func:`rank_g3_config`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from ...config import KvbmBackendConfig
from ...model.namespace import KvGroup, Namespace
from .geometry import EngineGeometry, engine_kv_packed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvbm_backend.connector")


def _group_of(spec: Any, geo: EngineGeometry) -> KvGroup:
    """A :class:`KvGroup` from one vLLM KV cache group's spec and its geometry. Raises ValueError naming the
    spec for kinds the connector cannot carry."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
    kind = {FullAttentionSpec: "full", MLAAttentionSpec: "mla", SlidingWindowSpec: "sliding"}.get(type(spec))
    if getattr(spec, "non_causal", False):  # review 2026-12-02: carried as "full" before, saved and loaded
        raise ValueError(f"kv cache spec {type(spec).__name__} is non-causal (a Prefix-LM's bidirectional prefill): "
                         "a block's KV depends on the tokens after it, so no other prompt may reuse it (vLLM turns "
                         "its own prefix caching off for it); KvbmBackendConnector cannot carry it")
    if kind is None:
        raise ValueError(f"kv cache spec {type(spec).__name__}: KvbmBackendConnector carries full attention, "
                         "sliding-window attention and MLA groups only (state/linear-attention, chunked local, "
                         "cross-attention and sink/ring caches are not KV blocks of a token prefix)")
    return KvGroup(kind=kind if not geo.mla else "mla", layout=geo.kv_layout,
                   sliding_window=int(spec.sliding_window) if kind == "sliding" else None)


def kv_groups(kv_cache_config: "KVCacheConfig") -> list:
    """vLLM's KV cache groups the connector carries (device-resident ones)."""
    return [g for g in kv_cache_config.kv_cache_groups if not getattr(g, "host_resident", False)]


def engine_geometries(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> list[EngineGeometry]:
    """One :class:`EngineGeometry` per KV cache group the connector carries, from its spec and layer
    names (``KVCacheConfig.kv_cache_groups``), the TP degree (``ParallelConfig.tensor_parallel_size``) and
    ``CacheConfig.cache_dtype`` (the ``--kv-cache-dtype``: vLLM allocates FP8 caches as uint8 tensors).
    Raises ValueError for specs that are not attention KV and for unsupported KV dtypes (named)."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    return [EngineGeometry.from_kv_cache_spec(g.kv_cache_spec, len(g.layer_names), tp, cache_dtype=cache_dtype)
            for g in kv_groups(kv_cache_config)]


def sliding_retained_tokens(vllm_config: Any, spec: Any) -> int:
    """Tokens vLLM keeps below a sliding window (not attended, but allocated, loaded and cached): vLLM 0.32's
    ``SlidingWindowSpec.extra_retained_tokens``, which its ``get_kv_cache_configs`` sets to
    ``VllmConfig.num_prefill_lookahead_tokens - 1`` (multi-module MTP: ``num_speculative_tokens - 1``; 0 without
    speculative decoding and for EAGLE/ngram), so its ``SlidingWindowManager`` skips only
    ``n - sliding_window + 1 - extra`` tokens (``get_num_skipped_tokens``). The larger of the spec's value and the
    one ``vllm_config`` implies (a spec of an older vLLM has none); never negative."""
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    return max(0, extra, lookahead - 1)


def group_window_blocks(ns: Namespace, vllm_config: Any, kv_cache_config: "KVCacheConfig") -> list[int | None]:
    """Per KV cache group (index = vLLM's group index): None for a full-attention (or MLA) group, else the blocks
    before a resume point vLLM allocates for a sliding-window group and the connector therefore stores, probes and
    loads: ``ceil((sliding_window - 1 + retained) / block_size)`` (``retained``: :func:`sliding_retained_tokens`;
    :attr:`KvGroup.window_blocks` when 0). A block vLLM allocates but the connector never fills would be computed
    with, and cached by vLLM's prefix cache for later requests whose window reaches it. ``[None]`` for a namespace
    without groups."""
    if not ns.groups:
        return [None]
    out: list[int | None] = []
    for kg, g in zip(ns.groups, kv_groups(kv_cache_config)):
        if kg.sliding_window is None:
            out.append(None)
            continue
        tokens = kg.sliding_window - 1 + sliding_retained_tokens(vllm_config, g.kv_cache_spec)
        out.append(max(1, -(-tokens // kg.layout.page_size)))
    return out


def namespace_model(cfg: KvbmBackendConfig, engine_name: Any, *engine_names: Any) -> str:
    """The namespace's ``model``: ``cfg.model`` when the operator set it (not its default ``"unknown"``), else
    the name the engine gives (``engine_name``). The connector and the native tiers both decide it here: two
    fine-tunes mounted at one path with different ``model`` settings never share blocks.

    A set ``model`` that names none of the engine's names (``engine_name`` and ``engine_names``: the served
    name, the ``--model`` path; equal, or equal in their last path component, as a local copy
    ``/models/Llama-3.1-8B-Instruct`` of ``meta-llama/Llama-3.1-8B-Instruct``) is one WARNING per process and
    pair (:func:`warn_model_mismatch`): the blocks go under the config's name, shared with every engine of
    that name. Not refused: naming the weights apart from vLLM's name is what the field is for (a local path,
    an alias from ``--served-model-name``, fine-tunes at one path), as KVBM's model id is the operator's."""
    if cfg.model == "unknown":
        return str(engine_name)
    warn_model_mismatch(str(cfg.model), [engine_name, *engine_names])
    return str(cfg.model)


_warned_models: set[tuple[str, tuple[str, ...]]] = set()
_warned_lock = threading.Lock()


def _last_part(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def warn_model_mismatch(model: str, engine_names: list[Any]) -> bool:
    """Log one WARNING (once per process, ``model`` and names) when ``model`` (the config's) names none of
    ``engine_names`` (None entries ignored); True when it did differ. The trap it catches: a config (a
    ConfigMap, a script's inline settings) that keeps naming one model while the deployment's ``MODEL`` serves
    another, whose blocks then share that model's namespace."""
    names = tuple(dict.fromkeys(str(n) for n in engine_names if n))
    if not names or any(model == n or _last_part(model) == _last_part(n) for n in names):
        return False
    with _warned_lock:
        if (model, names) in _warned_models:
            return True
        _warned_models.add((model, names))
    log.warning("kvbm_backend: the config's model %r is not the model vLLM serves (%s): its KV blocks are stored "
                "and looked up under %r, shared with every engine whose config names that model. Remove `model` "
                "from the kvbm-backend config to use vLLM's name, or keep it only if %r names these weights "
                "(docs/configuration.md, model)", model, " / ".join(repr(n) for n in names), model, model)
    return True


def refuse_parallel_layouts(carrier: str, *, pipeline_parallel_size: Any = 1, decode_context_parallel_size: Any = 1,
                            prefill_context_parallel_size: Any = 1) -> None:
    """Refuse the parallel layouts whose blocks neither the connector nor the native tiers can name (both call this:
    the connector with vLLM's ``ParallelConfig``, a native tier with the ``OffloadingParallelConfig`` vLLM builds from
    it, ``pp_size``/``dcp_size``/``pcp_size``). ``carrier`` names who refuses, in the message. ``None`` counts as 1.

    A block's identity (namespace: layers, heads and tokens of one rank's block, the rank count; key: rank) says
    neither which layers a pipeline stage holds nor which of a block's tokens a context-parallel rank holds, so
    under pipeline parallelism > 1 (vLLM's scheduler sees stage 0's layers only) or decode/prefill context
    parallelism > 1 (a block's tokens spread over the ranks: ``resolve_dcp_kv_block_size``) engines of other
    layouts got one fingerprint and loaded each other's blocks as verified hits (review 2026-12-02, native tiers:
    a PCP=2 engine served a TP=2 engine's chunks). Raises ValueError naming ``parallel_config.<field> <value>``."""
    pp = int(pipeline_parallel_size or 1)
    if pp > 1:
        raise ValueError(f"parallel_config.pipeline_parallel_size {pp} (--pipeline-parallel-size): {carrier}'s block "
                         "identity describes one stage's layers, not which layers each stage holds, so stages and "
                         "engines that split the layers otherwise would share keys; run it with pipeline parallelism 1")
    for fld, value in (("decode_context_parallel_size", decode_context_parallel_size),
                       ("prefill_context_parallel_size", prefill_context_parallel_size)):
        cp = int(value or 1)
        if cp > 1:  # vLLM: a block's tokens spread over the cp ranks (DCP: block_size * cp tokens per block)
            raise ValueError(f"parallel_config.{fld} {cp}: a block's tokens are then spread over {cp} "
                             f"context-parallel ranks, which {carrier}'s block identity (every rank's block holds "
                             "all of the block's tokens) does not describe, so engines of other layouts would share "
                             "keys; run it with context parallelism 1")


def namespace_from_vllm(cfg: KvbmBackendConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                        geometries: list[EngineGeometry] | None = None) -> Namespace:
    """The Namespace of this engine's KV: model (``cfg.model``, else vLLM's served model name),
    revision, per-rank KvLayout from the KV cache spec (layers, KV heads per rank, head size, dtype,
    ``page_size`` = vLLM ``block_size``) and the TP degree.

    MLA (vLLM ``MLAAttentionSpec``, e.g. DeepSeek-V2/V3/R1): one latent per token, ``outer_dim = 1``,
    ``inner_dim = head_size`` (``kv_lora_rank + qk_rope_head_dim``, 576 for DeepSeek), the same on every
    TP rank (replicated, not split); with TP > 1 every rank keeps its own copy in its G3 pool under its
    own rank's key, and G4 holds one copy under rank 0's key (``Namespace.shared_rank``).

    Several KV cache groups (vLLM's hybrid KV cache manager): the namespace records every group
    (:class:`KvGroup`: kind full/sliding/mla, its layout, the window in tokens) and names group 0's
    blocks; :meth:`Namespace.for_group` gives the others'. A uniform-spec model keeps the one-group
    namespace (unchanged fingerprint).

    Raises ValueError for KV caches the connector cannot carry (non-attention or chunked/cross/sink
    specs, an MLA spec with more than one KV head, groups with different block sizes) and for pipeline or
    context parallelism > 1 (:func:`refuse_parallel_layouts`).
    ``geometries``: :func:`engine_geometries` when the caller has them already."""
    groups = kv_groups(kv_cache_config)
    if not groups:
        raise ValueError("kv cache: no KV cache groups (attention-free model); nothing to carry")
    if geometries is None:
        geometries = engine_geometries(vllm_config, kv_cache_config)
    kgs = [_group_of(g.kv_cache_spec, geo) for g, geo in zip(groups, geometries)]
    sizes = {k.layout.page_size for k in kgs}
    if len(sizes) != 1:
        raise ValueError(f"kv cache: KV cache groups with block sizes {sorted(sizes)}; KvbmBackendConnector "
                         "needs one block size (a block's sequence hash covers block_size tokens)")
    names = vllm_config.model_config.served_model_name
    model = namespace_model(cfg, names[0] if isinstance(names, (list, tuple)) and names else
                            (names or vllm_config.model_config.model), vllm_config.model_config.model)
    revision = engine_revision(cfg, vllm_config)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    pc = vllm_config.parallel_config
    refuse_parallel_layouts("KvbmBackendConnector", pipeline_parallel_size=getattr(pc, "pipeline_parallel_size", 1),
                            decode_context_parallel_size=getattr(pc, "decode_context_parallel_size", 1),
                            prefill_context_parallel_size=getattr(pc, "prefill_context_parallel_size", 1))
    kv_version = engine_kv_version(vllm_config, kgs)
    if len(kgs) == 1 and kgs[0].kind != "sliding":
        return Namespace(model=str(model), layout=kgs[0].layout, revision=revision, tp_world_size=tp,
                         kv_version=kv_version)
    # several groups, or one sliding-window group (every layer windowed, e.g. Mistral-7B-v0.1: vLLM
    # null-blocks what the window left behind, so blocks are stored window-bounded as in a hybrid model)
    return Namespace(model=str(model), layout=kgs[0].layout, revision=revision, tp_world_size=tp,
                     groups=tuple(kgs), group=0, kv_version=kv_version)


def engine_device_type(vllm_config: Any) -> str:
    """The engine's device type: vLLM's ``DeviceConfig.device_type`` (``vllm/config/device.py``: the
    platform's, ``"cuda"``, ``"cpu"``, ...); ``"cpu"`` where the config has none (stand-ins)."""
    return str(getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu")


def engine_kv_version(vllm_config: Any, kgs: list[KvGroup]) -> int:
    """The namespace's ``kv_version``: 2 for an engine whose K/V caches are vLLM's packed K|V tensors
    (:func:`.geometry.engine_kv_packed` of :func:`engine_device_type`: every non-CPU engine) with at least
    one K/V (non-MLA) group, else 0 (CPU engines and MLA-only engines: their blocks were always read right,
    their fingerprints are unchanged). The worker checks its tensors agree (:func:`check_kv_version`)."""
    packed = engine_kv_packed(engine_device_type(vllm_config))
    return 2 if packed and any(k.kind != "mla" for k in kgs) else 0


def check_kv_version(ns: Namespace, engine_layout: str) -> None:
    """Raise ValueError when the worker's tensors (``engine_layout``, :func:`.geometry.detect_engine_layout`)
    contradict the namespace's ``kv_version`` (the scheduler's :func:`engine_kv_version`): a ``"packed"``
    engine under version 0 or a ``"cpu"`` engine under version 2 would name its blocks with the other
    convention's fingerprint."""
    want = {"packed": 2, "cpu": 0}.get(engine_layout)
    if want is not None and ns.kv_version != want:
        raise ValueError(f"kv caches: engine layout {engine_layout!r} but the namespace has kv_version "
                         f"{ns.kv_version} (vLLM device_type {'cpu' if ns.kv_version == 0 else 'non-cpu'}); "
                         f"expected {want}: the tensors' device and vLLM's DeviceConfig disagree")


def engine_revision(cfg: KvbmBackendConfig, vllm_config: "VllmConfig") -> str:
    """The namespace's ``revision`` of a connector engine: :func:`namespace_revision` of vLLM's ``--revision``,
    ``--quantization`` and ``--hf-overrides`` (``vllm_config.model_config``), plus what else makes this engine's KV
    other KV (review 2026-12-02): ``+qc=<digest>`` for a ``--quantization-config`` (``--quantization online``
    names only the method; the config says what is quantized) and :func:`kv_length_flags`."""
    mc = vllm_config.model_config
    rev = namespace_revision(cfg, getattr(mc, "revision", None), quantization=getattr(mc, "quantization", None),
                             hf_overrides=getattr(mc, "hf_overrides", None))
    have = rev.split("+")[1:]
    qc = getattr(mc, "quantization_config", None)
    if qc is not None:
        blob = json.dumps(qc if isinstance(qc, dict) else vars(qc) if hasattr(qc, "__dict__") else str(qc),
                          sort_keys=True, default=str, separators=(",", ":")).encode()
        flag = f"qc={hashlib.sha256(blob).hexdigest()[:16]}"
        rev += "" if flag in have else "+" + flag
    for flag in kv_length_flags(mc):
        rev += "" if flag in have else "+" + flag
    return rev


def kv_length_flags(mc: Any) -> list[str]:
    """Choices vLLM 0.32 makes from ``--max-model-len`` that change the KV it caches, as revision suffixes: a
    LongRoPE model (Phi-3/3.5/4-mini 128k: ``rope_type`` ``longrope``) rotates K with its long factors when
    ``max_model_len`` > ``original_max_position_embeddings`` and its short ones otherwise
    (``rotary_embedding/phi3_long_rope_scaled_rope.py``): ``rope=long`` / ``rope=short``; Llama 4 tunes its
    attention temperature when the generation config says so, by default when ``max_model_len`` > 32768
    (``models/llama4.py``), which changes every later layer's KV: ``attn_t=on`` / ``attn_t=off``. Before
    2026-12-02 two such engines with other ``--max-model-len`` shared keys and loaded each other's KV."""
    flags = []
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    max_len = int(getattr(mc, "max_model_len", 0) or 0)
    for rp in (getattr(hf, "rope_parameters", None), getattr(hf, "rope_scaling", None)):
        if isinstance(rp, dict) and (rp.get("rope_type") or rp.get("type")) == "longrope":
            orig = rp.get("original_max_position_embeddings") or getattr(hf, "original_max_position_embeddings", 0)
            flags.append("rope=long" if max_len > int(orig or 0) else "rope=short")
            break
    if any("Llama4" in a for a in (getattr(getattr(mc, "hf_config", None), "architectures", None) or [])):
        gen: dict = {}
        try:
            gen = dict(mc.try_get_generation_config() or {})
        except Exception:  # noqa: BLE001 - no generation config: vLLM's default decides
            pass
        gen.update(getattr(mc, "override_generation_config", None) or {})
        flags.append("attn_t=on" if gen.get("attn_temperature_tuning", max_len > 32768) else "attn_t=off")
    return flags


def namespace_revision(cfg: KvbmBackendConfig, engine_rev: Any = None, *, quantization: Any = None,
                       hf_overrides: Any = None, override: str | None = None) -> str:
    """The namespace's ``revision``, for the connector and the native tiers alike: the weights revision
    (``override``: a native tier's ``revision`` key; else ``cfg.revision`` when the operator set it; else the
    engine's ``engine_rev``, vLLM's ``--revision``; else ``"main"``) plus ``+q=<method>`` for ``quantization``
    (``--quantization``) and ``+hf=<digest>`` for ``hf_overrides`` (``--hf-overrides``, e.g. rope scaling,
    applied to K before it is cached): KV of other weights, another quantization or other overrides is other
    KV. The suffixes follow an explicit revision too (one already in it is not added twice): before
    2026-12-01 a config's ``revision`` was used as it stood, and an fp8 and a bf16 engine whose configs both
    said ``revision: main`` shared blocks (review finding). ``"main"`` for an engine with none of them, so
    such an engine keeps its fingerprint. Native tiers pass neither ``quantization`` nor ``hf_overrides``:
    vLLM does not hand them to tiers (docs/configuration.md)."""
    if override:
        rev = str(override)
    elif "revision" in cfg.model_fields_set:
        rev = str(cfg.revision)
    else:
        rev = str(engine_rev or cfg.revision)
    have = rev.split("+")[1:]  # the suffixes an operator's revision already holds, whole ("+q=fp8", not "+q=fp8x")
    if quantization and f"q={quantization}" not in have:
        rev += f"+q={quantization}"
    if hf_overrides and not callable(hf_overrides):
        blob = json.dumps(hf_overrides, sort_keys=True, default=str, separators=(",", ":")).encode()
        hf = f"hf={hashlib.sha256(blob).hexdigest()[:16]}"
        rev += "" if hf in have else "+" + hf
    return rev


def group_g3_config(cfg: KvbmBackendConfig, ns: Namespace, group: int, sliding_weight: float = 0.25) -> KvbmBackendConfig:
    """The G3 config of KV cache group ``group`` of a hybrid namespace: a private pool in
    ``<path>/group<g>`` under every configured path, with a share of ``g3.capacity_gb`` weighted 1 for a
    full-attention (or MLA) group and ``sliding_weight`` for a sliding-window group (which stores only
    the window before each resume point). ``cfg`` unchanged for a one-group namespace."""
    if not ns.groups or not cfg.g3.enabled:
        return cfg
    w = [sliding_weight if g.kind == "sliding" else 1.0 for g in ns.groups]
    g3 = cfg.g3.model_copy(update={"paths": [os.path.join(p, f"group{group}") for p in cfg.g3.paths],
                                   "capacity_gb": cfg.g3.capacity_gb * w[group] / sum(w)})
    return cfg.model_copy(update={"g3": g3})


def rank_g3_config(cfg: KvbmBackendConfig, rank: int, tp_world_size: int) -> KvbmBackendConfig:
    """The G3 config of TP rank ``rank`` of ``tp_world_size``: each rank's worker process owns a private
    pool in ``<path>/tp<N>-rank<r>`` under every configured path, with ``capacity_gb / N`` of the
    configured capacity (``g3.capacity_gb`` is the node's budget for this engine, all ranks together).
    A rank stores and loads only its own slice of each block (its KV heads; DESIGN.md: one object per
    rank), so the ranks' pools never hold the same bytes."""
    if tp_world_size <= 1 or not cfg.g3.enabled:
        return cfg
    g3 = cfg.g3.model_copy(update={"paths": [os.path.join(p, f"tp{tp_world_size}-rank{rank}") for p in cfg.g3.paths],
                                   "capacity_gb": cfg.g3.capacity_gb / tp_world_size})
    return cfg.model_copy(update={"g3": g3})
