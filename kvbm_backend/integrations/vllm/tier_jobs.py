"""The jobs of a vLLM secondary tier (:mod:`.tier_base`): where they run, and when each is reported finished.

Invariant 3 (never stall decode, docs/invariants.md):

- loads (promotions a waiting request needs) and stores (cascades) run on executors of their own, ``io_threads``
  threads each, so a load never queues behind stores (before 2026-12-01 one FIFO: a 2-chunk load waited 3.7 s
  behind 2 stores on a slow ``fdatasync``, reviewer 2026-12-01);
- a store's thread copies the job's chunks to staging and hands them to the pool, then is free: the job is
  finished from the pool futures' done-callbacks (its result computed on a store thread), not by a thread parked
  on ``Future.result`` until the put is durable;
- every job's ``job_timeout_s`` (from vLLM's submission) is enforced by one timer thread
  (:class:`~kvbm_backend.deadlines.Deadlines`) while the job waits for a thread or, a store, for the pool: it is
  then reported failed at once (before 2026-12-01 a queued job was failed only when a thread took it up, so with
  stores stuck in a stalled pool a request waited ``HIT_PENDING`` the whole stall). A job a thread is running
  (a load copying into the primary, a store copying out of it) is never reported early: vLLM may reuse its
  primary chunks the moment it is; those bound themselves (``deadline.left()``, the pools' bounded waits).

A job is reported exactly once (:meth:`TierJobs.deliver`, through the tier's ``finish``). What "finished" means
for a store is vLLM's: its chunks' pin is released and, on success, its latency (submission to finish) feeds
vLLM's back-pressure detector (``TieringOffloadingManager._process_finished_jobs``), so a store is finished once
its pool puts resolve (durable, or dropped), not when its staging copy is done: finished earlier, the detector
would see copy times and never the storage falling behind.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from ...deadlines import Deadline, Deadlines
from .tier_threads import started_executor

__all__ = ["Job", "NotAsked", "TierJobs"]

QUEUED, RUNNING, WAITING, DONE = "queued", "running", "waiting", "done"


class NotAsked(TimeoutError):
    """Why a job failed: its ``job_timeout_s`` passed while it was queued behind other jobs; the pool was not asked.
    Load, not a verdict on its chunks: the tier does not cool them (:meth:`.tier_base.KvbmSecondaryTier.get_finished_jobs`)."""


class Job:
    """One submitted job: vLLM's ``meta``, its ``keys``, ``store`` or load, its ``deadline``, ``state``."""

    __slots__ = ("meta", "keys", "store", "timeout_s", "deadline", "t0", "state")

    def __init__(self, meta: TransferJob, keys: list[OffloadKey], store: bool, timeout_s: float) -> None:
        self.meta, self.keys, self.store, self.timeout_s = meta, keys, store, timeout_s
        self.deadline = Deadline(timeout_s)  # from vLLM's submission, not from when a thread is free
        self.t0 = time.perf_counter()
        self.state = QUEUED


#: runs a job on its thread: its result, or None for a store now waiting for its puts (:meth:`TierJobs.wait`)
Run = Callable[[Job], Optional[JobResult]]
#: the tier's failure path: logs and counts a failed job (why: a message, or the exception) and returns its result
Fail = Callable[[Job, "str | BaseException"], JobResult]


class TierJobs:
    """The executors, deadlines and single reporting of one tier's jobs.

    Args:
        io_threads: threads of each executor (stores, loads), all started here.
        name: thread name prefix (stores ``name``, loads ``name_load``, the timer ``name_deadlines``).
        finish: hands a job's result to the tier (queued for ``get_finished_jobs``).
        fail: the tier's failure path (:data:`Fail`).
    """

    def __init__(self, io_threads: int, name: str, finish: Callable[[JobResult], None], fail: Fail) -> None:
        self._finish, self._fail = finish, fail
        self._mu = threading.Lock()
        self.stores: ThreadPoolExecutor = started_executor(io_threads, name)  # no thread starts in submit_*
        try:
            self.loads: ThreadPoolExecutor = started_executor(io_threads, f"{name}_load")
            self._timer = Deadlines(f"{name}_deadlines")
        except BaseException:
            self.stores.shutdown(wait=False)
            if hasattr(self, "loads"):
                self.loads.shutdown(wait=False)
            raise

    def submit(self, job: Job, run: Run) -> None:
        """Queue ``job`` on its executor and arm its deadline; a closed executor fails it at once."""
        try:
            (self.stores if job.store else self.loads).submit(self._take, job, run)
        except RuntimeError:  # shut down: report the job failed, never lose it
            self.deliver(job, self._fail(job, "the tier is shutting down"), claim=True)
            return
        if job.deadline.at is not None:
            self._timer.add(job.deadline.at, lambda: self._expire(job))

    def _take(self, job: Job, run: Run) -> None:
        with self._mu:
            if job.state != QUEUED:
                return  # failed at its deadline while queued: the pool is not asked
            late = job.deadline.expired()
            if not late:
                job.state = RUNNING
        if late:  # its deadline passed while queued and the timer thread has not run yet (a busy host): failed as
            self._expire(job)  # the timer would fail it, the pool not asked (before 2026-12-02 it asked the pool)
            return
        try:
            res = run(job)
        except Exception as e:  # noqa: BLE001 - any failure is a failed job, never a lost one
            res = self._fail(job, e)
        if res is not None:
            self.deliver(job, res, claim=True)

    def wait(self, job: Job, futs: list[Future], complete: Callable[[], JobResult]) -> None:
        """A store's staging copy is done and ``futs`` (its pool puts) are out: ``complete()`` (on a store thread)
        once all are done, unless its deadline passes first (then failed at once; a late ``complete`` is not
        called). The calling thread returns at once."""
        left = [len(futs)]
        mu = threading.Lock()

        def one(_f: Future) -> None:
            with mu:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    self.stores.submit(self._complete, job, complete)
                except RuntimeError:  # shut down meanwhile: on this thread
                    self._complete(job, complete)
        with self._mu:
            job.state = WAITING
        if job.deadline.expired():  # it passed while the job ran: the timer found it running
            self._expire(job)
        for f in futs:
            f.add_done_callback(one)

    def _complete(self, job: Job, complete: Callable[[], JobResult]) -> None:
        with self._mu:
            if job.state != WAITING:
                return  # reported failed at its deadline
            job.state = DONE
        try:
            res = complete()
        except Exception as e:  # noqa: BLE001
            res = self._fail(job, e)
        self.deliver(job, res)

    def _expire(self, job: Job) -> None:
        """The timer: ``job``'s deadline passed. Failed now if it waits for a thread or for the pool."""
        with self._mu:
            if job.state not in (QUEUED, WAITING):
                return
            t = f"job_timeout_s ({job.timeout_s:g} s)"
            why: str | NotAsked = (NotAsked(f"{t} passed while it was queued behind other "
                                            f"{'stores' if job.store else 'loads'} (io_threads busy); the pool was not asked")
                                   if job.state == QUEUED else f"no answer from the pool within {t}")
            job.state = DONE
        self.deliver(job, self._fail(job, why))

    def deliver(self, job: Job, res: JobResult, claim: bool = False) -> None:
        """Report ``job`` finished with ``res`` (``claim``: mark it done first; a job already done is not
        reported again)."""
        if claim:
            with self._mu:
                if job.state == DONE:
                    return
                job.state = DONE
        res.transfer_time = time.perf_counter() - job.t0
        self._finish(res)

    def shutdown(self) -> None:
        """After every job was reported: stop the threads."""
        self.loads.shutdown(wait=True)
        self.stores.shutdown(wait=True)
        self._timer.close()
