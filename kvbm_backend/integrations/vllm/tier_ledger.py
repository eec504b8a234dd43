"""Per-request lookup counting of our vLLM secondary tiers: each request's answers recorded as they arrive, its
counts derived from them once (:class:`Ledger`).

The rule (docs/operations.md, ``kvbm_matched_tokens`` and the pools' lookup counters): each chunk a request looks
up counts once. vLLM's manager asks its secondary tiers in their configured order and loads a chunk from the first
that answers HIT, so the chunk is found on that tier, the *owner*, when it lies in the request's usable prefix (the
leading chunks, per KV group in position order, that some tier holds: what vLLM loads; the chunk after it no tier
holds, and the rest are recomputed). Each of our tiers the request asked about a chunk counts it requested unless a
tier above it owns it in that prefix: the first tier over every chunk asked, each below over those not served
above, the lowest a miss where none holds it. An answer given without asking the pool counts as that tier's miss:
cooling after a failed load (also ``lookup_cooling_chunks``, once per request, tier and chunk); a tenant the tier
refuses (revoked: :mod:`.tier_revoked`) counts nothing in its pool (only ``lookup_g3_revoked``, as the connector).

How: :class:`Ledger`, one per vLLM manager (shared by our tiers over one primary buffer, in the order the manager
asks them), records per live request and chunk the last answer each tier gave it: at its ``lookup`` (HIT, miss,
cooling, refused, or pending), and when a pending one arrives (the scheduler drains the worker's answers: every
request holding that verdict, posted or taken up from another request, gets it), and its loads (a HIT whose load
failed yields to a tier that then answers one). At the step's end (``flush``) or when a load ends, a request whose
answers changed is counted once they settled: every chunk's owner known (no pending answer nor load before its first
HIT), one ``count_lookup`` per tier over the chunks not counted for the request yet, then those chunks are frozen
(asked again later, after a cool-down or a store, never counted again). At the request's end
(its first tier's ``cleanup``, after every tier's answers are drained in) the rest is counted, a pending answer
left out (the tier never answered it). Nothing is read from the tiers' live state: a cool-down ending or a tenant
revoked after an answer does not change what it counted.

Before 2026-12-03 the counts were built up as requests asked (posted, taken up, waiting, counted-above records,
the usable-prefix memo): a HIT taken up already answered counted only when loaded (never, if not loaded), with
three of our tiers a HIT of the middle one counted found though the first served it, and the usable prefix was
judged from live cool-downs and revocations (an answer given cooling counted as served once the cool-down ended).
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
    __slots__ = ("ctx", "ans", "done", "cooled", "loads")

    def __init__(self, ctx: ReqContext) -> None:
        self.ctx = ctx
        self.ans: dict[OffloadKey, dict[int, Any]] = {}  # chunk -> {tier index: its last answer}
        self.done: dict[OffloadKey, int | None] = {}  # chunks counted -> their owner (tier index; None: none)
        self.cooled: set[tuple[int, OffloadKey]] = set()  # (tier, chunk) answered cooling (counted once)
        self.loads: dict[OffloadKey, list] = {}  # chunk -> [its loads in flight, tiers whose load of it failed]


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

    def join(self, tier: KvbmSecondaryTier) -> int:
        """Add ``tier`` (asked after those joined before); its index."""
        self._tiers.append(weakref.ref(tier))
        return len(self._tiers) - 1

    def __len__(self) -> int:
        return len(self._reqs)

    def answer(self, t: int, key: OffloadKey, ctx: ReqContext, v: Any) -> bool:
        """Tier ``t`` answered the request's lookup of ``key`` with ``v`` (:data:`HIT`, :data:`MISS`, :data:`COOL`,
        :data:`REFUSED`; None: pending). Returns whether it is the request's first cooling answer of ``key`` from
        ``t`` (``lookup_cooling_chunks``)."""
        r = self._reqs.get(ctx.req_id)
        if r is None:
            r = self._reqs[ctx.req_id] = _Req(ctx)
        first = v is COOL and (t, key) not in r.cooled
        if first:
            r.cooled.add((t, key))
        a = r.ans.setdefault(key, {}) if key not in r.done else None
        if a is not None and a.get(t) is not HIT:  # a HIT answered stays the request's (its load may fail)
            a[t] = v
            self._dirty.add(ctx.req_id)
        return first

    def loading(self, t: int, job_id: Any, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """Tier ``t`` loads ``keys`` for the request (job ``job_id``): their counts wait for the load's end."""
        r = self._reqs.get(req_id)
        if r is None:
            return  # ended (or never asked us): nothing to count
        keys = [k for k in keys if k in r.ans and k not in r.done]
        for k in keys:
            r.loads.setdefault(k, [0, set()])[0] += 1
        if keys:
            self._jobs[(t, job_id)] = (req_id, keys)

    def loaded(self, t: int, job_id: Any, ok: Iterable[OffloadKey]) -> None:
        """Tier ``t``'s load job ``job_id`` ended with ``ok`` in the primary tier: a chunk whose load failed is
        another tier's to serve (its HIT here is passed over while another tier answers one: :func:`_owner`)."""
        rid, keys = self._jobs.pop((t, job_id), ("", []))
        r = self._reqs.get(rid)
        if r is None:
            return
        good = set(ok)
        for k in keys:
            ld = r.loads.get(k)
            if ld is not None:
                ld[0] -= 1
                if k not in good:
                    ld[1].add(t)
        self._dirty.discard(rid)
        self._count(r, final=False)  # now, before vLLM's scheduler sees the chunks in the primary tier

    def arrived(self, t: int, key: OffloadKey, request_ids: Iterable[str], v: bool) -> None:
        """Tier ``t``'s pending verdict of ``key`` came in as ``v`` for the requests ``request_ids`` holding it."""
        for rid in request_ids:
            r = self._reqs.get(rid)
            a = r.ans.get(key) if r is not None and key not in r.done else None
            if a is not None and t in a and a[t] is None:
                a[t] = bool(v)
                self._dirty.add(rid)

    def settle(self) -> None:
        """Count the requests whose answers changed and are now settled (the step's end)."""
        dirty, self._dirty = self._dirty, set()
        for rid in dirty:
            r = self._reqs.get(rid)
            if r is not None:
                self._count(r, final=False)

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

    def _count(self, r: _Req, final: bool) -> None:
        """Count ``r``'s chunks not counted yet once each one's owner is known (``final``: a pending answer is
        left out); nothing while one is not (not ``final``)."""
        owners: dict[OffloadKey, int | None] = {}
        filt = getattr(r.ctx, "load_tier_filter", None)
        asked = [t for t, ref in enumerate(self._tiers) if (u := ref()) is not None and not u._closed
                 and (filt is None or filt.allows(u.medium, u.locality))]  # the tiers the manager asks, in order
        for k, a in r.ans.items():
            if k not in r.done:
                o = _owner(a, asked, r.loads.get(k), final)
                if o is _UNDECIDED:
                    return
                owners[k] = o
        if not owners:
            return
        eff = _usable({**r.done, **owners}, r.ctx)
        counts: dict[int, list[int]] = {}
        for k in owners:
            e = eff[k]
            for t, v in r.ans[k].items():
                if v is not None and v is not REFUSED and (e is None or e >= t):
                    c = counts.setdefault(t, [0, 0])
                    c[0] += 1
                    c[1] += e == t
        r.done.update(owners)
        for t, (n, f) in sorted(counts.items()):
            u = self._tiers[t]()
            if u is not None and not u._closed:
                u.pool.count_lookup(n, f)


def _owner(a: dict[int, Any], asked: list[int], load: list | None, final: bool) -> Any:
    """The chunk's owner (tier index): the first tier answering HIT in ``a`` whose load of it for the request did not
    fail (``load``: ``[loads in flight, tiers whose load failed]``), else the first of those that failed; None when
    none answered HIT. :data:`_UNDECIDED` (unless ``final``: a tier not answering is passed over) while a tier
    before it (``asked``: those the manager asks the request's chunks, in order) has not answered, a load of it is
    in flight, or a load failed and no other tier answered HIT (the request may ask again and be served by another)."""
    if load is not None and load[0] > 0 and not final:
        return _UNDECIDED
    failed = load[1] if load is not None else ()
    for t in sorted({*a, *asked}):
        v = a.get(t)
        if v is None:
            if not final:
                return _UNDECIDED
        elif v is HIT and t not in failed:
            return t
    if failed and not final:
        return _UNDECIDED
    return min((t for t in failed if a.get(t) is HIT), default=None)


def _usable(owners: dict[OffloadKey, int | None], ctx: ReqContext) -> dict[OffloadKey, int | None]:
    """``owners`` with None past the request's usable prefix: per KV group (the key's last 4 bytes) in ascending
    position (``ReqContext.get_offload_key_position``) the chunks after one no tier holds. A chunk without a
    position is a prefix of its own."""
    pos = getattr(ctx, "get_offload_key_position", None)
    eff: dict[OffloadKey, int | None] = {}
    groups: dict[bytes, list[tuple[int, OffloadKey]]] = {}
    for k, o in owners.items():
        p = pos(k) if callable(pos) else None
        if p is None:
            eff[k] = o
        else:
            groups.setdefault(bytes(k[-4:]), []).append((p, k))
    for run in groups.values():
        ok = True
        for _, k in sorted(run, key=lambda x: x[0]):
            eff[k] = owners[k] if ok else None
            ok = ok and owners[k] is not None
    return eff
