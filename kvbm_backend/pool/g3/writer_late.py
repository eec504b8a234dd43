"""G3 puts that find the pool's lock busy: handed to one late-put thread, never dropped for it, never waited for.

The pool's lock (:attr:`.catalog.SlotCatalog.lock`) is held by other threads across journal I/O (lock_bounded.py);
on a stalled drive that lasts the stall, and on a busy host a hold can last longer than its I/O (the holder
waits for a CPU or the GIL). A put (an offload: a native ``G3Tier``'s store thread, the connector's save path)
waits for it at most ``put_lock_wait_s``; then its blocks are handed to :class:`LatePuts`, whose thread waits
for the lock and admits them as a put made at that moment (held, in-flight and admission checks, the queue
bound), and the caller returns at once with the put's future pending. Before 2026-12-02 such a put was dropped
(``lock_busy``): load, not a fault, turned into lost offloads (reviewer 2026-12-01 set the bound at 0.5 s; the
landing CI of 2026-12-01 ran on a host busy enough that it mattered for ``no_space`` in the same way).

Bounded like the write-behind queue: blocks handed off and not yet admitted count against
``g3.write_queue_blocks`` with the queued ones; past it a put is dropped ``queue_full`` at once (without the lock).
A key deleted while its put waits here is not written (:meth:`LatePuts.cancel`, called by ``G3Pool.delete`` under
the lock, as :meth:`.writer.G3Writer.cancel` does for queued and in-flight writes): skipped,
``offloads_skipped_deleted``, as a write cancelled in flight is.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Optional

from ...threads import executor

if TYPE_CHECKING:
    from ...model.namespace import BlockKey
    from ..base import BlockBuffer, PutResult
    from .catalog import SlotCatalog

log = logging.getLogger(__name__)

#: admits a put under the pool's lock: ``(keys, blocks, checks, bypass_admission, fut, res) -> queued anything``
Admit = Callable[["list[BlockKey]", "list[BlockBuffer]", "Optional[list[int]]", bool, "Future[PutResult]",
                  "PutResult"], bool]


class _Late:
    __slots__ = ("keys", "blocks", "checks", "bypass", "fut", "res", "cancelled")

    def __init__(self, keys: list[BlockKey], blocks: list[BlockBuffer], checks: list[int] | None, bypass: bool,
                 fut: Future[PutResult], res: PutResult) -> None:
        self.keys, self.blocks, self.checks, self.bypass, self.fut, self.res = keys, blocks, checks, bypass, fut, res
        self.cancelled: set[BlockKey] = set()


class LatePuts:
    """The late-put thread of one G3 writer. ``admit``: the writer's admission under the lock (:data:`Admit`)."""

    def __init__(self, cat: SlotCatalog, admit: Admit) -> None:
        self.cat, self._admit = cat, admit
        self._mu = threading.Lock()
        self._waiting: list[_Late] = []
        self.blocks = 0  # handed off, not yet admitted
        self._ex = executor(1, "kvbm-g3-late-put")

    def hand_off(self, keys: list[BlockKey], blocks: list[BlockBuffer], checks: list[int] | None, bypass: bool,
                 fut: Future[PutResult], res: PutResult, room: int) -> Future[PutResult]:
        """Hand a put off (its caller did not get the lock in time); ``room``: blocks the write-behind queue
        still takes (read without the lock). Returns ``fut``, resolved once the put is admitted and written, or
        at once when the queue bound or a closing pool drops it."""
        late = _Late(keys, blocks, checks, bypass, fut, res)
        with self._mu:
            full = self.blocks + len(keys) > room
            if not full:
                self.blocks += len(keys)
                self._waiting.append(late)
        if full:
            return self._dropped(late, "queue_full")
        with self.cat.side_mu:
            self.cat.side["puts_late"] += 1
        try:
            self._ex.submit(self._run, late)
        except RuntimeError:  # the pool is closing (the thread is shut down)
            self._forget(late)
            return self._dropped(late, "closed")
        return fut

    def cancel(self, key: BlockKey) -> None:
        """``key`` was deleted (caller holds the pool's lock): a put of it still waiting here does not write it."""
        with self._mu:
            for late in self._waiting:
                if key in late.keys:
                    late.cancelled.add(key)

    def keys(self) -> list[BlockKey]:
        """Keys handed off and not yet admitted (nor cancelled)."""
        with self._mu:
            return [k for late in self._waiting for k in late.keys if k not in late.cancelled]

    def close(self) -> None:
        """No more hand-offs; those waiting still run (a closed pool drops them, ``closed``)."""
        self._ex.shutdown(wait=False)

    def _forget(self, late: _Late) -> None:
        with self._mu:
            self._waiting.remove(late)
            self.blocks -= len(late.keys)

    def _dropped(self, late: _Late, reason: str) -> Future[PutResult]:
        n = len(late.keys)
        late.res.dropped += n
        self.cat.drop_unlocked(reason, n)
        late.fut.set_result(late.res)
        return late.fut

    def _run(self, late: _Late) -> None:
        try:
            self._admit_late(late)
        except Exception:  # noqa: BLE001 - a bug must not leave the put's future pending
            log.exception("G3: a late put failed")
            if not late.fut.done():
                self._dropped(late, "error")

    def _admit_late(self, late: _Late) -> None:
        cat = self.cat
        with cat.lock:  # waits out the stall here, not on the caller's thread
            self._forget(late)
            keys, blocks, checks = late.keys, late.blocks, late.checks
            if late.cancelled:
                keep = [i for i, k in enumerate(keys) if k not in late.cancelled]
                gone = len(keys) - len(keep)
                late.res.skipped += gone
                cat.c["offloads_skipped_deleted"] += gone
                keys, blocks = [keys[i] for i in keep], [blocks[i] for i in keep]
                checks = None if checks is None else [checks[i] for i in keep]
            queued = self._admit(keys, blocks, checks, late.bypass, late.fut, late.res)
            cat.cv.notify_all()  # a flush waits for late puts too (G3Writer.flush)
        if not queued:
            late.fut.set_result(late.res)
