"""The writer's journal barrier: one ``fdatasync`` of the G3 journal per group-commit round, off the pool's lock.

A round (:meth:`.writer.G3Writer._settle`) appends the PUT records of every block it publishes and puts those
blocks in the index in one hold of the pool's lock (so a compaction snapshot or a repair rewrite, both taken
from the index under that lock, never misses a journaled record), takes a duplicate of the journal's fd
(:func:`handle_locked`), releases the lock, and ``fdatasync``\\ s it (:func:`sync`): lookups, loads and puts
never wait for that barrier. Only after it are the round's blocks counted written and their puts resolved
(stored; the connector publishes KV events from those results). A block is served from the index before its
record is durable: its bytes are (slab ``fdatasync`` first) and every read verifies them, so a power cut then
costs a hit after restart, never bytes. If the barrier fails, :func:`repair_or_withdraw_locked` rewrites the
journal from the index (temp file, fsync, rename: every record of the round durable) or, failing that, takes
the round's blocks out of the index, drops them and journals their slots empty (vacancy records, best effort:
:func:`.journal_gen.encode_vacant`). Before 2026-12-03 it journaled nothing: the round's PUTs stayed the journal's
last word on those slots until the repair (the next append, or close), so a worker killed meanwhile restarted
reading zeroed headers where the journal said blocks were, each withdrawn block counted lost again
(``restore_dropped``, reason ``magic``; never wrong bytes: every entry is checked against its slot header).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Sequence

from ...log_limits import LimitedLog
from ...model.namespace import BlockKey
from . import journal_gen, vacancy
from .catalog import _NOSPACE, SlotCatalog  # no space: counted ``enospc`` (SlotCatalog.journal_failed)
from .pieces import Slot

if TYPE_CHECKING:
    from .pieces import _Job

log = logging.getLogger(__name__)
#: a barrier failing every round (a failing journal drive): one WARNING per pool per minute; ``journal_errors``
#: counts every one (:meth:`.catalog.SlotCatalog.journal_failed`)
LOG = LimitedLog(log)


def handle_locked(cat: SlotCatalog) -> int | BaseException | None:
    """(Pool lock held) The fd to sync for the records just appended: a duplicate of the journal's (the caller's
    :func:`sync` closes it), or the OSError that made one impossible (EMFILE: the barrier failed), or None when
    no journal is open (nothing was appended)."""
    try:
        return cat.journal.sync_handle()
    except OSError as e:
        return e


def sync(cat: SlotCatalog, handle: int | BaseException | None) -> BaseException | None:
    """(Pool lock NOT held) ``os.fdatasync(handle)`` and close it (the caller counts ``journal_syncs``). Returns the error
    (None: the round's records are durable)."""
    if handle is None or isinstance(handle, BaseException):
        return handle
    try:
        os.fdatasync(handle)
    except OSError as e:
        return e
    finally:
        os.close(handle)
    return None


def repair_or_withdraw_locked(cat: SlotCatalog, err: BaseException,
                              pub: Sequence[tuple["_Job", BlockKey, Slot]]) -> bool:
    """(Pool lock held) The journal barrier of a round failed with ``err``: the journal is rewritten from the index
    at once (it holds the round's blocks) and the tier degrades (``journal_failed``, once: ``journal_errors`` counts
    the failure, the barrier's ``err`` or, when the rewrite failed too, both (:func:`_both`), which also names the
    drop reason); True when the rewrite worked (the round's records are durable). Otherwise the round's blocks still
    at their slot are removed from the index (header zeroed, slot freed), those slots are journaled empty
    (:func:`_vacate`) and each put counts them dropped (``cat.journal_reason``); False. Before 2026-12-03 a failed
    rewrite counted the one failure twice in ``journal_errors`` (and ``enospc``: both errors' each)."""
    try:
        cat.journal.rewrite(cat.index.items())
    except Exception as e:  # noqa: BLE001 - storage trouble (or a bug): withdraw, never report unjournaled blocks
        cat.journal_failed(_both(err, e))  # one failure, counted once (before 2026-12-03: twice, err's and e's)
    else:
        cat.journal_failed(err)
        cat.journal_dirty = False
        LOG.warning(f"repaired {cat.journal.path}", "G3: journal %s: fdatasync failed (%s); rewritten from the index",
                    cat.journal.path, err)
        return True
    gone: list[tuple[int, int]] = []  # slots this withdrawal empties (a key deleted or moved meanwhile: not its)
    for job, k, slot in pub:
        held = cat.index.get(k)
        if held is not None and tuple(held) == tuple(slot):
            gone.append((int(slot[0]), int(slot[1])))
            cat.remove(k, slot)
        job.result.dropped += 1
    cat.drop(cat.journal_reason, len(pub))
    _vacate(cat, gone)
    return False


def _both(err: BaseException, e: BaseException) -> BaseException:
    """The failure a barrier (``err``) whose repair rewrite failed too (``e``) is counted and logged as: an OSError
    naming both, of ``e``'s errno unless only ``err``'s is ENOSPC or EDQUOT, then ``err``'s (no space, either way: the
    drop reason ``enospc``, counted ``enospc``; else ``journal_error``); ``e`` itself when it is no OSError (a bug:
    logged with its traceback). From 0686707 to 2026-12-03 it was always ``e``'s errno, so a barrier's ENOSPC whose
    rewrite then met EIO counted no ``enospc`` at all."""
    if not isinstance(e, OSError):
        return e
    msg = f"rewriting it failed ({e.strerror or e}) after its fdatasync failed ({err})"
    no = e.errno
    if no not in _NOSPACE and getattr(err, "errno", None) in _NOSPACE:
        no = err.errno  # type: ignore[attr-defined]
    return OSError(msg) if no is None else OSError(no, msg)


def _vacate(cat: SlotCatalog, slots: list[tuple[int, int]]) -> None:
    """(Pool lock held, before anything can reuse ``slots``) Append vacancy records of ``slots`` (file index,
    slot index) straight to the open journal, after the round's PUTs: replay then finds them empty. Best effort,
    never raises: the journal is marked for repair already and the rewrite from the index names none of them, so
    a failed append (a broken or closed journal: EBADF; EIO, ENOSPC) is counted and logged
    (:func:`.vacancy.unjournaled`) and leaves only the stale PUTs a kill before that repair would meet (counted
    ``restore_dropped`` at the restart, as before). Not through
    :meth:`.catalog.SlotCatalog.journal_append`: that would retry the rewrite that just failed, under the lock."""
    if not slots:
        return
    try:
        cat.journal.append(journal_gen.encode_vacant(slots))
    except OSError as e:
        vacancy.unjournaled(cat, len(slots), e, "withdrawn")
