"""Warm-restart builds of :class:`~.compact_index.CompactLruIndex` from the journal's entries.

:func:`restore_pairs` (from (key, slot) pairs) and :func:`restore_columns` (from the journal's columns)
build the whole index in a few vectorised passes (one sort for dedupe and the table); into a non-empty
index they update present keys in place and append the rest as most recently used. They are functions
of the index's parts, passed explicitly: the owners (interned here), the entries, the hash table and the
LRU log (each changed only through its own methods, the entry columns excepted: they are filled here).
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Hashable, Iterable, Mapping

import numpy as np
import numpy.typing as npt

from ...model.namespace import BlockKey
from .compact_entries import I64, Entries
from .compact_lru import LruLog
from .compact_owners import KNOWN, Owners
from .compact_table import _U, U64, HashTable, Ints, _mix_v
from .index import TagKey, tag_of

Slot = tuple[int, int]
_G0, _G1, _G2, _G3 = (itemgetter(i) for i in range(4))


def restore_pairs(owners: Owners, ent: Entries, table: HashTable, lru: LruLog,
                  entries: Iterable[tuple["BlockKey | TagKey", Slot]]) -> None:
    """``CompactLruIndex.restore`` of each (key, slot), oldest first, in one vectorised build (a repeated key
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
    owner_of: dict[Hashable, int] = {}  # (namespace, who), or who alone when one namespace -> owner id
    flag_of: dict[Hashable, bool] = {}
    if pairs is not None:
        distinct: dict[Hashable, tuple[str, str | bytes]] = {nk: nk for nk in set(pairs)}
    else:
        ns0 = next(iter(nss))
        distinct = {who: (ns0, who) for who in set(who_col)}
    for nk, (ns, who) in distinct.items():
        if isinstance(who, bytes):
            t = KNOWN.get(who)
            owner_of[nk] = owners.intern(ns, who, t)
            flag_of[nk] = t is None
        else:
            owner_of[nk] = owners.intern(ns, tag_of(who), who)
            flag_of[nk] = False
    col = list(zip(ns_col, who_col)) if pairs is not None else who_col
    file_col, slot_col = list(map(_G0, slots)), list(map(_G1, slots))
    _build(ent, table, lru, np.fromiter(map(owner_of.__getitem__, col), np.int64, n),
           np.fromiter(rank_col, np.int64, n), np.fromiter(seq_col, _U, n),
           np.fromiter(file_col, np.int64, n), np.fromiter(slot_col, np.int64, n),
           np.fromiter(map(flag_of.__getitem__, col), np.uint8, n))


def restore_columns(owners: Owners, ent: Entries, table: HashTable, lru: LruLog, namespace: str,
                    tags: npt.NDArray[Any], ranks: Ints, seqs: Ints, files: Ints, slots: Ints,
                    tenants: Mapping[bytes, str] | None = None) -> None:
    """:meth:`CompactLruIndex.restore_arrays <.compact_index.CompactLruIndex.restore_arrays>` on the index's
    parts (arguments, widths and errors as documented there)."""
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
        who = tenants.get(t) if tenants else None
        oid[i] = owners.intern(namespace, t, who)
        flag[i] = t not in KNOWN and who is None
    run_of = np.cumsum(start) - 1
    _build(ent, table, lru, oid[inv][run_of], np.asarray(ranks, np.int64), np.asarray(seqs, _U),
           np.asarray(files, np.int64), np.asarray(slots, np.int64), flag[inv][run_of])


def _build(ent: Entries, table: HashTable, lru: LruLog, own: I64, rank: I64, seq: U64, file: I64, slot: I64,
              flag: npt.NDArray[np.uint8]) -> None:
    """Put N entries (column arrays, oldest first; a repeated key keeps its last) into the parts: a fresh
    build when the index is empty, else present keys updated in place and the rest appended as most
    recently used (the table rebuilt once)."""
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
    if not table.n:  # the warm-restart case: a fresh build, one sort for dedupe and table
        ent.reset(n)
        ent.seq[:n], ent.own[:n], ent.rank[:n] = seq, own, rank
        ent.file[:n], ent.slot[:n], ent.flag[:n] = file, slot, flag
        lru.reset(n)
        table.build(hs, o)
        return
    ex = table.find_many(own, rank, seq)  # keys already present: updated in place
    old = ex >= 0
    if old.any():
        eo = ex[old]
        ent.file[eo], ent.slot[eo] = file[old], slot[old]
    ents = ex.copy()
    new = ~old
    m = int(new.sum())
    if m:
        ne = ent.new_many(m)
        ents[new] = ne
        ent.seq[ne], ent.own[ne], ent.rank[ne] = seq[new], own[new], rank[new]
        ent.file[ne], ent.slot[ne], ent.flag[ne] = file[new], slot[new], flag[new]
        ent.lp[ne] = 0  # live (the touch below sets the real position)
        lru.touch_many(ents)
        table.fit()  # counts the live entries, the new ones included
    else:
        lru.touch_many(ents)
