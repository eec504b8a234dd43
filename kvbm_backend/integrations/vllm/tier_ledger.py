"""Per-request lookup counting of our vLLM secondary tiers: each request's answers recorded as they arrive, its
counts derived from them once (:class:`Ledger`).

The rule (docs/operations.md, ``kvbm_matched_tokens`` and the pools' lookup counters): each chunk a request looks
up counts once. vLLM's manager asks its secondary tiers in their configured order and loads a chunk from the first
that answers HIT *when it asks* (a tier still answering is passed over: RETRY there, the chunk promoted from the
next tier down that answered HIT), so the chunk is found on the tier a load of it for the request succeeded from,
the *owner* (where nothing was loaded for the request: the first tier in order that answered it HIT), when it lies
in the request's usable run: per KV group, in position order, the leading chunks some tier holds (what vLLM loads of
a full-attention group; the chunk after it no tier holds, and the rest are recomputed), and of a sliding-window
group the run vLLM loads, at its end (below). Each of our tiers the request asked about a chunk counts it requested
unless a tier above it owns it in that run: the first tier over every chunk asked, each below over those not served
above, the lowest a miss where none holds it. An answer given without asking the pool counts as that tier's miss:
cooling after a failed load (also ``lookup_cooling_chunks``, once per request, tier and chunk); a tenant the tier
refuses (revoked: :mod:`.tier_revoked`) counts nothing in its pool (only ``lookup_g3_revoked``, as the connector).

Sliding-window groups: vLLM 0.32 records every group's key positions (``update_offload_keys``) and scans a window
group from its end down (``_sliding_window_lookup``: RETRY or MISS restart the count, it stops at the first run of
``window`` chunks it meets, or at the group's first chunk) and loads that run. The window size is not handed to the
tiers, so a group whose chunks a request asks in descending position within one step is a window group, and its
usable run starts at the lowest chunk the request's latest lookup of the group asked of our tiers (where vLLM's scan
stopped) and goes up through the chunks some tier holds; the chunks below it, or above a chunk none holds, count not
found. A chunk of the run vLLM met in the primary tier is not asked of our tiers (not counted here): where the scan
stopped there, the run starts at the lowest chunk asked above it.

How: :class:`Ledger`, one per vLLM manager (shared by our tiers over one primary buffer, in the order the manager
asks them), records per live request and chunk the last answer each tier gave it: at its ``lookup`` (HIT, miss,
cooling, refused, or pending), and when a pending one arrives (the scheduler drains the worker's answers: every
request holding that verdict, posted or taken up from another request, gets it), and its loads (a HIT whose load
failed yields to a tier that then answers one). At the step's end (``flush``) or when a load ends, a request whose
answers changed (an answer asked again and unchanged is no change) is counted once they settled: every chunk of a
usable run owned (a load of it ended, or no pending answer before its first HIT and, where a tier below may serve it
too, or in a window group, a load ended; a HIT not loaded past the run needs no load), one ``count_lookup`` per tier
over the chunks not counted for the request yet, then those chunks are frozen (asked again later, after a cool-down
or a store, never counted again). A chunk loaded from a tier below one still answering is counted without waiting;
the answer of the tier above counts (requested) when it comes. At the request's end (its first tier's ``cleanup``,
after every tier's answers are drained in) the rest is counted, a pending answer left out (the tier never answered
it), a HIT never loaded owned as answered. Nothing is read from the tiers' live state: a cool-down ending or a
tenant revoked after an answer does not change what it counted. A vLLM tier that is not ours (vLLM's ``fs`` tier
between a G3Tier and a G4Tier) is not in the ledger: a chunk only it serves looks held by none of ours (the run of a
full-attention group ends there).

Before 2026-12-03 the counts were built up as requests asked (posted, taken up, waiting, counted-above records,
the usable-prefix memo): a HIT taken up already answered counted only when loaded (never, if not loaded), with
three of our tiers a HIT of the middle one counted found though the first served it, and the usable prefix was
judged from live cool-downs and revocations (an answer given cooling counted as served once the cool-down ended).
Until 2026-12-03 (review of the ledger) the owner was the first tier in order that eventually answered HIT, so a
chunk vLLM loaded from G4 while G3 was still answering (or after another request's failed load forced G3's HIT to a
miss) counted as G3's find and not G4's; a window group's chunks counted as a leading prefix (a window served after
an earlier miss: not found); and every lookup marked the request changed, so a deferred request asked again every
step was judged every step.
Scheduler thread only; bounded by the live requests.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

if TYPE_CHECKING:
    from .tier_base import KvbmSecondaryTier

__all__ = ["COOL", "HIT", "MISS", "REFUSED", "Ledger", "shared_ledger"]

MISS, HIT, COOL, REFUSED = False, True, "cool", "refused"  # a tier's answer; None: pending (not answered yet)
_UNDECIDED = object()
_ATTR = "_kvbm_native_ledgers"  # attribute of vLLM's offloading spec: primary buffer address -> its Ledger


class _Req:
    __slots__ = ("ctx", "ans", "done", "cooled", "loads", "late", "scan", "windows")

    def __init__(self, ctx: ReqContext) -> None:
        self.ctx = ctx
        self.ans: dict[OffloadKey, dict[int, Any]] = {}  # chunk -> {tier index: its last answer}
        self.done: dict[OffloadKey, int | None] = {}  # chunks counted -> their owner (tier index; None: none)
        self.cooled: set[tuple[int, OffloadKey]] = set()  # (tier, chunk) answered cooling (counted once)
        # chunk -> [its loads in flight, tiers whose load of it failed, tiers whose load of it succeeded]
        self.loads: dict[OffloadKey, list] = {}
        self.late: set[tuple[int, OffloadKey]] = set()  # (tier, chunk counted) whose pending answer counts when in
        # KV group (the key's last 4 bytes) -> [step, first position asked in it (None: direction seen), lowest]
        self.scan: dict[bytes, list] = {}
        self.windows: set[bytes] = set()  # groups the request's lookup scanned from the end (sliding windows)


def shared_ledger(tier: KvbmSecondaryTier, offloading_spec: Any) -> tuple[Ledger, int]:
    """The :class:`Ledger` of ``tier``'s manager (one per primary buffer on ``offloading_spec``; the tier's own when
    the spec takes no attribute) and ``tier``'s index in it (the order the manager asks our tiers)."""
    try:
        ledgers = offloading_spec.__dict__.setdefault(_ATTR, {})
    except AttributeError:
        ledgers = {}
    ledger = ledgers.setdefault(tier._primary.ctypes.data, Ledger())
    return ledger, ledger.join(tier)


class Ledger:
    """Every live request's answers from our tiers of one manager, and the counts derived from them."""

    def __init__(self) -> None:
        self._tiers: list[weakref.ReferenceType] = []
        self._reqs: dict[str, _Req] = {}
        self._dirty: set[str] = set()  # requests whose answers changed since they were last settled
        self._jobs: dict[tuple[int, Any], tuple[str, list[OffloadKey]]] = {}  # (tier, load job) -> request, chunks
        self._late: dict[int, int] = {}  # tier -> late answers (requested, not found) not passed to its pool yet
        self._step = 0  # steps ended (``settle`` calls): a request's lookups within one step are one scan

    def join(self, tier: KvbmSecondaryTier) -> int:
        """Add ``tier`` (asked after those joined before); its index."""
        self._tiers.append(weakref.ref(tier))
        return len(self._tiers) - 1

    def __len__(self) -> int:
        return len(self._reqs)

    def answer(self, t: int, key: OffloadKey, ctx: ReqContext, v: Any) -> bool:
        """Tier ``t`` answered the request's lookup of ``key`` with ``v`` (:data:`HIT`, :data:`MISS`, :data:`COOL`,
        :data:`REFUSED`; None: pending). Returns whether it is the request's first cooling answer of ``key`` from
        ``t`` (``lookup_cooling_chunks``). The request is judged again only when the answer changed."""
        r = self._reqs.get(ctx.req_id)
        if r is None:
            r = self._reqs[ctx.req_id] = _Req(ctx)
        first = v is COOL and (t, key) not in r.cooled
        if first:
            r.cooled.add((t, key))
        self._scanned(r, key)
        if key in r.done:
            if v is not None and (t, key) in r.late:
                self._came(r, t, key, v)
            return first
        a = r.ans.setdefault(key, {})
        old = a.get(t, _UNDECIDED)
        if old is not HIT and old is not v:  # a HIT answered stays the request's (its load may fail)
            a[t] = v
            self._dirty.add(ctx.req_id)
        return first

    def _scanned(self, r: _Req, key: OffloadKey) -> None:
        """The request's lookup asked ``key``: within one step, a group's first two chunks asked in descending
        position make it a window group (vLLM scans those from the end), and the lowest one asked is where its
        latest scan stopped."""
        pos = getattr(r.ctx, "get_offload_key_position", None)
        p = pos(key) if callable(pos) else None
        if p is None:
            return
        g = bytes(key[-4:])
        s = r.scan.get(g)
        if s is None or s[0] != self._step:
            r.scan[g] = [self._step, p, p]
            return
        if s[1] is not None and p != s[1]:
            (r.windows.add if p < s[1] else r.windows.discard)(g)
            s[1] = None
        s[2] = min(s[2], p)

    def _came(self, r: _Req, t: int, key: OffloadKey, v: Any) -> None:
        """Tier ``t``'s pending answer ``v`` of a chunk counted without it came: requested there (a tier above the
        one the chunk was loaded from), unless a refusal."""
        r.late.discard((t, key))
        if v is not REFUSED:
            self._late[t] = self._late.get(t, 0) + 1

    def loading(self, t: int, job_id: Any, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """Tier ``t`` loads ``keys`` for the request (job ``job_id``): their counts wait for the load's end."""
        r = self._reqs.get(req_id)
        if r is None:
            return  # ended (or never asked us): nothing to count
        keys = [k for k in keys if k in r.ans and k not in r.done]
        for k in keys:
            r.loads.setdefault(k, [0, set(), set()])[0] += 1
        if keys:
            self._jobs[(t, job_id)] = (req_id, keys)

    def loaded(self, t: int, job_id: Any, ok: Iterable[OffloadKey]) -> None:
        """Tier ``t``'s load job ``job_id`` ended with ``ok`` in the primary tier: each of those is ``t``'s (the
        request's owner of it: :func:`_owner`); a chunk whose load failed is another tier's to serve."""
        rid, keys = self._jobs.pop((t, job_id), ("", []))
        r = self._reqs.get(rid)
        if r is None:
            return
        good = set(ok)
        for k in keys:
            ld = r.loads.get(k)
            if ld is not None:
                ld[0] -= 1
                ld[2 if k in good else 1].add(t)
        self._dirty.discard(rid)
        self._count(r, final=False)  # now, before vLLM's scheduler sees the chunks in the primary tier

    def arrived(self, t: int, key: OffloadKey, request_ids: Iterable[str], v: bool) -> None:
        """Tier ``t``'s pending verdict of ``key`` came in as ``v`` for the requests ``request_ids`` holding it."""
        for rid in request_ids:
            r = self._reqs.get(rid)
            if r is None:
                continue
            if key in r.done:
                if (t, key) in r.late:
                    self._came(r, t, key, bool(v))
                continue
            a = r.ans.get(key)
            if a is not None and t in a and a[t] is None:
                a[t] = bool(v)
                self._dirty.add(rid)

    def settle(self) -> None:
        """Count the requests whose answers changed and are now settled (the step's end)."""
        self._step += 1
        dirty, self._dirty = self._dirty, set()
        for rid in dirty:
            r = self._reqs.get(rid)
            if r is not None:
                self._count(r, final=False)
        self._pass_late()

    def finish(self, req_id: str) -> None:
        """The request ended: count what is left (after draining every tier's answers in) and forget it."""
        if req_id not in self._reqs:
            return
        for ref in self._tiers:
            u = ref()
            if u is not None and not u._closed:
                u._lookup.drain_results()
        r = self._reqs.pop(req_id)
        self._dirty.discard(req_id)
        self._jobs = {j: e for j, e in self._jobs.items() if e[0] != req_id} if r.loads else self._jobs
        self._count(r, final=True)
        self._pass_late()

    def _pass_late(self) -> None:
        """Count the late answers that came (:meth:`_came`) in their pools."""
        late, self._late = self._late, {}
        for t, n in sorted(late.items()):
            u = self._tiers[t]()
            if u is not None and not u._closed:
                u.pool.count_lookup(n, 0)

    def _count(self, r: _Req, final: bool) -> None:
        """Count ``r``'s chunks not counted yet once each one's owner is known where it matters (``final``: a
        pending answer is left out, a HIT not loaded owned as answered); nothing while one is not (not ``final``)."""
        owners: dict[OffloadKey, int | None] = {}
        unsettled: set[OffloadKey] = set()  # owned by a HIT a tier below may yet take over: its load decides
        unloaded: set[OffloadKey] = set()  # owned by a HIT not loaded for the request (yet)
        filt = getattr(r.ctx, "load_tier_filter", None)
        asked = [t for t, ref in enumerate(self._tiers) if (u := ref()) is not None and not u._closed
                 and (filt is None or filt.allows(u.medium, u.locality))]  # the tiers the manager asks, in order
        for k, a in r.ans.items():
            if k not in r.done:
                o, settled = _owner(a, asked, r.loads.get(k), final)
                if o is _UNDECIDED:
                    return
                owners[k] = o
                if not settled:
                    unsettled.add(k)
                if o is not None and not final and not (k in r.loads and r.loads[k][2]):
                    unloaded.add(k)
        if not owners:
            return
        lows = {g: s[2] for g, s in r.scan.items() if g in r.windows}
        eff = _usable({**r.done, **owners}, r.ctx, unsettled, (unloaded, lows))
        if eff is None:
            return
        counts: dict[int, list[int]] = {}
        for k, o in owners.items():
            e = eff[k]
            for t, v in r.ans[k].items():
                if v is None and o is not None and t < o and not final:
                    r.late.add((t, k))  # still answering above the tier the chunk was loaded from
                elif v is not None and v is not REFUSED and (e is None or e >= t):
                    c = counts.setdefault(t, [0, 0])
                    c[0] += 1
                    c[1] += e == t
        r.done.update(owners)
        for t, (n, f) in sorted(counts.items()):
            u = self._tiers[t]()
            if u is not None and not u._closed:
                u.pool.count_lookup(n, f)


def _owner(a: dict[int, Any], asked: list[int], load: list | None, final: bool) -> tuple[Any, bool]:
    """The chunk's owner (tier index) and whether it is settled: the tier a load of it for the request succeeded
    from (``load``: ``[loads in flight, tiers whose load failed, tiers whose load succeeded]``), whatever the tiers
    before it answer later (vLLM passed a pending one over); else the first tier answering HIT in ``a`` whose load of
    it did not fail, not settled while a tier below it may still serve the chunk (answered HIT, or not yet: vLLM
    loads from below where that HIT is passed over or forced to a miss) until a load ends (``final``: settled), else
    the first of those that failed; None
    when none answered HIT. :data:`_UNDECIDED` (unless ``final``: a tier not answering is passed over) while a tier
    before it (``asked``: those the manager asks the request's chunks, in order) has not answered, a load of it is
    in flight, or a load failed and no other tier answered HIT (the request may ask again and be served by another)."""
    if load is not None and load[2]:
        return min(load[2]), True
    if load is not None and load[0] > 0 and not final:
        return _UNDECIDED, False
    failed = load[1] if load is not None else ()
    order = sorted({*a, *asked})
    for i, t in enumerate(order):
        v = a.get(t)
        if v is None:
            if not final:
                return _UNDECIDED, False
        elif v is HIT and t not in failed:  # settled unless a tier below may serve it (a HIT, or no answer yet)
            return t, final or all(a.get(u) is not None and (a[u] is not HIT or u in failed) for u in order[i + 1:])
    if failed and not final:
        return _UNDECIDED, False
    return min((t for t in failed if a.get(t) is HIT), default=None), True


def _usable(owners: dict[OffloadKey, int | None], ctx: ReqContext, unsettled: set[OffloadKey],
            windows: tuple[set[OffloadKey], dict[bytes, int]]) -> dict[OffloadKey, int | None] | None:
    """``owners`` with None outside the request's usable runs, per KV group (the key's last 4 bytes) in ascending
    position (``ReqContext.get_offload_key_position``): the chunks after one no tier holds, and of a window group
    (``windows[1]``: group -> the lowest position its latest scan asked) also those below that position (its run
    goes up from there). A chunk without a position is a run of its own. None while a chunk of ``unsettled`` is in a
    run, or a window group's chunk of ``windows[0]`` (answered HIT, not loaded for the request yet: vLLM's next scan
    of the group finds the window and loads it) is at or above its low."""
    unloaded, lows = windows
    pos = getattr(ctx, "get_offload_key_position", None)
    eff: dict[OffloadKey, int | None] = {}
    groups: dict[bytes, list[tuple[int, OffloadKey]]] = {}
    for k, o in owners.items():
        p = pos(k) if callable(pos) else None
        if p is None:
            if k in unsettled:
                return None
            eff[k] = o
        else:
            groups.setdefault(bytes(k[-4:]), []).append((p, k))
    for g, run in groups.items():
        low = lows.get(g)
        ok = True
        for p, k in sorted(run, key=lambda x: x[0]):
            if low is not None and p < low:
                eff[k] = None
                continue
            if (k in unsettled and ok) or (low is not None and k in unloaded):
                return None
            eff[k] = owners[k] if ok else None
            ok = ok and owners[k] is not None
    return eff
