"""``KvbmBackendConnector``: vLLM ``KVConnectorBase_V1`` over the G3 and G4 pools.

Load it with::

    kv_transfer_config = {
        "kv_connector": "KvbmBackendConnector",
        "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",      # a failed load is recomputed, not an error
        "kv_connector_extra_config": {
            "kvbm_backend": {"model": "...", "g3": {"paths": ["/nvme/kvbm"]}, "g4": {...}},
            # or "config_file": "/etc/kvbm/backend.yaml"
        },
    }

``kv_connector_extra_config`` keys (anything else is a :class:`ConfigError` naming the key):

* ``kvbm_backend`` (dict or inline JSON string) or ``config_file`` (YAML/TOML/JSON path): the
  :class:`~kvbm_backend.config.KvbmBackendConfig` tree (environment overrides apply on top).
* ``stats_path``: write the connector counters (:mod:`.stats`) there as JSON.
* ``save`` / ``load`` (bool, default true): offload computed blocks / serve prefix hits.
* ``save_decode`` (bool, default true): also offload blocks filled by generated tokens (the next turn
  of a conversation then finds the previous answer's KV); false saves prompt blocks only.
* ``save_to_g4`` (bool, default true): write-through to G4 as well as G3.
* ``handoff_wait_s`` (seconds, default 5): disaggregated prefill/decode through the shared tiers
  (:mod:`.handoff`, ``examples/dynamo/disagg_*_g4.sh``): how long a decode request waits for the blocks its
  prefill worker said it offloaded before the engine computes what is missing.
* ``promote_to_g3`` (bool, default true): blocks loaded from G4 are also written into G3.
* ``max_pending_save_bytes`` (int bytes, default 1 GiB): host staging bound for offloads.

Roles: :class:`~.scheduler_side.SchedulerSide` (lookup G3 then G4, load/save plans) and
:class:`~.worker_side.WorkerSide` (gather/scatter, background I/O). With vLLM's ``uni`` executor
(worker inside the engine-core process) both open the pools through
:func:`kvbm_backend.integrations.tiers.shared_tiers` and share one pool object and one index. With
the ``mp`` executor (``vllm serve`` on CPU, for one) the worker owns G3 and the scheduler answers G3
lookups from a :class:`~.scheduler_side.G3Mirror` fed by the worker's reports
(:class:`~.metadata.KvbmWorkerMeta`); G4, shared storage by design, is opened by both. In that mode
the scheduler writes its counters to ``<stats_path stem>.scheduler<ext>`` and (rank 0's) worker merges
them into ``stats_path`` (:func:`.stats.merge_snapshots`), so ``stats_path`` holds both roles' counters.

Tensor parallelism (TP = N > 1): every rank's worker is its own process and stores and loads only its
slice of each block (its KV heads; one object per (block, rank) in G4) in a private G3 pool under
``<path>/tp<N>-rank<r>`` with ``capacity_gb / N`` (:func:`rank_g3_config`). The scheduler looks a
prefix up for every rank and takes the shortest (a block counts only when all ranks have their slice);
a rank's failed load is reported through ``get_block_ids_with_load_errors``, which vLLM unions over
ranks, so the block is recomputed on all of them. Rank r > 0 writes its counters to
``<stats_path stem>.rank<r><ext>``. MLA models (DeepSeek-V2/V3/R1: one latent per token, KVBM
``outer_dim`` 1) are carried; their latent is the same on every TP rank: each rank keeps its own copy
in its G3 pool, and G4 holds one object per block under rank 0's key
(:meth:`~kvbm_backend.model.namespace.Namespace.shared_rank`), written by rank 0 and read by all.

Hybrid models (vLLM's hybrid KV cache manager, several KV cache groups: gpt-oss's alternating
sliding-window/full attention, Gemma 2/3's sliding/full patterns, all-sliding models) are carried: the
connector implements ``SupportsHMA``, so vLLM keeps its hybrid manager on (it turns it off for
connectors that do not, and then keeps every layer for every token). Llama 4's chunked local attention
runs with vLLM's hybrid manager off by default (``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE``
unset): one full-attention group, carried like a dense model. Each group has its own namespace (the structure of all
groups plus the group's index and layout: :meth:`Namespace.for_group`), its own pools (G3 under
``<path>/group<g>``, capacity split by weight: full-attention groups 1, sliding-window groups
``sliding_capacity_weight``, default 0.25) and the same KVBM sequence hashes. Full-attention groups
store every block; sliding-window groups store and load only the ``ceil((window - 1) / block_size)``
blocks before a resume point (what vLLM's ``SlidingWindowManager`` reads; it null-blocks the rest). A
hit of ``n`` blocks counts only when every group has what the engine reads at ``n``. Refused, with the
reason: KV cache specs other than full attention, sliding window and MLA (Mamba/linear attention state,
chunked local attention (Llama 4), cross-attention, sink/ring specs) and groups with different block
sizes. With several groups a failed load is reported per request (vLLM 0.32 cannot map block-level
errors back to requests then) and the request is recomputed whole; G3 KV events are not published for
hybrid models.

KV dtypes: bf16, fp16, fp32 and FP8 (``--kv-cache-dtype fp8``: e4m3 / e5m2); the dtype is part of the
namespace, so an engine never loads blocks of another KV dtype.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...config import KvbmBackendConfig
from ...model.namespace import KvGroup, Namespace
from ..tiers import release_tiers, shared_tiers
from . import layerwise, report_channel, start_failure, stats
from .extra_config import EXTRA_KEYS, config_from_extra  # noqa: F401 - re-exported
from .geometry import EngineGeometry, total_kv_heads
from .kv_io import EngineKv
from .metadata import KvbmConnectorMetadata, KvbmWorkerMeta
from .kv_events import IdlePublisher, caller_publisher
from .scheduler_side import G3KvEvents, G3Mirror, GroupTiers, SchedulerSide
from .worker_side import GroupedWorkers, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvbm_backend.connector")

def _group_of(spec: Any, geo: EngineGeometry) -> KvGroup:
    """A :class:`KvGroup` from one vLLM KV cache group's spec and its geometry. Raises ValueError naming the
    spec for kinds the connector cannot carry."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
    kind = {FullAttentionSpec: "full", MLAAttentionSpec: "mla", SlidingWindowSpec: "sliding"}.get(type(spec))
    if kind is None:
        raise ValueError(f"kv cache spec {type(spec).__name__}: KvbmBackendConnector carries full attention, "
                         "sliding-window attention and MLA groups only (state/linear-attention, chunked local, "
                         "cross-attention and sink/ring caches are not KV blocks of a token prefix)")
    return KvGroup(kind=kind if not geo.mla else "mla", layout=geo.kv_layout,
                   sliding_window=int(spec.sliding_window) if kind == "sliding" else None)


def _kv_groups(kv_cache_config: "KVCacheConfig") -> list:
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
            for g in _kv_groups(kv_cache_config)]


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
    specs, an MLA spec with more than one KV head, groups with different block sizes).
    ``geometries``: :func:`engine_geometries` when the caller has them already."""
    groups = _kv_groups(kv_cache_config)
    if not groups:
        raise ValueError("kv cache: no KV cache groups (attention-free model); nothing to carry")
    if geometries is None:
        geometries = engine_geometries(vllm_config, kv_cache_config)
    kgs = [_group_of(g.kv_cache_spec, geo) for g, geo in zip(groups, geometries)]
    sizes = {k.layout.page_size for k in kgs}
    if len(sizes) != 1:
        raise ValueError(f"kv cache: KV cache groups with block sizes {sorted(sizes)}; KvbmBackendConnector "
                         "needs one block size (a block's sequence hash covers block_size tokens)")
    model = cfg.model
    if model == "unknown":
        names = vllm_config.model_config.served_model_name
        model = names[0] if isinstance(names, (list, tuple)) else (names or vllm_config.model_config.model)
    revision = cfg.revision
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if len(kgs) == 1 and kgs[0].kind != "sliding":
        return Namespace(model=str(model), layout=kgs[0].layout, revision=revision, tp_world_size=tp)
    # several groups, or one sliding-window group (every layer windowed, e.g. Mistral-7B-v0.1: vLLM
    # null-blocks what the window left behind, so blocks are stored window-bounded as in a hybrid model)
    return Namespace(model=str(model), layout=kgs[0].layout, revision=revision, tp_world_size=tp,
                     groups=tuple(kgs), group=0)


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


class KvbmBackendConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector serving prefix hits from G3/G4 and offloading computed blocks to them
    (``SupportsHMA``: hybrid models keep vLLM's hybrid KV cache manager; see the module doc)."""

    _cache_hit_source = CacheHitSource.DISK
    layerwise: layerwise.LayerwiseLoads | None = None  # g3.layerwise_load (worker role, one KV cache group)

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        with start_failure.started_or_exit(lambda: start_failure.release_partial(self)):  # issue 22 item 3
            self._start(vllm_config, role, kv_cache_config)

    def _start(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg, self.opts = config_from_extra(extra)
        # the KV geometry of every KV cache group, derived once from vLLM's KV cache config
        self.geometries = engine_geometries(vllm_config, kv_cache_config)
        self.ns = namespace_from_vllm(self.cfg, vllm_config, kv_cache_config, self.geometries)
        self.rank = 0
        if self.ns.tp_world_size > 1 and role != KVConnectorRole.SCHEDULER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.rank = int(get_tensor_model_parallel_rank())
        self.block_size = self.ns.layout.page_size
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvbm_backend: kv_load_failure_policy=%r; set 'recompute' so that a failed or corrupt "
                        "load is recomputed instead of failing the request",
                        self._kv_transfer_config.kv_load_failure_policy)
        # vLLM's "uni" executor runs the worker inside the engine-core (scheduler) process: both roles
        # share one pool object. Otherwise ("mp", e.g. `vllm serve` on CPU, or ray) the worker owns the
        # process-private G3 directory and the scheduler mirrors its index from worker reports.
        # With TP > 1 every rank's worker is its own process with its own G3 pool (rank_g3_config).
        backend = vllm_config.parallel_config.distributed_executor_backend
        self.split = backend not in (None, "uni", "external_launcher") or self.ns.tp_world_size > 1
        # vLLM publishes KV events (--kv-events-config enable_kv_cache_events): G3's contents go with them
        # (G3KvEvents), so the worker reports its G3 index changes even when it shares the scheduler's pool
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self.kv_events = bool(kv_events is not None and kv_events.enable_kv_cache_events and self.cfg.g3.enabled)
        self.hybrid = bool(self.ns.groups)
        if self.kv_events and self.hybrid:
            log.warning("kvbm_backend: G3 KV events are not published for hybrid models (%d KV cache groups)",
                        len(self.ns.groups))
            self.kv_events = False
        self._tier_cfg = self.cfg
        if self.split and role == KVConnectorRole.SCHEDULER and self.cfg.g3.enabled:
            self._tier_cfg = self.cfg.model_copy(update={"g3": self.cfg.g3.model_copy(update={"enabled": False})})
        elif self.ns.tp_world_size > 1:
            self._tier_cfg = rank_g3_config(self.cfg, self.rank, self.ns.tp_world_size)
        # one (namespace, config, g3, g4) per KV cache group (one entry for a non-hybrid model)
        self._groups: list[tuple[Namespace, KvbmBackendConfig, Any, Any]] = []
        for gi in range(max(1, len(self.ns.groups))):
            gns = self.ns.for_group(gi)
            gcfg = group_g3_config(self._tier_cfg, self.ns, gi, self.opts["sliding_capacity_weight"])
            g3, g4 = shared_tiers(gcfg, gns, total_kv_heads(vllm_config))
            if self.split and role == KVConnectorRole.SCHEDULER and self.cfg.g3.enabled:
                g3 = G3Mirror(gns)
            self._groups.append((gns, gcfg, g3, g4))
        self.g3, self.g4 = self._groups[0][2], self._groups[0][3]
        stats_path = merge = self.opts["stats_path"]
        if stats_path:
            root, ext = os.path.splitext(stats_path)
            merge = f"{root}.scheduler{ext}" if self.split else None  # rank 0's worker merges it into stats_path
        if stats_path and self.split and role == KVConnectorRole.SCHEDULER:
            stats_path, merge = merge, None
        elif stats_path and self.rank > 0:
            stats_path, merge = f"{root}.rank{self.rank}{ext}", None
        self._writer = stats.StatsWriter(stats_path, extra=self._pool_stats, merge=merge)
        self.sched: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = None
            if self.hybrid:
                groups = [GroupTiers(gns, g3, g4, gns.groups[gi].window_blocks)
                          for gi, (gns, _, g3, g4) in enumerate(self._groups)]
            self.sched = SchedulerSide(self.ns, self.block_size, self.g3, self.g4, default_tenant=self.cfg.tenant,
                                       lookup_timeout_s=max(self.cfg.g4.timeout_s, 0.5),
                                       save=self.opts["save"], load=self.opts["load"],
                                       save_decode=self.opts["save_decode"], groups=groups,
                                       handoff_wait_s=self.opts["handoff_wait_s"],
                                       layerwise=self.cfg.g3.layerwise_load)
            if self.kv_events:
                self.sched.events = G3KvEvents(self.ns.tp_world_size, self.block_size,
                                               kv_cache_config.kv_cache_groups[0].kv_cache_spec)
                self.sched.idle_events = IdlePublisher(self.sched.events)
            if (self.split and self.cfg.g3.enabled) or self.kv_events:
                self._listener = report_channel.ReportListener(self._channel_key(vllm_config), self._on_g3_report)
        else:
            ws = [WorkerSide(gns, self.rank, g3, g4,
                             load_timeout_s=self.cfg.g3.load_timeout_s + self.cfg.g4.timeout_s,
                             promote_to_g3=self.opts["promote_to_g3"], save_to_g4=self.opts["save_to_g4"],
                             max_pending_save_bytes=self.opts["max_pending_save_bytes"],
                             report_g3=self.split or self.kv_events, device_checksum=self.cfg.g3.device_checksum)
                  for gns, _, g3, g4 in self._groups]
            self.worker = GroupedWorkers(ws) if self.hybrid else ws[0]
        self._interval, self._closed, self._channel_decided = stats.Interval(), False, False
        log.info("kvbm_backend connector (%s): namespace %s %s, G3=%s G4=%s, G3 KV events=%s", role.name,
                 self.ns.fingerprint, json.dumps(self.ns.to_dict()), self.g3 is not None, self.g4 is not None,
                 self.kv_events)

    def _channel_key(self, vllm_config: "VllmConfig") -> str:
        dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        return report_channel.channel_key(str(self._kv_transfer_config.engine_id), dp, self.ns.fingerprint)

    def _on_g3_report(self, group: int, rank: int, added: list, removed: list, snapshot: bool) -> None:
        self.sched.apply_g3_report(group, KvbmWorkerMeta(added, removed, snapshot), rank=rank)
        stats.add(g3_reports_by_channel=1)

    def _start_report_channel(self) -> None:
        """At the worker's first report (:func:`.report_channel.start_worker_reports`)."""
        self._channel_decided = True
        ws = self.worker.workers if isinstance(self.worker, GroupedWorkers) else [self.worker]
        self._pump = report_channel.start_worker_reports(self._channel_key(self._vllm_config), ws, self.rank)

    def _pool_stats(self) -> dict:
        out = {}
        for gi, (_, _, g3, g4) in enumerate(self._groups):
            for name, p in (("g3", g3), ("g4", g4)):
                if p is not None:
                    out[name if gi == 0 else f"{name}_group{gi}"] = p.stats()
        return out

    # ---- worker role ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each KV cache group's per-layer tensors (:class:`EngineKv`; hybrid models: one per group,
        in vLLM's group order). Raises ValueError when a group's layer is missing or its tensors do not
        match the namespace layout."""
        assert self.worker is not None
        kvs = []
        for g, geo in zip(_kv_groups(self._kv_cache_config), self.geometries):
            names = list(g.layer_names)
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise ValueError(f"kv caches: layers {missing[:3]} of the KV cache group were not registered")
            t0 = kv_caches[names[0]]
            log.info("kvbm_backend: KV cache tensor per layer: shape %s stride %s dtype %s device %s",
                     tuple(t0.shape), t0.stride(), t0.dtype, t0.device)
            kvs.append(EngineKv.from_geometry([kv_caches[n] for n in names], geo,
                                              num_blocks=int(self._kv_cache_config.num_blocks)))
        if self.hybrid:
            self.worker.register(kvs)
        else:
            self.worker.register(kvs[0])
            self.layerwise = layerwise.for_worker(self.cfg, self.worker, names)  # one group: its layer names
        kv = kvs[0]
        stats.set_info(kv_cache_shape=list(t0.shape), kv_cache_dtype=str(t0.dtype), kv_cache_device=str(t0.device),
                       engine_layout=kv.engine_layout, bytes_per_block=kv.layout.bytes_per_block,
                       namespace=self.ns.fingerprint, namespace_dtype=self.ns.layout.dtype,
                       num_layers=kv.layout.num_layers)
        if self.hybrid:
            stats.set_info(kv_cache_groups=[
                {"kind": g.kind, "sliding_window": g.sliding_window, "window_blocks": g.window_blocks,
                 "num_layers": k.layout.num_layers, "bytes_per_block": k.layout.bytes_per_block,
                 "namespace": gns.fingerprint}
                for g, k, (gns, _, _, _) in zip(self.ns.groups, kvs, self._groups)])

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvbmConnectorMetadata) and meta.loads:
            self.worker.start_loads(self.layerwise.start(meta.loads) if self.layerwise else meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.layerwise is not None:  # else loads are asynchronous (whole requests, between steps)
            self.layerwise.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are gathered once per step in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        saves = meta.saves if isinstance(meta, KvbmConnectorMetadata) else []
        if saves or self.layerwise is not None:  # the step's layer-wise loads end (verified) before its saves
            self.worker.save(self.layerwise.saves(saves) if self.layerwise is not None else saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.hybrid:
            return None, (self.get_transfer_results(finished_req_ids).finished_recving or None)
        recv = self.worker.get_finished() if self.worker is not None else set()
        self._writer.maybe_write()
        return None, (recv or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads. Hybrid models: a request with any failed block in any group is also in
        ``failed_recving`` (vLLM 0.32 refuses block-level errors with several KV cache groups and
        recomputes such a request from its first token); otherwise as ``get_finished``."""
        if not self.hybrid:
            return super().get_transfer_results(finished_req_ids)
        done, failed = self.worker.take_finished() if self.worker is not None else (set(), set())
        self._writer.maybe_write()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_kv_connector_stats(self) -> stats.KvbmConnectorStats | None:
        """Worker counters since the last call (vLLM aggregates them across workers and logs them as
        "KV Transfer metrics" every logging interval); None when nothing happened."""
        if self.worker is None:
            return None
        d = self._interval.delta()
        return stats.KvbmConnectorStats(data=d) if d else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> stats.KvbmConnectorStats | None:
        return stats.KvbmConnectorStats(data=dict(data)) if data is not None else stats.KvbmConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> stats.KvbmPromMetrics:
        """Prometheus counters for the stats of :meth:`get_kv_connector_stats` (``vllm:kvbm_backend_*``)."""
        return stats.KvbmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.hybrid or self.worker is None:
            return set()  # hybrid: failures go to failed_recving (get_transfer_results)
        if self.layerwise is not None:
            self.layerwise.finish()  # wait_for_save may come later (vLLM's defer_finalize)
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.shutdown()
        if self.layerwise is not None:
            self.layerwise.close()
        if getattr(self, "_pump", None) is not None:
            self._pump.stop()
        if getattr(self, "_listener", None) is not None:
            self._listener.close()
        if self.sched is not None and self.sched.idle_events is not None:
            self.sched.idle_events.stop()
        for _, _, g3, g4 in self._groups:
            for p in (g3, g4):
                if p is not None and not p.flush(timeout=10.0):
                    log.warning("kvbm_backend: %s offloads still pending after 10 s at shutdown; close() drops "
                                "what it cannot write (counted)", p.tier)
        self._writer.maybe_write(force=True)
        self._writer.stop()
        for gns, gcfg, _, _ in self._groups:
            release_tiers(gcfg, gns)

    # ---- scheduler role -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        if num_external_tokens == 0:
            return {}
        return {CacheHitSource.DISK: num_external_tokens}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def build_connector_worker_meta(self):
        if self.worker is None:
            return None
        if not self._channel_decided:
            self._start_report_channel()
        return self.worker.worker_meta()

    def update_connector_output(self, connector_output) -> None:
        if self.sched is not None:
            self.sched.update_connector_output(getattr(connector_output, "kv_connector_worker_meta", None))
            failed = getattr(connector_output, "failed_recving", None)
            if failed:
                self.sched.load_failed(failed)
        self._writer.maybe_write()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request finished in every KV cache group. Saves were gathered in the
        steps that computed them, so no block has to outlive the request: ``(False, None)``."""
        return self.sched.request_finished(request, list(block_ids[0]) if block_ids else [])

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._gpu_block_pool = gpu_block_pool
        self._gpu_cache_map = id(getattr(gpu_block_pool, "cached_block_hash_to_block", None))

    def take_events(self):
        """G3 stored/removed blocks as vLLM KV events (``medium="DISK"``; :class:`~.scheduler_side.G3KvEvents`),
        published by vLLM's scheduler with the engine's own when ``--kv-events-config`` enables them. After a
        reset of the engine's prefix cache (vLLM's ``BlockPool.reset_prefix_cache`` replaces its hash map and
        publishes ``AllBlocksCleared``, which Dynamo's router applies to every tier of the worker) G3's blocks
        are published again."""
        if self.sched is None:
            return ()
        idle = self.sched.idle_events
        if idle is not None and idle._publisher is None:
            # vLLM's scheduler calls us from its step (vLLM 0.32: Scheduler.update_from_output); its publisher
            # lets G3 events leave while the engine does not step (kv_events.IdlePublisher)
            idle.capture(caller_publisher(sys._getframe(1)))
        reset = False
        pool = getattr(self, "_gpu_block_pool", None)
        if pool is not None:
            m = id(getattr(pool, "cached_block_hash_to_block", None))
            reset, self._gpu_cache_map = m != self._gpu_cache_map, m
        return self.sched.take_events(engine_cache_reset=reset)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def __del__(self) -> None:  # best effort: vLLM does not always call shutdown() on exit
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass
