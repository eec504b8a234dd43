"""Prometheus metrics for the pools, with KVBM's names where KVBM has one.

KVBM's own names (dynamo ``lib/runtime/src/metrics/prometheus_names.rs``, module ``kvbm``, exported
with the ``kvbm_`` prefix by KVBM's metrics server) that mean the same thing here. The counters among them
carry prometheus_client's ``_total`` suffix, which KVBM's Rust exporter does not add
(``kvbm_offload_blocks_h2d_total`` here); gauges keep KVBM's name; there is no ``dp_rank`` label:

* ``kvbm_offload_blocks_h2d``: blocks offloaded host -> disk (G3 puts written).
* ``kvbm_onboard_blocks_d2d``: blocks onboarded disk -> device (G3 gets verified; here they land in the
  caller's buffer on the way to the device).
* ``kvbm_offload_blocks_d2o`` / ``kvbm_onboard_blocks_o2d``: the same for object storage (G4).
* ``kvbm_matched_tokens``: tokens matched by requests' prefix lookups (G3's share and G4's), each request
  once, as the prefix every TP rank holds (the hit the request gets): its other TP ranks, KV cache groups, repeated asks and prompts the engine's own cache serves are not
  counted (``lookup_prefix(..., request=False)``, :class:`kvbm_backend.pool.base.BlockPool`). Under vLLM's
  ``external_launcher`` with TP > 1 every rank's process runs a scheduler: TP rank 0's alone counts, the hit the
  ranks agreed (:mod:`kvbm_backend.integrations.vllm.tp_sched`), so the pod's sum is still each request once. With
  vLLM's native tiers (``G3Tier`` above ``G4Tier`` in one offloading manager, which asks both about every chunk and
  loads each from the first tier holding it) the lower tier counts the request's usable prefix (the leading
  chunks some tier holds, however the tiers interleave) once, each chunk as the share of the tier it loads from
  (:mod:`kvbm_backend.integrations.vllm.tier_lookup`): a chunk both tiers hold counts once, a chunk after one no
  tier holds not at all.
* ``kvbm_disk_cache_hit_rate`` / ``kvbm_object_cache_hit_rate``: hit rate (0-1) over a sliding window of
  lookups (KVBM uses a sliding window too; ours is the last :data:`HIT_RATE_WINDOW` looked-up blocks),
  counted as matched tokens are; G4's over the blocks G3 lacked (did not serve: a request G3 serves whole is not
  in it).
* ``kvbm_object_read_failures`` / ``kvbm_object_write_failures``: G4 reads / offloads the store failed
  (unavailable, timed out, or answered with an error such as a missing bucket); refusals by the open
  circuit breaker are not failures of the store, they are ``kvbm_backend_g4_load_misses{reason="breaker"}``
  / ``kvbm_backend_g4_offloads_dropped{reason="breaker"}``.

Everything KVBM has no name for is ``kvbm_backend_<tier>_*`` (dropped offloads by reason, corrupt
blocks by reason, misses by reason: ``offloads_dropped{reason}``, ``corrupt_blocks{reason}``,
``load_misses{reason}``, bytes, ``degraded``; G3 also evictions, capacity, used bytes and
blocks; G4 also ``kvbm_backend_g4_offload_seconds``, a histogram of each block offload from queued to
ended: a worker whose G4 writes stall shows there, not only as late handoffs, and
``kvbm_backend_g4_throttled{op}``, requests the store answered "slow down"). Every series listed here
is updated by the pools (``tests/core/test_metrics.py``).

Reasons: each tier lists every ``reason`` its three labelled counters can carry, with its meaning, next to
the code that counts them (G3: ``kvbm_backend.pool.g3.catalog.REASONS``; G4:
``kvbm_backend.pool.g4.events.REASONS``; docs/operations.md "Reasons" has the same tables). A pool creates
each listed series at 0 when it opens (an alert on ``rate(...{reason="enospc"}[5m])`` sees 0, not "no data").
A reason a list lacks is still counted, with one WARNING naming it (:func:`count_reason`); the test suite
fails a run that counted one (``tests/conftest.py``).

Serving: one endpoint per pod and port for every process (:mod:`kvbm_backend.metrics_mp`). When an
integration opens its tiers with ``metrics.port`` P, :func:`prepare` (before the pools exist) puts this
process's series into P's multiprocess files, and :func:`serve_once` serves ``/metrics`` on
``metrics.addr:P`` from the first process of the pod that takes P's serving lock, with every process's
series merged (the scheduler's lookups and the workers' loads in one page). The other processes log
one INFO line naming the serving process and wait for its lock: when it ends (the kernel drops its lock), one
of them serves in its place (its serving line says it "took over from process N"), and the counters of the
processes that ended stay in the sums. A port that cannot be bound (another program holds it) is one
ERROR line naming ``metrics.port``, and the engine runs on without the endpoint. A process whose
default-registry series existed before :func:`prepare` (pools opened another way first) serves only its
own series. A child forked without exec neither serves nor waits for its parent: it joins as another process
of the pod (:func:`_after_fork_in_child`).

Metric objects are created idempotently per :class:`~prometheus_client.CollectorRegistry` (the
``prometheus_client`` library refuses duplicate registration), so several pools in one process share
one set of series in the default registry; tests pass their own registry (:func:`new_registry`).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from typing import Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from . import metrics_mp
from .threads import start_thread

KVBM_PREFIX = "kvbm_"
HIT_RATE_WINDOW = 10_000  # looked-up blocks in the sliding hit-rate window

log = logging.getLogger(__name__)
_lock = threading.Lock()
_serve_lock = threading.Lock()
_servers: dict[tuple[str, int], tuple] = {}  # (addr, port) -> (server, thread, lock fd); None server: a sibling serves
_serve_failed: dict[tuple[str, int], str] = {}  # (addr, port) -> error, logged once
_by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, dict]" = weakref.WeakKeyDictionary()
_mp: dict = {}  # "dir", "classes": the default registry's series live in that port's multiprocess files
_hit_rates: "weakref.WeakSet[HitRate]" = weakref.WeakSet()  # each gets a new lock in a forked child


def _after_fork_in_child() -> None:
    """A child forked without exec (multiprocessing's fork, an engine forking its workers) is a new process
    of the pod, not the one that served or waited: new locks (another thread of the parent may have held one
    at the fork: the child's copy stays held, and its first metrics call would hang), and no serving or
    waiting state. The parent's server threads and waiting thread do not exist in the child; it closes its
    copy of the listening socket (else the port stays bound after the parent ends, and no sibling can serve
    it) and forgets them, so that :func:`serve_once` there joins as any other process of the pod (waits for
    the serve lock). :mod:`kvbm_backend.metrics_mp` closes the inherited serve-lock descriptors (the
    parent's lock stays held: it belongs to the open file description, which the parent's descriptor keeps)."""
    global _lock, _serve_lock
    _lock = threading.Lock()
    _serve_lock = threading.Lock()
    for srv, _, _ in _servers.values():
        if srv is not None:
            try:
                srv.socket.close()
            except OSError:
                pass
    _servers.clear()
    _serve_failed.clear()
    for h in list(_hit_rates):
        h._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def new_registry() -> CollectorRegistry:
    """A private registry (tests, several independent pools)."""
    return CollectorRegistry(auto_describe=True)


def prepare(port: int | None) -> bool:
    """Keep this process's default-registry series in ``metrics.port`` ``port``'s multiprocess files, so
    that the process serving the port shows them (:mod:`kvbm_backend.metrics_mp`). Call it before the
    pools are opened. True when this process's series go there; False when ``port`` is None, the series
    already exist in memory (created before: they stay process-local), they go to another port's files,
    or the directory is unusable (logged; its filesystem full included: the series stay in this process)."""
    if port is None:
        return False
    with _lock:
        if _mp:
            return _mp["port"] == int(port)
        if _by_registry.get(REGISTRY):
            log.info("kvbm_backend: metrics created before metrics.port %d was known stay in this process", port)
            return False
        d = None
        try:
            d = metrics_mp.metrics_dir(port)
            metrics_mp.begin(d)  # the first process of a new run: the earlier run's files go
            metrics_mp.reserve(d)  # its files allocated on disk now: a full disk is an error here, not a SIGBUS
        except OSError as e:
            log.warning("kvbm_backend: metrics.port %d: no multiprocess metrics directory (%s%s); this process "
                        "serves only its own series", port, f"{d}: " if d else "", e)
            return False
        _mp.update(port=int(port), dir=d, classes=metrics_mp.metric_classes(d))
        return True


def _get(registry: CollectorRegistry | None, cls, name: str, doc: str, labels: tuple[str, ...] = (), **kw):
    reg = REGISTRY if registry is None else registry
    with _lock:
        known = _by_registry.setdefault(reg, {})
        m = known.get(name)
        if m is None:
            mode = kw.pop("multiprocess_mode", None)
            make = cls
            if reg is REGISTRY and _mp:
                make = _mp["classes"][cls]
                if mode:
                    kw["multiprocess_mode"] = mode
            m = make(name, doc, labelnames=labels, registry=reg, **kw)
            known[name] = m
        elif not isinstance(m, cls):
            raise ValueError(f"metric {name}: registered as {type(m).__name__}, asked for {cls.__name__}")
        return m


def counter(name: str, doc: str, labels: tuple[str, ...] = (), registry: CollectorRegistry | None = None) -> Counter:
    """Get or create a Counter ``name`` in ``registry`` (default: the process registry).
    Note prometheus-client exposes counters with a ``_total`` suffix."""
    return _get(registry, Counter, name, doc, labels)


THROTTLED_OPS = ("get", "head", "put")  # the ops of kvbm_backend_g4_throttled_total{op}, each created at 0

#: ``kvbm_backend_g4_offload_seconds`` buckets (seconds): a loopback PUT takes ~10 ms, a WAN one ~100 ms; the
#: top buckets catch stalls beyond the S3 timeouts (``g4.timeout_s`` x ``1 + g4.retries``)
OFFLOAD_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


#: (series, reason) counted in this process that the tier's list lacks (:func:`count_reason`); the test suite
#: fails a run that leaves any here (``tests/conftest.py``)
UNLISTED: set[tuple[str, str]] = set()


def count_reason(c: Counter, listed: Mapping[str, str], reason: str, n: float = 1) -> None:
    """Add ``n`` (blocks) to ``c{reason=reason}``. ``listed``: every reason the tier documents for ``c``
    (reason -> meaning). An unlisted reason is counted anyway (never lost) and logged as one WARNING per
    series and reason, and kept in :data:`UNLISTED`: the list and docs/operations.md must gain it."""
    if reason not in listed:
        key = (c._name, reason)
        with _lock:
            new = key not in UNLISTED
            UNLISTED.add(key)
        if new:
            log.warning("kvbm_backend: %s counted reason %r, which its tier's list of reasons lacks (a bug: "
                        "alerts and docs/operations.md do not know it)", c._name, reason)
    c.labels(reason).inc(n)


def histogram(name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry | None = None) -> Histogram:
    """Get or create a Histogram ``name`` with ``buckets`` (upper bounds, seconds) in ``registry``."""
    return _get(registry, Histogram, name, doc, buckets=buckets)


def gauge(name: str, doc: str, labels: tuple[str, ...] = (), registry: CollectorRegistry | None = None,
          multiprocess_mode: str = "livesum") -> Gauge:
    """Get or create a Gauge ``name`` in ``registry``; ``multiprocess_mode``: how the serving process
    merges the processes' values (prometheus_client's modes, e.g. ``livesum``, ``livemax``,
    ``livemostrecent``)."""
    return _get(registry, Gauge, name, doc, labels, multiprocess_mode=multiprocess_mode)


def sample_value(registry: CollectorRegistry | None, name: str, labels: dict | None = None) -> float | None:
    """Current value of one sample (e.g. ``kvbm_offload_blocks_h2d_total``), None if absent."""
    reg = REGISTRY if registry is None else registry
    return reg.get_sample_value(name, labels or {})


def serve(port: int, registry: CollectorRegistry | None = None, addr: str = "127.0.0.1"):
    """Serve ``/metrics`` over HTTP on ``addr:port`` (a daemon thread). Returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=REGISTRY if registry is None else registry)


def serve_once(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve ``/metrics`` on ``addr:port`` unless this process, or another process of the pod that keeps
    its series in the same port's files (:func:`prepare`), already does.

    True when the series of this process are served (here or by that other process: one INFO line names
    it, and a thread of this process waits to take over serving when that process ends). A port that
    cannot be bound (in use by another program, no permission) logs one ERROR naming ``metrics.port`` per
    (addr, port) and process and returns False: metrics are an aid, so the engine runs on without the
    endpoint rather than failing to start.
    """
    key = (addr, int(port))
    with _serve_lock:
        if key in _servers:
            return True
        if key in _serve_failed:
            return False
        shared = _mp.get("dir") if _mp.get("port") == key[1] else None
        lock_fd = None
        if shared is not None:
            lock_fd, holder = metrics_mp.take_serve_lock(shared)
            if lock_fd is None:
                ent = _servers[key] = (None, object(), None)  # the middle: this wait's token
                log.info("kvbm_backend: metrics.port %d is served by process %s of this pod; this process's "
                         "series are collected there", key[1], holder)
                start_thread(_stand_by, args=(key, shared, ent), name=f"kvbm-metrics-{key[1]}")
                return True
        return _start(key, shared, lock_fd, "")


def _start(key: tuple[str, int], shared: str | None, lock_fd: int | None, note: str) -> bool:
    """Start serving ``key`` (under ``_serve_lock``; the serve lock of ``shared`` held as ``lock_fd``)."""
    addr, port = key
    started = False
    try:
        reg = metrics_mp.registry_for(shared) if shared is not None else REGISTRY
        srv, thread = start_http_server(port, addr=addr, registry=reg)
        _servers[key] = (srv, thread, lock_fd)
        started = True
    except Exception as e:  # noqa: BLE001 - OSError (port in use), UnicodeError (an address getaddrinfo refuses)...
        _serve_failed[key] = str(e)
        log.error("metrics.port %d: cannot serve Prometheus /metrics on %s:%d (%s); running on WITHOUT a "
                  "metrics endpoint. Pick a free port (metrics.port, DYN_KVBM_METRICS_PORT or "
                  "KVBM_BACKEND__METRICS__PORT)", port, addr, port, getattr(e, "strerror", None) or e)
        return False
    finally:
        if not started:  # a sibling of the pod may serve the port: never keep its lock
            metrics_mp.drop_serve_lock(lock_fd)
    log.info("kvbm_backend: serving Prometheus metrics on http://%s:%d/metrics%s", addr, port,
             f" (every process of this pod with this metrics.port{note})" if shared else "")
    return True


def _stand_by(key: tuple[str, int], shared: str, ent: tuple) -> None:
    """A sibling's thread: wait for the serve lock (the kernel releases it when the serving process ends),
    then serve in its place."""
    try:
        fd, before = metrics_mp.wait_serve_lock(shared)
    except OSError as e:
        log.warning("kvbm_backend: metrics.port %d: cannot wait to take over serving (%s)", key[1], e)
        return
    with _serve_lock:
        if _servers.get(key) is not ent:  # stop_serving (tests) forgot this wait
            metrics_mp.drop_serve_lock(fd)
            return
        del _servers[key]
        _start(key, shared, fd, f"; took over from process {before}, which stopped serving")


def stop_serving(port: int, addr: str = "0.0.0.0") -> None:
    """Stop a server :func:`serve_once` started (tests); forgets a failed bind too."""
    key = (addr, int(port))
    with _serve_lock:
        ent = _servers.pop(key, None)
        _serve_failed.pop(key, None)
    if ent is not None and ent[0] is not None:
        ent[0].shutdown()
        ent[0].server_close()
    if ent is not None:
        metrics_mp.drop_serve_lock(ent[2])


def series_names() -> set[str]:
    """Names of every sample series :class:`TierMetrics` exposes for G3 and G4 (counters with
    ``_total``, histograms with ``_bucket`` / ``_count`` / ``_sum``), from a fresh registry: what a
    dashboard or alert may query (``examples/grafana/kvbm-backend.json`` is checked against it)."""
    reg = new_registry()
    TierMetrics("g3", reg)
    TierMetrics("g4", reg)
    out: set[str] = set()
    for fam in reg.collect():
        if fam.type == "counter":
            out.add(fam.name + "_total")
        elif fam.type == "histogram":
            out.update(fam.name + s for s in ("_bucket", "_count", "_sum"))
        else:
            out.add(fam.name)
    return out


class HitRate:
    """Sliding-window hit rate over the last ``window`` looked-up blocks, mirrored into a Gauge."""

    def __init__(self, g: Gauge, window: int = HIT_RATE_WINDOW):
        self._g = g
        self._win: collections.deque = collections.deque()
        self._window = window
        self._hits = 0
        self._n = 0
        self._lock = threading.Lock()
        _hit_rates.add(self)

    def _after_fork(self) -> None:
        """In a forked child: a new lock, and the sums again from the window (a thread of the parent may have
        been between the two at the fork)."""
        self._lock = threading.Lock()
        self._n = sum(r for r, _ in self._win)
        self._hits = sum(h for _, h in self._win)

    def record(self, requested: int, hit: int) -> None:
        """One lookup: ``requested`` blocks asked for, ``hit`` of them found."""
        if requested <= 0:
            return
        with self._lock:
            self._win.append((requested, hit))
            self._n += requested
            self._hits += hit
            while self._n > self._window and len(self._win) > 1:
                r, h = self._win.popleft()
                self._n -= r
                self._hits -= h
            self._g.set(self._hits / self._n if self._n else 0.0)

    @property
    def value(self) -> float:
        with self._lock:
            return self._hits / self._n if self._n else 0.0


class TierMetrics:
    """The series one tier's pool updates.

    Args:
        tier: ``g3`` or ``g4`` (lower case; used in our own names ``kvbm_backend_<tier>_*``).
        registry: where to register (None: the process registry).
        reasons: the tier's reasons, ``{attribute: {reason: meaning}}`` for ``offloads_dropped``, ``misses``
            and ``corrupt`` (the pools pass their tier's ``REASONS``): each series is created at 0 now.

    KVBM-named series: ``offload_blocks`` (``kvbm_offload_blocks_h2d`` for g3, ``_d2o`` for g4),
    ``onboard_blocks`` (``kvbm_onboard_blocks_d2d`` / ``_o2d``), ``matched_tokens``, ``hit_rate``;
    g4 only: ``read_failures``, ``write_failures`` (``kvbm_object_read_failures`` / ``_write_failures``),
    ``offload_seconds`` (histogram, :data:`OFFLOAD_SECONDS_BUCKETS`), ``throttled{op}`` (requests the
    store answered "slow down", each retried after a backoff: ``kvbm_backend_g4_throttled``; one series per op
    of :data:`THROTTLED_OPS`, each created at 0).
    Ours: ``offloads_dropped{reason}``, ``corrupt{reason}``, ``misses{reason}``, ``bytes_written``,
    ``bytes_read``, ``degraded``; g3 only (G4 has no capacity or eviction of its own; ``gc`` trims
    it): ``evictions``, ``capacity_bytes``, ``used_bytes``, ``blocks``. Attributes a tier lacks are None.
    """

    _KVBM = {"g3": ("offload_blocks_h2d", "onboard_blocks_d2d", "disk_cache_hit_rate"),
             "g4": ("offload_blocks_d2o", "onboard_blocks_o2d", "object_cache_hit_rate")}

    def __init__(self, tier: str, registry: CollectorRegistry | None = None,
                 reasons: Mapping[str, Mapping[str, str]] | None = None):
        tier = tier.lower()
        if tier not in self._KVBM:
            raise ValueError(f"tier: expected g3 or g4, got {tier!r}")
        off, on, hr = self._KVBM[tier]
        r = registry
        p = f"kvbm_backend_{tier}_"
        self.registry = REGISTRY if registry is None else registry
        self.offload_blocks = counter(KVBM_PREFIX + off, f"Blocks offloaded to {tier.upper()} (durable, published)",
                                      registry=r)
        self.onboard_blocks = counter(KVBM_PREFIX + on, f"Blocks onboarded from {tier.upper()} (verified)", registry=r)
        self.matched_tokens = counter(KVBM_PREFIX + "matched_tokens", "Tokens matched by prefix lookups", registry=r)
        self.hit_rate = HitRate(gauge(KVBM_PREFIX + hr, f"{tier.upper()} lookup hit rate (0-1), sliding window",
                                      registry=r, multiprocess_mode="livemostrecent"))
        self.offloads_dropped = counter(p + "offloads_dropped", "Offload blocks dropped, by reason", ("reason",), r)
        self.corrupt = counter(p + "corrupt_blocks", "Stored blocks that failed verification, by reason",
                               ("reason",), r)
        self.misses = counter(p + "load_misses", "Blocks asked for and not served, by reason", ("reason",), r)
        self.bytes_written = counter(p + "bytes_written", "Bytes written (frames incl. headers)", registry=r)
        self.bytes_read = counter(p + "bytes_read", "Bytes read (frames incl. headers)", registry=r)
        self.evictions = self.capacity_bytes = self.used_bytes = self.blocks = None
        self.read_failures = self.write_failures = self.offload_seconds = self.throttled = None
        if tier == "g3":
            self.evictions = counter(p + "evictions", "Blocks evicted (LRU) to make room", registry=r)
            self.capacity_bytes = gauge(p + "capacity_bytes", "Slot bytes the tier may use now", registry=r)
            self.used_bytes = gauge(p + "used_bytes", "Slot bytes holding published blocks", registry=r)
            self.blocks = gauge(p + "blocks", "Published blocks", registry=r)
        else:
            self.read_failures = counter(KVBM_PREFIX + "object_read_failures",
                                         "G4 block reads the store failed (unavailable, timeout, error)", registry=r)
            self.write_failures = counter(KVBM_PREFIX + "object_write_failures",
                                          "G4 block writes the store failed (unavailable, error)", registry=r)
            self.offload_seconds = histogram(p + "offload_seconds", "Seconds from a block offload queued to its end "
                                             "(written, skipped or dropped): queue wait, seal, store request",
                                             OFFLOAD_SECONDS_BUCKETS, registry=r)
            self.throttled = counter(p + "throttled", "G4 requests the store answered 'slow down' (S3 503 SlowDown, "
                                     "429), by op (get, head, put); each is retried after a jittered backoff",
                                     ("op",), r)
            for op in THROTTLED_OPS:
                self.throttled.labels(op)  # exported (at 0) before the store first throttles
        self.degraded = gauge(p + "degraded", "1 while the tier stopped admitting (ENOSPC, store down)", registry=r,
                              multiprocess_mode="livemax")
        for attr, listed in (reasons or {}).items():
            c = getattr(self, attr)
            for reason in listed:
                c.labels(reason)  # the series exists (at 0) before its first event
