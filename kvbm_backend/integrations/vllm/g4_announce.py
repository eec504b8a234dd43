"""G4 blocks announced to every worker, so Dynamo's KV router credits each of them (``g4.announce``).

G4 is shared: any worker with the keyring can load a block another one wrote, but Dynamo's router credits a
block only to the worker whose KV events published it (Dynamo 1.6.1's ``--shared-cache-type`` speaks only to
SGLang's HiCache / Mooncake). With ``g4.announce`` each worker's scheduler-side connector

* **writes**: remembers the blocks its requests save (vLLM block hash, parent hash, tokens, event extra
  keys, LoRA; learned with the G3 events' :meth:`~.kv_events.G3KvEvents.learn`), and every
  ``announce_interval_s`` checks which of them G4 now holds (HEAD, the pool's ``lookup_prefix``: published
  after durable) and writes them as one sealed record batch per tenant (:mod:`kvbm_backend.pool.g4.announce`:
  AES-256-GCM under the tenant's data key, so prompt tokens never reach the store in clear);
* **polls**: on the same background thread lists the namespace's announcement objects (a LIST, never on the
  serving path), opens the new ones (foreign, corrupt, other hash domain: ignored and counted) and queues
  ``BlockStored`` (``medium="DISK"``, Dynamo's ``disk_blocks``) for their blocks, the worker's own included,
  through the connector's KV events (:class:`~.kv_events.G3KvEvents`; published by vLLM's scheduler, or by
  the idle publisher while the engine does not step); re-published after a prefix-cache reset.
* **removal**: records expire. A batch whose store mtime is ``announce_ttl_s`` old, or that disappeared
  (any poller deletes expired batches), is withdrawn: ``BlockRemoved`` for blocks no live batch still
  announces. Blocks are not re-announced, so a block older than the TTL loses its router credit (it stays
  loadable); a block ``kvbm-backend gc`` deletes before the TTL keeps its credit until then (a routing
  preference, never KV: its load misses and the engine recomputes). Run gc with ``--max-age-s`` >= the TTL.

**Time base** (as :mod:`kvbm_backend.pool.g4.gc`): ages are ``now - mtime`` with ``now`` the store's clock
where it states one (S3: the ``Date`` header, :meth:`~kvbm_backend.pool.g4.store.ObjectStore.server_time`),
else this host's clock moved by the skew measured on this worker's own batches (the store mtime of a batch
it wrote minus this host's clock at the write: a free probe, no object written for it; 0 until one is
listed, and on filesystems whose clients stamp mtimes). ``now`` never follows the listed mtimes: a batch
stamped later than ``now`` (its writer's clock ahead on a client-stamped filesystem such as CephFS, Lustre
or some NFS; a restored file) is young, read and credited, and counted (``announce_future_batches``); its age
runs from when this poller first listed it, so it expires ``announce_ttl_s`` after that (again after a
restart), not only once its own stamp is that old. Before (2026-11-29), ``now`` was never earlier than the
newest listed mtime: one batch stamped an hour ahead made every fresh batch an hour old, so with the default
TTL every poller withdrew and deleted every other batch of the fleet.

Hash domain: the records carry the writer's vLLM block hashes, which every worker computes alike only with
the same hash function and seed (vLLM's default sha256 with the fixed seed, or one shared ``PYTHONHASHSEED``
as Dynamo's launcher sets); each batch names its domain (a digest of vLLM's ``NONE_HASH``) and a poller
ignores batches of another (``announce_ignored_domain``).

Counters (scheduler stats): ``announce_written_batches`` / ``_blocks``, ``announce_write_errors``,
``announce_dropped_absent`` (learned, never found in G4), ``announce_stored_blocks`` /
``announce_removed_blocks`` (queued events), ``announce_ignored_{foreign,corrupt,domain}``,
``announce_expired_batches``, ``announce_future_batches`` (stamped ahead of the poller's clock, counted once),
``announce_poll_errors``.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
from array import array
from collections import OrderedDict
from typing import Any

from ...pool.g4.announce import Announcements, Batch
from . import stats

log = logging.getLogger(__name__)
RECORD_VERSION = 1
FOREIGN_RETRY_S = 60.0  # a batch sealed under a key this keyring lacks is read again after this long


def hash_domain() -> str | None:
    """Digest of vLLM's ``NONE_HASH`` and hash form (None before vLLM set it): equal across workers exactly
    when their block hashes agree."""
    from vllm import envs
    from vllm.v1.core import kv_cache_utils as kcu
    if kcu.NONE_HASH is None:
        return None
    form = b"int" if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else b"bytes"
    return hashlib.sha256(bytes(kcu.NONE_HASH) + form).hexdigest()[:16]


def _enc_hash(h: Any) -> Any:
    return None if h is None else (h.hex() if isinstance(h, (bytes, bytearray)) else int(h))


def _dec_hash(v: Any) -> Any:
    if v is None or isinstance(v, int):
        return v
    if isinstance(v, str):
        return bytes.fromhex(v)
    raise ValueError("hash")


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def encode_records(writer: str, domain: str, block_size: int, blocks: list[tuple]) -> dict:
    """Record batch (JSON-able) of ``blocks``: ``(seq_hash, parent_seq, ev_info)`` with ``ev_info`` =
    ``(vLLM hash, parent hash, tokens, event extra keys, lora_id, lora_name)``."""
    out = []
    for seq, pseq, (h, ph, toks, ek, lora_id, lora_name) in blocks:
        out.append([seq, pseq, _enc_hash(h), _enc_hash(ph), base64.b64encode(array("I", toks).tobytes()).decode(),
                    ek, lora_id, lora_name])
    return {"v": RECORD_VERSION, "w": writer, "d": domain, "bs": block_size, "b": out}


def decode_records(recs: dict, domain: str, block_size: int) -> list[tuple] | None:
    """``[(seq, parent_seq, ev_info), ...]`` of a batch, or None when it is of another version, hash domain or
    block size. Raises ValueError/TypeError/KeyError on malformed records."""
    if recs.get("v") != RECORD_VERSION or recs.get("d") != domain or recs.get("bs") != block_size:
        return None
    out = []
    for seq, pseq, h, ph, toks, ek, lora_id, lora_name in recs["b"]:
        t = array("I")
        t.frombytes(base64.b64decode(toks, validate=True))
        if len(t) != block_size or not isinstance(seq, int) or h is None:
            raise ValueError("record")
        out.append((seq, pseq, (_dec_hash(h), _dec_hash(ph), t, _freeze(ek), lora_id, lora_name)))
    return out


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

    def __init__(self, events: Any, g4: Any, ns: Any, interval_s: float, ttl_s: float, max_pending: int = 1 << 16,
                 max_batch: int = 4096):
        pool = getattr(g4, "inner", g4)
        self.ann = Announcements(pool.store, pool.namespace.fingerprint, pool.keyring, pool.encrypt, pool.pseudonym)
        self.events, self.g4, self.ns, self.bs = events, g4, ns, ns.layout.page_size
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.max_pending, self.max_batch = max_pending, max_batch
        self.absent_s = max(30.0, 10 * interval_s)  # a learned block not in G4 by then was dropped
        self.writer = os.urandom(8).hex()
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, int], tuple] = OrderedDict()  # -> (parent_seq, ev_info, t)
        self._known: OrderedDict[tuple[str, int], None] = OrderedDict()  # learned once (bounded)
        self._batches: dict[str, list] = {}  # live batch name -> its vLLM hashes
        self._bad: OrderedDict[str, float] = OrderedDict()  # names read and ignored -> read again after (monotonic)
        self._live: dict[Any, list] = {}  # vLLM hash -> [live batches announcing it, ev_info]
        self._own: OrderedDict[str, float] = OrderedDict()  # batches written, not yet listed -> local time of write
        self._skew = 0.0  # store clock - this host's, measured on our own batches (no server time)
        self._ahead: dict[str, float] = {}  # listed batches stamped after now -> now when first listed
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    # ---- writer side ----------------------------------------------------------------------------
    def learn(self, tenant: str, seq: int, parent_seq: int | None, info: tuple) -> None:
        """A block a request saves (``info`` as :meth:`~.kv_events.G3KvEvents.learn` builds it)."""
        k = (tenant, int(seq))
        with self._lock:
            if k in self._known:
                return
            self._known[k] = None
            if len(self._known) > 4 * self.max_pending:
                self._known.popitem(last=False)
            h, ph, toks, extra, lora_id, lora_name = info
            self._pending[k] = (parent_seq, (h, ph, toks, extra, lora_id, lora_name), time.monotonic())
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
                stats.add(announce_dropped_absent=1)

    def flush(self, timeout_s: float = 10.0) -> int:
        """Announce the learned blocks G4 now holds (one object per tenant per ``max_batch``). Returns the
        blocks announced; blocks not yet in G4 wait (up to ``absent_s``)."""
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys
        domain = hash_domain()
        if domain is None:
            return 0
        with self._lock:
            todo, self._pending = list(self._pending.items()), OrderedDict()
        if not todo:
            return 0
        futs = [[self.g4.lookup_prefix(run, request=False) for run in self.ns.rank_runs([seq], tenant)[1]]
                for (tenant, seq), _ in todo]
        by_tenant: dict[str, list] = {}
        keep = []
        now = time.monotonic()
        for ((tenant, seq), (pseq, info, t)), fs in zip(todo, futs):
            try:
                present = all(f.result(timeout_s) >= 1 for f in fs)
            except Exception:  # noqa: BLE001 - unknown: ask again next time
                present = False
            if present:
                h, ph, toks, extra, lora_id, lora_name = info
                ek = (to_event_extra_keys([extra]) or [None])[0] if extra is not None else None
                by_tenant.setdefault(tenant, []).append((seq, pseq, (h, ph, list(toks), ek, lora_id, lora_name)))
            elif now - t < self.absent_s:
                keep.append(((tenant, seq), (pseq, info, t)))
            else:
                stats.add(announce_dropped_absent=1)
        with self._lock:
            for k, v in keep:
                self._pending.setdefault(k, v)
        n = 0
        for tenant, blocks in by_tenant.items():
            for i in range(0, len(blocks), self.max_batch):
                part = blocks[i:i + self.max_batch]
                try:
                    t0 = time.time()
                    name = self.ann.write(tenant, encode_records(self.writer, domain, self.bs, part))
                    with self._lock:  # its store mtime measures the store's clock (see _now)
                        self._own[name] = (t0 + time.time()) / 2
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
        for blocks no live batch announces any more. Returns ``(stored, removed)`` blocks queued."""
        domain = hash_domain()
        if domain is None:
            return 0, 0
        try:
            listed = self.ann.list()
        except Exception:  # noqa: BLE001 - store down: try again next interval
            stats.add(announce_poll_errors=1)
            return 0, 0
        now = self._now(listed)
        names = {b.name for b in listed}
        gone = [n for n in self._batches if n not in names]
        fresh: list[tuple[Batch, list]] = []
        self._ahead = {n: t for n, t in self._ahead.items() if n in names}
        for b in listed:
            if b.mtime > now and b.name not in self._ahead:  # its writer's clock ahead: young (module doc)
                self._ahead[b.name] = now
                stats.add(announce_future_batches=1)
            if now - min(b.mtime, self._ahead.get(b.name, b.mtime)) >= self.ttl_s:
                if b.name in self._batches:
                    gone.append(b.name)
                self._expire(b)
                continue
            if b.name in self._batches or self._bad.get(b.name, 0.0) > time.monotonic():
                continue
            blocks = self._read(b, domain)
            if blocks is not None:
                fresh.append((b, blocks))
        stored, removed = [], []
        with self._lock:
            for name in gone:
                for h in self._batches.pop(name, ()):
                    ent = self._live.get(h)
                    if ent is not None:
                        ent[0] -= 1
                        if ent[0] <= 0:
                            del self._live[h]
                            removed.append(h)
            for b, blocks in fresh:
                hs = []
                for _seq, _pseq, ev_info in blocks:
                    h = ev_info[0]
                    hs.append(h)
                    ent = self._live.get(h)
                    if ent is None:
                        self._live[h] = [1, ev_info]
                        stored.append(ev_info)
                    else:
                        ent[0] += 1
                self._batches[b.name] = hs
        if stored or removed:
            self.events.emit_announced(stored, removed)
            stats.add(announce_stored_blocks=len(stored), announce_removed_blocks=len(removed))
        return len(stored), len(removed)

    def _now(self, listed: list[Batch]) -> float:
        """The time base of ages (module doc): the store's stated clock, else this host's moved by the skew
        measured on this worker's own listed batches. Never the listed mtimes themselves."""
        with self._lock:
            for b in listed:
                t = self._own.pop(b.name, None)
                if t is not None:
                    self._skew = b.mtime - t
        t = self.ann.store.server_time()
        return t if t is not None else time.time() + self._skew

    def _read(self, b: Batch, domain: str) -> list | None:
        try:
            recs, why = self.ann.read(b)
        except Exception:  # noqa: BLE001 - store trouble: read it again next time
            stats.add(announce_poll_errors=1)
            return None
        if recs is None:
            if why != "absent":
                self._ignore(b, why)
            return None
        try:
            blocks = decode_records(recs, domain, self.bs)
        except (ValueError, TypeError, KeyError):
            self._ignore(b, "corrupt")
            return None
        if blocks is None:
            self._ignore(b, "domain")
        return blocks

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
            self._t = threading.Thread(target=self._loop, name="kvbm-g4-announce", daemon=True)
            self._t.start()

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
