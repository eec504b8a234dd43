"""Counting the verdicts a request takes up without posting them (:class:`.tier_lookup.TenantLookup`).

vLLM's ``AsyncLookupManager`` posts a key once: the first request that asks it (``batch_lookup`` runs with that
request's context, and counts it: ``kvbm_matched_tokens``, the hit rate, the pool's lookup counters); a request
asking a key whose verdict is already cached (resolved, in flight or pending for another live request) shares that
verdict and is never posted, so before 2026-12-03 it was never counted (review: a request served 4 chunks from G3 on
another live request's cached HITs moved ``kvbm_matched_tokens`` by 0). :class:`Pickups` notes such a request's keys
on the scheduler thread and counts each once per request, when its verdict is in: one ``count_lookup`` per request
and step (at ``flush``), over the keys it took up then (requested) and those it found held (found), on the pool of
the tier whose verdict it took. vLLM's manager asks our tiers in order and takes a chunk from the first that answers
HIT, so each tier counts the chunks it was asked and those it served: the split ``batch_lookup`` makes
(:func:`.tier_gaps.split_prefix`: the first tier over every chunk asked, each below over those not served above).

With several of our tiers in one manager (G3 above G4) a HIT is credited to the tier that loads the chunk, when its
load ends (:meth:`Pickups.loading`, :meth:`Pickups.loaded`), not when the tier answers it: vLLM asks G4 when G3
answers RETRY (G3 re-asks a cached miss once it stored the chunk, or its answer is in flight), and G4's HIT starts
no promotion when the primary tier has no free chunk (the manager answers MISS), or its load fails; the request
asks again and G3 serves the chunk. Before 2026-12-03 G4 was credited at its answer (review: chunk 1 loaded from G3
counted on G4) and G3's load of a chunk the request had not posted to G4 was never counted (G3 looks up uncounted:
the lowest of our tiers counts for all, but only what the request posted there). Now each tier credits the chunks
it loaded for the request that the lowest tier did not count for it (not posted there), each chunk once per
request; a verdict taken up is credited at its answer only when it is a miss, and a miss taken up on a tier with
one of ours below only when the request did not post the chunk to the lowest of them (its ``batch_lookup`` counts
every tier above over every chunk posted there): decided at ``flush``, after the step's lookups, since vLLM's
manager asks the tier below right after this one (:meth:`Pickups.uncount`). Before 2026-12-03 such a miss was
counted twice (a G3 miss taken up, 2 chunks: G3's lookups moved by 4 for the request).

Each lookup of each chunk per request counts once, on one tier (review, 2026-12-03). The lowest of our tiers counts
a request for every tier only over the chunks the request posted to it; a chunk the request posted to a tier above
and never to the lowest (the lowest refused the request's tenant, answered a chunk cooling after a failed load
without asking its pool, or the request took up the lowest's verdict another request posted) is counted by the tier
above itself at the step's end once its verdict is in (:meth:`Pickups.take_due`), unless the request posts it to the
lowest first (:meth:`Pickups.uncount`): requested, and found when it is a HIT in the request's usable prefix (the
leading chunks some tier of ours serves it: :func:`.tier_gaps.prefix_served`), as the lowest tier's count finds a
chunk for a tier and a lone tier's pool counts its leading held chunks. Before, neither tier counted it (G4 above a
G3 refusing the tenant: the request's lookup counted nowhere); in the first version of 2026-12-03 a HIT counted only
when loaded, so a HIT after a miss (vLLM's prefix scan stops at the miss: never loaded) was counted by no tier (G3
answering chunk 0 a miss and 1 a HIT while G4 cooled both: 1 chunk requested, where alone 2). A chunk a tier above counted for the request (a verdict
taken up, its own, a load credited) that the request posts to the lowest in a later step is left out of that tier's
count there (:meth:`Pickups.uncount` says so; :func:`.tier_gaps.split_prefix` names each chunk's tier): before, a
G3 miss taken up while G4 answered a cooling chunk was counted again once the request posted the chunk to G4.

A tier's answer to a chunk cooling after a failed load (a miss without asking its pool, :meth:`Pickups.cooled`)
counts as a miss once per request and chunk, where that tier counts the chunk: alone, at the step's end; above
another of ours, as a miss taken up (the lowest counts it where the request posts the chunk there); the lowest of
ours, at the step's end once no tier above serves the chunk for the request (its verdict a miss, or the request ended
without a HIT above). Before 2026-12-03 no pool counted it (review).

Bounds: a request's entries go at ``forget`` (its loads still in flight then credit nothing), except the counts
already due; a load is noted only for a request alive on the tier (:meth:`.tier_lookup.TenantLookup.loading`).
A HIT counted at the step's end is not credited again when loaded.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import ReqContext

__all__ = ["Pickups"]

Found = Callable[[ReqContext], Callable[[Any], "bool | None"]]  # found(req_context)(key): the request can use a HIT


class Pickups:
    """Per request, the keys whose cached verdict it shares without having posted it, those it posted, those it
    posted here and not to the lowest of our tiers, and the chunks counted on this tier for it. Scheduler thread
    only."""

    def __init__(self) -> None:
        # req_id -> keys it joined before their verdict was in (counted once it is); bounded by live requests' keys
        self._waiting: dict[str, set[Any]] = {}
        self._due: dict[str, list[int]] = {}  # req_id -> [requested, found]: counted at the next flush
        self._posted: dict[str, set[Any]] = {}  # req_id -> keys it posted here (batch_lookup counted them)
        self._counted: dict[str, set[Any]] = {}  # req_id -> keys counted here for it (taken up, own, loads credited)
        # req_id -> keys it posted here and not (yet) to the lowest of our tiers: counted here once their verdict is in
        self._own: dict[str, set[Any]] = {}
        self._own_ctx: dict[str, ReqContext] = {}  # req_id -> its context, while it has keys in _own
        self._loads: dict[Any, tuple[str, set[Any]]] = {}  # load job -> (req_id, keys to credit once loaded)
        self._misses: dict[str, set[Any]] = {}  # req_id -> misses taken up, due at the next flush unless uncounted
        # req_id -> {key: whether a tier above serves it (None: not known yet)}: cooling misses of this tier (the
        # lowest of ours), due once no tier above serves the key; and req_id -> keys answered so (each counted once)
        self._cooled: dict[str, dict[Any, Callable[[], bool | None]]] = {}
        self._cool_asked: dict[str, set[Any]] = {}

    def note(self, key: Any, held_before: bool, posted: bool, verdict: bool | None, req_context: ReqContext,
             hit_at_load: bool = False, counted_below: bool | None = None) -> None:
        """After the request's lookup of ``key``: ``held_before`` whether it held the key's verdict before this ask,
        ``posted`` whether this ask posted the key (``batch_lookup`` counts it then), ``verdict`` the answer (None:
        not in yet). A verdict the request took up is due for counting once, when it is in; asked again, never
        again. ``hit_at_load`` (several of our tiers in the manager): a HIT is not counted here but when the chunk's
        load from this tier ends (:meth:`loaded`). ``counted_below`` (None: no tier of ours asked after this one):
        whether the request posted ``key`` to the lowest of them, which counts it for this tier; a miss is then
        not counted here, else counted at the next :meth:`take_due` unless :meth:`uncount` comes first."""
        rid = req_context.req_id
        counted = self._counted.setdefault(rid, set())
        if posted:
            self._posted.setdefault(rid, set()).add(key)
            waiting = self._waiting.get(rid)
            if waiting is not None:
                waiting.discard(key)  # asked again under a new generation for this request: batch_lookup counts it
            if counted_below is False and key not in counted:  # the lowest does not count it (yet): this tier does
                self._own.setdefault(rid, set()).add(key)
                self._own_ctx[rid] = req_context
            return
        if held_before:
            waiting = self._waiting.get(rid)
            if waiting is None or key not in waiting or verdict is None:
                return
            waiting.discard(key)
        elif verdict is None:
            self._waiting.setdefault(rid, set()).add(key)
            return
        if verdict and hit_at_load:
            return  # credited to the tier vLLM loads it from (loading / loaded)
        if not verdict and counted_below is not None:
            if not counted_below:  # the manager asks the tier below next: it may post the key there (uncount)
                self._misses.setdefault(rid, set()).add(key)
            return
        if key in counted:
            return
        counted.add(key)
        due = self._due.setdefault(rid, [0, 0])
        due[0] += 1
        due[1] += bool(verdict)

    def cooled(self, key: Any, req_context: ReqContext, counted_below: bool | None = None,
               served_above: Callable[[], bool | None] | None = None) -> bool:
        """This tier answered the request's lookup of ``key`` a miss without asking its pool (cooling after a failed
        load). Returns whether that is the request's first such answer for ``key`` (counted then). A miss once per
        request, unless this tier's count has the key for it already (its own lookup posted it, or a verdict taken
        up or a load counted it): as a miss taken up (:meth:`note`, ``counted_below``) or, with ``served_above``
        (this tier the lowest of ours, others asked first: whether one of them serves ``key`` for the request, None
        while not known), due at the first :meth:`take_due` that finds it False (at :meth:`forget`: unless True)."""
        rid = req_context.req_id
        asked = self._cool_asked.setdefault(rid, set())
        if key in asked:
            return False
        asked.add(key)
        counted = self._counted.setdefault(rid, set())  # alive: what take_due counts for it is remembered (uncount)
        if key in counted or key in self._posted.get(rid, ()):
            return True
        if served_above is not None:
            self._cooled.setdefault(rid, {})[key] = served_above
        else:
            self.note(key, False, False, False, req_context, counted_below=counted_below)
        return True

    def _settle_cooled(self, rid: str, pending: dict[Any, Callable[[], bool | None]], final: bool) -> None:
        """Of ``pending`` (:meth:`cooled`), the keys no tier above serves become misses due (``final``: the request
        ended, so not known counts as not served); those served above or settled leave ``pending``."""
        for key, served in list(pending.items()):
            s = served()
            if s is None and not final:
                continue
            del pending[key]
            if not s:
                self._misses.setdefault(rid, set()).add(key)

    def cooled_keys(self, req_id: str) -> Collection[Any]:
        """The keys request ``req_id`` asked this tier about that it answered cooling (:meth:`cooled`)."""
        return self._cool_asked.get(req_id, ())

    def uncount(self, req_id: str, key: Any) -> bool:
        """Request ``req_id`` posted ``key`` to the lowest of our tiers, whose ``batch_lookup`` counts it for this
        one: a miss of it taken up here, or this tier's own verdict, is not counted here (:meth:`note`). Returns
        whether this tier counted it for the request already (the lowest then leaves it out of this tier's count)."""
        for pending in (self._misses, self._own):
            keys = pending.get(req_id)
            if keys is not None:
                keys.discard(key)
        self._cooled.get(req_id, {}).pop(key, None)  # the lowest's own cooling miss: its batch_lookup counts the key
        counted = self._counted.get(req_id)
        return counted is not None and key in counted

    def posted(self, req_id: str, key: Any) -> bool:
        """Whether request ``req_id`` (alive) posted ``key`` here: this tier's ``batch_lookup`` counted it."""
        keys = self._posted.get(req_id)
        return keys is not None and key in keys

    def loading(self, job_id: Any, req_id: str, keys: Iterable[Any]) -> None:
        """vLLM submitted load job ``job_id`` of request ``req_id`` to this tier: ``keys`` (those no lookup counted for
        the request) are credited to this tier once the load ends with them (:meth:`loaded`)."""
        want = set(keys)
        if want:
            self._counted.setdefault(req_id, set())
            self._loads[job_id] = (req_id, want)

    def loaded(self, job_id: Any, keys: Iterable[Any]) -> None:
        """Load job ``job_id`` ended with ``keys`` in the primary tier: those :meth:`loading` named count as looked up
        and found here for the request (each once per request; none once the request ended)."""
        entry = self._loads.pop(job_id, None)
        if entry is None:
            return
        rid, want = entry
        credited = self._counted.get(rid)
        if credited is None:
            return
        new = [k for k in keys if k in want and k not in credited]
        if new:
            credited.update(new)
            due = self._due.setdefault(rid, [0, 0])
            due[0] += len(new)
            due[1] += len(new)

    def take_due(self, verdict: Callable[[Any], bool | None] | None = None,
                 found: Found | None = None) -> list[tuple[int, int]]:
        """The counts due, one per request: ``(requested, found)`` in chunks; each taken once. Called after the
        step's lookups (``flush``), when the misses taken up, and the keys posted here and not to the lowest, are
        known not to be counted below. ``verdict(key)``: this tier's cached verdict of ``key`` (None: not in yet);
        a key posted here counts once it is in: a miss, or a HIT found when ``found(req_context)(key)`` (whether
        the request can use it: :func:`.tier_gaps.prefix_served`) is True, counted once that is known."""
        if verdict is not None:
            for rid, keys in self._own.items():
                self._settle(rid, keys, verdict, found)
            self._own = {rid: keys for rid, keys in self._own.items() if keys}
            self._own_ctx = {rid: c for rid, c in self._own_ctx.items() if rid in self._own}
        if self._cooled:
            for rid, pending in self._cooled.items():
                self._settle_cooled(rid, pending, final=False)
            self._cooled = {rid: pending for rid, pending in self._cooled.items() if pending}
        for rid, misses in self._misses.items():
            counted = self._counted.get(rid)
            if counted is not None:  # alive: a later post to the lowest leaves them out there (uncount)
                misses -= counted
                counted.update(misses)
            if misses:
                self._due.setdefault(rid, [0, 0])[0] += len(misses)
        self._misses = {}
        due, self._due = self._due, {}
        return [(n, f) for n, f in due.values()]

    def _settle(self, rid: str, keys: set[Any], verdict: Callable[[Any], bool | None], found: Found | None,
                final: bool = False) -> None:
        """Of ``keys`` (request ``rid`` posted them here, not to the lowest), those whose verdict is in leave
        ``keys``: a miss is due; a HIT is due once ``found`` knows whether the request can use it (``final``: the
        request ended, so not known is not found); one credited when loaded (:meth:`loaded`) is not counted again."""
        ctx, counted = self._own_ctx.get(rid), self._counted.get(rid)
        usable = found(ctx) if found is not None and ctx is not None and any(verdict(k) for k in keys) else None
        for key in list(keys):
            v = verdict(key)
            f = usable(key) if v and usable is not None else False
            if v is None or (f is None and not final):
                continue
            keys.discard(key)
            if not v:
                self._misses.setdefault(rid, set()).add(key)
            elif counted is not None and key not in counted:
                counted.add(key)
                due = self._due.setdefault(rid, [0, 0])
                due[0] += 1
                due[1] += bool(f)

    def forget(self, req_id: str, verdict: Callable[[Any], bool | None] | None = None,
               found: Found | None = None) -> None:
        """The request ended: forget the keys it was waiting on, posted and was counted, and its loads in flight
        (what is due is still counted, its misses taken up included, its own verdicts in by now (``verdict``,
        as :meth:`take_due`) and its cooling misses no tier above served (:meth:`cooled`)); a load of it ending later credits nothing, and one that never ends, its tier closed,
        is not kept)."""
        own = self._own.pop(req_id, None)
        if own and verdict is not None:
            self._settle(req_id, own, verdict, found, final=True)
        self._own_ctx.pop(req_id, None)
        cooled = self._cooled.pop(req_id, None)
        if cooled:
            self._settle_cooled(req_id, cooled, final=True)
        self._cool_asked.pop(req_id, None)
        misses, counted = self._misses.get(req_id), self._counted.get(req_id)
        if misses and counted:
            misses -= counted  # counted here for it already (take_due can no longer tell once it is forgotten)
        self._waiting.pop(req_id, None)
        self._posted.pop(req_id, None)
        if self._counted.pop(req_id, None) is not None:
            self._loads = {j: e for j, e in self._loads.items() if e[0] != req_id}
