"""Whether one of the tiers vLLM's manager asks first holds a chunk (:mod:`.tier_lookup`: G4 below G3 looks past
its own gap only where a tier above fills it).

vLLM 0.32's ``TieringOffloadingManager.lookup`` asks its secondary tiers in order for each chunk and promotes the
chunk from the first that answers HIT; the scheduler (``_maximal_prefix_lookup``) asks for every chunk of a prompt
in its first step, when each async tier still answers RETRY, so every tier is posted every chunk and its verdicts
stay cached while the request lives. A G4 that lacked chunk k answered every later chunk a miss: with G3 above
holding k, G3 served k and the chunks after it that G4 held were recomputed (review, 2026-11-30).

:func:`split_prefix` counts a request's usable prefix among the tiers (the lowest of our tiers counts for all):
each tier's own leading prefix undercounted chunks the tiers fill between them (G3 holding 1 and G4 0, 2, 3 loaded
4 chunks and counted 1, review 2026-11-30). It names the tier of each chunk, so a chunk a tier already counted for
the request (:mod:`.tier_pickups`) is left out of that tier's count (review 2026-12-03).

A tier above holds for them only what it answers a HIT: not a chunk whose load from it failed within the cool-down
(:class:`.failed_blocks.FailedChunks`: it answers a miss without asking its pool), nor a tenant it refuses. Before
2026-12-03 both read its index alone: G4 credited G3 with a HIT for a chunk G3 answered a miss and G4 served, and did
not look past its own gap at a chunk G3 cooled (no tier served it: recomputed).

That decision is taken when the tier below looks a chunk up; its verdict stays cached while a live request holds it.
A chunk an earlier request's lookup found held above (G4 answered it a miss without asking its store) and whose
load from above then failed (cooling; a block gone or unreadable, dropped or not) was answered from that stale miss
to every new request while the earlier one lived: recomputed although G4 held it (review, 2026-12-03). Now a failed
load that starts a cool-down has the tiers below ask their cached misses of those chunks again
(:func:`failed_load`), as a store does for its own tier's: a request not holding the verdict yet posts it again
(counted once for it, where it posts it). A chunk the tier above drops otherwise (evicted, deleted) keeps its cached
HIT there, so a new request's load from above fails and takes the same path.

:func:`prefix_runs` groups a request's posted chunks into prefixes (:meth:`.tier_lookup.TenantLookup.batch_lookup`),
and :func:`prefix_served` says whether a chunk a tier answered alone lies in the request's usable prefix: what a hit
counted in the tier's pool means (:mod:`.tier_pickups`, found at the step's end as the lowest tier's count finds it).
"""
from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from ...deadlines import Deadline

if TYPE_CHECKING:
    from .tier_base import KvbmSecondaryTier

log = logging.getLogger(__name__)

__all__ = ["count_run", "failed_load", "prefix_runs", "prefix_served", "served_above", "skip_held", "split_prefix"]


def failed_load(tier: KvbmSecondaryTier, keys: list[OffloadKey], tenant: str, req_context: ReqContext | None,
                cool: bool) -> None:
    """Scheduler thread: ``tier``'s load of ``tenant``'s chunks ``keys`` failed (``req_context``: the job's request).
    The cached verdicts of ``keys`` are forced to a miss (vLLM's fs tier's guard against re-issuing a doomed
    promotion, #49176) and asked again once the cool-down ended; ``cool`` (the pool was asked: its answer says
    something of them): they cool, and the tiers below that look past a gap only where a tier above fills it (G4)
    ask their cached misses of them again (the request's tenant there): "held above" may be no longer true. No I/O,
    never raises."""
    if cool:
        tier._failed.add(tenant, keys)
    tier._lookup.mark_miss_for(keys, tenant)
    if cool and keys and tier._lookup._reg and not tier._closed:  # closed: its primary buffer is gone
        for u in tier._lookup.below():
            if u is not None and not u._closed and not u.look_past_gaps:  # G3 below looked at each chunk itself
                u._lookup.stored(keys, u._tenant_of(req_context))


def skip_held(tiers: list[KvbmSecondaryTier], pairs: list[tuple[OffloadKey, str]], g: int, req_context: ReqContext,
              end: Deadline) -> int:
    """Index of the first of ``pairs[g:]`` (a run's chunks, ascending) that none of ``tiers`` (our tiers asked
    before this one, open and allowed for the request) holds every copy of for the request's tenant;
    ``len(pairs)`` when they hold all. Uncounted prefix lookups (``request=False``: G3's index), one per tier
    and stretch; a failed or late lookup holds nothing, nor one a tier answers a miss without asking its pool
    (cooling after a failed load, a tenant it refuses). Never raises."""
    tns = [u._tenant_of(req_context) for u in tiers]
    cools = [_cooling(u, pairs, tn) for u, tn in zip(tiers, tns)]
    s = g
    while s < len(pairs):
        m = 0
        for u, tenant, cool in zip(tiers, tns, cools):
            if u._serves(tenant):  # a tenant ``u`` refuses (revoked: .tier_revoked) holds nothing there
                e = _answered(cool, s, len(pairs))  # nor a chunk it cools
                m = max(m, _held_from(u, [bk for k, _ in pairs[s:e] for bk in u._block_keys(k, tenant)], end))
        if m == 0:
            return s
        s += m
    return s


def _cooling(u: KvbmSecondaryTier, pairs: list[tuple[OffloadKey, str]], tenant: str) -> list[int]:
    """Indices (ascending) of ``pairs`` whose load from ``u`` failed within the cool-down for ``tenant``: ``u``
    answers them misses without asking its pool (:class:`.failed_blocks.FailedChunks`). No I/O."""
    return [j for j, (k, _) in enumerate(pairs) if u._failed.cooling(tenant, k)] if len(u._failed) else []


def _answered(cooling: list[int], s: int, n: int) -> int:
    """The first of ``cooling`` (:func:`_cooling`) at or after ``s``; ``n`` (the run's length) if none."""
    i = bisect_left(cooling, s)
    return cooling[i] if i < len(cooling) else n


def _held_from(u: KvbmSecondaryTier, bks: list, end: Deadline) -> int:
    """Leading chunks of ``bks`` (``u``'s block keys, every copy of each chunk in turn) ``u`` holds every copy of
    (an uncounted index lookup); a failed or late lookup holds none. Never raises."""
    c = u.geometry.copies
    if not bks:
        return 0
    try:
        return int(u.pool.lookup_prefix(bks, request=False).result(timeout=end.left())) // c
    except Exception as e:  # noqa: BLE001 - a failed look holds nothing
        log.debug("lookup of the tier above failed: %s", e)
        return 0


def split_prefix(tiers: list[KvbmSecondaryTier], pairs: list[tuple[OffloadKey, str]], own: list[bool],
                 req_context: ReqContext, end: Deadline) -> list[int | None]:
    """The request's usable prefix of ``pairs`` (a run's chunks, ascending: the leading chunks some tier holds,
    what vLLM loads; the chunk after it no tier holds and the rest are recomputed) split by the tier each chunk
    loads from, the first in the manager's order that holds it: per chunk the index of that tier among ``tiers``
    (our tiers asked before this one, in order), ``len(tiers)`` for this tier (``own[j]``: its verdict of
    ``pairs[j]``, all copies), None past the usable prefix. Uncounted index lookups of the tiers above, one per
    tier and stretch they hold (one per chunk this tier serves); a failed or late one holds nothing, and a tier
    holds no chunk it answers a miss without asking its pool (cooling after a failed load, a tenant it refuses).
    Never raises."""
    tns = [u._tenant_of(req_context) for u in tiers]
    bks = [[bk for k, _ in pairs for bk in u._block_keys(k, tn)] if u._serves(tn) else []
           for u, tn in zip(tiers, tns)]  # a refused tenant: nothing held
    cools = [_cooling(u, pairs, tn) for u, tn in zip(tiers, tns)]
    owners: list[int | None] = [None] * len(pairs)
    s = 0
    while s < len(pairs):
        first, n = next(((i, m) for i, (u, b) in enumerate(zip(tiers, bks)) if (m := _held_from(
            u, b[s * u.geometry.copies:_answered(cools[i], s, len(pairs)) * u.geometry.copies], end))), (None, 0))
        if first is None:
            if not own[s]:
                break
            first, n = len(tiers), 1
        elif first > 0:
            n = 1  # a tier asked before ``first`` may hold the stretch's later chunks
        n = min(n, len(pairs) - s)
        owners[s:s + n] = [first] * n
        s += n
    return owners


def count_run(tier: KvbmSecondaryTier, above: list[KvbmSecondaryTier], pairs: list[tuple[OffloadKey, str]],
              own: list[bool], req_context: ReqContext, end: Deadline, done: dict[Any, tuple]) -> None:
    """``tier``, the lowest of our tiers, counts a run the request posted to it for each tier (``above``: ours asked
    before it): the first over every chunk asked, each below over those not served above (:func:`split_prefix`),
    each chunk for the tier it loads from; a chunk a tier counted for the request already (``done``: pair -> those
    tiers, :meth:`.tier_lookup.TenantLookup.lookup`) left out of its count. A tier above refusing the request's
    tenant counts nothing in its pool (``lookup_g3_revoked``, as the connector's G3). Never raises for I/O."""
    owners = split_prefix(above, pairs, own, req_context, end)
    for k, u in enumerate([*above, tier]):
        if u is not tier and not u._serves(u._tenant_of(req_context)):
            continue  # it answered misses without asking its pool (before 2026-12-03: counted there too)
        asked = [j for j, o in enumerate(owners) if (k == 0 or o is None or o >= k)
                 and not any(u is d for d in done.get(pairs[j], ()))]
        if asked:
            u.pool.count_lookup(len(asked), sum(owners[j] == k for j in asked))


def served_above(key: OffloadKey, req_context: ReqContext, tiers: list[KvbmSecondaryTier]) -> Callable[[], bool | None]:
    """``served()``: whether one of ``tiers`` (ours asked before this one for the request) answers ``key`` a HIT for
    the request: its cached verdict; a tenant it refuses or a chunk it cools is a miss. None while one of them has
    not answered. Scheduler thread (vLLM's verdicts are its own); no I/O."""
    def served() -> bool | None:
        unknown = False
        for u in tiers:
            tn = u._tenant_of(req_context)
            if u._closed or not u._serves(tn) or u._failed.cooling(tn, key):
                continue
            v = u._lookup._verdict((key, tn))
            if v:
                return True
            unknown = unknown or v is None
        return None if unknown else False
    return served


def prefix_served(asked: Iterable[Any], req_context: ReqContext,
                  tiers: list[KvbmSecondaryTier]) -> Callable[[Any], bool | None]:
    """``served(pair)``: whether the request can use ``pair``'s chunk from the tier that answered it a HIT: every
    chunk of ``asked`` (the ``(OffloadKey, tenant)`` pairs the request asked that tier about) of the same tenant and
    KV group (the key's last 4 bytes) at an earlier position in the request (``ReqContext.get_offload_key_position``)
    is served by one of ``tiers`` (ours the manager asks for it, in order: :func:`served_above`); None while a
    verdict is not in. A chunk without a position is a prefix of its own (True), as :func:`prefix_runs` runs it.
    The verdicts are read once, here (one pass over ``asked``). Scheduler thread; no I/O, never raises."""
    got = getattr(req_context, "get_offload_key_position", None)
    pos: Callable[[Any], Any] | None = got if callable(got) else None
    lows: dict[tuple[str, bytes], list[float]] = {}  # (tenant, group) -> [first unserved, first not known] position
    for k, tn in asked if pos is not None else ():
        q = pos(k) if pos is not None else None
        if q is not None:
            s = served_above(k, req_context, tiers)()
            if not s:
                low = lows.setdefault((tn, bytes(k[-4:])), [float("inf"), float("inf")])
                low[s is None] = min(low[s is None], q)

    def served(pair: Any) -> bool | None:
        key, tn = pair
        p = pos(key) if pos is not None else None
        low = lows.get((tn, bytes(key[-4:]))) if p is not None else None
        if low is None or p is None:
            return True
        return False if low[0] < p else None if low[1] < p else True
    return served


def prefix_runs(pairs: list[tuple[OffloadKey, str]], req_context: ReqContext) -> list[list[int]]:
    """Indices of ``pairs`` in runs to look up as prefixes: per (tenant, KV group: the key's last 4 bytes), the
    pairs in posted order while their positions in the request (``ReqContext.get_offload_key_position``, the end
    token vLLM records for every key) ascend; a pair without a position, or out of order, is a run of its own."""
    pos = getattr(req_context, "get_offload_key_position", None)
    runs: list[list[int]] = []
    last: dict[tuple[str, bytes], tuple[int, int]] = {}  # (tenant, group) -> (index in runs, its last position)
    for i, (k, tenant) in enumerate(pairs):
        p = pos(k) if callable(pos) else None
        g = (tenant, bytes(k[-4:]))
        prev = last.get(g)
        if p is not None and prev is not None and p > prev[1]:
            runs[prev[0]].append(i)
            last[g] = (prev[0], p)
            continue
        runs.append([i])
        if p is not None:
            last[g] = (len(runs) - 1, p)
        else:
            last.pop(g, None)
    return runs
