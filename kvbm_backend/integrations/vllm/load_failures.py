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
  to count its ranks' reports of this step and later ones, and its ``failed_recving`` (the whole load); before
  2026-12-03 they were dropped with it, so a failed load that errored its request counted 0 (a layer-wise one counted
  its blocks loaded). What is kept is bounded (review of 8f2f1f3, 2026-12-03; before, every errored request's whole
  sequence-hash array stayed until 1024 of them were, with block-level errors for good: no ``failed_recving`` ended
  one; 64 MiB at 8K-block prompts): only the hashes of the blocks a later report can still count (from the load's
  first block up to the earliest reported failed one, 8 bytes a block) and each group's count; a load with nothing
  left to count is dropped at once, as is one whose request errored for another reason (grammar, encoder, another
  connector's load: no report of ours in the output that errored it; it counts neither loaded nor failed), and the
  rest after :data:`ENDED_KEEP_S` (every rank's load has ended and been reported by then: ``g3.load_timeout_s`` is
  at most 120 s) or when they hold more than :data:`ENDED_KEEP_BYTES` (the oldest first).
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

import sys
import time
from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import stats
from .failed_blocks import contain_failed_sync_load

if TYPE_CHECKING:
    from .scheduler_side import SchedulerSide

#: the scheduler's counter of failed blocks (each once at any TP/PP size), reported to vLLM per interval
FAILED_BLOCKS = "load_failed_blocks_any_rank"
#: the scheduler's counter of blocks every rank loaded (each once at any TP/PP size), reported to vLLM per interval
LOADED_BLOCKS = "load_verified_blocks_every_rank"
#: bytes (hashes, positions, :data:`_ENTRY_BYTES` each) the unsettled loads of errored requests (:func:`errored`) kept
#: for their ranks' later failure reports may hold; past it the oldest are dropped (their later reports count 0)
ENDED_KEEP_BYTES = 16 << 20
#: seconds such a load is kept: longer than any rank's load runs (``g3.load_timeout_s`` <= 120) and is then reported
ENDED_KEEP_S = 150.0
_ENTRY_BYTES = 640  # charged per kept load beside its arrays: its entry, jobs dict and lists, request id, dict slot


def errored(request: Any) -> bool:
    """True when vLLM finished ``request`` with an error (``RequestStatus.FINISHED_ERROR``: with
    ``kv_load_failure_policy: fail`` a failed load does so before its failure report reaches the connector)."""
    return getattr(getattr(request, "status", None), "name", None) == "FINISHED_ERROR"


class _Ended:
    """An errored request's unsettled load, kept for its ranks' later failure reports (:meth:`FailedBlockCount.forget`):
    ``jobs`` as ``FailedBlockCount._jobs``' (group -> [positions, counted]); ``hashes[i]``: the sequence hash of the
    request's block ``base + i``, of the blocks a report can still count only (:meth:`cut`); ``whole``: no report
    cut any group yet; ``seen``: a report of it came since it was kept; ``since``: when it was kept (the clock's s);
    ``nbytes``: what it is charged against :data:`ENDED_KEEP_BYTES`."""

    __slots__ = ("base", "hashes", "jobs", "whole", "seen", "since", "nbytes")

    def __init__(self, jobs: dict[int, list], since: float) -> None:
        self.jobs = {g: [p if isinstance(p, range) else array("q", p), c] for g, (p, c) in jobs.items()}
        self.base, self.hashes, self.since, self.nbytes = 0, array("Q"), since, 0
        self.whole = all(c == len(p) for p, c in self.jobs.values())
        self.seen = not self.whole  # a report counted before vLLM errored the request: its own

    def cut(self, source: Any, source_base: int) -> bool:
        """Keep of ``source`` (sequence hashes, ``source[0]`` the request's block ``source_base``) only the blocks a
        report can still count: from the first block of a group with a count left to the last one counted. Returns
        False when no group has a count left (nothing to keep)."""
        live = [(p, c) for p, c in self.jobs.values() if c > 0]
        if not live:
            return False
        lo, hi = min(p[0] for p, _ in live), max(p[c - 1] for p, c in live) + 1
        if source is not self.hashes or lo != source_base or hi - lo != len(source):
            part = source[lo - source_base:hi - source_base]
            self.hashes = part if isinstance(part, array) and part.typecode == "Q" else array("Q", part)
        self.base, self.whole = lo, all(c == len(p) for p, c in self.jobs.values())
        self.nbytes = _ENTRY_BYTES + sys.getsizeof(self.hashes) + sum(sys.getsizeof(p) for p, _ in self.jobs.values())
        return True

    def first_kept(self, pos: Sequence[int], first_failed: int) -> int:
        """How many of ``pos`` (a group's positions) a report failing from the block whose sequence hash is
        ``first_failed`` keeps. A hash not among the kept blocks: while no report cut any group, not one of the
        load's (0: the whole load failed, as for a request not finished); after one, past the blocks any report can
        still count (``len(pos)``: none)."""
        try:
            i = self.hashes.index(first_failed)
        except (ValueError, OverflowError, TypeError):
            return 0 if self.whole else len(pos)
        return bisect_left(pos, self.base + i)


class FailedBlockCount:
    """Per request, the block positions of its outstanding load of each KV cache group and how many of them are
    counted failed (``load_failed_blocks_any_rank``); once the load is settled (:meth:`step`, :meth:`forget`) the
    blocks before the first failed one are counted loaded (``load_verified_blocks_every_rank``). Scheduler thread only;
    an entry lives until its load is settled or its request finishes (:meth:`forget`; an errored request's is kept
    for failure reports, bounded: :data:`ENDED_KEEP_BYTES`, :data:`ENDED_KEEP_S`). ``clock``: seconds, monotonic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._jobs: dict[str, dict[int, list]] = {}  # request id -> group -> [positions (ascending), first counted]
        self._mode: dict[str, str] = {}  # request id -> "async", "sync" (planned, not yet run) or "ran" (sync, run)
        self._ended: dict[str, _Ended] = {}  # errored request id -> its kept load (oldest first)
        self._ended_new: list[str] = []  # kept since the last step: dropped then unless a report of them came
        self._ended_bytes, self._clock = 0, clock

    @property
    def ended_bytes(self) -> int:
        """Bytes the kept loads of errored requests are charged (at most :data:`ENDED_KEEP_BYTES`)."""
        return self._ended_bytes

    def planned(self, req_id: str, group: int, positions: Sequence[int], sync: bool = False) -> None:
        """A load of blocks ``positions`` (indices into the request's sequence hashes, ascending) of ``group``;
        ``sync``: a layer-wise load, run in the step that schedules the request."""
        if self._mode.get(req_id) == "ran":  # a new load (after a preemption) while its last one's step is done
            self._settle(req_id)
        self._drop(req_id)
        self._jobs.setdefault(req_id, {})[group] = [positions, len(positions)]
        self._mode[req_id] = "sync" if sync else "async"

    def failed(self, req_id: str, group: int, hashes: Any, first_failed: int) -> int:
        """A worker's report: its load of ``group`` failed from the block whose sequence hash is ``first_failed`` on
        (``hashes``: the request's sequence hashes; None for a request that errored, whose load was kept). Counts
        and returns the blocks no earlier report counted (another rank's report of the same load counts only the
        blocks before those it failed from); 0 for an unknown load."""
        ended = None if req_id in self._jobs else self._ended.get(req_id)
        if ended is not None:
            ended.seen = True
            job = ended.jobs.get(group)
        else:
            job = self._jobs.get(req_id, {}).get(group) if hashes is not None else None
        if job is None:
            return 0
        pos, counted = job
        if ended is not None:
            k = ended.first_kept(pos, first_failed)
        else:
            try:
                k = bisect_left(pos, hashes.index(first_failed))
            except (ValueError, OverflowError, TypeError):  # not one of its blocks: the whole load failed
                k = 0
        if k >= counted:
            return 0
        job[1] = k
        stats.add(**{FAILED_BLOCKS: counted - k})
        if ended is not None:  # fewer blocks left to count: fewer hashes kept (none: dropped)
            self._ended_bytes -= ended.nbytes
            if ended.cut(ended.hashes, ended.base):
                self._ended_bytes += ended.nbytes
            else:
                del self._ended[req_id]
        return counted - k

    def loaded_none(self, req_id: str) -> int:
        """vLLM recomputes ``req_id`` from its first token (``failed_recving``; with ``kv_load_failure_policy: fail``
        it errored the request): every block of its unsettled load (every group's) that no report counted yet is
        counted failed now, and none will count loaded. Returns the blocks counted; 0 for an unknown load."""
        jobs = self._jobs.get(req_id)
        if jobs is None:  # an errored request's: every rank's report is in (vLLM reports failed_recving only then)
            ended = self._drop(req_id)
            jobs = ended.jobs if ended is not None else {}
        n = 0
        for job in jobs.values():
            n, job[1] = n + job[1], 0
        if n:
            stats.add(**{FAILED_BLOCKS: n})
        return n

    def step(self, scheduled: Any) -> int:
        """At ``build_connector_meta`` (``scheduled``: the step's scheduled request ids): settles the asynchronous
        loads of requests vLLM schedules again and the synchronous loads that ran in an earlier step (their output
        is in); marks this step's synchronous loads as running. Drops the kept loads of errored requests that no
        report of the output that errored them named (errored for another reason) and those kept
        :data:`ENDED_KEEP_S`. Returns the blocks counted loaded."""
        for rid in self._ended_new:
            ended = self._ended.get(rid)
            if ended is not None and not ended.seen:
                self._drop(rid)
        self._ended_new.clear()
        self._expire()
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

    def _drop(self, req_id: str) -> _Ended | None:
        ended = self._ended.pop(req_id, None)
        if ended is not None:
            self._ended_bytes -= ended.nbytes
        return ended

    def _expire(self) -> None:
        now = self._clock()
        while self._ended:
            rid, ended = next(iter(self._ended.items()))
            if now - ended.since < ENDED_KEEP_S:
                return
            self._drop(rid)

    def forget(self, req_id: str, errored_hashes: Any = None) -> None:
        """``req_id`` finished. ``errored_hashes``: its sequence hashes when it finished with an error
        (:func:`errored`): its unsettled load counts none loaded and is kept for the failure reports that follow
        (:meth:`failed`, :meth:`loaded_none`): the hashes of the blocks they can still count only, until no block is
        left to count, the next :meth:`step` when no report of it came by then, :data:`ENDED_KEEP_S`, or the kept
        loads hold over :data:`ENDED_KEEP_BYTES` (the oldest dropped first). Otherwise a synchronous load that ran
        in the step whose output finished it is settled (a failed block would have kept it from finishing), any
        other dropped uncounted."""
        if errored_hashes is not None and req_id in self._jobs:
            ended = _Ended(self._jobs.pop(req_id), self._clock())
            if ended.cut(errored_hashes, 0):
                self._drop(req_id)
                self._ended[req_id], self._ended_bytes = ended, self._ended_bytes + ended.nbytes
                self._ended_new.append(req_id)
                self._expire()
                while self._ended_bytes > ENDED_KEEP_BYTES:
                    self._drop(next(iter(self._ended)))
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
    on); for a miss (not a timeout) that block ends every prefix offered for ``FAILED_BLOCK_COOLDOWN_S`` (of a
    sliding-window group: every prefix whose window of that group reads it, :class:`.failed_blocks.FailedBlocks`); a
    failed synchronous load's blocks leave vLLM's prefix cache, hits on them save nothing from them on
    (:mod:`.failed_blocks`), hand-offs promise no dropped save; the failed blocks are counted once
    (:class:`FailedBlockCount`)."""
    sched.promises.loads_failed(failed, sched._reqs)
    for f in failed:
        st = sched._reqs.get(f.req_id)  # None: finished (errored: FailedBlockCount kept its hashes)
        sched.failed_counts.failed(f.req_id, group, st.hashes if st is not None else None, f.first_failed)
        if st is not None and st.sync_load and st.group_block_ids:
            contain_failed_sync_load(sched._reqs, st, f.first_failed, sched.evict_engine_blocks, sched.unrecomputed)
        if st is not None and not st.no_load:  # saved_upto: reset at its next schedule (recomputed: saved again)
            st.no_load, st.lookup, st.hit, st.saved_upto, st.planned = True, None, None, None, None
            stats.add(load_failed_requests=1)
        # counted once per block that starts cooling: every TP rank reports the same failed block (before
        # 2026-12-03 each report counted, N per block at TP N); the group: a sliding window's failed block cuts
        # only hits whose window reads it
        fb = sched.failed_blocks
        if f.reason == "miss" and fb.add_failed_load(f.tenant, st, f.first_failed, sched.bs, f.digest, group):
            stats.add(load_failed_blocks_cooled=1)
