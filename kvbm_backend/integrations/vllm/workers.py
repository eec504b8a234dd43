"""The worker role of the connector for N KV cache groups (a dense model is the 1-group case).

:class:`GroupedWorkers` holds one :class:`~.worker_side.WorkerSide` per vLLM KV cache group (each with its
group's namespace, pools and engine tensors) and routes the step's jobs to them by ``group``. How a failed
load reaches vLLM is decided once, at wiring time (``block_errors``):

* ``block_errors=True`` (one KV cache group without windows, :func:`block_level_errors`): every block
  from a load's first failed one on is reported by :meth:`~GroupedWorkers.load_errors` (vLLM's
  ``get_block_ids_with_load_errors``): vLLM keeps the verified prefix and recomputes the rest. Layer-wise
  G3 loads (``g3.layerwise_load``, :mod:`.layerwise`) need this and run only then.
* ``block_errors=False``: vLLM 0.32 cannot map block-level errors back to requests when there are several
  KV cache groups (its scheduler raises on ``invalid_block_ids`` then), so a request with a failed block in
  any group is reported in ``failed_recving`` (:meth:`~GroupedWorkers.take_finished`): recomputed whole.

A request's load is finished when every group that had a job for it finished.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from ...model.namespace import Namespace
from .kv_io import EngineKv
from .metadata import KvbmWorkerMeta, LoadJob, SaveJob

if TYPE_CHECKING:
    from .layerwise import LayerwiseLoads
    from .worker_side import WorkerSide


def block_level_errors(ns: Namespace) -> bool:
    """True when vLLM takes this namespace's failed loads as block ids: one full-attention (or MLA) KV cache
    group (``ns.groups`` empty). Sliding-window and multi-group namespaces report failed requests."""
    return not ns.groups


class GroupedWorkers:
    """The worker role over ``workers`` (index = vLLM's KV cache group index; see the module doc).

    Args:
        workers: one :class:`~.worker_side.WorkerSide` per KV cache group (at least one).
        block_errors: report failed loads as block ids (:meth:`load_errors`) instead of failed requests.
        layerwise: called at :meth:`register` with group 0's worker and its layer names; returns its
            :class:`~.layerwise.LayerwiseLoads` or None (needs ``block_errors`` and one group).

    Raises:
        ValueError: no workers, or ``layerwise`` without ``block_errors`` and exactly one group.
    """

    def __init__(self, workers: list["WorkerSide"], *, block_errors: bool = False,
                 layerwise: Callable[["WorkerSide", list[str]], "LayerwiseLoads | None"] | None = None):
        if not workers:
            raise ValueError("GroupedWorkers: no KV cache groups")
        if layerwise is not None and not (block_errors and len(workers) == 1):
            raise ValueError("GroupedWorkers: layer-wise loads need one KV cache group with block-level errors")
        self.workers = workers
        self.block_errors = block_errors
        self._make_layerwise = layerwise
        self.layerwise: LayerwiseLoads | None = None
        self._pending: dict[str, set[int]] = {}
        self._failed: set[str] = set()
        self._again: set[int] = set()  # engine block ids to report again (reinvalidate), for the next load_errors
        self._lock = threading.Lock()

    def register(self, kvs: list[EngineKv], layer_names: list[list[str]] | None = None) -> None:
        """Each group's engine tensors (``kvs[g]``) and, for layer-wise loads, its layer names."""
        if len(kvs) != len(self.workers):
            raise ValueError(f"kv caches: {len(kvs)} groups of tensors for {len(self.workers)} KV cache groups")
        for w, kv in zip(self.workers, kvs):
            w.register(kv)
        if self._make_layerwise is not None and layer_names:
            self.layerwise = self._make_layerwise(self.workers[0], list(layer_names[0]))

    def _route(self, jobs: list, call: Callable[["WorkerSide", list], None]) -> None:
        for gi, w in enumerate(self.workers):
            mine = [j for j in jobs if j.group == gi]
            if mine:
                call(w, mine)

    def save(self, jobs: list[SaveJob]) -> None:
        """``wait_for_save``: the step's layer-wise loads end (verified) first; saves of a request whose
        layer-wise load failed are dropped (:meth:`~.layerwise.LayerwiseLoads.saves`)."""
        if self.layerwise is not None:
            jobs = self.layerwise.saves(jobs)
        self._route(jobs, lambda w, mine: w.save(mine))

    def start_loads(self, jobs: list[LoadJob]) -> None:
        """``start_load_kv``: layer-wise jobs start on :attr:`layerwise`, the rest load in the background."""
        if self.layerwise is not None:
            jobs = self.layerwise.start(jobs)
        with self._lock:
            for j in jobs:
                self._pending.setdefault(j.req_id, set()).add(j.group)
        self._route(jobs, lambda w, mine: w.start_loads(mine))

    def reinvalidate(self, block_ids: list[int]) -> None:
        """``start_load_kv``: engine blocks a failed layer-wise load left unloaded that a request reads this step
        before any recomputed them (``KvbmConnectorMetadata.reinvalidate``): reported by this step's
        :meth:`load_errors`, so vLLM rolls that request back (only with ``block_errors``)."""
        with self._lock:
            self._again.update(int(b) for b in block_ids)

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: without layer-wise loads, loads are whole requests between steps."""
        if self.layerwise is not None:
            self.layerwise.wait_layer(layer_name)

    def take_finished(self) -> tuple[set[str], set[str]]:
        """``(finished, failed)``: requests whose loads are over in every group, and (``block_errors``
        False) those of them with a failed block (vLLM's ``failed_recving``: recomputed whole)."""
        done: set[str] = set()
        with self._lock:
            for gi, w in enumerate(self.workers):
                for rid in w.get_finished():
                    groups = self._pending.get(rid)
                    if groups is not None:
                        groups.discard(gi)
                failed_reqs = w.failed_requests()
                if not self.block_errors:
                    self._failed |= failed_reqs
                    w.load_errors()  # block ids are not reported with several groups (see the module doc)
            for rid, groups in list(self._pending.items()):
                if not groups:
                    del self._pending[rid]
                    done.add(rid)
            failed = self._failed & done
            self._failed -= failed
        return done, failed

    def load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: engine block ids whose load failed since the last call (the
        step's layer-wise loads are ended first); always empty without ``block_errors``."""
        if self.layerwise is not None:
            # wait_for_save may come later (vLLM's defer_kv_connector_finalize, speculative decoding): the
            # failures are kept for it, which still drops every save of this step (LayerwiseLoads.saves)
            self.layerwise.finish()
        with self._lock:
            out, self._again = self._again, set()
        if not self.block_errors:
            return set()
        for w in self.workers:
            out |= w.load_errors()
        return out

    def worker_meta(self) -> KvbmWorkerMeta | None:
        """Group 0's report carrying the other groups' in ``others`` (:class:`KvbmWorkerMeta`); None when no
        group has anything to report."""
        metas = [w.worker_meta() for w in self.workers]
        if all(m is None for m in metas):
            return None
        head = metas[0] or KvbmWorkerMeta()
        head.others = {gi: m for gi, m in enumerate(metas) if gi and m is not None}
        return head

    @property
    def kv(self) -> EngineKv | None:
        return self.workers[0].kv

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        if self.layerwise is not None:
            self.layerwise.close()
