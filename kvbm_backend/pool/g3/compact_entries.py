"""The entries of :class:`~.compact_index.CompactLruIndex`: one fixed-width numpy array per field.

Entry ``e`` is ``seq[e]`` (uint64 sequence hash), ``own[e]`` (int32 owner id), ``rank[e]`` (uint32),
``file[e]`` (uint16), ``slot[e]`` (uint32), ``flag[e]`` (uint8: restored by tag, not adopted yet) and
``lp[e]`` (int32: its position in the LRU log, -1 = free): 27 bytes per entry of capacity. The arrays grow
by doubling (a copy); freed entry indexes wait in an int32 stack for reuse. Each array has a memoryview
(``vseq`` ...): scalar reads and writes as Python ints, about twice as fast as numpy scalars.

:class:`Entries` owns the arrays; the index's other parts (hash table, LRU log, restore) read and write
them through it, never keeping an array across a call that may grow them. Not thread-safe.
"""
from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]


S = TypeVar("S", bound=np.generic)


def _col(old: npt.NDArray[S] | None, cap: int, dt: type[S], keep: int) -> npt.NDArray[S]:
    a = np.empty(cap, dt)
    if old is not None and keep:
        a[:keep] = old[:keep]
    return a


class Entries:
    """The entry arrays (see the module docstring) and the allocation of entry indexes.

    Args:
        cap: initial capacity in entries (at least 1).

    Attributes ``hi`` (entries ``[0, hi)`` were ever used) and ``cap`` are read-only outside this class.
    """

    seq: npt.NDArray[np.uint64]
    own: I32
    rank: npt.NDArray[np.uint32]
    file: npt.NDArray[np.uint16]
    slot: npt.NDArray[np.uint32]
    flag: npt.NDArray[np.uint8]
    lp: I32

    def __init__(self, cap: int) -> None:
        self.hi = 0
        self._free: I32 = np.empty(64, np.int32)  # freed entry indexes, a stack of _nfree
        self._nfree = 0
        self.cap = 0
        self.alloc(cap)

    def alloc(self, cap: int, keep: int = 0) -> None:
        """New arrays of ``cap`` entries holding the first ``keep`` entries of the old ones; the rest free."""
        k = keep if self.cap else 0
        self.seq = _col(self.seq if k else None, cap, np.uint64, k)
        self.own = _col(self.own if k else None, cap, np.int32, k)
        self.rank = _col(self.rank if k else None, cap, np.uint32, k)
        self.file = _col(self.file if k else None, cap, np.uint16, k)
        self.slot = _col(self.slot if k else None, cap, np.uint32, k)
        self.flag = _col(self.flag if k else None, cap, np.uint8, k)
        self.lp = _col(self.lp if k else None, cap, np.int32, k)
        self.lp[k:] = -1
        self.cap = cap
        self.vseq, self.vown, self.vrank = self.seq.data, self.own.data, self.rank.data
        self.vfile, self.vslot = self.file.data, self.slot.data
        self.vflag, self.vlp = self.flag.data, self.lp.data

    def grow(self, need: int) -> None:
        """Capacity doubled until it holds ``need`` entries (the used ones copied)."""
        cap = self.cap
        while cap < need:
            cap *= 2
        self.alloc(cap, self.hi)

    def new(self) -> int:
        """A free entry index (a freed one first, else the next never used; grows when full)."""
        if self._nfree:
            self._nfree -= 1
            return int(self._free[self._nfree])
        if self.hi >= self.cap:
            self.grow(self.hi + 1)
        e = self.hi
        self.hi += 1
        return e

    def new_many(self, m: int) -> I64:
        """``m`` free entry indexes (int64): freed ones first (the latest freed first), then new ones."""
        take = min(m, self._nfree)
        fe = self._free[self._nfree - take:self._nfree][::-1].astype(np.int64)
        self._nfree -= take
        rest = m - take
        if self.hi + rest > self.cap:
            self.grow(self.hi + rest)
        ne: I64 = np.concatenate([fe, np.arange(self.hi, self.hi + rest, dtype=np.int64)])
        self.hi += rest
        return ne

    def release(self, e: int) -> None:
        """Free entry ``e`` (``lp`` -1; its index reused by :meth:`new`)."""
        self.vlp[e] = -1
        if self._nfree == len(self._free):
            self._free = np.concatenate([self._free, np.empty(len(self._free), np.int32)])
        self._free[self._nfree] = e
        self._nfree += 1

    def release_many(self, es: I64) -> None:
        """:meth:`release` of distinct entries ``es``."""
        self.lp[es] = -1
        k = len(es)
        while self._nfree + k > len(self._free):
            self._free = np.concatenate([self._free, np.empty(len(self._free), np.int32)])
        self._free[self._nfree:self._nfree + k] = es
        self._nfree += k

    def reset(self, n: int) -> None:
        """Every entry free and ``[0, n)`` taken (a fresh build fills them): capacity ``n`` + 1/8 when
        ``n`` exceeds it."""
        self.hi = self._nfree = 0
        if n > self.cap:
            self.alloc(n + n // 8)
        else:
            self.lp[:] = -1
        self.hi = n

    def live(self) -> I64:
        """Indexes of the live entries (``lp >= 0``), ascending, int64."""
        return np.flatnonzero(self.lp[:self.hi] >= 0).astype(np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (capacity included) and the free stack."""
        return sum(a.nbytes for a in (self.seq, self.own, self.rank, self.file, self.slot, self.flag, self.lp,
                                      self._free))
