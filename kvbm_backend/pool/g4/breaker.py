"""Circuit breaker: stop sending to a store that keeps failing, probe it now and then, recover alone.

States: ``closed`` (all requests pass), ``open`` after ``failures`` consecutive failures (every request
is refused at once for ``reset_s`` seconds: the caller turns it into a miss or a dropped offload),
``half_open`` (one probe request passes; success closes, a failure re-opens for another ``reset_s``: the
probe's, or any other, such as a load batch that expired queued behind I/O threads stuck on a hung mount and
so never probed).
A probe that never reports (its caller ended without asking the store: a revoked tenant's offload, a bug)
is handed back with :meth:`release`, and in any case lapses after ``reset_s``: another request then probes
(before 2026-11-30 such a probe kept the breaker half-open for good, every load a miss until a restart).
Thread-safe.

Operator logs (when ``name`` is given; ``kvbm_backend.pool.g4.breaker`` logger), one line per state change,
never one per request: a WARNING when it opens (what failed last, how long it stays open, the config
fields), an INFO when it closes again (how long it was open, requests refused meanwhile). While the
store stays down, failed probes repeat the WARNING at most every ``remind_s`` seconds.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ...store_url import redact_urls

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Args:
        failures, reset_s: see the module doc (``g4.breaker_failures``, ``g4.breaker_reset_s``).
        name: what the breaker guards, for its log lines (e.g. ``G4 s3://bucket/prefix``); None: no logs.
        on_change: called with ``"open"`` / ``"closed"`` after each change (outside the lock).
        remind_s: least seconds between repeated "still unavailable" warnings.
    """

    def __init__(self, failures: int = 5, reset_s: float = 5.0, clock: Callable[[], float] = time.monotonic, *, name: str | None = None,
                 on_change: Callable[[str], None] | None = None, remind_s: float = 300.0):
        if failures < 1 or reset_s <= 0:
            raise ValueError(f"breaker: failures >= 1 and reset_s > 0 required, got {failures}, {reset_s}")
        self.failures, self.reset_s, self._clock = failures, reset_s, clock
        self.name, self._on_change, self.remind_s = name, on_change, remind_s
        self._mu = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None
        self._first_opened: float | None = None  # start of the current outage
        self._last_log = 0.0
        self._rejected_at_open = 0
        self._probe_out = False
        self._probe_at = 0.0  # when the probe went out (it lapses after reset_s)
        self._answered = False  # some request succeeded: the store was up after start
        self.opens = 0  # times it opened
        self.rejected = 0  # requests refused while open

    @property
    def state(self) -> str:
        with self._mu:
            return self._state()

    def _state(self) -> str:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.reset_s:
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """True if a request may go out now (counts a rejection otherwise)."""
        if self._opened_at is None:  # closed: no lock (every block load and offload asks; with many I/O
            return True  # threads a shared lock per request queues them; racing an opening is as if earlier)
        with self._mu:
            st = self._state()
            if st == "closed":
                return True
            if st == "half_open" and (not self._probe_out or self._clock() - self._probe_at >= self.reset_s):
                self._probe_out, self._probe_at = True, self._clock()
                return True
            self.rejected += 1
            return False

    def release(self) -> None:
        """A request :meth:`allow` let through ended without an answer from the store (nothing was sent):
        if it was the half-open probe, the next request probes. No-op while closed."""
        if self._opened_at is None:
            return
        with self._mu:
            self._probe_out = False

    def refuse_if_open(self, busy: bool = False, silent: Callable[[], bool] | None = None) -> bool:
        """True (counting a rejection) while ``open``, and while half-open when ``busy`` (the caller's I/O
        threads all have a task: work queued now would wait behind them); False otherwise, so a caller can
        refuse at once, before queueing work, and still let :meth:`allow` pick the half-open probe.

        ``busy`` bounds what queues behind I/O threads stuck in the kernel (a hung hard mount: reads neither
        return nor raise). Before 2026-12-02 every call of a half-open window passed: each queued its tasks
        behind the stuck threads, holding its caller's buffers, until the window's first batch expired and
        re-opened the breaker, so over a long hang the queue and the memory it held grew without bound (a get
        every 10 ms on a hung store with 2 I/O threads: 658 tasks, 82 MiB of caller buffers in 8 s). Now a
        half-open window queues work only while a thread is free for it; when ``silent()`` says the busy threads'
        requests still have no reply (:meth:`~.silence.StoreCalls.silent`), that refusal re-opens the breaker, as
        the expiry of a batch queued behind them did (else an offload could take the probe and wait on the
        store)."""
        with self._mu:
            st = self._state()
            if st == "open" or (busy and st == "half_open"):
                self.rejected += 1
                reopen = st == "half_open" and silent is not None
            else:
                return False
        if reopen and silent is not None and silent():
            self.failure("every I/O thread still waits for the store's reply")
        return True

    def success(self) -> None:
        """One request answered: resets the failure count, closes an open breaker."""
        if self._opened_at is None and self._consecutive == 0 and self._answered:
            return  # closed and nothing to reset: no lock (as in allow)
        with self._mu:
            was_open = self._opened_at is not None
            down_s = 0.0 if self._first_opened is None else self._clock() - self._first_opened
            refused = self.rejected - self._rejected_at_open
            self._consecutive = 0
            self._opened_at = self._first_opened = None
            self._probe_out = False
            self._answered = True
        if was_open:
            if self.name:
                log.info("%s: store answering again, circuit breaker closed after %.1f s open (%d requests "
                         "refused meanwhile as misses / dropped offloads)", self.name, down_s, refused)
            if self._on_change:
                self._on_change("closed")

    def failure(self, err: object = None) -> None:
        """One failed (or expired) request; ``err`` (exception or text) is what the log line names."""
        self._fail(err, force=False)

    def trip(self, err: object = None) -> None:
        """Open now, whatever the count (a start-up probe found the store unavailable). When a request
        has already succeeded, the store was up after start (the start-up check runs in the background,
        beside the first requests, and can fail later than they succeed): an ordinary :meth:`failure`."""
        self._fail(err, force=True)

    def _fail(self, err: object, force: bool) -> None:
        opened = remind = False
        with self._mu:
            now = self._clock()
            force = force and not self._answered
            self._consecutive += 1
            # half-open: any failure re-opens, the probe's or not (a batch that expired behind stuck I/O
            # threads never reached allow(), so no probe was out: before 2026-11-30 it left the breaker
            # half-open for good, every later load queued behind those threads for its whole load bound)
            half_open = self._opened_at is not None and now - self._opened_at >= self.reset_s
            if force or self._probe_out or half_open or (self._opened_at is None
                                                          and self._consecutive >= self.failures):
                if self._opened_at is None:
                    self.opens += 1
                    opened = True
                    self._first_opened = self._last_log = now
                    self._rejected_at_open = self.rejected
                elif now - self._last_log >= self.remind_s:
                    remind = True
                    self._last_log = now
                self._opened_at = now
            self._probe_out = False
            consecutive, refused = self._consecutive, self.rejected - self._rejected_at_open
            down_s = 0.0 if self._first_opened is None else now - self._first_opened
        if opened:
            if self.name:
                why = "unavailable at start" if force else f"{consecutive} consecutive failures"
                log.warning("%s: store unavailable, circuit breaker OPEN (%s; last: %s): loads are misses and "
                            "offloads are dropped at once, one probe request every %.1f s "
                            "(g4.breaker_failures=%d, g4.breaker_reset_s=%g)", self.name, why, _describe(err),
                            self.reset_s, self.failures, self.reset_s)
            if self._on_change:
                self._on_change("open")
        elif remind and self.name:
            log.warning("%s: store still unavailable after %.0f s (last: %s); %d requests refused so far",
                        self.name, down_s, _describe(err), refused)


def _describe(err: object) -> str:
    """``err`` for a log line, every URL in it redacted (a client's error text names the request's URL: with
    ``g4.endpoint_url`` ``http://USER:SECRET@host`` the secret was logged in the OPEN warning until 2026-12-02)."""
    if err is None:
        return "no detail"
    if isinstance(err, BaseException):
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    else:
        text = str(err)
    return redact_urls(text)
