"""Signal handling shared by the commands that leave files behind unless their ``finally`` runs (``replay``
in real mode, ``bench``): SIGTERM (what a job runner or ``timeout`` sends) is turned into the
KeyboardInterrupt that SIGINT raises, so the same cleanup runs."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def sigterm_as_interrupt() -> Callable[[], None]:
    """Until the returned function is called (it restores the previous handler), SIGTERM raises
    KeyboardInterrupt, as SIGINT does, so a ``finally`` cleans up (a second SIGTERM is ignored: the
    cleanup runs to its end). Only in the main thread (where signal handlers are set); a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    fired = False

    def on_term(signum: int, _frame: Any) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")

    prev = signal.signal(signal.SIGTERM, on_term)

    def restore() -> None:
        signal.signal(signal.SIGTERM, prev)
    return restore


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """:func:`sigterm_as_interrupt` for the duration of a ``with`` block."""
    restore = sigterm_as_interrupt()
    try:
        yield
    finally:
        restore()
