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
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from ...deadlines import Deadline

if TYPE_CHECKING:
    from .tier_base import KvbmSecondaryTier

log = logging.getLogger(__name__)

__all__ = ["skip_held", "split_prefix"]


def skip_held(tiers: list[KvbmSecondaryTier], pairs: list[tuple[OffloadKey, str]], g: int, req_context: ReqContext,
              end: Deadline) -> int:
    """Index of the first of ``pairs[g:]`` (a run's chunks, ascending) that none of ``tiers`` (our tiers asked
    before this one, open and allowed for the request) holds every copy of for the request's tenant;
    ``len(pairs)`` when they hold all. Uncounted prefix lookups (``request=False``: G3's index), one per tier
    and stretch; a failed or late lookup holds nothing. Never raises."""
    s = g
    while s < len(pairs):
        m = 0
        for u in tiers:
            tenant = u._tenant_of(req_context)
            if u._serves(tenant):  # a tenant ``u`` refuses (revoked: .tier_revoked) holds nothing there
                m = max(m, _held_from(u, [bk for k, _ in pairs[s:] for bk in u._block_keys(k, tenant)], end))
        if m == 0:
            return s
        s += m
    return s


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
    tier and stretch they hold (one per chunk this tier serves); a failed or late one holds nothing. Never
    raises."""
    bks = [[bk for k, _ in pairs for bk in u._block_keys(k, u._tenant_of(req_context))]
           if u._serves(u._tenant_of(req_context)) else [] for u in tiers]  # a refused tenant: nothing held
    owners: list[int | None] = [None] * len(pairs)
    s = 0
    while s < len(pairs):
        first, n = next(((i, m) for i, (u, b) in enumerate(zip(tiers, bks))
                         if (m := _held_from(u, b[s * u.geometry.copies:], end))), (None, 0))
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
