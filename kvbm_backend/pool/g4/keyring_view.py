"""A G4 pool's keyring as vLLM's scheduler thread may ask it: no file I/O, no keyring lock (:class:`KeyringView`).

The keyring (:class:`~kvbm_backend.crypto.keyring.Keyring`) answers :meth:`~.Keyring.tenant_state` and its naming
calls under its mutex, after re-reading its file when it changed (at most every ``g4.keyring.reload_interval_s``).
That reload parses the file and unwraps every key under the mutex: 70-180 ms with 4,096 tenants. The scheduler
thread of vLLM must never wait for it (invariant 3): before 2026-12-01 a hand-off's ``request_finished`` and the
first look of a handed-off decode request ran it there (``G4Pool.pseudonym`` asked the keyring's naming generation,
which reloads), each time the file had changed (every worker's use-count persist, every new tenant).

So the scheduler asks this view instead:

* :meth:`pseudonym` is the keyring's lock-free HMAC under the pseudonym key it holds now, without a reload; the
  key is renewed by the keyring's next reload on any other thread (the pool's lookups, loads and offloads, this
  view's refresh thread). A tag computed under a pseudonym key that was just replaced (the keyring file deleted and
  made anew) is a stale tag for at most one refresh interval: the other worker sees another tenant tag and computes
  the prompt without waiting, or waits for blocks whose names it computes under the key it holds; either way a
  miss at worst, never another tenant's KV (every load checks the frame's identity and AEAD tag).
* :meth:`state`, :meth:`write_refusal` and :meth:`read_refusal` read a snapshot of the keyring's tenants and
  revocation records (plain set look-ups and one HMAC), made on the ``kvbm-keyring-view`` thread every
  ``reload_interval_s`` when the keyring loaded a new version of its file (:meth:`refresh`). The keyring's
  :attr:`~.Keyring.error` (the file does not load now) is read as it is. An answer is therefore as old as the last
  refresh, at most about two reload intervals: a tenant revoked, created or re-created just now may be judged by
  its former state, which costs a hand-off a recompute or one ``handoff_wait_s``, never wrong KV.

The thread starts with :meth:`start` (the scheduler side's constructor), not with the pool: worker processes never
ask and run none. :meth:`close` (the pool's) stops it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...crypto.kek import UnknownTenant
from ...crypto.names import check_storable_tenant
from ...threads import start_thread

if TYPE_CHECKING:
    from ...crypto.keyring import Keyring

__all__ = ["CLOSE_WAIT_S", "KeyringView", "MIN_REFRESH_S"]
log = logging.getLogger(__name__)

MIN_REFRESH_S = 0.05  # the refresh thread's shortest interval (seconds; a reload_interval_s of 0 is allowed)
CLOSE_WAIT_S = 5.0  # how long close waits for a refresh in flight (seconds)


@dataclass(frozen=True)
class _Snap:
    loads: int                 # the keyring's ``stats()["loads"]`` when it was made (a new version: made anew)
    active: frozenset[str]     # tenant ids with a data key
    revoked: frozenset[str]    # pseudonyms (hex) with a revocation record


class KeyringView:
    """What the scheduler thread may know of a G4 pool's ``keyring`` without waiting (module doc).

    Args:
        keyring: the pool's keyring.
        encrypt: the pool seals its blocks (``g4.encrypt``): a write then needs the tenant's data key, which an
            unknown tenant gets only when the keyring may create it; a plaintext pool writes unknown tenants.
    """

    def __init__(self, keyring: "Keyring", encrypt: bool) -> None:
        self.keyring, self.encrypt = keyring, bool(encrypt)
        self._snap: _Snap | None = None
        self._mu = threading.Lock()  # start
        self._rmu = threading.Lock()  # refresh
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the scheduler thread: no I/O, no keyring lock ------------------------------------------------
    def pseudonym(self, tenant: str) -> bytes:
        """``tenant``'s 16-byte pseudonym under the pseudonym key the keyring holds now (no reload)."""
        return self.keyring.pseudonym(tenant)

    def state(self, tenant: str) -> str | None:
        """``"active"``, ``"revoked"``, ``"unknown"`` or ``"unavailable"`` (the keyring file does not load), as
        :meth:`~.Keyring.tenant_state` answered at the last :meth:`refresh`; None before the first."""
        if self.keyring.error is not None:
            return "unavailable"
        s = self._snap
        if s is None:
            return None
        if tenant in s.active:
            return "active"
        return "revoked" if self.pseudonym(tenant).hex() in s.revoked else "unknown"

    def write_refusal(self, tenant: str) -> str | None:
        """Why this pool's offloads of ``tenant`` are dropped whatever the store does, by the G4 writer's drop
        reason without ``dropped_``: ``"revoked_tenant"``, ``"unknown_tenant"`` (an encrypted pool whose keyring
        creates no data key for it: read-only, ``auto_create_tenants`` off, ``max_auto_tenants`` reached, an id
        over 1,024 bytes or one JSON cannot keep), ``"keyring"`` (the file does not load); None: written, as far
        as the last refresh knows."""
        st = self.state(tenant)
        if st == "unavailable":
            return "keyring"
        if st == "revoked":
            return "revoked_tenant"
        if st != "unknown" or not self.encrypt:
            return None
        return None if self._creatable(tenant) else "unknown_tenant"

    def read_refusal(self, tenant: str) -> str | None:
        """``"revoked"`` or ``"unavailable"`` when this pool can load none of ``tenant``'s blocks (its lookups and
        loads are misses without store I/O); None otherwise (an unknown tenant may be created by another worker)."""
        st = self.state(tenant)
        return st if st in ("revoked", "unavailable") else None

    def _creatable(self, tenant: str) -> bool:
        kr, s = self.keyring, self._snap
        if kr.read_only or not kr.auto_create_tenants or s is None or len(s.active) >= kr.max_auto_tenants:
            return False
        try:
            check_storable_tenant(tenant, kr.path, implicit=True)
        except UnknownTenant:
            return False
        return True

    # ---- the refresh thread -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Let the keyring check its file (it re-reads it when changed and ``reload_interval_s`` passed: this
        thread's I/O), then make the snapshot anew when the keyring loaded another version since the last one.
        Holds the keyring's lock while it lists the tenants (about 18 ms with 4,096 on the CI VM), never on the
        scheduler thread. Raises what the keyring raises (the thread logs it)."""
        kr = self.keyring
        with self._rmu:  # one refresh at a time: an older snapshot never replaces a newer one
            kr.naming_generation()  # the keyring's periodic check; never raises
            loads = kr.stats()["loads"]
            if self._snap is not None and self._snap.loads == loads:
                return
            active = frozenset(r["tenant"] for r in kr.info())
            self._snap = _Snap(loads, active, frozenset(kr.revoked()))

    def start(self) -> "KeyringView":
        """Make the first snapshot here (the caller's thread: a constructor, not the scheduler's step), then
        refresh it every ``reload_interval_s`` (at least :data:`MIN_REFRESH_S`) on the ``kvbm-keyring-view``
        thread. Idempotent; returns self."""
        with self._mu:
            if self._thread is not None or self._stop.is_set():
                return self
            self.refresh()
            self._thread = start_thread(self._run, name="kvbm-keyring-view")
        return self

    def _run(self) -> None:
        every = max(float(self.keyring.reload_every_s), MIN_REFRESH_S)
        while not self._stop.wait(every):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the last snapshot stays; tried again at the next interval
                log.exception("kvbm_backend: G4 keyring view refresh failed (retried in %.1f s)", every)

    def close(self) -> None:
        """Stop the refresh thread (it ends at its next wait). Waits for it at most :data:`CLOSE_WAIT_S`: a
        refresh stuck in the keyring file's I/O (a hung NFS mount) must not hang the pool's close; the thread is
        a daemon and ends with its refresh. Idempotent."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(CLOSE_WAIT_S)
