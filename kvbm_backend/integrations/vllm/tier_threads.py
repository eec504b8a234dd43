"""The I/O thread pool of a vLLM secondary tier (:mod:`.tiering`), with every thread started up front.

Why: ``ThreadPoolExecutor`` starts a thread inside ``submit`` while fewer than ``max_workers`` exist and
none is idle, so the first ``io_threads`` jobs' ``submit_store``/``submit_load`` (called on vLLM's
scheduler thread) each paid a thread start and the GIL hand-off to the new thread: measured on the
2-core dev VM, ``ThreadPoolExecutor._adjust_thread_count`` p99 1.1 ms, max 3.7 ms, with our
``submit_store`` p99 2.4 ms against a median of 0.05 ms (``benchmarks/tier_interface.py``'s step test).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["started_executor"]


def started_executor(threads: int, name: str, timeout_s: float = 60.0) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)`` whose ``threads`` threads
    are all running when it returns (each held at a barrier until all have started). Raises ValueError
    for ``threads`` < 1, ``threading.BrokenBarrierError`` if they do not all start within ``timeout_s``."""
    if threads < 1:
        raise ValueError(f"io_threads: must be >= 1, got {threads}")
    ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
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
