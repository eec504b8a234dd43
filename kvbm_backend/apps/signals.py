"""Signal handling shared by the commands that leave files behind unless their ``finally`` runs (``replay``
in real mode, ``bench``): SIGTERM (what a job runner or ``timeout`` sends) is turned into the
KeyboardInterrupt that SIGINT raises, so the same cleanup runs."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


_terminated = threading.Event()  # a SIGTERM came while sigterm_as_interrupt was in force


def raise_if_terminated() -> None:
    """Raise KeyboardInterrupt when a SIGTERM came under :func:`sigterm_as_interrupt` and the run still goes on:
    its interrupt was lost. The handler runs in whatever Python code the main thread is in, and an exception
    raised inside a finalizer or a weakref callback (e.g. a ThreadPoolExecutor's, run when one is freed) is
    printed as "Exception ignored in ..." and dropped; the later SIGTERMs are ignored by design, so the command
    would run to its end. Loops call this between their steps (a bench's rounds and baseline points)."""
    if _terminated.is_set():
        raise KeyboardInterrupt("SIGTERM (its first interrupt was lost)")


def sigterm_as_interrupt() -> Callable[[], None]:
    """Until the returned function is called (it restores the previous handler), SIGTERM raises
    KeyboardInterrupt, as SIGINT does, so a ``finally`` cleans up (a second SIGTERM is ignored: the
    cleanup runs to its end). Only in the main thread (where signal handlers are set); a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    fired = False
    _terminated.clear()

    def on_term(signum: int, _frame: Any) -> None:
        nonlocal fired
        _terminated.set()
        if not fired:
            fired = True
            raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")

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
