"""Layer-wise G3 loads for the vLLM connector (``g3.layerwise_load``, issue 24 item 5).

With the setting on, the scheduler offers a prefix hit served by G3 alone synchronously
(``get_num_new_matched_tokens`` returns ``load_async=False``): vLLM schedules the rest of the prompt in
the same step and calls ``start_load_kv`` before the forward. :class:`LayerwiseLoads` then:

* ``start`` (``start_load_kv``): one load per such job from the G3 pool's one entry point
  (:meth:`~kvbm_backend.pool.base.G3Extensions.layerwise_load`): slots leased, reads ordered by layer
  submitted on the pool's reader threads (returns at once);
* ``wait_layer`` (``wait_for_layer_load``, called by each attention layer before it runs): waits for that
  layer's reads and scatters the layer of the blocks read so far into vLLM's paged KV
  (:meth:`~.kv_io.EngineKv.scatter_layer`), so layer ``l`` loads while layer ``l - 1`` computes;
* ``finish`` (``wait_for_save`` / ``get_block_ids_with_load_errors``, after the forward): verifies every whole
  payload (:meth:`~kvbm_backend.pool.base.LayerwiseLoading.finish`) and reports every
  block from the first failed one on through the connector's failed-load path
  (``get_block_ids_with_load_errors`` + :class:`~.metadata.FailedLoad`). vLLM (``kv_load_failure_policy``
  ``recompute``) then resets the request to its valid prefix and throws the step's token away, so a
  forward that ran on unverified KV never yields a token (docs/invariants.md #1). Every save of a step in
  which a layer-wise load failed is dropped, and the failed request's saves from then on: vLLM caches a
  synchronous load's blocks at once, so another request of the same step may have used them as its prefix
  hit and computed (and would save) KV from the bad rows. The scheduler then removes the request's blocks from
  the first failed one on from vLLM's prefix cache (:func:`.failed_blocks.unloaded_engine_blocks`), so no later
  request hits them before they are recomputed; another request that took them as its prefix hit in that step
  (vLLM leaves it on them, for the failed request to recompute: never, if that one is aborted first) saves none of
  its blocks from the first of them on, and those leave the prefix cache too
  (:func:`.failed_blocks.contain_failed_sync_load`); in a step where it reads one of them before any request
  recomputed it, the block is reported to vLLM again and it rolls back (:class:`.failed_blocks.Unrecomputed`;
  before 2026-12-01 it decoded on the block's stale bytes). Whichever of ``wait_for_save`` and
  ``get_block_ids_with_load_errors`` ends the loads, the failure is kept until the step's ``wait_for_save``:
  with speculative decoding vLLM defers ``wait_for_save`` until after the draft model
  (``defer_kv_connector_finalize``), so ``get_block_ids_with_load_errors`` comes first there.
  A load with a layer vLLM never waited for in the forward (its attention ran without the connector's hooks: a
  FULL CUDA graph replays no Python) fails from its first block, however well its payloads verify: the forward
  computed that layer's attention, the step's token and the KV of every later position from stale rows of every
  block (counted ``layerwise_unwaited_jobs``, one WARNING a minute names the layers). Before 2026-12-03 such a
  layer was scattered after the forward and the load reported good: a wrong token and wrong KV saved. Only when
  ``get_block_ids_with_load_errors`` ends the load (speculative decoding: the draft model's forward, whose
  layers follow the target model's, comes after it) are layers after the last one waited for scattered then and
  not counted against the load.

Layer-wise loads run with one TP rank only (:func:`usable`): a rank cannot stop the other ranks from saving
their slices of KV computed, through the all-reduce, from its bad rows; with TP > 1 hits load asynchronously.
They also run only without vLLM's async scheduling (``--async-scheduling``, vLLM's default on GPUs; its CPU
engine turns it off): there step N + 1 is scheduled before step N's output (its ``invalid_block_ids``) is
processed, so a request of step N + 1 can take the failed, already cached blocks as its prefix hit and
compute, sample and save from them; vLLM's recovery (``Scheduler._update_requests_with_invalid_blocks``)
keeps such a request's in-flight step, and with ``recompute`` it does not evict the blocks. With async
scheduling hits load asynchronously (vLLM caches them only once verified) and a warning says so at start.
Nor where vLLM runs prefills as FULL CUDA graphs (``compilation_config.cudagraph_mode`` ``FULL``:
:func:`full_cudagraph_prefills_on`): a replayed FULL graph never calls ``wait_for_layer_load``, so nearly every
such load would fail; hits load asynchronously and a warning (:data:`FULL_CUDAGRAPH_PREFILLS_WARNING`) says so at
start. ``PIECEWISE`` and ``NONE`` (``--enforce-eager``, vLLM's CPU engine) run attention eagerly, hooks included;
``FULL_AND_PIECEWISE`` (vLLM's GPU default) and ``FULL_DECODE_ONLY`` do too except in a batch of decode-sized
requests only (``1 + num_speculative_tokens`` tokens each), which a hit leaving that few tokens to compute can
join: that load fails as above (counted ``layerwise_unwaited_jobs``) and vLLM recomputes it.

Sync loads are never reported in ``finished_recving`` (vLLM only waits for asynchronous ones).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...gpu.layer_copy import check_ids
from ...pool.base import G3Extensions, LayerwiseLoading
from ...transfer.layers import DEFAULT_MIN_READ
from .. import load_priority
from . import stats
from .metadata import FailedLoad, LoadJob, SaveJob
from ...log_limits import LimitedLog

log = logging.getLogger("kvbm_backend.connector")

TAINTED_MAX = 4096  # requests remembered whose layer-wise load failed (their later saves are dropped)


@dataclass
class _Active:
    job: LoadJob
    load: LayerwiseLoading | None
    keys: list
    prefix: int                      # rows scattered for every layer waited for so far
    idx: Any = None                  # the job's engine block ids on the device (EngineKv.block_index), made once
    done: set = field(default_factory=set)
    t0: float = field(default_factory=time.monotonic)


class LayerwiseLoads:
    """Layer-wise loads of one worker (:class:`~.worker_side.WorkerSide`, one KV cache group).

    Args:
        worker: the worker role (its ``g3`` pool, ``kv`` engine tensors, failed-load reports).
        layer_names: vLLM's attention layer names in the order of the engine's KV tensors.
        timeout_s: a load's deadline (``g3.load_timeout_s``); later reads are failed blocks.
        min_read: bytes per read at least (layers grouped up to it).
    """

    def __init__(self, worker: Any, layer_names: list[str], *, timeout_s: float = 5.0,
                 min_read: int = DEFAULT_MIN_READ):
        self.w = worker
        self.index = {n: i for i, n in enumerate(layer_names)}
        self.timeout_s, self.min_read = timeout_s, min_read
        self._active: list[_Active] = []
        self._tainted: OrderedDict = OrderedDict()
        self.log = LimitedLog(log)  # a failed load's WARNING: one per minute, not one per request (kvbm_backend.log_limits)
        # requests whose layer-wise load failed since the last saves(), by whichever finish() ended it: with
        # vLLM's defer_kv_connector_finalize (speculative decoding) get_block_ids_with_load_errors ends the
        # step's loads before wait_for_save, and saves() must still drop every save of that step
        self._step_failed: set[str] = set()

    def start(self, jobs: list[LoadJob]) -> list[LoadJob]:
        """Start the layer-wise jobs of ``jobs``; returns the others (asynchronous loads)."""
        for j in jobs:
            if j.layerwise:
                self._start(j)
        return [j for j in jobs if not j.layerwise]

    def _start(self, job: LoadJob) -> None:
        w, kv = self.w, self.w.kv
        n = len(job.block_ids)
        keys = w.ns.keys(job.seq_hashes, job.tenant, w.rank, job.digests or None)
        stats.add(load_jobs=1, load_blocks_requested=n, layerwise_jobs=1)
        ld = None
        load_priority.hold()  # released in _finish: the forward's Python yields the GIL to the reads sooner
        try:  # engine block ids checked first: out of range, vLLM 0.32's packed GPU caches hit a device-side assert
            check_ids(list(job.block_ids), kv.num_blocks)  # in the forward's scatter_layer (index tensor: unchecked)
            if not w.g3_refused(job.tenant, n):  # a revoked tenant's G3 blocks are not read: the load fails whole
                ld = w.g3.layerwise_load(keys, kv.device, timeout_s=self.timeout_s, min_read=self.min_read)
        except Exception as e:  # noqa: BLE001 - the load fails whole: the request recomputes
            log.warning("kvbm_backend: layer-wise load for %s could not start: %s", job.req_id, e)
            stats.add(load_errors=1)
        self._active.append(_Active(job, ld, keys, n if ld is not None else 0,
                                    kv.block_index(job.block_ids) if ld is not None else None))

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: layer ``layer_name`` of every active load is in vLLM's paged KV (the
        rows read so far); unknown layer names (no KV of ours) return at once."""
        li = self.index.get(layer_name)
        if li is None or not self._active:
            return
        for a in self._active:
            if self._layer(a, li):
                stats.add(layerwise_layer_waits=1)

    def _layer(self, a: _Active, li: int) -> bool:
        if a.load is None or li in a.done:
            return False
        a.done.add(li)
        try:
            good, t = a.load.wait_layer(li)
        except Exception as e:  # noqa: BLE001
            log.warning("kvbm_backend: layer-wise load of layer %d failed: %s", li, e)
            a.prefix = 0
            return True
        p = 0
        while p < len(good) and good[p] == p:
            p += 1
        a.prefix = min(a.prefix, p)
        if a.prefix:  # whole (the usual case) without slicing: a view per layer costs GIL hand-offs
            whole = a.prefix == len(t)
            self.w.kv.scatter_layer(li, t if whole else t[:a.prefix], a.idx if whole else a.idx[:a.prefix])
        return True

    def finish(self, *, whole_step: bool = False) -> set[str]:
        """End every active load (see the module doc). Returns the request ids with failed blocks (also kept
        for the step's :meth:`saves`, which may come later: vLLM's ``defer_kv_connector_finalize``).

        ``whole_step``: every forward of the step ran (``wait_for_save``: the draft model's too), so a layer not
        waited for fails the load; otherwise (``get_block_ids_with_load_errors``, which precedes the draft model's
        forward under speculative decoding) only layers before the last one waited for, or all of them, do: the
        ones after it may be the draft model's, loaded now as before (:meth:`_stale`)."""
        failed: set[str] = set()
        active, self._active = self._active, []
        for a in active:
            failed |= self._finish(a, whole_step)
        self._step_failed |= failed
        return failed

    def _finish(self, a: _Active, whole_step: bool) -> set[str]:
        try:
            return self._finish_held(a, whole_step)
        finally:
            load_priority.release()  # the hold() of _start

    def _stale(self, a: _Active, unwaited: list[int], whole_step: bool) -> bool:
        """Whether the forward ran attention on stale rows of ``a``: a layer of the model was not waited for
        (``wait_for_layer_load`` never called: vLLM skips it when the layer's attention replays in a FULL CUDA
        graph, ``compilation_config.cudagraph_mode``). Before the step's ``wait_for_save`` (``whole_step`` False:
        speculative decoding's draft model, whose layers follow the target model's, has not run yet) layers after
        the last one waited for are not counted against it."""
        if not unwaited or a.load is None:
            return False
        return whole_step or not a.done or min(unwaited) < max(a.done)

    def _finish_held(self, a: _Active, whole_step: bool) -> set[str]:
        job, w = a.job, self.w
        n = len(job.block_ids)
        why: list[str | None] = ["not_started"] * n
        unwaited = [li for li in range(w.kv.layout.num_layers) if li not in a.done]
        stale = self._stale(a, unwaited, whole_step)
        if a.load is not None:
            for li in [] if stale else unwaited:  # a stale forward's blocks are all recomputed: not scattered
                self._layer(a, li)
            try:
                why = a.load.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("kvbm_backend: layer-wise load for %s failed: %s", job.req_id, e)
                a.prefix = 0
            c = a.load.counters
            stats.add(layerwise_layers_unwaited=len(unwaited), layerwise_read_wait_s=c["read_wait_s"],
                      layerwise_verify_s=c["verify_s"], layerwise_reads=c["reads"],
                      layerwise_unaligned_loads=c["unaligned_loads"])
        p = 0
        while p < min(n, a.prefix) and why[p] is None:
            p += 1
        reason = "timeout" if p < n and why[p] == "timeout" else "miss"
        if stale:  # every block failed from the first: the forward computed from stale rows of each of them
            reason = reason if p == 0 else "unwaited"  # the G3 blocks are good: not cooled (FailedLoad.reason)
            p = 0
            stats.add(layerwise_unwaited_jobs=1)
            self.log.warning("unwaited", "kvbm_backend: layer-wise load for %s: vLLM never waited for layers %s of "
                             "%d (%s) in the forward: their attention ran on KV not loaded yet, most likely replayed "
                             "in a FULL CUDA graph without the connector's hooks (vLLM's compilation_config."
                             "cudagraph_mode: use PIECEWISE or NONE with g3.layerwise_load). Its %d blocks are "
                             "reported failed and vLLM recomputes them", job.req_id, _spans(unwaited),
                             w.kv.layout.num_layers, self._names(unwaited), n)
        bpb = w.kv.layout.bytes_per_block
        stats.add(load_blocks_ok=p, load_g3_blocks_ok=p, load_blocks_failed=n - p, load_bytes=p * bpb,
                  load_wall_s=time.monotonic() - a.t0)
        if p == n:
            return set()
        reasons = sorted({str(r) for r in why[p:] if r is not None})
        if not stale:
            self.log.warning("failed", "kvbm_backend: layer-wise load for %s: blocks %d..%d failed (%s); vLLM "
                             "recomputes them", job.req_id, p, n - 1, ",".join(reasons) or "late")
        with w._lock:
            w._load_errors.update(job.block_ids[p:])
            w._failed_loads.append(FailedLoad(job.req_id, job.tenant, int(job.seq_hashes[p]), reason,
                                              job.digest_of(p)))
        if a.load is not None:  # a block read in vain (not late, not unstarted): deleted so its recompute is stored
            w.drop_unreadable([a.keys[i] for i in range(p, n) if why[i] not in (None, "timeout", "not_started")])
        if w.report_g3:  # removed from the mirror only when G3 no longer holds it
            w._report_load_misses([a.keys[i] for i in range(p, n) if why[i] not in (None, "timeout")])
        if why[p] == "timeout":  # the first failed block ran out of time: a timeout, as an asynchronous load counts it
            stats.add(load_timeouts=1)
        self._tainted[job.req_id] = None
        while len(self._tainted) > TAINTED_MAX:
            self._tainted.popitem(last=False)
        stats.add(layerwise_failed_jobs=1)
        return {job.req_id}

    def saves(self, saves: list[SaveJob]) -> list[SaveJob]:
        """``wait_for_save``: end the step's loads, then ``saves`` less those of requests whose layer-wise
        load failed, now or in an earlier step, and none at all when one failed in this step (any request of
        the step may have computed from its blocks: vLLM caches them at once); counted ``save_dropped_blocks``.
        "This step" is every load ended since the previous call, here or by an earlier :meth:`finish`
        (``get_block_ids_with_load_errors`` first: vLLM's ``defer_kv_connector_finalize``); vLLM calls
        ``wait_for_save`` once per step in both orders. A step without one (vLLM 0.32, deferred, when
        ``execute_model`` returns its output itself: none of its saves are made) carries its failure to the next
        call: more saves dropped, never wrong KV."""
        self.finish(whole_step=True)
        failed_step, self._step_failed = self._step_failed, set()
        keep = [] if failed_step else [s for s in saves if s.req_id not in self._tainted]
        dropped = sum(len(s.block_ids) for s in saves) - sum(len(s.block_ids) for s in keep)
        if dropped:
            stats.add(save_dropped_blocks=dropped, layerwise_save_dropped_blocks=dropped)
        return keep

    def close(self) -> None:
        """Shutdown: end every active load without scattering a layer or counting it (no forward reads it, none was
        judged: a load started but never forwarded is no unwaited one); its reads are awaited and its slot leases
        and load priority released. Never raises."""
        active, self._active = self._active, []
        for a in active:
            try:
                if a.load is not None:
                    a.load.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("kvbm_backend: layer-wise load for %s at shutdown: %s", a.job.req_id, e)
            finally:
                load_priority.release()  # the hold() of _start

    def _names(self, layers: list[int]) -> str:
        """vLLM's names of ``layers`` (indices), the first three and how many more."""
        names = {i: n for n, i in self.index.items()}
        shown = [names.get(li, str(li)) for li in layers[:3]]
        return ", ".join(shown) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def _spans(idx: list[int]) -> str:
    """Sorted layer indices as spans: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for i in idx:
        if out and int(out[-1].rsplit("-", 1)[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def usable(cfg: Any, tp_world_size: int, *, async_scheduling: bool, full_cudagraph_prefills: bool = False) -> bool:
    """Whether ``g3.layerwise_load`` applies to an engine of ``tp_world_size`` TP ranks: on, one rank,
    ``async_scheduling`` (vLLM's ``scheduler_config.async_scheduling``, see :func:`async_scheduling_on`) off and
    ``full_cudagraph_prefills`` (:func:`full_cudagraph_prefills_on`) off (see the module doc; the scheduler and the
    workers both ask, so they agree)."""
    return (bool(cfg.g3.layerwise_load) and tp_world_size == 1 and not async_scheduling
            and not full_cudagraph_prefills)


#: the WARNING at start when ``g3.layerwise_load`` is on but vLLM runs prefills as FULL CUDA graphs
#: (:func:`full_cudagraph_prefills_on`); ``%s``: the mode
FULL_CUDAGRAPH_PREFILLS_WARNING = (
    "kvbm_backend: g3.layerwise_load is on but vLLM's compilation_config.cudagraph_mode is %s (FULL CUDA graphs): "
    "G3 hits load asynchronously (a FULL graph replays attention without the connector's wait_for_layer_load, "
    "so the forward would read KV not loaded yet; use cudagraph_mode PIECEWISE, or --enforce-eager, for "
    "layer-wise loads: docs/configuration.md)")


def full_cudagraph_prefills_on(vllm_config: Any) -> bool:
    """Whether vLLM replays prefill and mixed batches as FULL CUDA graphs (``vllm_config.compilation_config.
    cudagraph_mode`` ``FULL``; of the two-routine modes, the mixed batches' half: ``FULL_AND_PIECEWISE`` and
    ``FULL_DECODE_ONLY`` do not): a replayed graph runs no Python, so vLLM's ``wait_for_layer_load`` is never called
    for its layers. vLLM resolves the mode at start and only lowers it later (an attention backend without FULL
    graph support). False when the config names no mode (no ``compilation_config``, or its mode unset)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None:
        return False
    mixed = getattr(mode, "mixed_mode", None)
    mixed_mode = mixed() if callable(mixed) else mode
    return str(getattr(mixed_mode, "name", mixed_mode)).upper() == "FULL"


def async_scheduling_on(vllm_config: Any) -> bool:
    """Whether vLLM schedules a step before the previous step's output is processed
    (``vllm_config.scheduler_config.async_scheduling``); True unless it is False (unset or missing: vLLM's
    GPU default, so layer-wise loads are not offered where it cannot be told)."""
    sc = getattr(vllm_config, "scheduler_config", None)
    return getattr(sc, "async_scheduling", None) is not False


def for_worker(cfg: Any, worker: Any, layer_names: list[str], *, async_scheduling: bool,
               full_cudagraph_prefills: bool = False) -> LayerwiseLoads | None:
    """:class:`LayerwiseLoads` for a connector's worker when layer-wise loads apply (:func:`usable`) and its G3
    pool offers slot leases (:class:`~kvbm_backend.pool.base.G3Extensions`), else None. ``worker``: the
    :class:`~.worker_side.WorkerSide` of a model of one full-attention group (others load asynchronously)."""
    if (not usable(cfg, worker.ns.tp_world_size, async_scheduling=async_scheduling,
                   full_cudagraph_prefills=full_cudagraph_prefills)
            or not isinstance(getattr(worker, "g3", None), G3Extensions)):
        return None
    return LayerwiseLoads(worker, layer_names, timeout_s=cfg.g3.load_timeout_s)
