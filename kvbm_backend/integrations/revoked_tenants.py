"""G3 follows the keyring's revocations: a revoked tenant's KV is neither served nor stored nor kept in G3.

``kvbm-backend keys revoke`` crypto-shreds a tenant's G4 data (its data keys go; :mod:`kvbm_backend.crypto.keyring`).
G3, each worker's local plaintext tier, holds no key to shred: before 2026-12 it kept the tenant's blocks (its own
saves and the G4 blocks promoted into it) and served them to that tenant's requests until evicted, across
restarts too. :class:`RevokedTenants` is the seam between the two, in the integration layer (the G3 pool knows no
keyring, the keyring no G3): the worker's G4 pool's keyring says which tenants are revoked (``revoked()``:
pseudonym -> revocation time; a tenant is named by its HMAC pseudonym there), the requests say which tenant ids
exist (G3 keys carry the id, or after a restart only its tag ``tag_of(tenant)``: :mod:`kvbm_backend.pool.g3.index`).
Its users: the vLLM connector (:mod:`.vllm.wiring`, below) and the tiering form's G3Tier
(:mod:`.vllm.tier_revoked`: its lookups, loads and stores refused the same way, the same counters in the tier's own).

* **Refused** (:meth:`RevokedTenants.refused`; dict and set look-ups, no keyring call, no I/O: the scheduler's
  thread may ask): a tenant whose pseudonym the keyring records revoked and that no current tenant has (not
  re-created), and a tenant whose purge (below) has not run yet. The connector asks no G3 lookup for it, reads
  none of its G3 blocks and stores none (:meth:`RevokedTenants.put_g3`).
* **Purged**: once per tenant and revocation (its ``revoked_at``) in a process, every G3 block of the tenant is
  deleted (``G3Pool.delete``: the slot headers are zeroed, no restart brings them back): its keys under its id, and
  restored keys under its tag. Puts handed to G3 before the tenant was refused are cancelled first (their writes not
  published: ``G3Pool.unpublished_keys``), and G3 is flushed, so none is published after the purge; a flush that
  does not finish within ``FLUSH_S`` (a stalled drive) leaves the tenant refused and the purge runs again at the next
  check (``g3_revoked_purges_retried``, a WARNING). Before 2026-12-02 the flush's answer was ignored: a write still
  queued then was published after the purge and served once the tenant was re-created. A purge is due when a keyring check finds a new revocation record (tenants known here:
  ids in G3's index and ids seen in requests), and when a tenant is first seen in a process and the keyring holds
  a revocation record of its pseudonym (a worker that was down, or restored the blocks by tag only). A tenant
  re-created by ``keys create`` is therefore served again only after its blocks from before the revocation are
  gone; after a restart its G3 blocks are deleted once more (G3 does not know when a block was written).
* Everything that reads the keyring or G3's index runs on the ``kvbm-revoke`` thread: a check every
  ``interval_s`` (the keyring's ``reload_every_s``), and the purges. A keyring file that does not load changes
  nothing here (the last state stays; G4 fails closed on its own).

Counters (``count``, the connector's :func:`~kvbm_backend.integrations.vllm.stats.add`): ``g3_revoked_purges``
(purges run), ``g3_revoked_deleted_blocks`` (blocks they deleted), ``g3_revoked_purges_retried`` (purges left for
the next check: G3's flush did not finish), ``save_g3_revoked_blocks`` (blocks not stored
in G3: their tenant was refused). Each purge logs one INFO line naming the tenant by its pseudonym only (a tenant
id is a request's ``cache_salt``).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..model.namespace import BlockKey
from ..pool.g3.index import TagKey, tag_of
from ..threads import executor, start_thread

if TYPE_CHECKING:
    from ..crypto.keyring import Keyring

log = logging.getLogger("kvbm_backend.connector")

__all__ = ["RevokedTenants", "keyring_of"]

MAX_SEEN = 65536  # tenant ids whose pseudonym is cached (a flood of client-chosen ids clears it: recomputed)
DELETE_CHUNK = 1024  # keys per G3 delete (each holds the pool's lock: lookups wait at most one chunk)
FLUSH_S = 30.0  # seconds a purge waits for G3's queued puts (those handed over before the tenant was refused)


def keyring_of(g4: Any) -> "Keyring | None":
    """The keyring of a G4 pool (or of the pool a canonical view wraps); None without one (or without G4)."""
    while g4 is not None and not hasattr(g4, "keyring") and hasattr(g4, "inner"):
        g4 = g4.inner
    return getattr(g4, "keyring", None) if g4 is not None else None


class RevokedTenants:
    """Which tenants G3 refuses, and the purges of their G3 blocks (module doc).

    Args:
        keyring: the G4 pool's keyring (:func:`keyring_of`).
        g3: the G3 pools to purge (a worker's, one per KV cache group); empty: only refuse (the scheduler role,
            whose G3 is the worker's or a mirror of it).
        interval_s: seconds between keyring checks (> 0).
        count: adds to counters (``count(name=n)``); None: not counted.
        start: run the checks on the ``kvbm-revoke`` thread (False: only :meth:`check_now` checks, for tests).

    The keyring is read once here, on the caller's thread; a purge due then runs on the ``kvbm-revoke`` thread.
    Raises ValueError for ``interval_s`` <= 0.
    """

    def __init__(self, keyring: "Keyring", g3: Sequence[Any] = (), *, interval_s: float,
                 count: Callable[..., None] | None = None, start: bool = True) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0 seconds, got {interval_s}")
        self.keyring, self.g3, self.interval_s = keyring, [p for p in g3 if p is not None], float(interval_s)
        self._count = count or (lambda **kw: None)
        self._mu = threading.Lock()
        self._ps: dict[str, str] = {}  # tenant id -> pseudonym hex, of naming generation _gen
        self._gen = -1
        self._loads = -1  # the keyring's file versions loaded (its stats' ``loads``) when last read here
        self._records: dict[str, float] = {}  # pseudonym hex -> revoked_at: the keyring's revocation records
        self._revoked: frozenset[str] = frozenset()  # pseudonyms refused: revoked and not re-created
        self._pending: dict[str, float] = {}  # tenant id -> revoked_at: refused until its purge ran
        self._done: set[tuple[str, float]] = set()  # (tenant id, revoked_at) purged in this process
        self._stop = threading.Event()
        self._queued = False
        self._work = executor(1, "kvbm-revoke")
        if self._refresh() and self.g3:
            self._work.submit(self._run, self._purge_known)
        self._ticker = start_thread(self._tick, name="kvbm-revoke-tick") if start else None

    # ---- the hot path (any thread) -------------------------------------------------------------
    def refused(self, tenant: str) -> bool:
        """True while G3 must neither serve nor store ``tenant`` (module doc). No keyring call, no I/O."""
        ps = self._ps.get(tenant)
        if ps is None:
            ps = self._sight(tenant)
        return ps in self._revoked or tenant in self._pending

    def put_g3(self, tenant: str, put: Callable[[], Future], n: int) -> Future | None:
        """``put()`` (a G3 put of ``n`` blocks of ``tenant``: it only queues them) unless ``tenant`` is refused:
        then None, counted ``save_g3_revoked_blocks``. A purge that refuses the tenant meanwhile waits for a put
        begun here (the check and the hand-over are one step), so no block of it is published after its purge."""
        if not self.refused(tenant):  # sees the tenant (outside _mu: a first sighting takes it)
            with self._mu:
                ps = self._ps.get(tenant)
                if ps is not None and ps not in self._revoked and tenant not in self._pending:
                    return put()
        self._count(save_g3_revoked_blocks=n)
        return None

    def _sight(self, tenant: str) -> str:
        """A tenant id not seen since its cache entry: its pseudonym, cached; a purge is due when the keyring
        holds a revocation record of it that was not purged here (a worker that was down, keys restored by tag)."""
        ps = self.keyring.pseudonym(tenant).hex()
        with self._mu:
            if len(self._ps) >= MAX_SEEN:
                self._ps.clear()
            self._ps[tenant] = ps
            due = self._due(tenant, ps)
        if due:
            self._submit(self._purge_pending)
        return ps

    def _due(self, tenant: str, ps: str) -> bool:
        """Mark ``tenant`` pending when a revocation record of ``ps`` was not purged here; True if newly so.
        Caller holds ``_mu``."""
        at = self._records.get(ps)
        if not self.g3 or at is None or (tenant, at) in self._done or tenant in self._pending:
            return False
        self._pending[tenant] = at
        return True

    # ---- the kvbm-revoke thread ----------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        try:
            self._work.submit(self._run, fn)
        except RuntimeError:  # closed
            pass

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a failed check or purge is retried at the next check
            log.exception("kvbm_backend: G3 revocation check failed (retried in %.0f s)", self.interval_s)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._mu:
                if self._queued:
                    continue
                self._queued = True
            self._submit(self._check)

    def _check(self) -> None:
        with self._mu:
            self._queued = False
        if self._refresh() and self.g3:
            self._purge_known()
        elif self._pending:
            self._purge_pending()  # a purge that failed before

    def check_now(self, timeout: float | None = None) -> None:
        """Check the keyring now and run the purges due, on the ``kvbm-revoke`` thread; wait for them
        (``timeout`` seconds; None: no bound). Raises TimeoutError past ``timeout``."""
        self._work.submit(self._run, self._check).result(timeout)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until the checks and purges queued so far ran. Raises TimeoutError past ``timeout`` seconds."""
        self._work.submit(lambda: None).result(timeout)

    def _refresh(self) -> bool:
        """Read the keyring's revocation records (it re-reads its file when due); True when they changed. A
        keyring that does not load changes nothing; one that loaded no new version since the last read is not
        read again (its tenant list is built only then: it holds the keyring's lock meanwhile)."""
        kr = self.keyring
        loads = kr.stats()["loads"]  # before: a version loaded from here on is read again at the next check
        records = kr.revoked()
        if kr.error is not None or kr.stats()["loads"] == self._loads:
            return False
        gen = kr.naming_generation()
        active = {r["pseudonym"] for r in kr.info()} if records else set()
        with self._mu:
            if gen != self._gen:  # a new keyring file: every pseudonym changed
                self._ps.clear()
                self._gen = gen
            changed = records != self._records
            self._records, self._loads = records, loads
            self._revoked = frozenset(ps for ps in records if ps not in active)
        return changed

    def _purge_known(self) -> None:
        """Purge the tenants known here (seen in requests, or ids in G3's index) that a revocation record names."""
        with self._mu:
            names = set(self._ps)
        for p in self.g3:
            names.update(k.tenant for k in p.keys() if type(k) is not TagKey)
        pk = {t: self.keyring.pseudonym(t).hex() for t in names}
        with self._mu:
            for t, ps in pk.items():
                self._due(t, ps)
        self._purge_pending()

    def _purge_pending(self) -> None:
        """Delete the G3 blocks of every pending tenant, then serve it again unless it is revoked."""
        with self._mu:
            todo = {t: at for t, at in self._pending.items() if (t, at) not in self._done}
            for t in set(self._pending) - set(todo):
                del self._pending[t]
        if not todo:
            return
        for p in self.g3:  # puts handed over before the tenant was refused: their writes are cancelled
            queued = [k for k in p.unpublished_keys() if k.tenant in todo and type(k) is not TagKey]
            for i in range(0, len(queued), DELETE_CHUNK):
                p.delete(queued[i:i + DELETE_CHUNK]).result()
        flushed = [p.flush(FLUSH_S) for p in self.g3]  # and any publishing meanwhile is done before the deletes
        tags = {tag_of(t): t for t in todo}
        counts = dict.fromkeys(todo, 0)
        for p in self.g3:
            by_tenant: dict[str, list] = {t: [] for t in todo}
            for k in p.keys():
                owner = tags.get(k.tag) if type(k) is TagKey else (k.tenant if k.tenant in todo else None)
                if owner is not None:  # by its id: a key restored by tag may be adopted under its id meanwhile
                    by_tenant[owner].append(BlockKey(k.namespace, owner, k.rank, k.seq_hash))
            for t, keys in by_tenant.items():
                counts[t] += sum(p.delete(keys[i:i + DELETE_CHUNK]).result() for i in range(0, len(keys), DELETE_CHUNK))
        if not all(flushed):  # a write may still publish a block of it: refused until a later check purges again
            log.warning("kvbm_backend: G3: a purge of %d revoked tenant(s) found offloads still queued after %.0f s; "
                        "they stay refused and are purged again at the next check", len(todo), FLUSH_S)
            self._count(g3_revoked_purges_retried=len(todo))
            return
        with self._mu:
            for t, at in todo.items():
                self._done.add((t, at))
                if self._pending.get(t) == at:
                    del self._pending[t]
            pseudonyms = {t: self._ps.get(t) for t in todo}
        for t, at in todo.items():
            log.info("kvbm_backend: G3: deleted %d blocks of revoked tenant pseudonym %s (revoked at %.0f, Unix "
                     "time; keyring %s)", counts[t], pseudonyms[t] or self.keyring.pseudonym(t).hex(), at,
                     self.keyring.path)
        self._count(g3_revoked_purges=len(todo), g3_revoked_deleted_blocks=sum(counts.values()))

    def close(self) -> None:
        """Stop the checks; a purge running finishes first. Idempotent."""
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()  # it only waits on _stop and queues checks: it ends at once
        self._work.shutdown(wait=True, cancel_futures=True)
