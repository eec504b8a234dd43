"""Warm-restart builds of :class:`~.compact_index.CompactLruIndex` from the journal's entries.

:class:`Restore` is a mixin: ``restore_many`` (from (key, slot) pairs) and ``restore_arrays`` (from the
journal's columns) build the whole index in a few vectorised passes (one sort for dedupe and the table);
into a non-empty index they update present keys in place and append the rest as most recently used.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Iterable

import numpy as np

from ...model.namespace import BlockKey
from .compact_owners import KNOWN
from .compact_table import _LOAD, _U, _mix_v
from .index import TagKey, tag_of

Slot = tuple[int, int]
_G0, _G1, _G2, _G3 = (itemgetter(i) for i in range(4))


class Restore:
    """Mixin: the bulk restore of :class:`~.compact_index.CompactLruIndex` (see the module docstring)."""


    def restore_many(self, entries: Iterable[tuple["BlockKey | TagKey", Slot]]) -> None:
        """:meth:`restore` of each (key, slot), oldest first, in one vectorised build (a repeated key
        keeps its last slot and place).

        Raises:
            ValueError: a rank, file or slot index outside the journal's field widths.
        """
        entries = entries if isinstance(entries, (list, tuple)) else list(entries)
        n = len(entries)
        if not n:
            return
        keys = list(map(_G0, entries))  # columns by itemgetter: zip(*entries) is slow for millions
        slots = list(map(_G1, entries))
        ns_col, who_col, rank_col, seq_col = (list(map(g, keys)) for g in (_G0, _G1, _G2, _G3))
        # who: a TagKey's tag (bytes) or a BlockKey's tenant (str)
        nss = set(ns_col)
        pairs = zip(ns_col, who_col) if len(nss) > 1 else None
        owner_of: dict = {}
        flag_of: dict = {}
        for nk in (set(pairs) if pairs is not None else set(who_col)):
            ns, who = nk if pairs is not None else (next(iter(nss)), nk)
            if type(who) is bytes:
                t = KNOWN.get(who)
                owner_of[nk] = self._owners.intern(ns, who, t)
                flag_of[nk] = t is None
            else:
                owner_of[nk] = self._owners.intern(ns, tag_of(who), who)
                flag_of[nk] = False
        col = list(zip(ns_col, who_col)) if pairs is not None else who_col
        file_col, slot_col = list(map(_G0, slots)), list(map(_G1, slots))
        self._restore_owners(np.fromiter(map(owner_of.__getitem__, col), np.int64, n),
                             np.fromiter(rank_col, np.int64, n), np.fromiter(seq_col, _U, n),
                             np.fromiter(file_col, np.int64, n), np.fromiter(slot_col, np.int64, n),
                             np.fromiter(map(flag_of.__getitem__, col), np.uint8, n))

    def restore_arrays(self, namespace: str, tags: np.ndarray, ranks: np.ndarray, seqs: np.ndarray,
                       files: np.ndarray, slots: np.ndarray) -> None:
        """Vectorised :meth:`restore` of N journal entries (oldest first; a repeated key keeps its last).

        Args:
            namespace: the namespace fingerprint of every entry.
            tags: (N, 16) uint8, the tenant tags (``tenant_tag``); a tag other than ``""``'s is restored
                as a :class:`TagKey` entry until adopted.
            ranks, seqs, files, slots: (N,) integer arrays (rank < 2**32, seq_hash < 2**64 as uint64,
                file < 2**16, slot < 2**32).

        Raises:
            ValueError: shapes disagree, or a rank, file or slot index is outside the widths above.
        """
        tags = np.ascontiguousarray(tags, np.uint8)
        n = len(seqs)
        if tags.shape != (n, 16) or not (len(ranks) == len(files) == len(slots) == n):
            raise ValueError(f"restore_arrays: tags {tags.shape}, {len(ranks)} ranks, {n} seqs, "
                             f"{len(files)} files, {len(slots)} slots")
        if not n:
            return
        # intern the tags: runs of one tag first (a sequence's blocks are journaled together), then the
        # distinct run tags
        w = tags.view(np.uint64)  # (N, 2)
        start = np.ones(n, bool)
        start[1:] = (w[1:] != w[:-1]).any(axis=1)
        runs = np.flatnonzero(start)
        uniq, inv = np.unique(tags[runs].view("V16").ravel(), return_inverse=True)
        oid = np.empty(len(uniq), np.int64)
        flag = np.ones(len(uniq), np.uint8)
        for i, t in enumerate(uniq.tolist()):
            t = bytes(t)
            oid[i] = self._owners.intern(namespace, t, None)
            flag[i] = t not in KNOWN
        run_of = np.cumsum(start) - 1
        self._restore_owners(oid[inv][run_of], np.asarray(ranks, np.int64), np.asarray(seqs, _U),
                             np.asarray(files, np.int64), np.asarray(slots, np.int64), flag[inv][run_of])

    def _restore_owners(self, own, rank, seq, file, slot, flag) -> None:
        n = len(seq)
        for name, a, hi in (("rank", rank, 0xFFFFFFFF), ("file", file, 0xFFFF), ("slot", slot, 0xFFFFFFFF)):
            if n and (int(a.min()) < 0 or int(a.max()) > hi):
                raise ValueError(f"restore: {name} outside 0..{hi} (the journal's field width)")
        h = _mix_v(own, rank, seq)
        o = np.argsort(h)
        hs = h[o]
        if (hs[1:] == hs[:-1]).any():  # a repeated key (or a 64-bit mix collision): keep the last, exactly
            order = np.lexsort((np.arange(n), seq, rank, own))
            last = np.ones(n, bool)
            last[:-1] = ((own[order][1:] != own[order][:-1]) | (rank[order][1:] != rank[order][:-1])
                         | (seq[order][1:] != seq[order][:-1]))
            keep = np.sort(order[last])
            own, rank, seq, file, slot, flag, h = (x[keep] for x in (own, rank, seq, file, slot, flag, h))
            n = len(keep)
            o = np.argsort(h)
            hs = h[o]
        if not self._n:  # the warm-restart case: a fresh build, one sort for dedupe and table
            self._hi = self._nfree = 0
            self._head = self._tail = 0
            if n > self._cap:
                self._alloc_entries(n + n // 8)
            else:
                self._lp[:] = -1
            ents = np.arange(n, dtype=np.int64)
            self._seq[:n], self._own[:n], self._rank[:n] = seq, own, rank
            self._file[:n], self._slot[:n], self._flag[:n] = file, slot, flag
            self._hi = self._n = n
            if len(self._log) < 2 * n:
                self._set_log(np.empty(2 * n, np.int32))
            self._log[:n] = ents
            self._lp[:n] = ents
            self._tail = n
            bits = max(self._min_bits, (_LOAD * n - 1).bit_length())
            self._set_table(np.zeros(1 << bits, np.int32))
            self._place_sorted(hs >> _U(64 - bits), o)
            return
        ex = self._find_many(own, rank, seq)  # keys already present: updated in place
        old = ex >= 0
        if old.any():
            eo = ex[old]
            self._file[eo], self._slot[eo] = file[old], slot[old]
        ents = ex.copy()
        new = ~old
        m = int(new.sum())
        if m:
            take = min(m, self._nfree)
            fe = self._free[self._nfree - take:self._nfree][::-1].astype(np.int64)
            self._nfree -= take
            rest = m - take
            if self._hi + rest > self._cap:
                self._grow_entries(self._hi + rest)
            ne = np.concatenate([fe, np.arange(self._hi, self._hi + rest, dtype=np.int64)])
            self._hi += rest
            ents[new] = ne
            self._seq[ne], self._own[ne], self._rank[ne] = seq[new], own[new], rank[new]
            self._file[ne], self._slot[ne], self._flag[ne] = file[new], slot[new], flag[new]
            self._lp[ne] = 0  # live (the touch below sets the real position)
            self._n += m
            self._touch_many(ents)
            self._rebuild_table(max(self._min_bits, (_LOAD * self._n - 1).bit_length()))
        else:
            self._touch_many(ents)
