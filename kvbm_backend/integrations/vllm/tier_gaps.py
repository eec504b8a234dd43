"""Whether one of the tiers vLLM's manager asks first holds a chunk (:mod:`.tier_lookup`: G4 below G3 looks past
its own gap only where a tier above fills it).

vLLM 0.32's ``TieringOffloadingManager.lookup`` asks its secondary tiers in order for each chunk and promotes the
chunk from the first that answers HIT; the scheduler (``_maximal_prefix_lookup``) asks for every chunk of a prompt
in its first step, when each async tier still answers RETRY, so every tier is posted every chunk and its verdicts
stay cached while the request lives. A G4 that lacked chunk k answered every later chunk a miss: with G3 above
holding k, G3 served k and the chunks after it that G4 held were recomputed (review, 2026-11-30).

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

:func:`prefix_runs` groups a request's posted chunks into prefixes (:meth:`.tier_lookup.TenantLookup.batch_lookup`).
Counting is not here: :mod:`.tier_ledger` counts each request from the answers it got.
"""
from __future__ import annotations

import logging
from bisect import bisect_left
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from ...deadlines import Deadline

if TYPE_CHECKING:
    from .tier_base import KvbmSecondaryTier

log = logging.getLogger(__name__)

__all__ = ["failed_load", "prefix_runs", "skip_held"]


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
