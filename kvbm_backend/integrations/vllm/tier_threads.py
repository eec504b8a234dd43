"""The I/O thread pool of a vLLM secondary tier (:mod:`.tiering`), with every thread started up front, and its
staging arena (:func:`staging_pool`).

Why: ``ThreadPoolExecutor`` starts a thread inside ``submit`` while fewer than ``max_workers`` exist and
none is idle, so the first ``io_threads`` jobs' ``submit_store``/``submit_load`` (called on vLLM's
scheduler thread) each paid a thread start and the GIL hand-off to the new thread: measured on the
2-core dev VM, ``ThreadPoolExecutor._adjust_thread_count`` p99 1.1 ms, max 3.7 ms, with our
``submit_store`` p99 2.4 ms against a median of 0.05 ms (``benchmarks/tier_interface.py``'s step test).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ...memory import BufferPool
from ...threads import executor

__all__ = ["staging_pool", "started_executor"]


def started_executor(threads: int, name: str, timeout_s: float = 60.0) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)`` whose ``threads`` threads
    are all running when it returns (each held at a barrier until all have started). Raises ValueError
    for ``threads`` < 1, ``threading.BrokenBarrierError`` if they do not all start within ``timeout_s``."""
    if threads < 1:
        raise ValueError(f"io_threads: must be >= 1, got {threads}")
    ex = executor(threads, name)
    gate = threading.Barrier(threads + 1)
    try:
        futs = [ex.submit(gate.wait, timeout_s) for _ in range(threads)]
        gate.wait(timeout_s)
        for f in futs:
            f.result(timeout=timeout_s)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    return ex


def staging_pool(nbytes: int, count: int) -> BufferPool:
    """The tier's staging: ``count`` block buffers of ``nbytes`` (the FullyContiguous images of jobs in
    flight) in one arena allocated and pre-faulted now, on transparent huge pages (``"thp"``); a job past
    them gets fresh buffers, not kept (``keep_bytes`` 0), so taking never blocks.

    Why pre-faulted: measured on the 2-core dev VM, first-touch page faults of 256 MiB took ~0.7 s, most
    of a cold store job's time. Why THP: building a 256 MiB arena of 512 KiB buffers took 0.08 s on huge
    pages vs 0.30-0.34 s with ``MAP_POPULATE`` on 4 KiB pages (the previous arena), and copies into it ran
    4.5 vs 3.0-4.0 GB/s.
    """
    return BufferPool("thp", 0, arena=(max(0, int(count)), nbytes), name="vllm-tier-staging")
