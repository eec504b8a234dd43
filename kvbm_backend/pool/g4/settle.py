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
* other bytes: the writer's check of a found object (the ``found`` callback given to :meth:`LateSettler.start`:
  one ranged GET of its frame header, :meth:`~.writer.G4Writer._settle_found`): an object this pool serves
  is ``skipped_exists`` (another writer's copy; the block ends skipped, stored); one it will not serve
  (plaintext in an encrypted pool, a revoked or foreign data key, another block's or a damaged header) is
  ``skipped_unservable`` and the block ends ``dropped`` for the caller (not stored), as on the direct path.
  A header GET that fails keeps ``skipped_exists`` (before 2026-11-30 this path never checked). An object gone
  by that GET (deleted since: gc, a load dropping a bad copy) is no copy: the writer seals the block again from
  the caller's buffer (the pool reads it until the put's future resolves) and publishes it create-exclusive as a
  direct offload (up to 3 PUTs): ``written``, or dropped for the reason that PUT met (``dropped_error`` when each
  met a copy gone by its check); a new PUT the store cannot settle either is settled here in turn (its MD5),
  within the same ``bound_s``. Before 2026-12-03 that block counted ``skipped_exists``, stored with nothing there.
  The writer reads the caller's buffer only while the settler holds the block (:meth:`LateSettler._hold`): not
  after it ended, nor past ``bound_s``; :meth:`LateSettler.close` waits for such a read before it ends the block
  (before 2026-12-03 it resolved the put's future under the read: the caller reused its buffer and the writer
  published those bytes, validly sealed, under the block's name: wrong KV served). The republish starts only while
  the breaker allows it (else ``dropped_breaker``: nothing sent), and each of its PUTs only while one PUT's bound
  (the writer's ``put_bound_s``, ``bound_s / 4``) is left of ``bound_s`` and, but the first, while the pool is open
  (else ``dropped_unsettled``, nothing stored): before 2026-12-04 its PUTs ran past the bound, went out with the
  breaker open, and a close waited for all of them;
* absent: ``dropped_unavailable`` (the PUT was lost);
* still unknown past ``bound_s``, or the pool closing: ``dropped_unsettled``.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator

from ...deadlines import Deadlines
from .breaker import CircuitBreaker
from .store import ObjectStore, PutUnsettled, StoreUnavailable

__all__ = ["LateSettler"]

Hold = Callable[[], AbstractContextManager[float | None]]  # the block's bound (time.monotonic()) or None
Found = Callable[[Hold], str]


class _Unsettled:
    __slots__ = ("name", "md5_hex", "nbytes", "end", "found", "give_up_at", "delay_s", "ended", "reading")

    def __init__(self, name: str, md5_hex: str, nbytes: int, end: Callable[[str], None],
                 found: Found | None, give_up_at: float, delay_s: float):
        self.name, self.md5_hex, self.nbytes, self.end, self.found = name, md5_hex, nbytes, end, found
        self.give_up_at, self.delay_s = give_up_at, delay_s
        self.ended = self.reading = False  # reading: held by the writer (_hold; close waits for it)


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
        self._cv = threading.Condition(self._mu)  # a read of a caller's buffer ended (close waits for them)
        self._pending: set[_Unsettled] = set()
        self._closed = False

    def pending(self) -> int:
        """Blocks waiting to be settled now."""
        with self._mu:
            return len(self._pending)

    def start(self, name: str, md5_hex: str, nbytes: int, end: Callable[[str], None],
              found: Found | None = None) -> None:
        """Settle the block published as ``name`` (``nbytes`` bytes whose MD5 is ``md5_hex``) later;
        ``end(kind)`` (``"written"``, ``"skipped"`` or ``"dropped"``) is called exactly once, after its
        counter is counted, from a timer or offload thread (or from here when already closed).
        ``found(hold)`` is asked, on an offload thread, once the object is found holding other bytes, and returns the
        counter the block ends with: ``"skipped_exists"`` (kind ``"skipped"``), ``"skipped_unservable"`` (kind
        ``"dropped"``: not stored), ``"written"`` (the object was gone and the block is published again; counted
        ``written`` and ``bytes_written``, not ``settled_late``) or a ``"dropped_<reason>"``. It raises
        :class:`~.store.PutUnsettled` when that new PUT cannot be settled either: the block is then settled by
        the error's name and MD5, within the same bound. Any other exception (a bug) ends it ``dropped_error``,
        never stored. None: every such block is ``skipped_exists``. ``found`` reads the caller's buffer only inside
        ``with hold() as until:`` and only when ``until`` is not None: the block's bound (a ``time.monotonic()``),
        which its PUTs keep to; None (the block ended: the pool closed; or ``bound_s`` passed) means it must not, and
        returns ``"dropped_unsettled"``."""
        u = _Unsettled(name, md5_hex, nbytes, end, found, time.monotonic() + self._bound_s, self._first_delay_s)
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
        when it returns); later :meth:`start` calls end so at once. Waits only for a block the writer holds
        (:meth:`_hold`: re-sealing its caller's buffer, whose future must not resolve under the read, and publishing
        it again) until its outcome is recorded, at most until that block's bound; one still held then ends when its
        check returns. The writer starts no further PUT of a held block once closed, so this waits at most for the
        PUT in flight (its answer says whether the block is stored) and the check of a copy it met, whatever the
        pool's close timeout."""
        with self._mu:
            self._closed = True
            while (wait_s := max((u.give_up_at for u in self._pending if u.reading), default=0.0)
                   - time.monotonic()) > 0:
                self._cv.wait(wait_s)
            left = [u for u in self._pending if not u.reading]
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
        if settled and outcome is False:  # other bytes: the writer judges them (or publishes again: gone)
            self._found(u)
        elif settled:
            self._finish(u, "written" if outcome else "dropped_unavailable")
        elif time.monotonic() >= u.give_up_at:
            self._finish(u, "dropped_unsettled")
        else:
            self._again(u)

    def _again(self, u: _Unsettled) -> None:
        u.delay_s = min(2 * u.delay_s, self._bound_s / 2)
        self._schedule(u)

    @contextmanager
    def _hold(self, u: _Unsettled) -> Iterator[float | None]:
        """While held (yields ``u``'s bound), :meth:`close` does not end ``u``: the writer may read its caller's buffer
        and publish it again, within that bound. None: ``u`` ended (or the settler closed), or its bound passed: the
        buffer must not be read. The hold lasts until :meth:`_found` has recorded ``u``'s outcome (not only until the
        writer leaves it: before 2026-12-03's fix a close waking between the two ended a block its PUT had stored
        ``dropped_unsettled``)."""
        with self._mu:
            u.reading = live = not (u.ended or self._closed) and time.monotonic() < u.give_up_at
        yield u.give_up_at if live else None

    def _found(self, u: _Unsettled) -> None:
        """Other bytes under ``u.name``: end the block with the counter ``u.found()`` answers (see :meth:`start`);
        a new PUT of it that is unsettled too is settled in turn (past the bound: ``dropped_unsettled``)."""
        if u.found is None:
            self._finish(u, "skipped_exists")
            return
        try:
            try:
                counter = u.found(lambda: self._hold(u))
            except PutUnsettled as e:  # published again (the object was gone), and that PUT's answer was lost too
                u.name, u.md5_hex = e.name, e.md5_hex
                if self._closed or time.monotonic() >= u.give_up_at:
                    self._finish(u, "dropped_unsettled")
                else:
                    self._again(u)
                return
            except Exception:  # noqa: BLE001 - a bug (the writer's check answers every store error): not stored
                counter = "dropped_error"
            self._finish(u, counter, late=False)
        finally:  # the hold (:meth:`_hold`) ends once the outcome is recorded: close() waits for it
            with self._mu:
                u.reading = False
                self._cv.notify_all()

    def _finish(self, u: _Unsettled, counter: str, force: bool = False, late: bool = True) -> None:
        with self._mu:
            if u.ended or (u not in self._pending and not force):
                return
            u.ended = True
            self._pending.discard(u)
        if counter == "written":
            self._count("written")
            if late:  # found landed by a settle (not published again after the object found there was gone)
                self._count("settled_late")
            self._count("bytes_written", u.nbytes)
        else:
            self._count(counter)
        # an unservable object is no copy of the block: the caller hears dropped (counted skipped_unservable)
        u.end("dropped" if counter == "skipped_unservable" else counter.partition("_")[0])
