"""The two queues of vLLM's ``AsyncLookupManager`` as :class:`.tier_lookup.TenantLookup` keeps them, and the
per-request judgement of which chunks a request can use (:class:`FoundMemo`), recomputed only when a verdict it
reads changed.

:class:`StampedQueue` (scheduler -> worker) stamps each posted batch with its deadline and the chunks our tiers
counted for its requests already. :class:`ResultsQueue` (worker -> scheduler) notes, as the scheduler takes a batch
of answers in, which requests hold the verdicts it changes (:meth:`FoundMemo.changed`).

Why the memo (review, 2026-12-03): a HIT a tier counts itself for a request (:mod:`.tier_pickups`: posted there
and not to the lowest of our tiers, or taken up while pending) is found when it lies in the request's usable
prefix (:func:`.tier_gaps.prefix_served`, one pass over every key the request asked the tier about, each read on
every tier the manager asks). While an earlier chunk's verdict is not in (a stalled G4 below answers within
``job_timeout_s``, 60 s by default), every step's ``flush`` rebuilt it for every such request: thousands of keys x
tiers per request and step, on vLLM's scheduler thread. Now it is rebuilt for a request only when it asked more
keys or a verdict it holds on one of those tiers changed (an answer drained in, a miss forced after a failed load,
a miss asked again); otherwise the last one is reused.
"""
from __future__ import annotations

import queue
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

from ...deadlines import Deadline

if TYPE_CHECKING:
    from .tier_lookup import TenantLookup

__all__ = ["FoundMemo", "ResultsQueue", "StampedQueue", "Wrapped"]


class Wrapped:
    """An attribute of :class:`.tier_lookup.TenantLookup` that vLLM's ``AsyncLookupManager.__init__`` assigns a
    queue to (before it starts the worker thread): kept as ``wrap(owner, queue)``."""

    def __init__(self, wrap: type) -> None:
        self._wrap, self._name = wrap, ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = "_kvbm" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else obj.__dict__[self._name]

    def __set__(self, obj: Any, q: Any) -> None:
        obj.__dict__[self._name] = q if isinstance(q, self._wrap) else self._wrap(obj, q)


class StampedQueue:
    """vLLM's scheduler -> worker queue (``AsyncLookupManager._lookup_queue``: ``flush`` puts one batch per step,
    the worker thread gets them in turn) with each batch's deadline stamped when it is posted, and the chunks of it
    our tiers counted for its requests already (:meth:`.tier_lookup.TenantLookup._take_counted`); the worker's
    ``get`` makes them that batch's (``TenantLookup._end``, ``TenantLookup._done_for``)."""

    def __init__(self, owner: TenantLookup, q: queue.SimpleQueue) -> None:
        self._owner, self._q = owner, q

    def put(self, item: Any) -> None:
        o = self._owner
        self._q.put((None, {}, None) if item is None
                    else (Deadline(o._tier._job_timeout_s), o._take_counted(item), item))

    def get(self) -> Any:
        end, done, item = self._q.get()
        self._owner._batch_end, self._owner._batch_done = end, done
        return item


class ResultsQueue:
    """vLLM's worker -> scheduler queue (``AsyncLookupManager._pending_results``: the worker puts a batch of
    ``(key, generation, found)`` answers, ``drain_results`` takes them on the scheduler thread and applies them
    right after): as the scheduler takes a batch, the requests holding a verdict it answers are marked changed
    (:meth:`FoundMemo.changed`)."""

    def __init__(self, owner: TenantLookup, q: queue.SimpleQueue) -> None:
        self._owner, self._q = owner, q

    def put(self, item: Any) -> None:
        self._q.put(item)

    def empty(self) -> bool:
        return self._q.empty()

    def get_nowait(self) -> Any:
        item = self._q.get_nowait()  # raises queue.Empty as vLLM expects
        o = self._owner
        for key, generation, _ in item:
            st = o._lookup_state.get(key)
            if st is not None and st.generation == generation:
                o._memo.changed(st.request_ids)
        return item


class FoundMemo:
    """Per live request, the last ``found`` judgement (``found(pair)``: :func:`.tier_gaps.prefix_served`) and the
    stamp it was made under (the caller's: how many keys the request asked, each tier's :meth:`changes` for it);
    and per request how often a verdict it holds on this tier changed. Scheduler thread only; entries go at
    :meth:`forget` (the request's end), so bounded by the live requests."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[Hashable, Callable[[Any], bool | None]]] = {}
        self._changes: dict[str, int] = {}

    def changed(self, request_ids: Iterable[str]) -> None:
        """A verdict these requests hold on this tier changed (answered, forced to a miss, asked again)."""
        for rid in request_ids:
            self._changes[rid] = self._changes.get(rid, 0) + 1

    def changes(self, req_id: str) -> int:
        """How often a verdict request ``req_id`` holds on this tier changed (0: never, or forgotten)."""
        return self._changes.get(req_id, 0)

    def get(self, req_id: str, stamp: Hashable,
            make: Callable[[], Callable[[Any], bool | None]]) -> Callable[[Any], bool | None]:
        """The judgement kept for ``req_id`` when it was made under ``stamp``, else ``make()`` (kept)."""
        kept = self._memo.get(req_id)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        found = make()
        self._memo[req_id] = (stamp, found)
        return found

    def forget(self, req_id: str) -> None:
        """Request ``req_id`` ended (or its judgement must be made afresh): drop what is kept for it."""
        self._memo.pop(req_id, None)
        self._changes.pop(req_id, None)
