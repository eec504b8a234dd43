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
"""
from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import ReqContext

__all__ = ["Pickups"]


class Pickups:
    """Per request, the keys whose cached verdict it shares without having posted it. Scheduler thread only."""

    def __init__(self) -> None:
        # req_id -> keys it joined before their verdict was in (counted once it is); bounded by live requests' keys
        self._waiting: dict[str, set[Any]] = {}
        self._due: dict[str, list[int]] = {}  # req_id -> [requested, found]: counted at the next flush

    def note(self, key: Any, held_before: bool, posted: bool, verdict: bool | None, req_context: ReqContext) -> None:
        """After the request's lookup of ``key``: ``held_before`` whether it held the key's verdict before this ask,
        ``posted`` whether this ask posted the key (``batch_lookup`` counts it then), ``verdict`` the answer (None:
        not in yet). A verdict the request took up is due for counting once, when it is in; asked again, never
        again."""
        rid = req_context.req_id
        if posted:
            waiting = self._waiting.get(rid)
            if waiting is not None:
                waiting.discard(key)  # asked again under a new generation for this request: batch_lookup counts it
            return
        if held_before:
            waiting = self._waiting.get(rid)
            if waiting is None or key not in waiting or verdict is None:
                return
            waiting.discard(key)
        elif verdict is None:
            self._waiting.setdefault(rid, set()).add(key)
            return
        due = self._due.setdefault(rid, [0, 0])
        due[0] += 1
        due[1] += bool(verdict)

    def take_due(self) -> list[tuple[int, int]]:
        """The counts due, one per request: ``(requested, found)`` in chunks; each taken once."""
        due, self._due = self._due, {}
        return [(n, f) for n, f in due.values()]

    def forget(self, req_id: str) -> None:
        """The request ended: forget the keys it was waiting on (what is due is still counted)."""
        self._waiting.pop(req_id, None)
