"""Whether one of the tiers vLLM's manager asks first holds a chunk (:mod:`.tier_lookup`: G4 below G3 looks past
its own gap only where a tier above fills it).

vLLM 0.32's ``TieringOffloadingManager.lookup`` asks its secondary tiers in order for each chunk and promotes the
chunk from the first that answers HIT; the scheduler (``_maximal_prefix_lookup``) asks for every chunk of a prompt
in its first step, when each async tier still answers RETRY, so every tier is posted every chunk and its verdicts
stay cached while the request lives. A G4 that lacked chunk k answered every later chunk a miss: with G3 above
holding k, G3 served k and the chunks after it that G4 held were recomputed (review, 2026-11-30).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from ...deadlines import Deadline

if TYPE_CHECKING:
    from .tiering import KvbmSecondaryTier

log = logging.getLogger(__name__)

__all__ = ["skip_held"]


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
            c = u.geometry.copies
            tenant = u._tenant_of(req_context)
            bks = [bk for k, _ in pairs[s:] for bk in u._block_keys(k, tenant)]
            try:
                m = max(m, int(u.pool.lookup_prefix(bks, request=False).result(timeout=end.left())) // c)
            except Exception as e:  # noqa: BLE001 - a failed look holds nothing
                log.debug("lookup of the tier above failed: %s", e)
        if m == 0:
            return s
        s += m
    return s
