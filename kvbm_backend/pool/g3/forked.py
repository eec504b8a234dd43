"""A G3 pool in a child forked without exec from the process that opened it.

A child forked without exec (multiprocessing's fork, a zygote, an engine forking helpers) gets copies of the
pool's state and descriptors but none of its threads (writer, syncer, reader, verifier, lookups). Before
2026-12-01 its puts and gets then waited for ever, a lock another thread held at the fork hung its first call,
its ``close`` unlocked the directory lock of its still running parent (an ``flock`` belongs to the open file
description both share), and after the parent was killed it kept the directory locked until it ended (a
restarted worker got :class:`~.dirs.G3LockedError`). Writes through the copied descriptors would have gone into
the parent's slab files and journal behind the parent's index.

Now, at the fork, the child closes its copies of every open pool's descriptors: the directories and their lock
files (:mod:`.dirs`, which never unlocks in the child: the parent's locks stay held), the slab files and the
journal (no sync, nothing written or removed). Every call of such a pool in the child raises
:class:`G3ForkedError` naming the pool's directories, the opener and the child (the catalog's lock is a
:class:`ForkedLock`, taken first by every call: a lock another thread held at the fork is never waited for), and
its ``close`` does nothing (the parent's pool is not the child's to close). A child that wants a G3 pool opens its
own, on a directory of its own.
"""
from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .catalog import SlotCatalog


class G3ForkedError(RuntimeError):
    """A call of a G3 pool in a child forked without exec from the process that opened it (see the module
    docstring): the message names the pool's directories, the opener's pid and the child's."""


class ForkedLock:
    """The lock of a pool's catalog in a forked child: acquiring it raises :class:`G3ForkedError` (``message``)."""

    def __init__(self, message: str):
        self.message = message

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        raise G3ForkedError(self.message)

    def release(self) -> None:
        raise RuntimeError("release of a G3 ForkedLock, which is never held")

    def locked(self) -> bool:
        return False

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_open: "weakref.WeakSet[SlotCatalog]" = weakref.WeakSet()  # this process's pool catalogs


def opened(cat: SlotCatalog) -> None:
    """Record ``cat`` (a pool's catalog, its slab files and journal open): a forked child forgets it."""
    _open.add(cat)


def _after_fork_in_child() -> None:
    for cat in list(_open):
        cat.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
