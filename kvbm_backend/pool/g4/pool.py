"""G4Pool: the persistent, shared, per-tenant encrypted block pool on S3 or a shared POSIX mount.

Each block is one object (``docs/format.md`` frame: 4 KiB header + payload, no padding) named
``{prefix}/{ns_fp}/{tenant_pseudonym}/{rank}/{fanout}/{block_id}`` (:mod:`.naming`: ``block_id`` is a keyed
HMAC of namespace, rank and sequence hash under the tenant's naming key from the keyring, so a listing
reveals no sequence hash). No state that lives only in one process is needed to read G4: a new pool, on
any node, with the same keyring, finds blocks by name.

* Encrypted (default): AES-256-GCM under the tenant's data key (:mod:`kvbm_backend.crypto`), random
  96-bit nonce in the header, tag in ``integrity``, AAD = the expected header identity, so a blob
  swapped to another name or tenant fails to open. ``encrypt=False`` stores xxh3_128 checksummed
  plaintext and ``stats()["encrypted"]`` says so.
* Never blocks the caller: every call returns a Future at once; requests run on a pool of
  ``max_inflight`` threads for reads and as many for offloads (stuck reads never hold back offloads,
  nor the reverse). Loads and lookups resolve within ``timeout_s * (1 + retries)`` seconds:
  what is not back by then is a miss (``miss_timeout``), and a late reply never touches the
  caller's buffer. Offloads beyond ``write_queue_blocks`` pending blocks are dropped and counted.
* A circuit breaker (:mod:`.breaker`) turns a dead store into immediate misses/drops and probes it
  every ``breaker_reset_s`` seconds; the pool recovers by itself. A get or lookup batch that expires
  counts as a store failure too: a store that never answers (a hung NFS hard mount, where a read
  blocks in the kernel and raises nothing) opens the breaker like one that refuses connections, so
  later calls stop queueing behind the stuck I/O threads.
* A store that answers "slow down" (S3 ``503 SlowDown``, 429: :class:`~.store.StoreThrottled`) is up, not
  down: such answers never count towards the breaker. Gets and lookups retry them after a full-jitter
  backoff (:mod:`.throttle`: 50 ms doubling to at most 1 s) inside their load bound, offloads inside
  ``timeout_s * (1 + retries)`` from their first request; what is still throttled then is a miss
  (``miss_throttled``), a lookup cut short (``lookup_throttled``) or a dropped offload
  (``dropped_throttled``). Each throttled answer counts ``throttled_<op>`` (op ``get``, ``head``, ``put``;
  their sum is ``stats()["throttled"]``, the series ``kvbm_backend_g4_throttled_total{op}``).
* Corrupt, truncated, swapped or foreign objects are misses, counted under ``corrupt_<reason>`` and
  deleted (a corrupt object would otherwise block re-publishing forever under create-exclusive).
  Objects sealed under keys this keyring does not hold (revoked or foreign tenants) are misses
  (``miss_no_key``) and are left for ``kvbm-backend gc``. An object sealed under another tenant's
  key id (a blob sealed with B's key under A's name and identity) is ``corrupt_key_owner``.
* Tenants (encrypted pools): loads and lookups of a revoked tenant, or while the keyring file does
  not load, are misses without store I/O (``miss_revoked_tenant``, ``miss_keyring_unavailable``); an
  unknown tenant's loads are misses too (no key: ``miss_no_key``, or absent); offloads are
  dropped (``dropped_revoked_tenant``, ``dropped_unknown_tenant``, ``dropped_keyring``), logged once
  per tenant pseudonym (never the tenant id: it is the request's cache_salt). The keyring re-reads
  its file at most every ``g4.keyring.reload_interval_s``: a revocation reaches a running pool within
  that bound (plus requests already in flight).

Modules, by job (one class, :class:`G4Pool`, assembled from mixins): this module holds the public API,
construction, shutdown, names and tenant pseudonyms, counters/metrics and the operator log lines (the
``kvbm_backend.pool.g4.pool`` logger); :mod:`.writer` seals and publishes offloads; :mod:`.reader` loads,
lookups and the bounce buffers; stores are opened by URL scheme in :mod:`.factory`.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ...crypto.keyring import Keyring, KeyringError
from ...crypto.names import UNKEYED_PSEUDONYM_KEY, derive_name_key
from ...memory import BufferPool
from ...metrics import TierMetrics
from ...model.frame import HEADER_BYTES, FrameHeader
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, KeyRun, Namespace, tenant_bytes
from ..base import GetResult, PutResult, completed, is_tensor_batch
from ...deadlines import Deadline, Deadlines
from .breaker import CircuitBreaker
from .factory import open_store
from .naming import TenantNamer, legacy_block_name
from .reader import ReaderMixin, _Batch, bounce_buffers, bounce_slot_bytes
from .store import BucketMissing, ObjectStore, redact_url
from .throttle import ThrottleMixin
from .writer import WriterMixin

log = logging.getLogger(__name__)

__all__ = ["G4Pool"]
_MAX_LOGGED_TENANTS = 1024  # log lines about unknown/revoked tenants: at most this many distinct ones
TENANT_CACHE_ENTRIES = 4096  # tenants whose pseudonym and naming key a pool keeps (LRU); more are recomputed
_STORE_ERROR_LOG_S = 300.0  # a store that keeps answering with an error (missing bucket, 403): one line per this
# miss reasons that are failed store reads
_READ_FAILURES = {"unavailable", "error", "timeout", "unconfirmed_corrupt", "throttled"}
_WRITE_FAILURES = {"unavailable", "error", "throttled"}  # drop reasons that are failed store writes


class G4Pool(WriterMixin, ReaderMixin, ThrottleMixin):
    """BlockPool over an object store (tier ``"G4"``).

    Args:
        cfg: :class:`kvbm_backend.config.G4Config` (``url`` required; ``keyring.path`` required
            when ``encrypt``).
        namespace: what the blocks mean; keys of other namespaces are misses.
        registry: optional ``prometheus_client`` registry for the :class:`~kvbm_backend.metrics.TierMetrics`
            series (default: the process registry); given, the pool's :meth:`stats` are also exported
            there as ``kvbm_g4_*`` gauges.
        store, keyring: injected instances (tests, benchmarks); built from ``cfg`` when None.
    Raises:
        ValueError / KeyringError with the field at fault (missing URL, keyring, bad KEK, ...).
    """

    tier = "G4"

    def __init__(self, cfg, namespace: Namespace, *, registry=None, store: ObjectStore | None = None,
                 keyring: Keyring | None = None):
        self.cfg = cfg
        self.namespace = namespace
        self._layout = namespace.layout
        self._bpb = namespace.layout.bytes_per_block
        self._world = namespace.tp_world_size
        self._fp = namespace.fingerprint
        self.encrypt = bool(cfg.encrypt)
        if store is None and not cfg.url:
            raise ValueError("g4.url: required (s3://BUCKET/PREFIX, file:///path or mem://NAME)")
        self.keyring = keyring
        if self.keyring is None and (self.encrypt or cfg.keyring.path):
            self.keyring = Keyring.from_config(cfg.keyring)
        self._own_store = store is None
        try:
            self.store = store or open_store(cfg.url, cfg)
        except BaseException:  # a failed start leaves nothing open (issue 22 item 3)
            if self.keyring is not None and keyring is None:
                self.keyring.close()
            raise
        self.metrics = TierMetrics("g4", registry)
        where = f" at {redact_url(cfg.endpoint_url)}" if cfg.endpoint_url and self._own_store else ""
        self.where = f"G4 {redact_url(self.store.url)}{where}"  # operator log lines name the store this way
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s, name=self.where,
                                      on_change=self._on_breaker_change)
        self._store_errors_logged: dict[str, float] = {}  # kind -> when last logged
        # reads (gets, lookups, deletes) and writes (offloads) on threads of their own: stuck reads (a hung
        # mount, objects whose open blocks) never hold back offloads of other blocks, nor stuck writes loads
        self._io = ThreadPoolExecutor(cfg.max_inflight, thread_name_prefix="g4-io")
        self._io_put = ThreadPoolExecutor(cfg.max_inflight, thread_name_prefix="g4-put")
        # get() into torch tensors waits on its own host get here (never on an _io thread it needs)
        self._device_exec = ThreadPoolExecutor(2, thread_name_prefix="g4-device")
        # Stores that read straight into a buffer (file://) get reusable huge-page bounce buffers, one
        # per I/O thread (see bounce_buffers for the measured reason); others return their own bytes.
        self._bounce_bytes = bounce_slot_bytes(HEADER_BYTES + self._bpb)
        self._bounce = (bounce_buffers(HEADER_BYTES + self._bpb, cfg.max_inflight)
                        if getattr(self.store, "reads_into", False) else None)
        # frames of offloads (and plaintext staging of reads whose body is read-only, S3): reused, kept up
        # to one per I/O thread of each kind, allocated on first use (a fresh 2 MiB bytearray per block cost
        # page faults and zeroing: ~0.1-0.3 CPU-s/GB, issue 25)
        self._frame_bytes = HEADER_BYTES + self._bpb
        self._frames = BufferPool("host", 2 * cfg.max_inflight * self._frame_bytes, name="g4-frames")
        self._deadlines = Deadlines("g4-deadlines")
        self._load_bound_s = cfg.timeout_s * (1 + cfg.retries) + 0.05
        self._mu = threading.Lock()
        self._c: dict[str, int] = {}
        # tenant -> TenantNamer (pseudonym + naming key), LRU-bounded: a flood of distinct cache_salts
        # (each a tenant) costs one HMAC per miss, never memory (200k tenants once held 75 MB here)
        self._namer = functools.lru_cache(maxsize=TENANT_CACHE_ENTRIES)(self._new_namer)
        self._logged_tenants: set[tuple[str, str]] = set()
        self._pending_put_blocks = 0
        self._put_futures: set[Future] = set()
        self._closed = False
        self._ns_written = False
        self._io_put.submit(self._write_namespace_json)
        if registry is not None:
            self._register_metrics(registry)

    # ---- BlockPool ------------------------------------------------------------------------
    @property
    def layout(self) -> KvLayout:
        return self._layout

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> Future:
        """Number of leading ``keys`` present (HEAD requests in growing parallel waves, stopping at the
        first absent one). A store that does not answer within the load bound counts as absent. A
        :class:`~kvbm_backend.model.namespace.KeyRun` makes its BlockKeys only for the keys a wave probes."""
        if type(keys) is not KeyRun:
            keys = list(keys)
        self._count("lookups")
        if not keys or self._closed:
            return completed(0)
        if self.breaker.refuse_if_open():  # answered here: never queued behind stuck I/O threads
            self._lookup_result(len(keys), 0)
            return completed(0)
        d = Deadline(self._load_bound_s)
        b = _Batch(len(keys), d.at)
        b.count = 0  # leading confirmed
        self._deadlines.add(d.at, lambda: self._expire_lookup(b))
        self._lookup_wave(b, keys, 0, min(8, len(keys)))
        return b.future

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray]) -> Future:
        """Offload blocks (1-D uint8 arrays of ``layout.bytes_per_block`` bytes). The future gives a
        :class:`PutResult`; storage trouble drops and counts, never raises. Raises ValueError at once
        for mismatched lengths, wrong-sized buffers or a key of another namespace (caller bugs; G3 does
        the same)."""
        keys, blocks = list(keys), list(blocks)
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        for k in keys:
            if k.namespace != self._fp:
                raise ValueError(f"put: key namespace {k.namespace} is not this pool's namespace {self._fp}")
        for blk in blocks:
            if blk.nbytes != self._bpb:
                raise ValueError(f"put: block buffer of {blk.nbytes} bytes, layout needs {self._bpb}")
        res = PutResult()
        if not keys:
            return completed(res)
        if self._closed:
            res.dropped = len(keys)
            self._count("dropped_closed", len(keys))
            return completed(res)
        if self.breaker.refuse_if_open():
            res.dropped = len(keys)
            self._count("dropped_breaker", len(keys))
            return completed(res)
        with self._mu:
            room = max(0, self.cfg.write_queue_blocks - self._pending_put_blocks)
            take = min(room, len(keys))
            self._pending_put_blocks += take
        if take < len(keys):
            res.dropped += len(keys) - take
            self._count("dropped_queue_full", len(keys) - take)
        if take == 0:
            return completed(res)
        fut: Future = Future()
        state = {"left": take}
        mu = threading.Lock()

        def one_done(kind: str) -> None:
            with mu:
                setattr(res, kind, getattr(res, kind) + 1)
                state["left"] -= 1
                last = state["left"] == 0
            with self._mu:
                self._pending_put_blocks -= 1
            if last:
                fut.set_result(res)

        queued = time.monotonic()
        for k, blk in zip(keys[:take], blocks[:take]):
            self._io_put.submit(self._put_one, k, blk, one_done, queued)
        with self._mu:
            self._put_futures.add(fut)
        fut.add_done_callback(self._forget_put)
        return fut

    def get(self, keys: Sequence[BlockKey], out: Sequence) -> Future:
        """Load ``keys[i]`` into ``out[i]``; the future gives a :class:`GetResult` within the load bound.
        ``ok[i]`` is True only after header identity and GCM tag (or xxh3) verified in ``out[i]``.

        ``out`` may be torch tensors on one device (the pool seam for device loads,
        :mod:`kvbm_backend.pool.base`): blocks are then decrypted and verified on the host into pinned
        staging (in parallel, ``max_inflight`` at once) and copied to the device with one async H2D
        copy (:func:`kvbm_backend.gpu.host_path.load_via_host`); a miss leaves ``out[i]`` untouched."""
        keys, out = list(keys), list(out)
        if len(keys) != len(out):
            raise ValueError(f"get: {len(keys)} keys but {len(out)} buffers")
        if is_tensor_batch(out):
            return self._get_tensors(keys, out)
        for o in out:
            if o.nbytes != self._bpb:
                raise ValueError(f"get: out buffer of {o.nbytes} bytes, layout needs {self._bpb}")
        self._count("gets", len(keys))
        if not keys or self._closed:
            self._count("miss_closed", len(keys) if keys else 0)
            return completed(GetResult([False] * len(keys)))
        if self.breaker.refuse_if_open():
            self._count("miss_breaker", len(keys))
            return completed(GetResult([False] * len(keys)))
        d = Deadline(self._load_bound_s)
        b = _Batch(len(keys), d.at)
        self._deadlines.add(d.at, lambda: self._expire_get(b))
        for i, (k, o) in enumerate(zip(keys, out)):
            self._io.submit(self._get_one, b, i, k, o)
        return b.future

    def _get_tensors(self, keys: list, out: list) -> Future:
        from ...gpu.host_path import check_dst, load_via_host
        check_dst(out, self._bpb, out[0].device)  # ValueError at the call, like numpy buffers
        fut: Future = Future()
        fut.set_running_or_notify_cancel()

        def run() -> None:
            try:
                ok = load_via_host(self, keys, out, timeout_s=self._load_bound_s + 1.0)
            except Exception as e:  # noqa: BLE001 - storage trouble: misses (a bug is logged with its trace)
                log.exception("G4: device load of %d blocks failed: %s", len(keys), e)
                ok = [False] * len(keys)
            fut.set_result(GetResult(list(ok)))
        try:
            self._device_exec.submit(run)
        except RuntimeError:  # closing
            fut.set_result(GetResult([False] * len(keys)))
        return fut

    def delete(self, keys: Sequence[BlockKey]) -> Future:
        """Remove blocks; the future gives how many were present (HEAD then DELETE each)."""
        keys = list(keys)
        if not keys:
            return completed(0)

        def run() -> int:
            n = 0
            for k in keys:
                if k.namespace != self._fp:
                    continue
                name = self._name(k)
                try:
                    if self.store.head(name) is not None:
                        n += 1
                        self.store.delete(name)
                except OSError:
                    self._count("delete_errors")
            self._count("deleted", n)
            return n
        return self._io.submit(run)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload queued so far has finished (written, skipped or dropped).
        Returns False if ``timeout`` seconds passed first."""
        with self._mu:
            futs = list(self._put_futures)
        end = Deadline(timeout)
        for f in futs:
            try:
                f.result(end.left())
            except Exception:  # noqa: BLE001 - TimeoutError
                return False
        return True

    def stats(self) -> dict:
        with self._mu:
            s = dict(self._c)
            s["pending_put_blocks"] = self._pending_put_blocks
        s.update({"tier": self.tier, "encrypted": self.encrypt, "url": self.store.url,
                  "pseudonym_keyed": self.keyring is not None, "names_keyed": self.keyring is not None,
                  "tenant_cache_entries": self.tenant_cache_size(), "namespace": self._fp,
                  "keyring_read_only": bool(self.keyring is not None and self.keyring.read_only),
                  "keyring_ok": bool(self.keyring is None or self.keyring.error is None),
                  **({f"keyring_{k}": v for k, v in self.keyring.stats().items()} if self.keyring is not None else {}),
                  "breaker_state": self.breaker.state, "breaker_opens": self.breaker.opens,
                  "breaker_rejected": self.breaker.rejected,
                  "corrupt": sum(v for k, v in s.items() if k.startswith("corrupt_")),
                  "misses": sum(v for k, v in s.items() if k.startswith("miss_")),
                  "dropped": sum(v for k, v in s.items() if k.startswith("dropped_")),
                  "skipped": sum(v for k, v in s.items() if k.startswith("skipped_")),
                  "throttled": sum(v for k, v in s.items() if k.startswith("throttled_"))})
        for k in ("hits", "written", "skipped_exists", "bytes_written", "bytes_read"):
            s.setdefault(k, 0)
        if self._bounce is not None:  # reads that found every bounce buffer lent (a fresh one was allocated)
            s["bounce_overflow"] = self._bounce.stats()["allocated"]
        return s

    def close(self, timeout: float | None = None) -> None:
        """Wait (bounded: ``timeout``, default ``2 * timeout_s``) for queued offloads, then drop the
        rest, persist keyring use counts, and stop threads."""
        if self._closed:
            return
        self.flush(2 * self.cfg.timeout_s if timeout is None else timeout)
        self._closed = True
        self._device_exec.shutdown(wait=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._io_put.shutdown(wait=False, cancel_futures=True)
        self._deadlines.close()
        if self.keyring is not None:
            try:
                self.keyring.close()
            except (OSError, KeyringError):
                pass
        if self._own_store:
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._mu:
                self._c[name] = self._c.get(name, 0) + n
            self._export(name, n)

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
            m.offloads_dropped.labels(reason).inc(n)
            if reason in _WRITE_FAILURES:
                m.write_failures.inc(n)
        elif kind == "miss":
            m.misses.labels(reason).inc(n)
            if reason in _READ_FAILURES:
                m.read_failures.inc(n)
        elif kind == "corrupt":
            m.corrupt.labels(reason).inc(n)
        elif kind == "throttled":
            m.throttled.labels(reason).inc(n)
        elif name == "lookup_unavailable":
            m.read_failures.inc(n)

    def _lookup_result(self, requested: int, found: int) -> None:
        self.metrics.matched_tokens.inc(found * self._layout.page_size)
        self.metrics.hit_rate.record(requested, found)

    def _store_error(self, e: OSError) -> None:
        """The store answered with an error (not an outage): log it, at most once per kind per
        ``_STORE_ERROR_LOG_S`` seconds. A missing bucket is named with how to create it."""
        kind = "bucket_missing" if isinstance(e, BucketMissing) else "store_error"
        now = time.monotonic()
        with self._mu:
            last = self._store_errors_logged.get(kind)
            if last is not None and now - last < _STORE_ERROR_LOG_S:
                return
            self._store_errors_logged[kind] = now
        if isinstance(e, BucketMissing):
            ep = f" --endpoint-url {redact_url(self.cfg.endpoint_url)}" if self.cfg.endpoint_url else ""
            log.error("%s: bucket %r does not exist: every G4 offload is dropped and every load misses until it "
                      "is created (kvbm-backend never creates buckets). Create it, e.g. `aws s3 mb s3://%s%s`, "
                      "or fix g4.url", self.where, e.bucket, e.bucket, ep)
        else:
            log.warning("%s: the store refuses requests: %s (offloads dropped as dropped_error, loads miss as "
                        "miss_error; check credentials and permissions); repeated at most every %.0f s",
                        self.where, e, _STORE_ERROR_LOG_S)

    def _store_ok(self) -> None:
        """A write succeeded: clear logged store errors (one INFO line when the bucket appeared)."""
        with self._mu:
            had = self._store_errors_logged.pop("bucket_missing", None)
            self._store_errors_logged.clear()
        if had is not None:
            log.info("%s: bucket exists now, G4 offloads are stored again", self.where)

    def pseudonym(self, tenant: str) -> bytes:
        """16-byte tenant pseudonym: keyed HMAC under the keyring's pseudonym key (unkeyed HMAC only
        for unencrypted pools without a keyring; ``stats()["pseudonym_keyed"]`` says which)."""
        if self.keyring is not None:
            return self.keyring.pseudonym(tenant)
        return hmac.new(UNKEYED_PSEUDONYM_KEY, tenant_bytes(tenant), hashlib.sha256).digest()[:16]

    def _new_namer(self, tenant: str) -> TenantNamer:
        ps = self.pseudonym(tenant)
        key = (self.keyring.name_key(ps) if self.keyring is not None
               else derive_name_key(UNKEYED_PSEUDONYM_KEY, ps))  # public: such names hide nothing (format.md)
        return TenantNamer(self._fp, ps, key, self.cfg.dir_fanout)

    def _tag(self, tenant: str) -> str:
        return self._namer(tenant).pseudonym_hex

    def _name(self, key: BlockKey) -> str:
        return self._namer(key.tenant).name(key.rank, key.seq_hash)

    def object_name(self, key: BlockKey) -> str:
        """The store-relative object name of ``key`` (keyed: ``docs/format.md``, "G4 names")."""
        return self._name(key)

    def legacy_object_name(self, key: BlockKey) -> str:
        """The name format 1 gave ``key`` (sequence hash in clear); read only by ``kvbm-backend g4 migrate``."""
        return legacy_block_name(self._fp, self._tag(key.tenant), key.rank, key.seq_hash, self.cfg.dir_fanout)

    def tenant_cache_size(self) -> int:
        """Tenants whose pseudonym and naming key are cached now (at most ``TENANT_CACHE_ENTRIES``)."""
        return self._namer.cache_info().currsize

    def _expected_header(self, key: BlockKey) -> FrameHeader:
        return FrameHeader.for_block(key, self._layout, self._world, bytes.fromhex(self._tag(key.tenant)))

    def _on_breaker_change(self, state: str) -> None:
        self.metrics.degraded.set(int(state == "open"))
        # namespace.json could not be written at start (store down): write it once the store is back, so
        # the namespace an operator finds in the store always says what it holds
        if state == "closed" and not self._ns_written and not self._closed:
            try:
                self._io_put.submit(self._write_namespace_json)
            except RuntimeError:  # closing: the I/O threads are gone
                pass

    def _log_tenant_once(self, reason: str, tenant: str, err: Exception) -> None:
        tag = (reason, self._tag(tenant))
        with self._mu:
            if tag in self._logged_tenants or len(self._logged_tenants) > _MAX_LOGGED_TENANTS:
                return
            self._logged_tenants.add(tag)
            last = len(self._logged_tenants) > _MAX_LOGGED_TENANTS
        log.warning("G4: offload for tenant pseudonym %s %s (%s): %s%s", tag[1], reason, self._fp, err,
                    "; further tenants are counted, not logged" if last else "")

    def _register_metrics(self, registry) -> None:
        from prometheus_client.core import GaugeMetricFamily

        pool = self

        class _Collector:
            def collect(self):
                for k, v in pool.stats().items():
                    if isinstance(v, bool):
                        v = int(v)
                    if isinstance(v, (int, float)):
                        yield GaugeMetricFamily(f"kvbm_g4_{k}", f"G4 pool {k}", value=v)

        registry.register(_Collector())
