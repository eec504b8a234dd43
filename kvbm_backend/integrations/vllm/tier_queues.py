"""The two queues of vLLM's ``AsyncLookupManager`` as :class:`.tier_lookup.TenantLookup` keeps them.

:class:`StampedQueue` (scheduler -> worker) stamps each posted batch with its deadline. :class:`ResultsQueue`
(worker -> scheduler) hands each answer the scheduler takes in to the manager's :class:`.tier_ledger.Ledger`, for
every request holding that verdict (counted there once settled).
"""
from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Any

from ...deadlines import Deadline

if TYPE_CHECKING:
    from .tier_lookup import TenantLookup

__all__ = ["ResultsQueue", "StampedQueue", "Wrapped"]


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
    the worker thread gets them in turn) with each batch's deadline stamped when it is posted; the worker's ``get``
    makes it that batch's (``TenantLookup._end``)."""

    def __init__(self, owner: TenantLookup, q: queue.SimpleQueue) -> None:
        self._owner, self._q = owner, q

    def put(self, item: Any) -> None:
        self._q.put((None, item) if item is None else (Deadline(self._owner._tier._job_timeout_s), item))

    def get(self) -> Any:
        end, item = self._q.get()
        self._owner._batch_end = end
        return item


class ResultsQueue:
    """vLLM's worker -> scheduler queue (``AsyncLookupManager._pending_results``: the worker puts a batch of
    ``(key, generation, found)`` answers, ``drain_results`` takes them on the scheduler thread and applies them
    right after): as the scheduler takes a batch, each answer of the current generation goes to the ledger for the
    requests holding the verdict (:meth:`.tier_ledger.Ledger.arrived`)."""

    def __init__(self, owner: TenantLookup, q: queue.SimpleQueue) -> None:
        self._owner, self._q = owner, q

    def put(self, item: Any) -> None:
        self._q.put(item)

    def empty(self) -> bool:
        return self._q.empty()

    def get_nowait(self) -> Any:
        item = self._q.get_nowait()  # raises queue.Empty as vLLM expects
        o = self._owner
        for pair, generation, found in item:
            st = o._lookup_state.get(pair)
            if st is not None and st.generation == generation:
                o._ledger.arrived(o._index, pair[0], st.request_ids, found)
        return item
