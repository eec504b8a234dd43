"""Counters of the vLLM connector, one set per process (both connector roles add to it).

Read them with :func:`snapshot` (a plain dict: counts of blocks/requests/jobs, ``*_bytes`` in bytes,
``*_s`` in seconds); the connector also writes the snapshot as JSON to ``stats_path`` (from
``kv_connector_extra_config``) on shutdown and every ``stats_interval_s`` while counters change.

When the connector's roles run in different processes (vLLM's ``mp`` executor, TP > 1) the scheduler
writes ``<stats_path stem>.scheduler<ext>`` and the worker (TP rank 0) merges that file into
``stats_path`` each time it writes (:func:`merge_snapshots`): ``stats_path`` holds both roles'
counters, at most one write interval (0.5 s) behind the scheduler (each file is replaced atomically, so a
reader never sees half of one; the scheduler's own file is never written by the worker, so nothing is
counted twice).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from ...threads import start_thread

_lock = threading.Lock()
_counts: dict[str, float] = {}  # name -> count (int) or seconds (float)


def add(**kw: float) -> None:
    """Add to named counters (``add(load_blocks_ok=3, load_bytes=393216)``)."""
    with _lock:
        for k, v in kw.items():
            _counts[k] = _counts.get(k, 0) + v


def snapshot() -> dict:
    """All counters as a dict (missing counters read as 0 by :func:`get`)."""
    with _lock:
        return dict(_counts)


def get(name: str) -> float:
    with _lock:
        return _counts.get(name, 0)


_info: dict = {}


def set_info(**kw) -> None:
    """Record descriptive facts (``kv_cache_shape``, ``engine_layout``, ``namespace``, ...)."""
    with _lock:
        _info.update(kw)


def info() -> dict:
    with _lock:
        return dict(_info)


def reset() -> None:
    with _lock:
        _counts.clear()


# counters the worker role adds (what moved between the engine and G3/G4), reported per interval to vLLM
WORKER_PREFIXES = ("save_", "load_blocks", "load_g3_", "load_g4_", "load_jobs", "load_bytes", "load_errors",
                   "load_timeouts", "load_get_errors", "g3_put_", "g4_put_", "promote_")
# counters the scheduler role reports per interval to vLLM (it asks the scheduler's connector too): blocks of loads
# some TP rank failed, and blocks every TP rank loaded, each once (.load_failures; every rank's report reaches the
# scheduler). Neither name starts with a WORKER_PREFIXES entry: a process with both roles reports each once.
SCHEDULER_PREFIXES = ("load_failed_blocks_any_rank", "load_verified_blocks_every_rank")


def _is_block_count(name: str) -> bool:
    """A counter of blocks (``load_blocks_ok``, ``save_dropped_blocks``, ``g3_put_written_blocks``, ...)."""
    return "blocks" in name


def first_worker() -> bool:
    """True unless this process's worker is a TP or PP rank other than 0 of its vLLM engine (data-parallel
    replica), per vLLM's model-parallel state; True where that state is not set up (one worker, tools, tests)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        return int(get_tp_group().rank_in_group) == 0 and int(get_pp_group().rank_in_group) == 0
    except Exception:  # noqa: BLE001 - not initialized (AssertionError) or no vLLM: the one worker
        return True


class Interval:
    """Per-interval deltas of the worker counters (for vLLM's ``get_kv_connector_stats``).

    vLLM sums every worker's stats into one (``KVOutputAggregator``), and each TP/PP worker counts the blocks
    whose slice it moved (its heads, its layers): block counters (names with ``blocks``) are therefore reported
    by the engine's first worker only (TP rank 0, PP rank 0), so that the sum counts each block of KV once,
    as that worker saw it (a replicated MLA block goes to G4 from that rank too). Bytes, seconds and the other
    counts are every worker's own, summed.

    The scheduler role reports its own counters (``prefixes``: :data:`SCHEDULER_PREFIXES`), with the same rule: under
    ``external_launcher`` (a scheduler in every rank's process) the first worker's process only.

    Args:
        first: this worker reports block counters (default: :func:`first_worker`, read at the first
            :meth:`delta`, once vLLM's model-parallel state is set up).
        prefixes: the counters reported (names starting with one of them; default :data:`WORKER_PREFIXES`).
    """

    def __init__(self, first: bool | None = None, prefixes: tuple[str, ...] = WORKER_PREFIXES) -> None:
        # from the counts at construction: the counters are the process's, and an engine made after another in the
        # same process (or a test after another) reported the earlier ones' counts in its first interval
        self._last: dict = {k: v for k, v in snapshot().items() if k.startswith(prefixes)}
        self.first, self.prefixes = first, prefixes

    def delta(self) -> dict:
        """Counters that changed since the previous call: ``{name: increase}`` (empty if none); without block
        counters on a worker that is not the engine's first."""
        if self.first is None:
            self.first = first_worker()
        now = {k: v for k, v in snapshot().items()
               if k.startswith(self.prefixes) and (self.first or not _is_block_count(k))}
        d = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        return d


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats as _StatsBase
except Exception:  # noqa: BLE001 - the class also works without vLLM (tools, tests)
    @dataclass
    class _StatsBase:  # type: ignore[no-redef]
        data: dict = field(default_factory=dict)


@dataclass
class KvbmConnectorStats(_StatsBase):
    """vLLM ``KVConnectorStats`` of this connector: ``data`` maps worker counter names (blocks,
    ``*_bytes`` in bytes, ``*_s`` in seconds; see :data:`WORKER_PREFIXES`) to their increase over one
    interval; :meth:`aggregate` sums workers' stats and :meth:`reduce` gives the sums."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other) -> "KvbmConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# vLLM Prometheus counters fed from KvbmConnectorStats: (metric name, help, counters summed into it).
# Named in KVBM's terms (offload = engine -> G3/G4, onboard = G3/G4 -> engine). Block counters come from the
# engine's first worker only (Interval): each block once at any TP/PP; bytes from every worker; loaded and failed loads
# from the scheduler, which hears every rank (docs/operations.md, Metrics). Before 2026-12-03 onboard_blocks was TP
# rank 0's load_blocks_ok (a block rank 0 loaded but another rank failed counted as loaded and as failed).
PROM_COUNTERS = (
    ("vllm:kvbm_backend_onboard_blocks", "KV blocks loaded from G3/G4 into the engine on every TP rank (verified; "
     "each block once)", ("load_verified_blocks_every_rank",)),
    ("vllm:kvbm_backend_onboard_failed_blocks", "KV blocks whose load failed on any TP rank (recomputed; each block once)",
     ("load_failed_blocks_any_rank",)),
    ("vllm:kvbm_backend_onboard_bytes", "bytes loaded from G3/G4 into the engine", ("load_bytes",)),
    ("vllm:kvbm_backend_offload_blocks", "KV blocks gathered from the engine for offload", ("save_blocks",)),
    ("vllm:kvbm_backend_offload_dropped_blocks", "offloads dropped, per tier (staging full, queue full, G3 and G4 drops summed: a block both dropped counts twice)",
     ("save_dropped_blocks", "g3_put_dropped_blocks", "g4_put_dropped_blocks")),
    ("vllm:kvbm_backend_g3_written_blocks", "KV blocks published in G3", ("g3_put_written_blocks",)),
    ("vllm:kvbm_backend_g4_written_blocks", "KV blocks published in G4", ("g4_put_written_blocks",)),
)


if TYPE_CHECKING:  # type-checked against vLLM's base; the stand-in below has the part this module uses
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics as _PromBase
else:
    class _PromBase:  # replaced by vLLM's KVConnectorPromMetrics when vLLM is importable
        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            from prometheus_client import Counter
            self._counter_cls = metric_types.get(Counter, Counter)
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics as _PromBase  # noqa: F811
    except Exception:  # noqa: BLE001
        pass


class KvbmPromMetrics(_PromBase):
    """vLLM ``KVConnectorPromMetrics`` of this connector: the counters of :data:`PROM_COUNTERS`, one
    child per engine (vLLM's ``model_name``/``engine`` labels), increased by each interval's
    :class:`KvbmConnectorStats`. vLLM's MultiConnector requires it of every member connector that
    reports stats."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = []
        for name, doc, keys in PROM_COUNTERS:
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            per_engine = {i: c.labels(*lv) for i, lv in per_engine_labelvalues.items()}
            self._counters.append((per_engine, keys))

    def observe(self, transfer_stats_data, engine_idx: int = 0) -> None:
        data = getattr(transfer_stats_data, "data", transfer_stats_data) or {}
        for per_engine, keys in self._counters:
            v = sum(data.get(k, 0) for k in keys)
            if v > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)


def merge_snapshots(own: dict, other: dict) -> dict:
    """``own`` (a worker's snapshot) with ``other`` (the scheduler's, as written to its file) merged in:
    numeric counters summed, ``info`` joined (``own`` wins), ``pools`` from ``own`` plus the pools only
    ``other`` has; for a pool both have, the lookup counters (``lookup_blocks``, ``lookup_hits``, counted
    where lookups happen: the scheduler) are summed and ``hit_rate`` recomputed from them."""
    out = dict(own)
    for k, v in other.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = out.get(k, 0) + v
    out["info"] = {**(other.get("info") or {}), **(own.get("info") or {})}
    pools = {k: dict(v) if isinstance(v, dict) else v for k, v in (own.get("pools") or {}).items()}
    for name, st in (other.get("pools") or {}).items():
        mine = pools.get(name)
        if not isinstance(mine, dict) or not isinstance(st, dict):
            pools.setdefault(name, st)
            continue
        for k in ("lookup_blocks", "lookup_hits"):
            if isinstance(st.get(k), (int, float)):
                mine[k] = mine.get(k, 0) + st[k]
        if mine.get("lookup_blocks"):
            mine["hit_rate"] = mine.get("lookup_hits", 0) / mine["lookup_blocks"]
    if pools or "pools" in own:
        out["pools"] = pools
    return out


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}  # not written yet (or not ours): nothing to merge
    return d if isinstance(d, dict) else {}


class StatsWriter:
    """Writes :func:`snapshot` (plus ``extra()``) to a JSON file, atomically, at most every ``interval_s``.
    The file's directory is created (0700) when missing; a write that fails (directory not writable, disk
    full) is logged once as a warning naming the path and never reaches the engine. ``merge``: another
    process's stats file merged into each write (:func:`merge_snapshots`)."""

    def __init__(self, path: str | None, interval_s: float = 0.5, extra=None, merge: str | None = None):
        self.path, self.interval_s, self.extra, self.merge = path, interval_s, extra, merge
        self._warned = False
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            except OSError:
                pass  # reported by the first write
        self._last = 0.0
        self._last_snap: dict | None = None
        self._wlock = threading.Lock()
        self._stop = threading.Event()
        if path:
            # a daemon thread, so the file also catches what happens after the engine's last step
            start_thread(self._loop, name="kvbm-stats")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.maybe_write()
            except Exception:  # noqa: BLE001 - stats must never break the engine
                pass

    def stop(self) -> None:
        self._stop.set()

    def maybe_write(self, force: bool = False) -> None:
        path = self.path
        if not path:
            return
        with self._wlock:
            try:
                self._write(path, force)
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    logging.getLogger("kvbm_backend.connector").warning(
                        "kvbm_backend: cannot write the connector stats file %s: %s (stats_path)", self.path, e)

    def _write(self, path: str, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        snap = snapshot()
        snap["info"] = info()
        if self.extra is not None:
            try:
                snap["pools"] = self.extra()
            except Exception as e:  # noqa: BLE001 - stats must never break the engine
                snap["pools"] = {"error": str(e)}
        if self.merge:
            snap = merge_snapshots(snap, _read_json(self.merge))
        if not force and snap == self._last_snap:
            return
        self._last, self._last_snap = now, snap
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(snap, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, path)
