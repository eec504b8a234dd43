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
* ``save_to_g4`` (bool, default true): write-through to G4 as well as G3. A prefill worker's handoff promises
  blocks only with it (and G4) on: G3 is private to one worker.
* ``handoff_wait_s`` (seconds in [0, 600], default 5): disaggregated prefill/decode through G4
  (:mod:`.handoff`, ``examples/dynamo/disagg_*_g4.sh``): how long a decode request waits for the blocks its
  prefill worker said it offloaded before the engine computes what is missing (no wait when the handoff names
  another G4 namespace or tenant, none while G4's circuit breaker is open or its keyring serves no key of the
  tenant: :class:`.handoff.HandoffWaits`).
* ``promote_to_g3`` (bool, default true): blocks loaded from G4 are also written into G3.
* ``max_pending_save_bytes`` (int bytes, default 1 GiB): host staging bound for offloads (a save's leading
  blocks that fit are staged, the rest dropped and counted: ``save_dropped_blocks``).
* ``reset_tiers`` (bool, default false): what vLLM's reset of the connector's cache does (:meth:`reset_cache`).
  False: G3/G4 keep their blocks and keep serving them, as vLLM keeps its persistent secondary tiers across a
  reset (Dynamo's ``clear_kv_blocks``, sleep and wake reset the connector too). True: this engine is served none of
  the blocks stored before (a new reset epoch, :mod:`.reset_epoch`): for in-place weight updates.

How it is put together (roles, executors, TP ranks, KV cache groups, stats files): :mod:`.wiring`, which
builds every part once from vLLM's configs; this class only delegates vLLM's hooks to those parts. Every
model runs one path: a dense model is one KV cache group (:class:`~.workers.GroupedWorkers`,
:class:`~.lookup.PrefixLookup`).

Hybrid models (vLLM's hybrid KV cache manager: gpt-oss, Gemma 2/3, all-sliding models) are carried: the
connector implements ``SupportsHMA``, so vLLM keeps its hybrid manager on. Full-attention groups store every
block; sliding-window groups store and load only the ``ceil((window - 1 + retained) / block_size)`` blocks
before a resume point (``retained``: speculative decoding's extra tokens, :func:`.namespaces.group_window_blocks`). A hit of ``n`` blocks counts only when every group has what the engine reads at ``n``. A
failed load is reported per block for one full-attention group and per request otherwise (vLLM 0.32 cannot
map block-level errors back to requests with several groups; the request is recomputed whole); G3 KV events
are not published for hybrid models. Refused with the reason: KV specs that are not attention KV of a token
prefix, groups of different block sizes (:mod:`.namespaces`). Llama 4's chunked local attention runs with
vLLM's hybrid manager off by default: one full-attention group.

vLLM's ``reset_prefix_cache(reset_connector=True)`` (an in-place weight update's cache reset) makes this engine
serve none of the blocks stored before, deleting nothing: :meth:`KvbmBackendConnector.reset_cache`, :mod:`.reset_epoch`.

KV dtypes: bf16, fp16, fp32 and FP8 (``--kv-cache-dtype fp8``: e4m3 / e5m2); the dtype is part of the
namespace, so an engine never loads blocks of another KV dtype.
"""
from __future__ import annotations

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

from . import reset_epoch, start_failure, stats
from .extra_config import EXTRA_KEYS, config_from_extra  # noqa: F401 - re-exported
from .kv_events import caller_publisher
from .metadata import KvbmConnectorMetadata
from .namespaces import (  # noqa: F401 - re-exported
    engine_geometries,
    group_g3_config,
    namespace_from_vllm,
    rank_g3_config,
)
from .wiring import ConnectorParts, wire

__all__ = ["EXTRA_KEYS", "KvbmBackendConnector", "config_from_extra", "engine_geometries", "group_g3_config",
           "namespace_from_vllm", "rank_g3_config"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KvbmBackendConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector serving prefix hits from G3/G4 and offloading computed blocks to them
    (``SupportsHMA``: hybrid models keep vLLM's hybrid KV cache manager; see the module doc).

    Raises (at construction): ConfigError for a bad ``kv_connector_extra_config`` (naming the key), ValueError
    for a KV cache it cannot carry, TypeError for a worker G3 pool without ``G3Extensions`` (:func:`.wiring.wire`).
    """

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        self.parts = ConnectorParts()
        with start_failure.started_or_exit(self.parts.release_partial):  # issue 22 item 3
            wire(self.parts, self._kv_transfer_config, vllm_config, role, kv_cache_config)
        self.sched, self.worker = self.parts.sched, self.parts.worker
        self.cfg, self.ns = self.parts.cfg, self.parts.ns

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM asks at config time (``VllmConfig.__post_init__``, before any connector is built) whether FULL CUDA
        graphs must be lowered to PIECEWISE: True when the config ``extra_config`` gives
        (:func:`.extra_config.config_from_extra`) has G3 and ``g3.layerwise_load`` on and loads (``load`` not false),
        as LMCache answers for its ``use_layerwise``. vLLM asks before it knows the TP size or async scheduling, under
        which layer-wise loads do not run either (:func:`.layerwise.usable`): there ``g3.layerwise_load`` costs the
        FULL graphs for nothing, so leave it off. A replayed FULL graph calls no ``wait_for_layer_load``, so every layer-wise load in a
        FULL-graph batch would fail and recompute (:mod:`.layerwise`). A config that does not load answers False
        (the connector's constructor then raises naming the field)."""
        try:
            cfg, opts = config_from_extra(extra_config)
        except Exception:  # noqa: BLE001 - reported by the constructor, naming the field
            return False
        return bool(cfg.g3.enabled and cfg.g3.layerwise_load and opts["load"])

    # ---- worker role ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each KV cache group's per-layer tensors (in vLLM's group order). Raises ValueError when a
        group's layer is missing or its tensors do not match the namespace layout."""
        self.parts.register_kv_caches(kv_caches, self._kv_cache_config)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KvbmConnectorMetadata) and meta.reinvalidate:
            self.parts.worker_role().reinvalidate(meta.reinvalidate)
        if isinstance(meta, KvbmConnectorMetadata) and meta.loads:
            self.parts.worker_role().start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.parts.worker_role().wait_layer(layer_name)  # returns at once unless layer-wise loads run (g3.layerwise_load)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are gathered once per step in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata  # the step's layer-wise loads end (verified) before its saves
        self.parts.worker_role().save(meta.saves if isinstance(meta, KvbmConnectorMetadata) else [])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, (self.get_transfer_results(finished_req_ids).finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads; ``failed_recving``: requests with a failed block when vLLM cannot take block ids
        (several or windowed KV cache groups: recomputed from their first token)."""
        done, failed = self.parts.take_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.parts.load_errors()  # every TP rank's under external_launcher (tp_agree)

    def get_kv_connector_stats(self) -> stats.KvbmConnectorStats | None:
        """This role's counters since the last call (vLLM aggregates the workers' and the scheduler's and logs them
        as "KV Transfer metrics" every logging interval): the worker's transfers, the scheduler's failed-load blocks
        counted once over every TP rank (:mod:`.load_failures`); None when nothing happened."""
        return self.parts.interval_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> stats.KvbmConnectorStats | None:
        return stats.KvbmConnectorStats(data=dict(data)) if data is not None else stats.KvbmConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> stats.KvbmPromMetrics:
        """Prometheus counters for the stats of :meth:`get_kv_connector_stats` (``vllm:kvbm_backend_*``)."""
        return stats.KvbmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self.parts.close()

    # ---- scheduler role -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.parts.get_num_new_matched_tokens(request, num_computed_tokens)  # agreed by the TP ranks (SPMD)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        return {CacheHitSource.DISK: num_external_tokens} if num_external_tokens else {}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.parts.scheduler_role().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.parts.build_connector_meta(scheduler_output)

    def build_connector_worker_meta(self):
        return self.parts.worker_meta(self._connector_metadata)

    def update_connector_output(self, connector_output) -> None:
        self.parts.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.parts.scheduler_role().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request finished in every KV cache group. Saves were gathered in the
        steps that computed them, so no block has to outlive the request: ``(False, None)``."""
        return self.parts.scheduler_role().request_finished(request, list(block_ids[0]) if block_ids else [])

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._gpu_block_pool = gpu_block_pool
        # the map itself, not its id(): two resets between steps free the first new map, and the second's often
        # takes its address (review 2026-12-02: 18 of 20 double resets went unseen by id(), nothing republished)
        self._gpu_cache_map = getattr(gpu_block_pool, "cached_block_hash_to_block", None)
        if self.sched is not None:  # a failed layer-wise load's blocks leave vLLM's prefix cache (loads_failed)
            self.sched.evict_engine_blocks = lambda ids: gpu_block_pool.evict_blocks(set(ids))

    def take_events(self):
        """G3 stored/removed blocks as vLLM KV events (``medium="DISK"``; :class:`~.kv_events.G3KvEvents`),
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
            m = getattr(pool, "cached_block_hash_to_block", None)
            reset, self._gpu_cache_map = m is not self._gpu_cache_map, m
        return self.sched.take_events(engine_cache_reset=reset)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (``POST /reset_prefix_cache?reset_external=true``,
        ``pause_generation(clear_cache=True)``, sleep, and Dynamo 1.6.1's ``clear_kv_blocks``). With the option
        ``reset_tiers`` false (default) G3/G4 keep serving what they hold, as vLLM's own persistent tiers do (logged,
        counted ``connector_cache_resets_kept``). With it true, from now on this engine is served none of the blocks
        stored before, in G3 or G4, and nothing is deleted (other workers keep using the shared G4 blocks; old G3
        blocks age out by eviction): a new random reset epoch is folded into every later request's block identity
        (:mod:`.reset_epoch`); requests already in the engine are no longer loaded or saved; G3 blocks published as
        KV events are withdrawn. Returns True (done, nothing can fail), None in the worker role (vLLM asks the
        scheduler's connector only)."""
        if self.sched is None:
            return None
        if not self.parts.opts.get("reset_tiers"):
            reset_epoch.kept()
            return True
        pool = getattr(self, "_gpu_block_pool", None)  # vLLM's reset replaced the map: AllBlocksCleared goes out
        cleared = pool is not None and getattr(pool, "cached_block_hash_to_block", None) is not self._gpu_cache_map
        reset_epoch.reset(self.sched, engine_cleared=cleared)
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def __del__(self) -> None:  # best effort: vLLM does not always call shutdown() on exit
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass
