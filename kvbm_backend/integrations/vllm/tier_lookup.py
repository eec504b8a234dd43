"""The native tiers' index lookups: vLLM's :class:`AsyncLookupManager` with one verdict per (chunk, tenant).

vLLM's manager (0.32, ``vllm/v1/kv_offload/tiering/async_lookup.py``) runs a tier's ``batch_lookup`` on a
background thread, once per scheduler step, and caches one verdict per key for as long as a live request refers
to it; ``mark_miss`` (after a failed load) forces the cached verdict to a miss. Our tiers key a chunk's blocks by
tenant as well (a request's ``kv_transfer_params["kvbm_tenant"]``: G4's key and prefix), so a verdict cached
by ``OffloadKey`` alone answered every tenant with the first asker's: a tenant holding the chunk missed it while
another tenant's request for it was alive, a hit cached for the holder sent another tenant's request into a load
that could only fail, and that failure forced the holder's verdict to a miss (found in review, 2026-11-29). Here
the manager's key is ``(OffloadKey, tenant)``: each tenant gets its own verdict, and a failed load marks only the
tenant that asked.

A cached miss outlived what it said (review, 2026-12-01): vLLM keeps a verdict while any live request refers to the
key, so a request that found G3 empty, offloaded the chunks and kept generating held its miss for its whole life;
G3 stored them, the tier published them stored (KV events: the router steers their prefix here), and every later
request with that prefix got the cached miss and recomputed (4 chunks: 0 served to 3 requests while the first
lived). A miss forced after a failed load outlived the tier's cool-down the same way. Now a store's published
chunks (:meth:`TenantLookup.stored`) and a failed load's chunks once their cool-down ends
(:meth:`TenantLookup.mark_miss_for`) are asked again: the next lookup of a cached miss among them by a request
not holding that verdict yet posts it to the pool again (RETRY for one step, then the index's answer); the
requests holding it keep it (the one whose load failed would otherwise load it again and again).

Bounds (docs/invariants.md #3): vLLM's worker runs a posted batch's requests one after another and posts their
verdicts after the last. Before 2026-12-01 each request's lookup had its own ``job_timeout_s``, so while the pool
did not answer (G3's lock held across a journal write on a stalled drive, G4's endpoint hanging) N requests
posted together waited N x ``job_timeout_s`` in RETRY (6 requests, 2 s: 12 s; 8 at the default 60 s: 8 minutes).
Now one deadline bounds a posted batch, from when ``flush`` posted it (:class:`.tier_queues.StampedQueue`), and
once a lookup timed out the tier answers misses without asking the pool until that lookup answered or
``job_timeout_s`` passed (a probe then asks again): N requests cost about one ``job_timeout_s``, and the pool is not
handed a lookup per request to pile up behind the stall. Counted ``lookups_timed_out`` and ``lookups_not_asked``
(``kvbm_stats()``).

Counting (``kvbm_matched_tokens``, the hit rates, the pools' lookup counters): every look here is uncounted; the
answers each request gets are recorded as they arrive and counted once per request and chunk, on the tier that
answered it, by the manager's :class:`.tier_ledger.Ledger` (shared by our tiers over one primary buffer): a request
posting a key, one taking up another request's verdict (vLLM posts a key once), pending or answered, one answered
cooling or refused, all alike; a chunk is found on the tier its load for the request came from. Before 2026-12-03
the lowest of our tiers counted the request for all in its ``batch_lookup`` and a web of per-request records
(:mod:`.tier_ledger` names the defects) covered the rest.
"""
from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager, LookupPhase

from ...deadlines import Deadline
from .tier_gaps import prefix_runs, skip_held
from .tier_ledger import COOL, REFUSED, shared_ledger
from .tier_queues import ResultsQueue, StampedQueue, Wrapped

if TYPE_CHECKING:
    from .tier_base import KvbmSecondaryTier

log = logging.getLogger(__name__)

__all__ = ["TenantLookup", "prefix_runs", "tiers_above"]

_REGISTRY = "_kvbm_native_tiers"  # attribute of vLLM's offloading spec: our tiers it made, in order


def tiers_above(tier: KvbmSecondaryTier, offloading_spec: Any) -> list[weakref.ReferenceType]:
    """Register ``tier`` on ``offloading_spec`` (the spec that builds one manager's tiers, in the configured order,
    each over the manager's primary buffer) and return (weak references to) our tiers made before it over the
    same primary buffer: the tiers vLLM's manager asks first. Empty when the spec takes no attribute."""
    addr = tier._primary.ctypes.data
    try:
        reg = offloading_spec.__dict__.setdefault(_REGISTRY, [])
    except AttributeError:
        return []
    above = [r for r, a in reg if a == addr and r() is not None]
    reg[:] = [(r, a) for r, a in reg if r() is not None] + [(weakref.ref(tier), addr)]
    return above


class TenantLookup(AsyncLookupManager):
    """vLLM's async lookup machinery over the tier's pool index, verdicts keyed by ``(OffloadKey, tenant)``."""

    def __init__(self, tier: KvbmSecondaryTier, tier_type: str, offloading_spec: Any = None) -> None:
        self._tier = tier
        self._above = tiers_above(tier, offloading_spec) if offloading_spec is not None else []
        self._reg: list = getattr(offloading_spec, "__dict__", {}).get(_REGISTRY, [])  # our tiers, in order
        # (key, tenant) whose cached miss may be stale (stored since, or its failed load's cool-down may end):
        # asked again at its next lookup. Scheduler thread; only keys with a live request's verdict, so bounded
        self._recheck: set[tuple[OffloadKey, str]] = set()
        self._orphans: set[Any] = set()  # (key, tenant) pairs of _recheck: their requests ended while in flight
        self._batch_end: Deadline | None = None  # the worker's batch's deadline (StampedQueue)
        self._stuck: tuple[Future, Deadline] | None = None  # a lookup that timed out, the end of its back-off
        # the first two written by the worker thread only, lookup_cooling_chunks by the scheduler thread only
        self._counts = {"lookups_timed_out": 0, "lookups_not_asked": 0, "lookup_cooling_chunks": 0}
        self._ledger, self._index = shared_ledger(tier, offloading_spec)  # each request's answers: its counts
        super().__init__(tier_type=tier_type)

    _lookup_queue = Wrapped(StampedQueue)  # vLLM's, each batch stamped with its deadline
    _pending_results = Wrapped(ResultsQueue)  # vLLM's: the answers it takes in go to the ledger

    def counts(self) -> dict[str, int]:
        """``lookups_timed_out``: requests' lookups the pool did not answer within their batch's deadline;
        ``lookups_not_asked``: those answered misses without asking the pool (the batch's deadline had passed, or
        a lookup had timed out and the pool had not answered it yet); ``lookup_cooling_chunks``: chunks a request
        asked about that the tier answered misses without asking the pool, their load having failed within the
        cool-down (:meth:`cooled`; once per request and chunk)."""
        return dict(self._counts)

    def _end(self) -> Deadline:
        """The deadline of a lookup: on vLLM's worker thread its batch's (stamped when posted), else (a direct
        call) ``job_timeout_s`` from now."""
        end = self._batch_end
        if end is None or threading.current_thread() is not getattr(self, "_thread", None):
            return Deadline(self._tier._job_timeout_s)
        return end

    def _may_ask(self, end: Deadline) -> bool:
        """Whether a lookup asks the pool: not once its batch's deadline passed, nor while a lookup that timed out
        has not been answered, at most ``job_timeout_s`` from its timeout (then one asks again: a probe)."""
        if end.expired():
            return False
        stuck = self._stuck
        if stuck is not None:
            if not stuck[0].done() and not stuck[1].expired():
                return False
            self._stuck = None
        return True

    def _wait(self, fut: Future, end: Deadline) -> int:
        """``fut``'s answer by ``end``; a timeout starts the pool's back-off (:meth:`_may_ask`) and raises."""
        try:
            return int(fut.result(timeout=end.left()))
        except TimeoutError:
            self._stuck = (fut, Deadline(self._tier._job_timeout_s))
            self._counts["lookups_timed_out"] += 1
            raise

    def above(self) -> list[KvbmSecondaryTier]:
        """Our tiers built before this one over the same primary buffer (:func:`tiers_above`), still alive."""
        return [u for u in (r() for r in self._above) if u is not None]

    @staticmethod
    def _asked(tiers: Iterable[KvbmSecondaryTier | None], req_context: ReqContext) -> list[KvbmSecondaryTier]:
        """Those of ``tiers`` the manager asks for the request (open, allowed by its load tier filter)."""
        filt = getattr(req_context, "load_tier_filter", None)
        return [t for t in tiers if t is not None and not t._closed
                and (filt is None or filt.allows(t.medium, t.locality))]

    def _asked_first(self, req_context: ReqContext) -> list[KvbmSecondaryTier]:
        """Our tiers the manager asks before this one for the request (open, allowed by its load tier filter)."""
        return self._asked((r() for r in self._above), req_context)

    def below(self) -> list[KvbmSecondaryTier | None]:
        """Our tiers built after this one over the same primary buffer (the manager asks them after it; None: gone)."""
        t = self._tier
        addr = t._primary.ctypes.data
        after: list[KvbmSecondaryTier | None] | None = None  # set once past this tier's entry
        for r, a in list(self._reg):
            u = r()
            if u is t:
                after = []
            elif after is not None and a == addr:
                after.append(u)
        return after or []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Scheduler thread: the cached verdict of ``key`` for the request's tenant (None: not answered yet). A
        cached miss :meth:`stored` or :meth:`mark_miss_for` named is asked again for a request not holding it yet
        (None until answered: :meth:`_ask_again`). The tier calls this only for a chunk not cooling after a failed
        load (:class:`.failed_blocks.FailedChunks`), so a forced miss is asked again once its cool-down ended, never
        during it. The answer is the request's in the ledger (counted: :mod:`.tier_ledger`)."""
        pair = cast(Any, (key, self._tier._tenant_of(req_context)))
        if self._recheck and pair in self._recheck:
            self._ask_again(pair, req_context)
        r = super().lookup(pair, req_context)
        self._ledger.answer(self._index, key, req_context, r)
        return r

    def cooled(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Scheduler thread: the tier answers ``key`` a miss without asking its pool, its load having failed within
        the cool-down (:class:`.failed_blocks.FailedChunks`): ``lookup_cooling_chunks`` once per request and chunk,
        and a miss of this tier in the ledger (:mod:`.tier_ledger`). Returns False (the miss)."""
        if self._ledger.answer(self._index, key, req_context, COOL):
            self._counts["lookup_cooling_chunks"] += 1
        return False

    def refused(self, key: OffloadKey, req_context: ReqContext) -> None:
        """Scheduler thread: the tier answered ``key`` a miss without asking its pool, refusing the request's tenant
        (:mod:`.tier_revoked`): counted in no pool (:mod:`.tier_ledger`)."""
        self._ledger.answer(self._index, key, req_context, REFUSED)

    def loading(self, job: Any) -> None:
        """Scheduler thread: vLLM submitted load job ``job`` (a ``TransferJob``) to this tier (:mod:`.tier_ledger`:
        its chunks are counted once it ended)."""
        if job.req_context is not None:
            self._ledger.loading(self._index, job.job_id, job.req_context.req_id, job.keys)

    def loaded(self, job_id: Any, keys: Iterable[OffloadKey]) -> None:
        """Scheduler thread: load job ``job_id`` ended with ``keys`` in the primary tier (the others failed)."""
        self._ledger.loaded(self._index, job_id, keys)

    def _verdict(self, pair: Any) -> bool | None:
        """Scheduler thread: the cached verdict of ``pair`` (None: none, or not answered yet)."""
        st = self._lookup_state.get(pair)
        return bool(st.result) if st is not None and st.phase is LookupPhase.RESOLVED else None

    def flush(self) -> None:
        """vLLM's (post this step's keys), then count the requests whose answers settled (:mod:`.tier_ledger`)."""
        super().flush()
        self._ledger.settle()

    def _ask_again(self, pair: Any, req_context: ReqContext) -> None:
        """Post ``pair`` again when its cached verdict is a miss and the asking request is not among those holding
        it, under a new generation (vLLM discards an answer of the old one). A request holding the verdict keeps
        it: the one whose load failed would load the same chunk again and fail the same way, forever (the livelock
        vLLM's ``mark_miss`` guards against, #49176). An answer still in flight may predate the store: asked again
        once it is in."""
        self.drain_results()
        st = self._lookup_state.get(pair)
        if st is not None and (st.phase is LookupPhase.IN_FLIGHT or req_context.req_id in st.request_ids):
            return
        self._recheck.discard(pair)
        if st is not None and st.phase is LookupPhase.RESOLVED and st.result is False:
            st.generation, self._next_generation = self._next_generation, self._next_generation + 1
            st.phase, st.result = LookupPhase.PENDING, None
            self._lookup_batch.append((pair, req_context, st.generation))

    def stored(self, keys: Collection[OffloadKey], tenant: str) -> None:
        """Scheduler thread: what this tier holds of ``tenant``'s chunks ``keys`` may have changed, so a live request's
        cached miss of one is asked again at its next lookup (:meth:`lookup`). Called when a store job of them reported
        finished (stored and published), when this tier's own load of them failed (:meth:`mark_miss_for`), and for a
        tier below one whose load of them failed (:func:`.tier_gaps.failed_load`: a miss judged "held above" may be
        one no longer). No I/O, never raises."""
        for k in keys:
            pair = cast(Any, (k, tenant))
            st = self._lookup_state.get(pair)
            if st is not None and st.request_ids and st.result is not True:
                self._recheck.add(pair)

    def mark_miss_for(self, keys: Collection[OffloadKey], tenant: str) -> None:
        """Force ``tenant``'s cached verdicts of ``keys`` to a miss (a failed load; other tenants keep theirs), asked
        again once the chunk's cool-down ended (:meth:`lookup`). A verdict not answered yet is left alone (vLLM's
        ``mark_miss`` on one breaks its own asserts when the answer comes); the cool-down covers it meanwhile."""
        states = [(p, st) for p in (cast(Any, (k, tenant)) for k in keys) if (st := self._lookup_state.get(p))]
        self.mark_miss([p for p, st in states if st.phase is LookupPhase.RESOLVED])
        self.stored(keys, tenant)

    def cleanup(self, req_id: str) -> None:
        """vLLM's, and forget the keys to ask again whose verdict left with the request. vLLM keeps a verdict
        still in flight when its last request ends (and drops it when its answer comes in): such a key is
        forgotten then (:meth:`drain_results`), or kept for a request that took the verdict up meanwhile. Before
        2026-12-02 it was kept for good (review: one key per store that finished while a lookup of its chunk was
        in flight for a request that ended before the answer)."""
        keys = list(self._req_keys.get(req_id, ())) if self._recheck else []
        self._ledger.finish(req_id)  # counted with every tier's answers in by now (the first tier's cleanup)
        self.drain_results()
        super().cleanup(req_id)
        for pair in keys:
            st = self._lookup_state.get(pair)
            if st is None:
                self._recheck.discard(pair)
            elif not st.request_ids and pair in self._recheck:
                self._orphans.add(pair)

    def drain_results(self) -> None:
        """vLLM's, then forget the keys to ask again whose in-flight verdict no request holds any more."""
        super().drain_results()
        if self._orphans:
            for pair in list(self._orphans):
                st = self._lookup_state.get(pair)
                if st is None or st.request_ids:
                    self._orphans.discard(pair)
                    if st is None:
                        self._recheck.discard(pair)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Background thread: ``keys`` are the ``(OffloadKey, tenant)`` pairs :meth:`lookup` posted for one request
        (vLLM's manager calls this once per request and step). A chunk is held when all its copies (one block per
        TP rank it spans) are. Every look is uncounted: the request's answers are counted once, by chunk, in the
        ledger (:mod:`.tier_ledger`), so a chunk counts once at any TP size. One ``job_timeout_s`` from
        when ``flush`` posted it bounds the step's whole batch (:meth:`_end`); a failed or late lookup is a miss, and
        while the pool has not answered one that timed out the request is answered misses without asking it
        (:meth:`_may_ask`).

        Prefix runs (:func:`.tier_gaps.prefix_runs`): the pairs of one tenant and KV group that vLLM posted in ascending
        position order (its full-attention prefix scan) are one ``lookup_prefix`` (G4: HEAD waves that stop at the
        first absent object), every pair after the run's first miss False: block hashes chain, so the request
        cannot use a chunk after a missing one. Before 2026-11-30 each chunk was its own lookup: vLLM posts every
        chunk of a prompt in its first step, so G4 sent one HEAD per chunk even when chunk 0 was absent (256 for
        256 chunks). Other pairs are looked up one by one: a sliding-window group's (vLLM records their positions
        too, ``update_offload_keys``, but scans the group from its end, ``_sliding_window_lookup``: descending, each
        pair a run of its own), and those without a position.

        Past a gap (G3, :attr:`KvbmSecondaryTier.look_past_gaps`: index lookups, no I/O) the chunks after the
        run's first missing one are looked up too (:meth:`_past_gap`): the request cannot use a chunk
        after one no tier holds, but vLLM's manager takes each chunk from the first tier holding it, so G3's chunks
        after one only G4 holds are G3 hits. Before 2026-11-30 they were misses and read from G4 instead (S3 for
        what is on local disk), or recomputed when the tier below lacked them too. G4 (HEADs) looks past a gap
        only below our tiers, where they hold it, from the next chunk they lack (:func:`.tier_gaps.skip_held`):
        before 2026-11-30 a G4 lacking chunk k answered k+1.. misses though G3 above served k, so the chunks
        after k that G3 lacked and G4 held were recomputed.


        A tenant the tier refuses (revoked in the keyring it follows: :mod:`.tier_revoked`) is answered misses without
        asking the pool, and holds nothing for the tiers below (:meth:`KvbmSecondaryTier._serves`)."""
        t = self._tier
        pairs = cast("list[tuple[OffloadKey, str]]", keys)
        c = t.geometry.copies
        above = self._asked_first(req_context) if self._above else []
        runs = prefix_runs(pairs, req_context)
        refused = {tn for tn in {tn for _, tn in pairs} if not t._serves(tn)}  # revoked: misses, the pool not asked
        if refused:
            runs = [run for run in runs if pairs[run[0]][1] not in refused]  # a run is one tenant's
        end = self._end()
        ask = self._may_ask(end)
        if runs and not ask:
            self._counts["lookups_not_asked"] += 1
        futs: list[tuple[Future, Future | None] | None] = []
        for run in runs:
            bks = [t._block_keys(pairs[i][0], pairs[i][1]) for i in run]
            rest = [bk for b in bks for bk in b[1:]]
            futs.append((t.pool.lookup_prefix([b[0] for b in bks], request=False),
                         t.pool.lookup_prefix(rest, request=False) if rest else None) if ask else None)
        out = [False] * len(pairs)
        for run, fs in zip(runs, futs):
            n0, n1 = 0, -1
            try:
                if fs is not None:
                    n0 = self._wait(fs[0], end)
                    n1 = self._wait(fs[1], end) if fs[1] is not None else 0
            except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
                log.debug("lookup failed: %s", e)
                n1 = -1
            if n1 >= 0:
                for j, i in enumerate(run):  # chunk j: its first copy among the n0, its others among the n1
                    out[i] = j < n0 and (j + 1) * (c - 1) <= n1
                held = sum(out[i] for i in run)  # the run's held prefix; the chunk after it is not held
                if (t.look_past_gaps or above) and held + 1 < len(run):
                    self._past_gap([pairs[i] for i in run[held:]], run[held:], out, end,
                                   None if t.look_past_gaps else (above, req_context))
        return out

    def _past_gap(self, pairs: list[tuple[OffloadKey, str]], idx: list[int], out: list[bool], end: Deadline,
                  filled_by: tuple[list[KvbmSecondaryTier], ReqContext] | None = None) -> None:
        """Set ``out[idx[j]]`` for the chunks ``pairs[1:]`` after a run's first chunk the tier lacks (``pairs[0]``):
        held when every copy is, each gap skipped. Another tier may hold the gap (vLLM's manager promotes each chunk
        from the first tier that answers HIT), so a chunk this tier holds after it is a hit. One uncounted prefix
        lookup per gap; a failed or late one leaves misses. ``filled_by`` (G4 below our tiers, whose lookups are
        HEADs): past a gap only where those tiers hold it, and from the next chunk they lack
        (:func:`.tier_gaps.skip_held`, index lookups; the chunks they hold stay misses here, vLLM loads them from
        above). So G4 HEADs only from a chunk the request can use and no tier above holds; past a chunk no tier
        holds, none."""
        t, c = self._tier, self._tier.geometry.copies
        g = 0  # pairs[g]: a chunk this tier lacks
        while True:
            s = g + 1 if filled_by is None else skip_held(filled_by[0], pairs, g, filled_by[1], end)
            if s == g or s >= len(pairs):
                return
            try:
                n = self._wait(t.pool.lookup_prefix([bk for k, tenant in pairs[s:] for bk in t._block_keys(k, tenant)],
                                                    request=False), end)
            except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
                log.debug("lookup past a gap failed: %s", e)
                return
            for j in range(s, s + n // c):
                out[idx[j]] = True
            g = s + n // c  # some copy of chunk g absent

