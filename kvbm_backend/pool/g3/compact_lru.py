"""The LRU order of :class:`~.compact_index.CompactLruIndex`: a log of entry indexes, oldest first.

Touching an entry appends it and its older log position goes stale (the entry's ``lp`` no longer points
at it); the log is compacted when it fills, so it holds at most about twice the live entries after a
compaction (int32, 4-12 bytes per entry). A batch touch (a prefix lookup of 8K blocks) is then a few
array assignments instead of a doubly-linked list walk. :class:`LruLog` owns the log; the entries' ``lp``
column (:class:`~.compact_entries.Entries`) is where it writes each entry's position. Not thread-safe.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .compact_entries import I32, I64, Entries


class LruLog:
    """Entry indexes in LRU order (see the module docstring).

    Args:
        ent: the index's entries (their ``lp`` column holds each live entry's log position).
        size: initial log length (grows by doubling).

    ``head`` and ``tail`` (positions ``[head, tail)`` may be live) are read-only outside this class.
    """

    def __init__(self, ent: Entries, size: int) -> None:
        self._ent = ent
        self._set(np.empty(size, np.int32))
        self.head = self.tail = 0

    def _set(self, log: I32) -> None:
        self._log = log
        self._vlog = log.data

    @property
    def nbytes(self) -> int:
        return self._log.nbytes

    def live(self, a: int | None = None, b: int | None = None) -> npt.NDArray[np.int32]:
        """The entries at live log positions in ``[a, b)`` (default ``[head, tail)``), oldest first."""
        a = self.head if a is None else a
        b = self.tail if b is None else b
        seg = self._log[a:b]
        live: npt.NDArray[np.bool_] = self._ent.lp[seg] == np.arange(a, b, dtype=np.int32)
        return seg[live]

    def room(self, extra: int) -> None:
        """Make room for ``extra`` appends: compact (drop stale positions) and grow when needed.

        Raises:
            OverflowError: the log would need 2**31 positions.
        """
        if self.tail + extra <= len(self._log):
            return
        live = self.live()
        m = len(live)
        size = len(self._log)
        while 2 * (m + extra) > size:
            size *= 2
        if size >= 1 << 31:
            raise OverflowError("LRU log over 2**31 positions")
        log = self._log if size == len(self._log) else np.empty(size, np.int32)
        log[:m] = live
        self._ent.lp[live] = np.arange(m, dtype=np.int32)
        self._set(log)
        self.head, self.tail = 0, m

    def touch(self, e: int) -> None:
        """Make entry ``e`` the most recently used."""
        t = self.tail
        vlp = self._ent.vlp
        if t and vlp[e] == t - 1:
            return  # already the most recently used
        if t >= len(self._log):
            self.room(1)
            t = self.tail
        self._vlog[t] = e
        vlp[e] = t
        self.tail = t + 1

    def touch_many(self, es: I64) -> None:
        """Make ``es`` the most recently used, in order (a repeated entry ends at its last position)."""
        m = len(es)
        if not m:
            return
        self.room(m)
        t = self.tail
        self._log[t:t + m] = es
        self._ent.lp[es] = np.arange(t, t + m, dtype=np.int32)  # repeated index: the last value is assigned
        self.tail = t + m

    def reset(self, n: int) -> None:
        """The log of a fresh build: entries ``[0, n)`` in order, oldest first (their ``lp`` set)."""
        if len(self._log) < 2 * n:
            self._set(np.empty(2 * n, np.int32))
        ents = np.arange(n, dtype=np.int32)
        self._log[:n] = ents
        self._ent.lp[:n] = ents
        self.head, self.tail = 0, n

    def skip_stale(self) -> None:
        """Advance ``head`` over stale positions (after evictions)."""
        while self.head < self.tail:
            end = min(self.tail, self.head + 4096)
            seg = self._log[self.head:end]
            ok = self._ent.lp[seg] == np.arange(self.head, end, dtype=np.int32)
            if ok.any():
                self.head += int(np.argmax(ok))
                break
            self.head = end
