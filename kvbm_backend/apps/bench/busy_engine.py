"""A stand-in for an inference engine's step loop in the loading process, for load benchmarks.

A vLLM worker runs its step loop (scheduler, input preparation, kernel launches, sampling: Python that
holds the GIL) in the same process as the connector's I/O threads, and loads run while it steps. A
benchmark that loads from an otherwise idle process hides what that costs the loads (each I/O thread
needs the GIL back after every read, decrypt or checksum call; CPython hands it over after at most
``sys.getswitchinterval()`` seconds, 5 ms by default) and what the loads cost the engine (longer steps).

:class:`BusyEngine` is such a loop: each step runs a fixed amount of pure-Python work (calibrated to take
``busy_fraction * step_ms`` alone) and then waits the rest of ``step_ms`` with the GIL released (as an
engine waiting on the GPU). It records each step's duration, so a benchmark reports both sides: load
GB/s with the engine stepping, and the engine's step time while loads ran (``step_ms_p50`` /
``step_ms_p99`` against ``step_ms_alone``).
"""
from __future__ import annotations

import statistics
import threading
import time


def _work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i & 7
    return x


class BusyEngine:
    """A thread stepping like an engine: ``busy_fraction`` of each ``step_ms`` (milliseconds) running
    Python, the rest waiting with the GIL released. Use as a context manager around the loads measured.

    Args:
        busy_fraction: share of a step spent holding the GIL, when alone (0 < f <= 1).
        step_ms: nominal step length in milliseconds (> 0).
    Raises:
        ValueError: either argument out of range.
    """

    def __init__(self, busy_fraction: float = 1.0, step_ms: float = 10.0) -> None:
        if not 0 < busy_fraction <= 1 or step_ms <= 0:
            raise ValueError(f"BusyEngine: busy_fraction must be in (0, 1] and step_ms > 0, got "
                             f"{busy_fraction}, {step_ms}")
        self.busy_fraction, self.step_ms = busy_fraction, step_ms
        self._n = self._calibrate(busy_fraction * step_ms / 1e3)
        self.step_ms_alone = self._steps(5)
        self._stop = threading.Event()
        self._durations: list[float] = []
        self._thread: threading.Thread | None = None

    @staticmethod
    def _calibrate(busy_s: float) -> int:
        """Iterations of :func:`_work` that take ``busy_s`` seconds here (best of a few tries)."""
        n = 10_000
        while _timed(n) < 0.02:
            n *= 2
        best = min(_timed(n) for _ in range(3))
        return max(1, int(n * busy_s / best))

    def _step(self) -> float:
        t0 = time.perf_counter()
        _work(self._n)
        idle = self.step_ms / 1e3 * (1 - self.busy_fraction)
        if idle > 0:
            time.sleep(idle)
        return time.perf_counter() - t0

    def _steps(self, k: int) -> float:
        """Median step of ``k`` steps alone, milliseconds."""
        return statistics.median(self._step() for _ in range(k)) * 1e3

    def _run(self) -> None:
        while not self._stop.is_set():
            self._durations.append(self._step())

    def __enter__(self) -> "BusyEngine":
        self._durations.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="busy-engine", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self) -> dict:
        """The engine's side: ``busy_fraction``, ``step_ms`` (nominal), ``step_ms_alone`` (median step with
        nothing loading), ``steps``, ``step_ms_p50`` / ``step_ms_p99`` while the loads ran (None before
        any step finished)."""
        d = sorted(self._durations)
        pick = (lambda q: round(d[min(len(d) - 1, int(q * len(d)))] * 1e3, 3)) if d else (lambda q: None)
        return {"busy_fraction": self.busy_fraction, "step_ms": self.step_ms,
                "step_ms_alone": round(self.step_ms_alone, 3), "steps": len(d),
                "step_ms_p50": pick(0.5), "step_ms_p99": pick(0.99)}


def _timed(n: int) -> float:
    t0 = time.perf_counter()
    _work(n)
    return time.perf_counter() - t0
