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
answering chunk 0 a miss and 1 a HIT while G4 cooled both: 1 chunk requested, where alone 2). A chunk a tier above
counted for the request (a verdict taken up, its own, a load credited) that the request posts to the lowest in a
later step is left out of that tier's count there (:meth:`Pickups.uncount` says so; :func:`.tier_gaps.split_prefix`
names each chunk's tier): before, a G3 miss taken up while G4 answered a cooling chunk was counted again once the
request posted the chunk to G4.

A verdict a request takes up while still pending (another live request posted it in this step or the last: the
usual case for concurrent requests sharing a prefix) is settled like a chunk the request posted itself, at the first
``flush`` with its answer in, whether or not the request asks the chunk again (:meth:`Pickups._settle`): on a tier
above the lowest as that tier's own verdict (unless the request posts the chunk to the lowest first), alone as the
pool counts a prefix, on the lowest below tiers of ours as its ``batch_lookup`` counts a run (not when a tier above
serves the chunk in the request's usable prefix). Before 2026-12-03 it was counted only when the request asked the
chunk again once the answer was in, and vLLM's prefix scan stops at the first MISS: a chunk after it was counted by
no tier (two requests sharing 2 chunks G3 lacked: 3 chunks requested for 4 lookups).

A tier's answer to a chunk cooling after a failed load (a miss without asking its pool, :meth:`Pickups.cooled`)
counts as a miss once per request and chunk, where that tier counts the chunk: alone, at the step's end; above
another of ours, as a miss taken up (the lowest counts it where the request posts the chunk there); the lowest of
ours, at the step's end once no tier above serves the chunk for the request (its verdict a miss, or the request ended
without a HIT above). Before 2026-12-03 no pool counted it (review).

Bounds: a request's entries go at ``forget`` (its loads still in flight then credit nothing), except the counts
already due; a load is noted only for a request alive on the tier (:meth:`.tier_lookup.TenantLookup.loading`).
A HIT counted at the step's end is not credited again when loaded. Whether a HIT is found is judged at most once per
request and step, and again only once one of the request's verdicts changed (:class:`.tier_queues.FoundMemo`).
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
        # req_id -> {key it took up before its verdict was in: whether a tier above serves it (None: no tier of ours
        # above, or not this tier's to judge)}: settled at take_due once the verdict is in; bounded by live requests
        self._waiting: dict[str, dict[Any, Callable[[], bool | None] | None]] = {}
        self._due: dict[str, list[int]] = {}  # req_id -> [requested, found]: counted at the next flush
        self._posted: dict[str, set[Any]] = {}  # req_id -> keys it posted here (batch_lookup counted them)
        self._counted: dict[str, set[Any]] = {}  # req_id -> keys counted here for it (taken up, own, loads credited)
        # req_id -> keys it posted here and not (yet) to the lowest of our tiers: counted here once their verdict is in
        self._own: dict[str, set[Any]] = {}
        self._ctx: dict[str, ReqContext] = {}  # req_id -> its context, while it has keys in _own or _waiting
        self._loads: dict[Any, tuple[str, set[Any]]] = {}  # load job -> (req_id, keys to credit once loaded)
        self._misses: dict[str, set[Any]] = {}  # req_id -> misses taken up, due at the next flush unless uncounted
        # req_id -> {key: whether a tier above serves it (None: not known yet)}: cooling misses of this tier (the
        # lowest of ours), due once no tier above serves the key; and req_id -> keys answered so (each counted once)
        self._cooled: dict[str, dict[Any, Callable[[], bool | None]]] = {}
        self._cool_asked: dict[str, set[Any]] = {}

    def note(self, key: Any, held_before: bool, posted: bool, verdict: bool | None, req_context: ReqContext,
             hit_at_load: bool = False, counted_below: bool | None = None,
             served_above: Callable[[], bool | None] | None = None) -> None:
        """After the request's lookup of ``key``: ``held_before`` whether it held the key's verdict before this ask,
        ``posted`` whether this ask posted the key (``batch_lookup`` counts it then), ``verdict`` the answer (None:
        not in yet). A verdict the request took up is counted once for it; asked again, never again. One taken up
        while still pending is counted at the first :meth:`take_due` with its answer in (:meth:`_settle`), whether
        or not the request asks it again: vLLM's prefix scan stops at the first MISS, so it may never ask a later
        chunk again (before 2026-12-03 such a chunk was counted by no tier). ``hit_at_load`` (several of our tiers in
        the manager): a HIT taken up with its answer in is not counted here but when the chunk's load from this tier
        ends (:meth:`loaded`). ``counted_below`` (None: no tier of ours asked after this one): whether the request
        posted ``key`` to the lowest of them, which counts it for this tier; a miss is then not counted here, else
        counted at the next :meth:`take_due` unless :meth:`uncount` comes first. ``served_above`` (this tier the
        lowest of ours, others asked first; for a pending verdict taken up): whether one of them serves ``key`` for
        the request (:func:`.tier_gaps.served_above`)."""
        rid = req_context.req_id
        counted = self._counted.setdefault(rid, set())
        if posted:
            self._posted.setdefault(rid, set()).add(key)
            waiting = self._waiting.get(rid)
            if waiting is not None:
                waiting.pop(key, None)  # asked again under a new generation for this request: batch_lookup counts it
            if counted_below is False and key not in counted:  # the lowest does not count it (yet): this tier does
                self._own.setdefault(rid, set()).add(key)
                self._ctx[rid] = req_context
            return
        if held_before or counted_below:  # asked before (counted, or waiting: take_due); or counted by the lowest
            return
        if verdict is None:
            if key not in counted:
                self._waiting.setdefault(rid, {})[key] = served_above
                self._ctx[rid] = req_context
            return
        if verdict and hit_at_load:
            return  # credited to the tier vLLM loads it from (loading / loaded)
        if not verdict and counted_below is not None:  # the manager asks the tier below next: it may post the key
            self._misses.setdefault(rid, set()).add(key)  # there (uncount)
            return
        if key in counted:
            return
        self._add(rid, counted, key, bool(verdict))

    def _add(self, rid: str, counted: set[Any], key: Any, found: bool) -> None:
        """Count ``key`` here for request ``rid`` (alive: ``counted`` its record), once: requested, and ``found``."""
        counted.add(key)
        due = self._due.setdefault(rid, [0, 0])
        due[0] += 1
        due[1] += found

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
        self._waiting.get(rid, {}).pop(key, None)  # a verdict it took up pending: this answer counts instead
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
        one: a miss of it taken up here, a verdict taken up pending, or this tier's own verdict, is not counted here
        (:meth:`note`). Returns whether this tier counted it for the request already (the lowest then leaves it out
        of this tier's count)."""
        for pending in (self._misses, self._own):
            keys = pending.get(req_id)
            if keys is not None:
                keys.discard(key)
        self._waiting.get(req_id, {}).pop(key, None)  # a verdict it took up here pending
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
        a key posted here and not to the lowest, or taken up while pending, counts once it is in (:meth:`_settle`),
        a HIT found when ``found(req_context)(key)`` (whether the request can use it:
        :func:`.tier_gaps.prefix_served`) is True, counted once that is known."""
        if verdict is not None and (self._own or self._waiting):
            for by_req in (self._own, self._waiting):
                for rid, keys in by_req.items():
                    self._settle(rid, keys, verdict, found)
            self._own = {rid: keys for rid, keys in self._own.items() if keys}
            self._waiting = {rid: keys for rid, keys in self._waiting.items() if keys}
            self._ctx = {rid: c for rid, c in self._ctx.items() if rid in self._own or rid in self._waiting}
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

    def _settle(self, rid: str, keys: set[Any] | dict[Any, Callable[[], bool | None] | None],
                verdict: Callable[[Any], bool | None], found: Found | None, final: bool = False) -> None:
        """Of ``keys`` (request ``rid`` posted them here and not to the lowest, or took them up while pending:
        :meth:`note`), those whose verdict is in leave ``keys``: a miss is due; a HIT is due once ``found`` knows
        whether the request can use it (``final``: the request ended, so not known is not found). A key taken up
        on the lowest of ours with a ``served_above`` judge (the tiers above) counts as the lowest's count finds it
        (:func:`.tier_gaps.count_run`): not here when a tier above serves it in the request's usable prefix, else
        requested, and found when a HIT in that prefix no tier above serves; due once both are known. A key
        counted here already (a load credited, a cooling miss) is not counted again, nor credited when loaded. The
        ``found`` judgement is made at most once per call, and only when some key needs it."""
        ctx, counted = self._ctx.get(rid), self._counted.get(rid)
        judged: list[Callable[[Any], bool | None] | None] = []

        def usable(key: Any) -> bool | None:
            if not judged:
                judged.append(found(ctx) if found is not None and ctx is not None else None)
            u = judged[0]
            return u(key) if u is not None else False

        for key in list(keys):
            v = verdict(key)
            if v is None:
                continue
            above = keys.get(key) if isinstance(keys, dict) else None
            if above is None:
                f = usable(key) if v else False
                if f is None and not final:
                    continue
                _del_key(keys, key)
                if not v:
                    self._misses.setdefault(rid, set()).add(key)
                elif counted is not None and key not in counted:
                    self._add(rid, counted, key, bool(f))
                continue
            s = above()
            u = usable(key) if s or v else False  # whether a tier above serves it in the prefix; found
            if (s is None or u is None) and not final:
                continue
            _del_key(keys, key)
            if not (s and u) and counted is not None and key not in counted:
                self._add(rid, counted, key, bool(v and u and not s))

    def forget(self, req_id: str, verdict: Callable[[Any], bool | None] | None = None,
               found: Found | None = None) -> None:
        """The request ended: forget the keys it was waiting on, posted and was counted, and its loads in flight
        (what is due is still counted, its misses taken up included, its own verdicts and those it took up pending
        in by now (``verdict``, as :meth:`take_due`) and its cooling misses no tier above served (:meth:`cooled`));
        a load of it ending later credits nothing, and one that never ends, its tier closed, is not kept)."""
        for by_req in (self._own, self._waiting):
            keys = by_req.pop(req_id, None)
            if keys and verdict is not None:
                self._settle(req_id, keys, verdict, found, final=True)
        self._ctx.pop(req_id, None)
        cooled = self._cooled.pop(req_id, None)
        if cooled:
            self._settle_cooled(req_id, cooled, final=True)
        self._cool_asked.pop(req_id, None)
        misses, counted = self._misses.get(req_id), self._counted.get(req_id)
        if misses and counted:
            misses -= counted  # counted here for it already (take_due can no longer tell once it is forgotten)
        self._posted.pop(req_id, None)
        if self._counted.pop(req_id, None) is not None:
            self._loads = {j: e for j, e in self._loads.items() if e[0] != req_id}


def _del_key(keys: set[Any] | dict[Any, Any], key: Any) -> None:
    """Remove ``key`` from ``keys`` (a set or a dict's keys)."""
    if isinstance(keys, dict):
        del keys[key]
    else:
        keys.discard(key)
