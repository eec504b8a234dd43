"""Backoff for throttled store requests (S3 ``503 SlowDown``, 429, ``Throttling``...: :class:`StoreThrottled`).

A throttled request is retried after a *full-jitter* exponential backoff (AWS Architecture Blog,
"Exponential Backoff And Jitter"): before retry ``i`` (0-based) the caller sleeps ``uniform(0,
min(CAP_S, BASE_S * 2**i))`` seconds, so many workers throttled at once spread their retries instead of
coming back together. ``BASE_S`` = 50 ms (a loopback GET of a 2 MiB block takes ~5-20 ms, so the first
retries come back soon: a load waits for them) and ``CAP_S`` = 1 s (a quarter of the default load bound
``g4.timeout_s x (1 + g4.retries)`` = 4 s, so a bound still holds several retries). Retries stop when
the next sleep would end past the bound (the caller's deadline): the request then ends throttled (a
miss ``miss_throttled``, a lookup cut short, an offload ``dropped_throttled``). The sleep runs on the
pool's I/O thread: a throttled pool thus sends fewer requests, which is what the store asked for.
:class:`ThrottleWatch` is the pool's side: counting throttled answers and telling the breaker.
"""
from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

from .breaker import CircuitBreaker
from .store import StoreThrottled

BASE_S = 0.05  # first backoff's upper end, seconds
CAP_S = 1.0  # no backoff longer than this, seconds

T = TypeVar("T")


def backoff_s(attempt: int, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``rand() * min(CAP_S, BASE_S * 2**attempt)``."""
    return rand() * min(CAP_S, BASE_S * 2.0 ** min(attempt, 30))


def call_throttled(fn: Callable[[], T], until: float, on_throttle: Callable[[], None],
                   stop: Callable[[], bool] | None = None) -> T:
    """``fn()``, retried after :func:`backoff_s` while it raises :class:`StoreThrottled`.

    Args:
        until: ``time.monotonic()`` deadline: no sleep ends past it.
        on_throttle: called once per throttled answer (counters, breaker), before the sleep.
        stop: checked before each sleep; True ends the retries (e.g. the batch expired).
    Returns what ``fn`` returns. Raises the last :class:`StoreThrottled` when the next sleep would end past
    ``until`` or ``stop()`` says so; any other exception of ``fn`` at once.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except StoreThrottled:
            on_throttle()
            delay = backoff_s(attempt)
            attempt += 1
            if time.monotonic() + delay >= until or (stop is not None and stop()):
                raise
            time.sleep(delay)


def call_attempts(fn: Callable[[], T], attempts: int) -> T:
    """``fn()`` for batch jobs (gc): :func:`call_throttled` with no deadline but at most ``attempts`` calls
    (the waits between them :func:`backoff_s`: at most ~5 s over 10 attempts); raises the last
    :class:`StoreThrottled` after that many throttled answers."""
    calls = [0]

    def spent() -> bool:
        calls[0] += 1
        return calls[0] >= attempts
    return call_throttled(fn, float("inf"), lambda: None, spent)


class ThrottleWatch:
    """What a G4 pool does with a throttled answer: count it and tell the breaker the store is up, and
    remember when, so batches that expire soon after are counted as throttled, not as a silent store.

    Args:
        breaker: the pool's :class:`~kvbm_backend.pool.g4.breaker.CircuitBreaker`.
        count: the pool's counter (:meth:`~kvbm_backend.pool.g4.events.G4Counters.count`).
        load_bound_s: the pool's load bound, seconds (``timeout_s * (1 + retries)`` plus slack).
    """

    def __init__(self, breaker: CircuitBreaker, count: Callable[[str], None], load_bound_s: float):
        self._breaker = breaker
        self._count = count
        self._load_bound_s = load_bound_s
        self._throttled_at = -float("inf")  # time.monotonic() of the last throttled answer

    def note(self, op: str) -> None:
        """The store answered one ``op`` request (``get``, ``head``, ``put``) with "slow down": count it
        (``throttled_<op>``); the store is answering, so this is a breaker success (it also ends a
        half-open probe, which would otherwise stay out)."""
        self._throttled_at = time.monotonic()
        self._breaker.success()
        self._count(f"throttled_{op}")

    def throttling(self) -> bool:
        """A throttled answer came within the last load bound: batches expiring now waited on "slow down"
        answers (in backoff, or queued behind reads that were), not on a silent store."""
        return time.monotonic() - self._throttled_at < self._load_bound_s
