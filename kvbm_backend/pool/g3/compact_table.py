"""The hash table of :class:`~.compact_index.CompactLruIndex`: open addressing over entry indexes.

Cells are int32, ``entry + 1`` (0 = empty); a key's home cell is the top bits of a 64-bit mix of
(owner, rank, seq) (:func:`_mix`, vectorised :func:`_mix_v`; the finalizer is fmix64 from
:mod:`kvbm_backend.model.mix64`); linear probing at load at most 1/4; deletion shifts the cluster back (no tombstones). :class:`HashTable` owns the table (``tab``, its
memoryview, mask, shift, minimum size and the count of occupied cells) and every operation on it: scalar
find/insert/delete, the vectorised batch find (:meth:`HashTable.find_many`, :meth:`HashTable.find_run`),
batch delete, and the bulk builds (one argsort by home position). It reads the keys of the entries it
holds from the index's :class:`~.compact_entries.Entries` (given at construction), never writes them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ...model.mix64 import M64 as _M64, fmix64, fmix64_v
from .compact_entries import I64, Entries

U64 = npt.NDArray[np.uint64]
Ints = npt.NDArray[np.integer[Any]]

_K0 = 0x9E3779B97F4A7C15  # odd: the owner/rank word times it is a bijection of 64-bit words
_U = np.uint64
_MIN_TAB_BITS = 10
_LOAD = 4  # table cells per entry at least: load <= 1/4 keeps batch probing to a few rounds


def _mix(owner: int, rank: int, seq: int) -> int:
    """64-bit mix of one key (same value as :func:`_mix_v`): fmix64 of the seq hash xor the owner/rank word
    times an odd constant."""
    return fmix64((seq ^ ((((owner & 0xFFFFFFFF) << 32) | (rank & 0xFFFFFFFF)) * _K0)) & _M64)


def _mix_v(owner: Ints, rank: Ints, seq: Ints) -> U64:
    """Vectorised :func:`_mix`: uint64 array of the keys' shape."""
    with np.errstate(over="ignore"):
        o = (owner.astype(np.int64).astype(_U) & _U(0xFFFFFFFF)) << _U(32)
        x = seq.astype(_U, copy=False) ^ ((o | (rank.astype(np.int64).astype(_U) & _U(0xFFFFFFFF))) * _U(_K0))
    return fmix64_v(x)


def _mix_seq(owner: int, rank: int, seq: U64) -> U64:
    """:func:`_mix_v` for one owner and rank (a sequence's prefix): the owner/rank word is computed once in
    Python, only the sequence hashes are arrays. uint64 array of ``seq``'s shape."""
    with np.errstate(over="ignore"):
        x = seq ^ _U((((owner & 0xFFFFFFFF) << 32) | (rank & 0xFFFFFFFF)) * _K0 & _M64)
    return fmix64_v(x)




class HashTable:
    """The hash table of :class:`~.compact_index.CompactLruIndex` (see the module docstring): cells are
    ``entry + 1`` of ``ent``'s entries, int32, 0 = empty.

    Args:
        ent: the index's entries (the table reads their ``seq``, ``own``, ``rank`` and ``lp``).
        min_bits: the table never has fewer than ``2**min_bits`` cells (:meth:`reserve` raises it).

    Attributes read outside: ``tab`` (the cells; replaced by a rebuild), ``n`` (occupied cells: the
    live entries), ``shift`` (a key's home cell is its 64-bit mix shifted right by it), ``min_bits``.
    """

    def __init__(self, ent: Entries, min_bits: int) -> None:
        self._ent = ent
        self.min_bits = min_bits
        self.n = 0
        self._set(np.zeros(1 << min_bits, np.int32))

    def _set(self, tab: npt.NDArray[np.int32]) -> None:
        self.tab = tab
        self._vtab = tab.data
        self._mask = len(tab) - 1
        self.shift = 64 - (len(tab).bit_length() - 1)

    @property
    def size(self) -> int:
        """Cells (a power of two)."""
        return len(self.tab)

    @property
    def nbytes(self) -> int:
        return self.tab.nbytes

    def find(self, o: int, rank: int, seq: int) -> tuple[int, int]:
        """(entry or -1, table position of the entry or of the first empty cell on its probe path)."""
        tab, mask, ent = self._vtab, self._mask, self._ent
        seqa, owna, ranka = ent.vseq, ent.vown, ent.vrank
        p = _mix(o, rank, seq) >> self.shift
        while True:
            v = tab[p]
            if v == 0:
                return -1, p
            e = v - 1
            if seqa[e] == seq and owna[e] == o and ranka[e] == rank:
                return e, p
            p = (p + 1) & mask

    def put(self, p: int, e: int) -> None:
        """Fill the empty cell ``p`` (what :meth:`find` returned for entry ``e``'s key, with no change to
        the table since) with ``e``. The caller made room first (:meth:`room`)."""
        self._vtab[p] = e + 1
        self.n += 1

    def _home(self, e: int) -> int:
        ent = self._ent
        return _mix(ent.vown[e], ent.vrank[e], ent.vseq[e]) >> self.shift

    def cell_of(self, e: int) -> int:
        """Table position of live entry ``e``."""
        tab, mask, v = self._vtab, self._mask, e + 1
        p = self._home(e)
        while tab[p] != v:
            p = (p + 1) & mask
        return p

    def delete(self, i: int) -> None:
        """Empty table cell ``i`` and shift the rest of its cluster back (linear-probing deletion)."""
        tab, mask = self._vtab, self._mask
        j = i
        while True:
            j = (j + 1) & mask
            v = tab[j]
            if v == 0:
                break
            k = self._home(v - 1)
            if (i <= j and i < k <= j) or (i > j and (k > i or k <= j)):
                continue  # its home lies in (i, j]: it stays
            tab[i] = v
            i = j
        tab[i] = 0
        self.n -= 1

    def _homes(self, es: I64) -> I64:
        ent = self._ent
        return (_mix_v(ent.own[es], ent.rank[es], ent.seq[es]) >> _U(self.shift)).astype(np.int64)

    def delete_many(self, es: I64) -> None:
        """Remove live entries ``es`` (distinct, int64) from the table, vectorised: their cells and the
        rest of their clusters are emptied, then the other entries of those cluster tails go back."""
        tab, mask = self.tab, self._mask
        self.n -= len(es)
        pos = self._homes(es)
        want = es + 1
        cells = np.empty(len(es), np.int64)
        act = np.arange(len(es))
        while len(act):
            ok = tab[pos] == want[act]
            cells[act[ok]] = pos[ok]
            go = ~ok
            act = act[go]
            pos = (pos[go] + 1) & mask
        tab[cells] = 0
        moved = []
        cur = (cells + 1) & mask
        while len(cur):  # cluster tails after the emptied cells, up to the next empty cell
            cur = cur[tab[cur] != 0]
            if not len(cur):
                break
            cur = np.unique(cur)  # two emptied cells of one cluster reach the same cells
            moved.append(tab[cur].astype(np.int64) - 1)
            tab[cur] = 0
            cur = (cur + 1) & mask
        if not moved:
            return
        m = np.concatenate(moved)
        pos = self._homes(m)
        while len(m):  # each goes to the first empty cell from its home (ties: one per cell per round)
            free = np.flatnonzero(tab[pos] == 0)
            if len(free):
                cell, first = np.unique(pos[free], return_index=True)
                win = free[first]
                tab[cell] = (m[win] + 1).astype(np.int32)
                keep = np.ones(len(m), bool)
                keep[win] = False
                m, pos = m[keep], pos[keep]
            pos = (pos + 1) & mask

    def _insert_at_home(self, e: int) -> None:
        tab, mask = self._vtab, self._mask
        p = self._home(e)
        while tab[p] != 0:
            p = (p + 1) & mask
        tab[p] = e + 1

    def rebuild(self, bits: int) -> None:
        """A table of ``2**bits`` cells holding the live entries (one argsort by home position)."""
        live = self._ent.live()
        self._set(np.zeros(1 << bits, np.int32))
        self.n = len(live)
        if not len(live):
            return
        ent = self._ent
        home = _mix_v(ent.own[live], ent.rank[live], ent.seq[live]) >> _U(64 - bits)
        o = np.argsort(home)
        self._place_sorted(home[o], live[o])

    def build(self, mixes: U64, order: I64) -> None:
        """A table of entries ``order`` whose 64-bit mixes (:func:`_mix_v`) ``mixes`` are sorted
        ascending (a fresh restore: every other cell empty), sized for them (``min_bits`` at least)."""
        n = len(order)
        bits = max(self.min_bits, (_LOAD * n - 1).bit_length())
        self._set(np.zeros(1 << bits, np.int32))
        self.n = n
        self._place_sorted(mixes >> _U(64 - bits), order)

    def _place_sorted(self, home: npt.NDArray[np.integer[Any]], ents: I64) -> None:
        """Fill the empty table with ``ents`` whose home cells ``home`` are sorted ascending: each goes to
        the first free cell at or after its home (a running maximum), the overflow past the last cell
        wraps to the start one by one."""
        tab, size = self.tab, len(self.tab)
        home = home.astype(np.int64)
        i = np.arange(len(ents), dtype=np.int64)
        final = i + np.maximum.accumulate(home - i)
        ok = final < size
        tab[final[ok]] = (ents[ok] + 1).astype(np.int32)
        for e in ents[~ok].tolist():  # clusters running past the end wrap to the start
            self._insert_at_home(e)

    def room(self, extra: int) -> None:
        """Rebuild larger if ``extra`` more entries would take the load over 1/``_LOAD``."""
        need = self.n + extra
        if _LOAD * need > len(self.tab):
            self.rebuild(max(self.min_bits, (_LOAD * need - 1).bit_length()))

    def fit(self) -> None:
        """Rebuild at the size the live entries need (``min_bits`` at least)."""
        self.rebuild(max(self.min_bits, (_LOAD * self.n - 1).bit_length()))

    def reserve(self, n: int) -> None:
        """Never fewer cells than ``n`` entries need from now (rebuilt now if smaller)."""
        bits = (_LOAD * max(1, n) - 1).bit_length()
        if bits > self.min_bits:
            self.min_bits = bits
            if len(self.tab) < 1 << bits:
                self.rebuild(bits)

    def find_many(self, own: I64, rank: I64, seq: U64) -> I64:
        """Entries of N keys (-1 where absent; a negative owner is absent), vectorised probing. ``own``
        and ``rank`` are (N,) int64 arrays or one int64 for every key."""
        n = len(seq)
        res = np.full(n, -1, np.int64)
        if not self.n:
            return res
        tab, mask, ent = self.tab, self._mask, self._ent
        if own.ndim == 0 and rank.ndim == 0:  # one owner and rank (a sequence's prefix): scalar mix input
            if own < 0:
                return res
            o, r = int(own), int(rank)
            x = _mix_seq(o, r, seq)
            pos = (x >> _U(self.shift)).astype(np.int64)
            act = np.arange(n)
            hit = np.zeros(n, bool)
            while len(act) > 32:
                e = tab[pos].astype(np.int64) - 1
                occ = e >= 0
                ec = np.where(occ, e, 0)
                hit = occ & (ent.seq[ec] == seq)
                if hit.any():
                    hi = np.flatnonzero(hit)
                    eh = ec[hi]
                    hit[hi] = (ent.own[eh] == o) & (ent.rank[eh] == r)
                res[act[hit]] = e[hit]
                go = np.flatnonzero(occ & ~hit)
                act, seq = act[go], seq[go]
                pos = (pos[go] + 1) & mask
            for i, q in zip(act.tolist(), seq.tolist()):
                res[i] = self.find(o, r, q)[0]
            return res
        own = np.broadcast_to(own, (n,))
        rank = np.broadcast_to(rank, (n,))
        act = np.flatnonzero(own >= 0)
        if not len(act):
            return res
        own, rank, seq = own[act], rank[act], seq[act]
        pos = (_mix_v(own, rank, seq) >> _U(self.shift)).astype(np.int64)
        while len(act) > 32:
            e = tab[pos].astype(np.int64) - 1
            occ = e >= 0
            ec = np.where(occ, e, 0)
            hit = occ & (ent.seq[ec] == seq)
            if hit.any():  # the seq hash matched: check the rest of the identity
                hi = np.flatnonzero(hit)
                eh = ec[hi]
                hit[hi] = (ent.own[eh] == own[hi]) & (ent.rank[eh] == rank[hi])
            res[act[hit]] = e[hit]
            go = np.flatnonzero(occ & ~hit)
            act, own, rank, seq = act[go], own[go], rank[go], seq[go]
            pos = (pos[go] + 1) & mask
        for i, o, r, q in zip(act.tolist(), own.tolist(), rank.tolist(), seq.tolist()):  # a few long probes
            res[i] = self.find(o, r, q)[0]
        return res

    def find_run(self, o: int, rank: int, seq: U64) -> I64:
        """:meth:`find_many` of N keys of one owner and rank (a sequence's prefix), lean: per probing
        round one table gather and one seq gather for every pending key (an empty cell, -1 after the
        shift, reads the last entry's seq: harmless, such a "hit" is dropped with the owner/rank check),
        owner and rank read only where the seq matched. A key ends at its match or at an empty cell
        (linear probing never places a key past one); the last few pending keys probe in Python."""
        n = len(seq)
        res = np.full(n, -1, np.int64)
        if not self.n or o < 0:
            return res
        x = _mix_seq(o, rank, seq)
        x >>= _U(self.shift)
        pos = x.astype(np.int64)
        ent = self._ent
        tab, mask, seqa, owna, ranka = self.tab, self._mask, ent.seq, ent.own, ent.rank
        act = None  # all keys pending (round 1)
        while True:
            e = tab[pos].astype(np.int64)
            e -= 1  # -1 = empty cell
            hit = np.flatnonzero(seqa[e] == seq)
            if len(hit):
                eh = e[hit]
                ok = (eh >= 0) & (owna[eh] == o) & (ranka[eh] == rank)
                hit, eh = hit[ok], eh[ok]
                res[hit if act is None else act[hit]] = eh
                e[hit] = -1  # found: done
            go = np.flatnonzero(e >= 0)  # occupied by another key: probe on
            if len(go) <= 32:
                break
            act = go if act is None else act[go]
            seq = seq[go]
            pos = (pos[go] + 1) & mask
        if len(go):
            act = go if act is None else act[go]
            for i, q in zip(act.tolist(), seq[go].tolist()):
                res[i] = self.find(o, rank, q)[0]
        return res
