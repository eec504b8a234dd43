"""When the connector cannot start inside a vLLM engine process: release what it took, and make sure the
process exits when the engine stops it.

Why (issue 22 item 3, vLLM 0.32, ``vllm serve`` and Dynamo's vLLM worker alike): the worker reports the
constructor's exception to the engine core, which gives up and, leaving, terminates its worker process
(multiprocessing's exit: SIGTERM, then join). vLLM's worker turns the first SIGTERM into ``SystemExit``,
once only. When the signal lands while the worker's main thread runs a weakref callback (the failed
start's objects being freed: ``WeakSet._remove`` of ``threading._dangling`` for a closed pool's
threads), Python prints ``Exception ignored in ... SystemExit`` and drops it. Seen: the worker then idles
in its busy loop for good, the engine core waits on it for good, and the API server waits for the
engine's start for good (alive minutes later, port never bound, its first SIGTERM without effect).

So, on a failed start (:func:`started_or_exit`): the pools already opened are released and the garbage
collected before the exception leaves the constructor (less of ours is freed under vLLM's signal later;
seen: not enough on its own, the SystemExit was still dropped once), and the process's SIGTERM/SIGINT
handler is wrapped: it still runs the previous handler, but first starts a daemon thread that ends the
process (``os._exit(1)``) :data:`GRACE_S` seconds later if it is still alive. That makes the exit
certain; a process that exits normally is gone before then. Nothing changes for a connector that starts.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator
from ...threads import start_thread

log = logging.getLogger("kvbm_backend.connector")

GRACE_S = 5.0
"""Seconds a process whose connector failed to start may take to exit after SIGTERM/SIGINT before it is
ended with ``os._exit(1)``."""

_armed = False


def _exit_later(grace_s: float) -> None:
    time.sleep(grace_s)
    log.error("kvbm_backend: the connector failed to start and this process was asked to stop %.0f s ago; "
              "exiting now", grace_s)
    for h in logging.getLogger().handlers + log.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(1)


def arm_exit_on_stop(grace_s: float = GRACE_S) -> bool:
    """Wrap this process's SIGTERM and SIGINT handlers (once per process) so that a stop request ends the
    process within ``grace_s`` seconds even when the previous handler's ``SystemExit`` is lost. Returns
    False (nothing done) off the main thread, where handlers cannot be set."""
    global _armed
    if _armed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)

        def handler(signum, frame, prev=prev):
            start_thread(_exit_later, args=(grace_s,), name="kvbm-exit-on-stop")
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                raise SystemExit(128 + signum)

        signal.signal(sig, handler)
    _armed = True
    return True


@contextmanager
def started_or_exit(release: Callable[[], None]) -> Iterator[None]:
    """Run a connector's start-up; on any exception, call ``release`` (close what was opened; its own
    errors are logged, never raised), collect garbage, :func:`arm_exit_on_stop`, and re-raise."""
    try:
        yield
    except BaseException:
        try:
            release()
        except Exception:  # noqa: BLE001 - the start-up error is the one to report
            log.exception("kvbm_backend: releasing a failed start")
        gc.collect()
        arm_exit_on_stop()
        raise


def release_partial(connector) -> None:
    """Release what a :class:`~kvbm_backend.integrations.vllm.connector.KvbmBackendConnector` whose start
    failed had taken: the report listener, the stats writer, the shared tiers of each group opened."""
    from ..tiers import release_tiers
    if getattr(connector, "_listener", None) is not None:
        connector._listener.close()
    if getattr(connector, "_writer", None) is not None:
        connector._writer.stop()
    if getattr(connector, "revoked", None) is not None:
        connector.revoked.close()
    for gns, gcfg, _, _ in getattr(connector, "_groups", []):
        release_tiers(gcfg, gns)
    connector._groups = []
