"""Signal handling shared by the commands that leave files behind unless their ``finally`` runs (``replay``
in real mode, ``bench``): SIGTERM (what a job runner or ``timeout`` sends) asks the command to stop, and it
stops at its next step boundary with the KeyboardInterrupt that SIGINT raises, so the same cleanup runs.

The handler itself raises nothing: an exception raised from a signal handler lands in whatever Python code the
main thread runs, and one that lands inside a Python-level ``__enter__`` after it took its lock
(``threading.Condition``, the ``Semaphore`` a ``ThreadPoolExecutor`` uses) leaves that lock held for good.
CI 2026-12-02: ``bench --tier g3`` stopped by SIGTERM in a baseline point deadlocked there (the main thread joined
the executor's worker, which waited for the semaphore's lock the interrupted ``submit`` kept; stacks from
``tests/helpers/sigterm.py``), and before that (2026-12-01) ran on 120 s after its SIGTERM."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_terminated = threading.Event()  # a SIGTERM came while sigterm_as_interrupt was in force


def raise_if_terminated() -> None:
    """Raise KeyboardInterrupt when a SIGTERM came under :func:`sigterm_as_interrupt`. The commands call it
    between their steps (a bench's rounds, its baseline points and their I/Os, a replay's requests); from a worker
    thread it fails that thread's task, whose caller re-raises it."""
    if _terminated.is_set():
        raise KeyboardInterrupt("SIGTERM")


def sigterm_as_interrupt() -> Callable[[], None]:
    """Until the returned function is called (it restores the previous handler), SIGTERM asks the command to
    stop: :func:`raise_if_terminated` then raises KeyboardInterrupt at the command's next step boundary, so a
    ``finally`` cleans up as after Ctrl-C (module doc: why the handler raises nothing itself). Only in the main
    thread (where signal handlers are set); a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _terminated.clear()

    def on_term(signum: int, _frame: Any) -> None:
        _terminated.set()

    prev = signal.signal(signal.SIGTERM, on_term)

    def restore() -> None:
        signal.signal(signal.SIGTERM, prev)
        _terminated.clear()
    return restore


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """:func:`sigterm_as_interrupt` for the duration of a ``with`` block."""
    restore = sigterm_as_interrupt()
    try:
        yield
    finally:
        restore()
