"""What a G4 pool reports: its counters (``stats()``, mirrored into Prometheus) and its operator log lines.

* :class:`G4Counters` -- the named counters every part of the pool adds to (``hits``, ``written``,
  ``miss_<reason>``, ``dropped_<reason>``, ``corrupt_<reason>``, ``throttled_<op>``, ...) and their
  :class:`~kvbm_backend.metrics.TierMetrics` series; thread-safe. :data:`REASONS`: every ``<reason>`` of
  the dropped / miss / corrupt counters, with its meaning.
* :func:`set_degraded` -- ``kvbm_backend_g4_degraded``: the maximum over the process's pools (1 while any
  pool's circuit breaker is open).
* :class:`StatsGauges` -- the ``kvbm_g4_*`` gauges of one registry: the ``stats()`` of its open pools, summed.
* :class:`OperatorLog` -- the pool's operator log lines about the store (a missing bucket, a store that
  refuses requests, one that refuses writes for room: full, over quota, read-only; a load or lookup that failed
  unexpectedly: at most one line per kind per :data:`STORE_ERROR_LOG_S` seconds) and about tenants
  whose offloads are dropped (once per reason and tenant pseudonym, at most :data:`MAX_LOGGED_TENANTS`
  of them). They keep the logger they have always had, ``kvbm_backend.pool.g4.pool`` (operators and
  ``tests/pool/test_operator_logs.py`` filter on that name).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from ...metrics import TierMetrics, count_reason
from .store import BucketMissing, StoreFull
from ...store_url import redact_url

# the pool's logger: operator lines are looked up by this name (docstring)
log = logging.getLogger("kvbm_backend.pool.g4.pool")

__all__ = ["G4Counters", "StatsGauges", "set_degraded", "OperatorLog", "MAX_LOGGED_TENANTS", "STORE_ERROR_LOG_S",
           "REASONS", "DROP_REASONS", "MISS_REASONS", "CORRUPT_REASONS"]

MAX_LOGGED_TENANTS = 1024  # log lines about unknown/revoked tenants: at most this many distinct ones
STORE_ERROR_LOG_S = 300.0  # a store that keeps answering with an error (missing bucket, 403): one line per this
# Every reason the tier's labelled counters carry, with its meaning (docs/operations.md "Reasons" lists the same:
# tests/core/test_metric_reasons.py): the ``dropped_<reason>``, ``miss_<reason>`` and ``corrupt_<reason>``
# counters (writer.py, settle.py, reader.py), mirrored by G4Counters. Each series exists at 0 from the pool's
# start (TierMetrics reasons=); a reason counted that is not here is logged (metrics.count_reason).
#: ``kvbm_backend_g4_offloads_dropped{reason}``: queued or refused offloads not stored
DROP_REASONS = {
    "closed": "the pool was closing (put after close, or still queued)",
    "breaker": "refused while the circuit breaker was open (store unavailable)",
    "queue_full": "the offload queue held g4.write_queue_blocks already",
    "revoked_tenant": "the tenant was revoked (pools with a keyring, encrypted or not)",
    "unknown_tenant": "the keyring has no key for the tenant (encrypted pools)",
    "keyring": "the keyring failed otherwise (file does not load)",
    "unavailable": "the store did not answer (timeout, connection error, 5xx), or an unsettled PUT was found lost",
    "throttled": "the store kept answering 'slow down' past the offload's bound",
    "full": "the store refused the write for room: full (ENOSPC), over quota (EDQUOT) or read-only (EROFS); "
            "never a breaker failure, loads are still served",
    "error": "the store answered with an error (403, a missing bucket), or a bug",
    "unsettled": "a PUT that got no answer could not be settled by a HEAD within its bound or by close; also a late "
                 "settle's republish cut short by that bound or by close (nothing stored)",
}
#: ``kvbm_backend_g4_load_misses{reason}``: blocks asked for and not served
MISS_REASONS = {
    "absent": "no such object",
    "closed": "the pool was closing",
    "breaker": "refused while the circuit breaker was open, or half-open with every read thread still busy",
    "timeout": "no verified answer within the load bound (timeout_s x (1 + retries))",
    "throttled": "the store kept answering 'slow down' past the load bound",
    "unavailable": "the store did not answer",
    "error": "the store answered with an error (403, a missing bucket), or a bug",
    "foreign_namespace": "a key of another namespace",
    "revoked_tenant": "the tenant was revoked (pools with a keyring, encrypted or not)",
    "keyring_unavailable": "the keyring file does not load (pools with a keyring fail closed)",
    "no_key": "the keyring has no key the object was sealed with (an unknown tenant, a retired key)",
    "key_mismatch": "other key material under the object's key id and version (a diverged keyring copy); kept",
    "unencrypted_object": "a plaintext object in an encrypted pool (never served; deleted where confirmed)",
    "corrupt": "the object failed its checks (corrupt_blocks says which); deleted where confirmed",
    "unconfirmed_corrupt": "the bytes read failed a check the store does not confirm it holds (garbled in transit); kept",
    "other_digest": "a verified frame of another token sequence under this name (another nonzero token digest); kept",
}
#: ``kvbm_backend_g4_corrupt_blocks{reason}``: objects whose bytes failed a check (a FrameError reason)
CORRUPT_REASONS = {
    "magic": "the object holds no frame (magic bytes wrong)",
    "version": "a frame format this reader does not know",
    "header_check": "the header's own checksum does not match",
    "identity": "the frame names another block (key, tenant, TP world)",
    "layout": "the frame's layout differs from the namespace's",
    "length": "the object's size or the frame's lengths do not fit",
    "integrity": "the payload's checksum or AEAD tag does not verify",
    "key_owner": "sealed under another tenant's data key",
    "token_digest": "written without a token digest, asked for by a key that names one (re-stored with it)",
}
#: ``TierMetrics`` attribute -> its reasons (``TierMetrics("g4", reasons=REASONS)``)
REASONS = {"offloads_dropped": DROP_REASONS, "misses": MISS_REASONS, "corrupt": CORRUPT_REASONS}
# miss reasons that are failed store reads
_READ_FAILURES = {"unavailable", "error", "timeout", "unconfirmed_corrupt", "throttled"}
_WRITE_FAILURES = {"unavailable", "error", "throttled", "unsettled", "full"}  # drop reasons that are failed store writes


_degraded: dict[int, dict[int, int]] = {}  # id(degraded gauge) -> {id(pool): 1 while its breaker is open, else 0}
_degraded_lock = threading.Lock()


def set_degraded(gauge: Gauge, pool: object, value: int | None) -> None:
    """Set a ``degraded`` gauge to the maximum over the process's G4 pools on it (a hybrid model opens one
    pool per KV cache group, all on the process's one series), ``pool``'s part now ``value`` (None: it closed)."""
    with _degraded_lock:
        parts = _degraded.setdefault(id(gauge), {})
        if value is None:
            parts.pop(id(pool), None)
        else:
            parts[id(pool)] = value
        gauge.set(max(parts.values(), default=0))
        if not parts:
            del _degraded[id(gauge)]


def _after_fork_in_child() -> None:
    """A child forked without exec starts with no pool's part (its parent's pools are not its own) and a new lock
    (another thread of the parent may have held it at the fork). Before 2026-12-04 a child that opened a G4 pool of
    its own kept its parent's part: its ``degraded`` stayed 1 for good when the parent's breaker was open then."""
    global _degraded_lock
    _degraded_lock = threading.Lock()
    _degraded.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class StatsGauges:
    """The ``kvbm_g4_<stat>`` gauges of one registry: each numeric ``stats()`` value summed over the open G4
    pools that registry was given to (a boolean counts the pools where it holds). One collector per
    registry (:meth:`join`): prometheus_client refuses a second collector of the same names."""

    _lock = threading.Lock()
    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, StatsGauges] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._pools: dict[int, Any] = {}  # id(pool) -> pool, while open
        self._pools_lock = threading.Lock()  # not _lock: register() collects while join holds that

    @classmethod
    def join(cls, registry: CollectorRegistry, pool: Any) -> None:
        """Export ``pool.stats()`` in ``registry`` (until :meth:`leave`)."""
        with cls._lock:
            c = cls._by_registry.get(registry)
            if c is None:
                c = cls._by_registry[registry] = cls()
                registry.register(c)
            with c._pools_lock:
                c._pools[id(pool)] = pool

    @classmethod
    def leave(cls, registry: CollectorRegistry, pool: Any) -> None:
        with cls._lock:
            c = cls._by_registry.get(registry)
        if c is not None:
            with c._pools_lock:
                c._pools.pop(id(pool), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._pools_lock:
            pools = list(self._pools.values())
        total: dict[str, float] = {}
        for pool in pools:
            for k, v in pool.stats().items():
                if isinstance(v, (bool, int, float)):
                    total[k] = total.get(k, 0) + v
        for k, v in total.items():
            yield GaugeMetricFamily(f"kvbm_g4_{k}", f"G4 pools {k} (sum over the open pools)", value=v)


class G4Counters:
    """The pool's named counters and their Prometheus series.

    Args:
        metrics: the tier's series (:class:`~kvbm_backend.metrics.TierMetrics` of ``"g4"``).
        page_size: tokens per block (for ``kvbm_matched_tokens``).
    Raises:
        ValueError: ``metrics`` lacks the G4-only series (a TierMetrics of another tier).
    """

    def __init__(self, metrics: TierMetrics, page_size: int):
        m = metrics
        if m.read_failures is None or m.write_failures is None or m.throttled is None or m.offload_seconds is None:
            raise ValueError("G4Counters: metrics must be a TierMetrics('g4') (read/write failures, throttled, "
                             "offload_seconds)")
        self.metrics = metrics
        self._read_failures: Counter = m.read_failures
        self._write_failures: Counter = m.write_failures
        self._throttled: Counter = m.throttled
        self._offload_seconds: Histogram = m.offload_seconds
        self._page_size = page_size
        self._mu = threading.Lock()
        self._c: dict[str, int] = {}

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (and its Prometheus series); ``n`` 0 does nothing."""
        if n:
            with self._mu:
                self._c[name] = self._c.get(name, 0) + n
            self._export(name, n)

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter counted so far (name -> count)."""
        with self._mu:
            return dict(self._c)

    def offload_ended(self, seconds: float) -> None:
        """One block offload ended ``seconds`` after it was queued (``kvbm_backend_g4_offload_seconds``)."""
        self._offload_seconds.observe(seconds)

    def lookup_result(self, requested: int, found: int) -> None:
        """A lookup of ``requested`` blocks matched ``found`` leading ones: matched tokens and hit rate."""
        self.metrics.matched_tokens.inc(found * self._page_size)
        self.metrics.hit_rate.record(requested, found)

    def _export(self, name: str, n: int) -> None:
        """Mirror one stats counter into the Prometheus series (:class:`kvbm_backend.metrics.TierMetrics`)."""
        m = self.metrics
        kind, _, reason = name.partition("_")
        if name == "written":
            m.offload_blocks.inc(n)
        elif name == "hits":
            m.onboard_blocks.inc(n)
        elif name == "bytes_written":
            m.bytes_written.inc(n)
        elif name == "bytes_read":
            m.bytes_read.inc(n)
        elif kind == "dropped":
            count_reason(m.offloads_dropped, DROP_REASONS, reason, n)
            if reason in _WRITE_FAILURES:
                self._write_failures.inc(n)
        elif kind == "miss":
            count_reason(m.misses, MISS_REASONS, reason, n)
            if reason in _READ_FAILURES:
                self._read_failures.inc(n)
        elif kind == "corrupt":
            count_reason(m.corrupt, CORRUPT_REASONS, reason, n)
        elif kind == "throttled":
            self._throttled.labels(reason).inc(n)
        elif name == "lookup_unavailable":
            self._read_failures.inc(n)


class OperatorLog:
    """The pool's operator log lines, rate-limited (see the module docstring).

    Args:
        where: how lines name the store (``"G4 s3://bucket/prefix at http://..."``, credentials redacted).
        endpoint_url: ``g4.endpoint_url`` (named in the missing-bucket hint), or None.
        namespace: the pool's namespace fingerprint (named in tenant lines).
    """

    def __init__(self, where: str, endpoint_url: str | None, namespace: str):
        self.where = where
        self._endpoint_url = endpoint_url
        self._fp = namespace
        self._mu = threading.Lock()
        self.store_errors_logged: dict[str, float] = {}  # kind -> time.monotonic() when last logged
        self.read_errors_logged: dict[str, float] = {}  # the same for loads' and lookups' errors (never reset)
        self.logged_tenants: set[tuple[str, str]] = set()  # (reason, tenant pseudonym hex) logged once
        self.unexpected_logged: dict[str, float] = {}  # "what: exception type" -> time.monotonic() when last logged
        self.full_logged: dict[str, float] = {}  # errno name -> time.monotonic() when last logged (never reset)

    def store_error(self, e: OSError, read: bool = False) -> None:
        """The store answered with an error (not an outage): log it, at most once per kind per
        :data:`STORE_ERROR_LOG_S` seconds. A missing bucket is named with how to create it. ``read``: a load's or
        lookup's error, rate-limited on its own: a successful write (:meth:`store_ok`) does not reset it, so a
        store that takes PUTs but refuses GETs (or one object's name) logs one line per period, not one per write."""
        kind = "bucket_missing" if isinstance(e, BucketMissing) else "store_error"
        logged = self.read_errors_logged if read else self.store_errors_logged
        now = time.monotonic()
        with self._mu:
            last = logged.get(kind)
            if last is not None and now - last < STORE_ERROR_LOG_S:
                return
            logged[kind] = now
        if isinstance(e, BucketMissing):
            ep = f" --endpoint-url {redact_url(self._endpoint_url)}" if self._endpoint_url else ""
            log.error("%s: bucket %r does not exist: every G4 offload is dropped and every load misses until it "
                      "is created (kvbm-backend never creates buckets). Create it, e.g. `aws s3 mb s3://%s%s`, "
                      "or fix g4.url", self.where, e.bucket, e.bucket, ep)
        else:
            log.warning("%s: the store refuses requests: %s (offloads dropped as dropped_error, loads miss as "
                        "miss_error; check credentials and permissions); repeated at most every %.0f s",
                        self.where, e, STORE_ERROR_LOG_S)

    def store_full(self, e: StoreFull) -> None:
        """The store refused a write for room (no space, over quota, read-only: ``dropped_full``): a WARNING naming
        the errno and the mount, at most once per errno per :data:`STORE_ERROR_LOG_S` seconds (a write that
        succeeds meanwhile does not reset it: a mount at the brink of full alternates). Never raises."""
        kind = errno.errorcode.get(e.errno or 0, str(e.errno))
        now = time.monotonic()
        with self._mu:
            last = self.full_logged.get(kind)
            if last is not None and now - last < STORE_ERROR_LOG_S:
                return
            self.full_logged[kind] = now
        try:
            log.warning("%s: the store refuses writes (%s%s): %s; offloads are dropped as dropped_full, "
                        "loads are still served (not an outage: the circuit breaker stays closed); free space "
                        "(`kvbm-backend gc`), raise the quota or remount read-write; repeated at most every %.0f s",
                        self.where, kind, f", mount {e.mount}" if e.mount else "", e, STORE_ERROR_LOG_S)
        except Exception:  # noqa: BLE001 - logging never fails an offload
            pass

    def unexpected(self, e: BaseException, what: str) -> None:
        """A G4 ``what`` (``"load"``, ``"lookup"``) failed with an exception no store, I/O or frame error explains
        (a bug, e.g. a TypeError; it stays a miss / an absent key): an ERROR naming its type and message, at most
        once per (``what``, exception type) per :data:`STORE_ERROR_LOG_S` seconds (at most 64 types), with the
        traceback the first time that type is logged. Never raises."""
        kind = f"{what}: {type(e).__name__}"
        now = time.monotonic()
        with self._mu:
            last = self.unexpected_logged.get(kind)
            if (last is not None and now - last < STORE_ERROR_LOG_S) or (last is None and len(
                    self.unexpected_logged) >= 64):
                return
            self.unexpected_logged[kind] = now
        try:
            log.error("%s: a G4 %s failed unexpectedly (%s: %s): a miss, never served; not a store error: "
                      "please report it with this line's traceback; repeated at most every %.0f s", self.where,
                      what, type(e).__name__, e, STORE_ERROR_LOG_S, exc_info=e if last is None else None)
        except Exception:  # noqa: BLE001 - logging never fails a load
            pass

    def store_ok(self) -> None:
        """A write succeeded: clear logged store errors (one INFO line when the bucket appeared). Cheap
        when nothing was logged (the writer calls it after every written block)."""
        if not self.store_errors_logged:
            return
        with self._mu:
            had = self.store_errors_logged.pop("bucket_missing", None)
            self.store_errors_logged.clear()
        if had is not None:
            log.info("%s: bucket exists now, G4 offloads are stored again", self.where)

    def tenant_once(self, reason: str, pseudonym_hex: str, err: Exception | str) -> None:
        """An offload of the tenant with pseudonym ``pseudonym_hex`` was dropped for ``reason`` (a
        ``dropped_*`` counter): one WARNING per (reason, tenant), never the tenant id itself (``err``, the
        reason's text, must not hold it: the writer passes a fixed text per reason, never a keyring message)."""
        tag = (reason, pseudonym_hex)
        with self._mu:
            if tag in self.logged_tenants or len(self.logged_tenants) >= MAX_LOGGED_TENANTS:
                return
            self.logged_tenants.add(tag)
            last = len(self.logged_tenants) >= MAX_LOGGED_TENANTS
        log.warning("G4: offload for tenant pseudonym %s %s (%s): %s%s", tag[1], reason, self._fp, err,
                    "; further tenants are counted, not logged" if last else "")
