"""Prefix lookups of the scheduler-role connector: one :class:`PrefixLookup` per request over every KV cache
group (a dense model is the 1-group case), built from :class:`TierLookup` s (G3 then G4 over key lists: TP
ranks, and the groups' pools).

Lookups never block the scheduler: they run on the pools' threads and are polled once per step; past
their :class:`~kvbm_backend.deadlines.Deadline` what is not known counts as a miss. The keys of one
lookup are built once (:meth:`~kvbm_backend.model.namespace.Namespace.rank_runs`: one
:class:`~kvbm_backend.model.namespace.KeyRun` per TP rank over one array of sequence hashes, no per-key
object): G3 and G4 share them (G4 only the distinct
:meth:`~kvbm_backend.model.namespace.Namespace.shared_rank` ones).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...model.namespace import Namespace
from ...pool.base import BlockPool
from ...pool.g4.canonical import CanonicalG4
from ...pool.g4.pool import G4Pool
from ...deadlines import Deadline
from . import stats

if TYPE_CHECKING:
    from .scheduler_side import SchedulerSide, _Req

log = logging.getLogger("kvbm_backend.connector")


class TierLookup:
    """G3 prefix lookup, then G4 over the keys G3 lacks; resolves to ``(g3_blocks, g4_blocks)``: the
    shortest prefix over every key list (TP ranks, and KV cache groups).

    ``e3`` / ``e4``: ``(keys, pool)`` per key list (BlockKeys or a KeyRun; a None pool is skipped); all
    lists are one length.
    ``timeout_s``: seconds, or a :class:`Deadline` shared with the caller.
    ``count``: once the result is known, it counts as the request's lookup (:meth:`count_request`:
    ``kvbm_matched_tokens``, the hit rate, the pools' lookup counters), once whatever the TP size and over the
    prefix every key list holds (the pools are asked with ``request=False``; under ``external_launcher`` with TP > 1
    every rank's scheduler looks up: there TP rank 0 alone counts, the agreed hit, :meth:`.tp_sched.SchedAgree.match`).
    Before 2026-11-30 each tier's
    first key list (TP rank 0) counted its own pool lookup, so blocks rank 0 held beyond another rank's prefix
    counted as G3 hits, and again as G4 hits when G4 supplied them. False: nothing counts (a window probe, a
    request already counted, a hand-off wait's looks: :meth:`count_request` counts the one that ended it).
    ``known``: ``(g3, g4)`` leading blocks an earlier look of the same keys confirmed (blocks ``[0, g3)`` in G3,
    ``[g3, g3 + g4)`` in G4): they are not asked again. G3 is asked from block ``g3`` on (an index lookup),
    G4 only beyond both what is confirmed and what G3 now holds; the result counts them as found. With ``count``
    True, ``known`` must be ``(0, 0)`` (the pools count the keys they are asked).
    """

    def __init__(self, e3: list[tuple[Any, BlockPool | None]], e4: list[tuple[Any, BlockPool | None]],
                 timeout_s: float | Deadline, count: bool = True, known: tuple[int, int] = (0, 0)):
        self.deadline = timeout_s if isinstance(timeout_s, Deadline) else Deadline(timeout_s)
        self.count = count
        lens = [len(k) for k, _ in e3 + e4]
        self.n = n = lens[0] if lens else 0
        self.e3 = [(k, p) for k, p in e3 if p is not None]
        self.e4 = [(k, p) for k, p in e4 if p is not None]
        k3 = min(known[0], n) if self.e3 else 0
        self._k3, self._known = k3, min(k3 + known[1], n)  # G3's confirmed prefix; all confirmed
        self.p3: int | None = None
        self.p4: int | None = None
        if n == 0:
            self.p3, self.p4 = 0, 0
            self.count = False  # nothing asked, nothing counted
            return
        if not self.e3:
            self.p3 = 0
            self._start_g4()
        else:
            self._g3f = [p.lookup_prefix(k[k3:] if k3 else k, request=False) for k, p in self.e3]

    def _start_g4(self) -> None:
        assert self.p3 is not None  # G4 starts once G3's prefix is known
        self._g4_at = a = max(self.p3, self._known)  # [p3, known) confirmed in G4 by an earlier look
        if not self.e4 or a >= self.n:
            self.p4 = a - self.p3
            return
        self._g4f = [p.lookup_prefix(k[a:], request=False) for k, p in self.e4]

    def count_request(self, found: int | None = None) -> None:
        """Count the result (once known) as the request's lookup, as ``count`` True does when it resolves: one
        pool of each tier that was asked (the first key list's), over the blocks that tier is asked for (G3 all,
        G4 those G3 lacks), finding the prefix every key list holds (``p3`` / ``p4``). ``found``: the hit counts at
        most that many leading blocks (the hit the TP ranks agreed under ``external_launcher``, :mod:`.tp_sched`),
        G3's first."""
        assert self.p3 is not None and self.p4 is not None
        f = self.n if found is None else max(0, found)
        if self.e3:
            self.e3[0][1].count_lookup(self.n, min(self.p3, f))
        if self.e4 and self.p3 < self.n:
            self.e4[0][1].count_lookup(self.n - self.p3, min(self.p4, max(0, f - self.p3)))

    def g4_refused(self) -> bool:
        """True when G4 could supply blocks this lookup lacks but every G4 pool asked (each key list's) has its
        circuit breaker open (:mod:`kvbm_backend.pool.g4.breaker`): they answer every lookup 0 without asking the
        store until it reopens, so looking again changes nothing. False without G4 pools or when all are found."""
        if not self.e4 or self.p3 is None or self.p4 is None or self.p3 + self.p4 >= self.n:
            return False
        return all(breaker_open(p) for _, p in self.e4)

    @staticmethod
    def _min_done(futs: list[Future]) -> int | None:
        if not all(f.done() for f in futs):
            return None
        vals = []
        for f in futs:
            try:
                vals.append(int(f.result()))
            except Exception as e:  # noqa: BLE001 - a failed lookup is a miss
                log.warning("kvbm_backend: lookup failed: %s", e)
                stats.add(lookup_errors=1)
                vals.append(0)
        return min(vals) if vals else 0

    def poll(self) -> tuple[int, int] | None:
        """``(g3_blocks, g4_blocks)`` once known; None while still running (before the deadline)."""
        late = self.deadline.expired()
        if self.p3 is None:
            v = self._min_done(self._g3f)
            if v is None and not late:
                return None
            if v is None:
                stats.add(lookup_timeouts=1)
            self.p3 = min(self._k3 + (v or 0), self.n)
            self._start_g4()
        if self.p4 is None:
            v = self._min_done(self._g4f)
            if v is None and not late:
                return None
            if v is None:
                stats.add(lookup_timeouts=1)
            a = self._g4_at
            self.p4 = a - self.p3 + min(v or 0, self.n - a)
        if self.count:
            self.count = False  # counted once
            self.count_request()
        return self.p3, self.p4


def breaker_open(pool: BlockPool | None) -> bool:
    """Whether ``pool`` (a G4 pool, or the canonical view of one) refuses every request now: its circuit breaker is
    ``open`` (not ``half_open``: then the next request probes the store). False for any other pool."""
    while isinstance(pool, CanonicalG4):
        pool = pool.inner
    return isinstance(pool, G4Pool) and pool.breaker.state == "open"


@dataclass
class GroupTiers:
    """One vLLM KV cache group as the connector stores it.

    Attributes:
        ns: the group's namespace (:meth:`Namespace.for_group`).
        g3, g4: the group's pools (one pool per group), None when the tier is off.
        window_blocks: None for a full-attention (or MLA) group, whose blocks are needed for the whole
            prefix; for a sliding-window group the blocks needed before a resume point, speculative decoding's
            retained tokens included (:func:`.namespaces.group_window_blocks`): only those are saved (at the end
            of each step's computed range) and loaded (vLLM's ``SlidingWindowManager`` null-blocks the rest).
    """

    ns: Namespace
    g3: BlockPool | None
    g4: BlockPool | None
    window_blocks: int | None = None


class PrefixLookup:
    """Prefix lookup of one request over every KV cache group (``sched.groups``): the full-attention groups'
    prefix (G3 then G4, :class:`TierLookup`), then for every sliding-window group the window of blocks before
    the candidate resume point ``n``. A hit of ``n`` blocks counts only when every group has what the engine
    reads there; when a window lacks a block the candidate moves to that block (a window ending later would
    contain it), at most ``max_probes`` times. Resolves to ``(n, g3_full, windows)``: ``g3_full`` leading
    full-group blocks are in G3 (the rest of ``[0, n)`` in G4), ``windows[g] = (start, k3)``: group ``g``'s
    blocks ``[start, n)`` are loaded, the first ``k3`` from G3, the rest from G4. A dense model (one full
    group) resolves to ``(g3 + g4, g3, {})``. A hit not beyond the engine's own prefix cache (``n_local``)
    resolves to ``(n, g3_full, {})`` without windows, and to ``(0, 0, {})`` with them (their G3 share at
    ``n_local`` was not probed).

    Cool-down: no hit reaches a block of ``[n_local, n)`` whose load failed within the cool-down
    (``sched.failed_blocks``, :meth:`.failed_blocks.FailedBlocks.first_for`; a block that failed in a sliding-window
    group only where that group's window reads it): the candidate is cut before it and, with windows, they are probed
    at the cut point, as at any candidate. A result is checked again each time it is polled (a block may start
    cooling after it resolved): cut, its windows probed anew (within a lookup timeout and ``max_probes`` of their
    own). Before 2026-12-03 a hit with windows was never cut: every request of a hybrid model's prompt was offered
    the block whose load had just failed, loaded it in vain and recomputed it. A look that was cut counts
    ``lookup_failed_block_cuts`` once, when it counts as the request's (``count``, else :meth:`count_request`):
    a hand-off's wait counts the look that ended it only. :attr:`reach`: how far the hit could have gone but for
    the cool-down (the full-attention prefix found), which a hand-off's wait compares with its promise's first
    cooling block (a hybrid hit cut there may find less than that: its windows are probed at the cut).

    ``known``: the full-attention prefix an earlier look of this request confirmed (:attr:`confirmed`; a hand-off's
    wait looks again from there, :class:`TierLookup`). ``count`` False: the pools do not count this look as the
    request's (:meth:`count_request` can, later: a hand-off wait's look, and every look under ``external_launcher``
    with TP > 1, counted by TP rank 0 alone once the ranks agree the answer). A tenant G3 refuses (``sched.revoked``:
    revoked in G4's keyring) is looked up in G4 alone (counted ``lookup_g3_revoked``)."""

    max_probes = 8

    def __init__(self, sched: "SchedulerSide", st: "_Req", known: tuple[int, int] = (0, 0), count: bool = True):
        self.sched, self.st = sched, st
        self.deadline = Deadline(sched.lookup_timeout_s)
        n = st.lookup_blocks
        e3, e4 = [], []
        self.g3_off = sched.revoked is not None and sched.revoked.refused(st.tenant)
        if self.g3_off:
            stats.add(lookup_g3_revoked=1)
        for g in sched.groups:
            if g.window_blocks is None:
                by_rank, g4 = g.ns.rank_runs(st.hashes[:n], st.tenant)  # built once, shared by G3 and G4
                e3 += [(k, None if self.g3_off else g.g3) for k in by_rank]
                e4 += [(k, g.g4) for k in g4]
        self.windowed = any(g.window_blocks is not None for g in sched.groups)
        self.count = count and not st.counted
        self.full = TierLookup(e3, e4, self.deadline, count=self.count, known=known)
        self.p3: int | None = None
        self.reach: int | None = None  # the first candidate: the full-attention prefix found (None: not yet known)
        self.cut = False  # a cooling block cut a candidate of this look (counted once: _cut_at, count_request)
        self.cand: int | None = None
        self.probes = 0
        self.win: dict[int, TierLookup] = {}
        self.result: tuple[int, int, dict[int, tuple[int, int]]] | None = None

    @property
    def confirmed(self) -> tuple[int, int]:
        """``(g3, g4)``: the full-attention blocks this look found in G3 and then in G4 (``(0, 0)`` before it is
        known): the ``known`` of the request's next look."""
        f = self.full
        return (f.p3, f.p4) if f.p3 is not None and f.p4 is not None else (0, 0)

    def _start(self, n: int) -> None:
        self.cand = n
        self.probes += 1
        self.win = {}
        lo = self.st.n_local
        for gi, g in enumerate(self.sched.groups):
            if g.window_blocks is None:
                continue
            a = max(n - g.window_blocks, lo, 0)
            by_rank, g4 = g.ns.rank_runs(self.st.hashes[a:n], self.st.tenant)
            self.win[gi] = TierLookup([(k, None if self.g3_off else g.g3) for k in by_rank], [(k, g.g4) for k in g4],
                                      self.deadline, count=False)

    def count_request(self, found: int | None = None, pools: bool = True) -> None:
        """Count this look, once known, as the request's lookup (a hand-off wait's look that ended it, or any under
        ``external_launcher`` with TP > 1 once the ranks agreed: :meth:`.tp_sched.SchedAgree.match`): the pools'
        lookup counters (:meth:`TierLookup.count_request`, at most ``found`` blocks; none with ``pools`` False: a TP
        rank other than 0) and ``lookup_failed_block_cuts`` when it was cut."""
        if pools:
            self.full.count_request(found)
        if self.cut and not self.count:
            stats.add(lookup_failed_block_cuts=1)

    def _cooling(self, n: int) -> bool:
        """Whether a hit ending at ``n`` reads a block of ``[n_local, n)`` cooling after a failed load."""
        return self.sched.failed_blocks.first_for(self.st, n, self.sched.bs) < n

    def _begin(self, n: int) -> bool:
        """Probe candidate ``n`` cut before the cooling blocks it reads (the look's first cut counts
        ``lookup_failed_block_cuts`` when the look is counted); True when the result is known at once (no hit beyond
        ``n_local``: see the class doc)."""
        cut = self.sched.failed_blocks.first_for(self.st, n, self.sched.bs)
        if cut < n and not self.cut:
            self.cut = True
            if self.count:
                stats.add(lookup_failed_block_cuts=1)
        assert self.p3 is not None  # the full-attention prefix is known before any candidate
        if cut <= self.st.n_local:
            self.result = (0, 0, {}) if self.windowed else (cut, min(self.p3, cut), {})
            return True
        self._start(cut)
        return False

    def poll(self) -> tuple[int, int, dict[int, tuple[int, int]]] | None:
        """The result once known (see the class doc); None while still running (before the deadline)."""
        if self.result is not None:
            n = self.result[0]
            if not self._cooling(n):
                return self.result
            self.result = None  # a block cooled since it resolved: cut, its windows probed again at the cut,
            self.deadline = Deadline(self.sched.lookup_timeout_s)  # within a deadline and probes of their own
            self.probes = 0
            if self._begin(n):
                return self.result
        elif self.p3 is None:
            r = self.full.poll()
            if r is None:
                return None
            self.p3 = r[0]
            self.reach = r[0] + r[1] if self.full.n else self.st.lookup_blocks
            if self._begin(self.reach):
                return self.result
        while True:
            polled = {gi: lk.poll() for gi, lk in self.win.items()}
            if any(v is None for v in polled.values()):
                if not self.deadline.expired():
                    return None
                stats.add(lookup_timeouts=1)
                self.result = (0, 0, {})
                return self.result
            res = {gi: v for gi, v in polled.items() if v is not None}  # all of them (checked above)
            assert self.cand is not None and self.p3 is not None  # set by _start / before it
            n = self.cand
            bad = [self.win[gi].n - (v[0] + v[1]) for gi, v in res.items()]
            if not any(bad):
                if self._cooling(n):  # a block started cooling while the windows were probed
                    if self._begin(n):
                        return self.result
                    continue
                wins = {gi: (n - self.win[gi].n, v[0]) for gi, v in res.items()}
                self.result = (n, min(self.p3, n), wins)
                return self.result
            # the first missing block of a window: a hit must end at or before it
            nxt = min(n - self.win[gi].n + v[0] + v[1] for gi, v in res.items() if self.win[gi].n != v[0] + v[1])
            if nxt <= self.st.n_local or self.probes >= self.max_probes:
                stats.add(lookup_window_misses=1)
                self.result = (0, 0, {})
                return self.result
            if self._begin(nxt):
                return self.result
