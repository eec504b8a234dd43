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
the round's blocks out of the index and drops them.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Sequence

from ...model.namespace import BlockKey
from .catalog import SlotCatalog
from .pieces import Slot

if TYPE_CHECKING:
    from .pieces import _Job

log = logging.getLogger(__name__)


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
    """(Pool lock held) The journal barrier of a round failed with ``err``: the tier degrades
    (``journal_failed``) and the journal is rewritten from the index at once (it holds the round's blocks);
    True when that worked (the round's records are durable). Otherwise the round's blocks still at their slot
    are removed from the index (header zeroed, slot freed) and each put counts them dropped
    (``cat.journal_reason``); False."""
    cat.journal_failed(err)
    try:
        cat.journal.rewrite(cat.index.items())
    except Exception as e:  # noqa: BLE001 - storage trouble (or a bug): withdraw, never report unjournaled blocks
        cat.journal_failed(e)
    else:
        cat.journal_dirty = False
        log.warning("G3: journal %s: fdatasync failed (%s); rewritten from the index", cat.journal.path, err)
        return True
    for job, k, slot in pub:
        cat.remove(k, slot)
        job.result.dropped += 1
    cat.drop(cat.journal_reason, len(pub))
    return False
