"""G4 blocks announced to every worker, so Dynamo's KV router credits each of them (``g4.announce``).

G4 is shared: any worker with the keyring can load a block another one wrote, but Dynamo's router credits a
block only to the worker whose KV events published it (Dynamo 1.6.1's ``--shared-cache-type`` speaks only to
SGLang's HiCache / Mooncake). With ``g4.announce`` each worker's scheduler-side connector

* **writes**: remembers the blocks its requests save (vLLM block hash, parent hash, tokens, event extra
  keys, LoRA; learned with the G3 events' :meth:`~.kv_events.G3KvEvents.learn`), and every
  ``announce_interval_s`` checks which of them G4 now holds (HEAD, the pool's ``lookup_prefix``: published
  after durable) and writes them as one sealed record batch per tenant (:mod:`kvbm_backend.pool.g4.announce`:
  AES-256-GCM under the tenant's data key, so prompt tokens never reach the store in clear). A block is
  announced once per name and key: one learned again is announced again only when its tenant's blocks are
  now named or sealed otherwise (the keyring file replaced: another naming generation; the tenant revoked and
  re-created: another key id); before (2026-11-30) a block was announced once per process, so blocks stored
  again after a keyring swap or a re-creation never regained their router credit. A revoked tenant's batches
  are never written (plaintext pools with a keyring too). Whether a learned block is such a repeat is judged
  on the scheduler thread against the name and key the last flush found (no keyring call there: its reload
  reads and unwraps the whole file, 82-176 ms with 4,096 tenants) and checked again by the next flush against
  the keyring itself; a block is remembered as announced only once its batch is written, so one that was not
  yet in G4 (``announce_dropped_absent``) or whose batch failed (``announce_write_errors``) is announced when
  learned again. Before (2026-12-01) the scheduler thread asked the keyring (reloading it whenever the file
  had changed) and such blocks counted as announced for good. Under ``external_launcher`` with TP > 1 only TP
  rank 0's scheduler tells its announcer where every rank has one hash domain (else each rank its own), and only
  blocks the ranks' agreed plan offers (:mod:`.tp_events`);
* **polls**: on the same background thread lists the namespace's announcement objects (a LIST, never on the
  serving path), opens the new ones (foreign, corrupt, other hash domain: ignored and counted) and queues
  ``BlockStored`` (``medium="DISK"``, Dynamo's ``disk_blocks``) for their blocks, the worker's own included,
  through the connector's KV events (:class:`~.kv_events.G3KvEvents`; published by vLLM's scheduler, or by
  the idle publisher while the engine does not step); re-published after a prefix-cache reset.
* **removal**: records expire. A batch as old as the ``announce_ttl_s`` of the worker that wrote it (sealed in
  it; a batch written before 2026-12-01, with none, or ignored when read: the poller's own; before, every poller
  used its own, so one worker configured with a short TTL withdrew and deleted the whole fleet's batches) (its
  age: the older of its store mtime and the write time sealed in it, :mod:`.g4_records`: a copy of an expired
  batch written back is still expired; a batch not read yet is read before it is judged), that
  disappeared (any poller deletes expired batches), or whose tenant was revoked since (its key is re-checked
  every poll; ``announce_revoked_batches``) is withdrawn: ``BlockRemoved`` for blocks no live batch still
  announces. In a plaintext pool with a keyring a checksummed batch's tenant state is re-checked instead (by
  pseudonym), since that pool no longer serves a revoked tenant's blocks; before (2026-11-30) such batches
  written before the revocation kept their router credit. Blocks are not re-announced under the same name and key, so a block older than the TTL loses
  its router credit (it stays loadable); a block ``kvbm-backend gc`` deletes before the TTL keeps its credit until then (a routing
  preference, never KV: its load misses and the engine recomputes). Run gc with ``--max-age-s`` >= the TTL.

**Reset epochs** (:mod:`.reset_epoch`, ``reset_tiers``): a batch names the reset epoch its blocks were stored
under (sealed key ``"e"``, absent for a worker never reset), and a poller credits only the batches of its own
engine's current epoch: a block of another epoch is never this engine's hit (its identity differs), so crediting
it would route requests to a worker that misses it. At a reset (:meth:`G4Announcer.set_epoch`) the credits of the
batches read so far are withdrawn (``BlockRemoved`` queued by the next poll, before its credits: the same prompt
stored again under the new epoch has the same vLLM hashes; ``announce_removed_blocks``; gone from
:meth:`~G4Announcer.live` at once, so the re-publishing after ``AllBlocksCleared`` leaves them out), and blocks
learned before it are announced under the epoch they were stored under. Other epochs' batches still expire by their
writer's TTL. Before (2026-12-03) batches named no epoch and every poller credited them all, so after a reset the
router kept crediting the engine with every G4 block stored before it, none of which it could load.

**Time base** (as :mod:`kvbm_backend.pool.g4.gc`): ages are ``now - mtime`` with ``now`` the clock that stamps the
store's objects: this host's clock moved by the skew measured on this worker's own batches (the store mtime of a
batch it wrote minus this host's clock at the write: a free probe) or, when none was measured in the last
``CLOCK_REMEASURE_S``, on an empty probe object (:func:`~kvbm_backend.pool.g4.gc.probe_clock`, gc's); where the
store states a time (S3: the ``Date`` header, :meth:`~kvbm_backend.pool.g4.store.ObjectStore.server_time`) that one,
unless it is more than ``CLOCK_AGREE_S`` ahead of the measured clock (then the measured one, and a warning; within
it the stated time: the skew is measured on whole-second stamps; a probe such a store refuses, a read-only bucket,
is tried again after ``CLOCK_REMEASURE_S``). Before (2026-12-03) the stated time alone: a reverse proxy in front of
the store (nginx sends its own ``Date``) whose clock ran 2 h ahead made the poller expire and delete every fresh
batch of the fleet. Nothing is expired or deleted before the clock is measured: before (2026-11-30) the skew was 0
until the poller listed a batch of its own, so a poller whose host clock ran 2 h ahead deleted every fresh batch of
the fleet. A store that states no time and cannot be measured (a read-only file store) expires nothing; batches are
then withdrawn when they disappear (a read-only S3 store: its stated time alone). ``now`` never follows the listed
mtimes: a batch stamped later than ``now`` (its writer's clock ahead on a client-stamped filesystem such as CephFS,
Lustre or some NFS; a restored file) is young, read and credited, and counted (``announce_future_batches``); its age
runs from when this poller first listed it, so it expires ``announce_ttl_s`` after that (again after a restart), not
only once its own stamp is that old. Before (2026-11-29), ``now`` was never earlier than the newest listed mtime:
one batch stamped an hour ahead made every fresh batch an hour old, so with the default TTL every poller withdrew
and deleted every other batch of the fleet.

Hash domain: the records carry the writer's vLLM block hashes, which every worker computes alike only with
the same hash function and seed (vLLM's default sha256 with the fixed seed, or one shared ``PYTHONHASHSEED``
as Dynamo's launcher sets); each batch names its domain (a digest of vLLM's ``NONE_HASH``) and a poller
ignores batches of another (``announce_ignored_domain``).

**Caps** (a fleet member that holds the keyring can write anything): at most ``MAX_BATCHES_PER_POLL``
batches are read a poll (the rest wait for the next), ``MAX_BATCH_RECORDS`` records a batch (larger:
corrupt), objects over 64 MiB are refused unread (:mod:`kvbm_backend.pool.g4.announce`), and at most
``MAX_LIVE_BLOCKS`` blocks are credited: a batch beyond it is not credited (``announce_ignored_capped``,
logged once, read again after ``FOREIGN_RETRY_S``). Blocks are credited one batch per hold of this
announcer's lock, and queued ``EMIT_CHUNK`` per hold of the events lock (:meth:`~.kv_events.G3KvEvents.
emit_announced`): the scheduler's step never waits for a whole import.

Counters (scheduler stats): ``announce_written_batches`` / ``_blocks``, ``announce_write_errors``,
``announce_dropped_absent`` (learned, never found in G4), ``announce_stored_blocks`` /
``announce_removed_blocks`` (queued events), ``announce_ignored_{foreign,corrupt,domain}``,
``announce_ignored_capped``, ``announce_expired_batches``, ``announce_revoked_batches``,
``announce_future_batches`` (stamped ahead of the poller's clock, counted once),
``announce_poll_errors``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any

from ...pool.g4.announce import Announcements, Batch
from ...pool.g4.gc import CLOCK_AGREE_S, probe_clock
from . import stats
from .g4_records import (MAX_BATCH_RECORDS, MAX_TTL_S, RECORD_VERSION, decode_records, encode_records, hash_domain,
                         sealed_ttl)
from ...threads import start_thread

__all__ = ["G4Announcer", "RECORD_VERSION", "decode_records", "encode_records", "hash_domain"]
log = logging.getLogger(__name__)
_UNSEEN = object()  # a tenant no flush has looked up yet
FOREIGN_RETRY_S = 60.0  # a batch sealed under a key this keyring lacks is read again after this long
MAX_BATCHES_PER_POLL = 16  # batches read (GET, open, decode) in one poll at most; the rest wait for the next
MAX_LIVE_BLOCKS = 1 << 19  # announced blocks credited at once at most (module doc, "Caps")
CLOCK_REMEASURE_S = 600.0  # a probed store clock skew is measured again after this long


class G4Announcer:
    """Writes and polls G4 announcements for one engine's scheduler (see the module doc).

    Args:
        events: the connector's :class:`~.kv_events.G3KvEvents` (it calls :meth:`learn`; events are queued
            through its :meth:`~.kv_events.G3KvEvents.emit_announced`).
        g4: the scheduler's G4 pool (:class:`~kvbm_backend.pool.g4.pool.G4Pool` or its canonical wrapper).
        ns: the engine's (per-rank) namespace, whose keys ``g4`` looks up.
        interval_s, ttl_s: ``g4.announce_interval_s``, ``g4.announce_ttl_s`` (seconds).
        max_pending: learned blocks waiting for G4 (oldest dropped beyond it).
        max_batch: records per written object (more: several objects that flush).
    """

    epoch = ""  # the engine's reset epoch (.reset_epoch; set_epoch): only batches of this one are credited

    def __init__(self, events: Any, g4: Any, ns: Any, interval_s: float, ttl_s: float, max_pending: int = 1 << 16,
                 max_batch: int = 4096):
        pool = getattr(g4, "inner", g4)
        self.ann = Announcements(pool.store, pool.namespace.fingerprint, pool.keyring, pool.encrypt, pool.pseudonym)
        self.events, self.g4, self.ns, self.bs = events, g4, ns, ns.layout.page_size
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.max_pending, self.max_batch = max_pending, min(max_batch, MAX_BATCH_RECORDS)
        # A learned block not in G4 is looked for again after as long again as it has waited (at least one
        # interval: HEADs at about 1, 2, 4, 8 ... intervals), and dropped once it waited ``absent_s``: a write-behind
        # queue behind a throttled or saturated store can take minutes (before 2026-12-02: every interval, dropped
        # after 30 s, so such blocks were never announced)
        self.absent_s = max(600.0, 10 * interval_s)
        self.writer = os.urandom(8).hex()
        self._lock = threading.Lock()
        # -> (parent_seq, ev_info, t learned, t of its next look in G4)
        self._pending: OrderedDict[tuple[str, int], tuple] = OrderedDict()
        self._known: OrderedDict[tuple[str, int], Any] = OrderedDict()  # announced -> its tenant's _ident (bounded)
        self._idents: dict[str, Any] = {}  # tenant -> its _ident as the last flush found it (the flush thread's)
        self._recheck: OrderedDict[tuple[str, int], tuple] = OrderedDict()  # learned, judged repeats -> pending value
        self._batches: dict[str, tuple] = {}  # live batch name -> (its vLLM hashes, sealed time, its key)
        self._bad: OrderedDict[str, float] = OrderedDict()  # names read and ignored -> read again after (monotonic)
        self._live: dict[Any, list] = {}  # vLLM hash -> [live batches announcing it, ev_info]
        self._own: OrderedDict[str, float] = OrderedDict()  # batches written, not yet listed -> local time of write
        self._skew = 0.0  # store clock - this host's, measured on our own batches or a probe
        self._skew_at: float | None = None  # monotonic time it was last measured (None: never)
        self._probe_failed: float | None = None  # monotonic time a probe object was last refused
        self._capped_logged = False
        self._clock_warned = False  # a stated time far from the measured clock logged (once)
        self._ahead: dict[str, float] = {}  # listed batches stamped after now -> now when first listed
        self._gone: list = []  # vLLM hashes set_epoch withdrew, queued as BlockRemoved by the next poll
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    # ---- writer side ----------------------------------------------------------------------------
    def learn(self, tenant: str, seq: int, parent_seq: int | None, info: tuple) -> None:
        """A block a request saves (``info`` as :meth:`~.kv_events.G3KvEvents.learn` builds it). Runs on vLLM's
        scheduler thread: no keyring call (its reload reads and unwraps the whole file under its lock), only this
        announcer's lock. A block announced under its tenant's name and key as the last :meth:`flush` found them is
        a repeat: set aside for the next flush, which announces it again only if they changed since."""
        k = (tenant, int(seq))
        h, ph, toks, extra, lora_id, lora_name = info
        now = time.monotonic()
        with self._lock:
            # (parent, info, t learned, t of its next look, the epoch it was stored under: "" when absent)
            v = (parent_seq, (h, ph, toks, extra, lora_id, lora_name), now, now, self.epoch)
            if k in self._pending:
                return  # waiting for G4
            if k in self._known and self._known[k] == self._idents.get(tenant, _UNSEEN):
                self._recheck[k] = v  # announced already, as far as the last flush knew (module doc, "writes")
                while len(self._recheck) > self.max_pending:
                    self._recheck.popitem(last=False)
                return
            self._pending[k] = v
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
                stats.add(announce_dropped_absent=1)

    def _ident(self, tenant: str) -> tuple[int, Any]:
        """What names and seals ``tenant``'s blocks now: ``(keyring naming generation, current data key id, or
        the tenant's state when it has none)``; ``(0, None)`` without a keyring."""
        kr = self.ann.keyring
        if kr is None:
            return 0, None
        state, key_id = kr.tenant_key(tenant)
        return kr.naming_generation(), key_id if key_id is not None else state

    def flush(self, timeout_s: float = 10.0) -> int:
        """Announce the learned blocks G4 now holds (one object per tenant per ``max_batch``). Returns the
        blocks announced; blocks not yet in G4 wait (looked for again after as long as they waited, up to
        ``absent_s``)."""
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys
        domain = hash_domain()
        if domain is None:
            return 0
        with self._lock:
            todo, self._pending = list(self._pending.items()), OrderedDict()
            again, self._recheck = list(self._recheck.items()), OrderedDict()
        idents = {t: self._ident(t) for t in {k[0] for k, _ in todo + again}}  # this thread reads the keyring
        with self._lock:
            self._idents.update(idents)
            if len(self._idents) > 4 * self.max_pending:
                self._idents = dict(idents)
            # a repeat whose tenant is named or sealed otherwise now is announced again; a block announced
            # meanwhile (learned twice before this flush) is not
            todo = [(k, v) for k, v in dict(again + todo).items() if self._known.get(k) != idents[k[0]]]
            now = time.monotonic()
            for k, v in todo:  # not due yet: back to pending without a look
                if v[3] > now:
                    self._pending.setdefault(k, v)
            todo = [(k, v) for k, v in todo if v[3] <= now]
        if not todo:
            return 0
        futs = [[self.g4.lookup_prefix(run, request=False) for run in self.ns.rank_runs([seq], tenant)[1]]
                for (tenant, seq), _ in todo]
        by_tenant: dict[tuple[str, str], list] = {}  # (tenant, reset epoch) -> blocks
        keep = []
        now = time.monotonic()
        for ((tenant, seq), v), fs in zip(todo, futs):
            pseq, info, t, ep = v[0], v[1], v[2], v[4] if len(v) > 4 else ""
            try:
                present = all(f.result(timeout_s) >= 1 for f in fs)
            except Exception:  # noqa: BLE001 - unknown: ask again next time
                present = False
            if present:
                h, ph, toks, extra, lora_id, lora_name = info
                ek = (to_event_extra_keys([extra]) or [None])[0] if extra is not None else None
                by_tenant.setdefault((tenant, ep), []).append((seq, pseq, (h, ph, list(toks), ek, lora_id, lora_name)))
            elif now - t < self.absent_s:
                keep.append(((tenant, seq), (pseq, info, t, now + max(self.interval_s, now - t), ep)))
            else:
                stats.add(announce_dropped_absent=1)
        with self._lock:
            for k, v in keep:
                self._pending.setdefault(k, v)
        n = 0
        t_store = self._clock()[0] if by_tenant else 0.0  # sealed with the records: the age pollers go by
        for (tenant, ep), blocks in by_tenant.items():
            for i in range(0, len(blocks), self.max_batch):
                part = blocks[i:i + self.max_batch]
                try:
                    t0 = time.time()
                    recs = encode_records(self.writer, domain, self.bs, part, t_store, self.ttl_s)
                    if ep:  # the reset epoch its blocks were stored under (module doc, "Reset epochs")
                        recs["e"] = ep
                    name = self.ann.write(tenant, recs)
                    ident = self._ident(tenant)  # after the write: a tenant it created has its key id now
                    with self._lock:  # its store mtime measures the store's clock (see _now)
                        self._own[name] = (t0 + time.time()) / 2
                        for seq, _pseq, _info in part:  # announced under this name and key: repeats suppressed
                            self._known.pop((tenant, seq), None)
                            self._known[(tenant, seq)] = ident
                        while len(self._known) > 4 * self.max_pending:
                            self._known.popitem(last=False)
                        while len(self._own) > 4096:
                            self._own.popitem(last=False)
                except Exception as e:  # noqa: BLE001 - keyring or store trouble: these blocks stay unannounced
                    stats.add(announce_write_errors=1)
                    log.debug("g4.announce: write failed: %s", e)
                    continue
                n += len(part)
                stats.add(announce_written_batches=1, announce_written_blocks=len(part))
        return n

    # ---- poller side ----------------------------------------------------------------------------
    def poll(self) -> tuple[int, int]:
        """List the announcements once: queue ``BlockStored`` for blocks of new batches and ``BlockRemoved``
        for blocks no live batch announces any more (expired, deleted, or of a revoked tenant). Returns
        ``(stored, removed)`` blocks queued. The credits a reset withdrew before this poll (:meth:`set_epoch`) are
        queued first: the next batches may credit the very same hashes again (vLLM's block hash does not change
        with the reset epoch). Before 2026-12-03 they followed this poll's credits, so a prompt the engine stored
        again under its new epoch was credited then withdrawn, and the router lost blocks the engine hits."""
        with self._lock:  # those set_epoch withdraws during this poll (of its credits, maybe) wait for the next one
            early, self._gone = self._gone, []
        if early:
            self.events.emit_announced([], early)
            stats.add(announce_removed_blocks=len(early))
        domain = hash_domain()
        if domain is None:
            return 0, len(early)
        try:
            listed = self.ann.list()
        except Exception:  # noqa: BLE001 - store down: try again next interval
            stats.add(announce_poll_errors=1)
            return 0, len(early)
        now, measured = self._now(listed)
        names = {b.name for b in listed}
        gone = [n for n in self._batches if n not in names]
        self._ahead = {n: t for n, t in self._ahead.items() if n in names}
        stored: list = []
        reads = 0
        for b in listed:
            if b.mtime > now and b.name not in self._ahead:  # its writer's clock ahead: young (module doc)
                self._ahead[b.name] = now
                stats.add(announce_future_batches=1)
            live = self._batches.get(b.name)
            stamp = min(b.mtime, self._ahead.get(b.name, b.mtime), live[1] if live is not None else b.mtime)
            # a batch is judged by the TTL its writer sealed in it; one not read yet is read first (unless older
            # than any TTL may be), one ignored when read (foreign, corrupt, other domain) by this poller's own
            ttl = live[3] if live is not None else MAX_TTL_S if b.name not in self._bad else self.ttl_s
            if measured and now - stamp >= ttl:  # never on an unmeasured clock (module doc)
                if live is not None:
                    gone.append(b.name)
                self._expire(b)
                continue
            if live is not None:
                if not self.ann.key_held(live[2], b.tenant_hex):  # its tenant revoked: withdrawn
                    gone.append(b.name)
                    stats.add(announce_revoked_batches=1)
                continue
            if self._bad.get(b.name, 0.0) > time.monotonic() or reads >= MAX_BATCHES_PER_POLL:
                continue
            if len(self._live) >= MAX_LIVE_BLOCKS:
                self._cap(b)
                continue
            reads += 1
            got = self._read(b, domain)
            if got is None:
                continue
            t, blocks, key, ttl, ep = got
            if measured and now - min(stamp, t) >= ttl:  # its writer's TTL passed, or sealed long ago (a replay)
                self._bad[b.name] = float("inf")
                self._expire(b)
                continue
            if ep == self.epoch and len(self._live) + len(blocks) > MAX_LIVE_BLOCKS:  # another epoch's: no credit
                self._cap(b)
                continue
            stored += self._credit(b, t, key, blocks, ttl, ep)
        removed = self._withdraw(gone)
        n_st, n_rm = len(stored), len(removed)
        if stored or removed:
            self.events.emit_announced(stored, removed)
            stats.add(announce_stored_blocks=n_st, announce_removed_blocks=n_rm)
        return n_st, n_rm + len(early)

    def _credit(self, b: Batch, t: float, key: Any, blocks: list, ttl: float, epoch: str = "") -> list:
        """Count ``b``'s blocks live; their ``ev_info`` not live before (to publish). A batch of another reset
        ``epoch`` than the engine's is kept (it expires by its TTL) with none of its blocks credited."""
        stored, hs = [], []
        with self._lock:  # one batch (<= MAX_BATCH_RECORDS) at a time: learn() never waits long
            for _seq, _pseq, ev_info in blocks if epoch == self.epoch else ():
                h = ev_info[0]
                hs.append(h)
                ent = self._live.get(h)
                if ent is None:
                    self._live[h] = [1, ev_info]
                    stored.append(ev_info)
                else:
                    ent[0] += 1
            self._batches[b.name] = (hs, t, key, ttl, epoch)
        time.sleep(0)  # a learn() waiting for the lock gets it between batches
        return stored

    def _withdraw(self, gone: list[str]) -> list:
        removed = []
        for name in gone:
            with self._lock:
                ent_b = self._batches.pop(name, None)
                for h in ent_b[0] if ent_b is not None else ():
                    ent = self._live.get(h)
                    if ent is not None:
                        ent[0] -= 1
                        if ent[0] <= 0:
                            del self._live[h]
                            removed.append(h)
            time.sleep(0)  # a learn() waiting for the lock gets it between batches
        return removed

    def set_epoch(self, epoch: str) -> None:
        """The engine's reset epoch is ``epoch`` now (:func:`.reset_epoch.reset`, on the scheduler thread): blocks
        learned from now on are announced under it, only batches of it are credited, and the credits of batches
        of other epochs are withdrawn (off :meth:`live` at once; ``BlockRemoved`` queued first thing by the next
        :meth:`poll`, the one thread that queues announced blocks: after the credits of a poll running meanwhile,
        before those of the next poll, which may credit the same hashes under the new epoch)."""
        with self._lock:
            self.epoch = epoch
            for name, (hs, t, key, ttl, ep) in list(self._batches.items()):
                if ep == epoch or not hs:
                    continue
                self._batches[name] = ([], t, key, ttl, ep)  # kept for its expiry, crediting nothing
                for h in hs:
                    ent = self._live.get(h)
                    if ent is not None:
                        ent[0] -= 1
                        if ent[0] <= 0:
                            del self._live[h]
                            self._gone.append(h)

    def _cap(self, b: Batch) -> None:
        """``b`` would take the live blocks past MAX_LIVE_BLOCKS: not credited, read again later."""
        if b.name not in self._bad:
            stats.add(announce_ignored_capped=1)
        self._bad[b.name] = time.monotonic() + FOREIGN_RETRY_S
        if not self._capped_logged:
            self._capped_logged = True
            log.warning("g4.announce: %d announced blocks credited, the most a worker holds; further batches "
                        "are not credited until some expire (announce_ignored_capped)", MAX_LIVE_BLOCKS)

    def _clock(self) -> tuple[float, bool]:
        """``(now, measured)`` (epoch s) on the store's clock (module doc, "Time base"): the clock that stamps
        objects, this host's moved by the skew last measured (on this worker's own batches, or an empty probe object
        of :func:`~kvbm_backend.pool.g4.gc.probe_clock` when none was within CLOCK_REMEASURE_S), and the store's
        stated time (S3 ``Date``); the stated one unless it is more than CLOCK_AGREE_S ahead of the measured one (a
        proxy's own clock: a warning). ``measured`` False when neither worked: nothing then expires nor is deleted."""
        stated = self.ann.store.server_time()
        mono = time.monotonic()
        # a refused probe (read-only bucket) is tried again each call only where the store states no time
        if (self._skew_at is None or mono - self._skew_at > CLOCK_REMEASURE_S) and (
                stated is None or self._probe_failed is None or mono - self._probe_failed > CLOCK_REMEASURE_S):
            t0 = time.time()
            probed = probe_clock(self.ann.store)
            if probed is None:
                self._probe_failed = mono
            else:
                with self._lock:
                    self._skew, self._skew_at = probed - (t0 + time.time()) / 2, mono
        local = time.time()
        if self._skew_at is None:
            return (local, False) if stated is None else (stated, True)
        est = local + self._skew
        if stated is None:
            return est, True
        if abs(stated - est) > CLOCK_AGREE_S and not self._clock_warned:
            self._clock_warned = True
            log.warning("g4.announce: the store's stated time (S3 Date header) is %+.0f s from the clock stamping its "
                        "objects: a proxy or gateway in front of it states another clock; batches are aged on the "
                        "earlier", stated - est)
        return (est, True) if stated - est > CLOCK_AGREE_S else (stated, True)

    def _now(self, listed: list[Batch]) -> tuple[float, bool]:
        """:meth:`_clock`, after measuring the skew on this worker's own listed batches. Never the listed
        mtimes themselves."""
        with self._lock:
            for b in listed:
                t = self._own.pop(b.name, None)
                if t is not None:
                    self._skew, self._skew_at = b.mtime - t, time.monotonic()
        return self._clock()

    def _read(self, b: Batch, domain: str) -> tuple[float, list, Any, float, str] | None:
        """``(sealed time, blocks, key, its writer's TTL, its reset epoch)`` of ``b``, or None (ignored, counted,
        or a store error)."""
        try:
            recs, why, key = self.ann.open(b)
        except Exception:  # noqa: BLE001 - store trouble: read it again next time
            stats.add(announce_poll_errors=1)
            return None
        if recs is None:
            if why != "absent":
                self._ignore(b, why)
            return None
        try:
            got = decode_records(recs, domain, self.bs, lambda salt: self.ann.names_tenant(b, salt))
            ep = recs.get("e", "")
            if got is not None and (not isinstance(ep, str) or len(ep) > 64):
                raise ValueError("batch: reset epoch")
        except (ValueError, TypeError, KeyError, RecursionError, MemoryError):
            self._ignore(b, "corrupt")
            return None
        if got is None:
            self._ignore(b, "domain")
            return None
        return got[0], got[1], key, sealed_ttl(recs, self.ttl_s), ep

    def _ignore(self, b: Batch, why: str) -> None:
        """Count ``b`` ignored; not read again (``foreign``: not for ``FOREIGN_RETRY_S``, the keyring may
        learn its tenant)."""
        if b.name not in self._bad:
            stats.add(**{f"announce_ignored_{why}": 1})
        self._bad.pop(b.name, None)
        self._bad[b.name] = time.monotonic() + FOREIGN_RETRY_S if why == "foreign" else float("inf")
        while len(self._bad) > 65536:
            self._bad.popitem(last=False)

    def _expire(self, b: Batch) -> None:
        try:
            self.ann.delete(b)
            stats.add(announce_expired_batches=1)
        except Exception:  # noqa: BLE001 - another poller may delete it
            stats.add(announce_poll_errors=1)

    def live(self) -> list:
        """``ev_info`` of every block announced now (re-published after a prefix-cache reset)."""
        with self._lock:
            return [ent[1] for ent in self._live.values()]

    # ---- thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Flush and poll every ``interval_s`` on a daemon thread until :meth:`stop`."""
        if self._t is None:
            self._t = start_thread(self._loop, name="kvbm-g4-announce")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
                self.poll()
            except Exception:  # noqa: BLE001 - never let the thread die
                log.exception("g4.announce: flush/poll failed")
                stats.add(announce_poll_errors=1)

    def stop(self) -> None:
        self._stop.set()
