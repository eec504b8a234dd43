"""Journaling slots empty: the vacancy records of slots whose header the G3 pool zeroed without a DEL of their key.

:meth:`.catalog.SlotCatalog.clear_headers` zeroes the header of a slot a block left without a record of its own
(evicted for a batch whose write or journal append then failed, evicted and not reused, a write cancelled by a
delete) and calls :func:`journal_vacant`, so that replay finds the slot empty (:func:`.journal_gen.encode_vacant`)
rather than the evicted block's stale PUT, which met the zeroed header at the next open and was counted lost
(``restore_dropped``, reason ``magic``).

While a rewrite of the journal from the index is due (the journal marked for repair after a failed append or
rewrite, no repair compaction under way yet; or a journal that takes no appends: broken, or not open), the
records go straight to the journal, best effort, not through :meth:`~.catalog.SlotCatalog.journal_append`:
that would start the repair (for a broken journal: write it under the pool's lock) from call sites that only
release slots, right after a failed append among them, so it would retry at once what just failed. The repair
needs none of them (a rewrite from the index names none of these slots), but it runs only at the next append or
at close. Before 2026-12-03 nothing was journaled in that window: a worker killed before the repair restarted
with the evicted blocks' PUTs as the journal's last word on zeroed slots, each counted in ``restore_dropped``
(``magic``), 8 for a full pool's failed put of 8 (tests/pool/g3/test_g3_vacancy_while_dirty.py). A journal
that takes no appends gets none (logged): the rewrite it needs before any append comes first. A newer block's PUT
is never cancelled: the records are appended while the pool's lock is held and before the slots are released, so
any later PUT of those slots follows them.

A journal that takes no appends stays so until its rewrite works (a full or failing drive: every put, every
emptied slot meets it again), and a drive gone fails every header write. Their WARNINGs are one per kind and pool
(journal path) per minute (:data:`LOG`, :mod:`kvbm_backend.log_limits`; the next line says how many were left out),
their counters count every slot: ``vacancies_unjournaled`` (:func:`unjournaled`, here, for a withdrawn round,
:mod:`.journal_sync`, and for the DEL records of removed blocks, :func:`journal_dels`), ``header_clear_errors``
(:func:`header_not_cleared`). Before 2026-12-03 each was a WARNING per put or per slot (30 one-block puts to a
broken journal: 30 lines) and neither was counted.

The tier's degradation by a failed journal append, rewrite or barrier repair ("tier degraded", :func:`journal_degraded`)
is limited the same way: while the journal stays broken each put after the window (``degrade_s``, 5 s) degrades it
again. ``degradations`` counts every one (:meth:`~.catalog.SlotCatalog.degrade`, slab ENOSPC too). Until late
2026-12-03 that was a WARNING per degradation: one per pool every 5 s (720 an hour), one per put with degrade_s 0.
"""
from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Sequence

from ...log_limits import LimitedLog
from . import journal_gen

if TYPE_CHECKING:
    from .catalog import SlotCatalog

log = logging.getLogger(__name__)
#: this module's per-slot / per-put WARNINGs: one per kind and pool per minute (the counters count every one)
LOG = LimitedLog(log)


def journal_vacant(cat: SlotCatalog, slots: Sequence[tuple[int, int]]) -> None:
    """(Pool lock held, before ``slots`` are released) Journal ``slots`` ((file index, slot index) pairs) empty.
    Through :meth:`~.catalog.SlotCatalog.journal_append` when no repair is due (a failure there degrades the tier
    and marks the journal for repair, as for any append); else straight to the journal, best effort: a failure
    (EBADF: broken or not open; EIO, ENOSPC) is logged, the journal left as :meth:`~.journal.Journal.append`
    leaves it (cut back, or broken), and the tier not degraded again (the repair due names none of these slots).
    Either failure is counted and logged by :func:`unjournaled` (before 2026-12-03 one through ``journal_append``
    was not: ``vacancies_unjournaled`` missed its slots). Nothing when ``slots`` is empty or the pool closed.
    Never raises."""
    if not slots or not cat.slabs.dirs:
        return
    j = cat.journal
    recs = journal_gen.encode_vacant(slots)
    if not (j.broken or j.fd is None or (cat.journal_dirty and getattr(j.compaction, "gen", None) != cat.dirty_gen)):
        if not cat.journal_append(recs):  # failed (journal_errors, tier degraded): these slots are unjournaled too
            unjournaled(cat, len(slots), cat.journal_error or OSError("journal append failed"), "emptied")
        return
    try:
        j.append(recs)
    except OSError as e:
        unjournaled(cat, len(slots), e, "emptied")


def journal_dels(cat: SlotCatalog, recs: list[bytes]) -> bool:
    """(Pool lock held, the blocks already out of the index) Journal ``recs``, the DEL records of blocks removed
    (deleted, a revoked tenant's purged, proven corrupt or unreadable: each slot emptied), through
    :meth:`~.catalog.SlotCatalog.journal_append` (a failure there degrades the tier and marks the journal for
    repair). Records it did not take (that failure, or the pool closed) are counted and logged by
    :func:`unjournaled` (``"deleted"``, one slot per record): a restart before the repair replays the blocks' PUTs,
    each dropped on its zeroed header (``restore_dropped``, ``magic``), or, a header not zeroed
    (``header_clear_errors``), indexed again and verified like any. Before 2026-12-03 none was counted. Returns
    whether the journal took them. Never raises."""
    if cat.journal_append(recs):
        return True
    e = cat.journal_error if cat.slabs.dirs else None
    unjournaled(cat, len(recs), e or OSError(errno.EBADF, "the pool is closed"), "deleted")
    return False


def unjournaled(cat: SlotCatalog, slots: int, e: BaseException, what: str) -> None:
    """(Pool lock held) ``slots`` slots (``what``: ``"emptied"``, ``"withdrawn"``, ``"deleted"``: DEL records,
    :func:`journal_dels`) whose vacancy records the journal did not take (``e``): counted in
    ``vacancies_unjournaled`` (every slot, ``stats()``), a WARNING at most once a minute per kind (``what``) and pool
    (:data:`LOG`). Never raises."""
    cat.c["vacancies_unjournaled"] += slots
    LOG.warning(f"vacancy {what} {cat.journal.path}", "G3: journal %s: cannot journal %d %s slot(s) empty (%s); a "
                "restart before the journal is repaired replays their blocks' PUTs: each dropped on its zeroed header "
                "(restore_dropped, magic) or, a header not zeroed, verified again (vacancies_unjournaled)",
                cat.journal.path, slots, what, e)


def header_not_cleared(cat: SlotCatalog, file_index: int, slot: int, e: BaseException) -> None:
    """(Pool lock held) The frame header of ``slot`` of file ``file_index`` could not be zeroed (``e``: EIO, EBADF,
    the file gone: KeyError): counted in ``header_clear_errors`` (every slot, ``stats()``), a WARNING at most once a
    minute per pool (:data:`LOG`; a drive gone fails every slot of every put). Never raises."""
    cat.c["header_clear_errors"] += 1
    LOG.warning(f"header {cat.journal.path}", "G3: cannot clear the header of removed slot %d of file %d (%s): a "
                "restart without the journal could find that block again (header_clear_errors)", slot, file_index, e)


def journal_degraded(cat: SlotCatalog, e: BaseException, fresh: bool) -> None:
    """(Pool lock held) The journal failed (``e``; :meth:`~.catalog.SlotCatalog.journal_failed` counted it in
    ``journal_errors``) and degraded the tier for ``cat.degrade_s()`` seconds; ``fresh``: it was admitting before
    (counted in ``degradations``). A fresh degradation's WARNING is at most one per pool per minute (:data:`LOG`,
    the next line says how many were left out); one while already degraded is not logged. An ``e`` that is not an
    OSError (a bug) is logged every time, with its traceback. Never raises."""
    msg = "G3: journal %s: %s; tier degraded for %.1f s (no admission), the journal is rewritten once it can be"
    if not isinstance(e, OSError):
        log.warning(msg, cat.journal.path, e, cat.degrade_s(), exc_info=e)
    elif fresh:
        LOG.warning(f"degraded {cat.journal.path}", msg + " (degradations)", cat.journal.path, e, cat.degrade_s())
