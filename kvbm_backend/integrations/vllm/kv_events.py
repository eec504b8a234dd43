"""G3 contents published as vLLM KV events for Dynamo's KV router (:class:`G3KvEvents`)."""
from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import stats
from .metadata import snapshot_ranks
from .rank_masks import RankMasks, block_fps, report_columns
from ...threads import start_thread

EMIT_CHUNK = 1024  # announced blocks queued per hold of the events lock (emit_announced)
APPLY_CHUNK = 1 << 15  # report entries per hold of the events lock (apply)

class G3KvEvents:
    """G3 contents as vLLM KV events (``BlockStored`` / ``BlockRemoved``, ``medium="DISK"``), returned by
    the connector's ``take_events`` and published by vLLM's scheduler with its own (``--kv-events-config``),
    so Dynamo's KV router counts this worker's G3 blocks (its ``disk_blocks``; Dynamo maps the medium
    ``"DISK"`` to its ``StorageTier::Disk``) and prefers the worker whose G3 holds a prompt's prefix.

    Identity: the router matches a prompt on per-block token hashes it computes itself from the event's
    ``token_ids`` and chains blocks by the event's ``block_hashes`` / ``parent_block_hash``; for the chain to
    continue from the engine's own (GPU) events these are vLLM's block hashes of the same blocks, as vLLM
    publishes them (``maybe_convert_block_hash``). G3 is keyed by KVBM sequence hashes, which vLLM's hashes
    cannot be computed from (vLLM hashes with SHA-256 over CBOR, KVBM with xxh3), so the scheduler learns
    ``(tenant tag, seq_hash) -> (vLLM hash, parent, tokens)`` from the requests whose blocks it saves or
    finds in G3, and translates the worker's G3 index reports (:class:`KvbmWorkerMeta`, also sent in the
    shared-pool mode when events are on): a block is published stored once every TP rank reports it present
    (written and indexed), and removed when any rank reports it gone (evicted, dropped as corrupt, failed to
    load). A block found again after a worker restart is published when a request first looks it up.
    G4 is published only with ``g4.announce`` (:mod:`.g4_announce`: every announcing worker is credited with
    every announced G4 block, through :meth:`emit_announced`; ``g3=False`` when this worker has no G3).
    The router keeps one credit per (worker, vLLM hash, medium), not a count, and G3 and G4 both publish
    ``DISK``, as do two tenants' G3 blocks of one vLLM hash (requests without a cache salt): each vLLM hash
    therefore has a count of its holders here (G3 entries, the G4 announcement), and ``BlockStored`` goes out
    when the first appears, ``BlockRemoved`` only when the last goes (before 2026-11-30 a G3 eviction withdrew
    the credit of a block G4 still announced, and an expired announcement that of a block G3 still held).
    Memory: per published block its vLLM hash and tokens (~4 bytes per token), kept
    for removal and re-publishing; learned-but-unwritten entries are capped at ``max_pending``. Per block
    any rank reports present (restored blocks no request asks for included: most of a big G3), which ranks
    hold it: a 64-bit fingerprint of (tenant tag, seq_hash) and a rank bitmask in numpy tables
    (:class:`~.rank_masks.RankMasks`), 18 to 36 bytes per block at TP <= 8 (up to 64 at TP 64); before
    2026-11-30 a dict of sets, ~357 bytes per block at TP=2 (4-14 GB for a G3 of 10-40M blocks).
    Fingerprint collisions (only between blocks of different tenants: the fingerprint is a bijection of the
    sequence hash for one tenant; probability about n^2 / 2^65 for n blocks, 4e-5 at 40M) make two blocks
    share one rank mask: a block can be published stored while a rank lacks it, or withheld or withdrawn
    while every rank holds it. That costs at most one wrong routing credit: the router only routes, and the
    worker looks the block up in its own G3 index and verifies every frame it loads (a miss is recomputed,
    never wrong KV).
    """

    MEDIUM = "DISK"

    def __init__(self, tp_world_size: int, block_size: int, kv_cache_spec: Any = None, max_pending: int = 1 << 18,
                 g3: bool = True):
        from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: F401 - fail early without vLLM
        self.tp, self.bs = tp_world_size, block_size
        self.kind = self.window = None
        if kv_cache_spec is not None:
            from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
            self.kind = get_kv_cache_spec_kind(kv_cache_spec).value
            self.window = get_kv_cache_spec_sliding_window(kv_cache_spec)
        self.max_pending = max_pending
        self._info: OrderedDict[tuple[bytes, int], tuple] = OrderedDict()  # learned, not yet published
        self._ranks = RankMasks(tp_world_size)  # block fingerprint -> ranks whose G3 holds it (bitmask)
        self._full = (1 << tp_world_size) - 1  # the mask of a block every rank holds
        self._published: dict[tuple[bytes, int], tuple] = {}   # -> what was published (for removal, re-publish)
        self._holders: dict[Any, int] = {}  # vLLM hash -> G3 entries + G4 announcement publishing it
        self._events: list = []
        self._lock = threading.Lock()
        self.g3 = g3  # False: no G3 (G4 announcements only), nothing learned is kept here
        self.announcer: Any = None  # a .g4_announce.G4Announcer (g4.announce), told every learned block
        self._snapped: set[int] = set()  # TP ranks whose snapshot was applied
        self._for_step = False  # a republish() queued events that only the step's take() may take (take(idle=))

    def learn(self, tenant: str, request: Any, seq_hashes: Sequence[int], first: int, end: int,
              announce: bool = True, to_g3: bool = True) -> None:
        """Blocks ``[first, end)`` of ``request`` (KVBM ``seq_hashes``) are, or are about to be, in G3. ``announce``
        False: not told to the G4 announcer (under ``external_launcher`` with TP > 1 and one hash domain only TP
        rank 0's is: .tp_events). ``to_g3`` False: told to the announcer only, not learned for G3 (blocks offered
        to G4 alone)."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash
        from ...pool.g3.index import tag_of
        vh = list(getattr(request, "block_hashes", None) or [])
        toks = getattr(request, "all_token_ids", None) or []
        lora = getattr(request, "lora_request", None)
        tag = tag_of(tenant)
        end = min(end, len(seq_hashes), len(vh), len(toks) // self.bs)
        ann = self.announcer if announce else None
        g3 = self.g3 and to_g3
        new: list[tuple[bytes, int]] = []
        with self._lock:
            for i in range(max(first, 0), end):
                k = (tag, seq_hashes[i])
                if ann is None and (not g3 or k in self._published or k in self._info):
                    continue
                extra, _ = generate_block_hash_extra_keys(request, i * self.bs, (i + 1) * self.bs, 0)
                info = (maybe_convert_block_hash(vh[i]), maybe_convert_block_hash(vh[i - 1]) if i else None,
                        array("I", toks[i * self.bs:(i + 1) * self.bs]), extra,
                        getattr(lora, "adapter_id", None), getattr(lora, "name", None))
                if ann is not None:
                    ann.learn(tenant, seq_hashes[i], seq_hashes[i - 1] if i else None, info)
                if not g3 or k in self._published or k in self._info:
                    continue
                self._info[k] = info
                new.append(k)
            if new:  # in block order, as each was learned (the rank masks do not change meanwhile)
                for k, m in zip(new, self._ranks.masks(block_fps([k[0] for k in new], [k[1] for k in new]))):
                    if m == self._full:
                        self._store(k)
            while len(self._info) > self.max_pending:  # learned but never written (dropped offloads)
                self._info.popitem(last=False)

    def apply(self, meta: Any, rank: int | None = None) -> None:
        """A worker's G3 index report (``(tenant tag, rank, seq_hash)`` entries added / removed): ``removed``
        first, then ``added``, each in order. Ranks outside ``[0, tp)`` hold nothing here (the namespace
        never cuts such keys). ``rank``: the TP rank whose report this is (the report channel), None for a
        step's output (every rank's aggregated).

        A snapshot of a rank that sent one before (its report channel failed and lost a report, see
        :meth:`~.g3_mirror.G3Mirror.apply`) replaces that rank's entries: the rank is first taken out of every
        block's mask, and the published blocks it held that the snapshot does not hold again are withdrawn
        (``BlockRemoved`` once no other holder of their hash is left) and kept as learned, so that a later
        report completing their mask publishes them again (a snapshot over ``MAX_ENTRIES`` entries comes in
        several messages, the replacement with the first). Before 2026-11-30 a snapshot only added: the
        removals of the lost report were never published and the router kept credit for those blocks."""
        if not self.g3:  # nothing learned is kept, so nothing reported can be published
            return
        rem, add = meta.removed, meta.added
        snap = snapshot_ranks(meta, rank)
        with self._lock:
            lost = [self._ranks.drop_rank(r) for r in snap if r in self._snapped]
            self._snapped.update(snap)
        # The lock the scheduler's take() (every step) and learn() need is held for APPLY_CHUNK entries at a
        # time, columns and fingerprints computed outside it (before 2026-12-02 a 1M-block snapshot held it
        # 0.3-0.7 s on the 2-core VM). Between two chunks a learn() sees the masks of the entries applied so far:
        # a block whose mask a later chunk completes is stored by that chunk (it is learned by then).
        for i in range(0, len(rem), APPLY_CHUNK):
            if i:
                time.sleep(0)  # let a waiting take() have the lock (a released Lock is not handed over)
            self._apply_removed(rem[i:i + APPLY_CHUNK])
        for i in range(0, len(add), APPLY_CHUNK):
            if i or len(rem) > APPLY_CHUNK:
                time.sleep(0)
            self._apply_added(add[i:i + APPLY_CHUNK])
        if lost:
            self._withdraw(np.concatenate(lost))

    def _apply_removed(self, rem: Sequence) -> None:
        tags, ranks, seqs = report_columns(rem)
        fps, ranks = self._valid(block_fps(tags, seqs), ranks)
        with self._lock:
            self._ranks.clear_bits(fps, ranks)
            pub = self._published
            if pub:
                for tag, _, seq in rem:
                    info = pub.pop((tag, seq), None)
                    if info is not None:
                        self._emit_removed(info[0])

    def _apply_added(self, add: Sequence) -> None:
        tags, ranks, seqs = report_columns(add)
        fps = block_fps(tags, seqs)
        valid = self._valid(fps, ranks)
        with self._lock:
            info_ = self._info
            # learned blocks: stored when the entry that completes their mask comes, in report order
            sel = [i for i, (tag, _, seq) in enumerate(add) if (tag, seq) in info_] if info_ else []
            if sel:
                cur: dict[int, int] = {}
                fl = fps[sel].tolist()
                for i, f, m in zip(sel, fl, self._ranks.masks(fps[sel])):
                    m = cur.get(f, m)
                    r = ranks[i]
                    if 0 <= r < self.tp:
                        m |= 1 << r
                    cur[f] = m
                    k = (tags[i], seqs[i])
                    if m == self._full and k in info_ and k not in self._published:
                        self._store(k)
            self._ranks.set_bits(*valid)

    def _withdraw(self, lost: Any) -> None:
        """Withdraw the published blocks of fingerprints ``lost`` (their mask lost a rank) that some rank no
        longer holds; each is learned again (re-published when its mask is full again). The published keys
        are fingerprinted outside the lock (before 2026-12-02 under it: 1.2 s at 300k published blocks, as
        measured in review); a key published or withdrawn meanwhile is judged by its mask then."""
        with self._lock:
            keys = list(self._published)
        if not keys:
            return
        fps = block_fps([k[0] for k in keys], [k[1] for k in keys])
        idx = np.flatnonzero(np.isin(fps, lost)).tolist()
        for a in range(0, len(idx), APPLY_CHUNK):
            part = idx[a:a + APPLY_CHUNK]
            with self._lock:
                for i, m in zip(part, self._ranks.masks(fps[part])):
                    k = keys[i]
                    if m != self._full and k in self._published:
                        info = self._info[k] = self._published.pop(k)
                        self._emit_removed(info[0])
                while len(self._info) > self.max_pending:
                    self._info.popitem(last=False)
            time.sleep(0)

    def _valid(self, fps: Any, ranks: list) -> tuple[Any, list]:
        """``fps`` and ``ranks`` without the entries of a rank outside ``[0, tp)``."""
        if ranks and (min(ranks) < 0 or max(ranks) >= self.tp):
            keep = [i for i, r in enumerate(ranks) if 0 <= r < self.tp]
            return fps[keep], [ranks[i] for i in keep]
        return fps, ranks

    def _store(self, k) -> None:
        """Publish learned block ``k`` (in ``_info``, held by every rank)."""
        info = self._published[k] = self._info.pop(k)
        self._emit_stored(info)

    def _emit_stored(self, info: tuple, count: bool = True) -> None:
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys
        h, parent, toks, extra, lora_id, lora_name = info
        ek = (to_event_extra_keys([extra]) or [None])[0] if extra is not None else None
        self._emit_stored_event((h, parent, toks, ek, lora_id, lora_name), count)

    def _emit_stored_event(self, ev_info: tuple, count: bool = True) -> None:
        """``ev_info``: ``(vLLM hash, parent hash, tokens, event-form extra keys, lora_id, lora_name)``; with
        ``count``, one more holder of the hash (queued only for its first)."""
        from vllm.distributed.kv_events import BlockStored
        h, parent, toks, ek, lora_id, lora_name = ev_info
        if count:
            n = self._holders.get(h, 0)
            self._holders[h] = n + 1
            if n:
                return
        toks = list(toks)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent and last.lora_name == lora_name:
            if ek is not None and last.extra_keys is None:
                last.extra_keys = [None] * len(last.block_hashes)
            if last.extra_keys is not None:
                last.extra_keys.append(ek)
            last.block_hashes.append(h)  # one event per run of consecutive blocks
            last.token_ids.extend(toks)
            return
        self._events.append(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=toks,
                                        block_size=self.bs, lora_id=lora_id, medium=self.MEDIUM, lora_name=lora_name,
                                        extra_keys=[ek] if ek is not None else None,
                                        group_idx=0, kv_cache_spec_kind=self.kind,
                                        kv_cache_spec_sliding_window=self.window, locality="LOCAL"))

    def _emit_removed(self, h) -> None:
        """One holder of ``h`` fewer; ``BlockRemoved`` queued when it was the last."""
        from vllm.distributed.kv_events import BlockRemoved
        n = self._holders.pop(h, 0)
        if n > 1:
            self._holders[h] = n - 1
            return
        if not n:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
            return
        self._events.append(BlockRemoved(block_hashes=[h], medium=self.MEDIUM, group_idx=0, locality="LOCAL"))

    def emit_announced(self, stored: list, removed: list) -> None:
        """G4 blocks announced by any worker (:mod:`.g4_announce`): ``stored`` ``ev_info`` tuples (see
        :meth:`_emit_stored_event`) and ``removed`` vLLM hashes, queued as this worker's ``DISK`` blocks.
        The lock the scheduler's :meth:`take` needs is held for :data:`EMIT_CHUNK` blocks at a time, never
        for the whole import (before 2026-11-30: 2.5 s for 600k records, every step waiting)."""
        stored = [(h, ph, list(toks), ek, li, ln) for h, ph, toks, ek, li, ln in stored]  # built unlocked
        for i in range(0, len(stored), EMIT_CHUNK):
            with self._lock:
                for ev_info in stored[i:i + EMIT_CHUNK]:
                    self._emit_stored_event(ev_info)
            time.sleep(0)  # let a waiting take() have the lock (a released Lock is not handed over)
        for i in range(0, len(removed), EMIT_CHUNK):
            with self._lock:
                for h in removed[i:i + EMIT_CHUNK]:
                    self._emit_removed(h)
            time.sleep(0)

    def republish(self) -> None:
        """Publish every block G3 holds again: vLLM's ``AllBlocksCleared`` (a reset of the engine's prefix
        cache, e.g. Dynamo's ``clear_kv_blocks``) makes Dynamo's router forget the worker's blocks in every
        tier, G3's included (and the announced G4 blocks). Queued after the engine's own events of the step,
        so they follow the clear: until the step's :meth:`take`, an idle take (:class:`IdlePublisher`) takes
        nothing (before 2026-12-03 the idle thread took them while this queued them, after an idle spell, and sent
        them before the step's batch: the router applied the clear after them and credited none of them)."""
        with self._lock:
            self._for_step = True
        announced = self.announcer.live() if self.announcer is not None else []
        with self._lock:
            held = list(self._published.values())
        seen: set = set()  # each held hash once; the holder counts stay as they are
        for i in range(0, len(held), EMIT_CHUNK):  # the lock for a chunk at a time (before 2026-12-02: all)
            with self._lock:
                for info in held[i:i + EMIT_CHUNK]:
                    # a hash whose last holder went since the list was taken has had its BlockRemoved: not again
                    if info[0] not in seen and self._holders.get(info[0], 0):
                        seen.add(info[0])
                        self._emit_stored(info, count=False)
            time.sleep(0)
        for i in range(0, len(announced), EMIT_CHUNK):  # the lock for a chunk at a time (emit_announced)
            with self._lock:
                for ev_info in announced[i:i + EMIT_CHUNK]:
                    # as above: an announcement withdrawn since live() was read has had its BlockRemoved (before
                    # 2026-12-02 it was stored again, and the router credited it until the next reset)
                    if ev_info[0] not in seen and self._holders.get(ev_info[0], 0):
                        seen.add(ev_info[0])
                        self._emit_stored_event(ev_info, count=False)
            time.sleep(0)
        stats.add(kv_events_republished=1)

    def forget(self, withdraw: bool) -> int:
        """The connector's ``reset_cache`` (:mod:`.reset_epoch`): the G3 blocks learned or published so far are
        no longer this engine's (another identity), so they are neither published nor re-published again. Each
        published one gives up its holder; with ``withdraw`` (vLLM's own prefix-cache reset failed: no
        ``AllBlocksCleared`` goes out) ``BlockRemoved`` is queued for every hash no G4 announcement still holds,
        without it (the router has just forgotten every tier) nothing is, and the events queued so far are dropped:
        the next step publishes them after its ``AllBlocksCleared``, and what they say of blocks still held is
        said again by the :meth:`republish` that follows it (before 2026-12-03 a G3 report's ``BlockStored`` still
        queued at the reset left after the clear: the router credited blocks of the old identity, whose holders
        were given up here, so no ``BlockRemoved`` ever followed). Returns the published blocks forgotten."""
        with self._lock:
            pub, self._published = self._published, {}
            self._info.clear()
            if not withdraw:
                self._events = []
        hs = [info[0] for info in pub.values()]
        for i in range(0, len(hs), EMIT_CHUNK):  # the lock for a chunk at a time (as republish)
            with self._lock:
                for h in hs[i:i + EMIT_CHUNK]:
                    if withdraw:
                        self._emit_removed(h)
                    elif (n := self._holders.pop(h, 0)) > 1:
                        self._holders[h] = n - 1
            time.sleep(0)
        return len(hs)

    def take(self, idle: bool = False) -> list:
        """The queued events, in order. ``idle``: the idle publisher's take, which gets none while a
        :meth:`republish` awaits the step's take (the events must follow the step's ``AllBlocksCleared``)."""
        with self._lock:
            if idle and self._for_step:
                return []
            ev, self._events, self._for_step = self._events, [], False
        if ev:
            stats.add(kv_events_stored_blocks=sum(len(e.block_hashes) for e in ev if type(e).__name__ == "BlockStored"),
                      kv_events_removed_blocks=sum(len(e.block_hashes) for e in ev if type(e).__name__ == "BlockRemoved"))
        return ev

    def published(self) -> int:
        return len(self._published)


def caller_publisher(frame: Any, depth: int = 3) -> Any:
    """vLLM's KV event publisher of the scheduler whose method runs in ``frame`` or one of its ``depth - 1``
    callers (the connector's ``take_events`` is called by vLLM 0.32's ``Scheduler.update_from_output``, whose
    ``self`` holds ``kv_event_publisher``, directly or through ``MultiConnector.take_events``); None when
    none of them is such a method."""
    for _ in range(depth):
        if frame is None:
            return None
        pub = getattr(frame.f_locals.get("self"), "kv_event_publisher", None)
        if callable(getattr(pub, "publish", None)):
            return pub
        frame = frame.f_back
    return None


class IdlePublisher:
    """Publishes G3 KV events while the engine does not step (issue 26 B).

    vLLM publishes the connector's events only from its scheduler's step (``take_events``), so blocks whose
    offload completed after the last step reached Dynamo's router only when the engine ran again. The
    connector hands over vLLM's own publisher, found on the scheduler that calls ``take_events`` (vLLM 0.32:
    ``Scheduler.kv_event_publisher``; :meth:`capture`); a thread then publishes what is pending once the
    engine has not taken events for ``idle_s`` seconds. A step's take and this thread's take-and-publish
    hold one lock, so events leave in the order they were taken, except if vLLM's thread stalls longer than
    ``idle_s`` between its take and its publish (the router then sees a stored/removed pair swapped until
    the next change of that block: a routing preference, never KV). Blocks a reset re-publishes
    (:meth:`G3KvEvents.republish`) are left to the step's take, so they follow its ``AllBlocksCleared``.
    """

    def __init__(self, events: G3KvEvents, idle_s: float = 0.5, interval_s: float = 0.1):
        self.events, self.idle_s, self.interval_s = events, idle_s, interval_s
        self.lock = threading.Lock()
        self._publisher: Any = None  # vLLM's KV event publisher, once attached
        self._last_take = time.monotonic()
        self._stop = threading.Event()
        self._t: threading.Thread | None = None
        self.passes = 0  # passes of the idle thread (tests wait for them)

    def capture(self, publisher: Any) -> None:
        """Start publishing idle events through ``publisher`` (an object with ``publish(KVEventBatch)``)."""
        if self._publisher is not None or publisher is None or not callable(getattr(publisher, "publish", None)):
            return
        self._publisher = publisher
        self._t = start_thread(self._loop, name="kvbm-kv-events")

    def take(self) -> list:
        """The step's take (vLLM publishes the result right after)."""
        with self.lock:
            self._last_take = time.monotonic()
            return self.events.take()

    def _loop(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch
        while not self._stop.wait(self.interval_s):
            with self.lock:
                self.passes += 1
                if time.monotonic() - self._last_take < self.idle_s:
                    continue
                ev = self.events.take(idle=True)  # never a republish's before the step's take (republish)
                if not ev:
                    continue
                try:
                    self._publisher.publish(KVEventBatch(ts=time.time(), events=ev))
                    stats.add(kv_events_idle_batches=1)
                except Exception:  # noqa: BLE001 - the publisher is shutting down
                    return

    def stop(self) -> None:
        self._stop.set()
