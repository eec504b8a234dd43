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
  queued then was published after the purge and served once the tenant was re-created. A purge is due when a
  keyring check finds a new revocation record (tenants known here: ids in G3's index, ids seen in requests, ids the
  keyring holds (a re-created tenant's), and tags G3's tenant labels name), and when a tenant is first seen in a
  process and the keyring holds a revocation record of its pseudonym not purged here yet. A tenant re-created by
  ``keys create`` is therefore served again only after its blocks from before the revocation are gone; after a
  restart its G3 blocks are deleted once more (G3 does not know when a block was written).
* **Restarts.** G3 restores blocks by tag only (no tenant id in its journal). The worker's gate records the keyring
  pseudonym of every tenant it sees in G3's tenant labels (:mod:`kvbm_backend.pool.g3.tenant_labels`, written on
  the ``kvbm-revoke`` thread, by :meth:`RevokedTenants.put_g3` before it hands the tenant's first blocks to G3
  (so a label is in its file before the blocks it names are journaled, also after :meth:`RevokedTenants.close`:
  before 2026-12-03 the saves the worker's shutdown handed over after the gate closed were stored unlabelled), and
  at :meth:`RevokedTenants.close`; labels a write failed to record are written again at each check, their failures
  counted and logged at most once per minute), and its first purge runs in its constructor,
  before the worker serves anything: a tenant revoked while the worker was down is purged by its label without a
  request of it (before 2026-12 its restored blocks stayed, refused and unservable, until its next request or their
  eviction), and a re-created one by its id in the keyring, so the scheduler (whose gate purges nothing) is never
  left offering restored blocks that the worker refuses at the tenant's first sighting (before 2026-12 it offered
  them: every planned block failed). Labels of tags G3 no longer holds are forgotten then, and whenever the labels
  are full (:data:`~kvbm_backend.pool.g3.tenant_labels.MAX_LABELS`; at most once per ``interval_s`` past the first,
  and at the checks): their number stays bounded by the tenants G3 holds blocks of (before 2026-12-03 a worker that
  saw that many ``cache_salt`` values labelled no new tenant again).
* Everything that reads the keyring or G3's index runs on the ``kvbm-revoke`` thread: a check every
  ``interval_s`` (the keyring's ``reload_every_s``), and the purges. A keyring file that does not load changes
  nothing here (the last state stays; G4 fails closed on its own).

Counters (``count``, the connector's :func:`~kvbm_backend.integrations.vllm.stats.add`): ``g3_revoked_purges``
(purges run), ``g3_revoked_deleted_blocks`` (blocks they deleted), ``g3_revoked_purges_retried`` (purges left for
the next check: G3's flush did not finish), ``save_g3_revoked_blocks`` (blocks not stored
in G3: their tenant was refused), ``g3_tenant_label_errors`` (failed reads and writes of G3's tenant labels). Each
purge logs one INFO line naming the tenant by its pseudonym only (a tenant id is a request's ``cache_salt``).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..model.namespace import BlockKey
from ..pool.g3.index import TagKey, tag_of
from ..pool.g3.tenant_labels import labels_of
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

    The keyring is read once here, on the caller's thread, and with ``g3`` the first purge runs here too (module doc,
    "Restarts": G3 deletes the blocks it restored of tenants the keyring records revoked before this returns).
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
        self._tag_pending: dict[bytes, float] = {}  # tenant tag -> revoked_at: restored blocks of a labelled tenant
        self._done: set[tuple[bytes, float]] = set()  # (tenant tag, revoked_at) purged in this process
        self._labelled = [(lb, p) for lb, p in zip(map(labels_of, self.g3), self.g3) if lb is not None]
        self._labels = [lb for lb, _ in self._labelled]  # G3's tenant labels (restarts)
        self._stop = threading.Event()
        self._queued = self._labelling = self._compacting = False
        self._compacted_at = -float("inf")  # monotonic seconds of the last compaction of full labels
        self._work = executor(1, "kvbm-revoke")
        changed = self._refresh()
        if self.g3:  # before the worker serves anything: no block restored for a tenant refused here is offered
            self._run(lambda: self._start(changed))
        self._count_label_errors()
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
            self._label_before_put(tenant)
            with self._mu:
                ps = self._ps.get(tenant)
                if ps is not None and ps not in self._revoked and tenant not in self._pending:
                    return put()
        self._count(save_g3_revoked_blocks=n)
        return None

    def _label_before_put(self, tenant: str) -> None:
        """Write the labels noted and not written yet when ``tenant``'s is one of them (a tenant's first put: one
        small append), so a label is in its file before the blocks it names are journaled; not while the last write
        failed (the checks retry it). Notes the label itself first (idempotent): a first sighting on another thread
        (another KV group's save, a load) may have cached the tenant and not noted its label yet."""
        tag = tag_of(tenant)
        with self._mu:
            ps = self._ps.get(tenant)
        wrote = False
        for lb in self._labels:
            if ps is not None:
                lb.note(tag, bytes.fromhex(ps))
            if not lb.failing and lb.unsynced(tag):
                lb.persist()
                wrote = True
        if wrote:
            self._count_label_errors()

    def _count_label_errors(self) -> None:
        n = sum(lb.take_errors() for lb in self._labels)
        if n:
            self._count(g3_tenant_label_errors=n)

    def _sight(self, tenant: str) -> str:
        """A tenant id not seen since its cache entry: its pseudonym, cached; a purge is due when the keyring
        holds a revocation record of it that was not purged here (a worker that was down, keys restored by tag)."""
        ps = self.keyring.pseudonym(tenant).hex()
        with self._mu:  # before its label is noted: a compaction of the labels keeps the tags of _ps
            if len(self._ps) >= MAX_SEEN:
                self._ps.clear()
            self._ps[tenant] = ps
            due = self._due(tenant, ps)
        noted = full = False
        for lb in self._labels:  # G3 keeps it: after a restart its restored blocks are found by it (.tenant_labels)
            noted |= lb.note(tag_of(tenant), bytes.fromhex(ps))
            full |= lb.full
        with self._mu:
            label = noted and not self._labelling
            self._labelling |= label
            compact = full and not self._compacting and time.monotonic() - self._compacted_at >= self.interval_s
            self._compacting |= compact
        if due:
            self._submit(self._purge_pending)
        if label:
            self._submit(self._persist_labels)
        if compact:
            self._submit(self._compact_full)
        return ps

    def _due(self, tenant: str, ps: str) -> bool:
        """Mark ``tenant`` pending when a revocation record of ``ps`` was not purged here; True if newly so.
        Caller holds ``_mu``."""
        at = self._records.get(ps)
        if not self.g3 or at is None or tenant in self._pending or (tag_of(tenant), at) in self._done:
            return False
        self._pending[tenant] = at
        return True

    def _start(self, changed: bool) -> None:
        """The first purge (of the tenants known here that a revocation record names: :meth:`_purge_known`, restored
        blocks by their labels too), then G3's labels of tenants it holds no block of are forgotten. Caller's thread."""
        if changed:
            self._purge_known()
        self._compact_labels(lambda lb: bool(lb.labels()))

    def _compact_labels(self, due: Callable[[Any], bool]) -> None:
        """Forget the labels ``due`` picks of tags G3 holds no block of and no tenant seen here has (noted
        meanwhile: kept), then note again the tenants seen here whose labels a full map refused."""
        for lb, p in self._labelled:
            if not due(lb):
                continue
            lb.mark()
            held = {k.tag if type(k) is TagKey else tag_of(k.tenant) for k in p.keys()}
            with self._mu:
                seen = dict(self._ps)
            held.update(tag_of(t) for t in seen)
            full = lb.full
            lb.compact(held.__contains__)
            if full:
                for t, ps in seen.items():
                    lb.note(tag_of(t), bytes.fromhex(ps))
                lb.persist()
        self._count_label_errors()

    def _compact_full(self) -> None:
        with self._mu:
            self._compacting = False
            self._compacted_at = time.monotonic()
        self._compact_labels(lambda lb: lb.full)

    def _persist_labels(self) -> None:
        with self._mu:
            self._labelling = False
        for lb in self._labels:
            lb.persist()
        self._count_label_errors()

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
        elif self._pending or self._tag_pending:
            self._purge_pending()  # a purge that failed before
        if any(lb.full for lb in self._labels):
            self._compact_full()
        if any(lb.pending() for lb in self._labels):
            self._persist_labels()  # labels a failed write kept

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
        """Purge the tenants known here that a revocation record names: seen in requests, ids in G3's index, ids
        the keyring holds (re-created tenants), and tags G3's labels name (restored blocks of a revoked tenant)."""
        with self._mu:
            names, records = set(self._ps), dict(self._records)
        for p in self.g3:
            names.update(k.tenant for k in p.keys() if type(k) is not TagKey)
        if records:
            names.update(r["tenant"] for r in self.keyring.info() if r.get("pseudonym") in records)
        pk = {t: self.keyring.pseudonym(t).hex() for t in names}
        tags = {tag: lb.hex() for x in self._labels for tag, lb in x.labels().items() if lb.hex() in records}
        with self._mu:
            for t, ps in pk.items():
                self._due(t, ps)
            for tag, ps in tags.items():
                at = self._records.get(ps)
                if at is not None and (tag, at) not in self._done:
                    self._tag_pending[tag] = at
        self._purge_pending()

    def _purge_pending(self) -> None:
        """Delete the G3 blocks of every pending tenant, then serve it again unless it is revoked."""
        with self._mu:
            todo = {t: at for t, at in self._pending.items() if (tag_of(t), at) not in self._done}
            for t in set(self._pending) - set(todo):
                del self._pending[t]
            tags = {tag_of(t): t for t in todo}
            by_tag = {g: at for g, at in self._tag_pending.items() if (g, at) not in self._done and g not in tags}
            self._tag_pending = dict(by_tag)
        if not todo and not by_tag:
            return
        for p in self.g3:  # puts handed over before the tenant was refused: their writes are cancelled
            queued = [k for k in p.unpublished_keys() if k.tenant in todo and type(k) is not TagKey]
            for i in range(0, len(queued), DELETE_CHUNK):
                p.delete(queued[i:i + DELETE_CHUNK]).result()
        flushed = [p.flush(FLUSH_S) for p in self.g3]  # and any publishing meanwhile is done before the deletes
        counts: dict[str | bytes, int] = {**dict.fromkeys(todo, 0), **dict.fromkeys(by_tag, 0)}
        for p in self.g3:
            by_owner: dict[str | bytes, list] = {}
            for k in p.keys():
                if type(k) is TagKey:  # by its id where known: it may be adopted under its id meanwhile
                    owner: str | bytes | None = tags.get(k.tag)
                    key = BlockKey(k.namespace, owner, k.rank, k.seq_hash) if type(owner) is str else k
                    owner = owner if owner is not None else (k.tag if k.tag in by_tag else None)
                else:  # a restored key adopted under its id was looked up by its tenant: pending by id then
                    owner, key = (k.tenant, k) if k.tenant in todo else (None, k)
                if owner is not None:
                    by_owner.setdefault(owner, []).append(key)
            for o, keys in by_owner.items():
                counts[o] += sum(p.delete(keys[i:i + DELETE_CHUNK]).result() for i in range(0, len(keys), DELETE_CHUNK))
        n = len(todo) + len(by_tag)
        if not all(flushed):  # a write may still publish a block of it: refused until a later check purges again
            log.warning("kvbm_backend: G3: a purge of %d revoked tenant(s) found offloads still queued after %.0f s; "
                        "they stay refused and are purged again at the next check", n, FLUSH_S)
            self._count(g3_revoked_purges_retried=n)
            return
        with self._mu:
            for t, at in todo.items():
                self._done.add((tag_of(t), at))
                if self._pending.get(t) == at:
                    del self._pending[t]
            for g, at in by_tag.items():
                self._done.add((g, at))
                if self._tag_pending.get(g) == at:
                    del self._tag_pending[g]
            pseudonyms: dict[str | bytes, str | None] = {t: self._ps.get(t) for t in todo}
        shown = {g: at for g, at in by_tag.items() if counts[g]}  # by label, none held: no purge was due
        for lb in self._labels:
            ps_of = lb.labels()
            pseudonyms.update({g: ps_of[g].hex() for g in shown if g in ps_of})
        purged: list[tuple[str | bytes, float]] = [*todo.items(), *shown.items()]
        for who, at in purged:
            log.info("kvbm_backend: G3: deleted %d blocks of revoked tenant pseudonym %s (revoked at %.0f, Unix "
                     "time; keyring %s)", counts[who], pseudonyms.get(who) or (
                         self.keyring.pseudonym(who).hex() if isinstance(who, str) else "?"), at, self.keyring.path)
        self._count(g3_revoked_purges=len(todo) + len(shown), g3_revoked_deleted_blocks=sum(counts.values()))

    def close(self) -> None:
        """Stop the checks; a purge running finishes first. Idempotent."""
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()  # it only waits on _stop and queues checks: it ends at once
        self._work.shutdown(wait=True, cancel_futures=True)
        for lb in self._labels:  # the labels noted since the last write (a queued write may have been cancelled)
            lb.persist()
        self._count_label_errors()
