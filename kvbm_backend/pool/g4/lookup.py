"""G4 prefix lookups (:class:`G4Lookups`, a part of :class:`~kvbm_backend.pool.g4.pool.G4Pool`).

A lookup HEADs its keys in growing parallel waves (8, 16, ... up to ``max_inflight``), stopping at the first
absent key, and resolves within the load bound (``timeout_s * (1 + retries)`` seconds, a
:class:`~kvbm_backend.deadlines.Deadline` on the pool's timer thread): an expired lookup answers the
prefix confirmed so far and counts as one store failure (breaker) when the store is silent (:mod:`.silence`:
HEADs queued behind requests that answer are load, not a fault), unless the store was answering "slow down". Throttled HEADs (:class:`~kvbm_backend.pool.g4.store.StoreThrottled`) are retried after a
full-jitter backoff (:mod:`.throttle`) until the bound: each throttled answer counts ``throttled_head``, a
HEAD still throttled at the bound ends the lookup there (``lookup_throttled``), never a breaker failure. A HEAD
answered with an error (an OSError neither outage nor throttle: 403, a link at the name) finds the key absent and
is logged as the writer's errors are (:meth:`~.events.OperatorLog.store_error`, ``the store refuses requests``);
any other exception (a bug) finds it absent too, logged with its type and traceback (:meth:`~.events.OperatorLog.unexpected`).
Keys of another namespace, or of a revoked tenant (any pool with a keyring, plaintext ones too), or any key while
the keyring file does not load, are absent without store I/O.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Sequence

from ...crypto.keyring import Keyring
from ...deadlines import Deadlines
from ...model.namespace import BlockKey, KeyRun
from ...threads import CountingExecutor
from ..base import InFlight, completed
from .breaker import CircuitBreaker
from .silence import StoreCalls
from .events import G4Counters, OperatorLog
from .reader import tenant_miss
from .store import ObjectStore, StoreThrottled, StoreUnavailable
from .tenant_names import TenantNames
from .throttle import ThrottleWatch, call_throttled

__all__ = ["G4Lookups"]

FIRST_WAVE = 8  # HEADs in a lookup's first wave; each next wave doubles, up to max_inflight


class _Lookup:
    """One lookup: which keys were HEADed and found, guarded so a late reply never resolves it twice."""

    def __init__(self, n: int, until: float):
        self.until = until  # time.monotonic() of the load bound
        self.throttled = False  # a HEAD stayed throttled to the bound
        self.future: Future[int] = Future()
        self.mu = threading.Lock()
        self.closed = False
        self.ok = [False] * n
        self.done = [False] * n
        self.count = 0  # leading keys confirmed
        self.request = True  # a request's prefix lookup: counted in lookups, hits, matched tokens, hit rate


class G4Lookups:
    """The lookup path of a G4 pool (stateless beyond its lookups in flight; everything is handed in).

    Args:
        store: HEADed for each key.
        namespace: the pool's namespace fingerprint (other keys are absent).
        names: object names per tenant.
        keyring: the pool's keyring (revoked tenants are absent; encrypted or not); None for a pool without one.
        breaker, throttle, counters, oplog: the pool's shared collaborators.
        executor: the read threads; deadlines: the pool's timer thread.
        load_bound_s: seconds within which a lookup resolves; max_inflight: the widest wave.
        calls: the pool's :class:`~.silence.StoreCalls` (its HEADs go through it; an expired lookup tells silence).
    """

    def __init__(self, *, store: ObjectStore, namespace: str, names: TenantNames, keyring: Keyring | None,
                 breaker: CircuitBreaker, throttle: ThrottleWatch, counters: G4Counters, oplog: OperatorLog,
                 executor: CountingExecutor, deadlines: Deadlines, load_bound_s: float, max_inflight: int,
                 calls: StoreCalls):
        self.store = store
        self._fp = namespace
        self._names = names
        self._keyring = keyring
        self._breaker = breaker
        self._throttle = throttle
        self._counters = counters
        self._count = counters.count
        self._oplog = oplog
        self._exec = executor
        self._deadlines = deadlines
        self._load_bound_s = load_bound_s
        self._max_inflight = max_inflight
        self._call, self._silent = calls.call, calls.silent
        self._closed = False
        self._open: InFlight[_Lookup] = InFlight()  # lookups not resolved yet (expire_open)

    def close(self) -> None:
        """From now on lookups answer 0 without store I/O."""
        self._closed = True

    def expire_open(self) -> None:
        """Resolve every lookup still open (the pool is closing and its timer thread stops) with the leading
        keys confirmed so far; their HEADs still queued then end without I/O. Without this a lookup queued
        behind busy I/O threads at close never resolved."""
        for b in self._open.snapshot():
            self._expire(b, closing=True)

    def lookup_prefix(self, keys: Sequence[BlockKey], request: bool = True) -> Future[int]:
        """Number of leading ``keys`` present (see :meth:`kvbm_backend.pool.g4.pool.G4Pool.lookup_prefix`)."""
        if type(keys) is not KeyRun:
            keys = list(keys)
        if request:
            self._count("lookups")
        if not keys or self._closed:
            return completed(0)
        if self._breaker.refuse_if_open(self._exec.saturated(), self._silent):  # answered here, never queued
            if request:
                self._counters.lookup_result(len(keys), 0)
            return completed(0)
        b = _Lookup(len(keys), time.monotonic() + self._load_bound_s)
        b.request = request
        self._open.add(b, b.future)
        self._deadlines.add(b.until, lambda: self._expire(b))
        self._wave(b, keys, 0, min(FIRST_WAVE, len(keys)))
        return b.future

    def count_lookup(self, requested: int, found: int) -> None:
        """One request's lookup counted as :meth:`lookup_prefix` with ``request`` True counts it, without I/O."""
        self._count("lookups")
        self._count("lookup_hits", found)
        self._counters.lookup_result(requested, found)

    def _wave(self, b: _Lookup, keys: Sequence[BlockKey], start: int, width: int) -> None:
        end = min(len(keys), start + width)
        wave = {"left": end - start}
        mu = threading.Lock()

        def head_one(i: int) -> None:
            present = False
            try:
                k = keys[i]
                if (k.namespace == self._fp and not b.closed and not self._closed and tenant_miss(self._keyring, k.tenant) is None
                        and self._breaker.allow()):
                    name = self._names.name(k)
                    try:
                        present = call_throttled(lambda: self._call(self.store.head, name), b.until,
                                                 lambda: self._throttle.note("head"), lambda: b.closed) is not None
                        self._breaker.success()
                    except StoreThrottled:
                        b.throttled = True  # absent for this lookup: it ends here
                    except StoreUnavailable as e:
                        self._breaker.failure(e)
                        self._count("lookup_unavailable")
                    except OSError as e:  # an error answer (denied, a link refused): absent, named in the log
                        self._breaker.success()
                        self._oplog.store_error(e, read=True)
            except Exception as e:  # noqa: BLE001 - a lookup never raises: absent, named in the log (a bug)
                present = False
                self._oplog.unexpected(e, "lookup")
            b.ok[i] = present
            b.done[i] = True
            with mu:
                wave["left"] -= 1
                last = wave["left"] == 0
            if last:
                self._wave_done(b, keys, start, end)

        for i in range(start, end):
            try:
                self._exec.submit(head_one, i)
            except RuntimeError:  # the pool closed meanwhile (its I/O threads stopped): the rest are absent
                for j in range(i, end):
                    b.done[j] = True
                with mu:
                    wave["left"] -= end - i
                    last = wave["left"] == 0
                if last:
                    self._wave_done(b, keys, start, end)
                return

    def _wave_done(self, b: _Lookup, keys: Sequence[BlockKey], start: int, end: int) -> None:
        with b.mu:
            if b.closed:
                return
            n = start
            while n < end and b.ok[n]:
                n += 1
            b.count = n
            finished = n < end or end == len(keys)
            if finished:
                b.closed = True
        if finished:
            if b.request:
                self._count("lookup_hits", n)
                self._counters.lookup_result(len(keys), n)
            if b.throttled and n < len(keys):
                self._count("lookup_throttled")
            b.future.set_result(n)
        else:
            self._wave(b, keys, end, min(2 * (end - start), self._max_inflight))

    def _expire(self, b: _Lookup, closing: bool = False) -> None:
        """Resolve ``b`` at its load bound (or, ``closing``, at pool close: no timeout counted)."""
        with b.mu:
            if b.closed:
                return
            b.closed = True
            n = 0
            while n < len(b.ok) and b.done[n] and b.ok[n]:
                n += 1
        if b.request:  # as _wave_done counts (before 2026-12-02 lookup_hits missed an expired lookup's hits)
            self._count("lookup_hits", n)
            self._counters.lookup_result(len(b.ok), n)
        if not closing:  # at close nothing timed out
            if b.throttled or self._throttle.throttling():  # waited on "slow down" answers, not on silence
                self._count("lookup_throttled")
            else:
                self._count("lookup_timeout")
                if self._silent():  # a HEAD unanswered (:mod:`.silence`); one queued behind answering ones: load
                    self._breaker.failure(f"a lookup got no reply within {self._load_bound_s:.2f} s")
        b.future.set_result(n)
