"""Offloads whose PUT the store could not settle at once, settled later (:class:`LateSettler`).

An S3 PUT that got no answer on every attempt is settled by a HEAD (:meth:`~.s3_store.S3Store._settle_put`),
and a retried PUT answered 412 by a HEAD comparing ETags; when that HEAD fails too (an overloaded server:
CI saw SeaweedFS take 8 s to fail a PUT and 13.9 s to fail the HEAD) the store raises
:class:`~.store.PutUnsettled`: the block may well be there. Counting it dropped (or "another writer's
copy") then miscounts blocks the next worker loads, and the connector's tiering path reports a failed
store. So the block stays pending (its :class:`~kvbm_backend.pool.base.PutResult`, ``flush`` and
``pending_put_blocks`` see it in flight; only its name and the MD5 of its bytes are kept, the frame
buffer is returned at once) and is re-checked with :meth:`~.store.ObjectStore.settle` on the offload
threads, after ``first_delay_s`` doubling to at most ``bound_s / 2`` (no thread waits: the pool's
:class:`~kvbm_backend.deadlines.Deadlines` timer queues each check), while the breaker refuses or the HEAD
fails, until ``bound_s`` seconds after it became unsettled. Outcome, exactly one per block:

* the object holds these bytes: ``written`` (and ``settled_late``, ``bytes_written``);
* other bytes: the writer's check of a found object (the ``serves`` callback given to :meth:`LateSettler.start`:
  one ranged GET of its frame header, :meth:`~.writer.G4Writer._serves_existing`): an object this pool serves
  is ``skipped_exists`` (another writer's copy; the block ends skipped, stored); one it will not serve
  (plaintext in an encrypted pool, a revoked or foreign data key, another block's or a damaged header) is
  ``skipped_unservable`` and the block ends ``dropped`` for the caller (not stored), as on the direct path.
  A header GET that fails keeps ``skipped_exists`` (before 2026-11-30 this path never checked);
* absent: ``dropped_unavailable`` (the PUT was lost);
* still unknown past ``bound_s``, or the pool closing: ``dropped_unsettled``.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor
from typing import Callable

from ...deadlines import Deadlines
from .breaker import CircuitBreaker
from .store import ObjectStore, StoreUnavailable

__all__ = ["LateSettler"]


class _Unsettled:
    __slots__ = ("name", "md5_hex", "nbytes", "end", "serves", "give_up_at", "delay_s", "ended")

    def __init__(self, name: str, md5_hex: str, nbytes: int, end: Callable[[str], None],
                 serves: Callable[[], bool] | None, give_up_at: float, delay_s: float):
        self.name, self.md5_hex, self.nbytes, self.end, self.serves = name, md5_hex, nbytes, end, serves
        self.give_up_at, self.delay_s = give_up_at, delay_s
        self.ended = False


class LateSettler:
    """Re-checks offloads left unsettled (see the module doc).

    Args:
        store: the pool's store (its :meth:`~.store.ObjectStore.settle`).
        executor: the offload threads the checks run on.
        deadlines: the pool's timer thread (queues each check when its delay is up).
        breaker: a check goes out only when it allows one; its answer is a success, a StoreUnavailable a failure.
        count: the pool's ``G4Counters.count``.
        first_delay_s: seconds before the first check (> 0), doubled after each failed or refused one.
        bound_s: seconds after which a block still unsettled ends ``dropped_unsettled``.
    """

    def __init__(self, *, store: ObjectStore, executor: Executor, deadlines: Deadlines, breaker: CircuitBreaker,
                 count: Callable[..., None], first_delay_s: float, bound_s: float):
        self._store, self._exec, self._deadlines, self._breaker = store, executor, deadlines, breaker
        self._count = count
        self._first_delay_s, self._bound_s = max(0.01, first_delay_s), bound_s
        self._mu = threading.Lock()
        self._pending: set[_Unsettled] = set()
        self._closed = False

    def pending(self) -> int:
        """Blocks waiting to be settled now."""
        with self._mu:
            return len(self._pending)

    def start(self, name: str, md5_hex: str, nbytes: int, end: Callable[[str], None],
              serves: Callable[[], bool] | None = None) -> None:
        """Settle the block published as ``name`` (``nbytes`` bytes whose MD5 is ``md5_hex``) later;
        ``end(kind)`` (``"written"``, ``"skipped"`` or ``"dropped"``) is called exactly once, after its
        counter is counted, from a timer or offload thread (or from here when already closed).
        ``serves()`` is asked, on an offload thread, once the object is found holding other bytes: True
        (this pool serves it, or cannot tell) ends the block ``skipped_exists`` (kind ``"skipped"``), False
        ``skipped_unservable`` (kind ``"dropped"``: not stored); it should not raise (one that does counts as
        True). None: every such block is ``skipped_exists``."""
        u = _Unsettled(name, md5_hex, nbytes, end, serves, time.monotonic() + self._bound_s, self._first_delay_s)
        self._count("unsettled_puts")  # every outcome below is one of these (dropped_unsettled <= unsettled_puts)
        with self._mu:
            closed = self._closed
            if not closed:
                self._pending.add(u)
        if closed:
            self._finish(u, "dropped_unsettled", force=True)
            return
        self._schedule(u)

    def close(self) -> None:
        """End every block still unsettled as ``dropped_unsettled`` now (a check in flight is ignored
        when it returns); later :meth:`start` calls end so at once. Never waits."""
        with self._mu:
            self._closed = True
            left = list(self._pending)
        for u in left:
            self._finish(u, "dropped_unsettled")

    # ---- internals -----------------------------------------------------------------------
    def _schedule(self, u: _Unsettled) -> None:
        at = time.monotonic() + u.delay_s
        if at >= u.give_up_at:  # the last check runs at the bound, never after it
            at = u.give_up_at
        self._deadlines.add(at, lambda: self._submit(u))

    def _submit(self, u: _Unsettled) -> None:
        try:
            self._exec.submit(self._check, u)
        except RuntimeError:  # the offload threads are gone: the pool is closing
            self._finish(u, "dropped_unsettled")

    def _check(self, u: _Unsettled) -> None:
        if u.ended:  # closed meanwhile
            return
        outcome: bool | None = None
        settled = False
        if self._breaker.allow():
            try:
                outcome = self._store.settle(u.name, u.md5_hex)
                settled = True
                self._breaker.success()
            except StoreUnavailable as e:  # no answer again (a PutUnsettled is one too)
                self._breaker.failure(e)
            except OSError:  # throttled, denied: the store answered, cannot tell yet
                self._breaker.success()
            except Exception:  # noqa: BLE001 - never let a check raise: the block must still end
                self._finish(u, "dropped_error")
                return
        if settled:
            self._finish(u, "written" if outcome else "dropped_unavailable" if outcome is None else
                         "skipped_exists" if self._serves(u) else "skipped_unservable")
        elif time.monotonic() >= u.give_up_at:
            self._finish(u, "dropped_unsettled")
        else:
            u.delay_s = min(2 * u.delay_s, self._bound_s / 2)
            self._schedule(u)

    @staticmethod
    def _serves(u: _Unsettled) -> bool:
        """Whether the pool serves the other bytes found under ``u.name`` (True when it cannot tell)."""
        if u.serves is None:
            return True
        try:
            return bool(u.serves())
        except Exception:  # noqa: BLE001 - unknown: counted as before (skipped_exists)
            return True

    def _finish(self, u: _Unsettled, counter: str, force: bool = False) -> None:
        with self._mu:
            if u.ended or (u not in self._pending and not force):
                return
            u.ended = True
            self._pending.discard(u)
        if counter == "written":
            self._count("written")
            self._count("settled_late")
            self._count("bytes_written", u.nbytes)
        else:
            self._count(counter)
        # an unservable object is no copy of the block: the caller hears dropped (counted skipped_unservable)
        u.end("dropped" if counter == "skipped_unservable" else counter.partition("_")[0])
