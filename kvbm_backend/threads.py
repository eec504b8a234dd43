"""Threads kvbm_backend starts, and the CPUs they run on.

A new thread inherits the CPU affinity of the thread that creates it. vLLM's CPU worker binds its main thread
to one core (the first of its OpenMP CPU list: ``VLLM_CPU_OMP_THREADS_BIND`` ``auto``, vLLM 0.x
``vllm/v1/worker/cpu_worker.py`` ``init_cpu_threads_env``), and that thread runs the connector, which opens the
pools: every G3/G4 write-behind, I/O, stats and report thread kvbm_backend started there ran on that one core,
beside the engine's own busy loop (vLLM's shared-memory queue spins with ``sched_yield`` for a second after
each step, and without pause while a request waits for remote KV). Measured on the 2-core CI VM (kernel 6.18,
two workers on one host, both bound to core 0): the prefill worker's write-behind got no CPU for 20-90 s while
the decode worker's engine spun on that core waiting for the very blocks it was to write
(``tests/e2e/test_dynamo_e2e.py::test_disaggregated_prefill_decode_hand_off_through_g4``, TTFT 91 s).

So every thread kvbm_backend starts (:func:`start_thread`, :func:`executor`) first sets its own affinity to
:func:`io_cpus`: the CPUs any thread of its process may run on (the union of their affinities, e.g. the
engine's whole OpenMP CPU list), never wider: an operator's ``taskset`` / ``numactl`` / cgroup cpuset bound
the whole process and stays. Where no thread is bound narrower than the others nothing changes. The first
widening logs one INFO line: ``kvbm_backend: threads run on CPUs A (the thread starting them is bound to B)``.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_cpus: tuple[int, frozenset[int]] | None = None  # (pid, its io_cpus): a forked child computes its own
_logged: set[int] = set()  # pids that logged the widening


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids of a kernel CPU list (``/proc/*/status`` ``Cpus_allowed_list``: ``"0-3,8,10-11"``).
    Raises ValueError on a malformed list."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def _process_cpus() -> frozenset[int]:
    """The union of the CPU affinities of this process's threads (``/proc/self/task/*/status``), with the
    calling thread's; only the calling thread's where ``/proc`` cannot be read."""
    cpus = set(os.sched_getaffinity(0))
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return frozenset(cpus)
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= parse_cpu_list(line.split(":", 1)[1])
                        break
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return frozenset(cpus)


def io_cpus() -> frozenset[int]:
    """The CPUs kvbm_backend's threads run on: those any thread of this process may run on (computed once
    per process, at the first thread kvbm_backend starts). Empty where the platform has no CPU affinity."""
    global _cpus
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    pid = os.getpid()
    with _lock:
        if _cpus is None or _cpus[0] != pid:
            _cpus = (pid, _process_cpus())
        return _cpus[1]


def on_io_cpus() -> None:
    """Set the calling thread's CPU affinity to :func:`io_cpus` when it is narrower (a thread that inherited
    one core's binding); never raises (an affinity the kernel refuses, or a ``/proc`` that cannot be read,
    leaves the thread as it was: an executor whose initializer raised would refuse all work)."""
    try:
        cpus = io_cpus()
        if not cpus:
            return
        mine = os.sched_getaffinity(0)
        if cpus <= mine:
            return
        os.sched_setaffinity(0, cpus)
    except Exception:  # noqa: BLE001 - never fail a thread's start over its CPUs
        return
    pid = os.getpid()
    with _lock:
        first = pid not in _logged
        _logged.add(pid)
    if first:
        log.info("kvbm_backend: threads run on CPUs %s (the thread starting them is bound to %s)",
                 _cpu_text(cpus), _cpu_text(mine))


def _cpu_text(cpus: Any) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def start_thread(target: Callable[..., Any], *, name: str, args: tuple = (), daemon: bool = True,
                 start: bool = True) -> threading.Thread:
    """A ``threading.Thread(target=target, args=args, name=name, daemon=daemon)`` whose run first calls
    :func:`on_io_cpus`; started unless ``start`` is False (then the caller starts it)."""
    def run(*a: Any) -> None:
        on_io_cpus()
        target(*a)
    t = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    if start:
        t.start()
    return t


class CountingExecutor(ThreadPoolExecutor):
    """:func:`executor`'s ``ThreadPoolExecutor`` that knows its backlog: :attr:`backlog` is the tasks submitted and not finished
    (queued or running), :meth:`saturated` whether every thread has one (a task submitted now waits for one of
    them: behind reads stuck in the kernel on a hung mount, for as long as they stay stuck)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=on_io_cpus)
        self.threads = max_workers
        self._backlog = 0
        self._backlog_mu = threading.Lock()

    @property
    def backlog(self) -> int:
        """Tasks submitted and not finished (queued or running)."""
        return self._backlog

    def saturated(self) -> bool:
        """True when the backlog is at least the thread count (no thread is free for another task)."""
        return self._backlog >= self.threads

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._backlog_mu:
            self._backlog += 1
        try:
            return super().submit(self._counted, fn, args, kwargs)
        except BaseException:
            with self._backlog_mu:
                self._backlog -= 1
            raise

    def _counted(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            with self._backlog_mu:
                self._backlog -= 1


def executor(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor(max_workers, thread_name_prefix=name)`` whose threads first call
    :func:`on_io_cpus` (:class:`CountingExecutor` for one that counts its backlog)."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name, initializer=on_io_cpus)
