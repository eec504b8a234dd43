"""G4 offloads: seal one block (AES-256-GCM under the tenant's data key, or xxh3 plaintext) and publish it
create-exclusive (:class:`WriterMixin`, part of :class:`~kvbm_backend.pool.g4.pool.G4Pool`).

Each queued block runs :meth:`WriterMixin._put_one` on an I/O thread and ends in exactly one of
``written`` / ``skipped`` / ``dropped`` (counted by reason: ``dropped_breaker``, ``dropped_unavailable``,
``dropped_throttled``, ``dropped_error``, ``dropped_revoked_tenant``, ``dropped_unknown_tenant``, ``dropped_keyring``,
``skipped_exists``, ``skipped_foreign``); it never raises. A store outage counts towards the breaker; a
store that answers with an error (403, missing bucket) does not, and is logged by the pool
(``_store_error``). A throttled PUT (:class:`~.store.StoreThrottled`) is retried after a full-jitter backoff
(:mod:`.throttle`) until ``timeout_s * (1 + retries)`` seconds after its first request, then dropped
(``dropped_throttled``); never a breaker failure. The backoff holds the I/O thread, so offloads queued
behind it wait, and past ``write_queue_blocks`` pending blocks new ones are dropped (never waited for).
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from ...crypto.aead import new_nonce, seal_into
from ...crypto.keyring import KeyringError, TenantRevoked, UnknownTenant
from ...model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, payload_checksum
from ...model.namespace import BlockKey
from .naming import namespace_name
from .store import StoreThrottled, StoreUnavailable
from .throttle import call_throttled


class WriterMixin:
    """The write path of :class:`~kvbm_backend.pool.g4.pool.G4Pool` (uses its store, breaker, keyring,
    counters and lock)."""

    def _forget_put(self, f: Future) -> None:
        with self._mu:
            self._put_futures.discard(f)

    def _seal(self, key: BlockKey, block: np.ndarray, buf) -> memoryview:
        """Frame ``block`` into ``buf`` (a reused uint8 buffer of at least ``HEADER_BYTES + bpb`` bytes,
        from :attr:`_frames`): AES-256-GCM straight from the caller's block into the payload (or one copy
        and xxh3 for plaintext), header in front. Returns the frame's memoryview (no copy)."""
        hdr = self._expected_header(key)
        frame = memoryview(buf).cast("B")[:HEADER_BYTES + self._bpb]
        payload = frame[HEADER_BYTES:]
        src = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
        if self.encrypt:
            dk = self.keyring.write_key(key.tenant)
            hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, dk.key_id, dk.version, new_nonce()
            hdr.integrity = seal_into(dk.key, hdr.nonce, hdr.identity_bytes(), src, payload)
        else:
            payload[:] = src
            hdr.flags, hdr.integrity = FLAG_CHECKSUM, payload_checksum(src)
        frame[:HEADER_BYTES] = hdr.pack()
        return frame

    def _put_one(self, key: BlockKey, block: np.ndarray, done, queued: float) -> None:
        """One queued offload (``queued``: its ``time.monotonic()`` when queued, for the
        ``kvbm_backend_g4_offload_seconds`` histogram)."""
        kind = "dropped"
        try:
            if key.namespace != self._fp:
                self._count("skipped_foreign")
                kind = "skipped"
                return
            if not self.breaker.allow():
                self._count("dropped_breaker")
                return
            with self._frames.lend(self._frame_bytes) as fbuf:  # reused: no allocation, no page faults
                try:
                    buf = self._seal(key, block, fbuf)
                except KeyringError as e:
                    reason = ("dropped_revoked_tenant" if isinstance(e, TenantRevoked) else
                              "dropped_unknown_tenant" if isinstance(e, UnknownTenant) else "dropped_keyring")
                    self._count(reason)
                    self._log_tenant_once(reason, key.tenant, e)
                    return
                name = self._name(key)
                created = self._publish(name, buf)
            if created is None:
                return
            self.breaker.success()
            if self._store_errors_logged:
                self._store_ok()
            if not self._ns_written:  # namespace.json stayed throttled at start: the store takes writes now
                self._write_namespace_json()
            if created:
                kind = "written"
                self._count("written")
                self._count("bytes_written", len(buf))
            else:
                kind = "skipped"
                self._count("skipped_exists")
        except Exception:  # noqa: BLE001 - never let an offload raise
            self._count("dropped_error")
            kind = "dropped"
        finally:
            self.metrics.offload_seconds.observe(time.monotonic() - queued)
            done(kind)

    def _publish(self, name: str, buf) -> bool | None:
        """Create-exclusive PUT of one frame (throttles backed off within the offload bound). True:
        written; False: another writer's copy was there; None: dropped (counted here)."""
        try:
            return call_throttled(lambda: self.store.put_if_absent(name, buf),
                                  time.monotonic() + self.cfg.timeout_s * (1 + self.cfg.retries),
                                  lambda: self._note_throttle("put"), lambda: self._closed)
        except StoreThrottled:
            self._count("dropped_throttled")  # the store answered: _note_throttle told the breaker so
        except StoreUnavailable as e:
            self.breaker.failure(e)
            self._count("dropped_unavailable")
        except OSError as e:
            self.breaker.success()  # the store answered (e.g. 403): not an outage
            self._count("dropped_error")
            self._store_error(e)
        return None

    def _write_namespace_json(self) -> None:
        """Start-up check and ``{ns_fp}/namespace.json`` (once; throttled answers backed off within the load
        bound; an unavailable store trips the breaker, whose closing writes it again)."""
        if self._ns_written:
            return

        def write() -> None:
            self.store.probe()  # start-up check: an unavailable store or missing bucket is logged now
            if self.store.head(namespace_name(self._fp)) is None:
                self.store.put_if_absent(namespace_name(self._fp), self.namespace.canonical_json().encode())
        try:
            call_throttled(write, time.monotonic() + self._load_bound_s, lambda: self._note_throttle("put"))
            self._ns_written = True
        except StoreThrottled:  # still throttled: the next offload that is written tries again
            self._count("namespace_json_errors")
        except StoreUnavailable as e:
            self._count("namespace_json_errors")
            self.breaker.trip(e)  # logs "unavailable at start"; probes every breaker_reset_s from now on
        except OSError as e:
            self._count("namespace_json_errors")
            self._store_error(e)
