"""The connector's wiring: from vLLM's configs to its parts (:func:`wire` fills a :class:`ConnectorParts`).

Roles: :class:`~.scheduler_side.SchedulerSide` (lookup G3 then G4, load/save plans) and
:class:`~.workers.GroupedWorkers` (one :class:`~.worker_side.WorkerSide` per KV cache group: gather/scatter,
background I/O). Every model runs the same path; a dense model is one KV cache group. With vLLM's ``uni``
executor (worker inside the engine-core process) both roles open the pools through
:func:`kvbm_backend.integrations.tiers.shared_tiers` and share one pool object and one index. With the ``mp``
executor (``vllm serve`` on CPU, for one) or TP > 1 the worker owns G3 and the scheduler answers G3 lookups
from a :class:`~.g3_mirror.G3Mirror` fed by the worker's reports (:mod:`.report_channel`, else
:class:`~.metadata.KvbmWorkerMeta` in the step output); G4, shared storage by design, is opened by both. In
that mode the scheduler writes its counters to ``<stats_path stem>.scheduler<ext>`` and (rank 0's) worker
merges them into ``stats_path`` (:func:`.stats.merge_snapshots`); rank r > 0 writes
``<stats_path stem>.rank<r><ext>``; with vLLM data parallelism DP engine d > 0 adds ``.dp<d>`` to the stem. With ``external_launcher`` and TP > 1 (each process hosts the scheduler and one
rank's worker) rank r's worker file holds both roles' counters of its process and the scheduler writes none, and
each process's engine sees only its own worker's reports: every rank's scheduler gathers all ranks' G3 reports
over vLLM's TP group at each step (:class:`~.report_channel.TpReportExchange`), so all ranks' mirrors agree; the
ranks' load results and the tokens to load per request are agreed over it too (:mod:`.tp_agree`), and the
schedulers' save plans and lookup counts (:mod:`.tp_sched`).

TP = N > 1: every rank stores and loads only its slice of each block (its KV heads; one object per
(block, rank) in G4) in its own G3 pool (:func:`.namespaces.rank_g3_config`); the scheduler looks a prefix
up for every rank and takes the shortest. MLA latents are the same on every rank: each rank keeps its copy in
G3, G4 holds one under rank 0's key (:meth:`~kvbm_backend.model.namespace.Namespace.shared_rank`).

Decided once here, per model: how failed loads reach vLLM (block ids for one full-attention group, failed
requests otherwise: :func:`.workers.block_level_errors`), layer-wise G3 loads (``g3.layerwise_load``, the
block-id case only) and G3 KV events (``--kv-events-config``; not for hybrid models). Each worker-side G3
pool must satisfy :class:`~kvbm_backend.pool.base.G3Extensions` (checked by :class:`~.worker_side.WorkerSide`).
"""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from ...config import KvbmBackendConfig
from ...model.namespace import Namespace
from ..revoked_tenants import RevokedTenants, keyring_of
from ..tiers import release_tiers, shared_tiers
from . import layerwise, report_channel, start_failure, stats, tp_agree
from .cached_context import cached_context_problem
from .extra_config import config_from_extra
from .g3_mirror import G3Mirror
from .geometry import EngineGeometry, total_kv_heads
from .g4_announce import G4Announcer
from .kv_events import G3KvEvents, IdlePublisher
from .kv_io import EngineKv
from .metadata import KvbmConnectorMetadata, KvbmWorkerMeta
from .namespaces import (check_kv_version, engine_geometries, group_g3_config, group_window_blocks, kv_groups,
                         namespace_from_vllm, rank_g3_config)
from .scheduler_side import GroupTiers, SchedulerSide
from .worker_side import WorkerSide
from .workers import GroupedWorkers, block_level_errors

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvbm_backend.connector")


class TierGroup(NamedTuple):
    """One KV cache group's namespace, (per group and rank) config and pools as this role opened them."""

    ns: Namespace
    cfg: KvbmBackendConfig
    g3: Any
    g4: Any


class ConnectorParts:
    """What one connector (one role) is made of; :func:`wire` fills it in steps, so a failed start releases
    what was taken (:meth:`release_partial`). ``sched`` is set for the scheduler role, ``worker`` otherwise."""

    cfg: KvbmBackendConfig          # set by wire(), in this order
    opts: dict                      # the connector's own options (extra_config.config_from_extra)
    geometries: list[EngineGeometry]
    ns: Namespace                   # the engine's namespace (group 0's blocks; every group's structure)
    window_blocks: list[int | None]  # per group: blocks before a resume point (namespaces.group_window_blocks)

    def __init__(self) -> None:
        self._groups: list[TierGroup] = []
        self._listener: report_channel.ReportListener | None = None
        self.announcer: G4Announcer | None = None  # g4.announce (scheduler role)
        self._writer: stats.StatsWriter | None = None
        self._pump: Any = None
        self.sched: SchedulerSide | None = None
        self.worker: GroupedWorkers | None = None
        self.channel_key = ""  # the scheduler's listener key (report_channel.channel_key, with its token)
        self.channel_base: tuple[str, int, str] = ("", 0, "")  # engine id, DP rank, namespace: the key's inputs
        self.channel_token = ""  # the scheduler's token, sent to the workers in every step's metadata
        self.rank = 0
        self.revoked: RevokedTenants | None = None  # the tenants G3 refuses (with G3 and a G4 keyring)
        self.exchange: report_channel.TpReportExchange | None = None  # external_launcher, TP > 1 (scheduler role)
        self.agree: tp_agree.TpLoadAgree | None = None  # external_launcher, TP > 1 (worker role): load results
        self.match_agree: tp_agree.TpMatchAgree | None = None  # external_launcher, TP > 1 (scheduler role)
        self._interval, self._closed, self._channel_decided = stats.Interval(), False, False

    def release_partial(self) -> None:
        start_failure.release_partial(self)

    def worker_role(self) -> GroupedWorkers:
        """The worker role's parts. Raises RuntimeError on the scheduler role's connector."""
        if self.worker is None:
            raise RuntimeError("kvbm_backend: a worker-role call on the scheduler role's connector")
        return self.worker

    def scheduler_role(self) -> SchedulerSide:
        """The scheduler role's parts. Raises RuntimeError on a worker role's connector."""
        if self.sched is None:
            raise RuntimeError("kvbm_backend: a scheduler-role call on a worker role's connector")
        return self.sched

    # ---- worker role ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, kv_cache_config: "KVCacheConfig") -> None:
        """Wrap each KV cache group's per-layer tensors (:class:`EngineKv`, in vLLM's group order). Raises
        ValueError when a group's layer is missing or its tensors do not match the group's layout."""
        kvs, names = [], []
        for g, geo in zip(kv_groups(kv_cache_config), self.geometries):
            gnames = list(g.layer_names)
            missing = [n for n in gnames if n not in kv_caches]
            if missing:
                raise ValueError(f"kv caches: layers {missing[:3]} of the KV cache group were not registered")
            t0 = kv_caches[gnames[0]]
            log.info("kvbm_backend: KV cache tensor per layer: shape %s stride %s dtype %s device %s",
                     tuple(t0.shape), t0.stride(), t0.dtype, t0.device)
            kvs.append(EngineKv.from_geometry([kv_caches[n] for n in gnames], geo,
                                              num_blocks=int(kv_cache_config.num_blocks)))
            check_kv_version(self.ns, kvs[-1].engine_layout)
            names.append(gnames)
        self.worker_role().register(kvs, names)
        t0, kv = kv_caches[names[0][0]], kvs[0]
        stats.set_info(kv_cache_shape=list(t0.shape), kv_cache_dtype=str(t0.dtype), kv_cache_device=str(t0.device),
                       engine_layout=kv.engine_layout, bytes_per_block=kv.layout.bytes_per_block,
                       namespace=self.ns.fingerprint, namespace_dtype=self.ns.layout.dtype,
                       num_layers=kv.layout.num_layers)
        if self.ns.groups:
            stats.set_info(kv_cache_groups=[
                {"kind": g.kind, "sliding_window": g.sliding_window, "window_blocks": wb,
                 "num_layers": k.layout.num_layers, "bytes_per_block": k.layout.bytes_per_block,
                 "namespace": tg.ns.fingerprint}
                for g, k, tg, wb in zip(self.ns.groups, kvs, self._groups, self.window_blocks)])

    def take_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` of the worker role (empty for the scheduler); under
        ``external_launcher`` with TP > 1 agreed by every TP rank (:class:`~.tp_agree.TpLoadAgree`, with the failed
        blocks and loads: :meth:`load_errors`, :meth:`worker_meta`). Raises RuntimeError when that exchange fails."""
        out = self.worker.take_finished() if self.worker is not None else (set(), set())
        if self.agree is not None and self.worker is not None:
            loads = [(gi, f) for gi, w in enumerate(self.worker.workers) for f in w.take_failed_loads()]
            out = self.agree.agree(*out, self.worker.load_errors(), loads)
        assert self._writer is not None  # set by wire()
        self._writer.maybe_write()
        return out

    def load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: engine block ids whose load failed (every TP rank's under
        ``external_launcher`` with TP > 1, taken by :meth:`take_finished`); empty for the scheduler role."""
        if self.agree is not None:
            return self.agree.take_errors()
        return self.worker.load_errors() if self.worker is not None else set()

    def worker_meta(self, bound: Any = None) -> KvbmWorkerMeta | None:
        """The worker's report for this step. ``bound``: the connector metadata bound for the step; at the first
        report its ``channel`` token names the scheduler's report channel (none: reports go in the step output)."""
        if self.worker is None:
            return None
        if not self._channel_decided:  # at the worker's first report (report_channel.start_worker_reports)
            self._channel_decided = True
            token = getattr(bound, "channel", "") or ""
            if token:
                self.channel_key = report_channel.channel_key(*self.channel_base, token)
                self._pump = report_channel.start_worker_reports(self.channel_key, self.worker.workers, self.rank)
        meta = self.worker.worker_meta()
        return self.agree.with_failed_loads(meta) if self.agree is not None else meta

    def interval_stats(self) -> stats.KvbmConnectorStats | None:
        """This role's counters since the last call (vLLM asks both roles' connectors): the worker's
        (:data:`.stats.WORKER_PREFIXES`), the scheduler's (:data:`.stats.SCHEDULER_PREFIXES`); None when none moved."""
        d = self._interval.delta()
        return stats.KvbmConnectorStats(data=d) if d else None

    # ---- scheduler role ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """:meth:`.SchedulerSide.get_num_new_matched_tokens`; under ``external_launcher`` with TP > 1 the answer
        every TP rank's scheduler agrees (:class:`~.tp_agree.TpMatchAgree`: the fewest tokens, None while any rank
        has none). Raises RuntimeError when that exchange fails."""
        n, is_async = self.scheduler_role().get_num_new_matched_tokens(request, num_computed_tokens)
        return self.match_agree.agree(n, is_async) if self.match_agree is not None else (n, is_async)

    def build_connector_meta(self, scheduler_output: Any) -> KvbmConnectorMetadata:
        """The step's metadata for the workers (:meth:`.SchedulerSide.build_connector_meta`) with this
        scheduler's report channel token."""
        if self.exchange is not None:  # every TP rank's scheduler is here in the same step: all ranks' reports
            self.exchange.exchange()
        meta = self.scheduler_role().build_connector_meta(scheduler_output)
        meta.channel = self.channel_token
        return meta

    def on_g3_report(self, group: int, rank: int, added: list, removed: list, snapshot: bool) -> None:
        """A worker's report by the channel (counted ``g3_reports_by_channel`` here, once: not the other ranks' nor
        the step output's, which the TP exchange applies too): applied at once, or held for the TP group's next
        exchange."""
        stats.add(g3_reports_by_channel=1)
        if self.exchange is not None:
            self.exchange.put(group, rank, added, removed, snapshot)
            return
        self._apply_g3_report(group, rank, added, removed, snapshot)

    def _apply_g3_report(self, group: int, rank: int, added: list, removed: list, snapshot: bool) -> None:
        self.scheduler_role().apply_g3_report(group, KvbmWorkerMeta(added, removed, snapshot), rank=rank)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.sched is not None:
            wm = getattr(connector_output, "kv_connector_worker_meta", None)
            if self.exchange is not None and isinstance(wm, KvbmWorkerMeta):
                wm = self._hold_step_g3(wm)
            self.sched.update_connector_output(wm)
            failed = getattr(connector_output, "failed_recving", None)
            if failed:
                self.sched.load_failed(failed)
        assert self._writer is not None  # set by wire()
        self._writer.maybe_write()

    def _hold_step_g3(self, wm: KvbmWorkerMeta) -> KvbmWorkerMeta:
        """``wm`` (this process's worker's step report, under :attr:`exchange`) without its G3 index changes,
        which are held for the TP group's exchange as this TP rank's (applied alone they would make this rank's
        mirror unlike the others')."""
        assert self.exchange is not None
        for gi in [0, *wm.others]:
            m = wm.for_group(gi)
            if m is not None and (m.added or m.removed or m.snapshot):
                self.exchange.put(gi, self.rank, m.added, m.removed, m.snapshot)
        others = {g: KvbmWorkerMeta(failed=m.failed) for g, m in wm.others.items()}
        return KvbmWorkerMeta(failed=wm.failed, others=others)

    def pool_stats(self) -> dict:
        out = {}
        for gi, tg in enumerate(self._groups):
            for name, p in (("g3", tg.g3), ("g4", tg.g4)):
                if p is not None:
                    out[name if gi == 0 else f"{name}_group{gi}"] = p.stats()
        return out

    def close(self) -> None:
        """Stop the worker, report channel and idle publisher, flush the pools (10 s each), write the
        counters and release the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.shutdown()  # hands off the saves staged so far: through the gate, labelled (revoked_tenants)
        if self.revoked is not None:
            self.revoked.close()
        if self._pump is not None:
            self._pump.stop()
        if self.announcer is not None:
            self.announcer.stop()
        if self._listener is not None:
            self._listener.close()
        if self.sched is not None and self.sched.idle_events is not None:
            self.sched.idle_events.stop()
        for tg in self._groups:
            for p in (tg.g3, tg.g4):
                if p is not None and not p.flush(timeout=10.0):
                    log.warning("kvbm_backend: %s offloads still pending after 10 s at shutdown; close() drops "
                                "what it cannot write (counted)", p.tier)
        if self._writer is not None:
            self._writer.maybe_write(force=True)
            self._writer.stop()
        for tg in self._groups:
            release_tiers(tg.cfg, tg.ns)


def wire(parts: ConnectorParts, ktc: Any, vllm_config: "VllmConfig", role: Any, kv_cache_config: "KVCacheConfig",
         tiers: Callable[[KvbmBackendConfig, Namespace, Any], tuple[Any, Any]] = shared_tiers) -> ConnectorParts:
    """Fill ``parts`` for ``role`` (vLLM's ``KVConnectorRole``) from the ``kv_transfer_config`` ``ktc``.
    ``tiers(cfg, namespace, kv_heads) -> (g3, g4)`` opens a group's pools (:func:`~kvbm_backend.integrations.
    tiers.shared_tiers`, released by :meth:`ConnectorParts.close`; ``kv_heads``: the model's total KV heads,
    for ``g4.layout: canonical``).

    Raises:
        ConfigError: a bad ``kv_connector_extra_config`` (naming the key or field).
        ValueError: a KV cache the connector cannot carry (naming the spec).
        TypeError: a worker-side G3 pool without :class:`~kvbm_backend.pool.base.G3Extensions`.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    scheduler = role == KVConnectorRole.SCHEDULER
    cfg, opts = config_from_extra(ktc.kv_connector_extra_config)
    parts.cfg, parts.opts = cfg, opts
    parts.geometries = engine_geometries(vllm_config, kv_cache_config)
    ns = parts.ns = namespace_from_vllm(cfg, vllm_config, kv_cache_config, parts.geometries)
    parts.window_blocks = group_window_blocks(ns, vllm_config, kv_cache_config)  # with speculative decoding's extra
    backend = vllm_config.parallel_config.distributed_executor_backend
    spmd = backend == "external_launcher" and ns.tp_world_size > 1  # a scheduler in every TP rank's process
    if ns.tp_world_size > 1 and not scheduler:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        parts.rank = int(get_tensor_model_parallel_rank())
    if spmd and not scheduler:  # every rank's load results, agreed once per step (tp_agree)
        group = tp_agree.tp_group("in the worker's process, to agree the ranks' load results")
        parts.agree = tp_agree.TpLoadAgree(group)
    if ktc.kv_load_failure_policy != "recompute":
        log.warning("kvbm_backend: kv_load_failure_policy=%r; set 'recompute' so that a failed or corrupt "
                    "load is recomputed instead of failing the request", ktc.kv_load_failure_policy)
    # vLLM's "uni" executor runs the worker inside the engine-core (scheduler) process: both roles share one
    # pool object. Otherwise ("mp", ray) or with TP > 1 the worker owns G3 and the scheduler mirrors it.
    split = backend not in (None, "uni", "external_launcher") or ns.tp_world_size > 1
    blocks = block_level_errors(ns)
    async_sched = layerwise.async_scheduling_on(vllm_config)  # layer-wise loads need it off (layerwise.py doc)
    full_cg = layerwise.full_cudagraph_prefills_on(vllm_config)  # FULL graphs call no wait_for_layer_load
    lw_on = layerwise.usable(cfg, ns.tp_world_size, async_scheduling=async_sched, full_cudagraph_prefills=full_cg)
    kv_events_cfg = getattr(vllm_config, "kv_events_config", None)
    events_on = bool(kv_events_cfg is not None and kv_events_cfg.enable_kv_cache_events)
    announce = events_on and cfg.g4.enabled and cfg.g4.announce
    kv_events = events_on and (cfg.g3.enabled or announce)
    if cfg.g4.enabled and cfg.g4.announce and not events_on:
        log.warning("kvbm_backend: g4.announce is on but vLLM publishes no KV events (--kv-events-config): "
                    "G4 blocks are not announced")
    if kv_events and not blocks:
        log.warning("kvbm_backend: G3 KV events are not published for hybrid models (%d KV cache groups)",
                    len(ns.groups))
        kv_events = False
    mirror = split and scheduler and cfg.g3.enabled
    tier_cfg = cfg
    if mirror:
        tier_cfg = cfg.model_copy(update={"g3": cfg.g3.model_copy(update={"enabled": False})})
    elif ns.tp_world_size > 1:
        tier_cfg = rank_g3_config(cfg, parts.rank, ns.tp_world_size)
    for gi in range(max(1, len(ns.groups))):  # one TierGroup per KV cache group
        gns = ns.for_group(gi)
        gcfg = group_g3_config(tier_cfg, ns, gi, opts["sliding_capacity_weight"])
        g3, g4 = tiers(gcfg, gns, total_kv_heads(vllm_config))
        parts._groups.append(TierGroup(gns, gcfg, G3Mirror(gns) if mirror else g3, g4))
    parts._writer = _stats_writer(parts, opts["stats_path"], split, scheduler,
                                  same_process=backend in (None, "uni", "external_launcher"), dp=dp_index(vllm_config))
    parts.revoked = revoked_tenants(parts._groups, scheduler)
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    parts.channel_base = (str(ktc.engine_id), dp, ns.fingerprint)
    if scheduler:
        parts._interval = stats.Interval(prefixes=stats.SCHEDULER_PREFIXES)  # failed blocks, every rank's (once)
        load = opts["load"]
        if load and (why := cached_context_problem(vllm_config)):
            log.warning("kvbm_backend: loads are off for this engine: %s. Blocks are still saved to G3/G4 for "
                        "engines that can load them (docs/configuration.md, load)", why)
            stats.set_info(loads_off=why)
            load = False
        groups = [GroupTiers(tg.ns, tg.g3, tg.g4, parts.window_blocks[gi]) for gi, tg in enumerate(parts._groups)]
        # the one decision (spmd) for every TP agreement, the scheduler side's saves and matches too (.tp_sched)
        tp = tp_agree.tp_group("in the scheduler's process, to agree the ranks' plans") if spmd else None
        parts.sched = SchedulerSide(ns, ns.layout.page_size, groups[0].g3, groups[0].g4, default_tenant=cfg.tenant,
                                    lookup_timeout_s=max(cfg.g4.load_bound_s, 0.5), save=opts["save"],
                                    load=load, save_decode=opts["save_decode"], groups=groups,
                                    handoff_wait_s=opts["handoff_wait_s"],
                                    layerwise=lw_on, save_to_g4=opts["save_to_g4"], tp_group=tp)
        parts.sched.revoked = parts.revoked
        if cfg.g3.layerwise_load and ns.tp_world_size > 1:
            log.warning("kvbm_backend: g3.layerwise_load is on but the engine has %d TP ranks: G3 hits load "
                        "asynchronously (layer-wise loads run with one rank only: docs/configuration.md)",
                        ns.tp_world_size)
        elif cfg.g3.layerwise_load and async_sched:
            log.warning("kvbm_backend: g3.layerwise_load is on but vLLM's async scheduling is on: G3 hits load "
                        "asynchronously (a failed layer-wise load could serve a request of the next step; run "
                        "with --no-async-scheduling to use layer-wise loads: docs/configuration.md)")
        elif cfg.g3.layerwise_load and full_cg and load:  # load: false loads nothing: FULL graphs cost nothing
            log.warning(layerwise.FULL_CUDAGRAPH_PREFILLS_WARNING, vllm_config.compilation_config.cudagraph_mode)
        if kv_events:
            parts.sched.events = G3KvEvents(ns.tp_world_size, ns.layout.page_size,
                                            kv_cache_config.kv_cache_groups[0].kv_cache_spec, g3=cfg.g3.enabled)
            parts.sched.idle_events = IdlePublisher(parts.sched.events)
            if announce and groups[0].g4 is not None:
                parts.announcer = G4Announcer(parts.sched.events, groups[0].g4, ns, cfg.g4.announce_interval_s,
                                              cfg.g4.announce_ttl_s)
                parts.sched.events.announcer = parts.announcer
                parts.announcer.start()
        if spmd and (mirror or kv_events):
            parts.exchange = _tp_exchange(parts)
        if spmd and load and parts.sched.tp is not None:  # the tokens to load, agreed per request; else all answer 0
            parts.match_agree = parts.sched.tp.match_agree  # the side's own: it settles what it agreed
        if mirror or kv_events:  # one engine's: its own token, even where another has the same engine_id
            parts.channel_token = report_channel.new_token()
            parts.channel_key = report_channel.channel_key(*parts.channel_base, parts.channel_token)
            parts._listener = report_channel.ReportListener(parts.channel_key, parts.on_g3_report)
    else:
        ws = [WorkerSide(tg.ns, parts.rank, tg.g3, tg.g4, load_timeout_s=cfg.g3.load_timeout_s + cfg.g4.load_bound_s,
                         promote_to_g3=opts["promote_to_g3"], save_to_g4=opts["save_to_g4"],
                         max_pending_save_bytes=opts["max_pending_save_bytes"], report_g3=split or kv_events,
                         device_checksum=cfg.g3.device_checksum, revoked=parts.revoked)
              for tg in parts._groups]
        lw = (lambda w, names: layerwise.for_worker(cfg, w, names, async_scheduling=async_sched,
                                                    full_cudagraph_prefills=full_cg)) if blocks else None
        parts.worker = GroupedWorkers(ws, block_errors=blocks, layerwise=lw)
    log.info("kvbm_backend connector (%s): namespace %s %s, G3=%s G4=%s, G3 KV events=%s", role.name,
             ns.fingerprint, json.dumps(ns.to_dict()), parts._groups[0].g3 is not None,
             parts._groups[0].g4 is not None, kv_events)
    return parts


def _tp_exchange(parts: ConnectorParts) -> report_channel.TpReportExchange:
    """The scheduler's exchange of G3 reports with the other TP ranks' schedulers (``external_launcher``, TP > 1:
    :class:`~.report_channel.TpReportExchange`). The mirror's wait for the first snapshots ends on every rank at
    the same step (the exchange agrees it), never by this process's clock alone. Raises RuntimeError when this
    process has no vLLM TP group (the scheduler could see only its own rank's G3 blocks)."""
    group = tp_agree.tp_group("in the scheduler's process, to share the ranks' G3 reports")
    parts.rank = int(group.rank_in_group)  # this process's TP rank (its worker's reports in the step output)
    sched = parts.scheduler_role()
    wait_s, sched.mirror_wait_s = sched.mirror_wait_s, float("inf")

    def wait_over() -> None:
        sched.mirror_wait_s = 0.0
    return report_channel.TpReportExchange(group, parts._apply_g3_report, wait_s, wait_over)


def revoked_tenants(groups: list[TierGroup], scheduler: bool) -> RevokedTenants | None:
    """The tenants G3 refuses (:mod:`..revoked_tenants`), when G3 is on and G4 has a keyring: group 0's G4 keyring,
    checked every ``g4.keyring.reload_interval_s``. The worker role also purges every group's G3 pool of them
    (the scheduler's G3 is the worker's, or a mirror of it: only refused)."""
    kr = keyring_of(groups[0].g4) if groups else None
    if kr is None or all(tg.g3 is None for tg in groups):
        return None
    return RevokedTenants(kr, [] if scheduler else [tg.g3 for tg in groups], interval_s=kr.reload_every_s,
                          count=stats.add)


def dp_index(vllm_config: Any) -> int:
    """This engine's vLLM data-parallel rank: ``parallel_config.data_parallel_index``, which vLLM's engine core sets
    to the DP rank in every DP engine (its workers get the same config). Not ``data_parallel_rank``: a dense
    model's DP ranks run as independent engines, each with ``data_parallel_rank`` 0 and ``data_parallel_size`` 1
    (vLLM's ``ParallelConfig.reconfigure_for_independent_dp_rank``); that field is the fallback for a config
    without the index. 0 without DP."""
    pc = vllm_config.parallel_config
    idx = getattr(pc, "data_parallel_index", None)
    return int((getattr(pc, "data_parallel_rank", 0) if idx is None else idx) or 0)


def _stats_writer(parts: ConnectorParts, stats_path: str | None, split: bool, scheduler: bool,
                  same_process: bool = False, dp: int = 0) -> stats.StatsWriter:
    """The counters' writer of this role (see the module doc for the file names). ``same_process``: both roles
    run in this process (``uni``, ``external_launcher``); the counters are per process, so with TP > 1
    (``external_launcher``: every process hosts the scheduler and one rank's worker) the worker's file holds
    both roles' counters and the scheduler writes none (merging its file would count everything twice).
    ``dp``: the engine's DP rank (:func:`dp_index`); DP engine d > 0 adds ``.dp<d>`` to the stem of every name
    (every DP engine has the deployment's one ``stats_path``: before 2026-12-04 they all wrote it, each write
    replacing the other engines' counters)."""
    merge = stats_path
    if stats_path:
        root, ext = os.path.splitext(stats_path)
        if dp > 0:
            root = f"{root}.dp{dp}"
            stats_path = f"{root}{ext}"
        merge = f"{root}.scheduler{ext}" if split and not same_process else None  # rank 0's worker merges it
        if split and scheduler:
            stats_path, merge = (None if same_process else merge), None
        elif parts.rank > 0:
            stats_path, merge = f"{root}.rank{parts.rank}{ext}", None
    return stats.StatsWriter(stats_path, extra=parts.pool_stats, merge=merge)
