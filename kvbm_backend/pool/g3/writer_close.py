"""Closing a :class:`~.writer.G3Writer` within a bound while its storage may hang (a hard-mounted NFS whose
writes or flushes never return): :func:`close_writer` waits at most twice its bound, then resolves every put
still pending (dropped, ``closed``) and marks the rest abandoned, so nothing of it is published later;
:func:`finish_writer` waits (no bound) for the hung I/O, after which the pool may release its slab files and
directory locks (a new pool on the directory must not take slots a late write of this one may still land in)."""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ...deadlines import Deadline
from ..base import PutResult
from .pieces import _Piece, abandon_locked

if TYPE_CHECKING:
    from .writer import G3Writer

log = logging.getLogger(__name__)


def close_writer(w: G3Writer, bound_s: float) -> bool:
    """The pool is closing (``cat.closed`` is set): write what is queued for at most ``bound_s`` seconds (the
    rest is dropped, ``closed``), let pieces being written or synced settle (another ``bound_s`` at most), then
    stop the threads and return True. When writes or flushes still hang then, every put not yet resolved is
    resolved now (its unsettled blocks dropped, ``closed``; none of them is published later) and False is
    returned: the threads run on until the hung I/O returns (:func:`finish_writer`), and the caller must hold
    the slab files and directory locks until then."""
    cat = w.cat
    w._writer.join(timeout=bound_s)
    with cat.lock:
        jobs = list(w._queue)
        w._queue.clear()
    for job in jobs:  # writer did not get to them in time
        w._finish_job_dropped(job, "closed")
    end = Deadline(bound_s)
    late: list[tuple[Future[PutResult], PutResult]] = []
    with cat.cv:  # pieces still being written or synced settle first
        while w._writing and not end.expired():
            cat.cv.wait(end.left())
        settled = not w._writing and not w._writer.is_alive()
        if settled:
            w._stop_sync = True
        else:  # hung writes or flushes: give up on them
            w._abandoned = True
            late = abandon_locked(list(w._batches.values()), cat)
        cat.cv.notify_all()
    if settled:
        w._syncer.join()  # nothing in flight: it exits at once
        return True
    log.warning("G3 close: writes or flushes still hang after %.1f s; %d puts resolved dropped (closed); the slab "
                "files and directory locks are held until the I/O returns", 2 * bound_s, len(late))
    for fut, r in late:
        if not fut.done():
            fut.set_result(r)
    return False


def finish_writer(w: G3Writer) -> None:
    """After :func:`close_writer` returned False: wait (no bound) until the hung writes and flushes returned and
    the writer's threads stopped (what settles meanwhile is released, never published)."""
    w._writer.join()
    with w.cat.cv:
        while w._writing:
            w.cat.cv.wait()
        w._stop_sync = True
        w.cat.cv.notify_all()
    w._syncer.join()


def settle_abandoned_locked(w: G3Writer, pieces: list[_Piece]) -> None:
    """(``w.cat.cv`` held) Pieces of an abandoned close settle: their slots are released, never published (their
    puts were resolved by :func:`close_writer`)."""
    for pc in pieces:
        w.cat.reserved -= len(pc.slots)
        w.cat.release_unpublished(pc.slots)
        pc.batch.left -= 1
        if pc.batch.left == 0:
            w._batch_done_locked(pc.batch)
    w.cat.cv.notify_all()
