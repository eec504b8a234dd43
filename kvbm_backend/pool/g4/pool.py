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
  (``miss_no_key``) and are left for ``kvbm-backend gc``; so are those whose frame ``key_check`` names other
  key material than this keyring holds under their key id and version (``miss_key_mismatch``: a keyring copy
  rotated apart, docs/format.md), never deleted as corrupt. An object sealed under another tenant's
  key id (a blob sealed with B's key under A's name and identity) is ``corrupt_key_owner``. A plaintext
  frame found by an encrypted pool is never served (``miss_unencrypted_object``) and deleted once the
  store confirms it (``deleted_unencrypted``), so the encrypted copy can be written; a plaintext pool
  never deletes an encrypted frame it cannot open (``miss_no_key``).
* Tenants (every pool with a keyring, plaintext ones too): loads and lookups of a revoked tenant, or
  while the keyring file does not load, are misses without store I/O (``miss_revoked_tenant``,
  ``miss_keyring_unavailable``), offloads dropped (``dropped_revoked_tenant``, ``dropped_keyring``).
  Encrypted pools: an unknown tenant's loads are misses too (no key: ``miss_no_key``, or absent) and its
  offloads dropped (``dropped_unknown_tenant``); a plaintext pool stores and serves it (it needs no data
  key). Drops are logged once per tenant pseudonym (never the tenant id: it is the request's
  cache_salt). The keyring re-reads its file at most every ``g4.keyring.reload_interval_s``: a
  revocation reaches a running pool within that bound (plus requests already in flight).

Modules, by job: this module is the facade: the public API, construction, shutdown and ``stats()``,
wiring parts that each own their state and get what they use handed in (no part reaches into another's
attributes): :class:`~.writer.G4Writer` (:mod:`.writer`) seals and publishes offloads and owns the
offload queue; :class:`~.reader.G4Reader` (:mod:`.reader`) loads, verifies and owns the bounce buffers;
:class:`~.lookup.G4Lookups` (:mod:`.lookup`) answers prefix lookups; :class:`~.tenant_names.TenantNames`
(:mod:`.tenant_names`) turns tenants into pseudonyms, object names and expected headers;
:class:`~.keyring_view.KeyringView` (:mod:`.keyring_view`) answers vLLM's scheduler thread about tenants;
:class:`~.throttle.ThrottleWatch` (:mod:`.throttle`) counts "slow down" answers; and
:class:`~.events.G4Counters` / :class:`~.events.OperatorLog` (:mod:`.events`) hold the counters and the
operator log lines (the ``kvbm_backend.pool.g4.pool`` logger). Stores are opened by URL scheme in
:mod:`.factory`.
"""
from __future__ import annotations

import logging
import struct
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry

from ...config import G4Config
from ...crypto.keyring import Keyring, KeyringError
from ...deadlines import Deadlines
from ...memory import BufferPool
from ...metrics import TierMetrics
from ...model.frame import HEADER_BYTES
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, Namespace
from ..base import GetResult, PutResult, completed, is_tensor_batch
from .breaker import CircuitBreaker
from .events import REASONS, G4Counters, OperatorLog, StatsGauges, set_degraded
from .factory import open_store
from .keyring_view import KeyringView
from .lookup import G4Lookups
from .reader import G4Reader, GetBatch
from .silence import SILENT_FRACTION, StoreCalls
from .store import ObjectStore
from ...store_url import redact_url
from .tenant_names import TENANT_CACHE_ENTRIES as TENANT_CACHE_ENTRIES, TenantNames
from .throttle import ThrottleWatch
from .writer import G4Writer
from ...threads import CountingExecutor, executor

log = logging.getLogger(__name__)

__all__ = ["G4Pool", "TENANT_CACHE_ENTRIES"]


class G4Pool:
    """BlockPool over an object store (tier ``"G4"``): a facade over parts that own their state.

    Args:
        cfg: :class:`kvbm_backend.config.G4Config` (``url`` required; ``keyring.path`` required
            when ``encrypt``).
        namespace: what the blocks mean; keys of other namespaces are misses.
        registry: optional ``prometheus_client`` registry for the :class:`~kvbm_backend.metrics.TierMetrics`
            series (default: the process registry); given, the pool's :meth:`stats` are also exported
            there as ``kvbm_g4_*`` gauges, summed over the open pools given that registry
            (:class:`~.events.StatsGauges`).
        store, keyring: injected instances (tests, benchmarks); built from ``cfg`` when None.
        default_tenant: the configured default tenant (the config's ``tenant``: requests without a cache_salt):
            a drop's log line names it as such, never by its id (:meth:`~.writer.G4Writer._drop_text`).
    Raises:
        ValueError / KeyringError with the field at fault (missing URL, keyring, bad KEK, ...).

    Attributes besides the BlockPool API: ``cfg``, ``namespace``, ``encrypt``, ``keyring`` (None only for
    plaintext pools without ``keyring.path``), ``store``, ``breaker``, ``metrics``, ``where`` (how log
    lines name the store), ``load_bound_s`` (seconds within which loads and lookups resolve), and the
    parts: ``names`` (:class:`~.tenant_names.TenantNames`), ``counters`` / ``oplog`` (:mod:`.events`),
    ``throttle`` (:class:`~.throttle.ThrottleWatch`), ``writer`` (:class:`~.writer.G4Writer`), ``reader``
    (:class:`~.reader.G4Reader`), ``lookups`` (:class:`~.lookup.G4Lookups`).
    """

    tier = "G4"

    def __init__(self, cfg: G4Config, namespace: Namespace, *, registry: CollectorRegistry | None = None,
                 store: ObjectStore | None = None, keyring: Keyring | None = None, default_tenant: str = ""):
        self.cfg = cfg
        self.namespace = namespace
        self._layout = namespace.layout
        self._bpb = namespace.layout.bytes_per_block
        self._fp = namespace.fingerprint
        self.encrypt = bool(cfg.encrypt)
        self._closed = False
        url = cfg.url or ""
        if store is None and not url:
            raise ValueError("g4.url: required (s3://BUCKET/PREFIX, file:///path or mem://NAME)")
        self.keyring = keyring
        if self.keyring is None and (self.encrypt or cfg.keyring.path):
            self.keyring = Keyring.from_config(cfg.keyring)
        self._own_store = store is None
        try:
            self.store = store or open_store(url, cfg)
        except BaseException:  # a failed start leaves nothing open (issue 22 item 3)
            if self.keyring is not None and keyring is None:
                self.keyring.close()
            raise
        self.metrics = TierMetrics("g4", registry, reasons=REASONS)
        where = f" at {redact_url(cfg.endpoint_url)}" if cfg.endpoint_url and self._own_store else ""
        self.where = f"G4 {redact_url(self.store.url)}{where}"  # operator log lines name the store this way
        self.load_bound_s = cfg.load_bound_s  # timeout_s * (1 + retries) + slack (one formula: G4Config)
        self.counters = G4Counters(self.metrics, namespace.layout.page_size)
        self.oplog = OperatorLog(self.where, cfg.endpoint_url, self._fp)
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s, name=self.where,
                                      on_change=self._on_breaker_change)
        self.throttle = ThrottleWatch(self.breaker, self.counters.count, self.load_bound_s)
        self.names = TenantNames(self.keyring, self._fp, namespace.layout, namespace.tp_world_size, cfg.dir_fanout)
        # what vLLM's scheduler thread asks of the keyring, without I/O or its lock (:mod:`.keyring_view`)
        self.keyring_view = KeyringView(self.keyring, self.encrypt) if self.keyring is not None else None
        # reads (gets, lookups, deletes) and writes (offloads) on threads of their own: stuck reads (a hung
        # mount, objects whose open blocks) never hold back offloads of other blocks, nor stuck writes loads
        self._io = CountingExecutor(cfg.max_inflight, "g4-io")  # its backlog: refuse_if_open
        self.read_threads = cfg.max_inflight  # blocks read at once: sizes a device load's staging window
        self._io_put = executor(cfg.max_inflight, "g4-put")
        # get() into torch tensors waits on its own host get here (never on an _io thread it needs)
        self._device_exec = executor(2, "g4-device")
        # frames of offloads (and plaintext staging of reads whose body is read-only, S3): reused, kept up
        # to one per I/O thread of each kind, allocated on first use (a fresh 2 MiB bytearray per block cost
        # page faults and zeroing: ~0.1-0.3 CPU-s/GB, issue 25)
        frames = BufferPool("host", 2 * cfg.max_inflight * (HEADER_BYTES + self._bpb), name="g4-frames")
        self._deadlines = Deadlines("g4-deadlines")
        self.writer = G4Writer(store=self.store, namespace=namespace, names=self.names, keyring=self.keyring,
                               encrypt=self.encrypt, frames=frames, oplog=self.oplog,
                               executor=self._io_put, deadlines=self._deadlines,
                               write_queue_blocks=cfg.write_queue_blocks,
                               put_bound_s=cfg.timeout_s * (1 + cfg.retries), load_bound_s=self.load_bound_s,
                               default_tenant=default_tenant,
                               breaker=self.breaker, throttle=self.throttle, counters=self.counters)
        calls = StoreCalls(cfg.timeout_s * SILENT_FRACTION)  # requests out on the I/O threads: silence vs load
        self.reader = G4Reader(store=self.store, layout=namespace.layout, world=namespace.tp_world_size,
                               namespace=self._fp, names=self.names, keyring=self.keyring, encrypt=self.encrypt,
                               frames=frames, executor=self._io, deadlines=self._deadlines,
                               load_bound_s=self.load_bound_s, max_inflight=cfg.max_inflight, calls=calls,
                               breaker=self.breaker, throttle=self.throttle, counters=self.counters,
                               oplog=self.oplog)
        self.lookups = G4Lookups(store=self.store, namespace=self._fp, names=self.names,
                                 keyring=self.keyring, executor=self._io,
                                 deadlines=self._deadlines, load_bound_s=self.load_bound_s,
                                 max_inflight=cfg.max_inflight, calls=calls, breaker=self.breaker,
                                 throttle=self.throttle, counters=self.counters, oplog=self.oplog)
        self.writer.start()
        self._registry = registry
        if registry is not None:
            StatsGauges.join(registry, self)

    # ---- BlockPool ------------------------------------------------------------------------
    @property
    def layout(self) -> KvLayout:
        return self._layout

    def lookup_prefix(self, keys: Sequence[BlockKey], *, request: bool = True) -> Future[int]:
        """Number of leading ``keys`` present (HEAD requests in growing parallel waves, stopping at the
        first absent one). A store that does not answer within the load bound counts as absent. A
        :class:`~kvbm_backend.model.namespace.KeyRun` makes its BlockKeys only for the keys a wave probes.
        ``request`` False: a background existence check (``g4.announce``), not counted in ``lookups``,
        ``lookup_hits``, matched tokens or the hit rate (which describe requests' lookups)."""
        return self.lookups.lookup_prefix(keys, request)

    def count_lookup(self, requested: int, found: int) -> None:
        """Count a request's lookup settled elsewhere (:meth:`BlockPool.count_lookup`): ``lookups``,
        ``lookup_hits``, matched tokens and the hit rate, as a counted :meth:`lookup_prefix` does."""
        self.lookups.count_lookup(requested, found)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[npt.NDArray[np.uint8]]) -> Future[PutResult]:
        """Offload blocks (1-D uint8 arrays of ``layout.bytes_per_block`` bytes). The future gives a
        :class:`PutResult`; storage trouble drops and counts, never raises. ``skipped``: an object this pool
        serves was already there (``skipped_exists``); one it would not serve counts in ``dropped``
        (``skipped_unservable``: not stored; :mod:`.writer`). Raises ValueError at once
        for mismatched lengths, wrong-sized buffers or a key of another namespace (caller bugs; G3 does
        the same)."""
        return self.writer.put(keys, blocks)

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any] | Any) -> Future[GetResult]:
        """Load ``keys[i]`` into ``out[i]``; the future gives a :class:`GetResult` within the load bound.
        ``ok[i]`` is True only after header identity and GCM tag (or xxh3) verified in ``out[i]``.

        ``out`` may be torch tensors on one device, or one ``[n, bytes_per_block]`` tensor (the pool seam for device loads,
        :mod:`kvbm_backend.pool.base`): blocks are then decrypted and verified on the host into pinned
        staging (in parallel, ``max_inflight`` at once, through a window of reused staging buffers) and each
        verified row is copied to the device asynchronously
        (:func:`kvbm_backend.gpu.host_path.load_via_host`); a miss leaves ``out[i]`` untouched.
        Raises ValueError for mismatched lengths or wrong-sized buffers."""
        keys = list(keys)
        if len(keys) != len(out):
            raise ValueError(f"get: {len(keys)} keys but {len(out)} buffers")
        if is_tensor_batch(out):  # a [n, bytes] matrix stays one tensor (kvbm_backend.gpu.rows)
            return self._get_tensors(keys, out)
        return self.reader.get(keys, list(out))

    def get_staged(self, keys: Sequence[BlockKey], rows: Sequence[npt.NDArray[np.uint8]],
                   on_hit: Callable[[int], object] | None = None) -> GetBatch:
        """Load into scratch rows, verified there (:meth:`~.reader.G4Reader.get_staged`: the device-load
        path of :func:`kvbm_backend.gpu.host_path.load_via_host`). Returns the batch (``.future``,
        ``.idle``); raises ValueError for mismatched lengths or wrong-sized rows."""
        return self.reader.get_staged(keys, rows, on_hit)

    def _get_tensors(self, keys: list[BlockKey], out: Any) -> Future[GetResult]:
        from ...gpu.host_path import load_via_host
        from ...gpu.rows import BlockRows
        out = BlockRows(out, self._bpb)  # ValueError at the call, like numpy buffers
        fut: Future[GetResult] = Future()
        fut.set_running_or_notify_cancel()

        def run() -> None:
            late: list[bool] = []
            try:
                ok = load_via_host(self, keys, out, timeout_s=self.load_bound_s + 1.0, timed_out=late)
            except Exception as e:  # noqa: BLE001 - storage trouble: misses (a bug is logged with its trace)
                log.exception("G4: device load of %d blocks failed: %s", len(keys), e)
                ok, late = [False] * len(keys), []
            fut.set_result(GetResult(list(ok), late))
        try:
            self._device_exec.submit(run)
        except RuntimeError:  # closing
            fut.set_result(GetResult([False] * len(keys)))
        return fut

    def delete(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Remove blocks; the future gives how many were present and deleted (HEAD then DELETE each), as counted
        ``deleted``. A key whose HEAD or DELETE failed counts ``delete_errors`` only (before 2026-12-04 one whose
        DELETE failed counted in both, and in the result). Every key is named before anything is deleted: a key no
        object name can hold (rank outside [0, 2**32), seq_hash outside [0, 2**64) or not an integer) is not
        present, and a naming error fails the future with nothing deleted (before 2026-12-04 such a key failed it
        with ``struct.error`` after the keys before it were deleted, uncounted)."""
        keys = list(keys)
        if not keys:
            return completed(0)

        def run() -> int:
            n, names = 0, []
            for k in keys:
                if k.namespace != self._fp:
                    continue
                try:
                    names.append(self.names.name(k))
                except struct.error:  # a rank or seq_hash out of range or not an integer: no block has such a name
                    continue
            for name in names:
                try:
                    if self.store.head(name) is not None:
                        self.store.delete(name)
                        n += 1
                except OSError:
                    self.counters.count("delete_errors")
            self.counters.count("deleted", n)
            return n
        return self._io.submit(run)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every offload queued so far has finished (written, skipped or dropped).
        Returns False if ``timeout`` seconds passed first."""
        return self.writer.flush(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters (``hits``, ``written``, ``miss_<reason>``, ...) and their sums (``misses``, ``dropped``,
        ``corrupt``, ``skipped``, ``throttled``), queue (``pending_put_blocks``; of them
        ``unsettled_put_blocks``: PUTs waiting to be settled, :mod:`.settle`), breaker, keyring and naming state."""
        s: dict[str, Any] = dict(self.counters.snapshot())
        s["pending_put_blocks"] = self.writer.pending_blocks()
        s["unsettled_put_blocks"] = self.writer.unsettled_blocks()
        kr = self.keyring
        s.update({"tier": self.tier, "encrypted": self.encrypt, "url": self.store.url,
                  "pseudonym_keyed": kr is not None, "names_keyed": kr is not None,
                  "tenant_cache_entries": self.tenant_cache_size(), "namespace": self._fp,
                  # block names use the store's recorded dir_fanout, not g4.dir_fanout (tenant_names.follow_store)
                  "dir_fanout_overridden": self.names.dir_fanout != self.cfg.dir_fanout,
                  "keyring_read_only": bool(kr is not None and kr.read_only),
                  "keyring_ok": bool(kr is None or kr.error is None),
                  **({f"keyring_{k}": v for k, v in kr.stats().items()} if kr is not None else {}),
                  "breaker_state": self.breaker.state, "breaker_opens": self.breaker.opens,
                  "breaker_rejected": self.breaker.rejected,
                  "corrupt": sum(v for k, v in s.items() if k.startswith("corrupt_")),
                  "misses": sum(v for k, v in s.items() if k.startswith("miss_")),
                  "dropped": sum(v for k, v in s.items() if k.startswith("dropped_")),
                  "skipped": sum(v for k, v in s.items() if k.startswith("skipped_")),
                  "throttled": sum(v for k, v in s.items() if k.startswith("throttled_"))})
        for k in ("hits", "written", "skipped_exists", "skipped_unservable", "bytes_written", "bytes_read"):
            s.setdefault(k, 0)
        if self.reader.bounce is not None:  # reads that found every bounce buffer lent (a fresh one allocated)
            s["bounce_overflow"] = self.reader.bounce.stats()["allocated"]
        return s

    def close(self, timeout: float | None = None) -> None:
        """Wait (bounded: ``timeout``, default ``2 * timeout_s``) for queued offloads, then drop the
        rest, persist keyring use counts, and stop threads. A late settle re-publishing a block is waited for
        too, whatever ``timeout``: only for its PUT in flight (no further PUT starts once closing; returning before
        its answer would report a block it may store dropped), at most until that block's settle bound
        (:meth:`.settle.LateSettler.close`)."""
        if self._closed:
            return
        self.flush(2 * self.cfg.timeout_s if timeout is None else timeout)
        self._closed = True
        set_degraded(self.metrics.degraded, self, None)
        if self._registry is not None:
            StatsGauges.leave(self._registry, self)
        self.writer.close()
        self.reader.close()
        self.lookups.close()
        self._device_exec.shutdown(wait=True)
        # reads and lookups still queued run, closed: each block or key ends at once without I/O, so their
        # batches go idle (staging rows free again); those still open are resolved now, since the timer
        # thread that would have expired them at their load bound stops here
        self._io.shutdown(wait=False)
        self._io_put.shutdown(wait=False)  # queued offloads end dropped (dropped_closed), their futures resolve
        self.reader.expire_open()
        self.lookups.expire_open()
        self._deadlines.close()
        if self.keyring_view is not None:
            self.keyring_view.close()
        if self.keyring is not None:
            try:
                self.keyring.close()
            except (OSError, KeyringError):
                pass
        if self._own_store:
            self.store.close()

    def __enter__(self) -> G4Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- names ----------------------------------------------------------------------------
    def pseudonym(self, tenant: str) -> bytes:
        """16-byte tenant pseudonym: keyed HMAC under the keyring's pseudonym key (unkeyed HMAC only
        for unencrypted pools without a keyring; ``stats()["pseudonym_keyed"]`` says which)."""
        return self.names.pseudonym(tenant)

    def object_name(self, key: BlockKey) -> str:
        """The store-relative object name of ``key`` (keyed: ``docs/format.md``, "G4 names")."""
        return self.names.name(key)

    def legacy_object_name(self, key: BlockKey) -> str:
        """The name format 1 gave ``key`` (sequence hash in clear); read only by ``kvbm-backend g4 migrate``."""
        return self.names.legacy_name(key)

    def tenant_cache_size(self) -> int:
        """Tenants whose pseudonym and naming key are cached now (at most ``TENANT_CACHE_ENTRIES``)."""
        return self.names.cache_size()

    # ---- internals ------------------------------------------------------------------------
    def _on_breaker_change(self, state: str) -> None:
        set_degraded(self.metrics.degraded, self, None if self._closed else int(state == "open"))
        if state == "closed" and not self._closed:
            self.writer.store_back()  # namespace.json could not be written at start: write it now
