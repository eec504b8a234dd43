"""G4 offloads: seal one block (AES-256-GCM under the tenant's data key, or xxh3 plaintext) and publish it
create-exclusive (:class:`WriterMixin`, part of :class:`~kvbm_backend.pool.g4.pool.G4Pool`).

Each queued block runs :meth:`WriterMixin._put_one` on an I/O thread and ends in exactly one of
``written`` / ``skipped`` / ``dropped`` (counted by reason: ``dropped_breaker``, ``dropped_unavailable``,
``dropped_error``, ``dropped_revoked_tenant``, ``dropped_unknown_tenant``, ``dropped_keyring``,
``skipped_exists``, ``skipped_foreign``); it never raises. A store outage counts towards the breaker; a
store that answers with an error (403, missing bucket) does not, and is logged by the pool
(``_store_error``).
"""
from __future__ import annotations

import time
from concurrent.futures import Future

import numpy as np

from ...crypto.aead import new_nonce, seal_into
from ...crypto.keyring import KeyringError, TenantRevoked, UnknownTenant
from ...model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, payload_checksum
from ...model.namespace import BlockKey
from .store import StoreUnavailable


class WriterMixin:
    """The write path of :class:`~kvbm_backend.pool.g4.pool.G4Pool` (uses its store, breaker, keyring,
    counters and lock)."""

    def _forget_put(self, f: Future) -> None:
        with self._mu:
            self._put_futures.discard(f)

    def _seal(self, key: BlockKey, block: np.ndarray) -> bytearray:
        hdr = self._expected_header(key)
        buf = bytearray(HEADER_BYTES + self._bpb)
        payload = memoryview(buf)[HEADER_BYTES:]
        src = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
        if self.encrypt:
            dk = self.keyring.write_key(key.tenant)
            hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, dk.key_id, dk.version, new_nonce()
            hdr.integrity = seal_into(dk.key, hdr.nonce, hdr.identity_bytes(), src, payload)
        else:
            payload[:] = src
            hdr.flags, hdr.integrity = FLAG_CHECKSUM, payload_checksum(src)
        buf[:HEADER_BYTES] = hdr.pack()
        return buf

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
            try:
                buf = self._seal(key, block)
            except KeyringError as e:
                reason = ("dropped_revoked_tenant" if isinstance(e, TenantRevoked) else
                          "dropped_unknown_tenant" if isinstance(e, UnknownTenant) else "dropped_keyring")
                self._count(reason)
                self._log_tenant_once(reason, key.tenant, e)
                return
            try:
                created = self.store.put_if_absent(self._name(key), buf)
            except StoreUnavailable as e:
                self.breaker.failure(e)
                self._count("dropped_unavailable")
                return
            except OSError as e:
                self.breaker.success()  # the store answered (e.g. 403): not an outage
                self._count("dropped_error")
                self._store_error(e)
                return
            self.breaker.success()
            if self._store_errors_logged:
                self._store_ok()
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

