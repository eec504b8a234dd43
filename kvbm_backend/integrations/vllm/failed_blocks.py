"""Blocks whose load failed, kept out of lookups for a cool-down: the connector's scheduler (:mod:`.scheduler_side`,
per ``(tenant, sequence hash)``) and the native tiers (:class:`FailedChunks`, per ``(tenant, chunk)``) share the rule
and its constants. Also the scheduler's containment of a failed synchronous (layer-wise) load: its unloaded engine
blocks, and the requests that took them as their prefix hit (:func:`contain_failed_sync_load`)."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from . import stats
from .identity import block_digests

log = logging.getLogger(__name__)

__all__ = ["FAILED_BLOCK_COOLDOWN_S", "FAILED_BLOCKS_MAX", "FAILED_DIGESTS_MAX", "FailedBlocks", "FailedChunks", "contain_failed_sync_load",
           "Unrecomputed", "drop_blocks", "request_digest_of", "unloaded_engine_blocks", "withhold_tainted"]

#: seconds a block whose load failed (absent, unreadable or corrupt in the tier that was to serve it) ends
#: every prefix offered to any request: the failed request itself is never offered a load again (vLLM
#: reschedules it and asks again: the same hit would fail the same way, forever); others recompute from
#: that block until it was re-verified by a later lookup after the cool-down (a dropped slot is then simply
#: absent; a recomputed block offloaded again is a hit again)
FAILED_BLOCK_COOLDOWN_S = 30.0
FAILED_BLOCKS_MAX = 1 << 16  # (tenant, sequence hash) entries kept, oldest dropped first


#: token digests remembered per cooling ``(tenant, sequence hash)`` (oldest forgotten first): a forger cycling
#: digests only un-cools its own oldest prompts, never widens the entry to every request of the tenant
FAILED_DIGESTS_MAX = 64


class FailedBlocks:
    """``(tenant, sequence hash)`` of blocks whose load failed, each for ``cooldown_s`` seconds, at most
    ``max_entries`` (oldest forgotten first). Scheduler thread only.

    An entry added with the failed request's token digest of that block (:meth:`add` ``digest``) cools only
    requests whose own digest for the block is one of those (:meth:`first_in` ``digest_of``): the sequence hash is
    forgeable (docs/format.md "Token digest"), and before 2026-12-01 a tenant-mate's forged prompt, failing on the
    victim's stored block, cooled that block for every request of the tenant. An entry added without one (the
    job named no digests, or the request is gone) cools every request, as before.

    An entry added with the KV cache group whose load failed (:meth:`add` ``group``) cools, for a sliding-window
    group (``windows[group]`` not None: the blocks before a resume point that group loads), only hits whose window
    of that group contains the block: before 2026-12-03 a failed block of a window cut every later hit at it, though
    a longer prompt's window never reads it, and such prompts recomputed everything for the cool-down. A failure of a
    full-attention group, of a group ``windows`` does not name, or without a group cuts every hit at the block.

    ``windows``: per KV cache group index, its window in blocks (None: full attention); None: every failure cuts
    every hit at its block (one full-attention group)."""

    def __init__(self, cooldown_s: float = FAILED_BLOCK_COOLDOWN_S, max_entries: int = FAILED_BLOCKS_MAX,
                 windows: list[int | None] | None = None):
        self.cooldown_s, self.max_entries = cooldown_s, max_entries
        self.windows = list(windows) if windows is not None else None
        self._until: OrderedDict[tuple[str, int], float] = OrderedDict()
        # (tenant, seq hash) -> the failed requests' digests (insertion-ordered); absent: every request cools
        self._digests: dict[tuple[str, int], dict[bytes, None]] = {}
        # (tenant, seq hash) -> the KV cache groups whose load of it failed; absent: unknown (every group's hit cut)
        self._groups: dict[tuple[str, int], set[int]] = {}

    def __len__(self) -> int:
        return len(self._until)

    def add(self, tenant: str, seq_hash: int, digest: bytes | None = None, group: int | None = None) -> bool:
        """``tenant``'s load of the block ``seq_hash`` failed now; ``digest``: the failed request's token digest
        of that block (16 bytes), None: unknown (every request of the tenant cools on it); ``group``: the KV cache
        group whose load failed (see the class doc), None: unknown (every hit at the block is cut; an entry once
        without a group stays so). Returns True when the block starts a cool-down (it was not cooling), False when it
        was cooling already (another TP rank's report of the same load, another failed load of it within the
        cool-down, in any group): its cool-down is renewed."""
        k = (tenant, int(seq_hash))
        now = time.monotonic()
        until = self._until.pop(k, None)
        held = until is not None and until > now  # an expired entry left until the next lookup is not cooling
        if until is not None and not held:
            self._digests.pop(k, None)
            self._groups.pop(k, None)
        self._until[k] = now + self.cooldown_s
        gs = self._groups.pop(k, None)
        if group is not None and (gs is not None or not held):  # a group-less entry stays group-less
            self._groups[k] = (gs or set()) | {int(group)}
        ds = self._digests.pop(k, None)
        if digest is not None and (ds is not None or not held):  # a digest-less entry stays digest-less
            ds = {} if ds is None else ds
            ds.pop(digest, None)
            ds[digest] = None
            while len(ds) > FAILED_DIGESTS_MAX:
                del ds[next(iter(ds))]
            self._digests[k] = ds
        while len(self._until) > self.max_entries:
            old, _ = self._until.popitem(last=False)
            self._digests.pop(old, None)
            self._groups.pop(old, None)
        return not held

    def first_in(self, tenant: str, hashes, start: int, end: int,
                 digest_of: Callable[[int], bytes | None] | None = None) -> int:
        """End (a block index in ``[start, end]``) of the longest hit ending at most at ``end`` that reads no block
        of ``hashes[start:end]`` that failed within the cool-down for this request: the index of the first such
        block, else ``end``; with :attr:`windows`, a block that failed only in sliding-window groups cuts only hits
        whose window of one of those groups contains it (the class doc). ``digest_of(i)``: the asking request's
        token digest of block ``i`` (asked only for blocks whose entry names digests, computed lazily); None, or a
        None answer: the block cools whatever the digests."""
        if not self._until or start >= end:
            return end
        now = time.monotonic()
        while self._until:  # expired entries leave in insertion (= expiry) order
            k, t = next(iter(self._until.items()))
            if t > now:
                break
            del self._until[k]
            self._digests.pop(k, None)
            self._groups.pop(k, None)
        cooling: list[tuple[int, int | None]] = []  # (block index, the smallest window reading it; None: any hit)
        for i in range(start, end):
            k = (tenant, int(hashes[i]))
            if k in self._until:
                ds = self._digests.get(k)
                d = None if ds is None or digest_of is None else digest_of(i)
                if d is None or d in ds:  # type: ignore[operator]
                    w = self._window(k)
                    if w is None:
                        return self._cut(cooling, i)
                    cooling.append((i, w))
        return self._cut(cooling, end)

    def _window(self, k: tuple[str, int]) -> int | None:
        """The window (blocks) of the groups whose load of ``k`` failed, when all of them are sliding-window groups
        (the largest: a hit reads the block when any of them does); None: every hit at the block reads it."""
        gs, ws = self._groups.get(k), self.windows
        if gs is None or ws is None or any(g >= len(ws) or ws[g] is None for g in gs):
            return None
        return max(ws[g] or 0 for g in gs)

    @staticmethod
    def _cut(cooling: list[tuple[int, int | None]], end: int) -> int:
        """The longest hit ending at most at ``end`` whose windows read none of ``cooling`` (block ``i`` with window
        ``w`` is read by a hit ending at ``m`` when ``m - w <= i < m``). A hit ending before ``m`` past a block read
        at ``m`` ends before that block too (its window ends before ``m``, so before ``i + w``), so the cut moves
        down to the first block read until none is."""
        m = end
        while True:
            read = [i for i, w in cooling if i < m and (w is None or i >= m - w)]
            if not read:
                return m
            m = min(read)

    def add_failed_load(self, tenant: str, st: Any, first_failed: int, block_size: int,
                        digest: bytes | None = None, group: int | None = None) -> bool:
        """:meth:`add` for a load of KV cache group ``group`` (None: unknown) of ``tenant`` that failed at block
        ``first_failed`` (a sequence hash), with the failed request's digest of that block where it can be computed
        (:func:`request_digest_of`) from its scheduler state ``st`` (``_Req``: ``tenant``, ``hashes``, ``request``,
        ``digests``; None: the request is gone), else ``digest`` (the worker's report's, :class:`~.metadata.
        FailedLoad`); neither: the block cools for every request of the tenant. Returns :meth:`add`'s answer (True:
        the block starts a cool-down)."""
        i = None
        if st is not None and st.tenant == tenant:
            try:
                i = list(st.hashes).index(int(first_failed))
            except ValueError:
                pass
        d = None if i is None else request_digest_of(st, block_size)(i)
        return self.add(tenant, first_failed, d if d is not None else digest, group)

    def first_for(self, st: Any, end: int, block_size: int) -> int:
        """:meth:`first_in` of request state ``st`` (``_Req``) from its local blocks (``n_local``) to ``end``,
        with its own token digests (:func:`request_digest_of`): the end of its longest hit up to ``end`` that
        reads no cooling block."""
        if not self._until:
            return end
        return self.first_in(st.tenant, st.hashes, st.n_local, end, request_digest_of(st, block_size))


def request_digest_of(st: Any, block_size: int) -> Callable[[int], bytes | None]:
    """``i -> `` the token digest of block ``i`` of the scheduler's request state ``st``
    (:func:`.identity.block_digests`: computed once per request as far as asked, cached in ``st.digests``); None
    when it cannot be (a block not full in the request's tokens, a request without token ids)."""
    def of(i: int) -> bytes | None:
        try:
            return block_digests(st, [i], block_size)
        except (ValueError, TypeError, AttributeError):
            return None
    return of


class FailedChunks:
    """The native tiers' (:mod:`.tiering`) chunks whose load failed, per ``(tenant, chunk key)``, for ``cooldown_s``
    seconds (the connector's :data:`FAILED_BLOCK_COOLDOWN_S`), at most ``max_entries`` (oldest forgotten first).
    Meanwhile the tier answers the chunk's lookups with a miss and does not report a store of it as held: a chunk
    G3 could not read but not prove bad (a read error, a timeout) stays in its index, and before 2026-11-30 every
    new request was offered it, loaded it in vain and recomputed it, and the recomputed chunk's store (skipped:
    held already) was reported stored again. A load whose ``job_timeout_s`` passed while it was queued behind other
    loads (the pool not asked: :class:`.tier_jobs.NotAsked`) adds none: load, not a verdict on its chunks (before
    2026-12-02 they cooled, and a busy tier made every new request recompute chunks G3 held). Thread-safe (scheduler
    thread and the tier's I/O threads)."""

    def __init__(self, key_hash: Callable[[Any], int], cooldown_s: float = FAILED_BLOCK_COOLDOWN_S,
                 max_entries: int = FAILED_BLOCKS_MAX):
        self._hash = key_hash
        self._blocks = FailedBlocks(cooldown_s, max_entries)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, tenant: str, keys: list[Any]) -> None:
        """``tenant``'s loads of ``keys`` failed now."""
        with self._lock:
            for k in keys:
                self._blocks.add(tenant, self._hash(k))

    def cooling(self, tenant: str, key: Any) -> bool:
        """Whether ``tenant``'s load of ``key`` failed within the cool-down."""
        if not len(self._blocks):
            return False
        with self._lock:
            return self._blocks.first_in(tenant, [self._hash(key)], 0, 1) == 0

    def not_cooling(self, tenant: str, keys: list[Any]) -> list[Any]:
        """``keys`` less those :meth:`cooling` for ``tenant``."""
        return [k for k in keys if not self.cooling(tenant, k)] if len(self._blocks) else keys


def drop_blocks(pool: Any, keys: list[Any], deadline: Any, tier_type: str, count: Callable[[int], None]) -> None:
    """Delete ``keys`` (the blocks of chunks a tier failed to read, not by a timeout) from ``pool`` (a G3 pool:
    ``G3Pool.drop_unreadable``), so the recomputed chunks' stores write them again instead of skipping them as
    held; ``count(n)`` with how many it deleted once the deletion is done. A block whose slot re-reads and verifies
    stays: the failed read was transient (before 2026-11-30 it was deleted too: good blocks lost to one bad read);
    so does one a re-read cannot read either until it stayed unreadable (docs/invariants.md #1). Waits for the
    deletion until ``deadline`` (the caller's bound: a recompute's store then comes after it); one still running
    then (a stalled journal, or a load whose deadline had passed) is counted and logged when it ends, on the pool's
    thread (before 2026-12-04 it was logged ``could not delete`` and counted 0 while the pool went on deleting).
    Never raises (logged): a block left in place only stays cooling (:class:`FailedChunks`)."""
    def done(fut: Any) -> None:
        try:
            n = int(fut.result())
        except Exception as e:  # noqa: BLE001 - the failed load is reported either way
            log.warning("%s: could not delete %d unreadable blocks: %s", tier_type, len(keys), e)
            return
        if n:
            log.warning("%s: deleted %d blocks that failed to load (read error); a later store writes them again",
                        tier_type, n)
        count(n)
    try:
        fut = pool.drop_unreadable(keys)
    except Exception as e:  # noqa: BLE001
        log.warning("%s: could not delete %d unreadable blocks: %s", tier_type, len(keys), e)
        return
    try:
        fut.result(timeout=deadline.left())
    except Exception:  # noqa: BLE001 - still deleting (not a failure: counted when it ends) or failed (done logs it)
        pass
    fut.add_done_callback(done)  # here when it ended; else on the pool's thread when it does


def unloaded_engine_blocks(hashes: Any, block_ids: list[int], start: int, first_failed: int) -> list[int]:
    """Engine block ids of a request whose synchronous (layer-wise) load failed, from its first failed block on
    (``first_failed``: that block's sequence hash, searched from block ``start``, the load's first; not found:
    every block from ``start``). vLLM caches a synchronous load's blocks when it schedules it, and with
    ``kv_load_failure_policy`` ``recompute`` it leaves the failed blocks, and those computed after them in that
    step, in its prefix cache for the request to recompute; until it does (never, when it is aborted or
    preempted) another request hits them and computes from, and the connector saves, KV that was never loaded.
    The scheduler removes these blocks from vLLM's prefix cache (``BlockPool.evict_blocks``, what vLLM does
    itself under the ``fail`` policy): the next request recomputes them. Never raises."""
    try:
        p = list(hashes).index(int(first_failed), max(0, start))
    except ValueError:
        p = max(0, start)
    return [b for b in block_ids[p:] if b]  # block 0 is vLLM's null block


def contain_failed_sync_load(reqs: dict[str, Any], failed: Any, first_failed: int, evict: Any,
                             debts: "Unrecomputed | None" = None) -> list[str]:
    """A synchronous (layer-wise) load of request ``failed`` (the scheduler's ``_Req``) failed from the block whose
    sequence hash is ``first_failed`` on. Its unloaded engine blocks (:func:`unloaded_engine_blocks`) leave vLLM's
    prefix cache (``evict``: ``BlockPool.evict_blocks``, None when not bound). Every other request of ``reqs``
    whose engine blocks include one of them took it as its prefix hit in the same step (vLLM cached it when it
    scheduled the load) and stays on it (``recompute`` leaves it for the failed request to recompute: never,
    when that one is aborted or preempted first): such a request is tainted from its first such block on
    (``save_limit``): none of its blocks from there on is saved (:func:`withhold_tainted`), and those vLLM cached
    leave its prefix cache too. The blocks they share are recorded in ``debts`` (:class:`Unrecomputed`), until
    one of their holders recomputed them. Returns the tainted request ids (counted ``layerwise_tainted_requests``).
    Never raises."""
    bad = set(unloaded_engine_blocks(failed.hashes, failed.group_block_ids[0], failed.n_local, first_failed))
    if evict is not None:
        evict(sorted(bad))
    tainted = []
    shared: dict[int, dict[str, int]] = {}  # unloaded block -> {holder: the block's index in its blocks}
    for rid, st in reqs.items():
        ids = st.group_block_ids[0] if st is not failed and st.group_block_ids else []
        i = next((i for i, b in enumerate(ids) if b in bad), None)
        for j in range(len(ids)) if i is not None else ():
            if ids[j] in bad:
                shared.setdefault(ids[j], {})[rid] = j
        if i is not None and i < st.save_limit:
            st.save_limit = i
            tainted.append(rid)
            if evict is not None:
                evict([b for b in ids[i:] if b])
    if debts is not None:
        fids = failed.group_block_ids[0]
        for b, hs in shared.items():
            debts.add(b, {**hs, **({failed.req_id: fids.index(b)} if b in fids else {})})
    if tainted:
        log.warning("layer-wise load of request %s failed: requests %s computed on its unloaded blocks; their "
                    "blocks from there on are never saved", failed.req_id, tainted)
        stats.add(layerwise_tainted_requests=len(tainted))
    return tainted


def withhold_tainted(st: Any, a: int, end: int, evict: Any) -> int:
    """End of the blocks of request ``st`` (the scheduler's ``_Req``) in ``[a, end)`` that may be saved: those
    from its ``save_limit`` on (computed on KV a failed synchronous load never filled:
    :func:`contain_failed_sync_load`) are not, are counted ``layerwise_save_withheld_blocks`` and leave vLLM's
    prefix cache (``evict``, None when not bound; vLLM caches a block as the step that computes it is scheduled)."""
    cut = max(a, min(end, st.save_limit))
    if cut < end:
        stats.add(layerwise_save_withheld_blocks=end - cut)
        ids = st.group_block_ids[0] if st.group_block_ids else []
        if evict is not None:
            evict([b for b in ids[cut:end] if b])
    return cut


class Unrecomputed:
    """Engine blocks a failed synchronous (layer-wise) load left unloaded and other requests share
    (:func:`contain_failed_sync_load`), until some holder recomputed them. Scheduler thread only.

    vLLM (``recompute`` policy) rolls the failed request back to its first failed block and leaves every other
    request on a shared failed block counted as computed, for the failed request to recompute it. When that one is
    aborted or preempted first (or recomputes it only in part), nobody does: before 2026-12-01 the others computed
    and decoded on the block's stale bytes (docs/invariants.md #1). :meth:`step`, at every schedule, returns the
    blocks some holder reads in that step (scheduled from past the block's recomputed part) while no holder's step
    recomputes them: the worker reports them again (``KvbmConnectorMetadata.reinvalidate``,
    ``get_block_ids_with_load_errors``), and vLLM rolls those readers back (the first to the block, to recompute
    it; the step of each is discarded). A report reaches only requests holding the block as computed: at worst a
    needless recompute, never wrong KV."""

    def __init__(self) -> None:
        # engine block id -> ({holder request id: the block's index in its blocks}, tokens of it recomputed)
        self._debts: dict[int, tuple[dict[str, int], int]] = {}

    def __len__(self) -> int:
        return len(self._debts)

    def add(self, block: int, holders: dict[str, int]) -> None:
        """Engine block ``block`` was not loaded; ``holders``: request id -> the block's index in its block ids
        (the failed request's and those of the requests that took it as their prefix hit)."""
        old = self._debts.get(int(block), ({}, 0))[0]
        self._debts[int(block)] = ({**old, **holders}, 0)

    def step(self, scheduler_output: Any, reqs: dict[str, Any], block_size: int) -> list[int]:
        """The blocks to report again in this step (see the class), from the step's ``SchedulerOutput``: each
        scheduled request's range ``[num_computed_tokens, + num_scheduled_tokens)``; a request scheduled new or
        resumed (new block ids) and one gone from ``reqs`` no longer holds any. A block fully recomputed is
        forgotten. Never raises."""
        if not self._debts:
            return []
        sched = scheduler_output.num_scheduled_tokens
        ranges = {nr.req_id: nr.num_computed_tokens for nr in scheduler_output.scheduled_new_reqs}
        fresh = set(ranges) | set(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        c = scheduler_output.scheduled_cached_reqs
        ranges.update((rid, c.num_computed_tokens[i]) for i, rid in enumerate(c.req_ids))
        for hs, _ in self._debts.values():
            for rid in [r for r in hs if r in fresh or r not in reqs]:
                del hs[rid]
        # a holder reading a block's unrecomputed part computes wrong KV: what it writes recomputes nothing
        stale = {rid for hs, done in self._debts.values() for rid, i in hs.items()
                 if ranges.get(rid, -1) > i * block_size + done}
        out = []
        for b, (hs, done) in list(self._debts.items()):
            for rid, i in hs.items():  # recomputes first: a step's reads see its own writes (vLLM's premise)
                a = ranges.get(rid)
                if a is not None and rid not in stale and a <= i * block_size + done:
                    done = max(done, min(block_size, a + sched.get(rid, 0) - i * block_size))
            if not hs or done >= block_size:
                del self._debts[b]
                continue
            self._debts[b] = (hs, done)
            if any(ranges.get(rid, -1) > i * block_size + done for rid, i in hs.items()):
                out.append(b)
        if out:
            log.warning("blocks %s a failed layer-wise load left unloaded are read before they were recomputed: "
                        "reported again (their readers recompute them)", out)
            stats.add(layerwise_reinvalidated_blocks=len(out))
        return out
