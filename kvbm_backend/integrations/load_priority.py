"""While a load is in flight, the interpreter hands the GIL to the loading threads sooner
(``load_gil_switch_ms``, a top-level config field; default 0.5 ms).

Why: the connector's loads run on I/O threads inside the engine's process, beside its step loop
(scheduler, input preparation, kernel launches, sampling: Python holding the GIL). Each read, decrypt
and checksum call releases the GIL; getting it back from a thread that runs Python takes up to
``sys.getswitchinterval()`` (CPython's default: 5 ms) per call, several calls per block. Measured on the
2-core dev VM (``benchmarks/results/engine_busy-cpu-2026-11-26.json``), beside a thread running Python all
the time (:class:`~kvbm_backend.apps.bench.busy_engine.BusyEngine`): the connector's G3 loads through the
worker went from 2.19 GB/s alone to 0.13 GB/s at 5 ms and 0.93 GB/s at 0.5 ms
(``benchmarks/gpu_bench.py --smoke-cpu --engine-busy 1.0``); staged G4 encrypted loads, 4 I/O threads, from
4.8 GB/s alone to 0.77 at 5 ms and 3.21 at 0.5 ms, and with the engine busy half of each step from 7.0 to
2.87 and 4.04 GB/s (``python -m kvbm_backend.apps.bench.g4_load --engine-busy F --switch-ms 5,1,0.5``). A
starved load holds the request waiting for it (its TTFT) and, past its bound, turns into misses that are
recomputed.

The cost goes to the engine, only while loads are in flight: its step loop hands the GIL over at most
once per interval to a loading thread's short Python bits (there, its median step barely moved and its p99
rose, 29 -> 51 ms in the G3 case, on 2 cores that the loads' threads also share). The interval is shortened when the first load
starts and restored when the last one ends (loads of every pool and integration of the process count
together); it is only ever shortened (an engine that set a shorter one keeps it), and an interval someone
else changed during the loads is left as they set it. ``load_gil_switch_ms: null`` never touches it.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

_mu = threading.Lock()
_target_s: float | None = None  # seconds while loads run; None: leave the interpreter's interval alone
_active = 0  # loads in flight (hold() without release())
_saved: float | None = None  # the interval before the first load shortened it
_applied: float | None = None  # the interval the first load set (what release() expects to find)
_held = 0  # loads that ran with the interval shortened (stats)


def configure(ms: float | None) -> None:
    """Use ``ms`` milliseconds (> 0) as the switch interval while loads run from now on (None: never
    change it). Called when tiers open (:func:`kvbm_backend.integrations.tiers.announce_tiers`) with the
    config's ``load_gil_switch_ms``. Raises ValueError for ``ms`` <= 0."""
    global _target_s
    if ms is not None and ms <= 0:
        raise ValueError(f"load_gil_switch_ms: must be > 0 or null, got {ms}")
    with _mu:
        _target_s = None if ms is None else ms / 1e3


def hold() -> None:
    """A load starts: shorten the interval if this is the first load in flight. Pair with :func:`release`."""
    global _active, _saved, _applied, _held
    with _mu:
        _active += 1
        if _active == 1 and _target_s is not None:
            now = sys.getswitchinterval()
            if _target_s < now:
                _saved = now
                sys.setswitchinterval(_target_s)
                _applied = sys.getswitchinterval()  # as the interpreter stores it
        if _saved is not None:
            _held += 1


def release() -> None:
    """A load ended: restore the interval when it was the last one in flight (unless it was changed
    meanwhile by someone else). A release without a hold raises RuntimeError."""
    global _active, _saved, _applied
    with _mu:
        if _active == 0:
            raise RuntimeError("load_priority.release() without hold()")
        _active -= 1
        if _active == 0 and _saved is not None:
            if sys.getswitchinterval() == _applied:  # a configure() meanwhile does not strand it shortened
                sys.setswitchinterval(_saved)
            _saved = _applied = None


@contextmanager
def loading() -> Iterator[None]:
    """``with loading():`` around a load run on one thread (:func:`hold` ... :func:`release`)."""
    hold()
    try:
        yield
    finally:
        release()


def stats() -> dict:
    """``load_gil_switch_ms`` (configured; None: off), ``loads_in_flight``, ``loads_prioritized`` (loads
    that ran with the interval shortened) and ``switch_interval_ms`` (the interpreter's now)."""
    with _mu:
        return {"load_gil_switch_ms": None if _target_s is None else _target_s * 1e3, "loads_in_flight": _active,
                "loads_prioritized": _held, "switch_interval_ms": sys.getswitchinterval() * 1e3}
