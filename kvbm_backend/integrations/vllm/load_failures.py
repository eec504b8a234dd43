"""The scheduler's side of failed loads: vLLM's ``failed_recving`` and the workers' :class:`~.metadata.FailedLoad`
reports (:meth:`.scheduler_side.SchedulerSide.load_failed` / ``loads_failed`` delegate here), and their counts.

* **Whose failure.** vLLM's ``MultiConnector`` (this connector beside NIXL, LMCache, ...) hands every member the
  union of every member's ``failed_recving``. A request there is this connector's failure only while it has a load
  of that request outstanding (``_Req.planned``: set when it planned one, cleared when vLLM allocates the request
  with no external tokens from it, as for a request another member loads). Before 2026-12-03 a request another
  connector failed to load was counted ``load_failed_requests`` here and never offered a G3/G4 hit again (vLLM
  recomputes such a request and asks every member once more: the G3/G4 hit it then had was refused). The
  block-level report (``get_block_ids_with_load_errors``) was never mixed up: MultiConnector asks each member for
  its own and unions them itself; this connector's workers report only their own loads' blocks.
* **Failed blocks, each once** (``load_failed_blocks_any_rank``: ``vllm:kvbm_backend_onboard_failed_blocks``,
  :class:`FailedBlockCount`). With TP (or PP) > 1 every worker loads its slice of every block and fails alone; vLLM
  recomputes a load from the first block any rank failed on (it unions the ranks' invalid block ids). The scheduler
  gets every rank's report (vLLM aggregates the workers' metadata; ranks may report in different steps) and counts
  each planned load's blocks from the earliest reported first failed one on, once. Before 2026-12-03 the Prometheus
  counter took the workers' ``load_blocks_failed`` from TP rank 0 only (``stats.Interval``): a load only rank 1
  failed, recomputed by the engine, read 0. A load vLLM reports in ``failed_recving`` (models without block-level
  load errors) is recomputed whole (vLLM sets the request's computed tokens to 0): every block of it, every group's,
  counts failed (before 2026-12-03 only the reporting group's from its first failed block on: 3 of an 8-block load).
  With ``kv_load_failure_policy: fail`` vLLM finishes the request (``FINISHED_ERROR``, ``request_finished``) before
  it hands the connector the step's failure reports: the load of a request finished so (:func:`errored`) is kept
  (:data:`ENDED_KEEP` of them at most, the oldest dropped first) to count its ranks' reports of this step and later
  ones, and its ``failed_recving`` (the whole load); before 2026-12-03 they were dropped with it, so a failed load
  that errored its request counted 0 (a layer-wise one counted its blocks loaded).
* **Loaded blocks, each once** (``load_verified_blocks_every_rank``: ``vllm:kvbm_backend_onboard_blocks``). A load's
  blocks before the first one any rank failed on (what vLLM keeps), counted once the load is settled, i.e. once every
  rank's report of it is in: an asynchronous load when vLLM schedules its request again (it does so only after every
  rank reported the request in ``finished_recving``, each rank's ``FailedLoad`` in the same step output); a
  synchronous (layer-wise) load at the next step's ``build_connector_meta`` (its step's output is processed before:
  layer-wise loads run only without async scheduling) or when its request finishes in that step's output (a failed
  block keeps it from finishing). A request vLLM reports in ``failed_recving`` (recomputed from its first token)
  loaded none; a load whose request ends (aborted) before it settled is not counted. Before 2026-12-03 the counter was
  TP rank 0's ``load_blocks_ok``: a block rank 0 loaded but another rank failed counted in ``onboard_blocks`` as
  well as in ``onboard_failed_blocks``. A load whose request errored (``kv_load_failure_policy: fail``) loaded none:
  vLLM dropped the request.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import stats
from .failed_blocks import contain_failed_sync_load

if TYPE_CHECKING:
    from .scheduler_side import SchedulerSide

#: the scheduler's counter of failed blocks (each once at any TP/PP size), reported to vLLM per interval
FAILED_BLOCKS = "load_failed_blocks_any_rank"
#: the scheduler's counter of blocks every rank loaded (each once at any TP/PP size), reported to vLLM per interval
LOADED_BLOCKS = "load_verified_blocks_every_rank"
#: unsettled loads of errored requests (:func:`errored`) kept for their ranks' later failure reports; oldest dropped
ENDED_KEEP = 1024


def errored(request: Any) -> bool:
    """True when vLLM finished ``request`` with an error (``RequestStatus.FINISHED_ERROR``: with
    ``kv_load_failure_policy: fail`` a failed load does so before its failure report reaches the connector)."""
    return getattr(getattr(request, "status", None), "name", None) == "FINISHED_ERROR"


class FailedBlockCount:
    """Per request, the block positions of its outstanding load of each KV cache group and how many of them are
    counted failed (``load_failed_blocks_any_rank``); once the load is settled (:meth:`step`, :meth:`forget`) the
    blocks before the first failed one are counted loaded (``load_verified_blocks_every_rank``). Scheduler thread only;
    an entry lives until its load is settled or its request finishes (:meth:`forget`; an errored request's is kept
    for failure reports, :data:`ENDED_KEEP` at most)."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[int, list]] = {}  # request id -> group -> [positions (ascending), first counted]
        self._mode: dict[str, str] = {}  # request id -> "async", "sync" (planned, not yet run) or "ran" (sync, run)
        self._ended: dict[str, tuple[Any, dict[int, list]]] = {}  # errored request id -> (its hashes, its jobs)

    def planned(self, req_id: str, group: int, positions: Sequence[int], sync: bool = False) -> None:
        """A load of blocks ``positions`` (indices into the request's sequence hashes, ascending) of ``group``;
        ``sync``: a layer-wise load, run in the step that schedules the request."""
        if self._mode.get(req_id) == "ran":  # a new load (after a preemption) while its last one's step is done
            self._settle(req_id)
        self._ended.pop(req_id, None)
        self._jobs.setdefault(req_id, {})[group] = [positions, len(positions)]
        self._mode[req_id] = "sync" if sync else "async"

    def failed(self, req_id: str, group: int, hashes: Any, first_failed: int) -> int:
        """A worker's report: its load of ``group`` failed from the block whose sequence hash is ``first_failed`` on
        (``hashes``: the request's sequence hashes; None for a request that errored, whose hashes were kept). Counts
        and returns the blocks no earlier report counted (another rank's report of the same load counts only the
        blocks before those it failed from); 0 for an unknown load."""
        if req_id in self._jobs:
            job = self._jobs[req_id].get(group)
        else:
            hashes, jobs = self._ended.get(req_id, (None, {}))
            job = jobs.get(group)
        if job is None or hashes is None:
            return 0
        pos, counted = job
        try:
            k = bisect_left(pos, hashes.index(first_failed))
        except (ValueError, OverflowError, TypeError):  # not one of its blocks: the whole load failed
            k = 0
        if k >= counted:
            return 0
        job[1] = k
        stats.add(**{FAILED_BLOCKS: counted - k})
        return counted - k

    def loaded_none(self, req_id: str) -> int:
        """vLLM recomputes ``req_id`` from its first token (``failed_recving``; with ``kv_load_failure_policy: fail``
        it errored the request): every block of its unsettled load (every group's) that no report counted yet is
        counted failed now, and none will count loaded. Returns the blocks counted; 0 for an unknown load."""
        jobs = self._jobs.get(req_id)
        if jobs is None:  # an errored request's: every rank's report is in (vLLM reports failed_recving only then)
            jobs = self._ended.pop(req_id, (None, {}))[1]
        n = 0
        for job in jobs.values():
            n, job[1] = n + job[1], 0
        if n:
            stats.add(**{FAILED_BLOCKS: n})
        return n

    def step(self, scheduled: Any) -> int:
        """At ``build_connector_meta`` (``scheduled``: the step's scheduled request ids): settles the asynchronous
        loads of requests vLLM schedules again and the synchronous loads that ran in an earlier step (their output
        is in); marks this step's synchronous loads as running. Returns the blocks counted loaded."""
        n = 0
        for rid, mode in list(self._mode.items()):
            if mode == "ran" or (mode == "async" and rid in scheduled):
                n += self._settle(rid)
            elif mode == "sync":
                self._mode[rid] = "ran"
        return n

    def _settle(self, req_id: str) -> int:
        jobs = self._jobs.pop(req_id, {})
        self._mode.pop(req_id, None)
        n = sum(job[1] for job in jobs.values())
        if n:
            stats.add(**{LOADED_BLOCKS: n})
        return n

    def forget(self, req_id: str, errored_hashes: Any = None) -> None:
        """``req_id`` finished. ``errored_hashes``: its sequence hashes when it finished with an error
        (:func:`errored`): its unsettled load counts none loaded and is kept for the failure reports that follow
        (:meth:`failed`, :meth:`loaded_none`). Otherwise a synchronous load that ran in the step whose output
        finished it is settled (a failed block would have kept it from finishing), any other dropped uncounted."""
        if errored_hashes is not None and req_id in self._jobs:
            self._ended[req_id] = (errored_hashes, self._jobs.pop(req_id))
            while len(self._ended) > ENDED_KEEP:
                del self._ended[next(iter(self._ended))]
        elif self._mode.get(req_id) == "ran":
            self._settle(req_id)
        self._jobs.pop(req_id, None)
        self._mode.pop(req_id, None)


def on_failed_recving(reqs: dict[str, Any], req_ids, counts: FailedBlockCount | None = None) -> None:
    """vLLM reported these requests' loads failed (``failed_recving``: models without block-level load errors,
    :func:`.workers.block_level_errors`, or another ``MultiConnector`` member's). vLLM recomputes such a request from
    its first token and asks for a match again: one with a load of ours outstanding is answered 0 from now on (the same
    load would fail again: a livelock) and its blocks are offered again as they are recomputed; others are not ours.
    ``counts``: the scheduler's :class:`FailedBlockCount`: a load of ours not yet settled loaded no block and every
    block of it failed (:meth:`FailedBlockCount.loaded_none`: vLLM recomputes the request whole; the worker's report of
    the same step may have cleared ``planned``)."""
    for rid in req_ids:
        if counts is not None:
            counts.loaded_none(rid)
        st = reqs.get(rid)
        if st is None or st.planned is None:  # no load of ours: another connector's (MultiConnector)
            continue
        if not st.no_load:  # else counted by on_failed_loads (the worker's report of the same step)
            stats.add(load_failed_requests=1)
        st.no_load, st.lookup, st.hit, st.saved_upto, st.planned = True, None, None, None, None


def on_failed_loads(sched: SchedulerSide, failed: list, group: int = 0) -> None:
    """Worker reports of loads of KV cache group ``group`` that did not deliver every block (:class:`~.metadata.
    FailedLoad`, every TP rank's): the request is never offered a load again (recomputed from its first failed block
    on); for a miss (not a timeout) that block ends every prefix offered for ``FAILED_BLOCK_COOLDOWN_S``; a failed
    synchronous load's blocks leave vLLM's prefix cache, hits on them save nothing from them on (:mod:`.failed_blocks`),
    hand-offs promise no dropped save; the failed blocks are counted once (:class:`FailedBlockCount`)."""
    sched.promises.loads_failed(failed, sched._reqs)
    for f in failed:
        st = sched._reqs.get(f.req_id)  # None: finished (errored: FailedBlockCount kept its hashes)
        sched.failed_counts.failed(f.req_id, group, st.hashes if st is not None else None, f.first_failed)
        if st is not None and st.sync_load and st.group_block_ids:
            contain_failed_sync_load(sched._reqs, st, f.first_failed, sched.evict_engine_blocks, sched.unrecomputed)
        if st is not None and not st.no_load:  # saved_upto: reset at its next schedule (recomputed: saved again)
            st.no_load, st.lookup, st.hit, st.saved_upto, st.planned = True, None, None, None, None
            stats.add(load_failed_requests=1)
        if f.reason == "miss":
            sched.failed_blocks.add_failed_load(f.tenant, st, f.first_failed, sched.bs, f.digest)
            stats.add(load_failed_blocks_cooled=1)
