"""A compact G3 index for 10M+ blocks: :class:`LruIndex`'s API and semantics in fixed-width numpy arrays.

No Python object per entry. Per entry (arrays of the entry capacity, which grows by doubling; a
restore into an empty index sizes it at 1.125x the entries):
``seq`` uint64 (8 bytes), ``owner`` int32 (4: an interned (namespace, 16-byte tenant tag) pair),
``rank`` uint32 (4), ``file`` uint16 (2), ``slot`` uint32 (4), ``flag`` uint8 (1: restored by tag and
not adopted yet), ``lp`` int32 (4: the entry's position in the LRU log, -1 = free) = 27 bytes; plus the
hash table, int32, a power of two of at least 4 cells per entry (16-32 bytes per entry), and the LRU
log, int32, at most about twice the entries after compaction (4-12 bytes per entry); freed entry
indexes wait in an int32 stack for reuse.

Identity is exact, never a hash-only match: a hit compares seq_hash, owner (namespace and tenant tag)
and rank. Owners are interned by :class:`.compact_owners.Owners` (tag -> id, the tenant string learned
from the first BlockKey, ids without live entries collected and reused).

Hash table: open addressing, linear probing, position = the top bits of a 64-bit mix of (owner, rank,
seq), load at most 1/4 (so a batch lookup needs few probing rounds); deletion shifts the cluster back
(no tombstones). Batch lookups probe all keys at once (vectorised rounds); a bulk build sorts the
entries by home position (one argsort) and places them with a running maximum. Measured (``kvbm-backend
bench --tier index``, 2-core VM): 65 bytes per entry at 10M entries.

LRU order is a log of entry indexes, oldest first: touching an entry appends it and the older log
position goes stale (``lp[entry]`` no longer points at it); the log is compacted when it fills. This
makes a batch touch (a prefix lookup of 8K blocks) a few array assignments instead of a doubly-linked
list walk. Eviction scans the log from its head, skipping stale and pinned entries.

Semantics are :class:`.index.LruIndex`'s, including TagKey adoption (see that module): a restored entry
whose tenant tag is not a known tenant's (only ``""`` is known at restore) is reported as a
:class:`TagKey` by :meth:`items`/:meth:`evict` until the first ``get``/``in``/``remove``/``put``/
``lookup_prefix`` with the real :class:`BlockKey`, which adopts it (and makes it most recently used).
One difference: identity is unique here, so ``restore`` of a TagKey whose BlockKey is already present
updates that entry (the OrderedDict index would hold both); the pool restores into an empty index only.

Prefix lookup (the scheduler's hot path, 8K blocks < 1 ms is the goal): the first ``FIRST_CHUNK`` (512)
keys, then the rest; a miss in the first chunk (a partial hit) ends the lookup without reading the rest.
A :class:`~kvbm_backend.model.namespace.KeyRun` (what the scheduler passes: one namespace, tenant and
rank, the seq hashes converted to uint64 once, chunk by chunk as probed) is probed straight from its array with
:meth:`~.compact_table.HashTable.find_run` (one owner and rank mixed into every home position in one numpy
pass; per round one table gather and one seq gather): no per-key Python object. A list of BlockKeys
first has its four columns read (one ``zip(*keys)`` pass, ~20 ns per key per pass) and its seq hashes
converted to uint64 (together ~0.7 ms for 8K keys on the loaded 2-core VM); keys of mixed owners probe
with :meth:`~.compact_table.HashTable.find_many`.

Modules: this one holds the API over parts the index owns, each owning its state: :mod:`.compact_entries`
the entry arrays, :mod:`.compact_table` the hash table, :mod:`.compact_lru` the LRU log,
:mod:`.compact_owners` the owners, :class:`.index.SlotPins` the read pins; :mod:`.compact_restore` the bulk
warm-restart builds (functions of those parts); :mod:`.compact_items` the snapshot :meth:`items` returns.

Not thread-safe: the pool holds its lock around every call. A table grow rebuilds the table in one
call (seconds at 10M entries: ``table_grow_s`` of the bench); the pool avoids it with :meth:`reserve`
at open. Entry capacity growth copies the arrays (a memcpy).
"""
from __future__ import annotations

from array import array
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ...model.mix64 import M64 as _M64
from ...model.namespace import BlockKey, DigestKey, KeyRun, key_columns
from .compact_entries import I64, Entries
from .compact_items import Items, live_owners
from .compact_lru import LruLog
from .compact_owners import KNOWN, OWNER_SLACK, Owners  # noqa: F401  (OWNER_SLACK: re-exported)
from .compact_restore import restore_columns, restore_pairs
from .compact_table import _LOAD, _MIN_TAB_BITS, _U, HashTable
from .entry import SCALAR_LOOKUP_KEYS
from .index import SlotPins, TagKey, tag_of

Slot = tuple[int, int]

RESERVE_MAX = 1 << 26  # reserve() sizes the table for at most 64M entries (1 GiB of address space)
FIRST_CHUNK = 512  # lookup_prefix: keys read and probed first (a miss among them ends the lookup there)
_RUN_TYPES = frozenset({BlockKey, DigestKey})  # get_many: key types probed in one batch (a TagKey: key by key)


def _prefix(code: str, col: Sequence[int], dtype: type) -> npt.NDArray[Any]:
    """Array (``array(code)``: ``"Q"`` uint64, ``"I"`` uint32) of the leading items of ``col`` that fit it:
    all of them in the usual case (one conversion, the fastest for 8K ints). The first item that does not (a
    negative or too large int, a float...) ends it: no index entry has such a key, so a lookup's prefix
    ends there (never an OverflowError, and a float is never truncated onto another key)."""
    try:
        return np.frombuffer(array(code, col), dtype)
    except (TypeError, OverflowError):
        m = 0
        for m, x in enumerate(col):  # noqa: B007 - m is the index of the first item that does not fit
            try:
                array(code, (x,))
            except (TypeError, OverflowError):
                break
        return np.frombuffer(array(code, col[:m]), dtype)


def _check(key: "BlockKey | TagKey", slot: Slot) -> None:
    """Before any change: the key's rank and the slot fit the arrays (and the journal's fields)."""
    f, s = slot
    if not (0 <= f <= 0xFFFF and 0 <= s <= 0xFFFFFFFF and 0 <= key.rank <= 0xFFFFFFFF
            and 0 <= key.seq_hash <= _M64):
        raise ValueError(f"index: rank {key.rank}, seq_hash {key.seq_hash}, slot {slot} outside the journal's field "
                         f"widths (rank, slot < 2**32; file < 2**16; seq_hash < 2**64)")



class CompactLruIndex:
    """Key -> (file, slot) in LRU order with read pins, in numpy arrays (see the module docstring).

    Args:
        capacity: initial entry capacity (grows by doubling).
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._owners = Owners()  # interned (namespace, tag) owners; tenant string per owner once known
        self._owner_of = self._owners.find  # (owner id or -1, is a TagKey) of a key; bound once (hot path)
        self._ent = Entries(max(16, int(capacity)))
        self._table = HashTable(self._ent, _MIN_TAB_BITS)
        self._lru = LruLog(self._ent, max(32, 2 * int(capacity)))
        self._pins = SlotPins()
        # hits that moved held entries to the most recently used end (a get with touch, a prefix lookup's hits, an
        # adoption): the journal records none of them, so the pool's close rewrites it in LRU order when this moved
        self.touches = 0

    def reserve(self, n: int) -> None:
        """Size the hash table for ``n`` entries now (at most ``RESERVE_MAX``), so that no ``put`` up to
        ``n`` entries rebuilds it (a rebuild holds the caller for ~0.5 s per 1M entries). The table is
        zero-filled lazily by the OS: untouched cells cost address space, not memory. 4 bytes per cell,
        4 to 8 cells per entry."""
        self._table.reserve(min(int(n), RESERVE_MAX))

    @property
    def nbytes(self) -> int:
        """Bytes held by the index's arrays (entries, hash table, LRU log); interned strings excluded."""
        return self._ent.nbytes + self._table.nbytes + self._lru.nbytes

    # ---- owners and pins ----------------------------------------------------------------------
    @property
    def owners(self) -> int:
        """Interned (namespace, tenant) owners: at most twice those with live entries, plus
        ``OWNER_SLACK`` (:meth:`.compact_owners.Owners.collect`)."""
        return len(self._owners)

    def _gc_owners(self) -> None:
        """Let the owners forget those without a live entry when a collection is due. Called only where
        no owner id is held across the call (:meth:`put` before it interns)."""
        if self._owners.collect_due():
            ent = self._ent
            self._owners.collect(ent.own[:ent.hi][ent.lp[:ent.hi] >= 0])

    def pin(self, slot: Slot) -> None:
        """A reader holds ``slot``: no eviction picks it, and its free waits for the last :meth:`unpin`."""
        self._pins.pin(slot)

    def pin_many(self, slots: Iterable[Slot]) -> None:
        """:meth:`pin` of each slot (a repeated slot is pinned as often)."""
        self._pins.pin_many(slots)

    def unpin(self, slot: Slot) -> Slot | None:
        """Returns the slot if it must be freed now (it was removed while pinned)."""
        return self._pins.unpin(slot)

    @property
    def pinned(self) -> int:
        """Pinned slots."""
        return len(self._pins)

    @property
    def deferred(self) -> int:
        """Removed slots whose free waits for their last unpin."""
        return self._pins.deferred

    # ---- entries ------------------------------------------------------------------------------
    def _new_entry(self, o: int, rank: int, seq: int, slot: Slot, flag: int, p: int) -> int:
        """Insert an absent key (``p``: the empty cell :meth:`HashTable.find` returned for it, valid only
        while the table is not rebuilt)."""
        table, ent = self._table, self._ent
        if _LOAD * (table.n + 1) > table.size:
            table.room(1)
            p = table.find(o, rank, seq)[1]
        e = ent.new()
        ent.vseq[e] = seq
        ent.vown[e] = o
        ent.vrank[e] = rank
        ent.vfile[e] = slot[0]
        ent.vslot[e] = slot[1]
        ent.vflag[e] = flag
        table.put(p, e)
        self._lru.touch(e)
        return e

    def _free_entry(self, e: int, p: int) -> None:
        self._table.delete(p)
        self._ent.release(e)

    def _slot_of(self, e: int) -> Slot:
        ent = self._ent
        return ent.vfile[e], ent.vslot[e]

    def _key_of(self, e: int) -> "BlockKey | TagKey":
        ent = self._ent
        o = ent.vown[e]
        pair = self._owners.pairs[o]
        assert pair is not None  # a live entry's owner is never collected (_gc_owners counts live entries)
        ns, tag = pair
        if ent.vflag[e]:
            return TagKey(ns, tag, ent.vrank[e], ent.vseq[e])
        tenant = self._owners.tenants[o]
        assert tenant is not None  # an entry not flagged was put or adopted by a BlockKey: tenant known
        return BlockKey(ns, tenant, ent.vrank[e], ent.vseq[e])

    def _lookup(self, key: "BlockKey | TagKey") -> tuple[int, int]:
        """(entry or -1, table cell) for a BlockKey (adopting a tag entry: MRU, reported as BlockKey from
        now) or a TagKey (found only while its entry is not adopted, as in the OrderedDict index)."""
        o, is_tag = self._owner_of(key)
        if o < 0:
            return -1, -1
        try:
            e, p = self._table.find(o, key.rank, key.seq_hash)
        except TypeError:  # not an int (a float seq_hash...): no entry has this key
            return -1, -1
        if e < 0:
            return -1, -1
        vflag = self._ent.vflag
        if is_tag:
            return (e, p) if vflag[e] else (-1, -1)
        if vflag[e]:
            vflag[e] = 0
            self._lru.touch(e)
            self.touches += 1
        return e, p

    # ---- the LruIndex API ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self._table.n

    def __contains__(self, key: "BlockKey | TagKey") -> bool:
        return self._lookup(key)[0] >= 0

    def get(self, key: "BlockKey | TagKey", touch: bool = False) -> Slot | None:
        """The (file, slot) of ``key`` or None; ``touch`` makes it most recently used."""
        e = self._lookup(key)[0]
        if e < 0:
            return None
        if touch:
            self._lru.touch(e)
            self.touches += 1
        return self._slot_of(e)

    def put(self, key: BlockKey, slot: Slot) -> None:
        """Map ``key`` to ``slot`` = (file index, slot index) (replacing its slot if present); it becomes
        most recently used.

        Raises:
            ValueError: rank, file or slot index outside the journal's field widths (rank and slot
                < 2**32, file < 2**16) or negative.
        """
        _check(key, slot)
        self._gc_owners()
        o = self._owners.intern(key.namespace, tag_of(key.tenant), key.tenant)
        e, p = self._table.find(o, key.rank, key.seq_hash)
        if e < 0:
            self._new_entry(o, key.rank, key.seq_hash, slot, 0, p)
            return
        ent = self._ent
        ent.vfile[e], ent.vslot[e], ent.vflag[e] = slot[0], slot[1], 0
        self._lru.touch(e)

    def restore(self, key: "BlockKey | TagKey", slot: Slot) -> None:
        """Insert a journal entry (oldest first) at restore: a TagKey of a known tag becomes its BlockKey."""
        if isinstance(key, TagKey):
            tenant = KNOWN.get(key.tag)
            if tenant is None:
                _check(key, slot)
                o = self._owners.intern(key.namespace, key.tag, None)
                e, p = self._table.find(o, key.rank, key.seq_hash)
                if e < 0:
                    self._new_entry(o, key.rank, key.seq_hash, slot, 1, p)
                else:
                    self._ent.vfile[e], self._ent.vslot[e] = slot
                    self._lru.touch(e)
                return
            key = BlockKey(key.namespace, tenant, key.rank, key.seq_hash)
        self.put(key, slot)

    def restore_many(self, entries: Iterable[tuple["BlockKey | TagKey", Slot]]) -> None:
        """:meth:`restore` of each (key, slot), oldest first, in one vectorised build (a repeated key
        keeps its last slot and place).

        Raises:
            ValueError: a rank, file or slot index outside the journal's field widths.
        """
        restore_pairs(self._owners, self._ent, self._table, self._lru, entries)

    def restore_arrays(self, namespace: str, tags: npt.NDArray[Any], ranks: npt.NDArray[Any],
                       seqs: npt.NDArray[Any], files: npt.NDArray[Any], slots: npt.NDArray[Any],
                       tenants: Mapping[bytes, str] | None = None) -> None:
        """Vectorised :meth:`restore` of N journal entries (oldest first; a repeated key keeps its last).

        Args:
            namespace: the namespace fingerprint of every entry.
            tags: (N, 16) uint8, the tenant tags (``tenant_tag``); a tag other than ``""``'s is restored
                as a :class:`TagKey` entry until adopted.
            ranks, seqs, files, slots: (N,) integer arrays (rank < 2**32, seq_hash < 2**64 as uint64,
                file < 2**16, slot < 2**32).
            tenants: tag -> tenant string where known (a version-1 journal names them): those entries are
                restored as BlockKeys.

        Raises:
            ValueError: shapes disagree, or a rank, file or slot index is outside the widths above.
        """
        restore_columns(self._owners, self._ent, self._table, self._lru, namespace, tags, ranks, seqs, files, slots,
                        tenants)

    def lookup_prefix(self, keys: Sequence[BlockKey] | KeyRun, namespace: str | None = None) -> int:
        """How many leading ``keys`` are held (a key of another ``namespace``, when given, ends the
        prefix). The found ones become most recently used, in order (tag entries are adopted), exactly as
        ``get(k, touch=True)`` one by one until the first miss would leave them. ``keys``: BlockKeys, or a
        :class:`KeyRun` (probed from its uint64 array, no per-key object).

        The first ``FIRST_CHUNK`` keys are read and probed first: a miss among them (a partial hit, the
        usual case of a new request) ends the lookup without reading the rest; then the rest in one batch.
        """
        n = len(keys)
        if n == 0:
            return 0
        if type(keys) is KeyRun:
            if namespace is not None and keys.namespace != namespace:
                return 0
            o = self._owner_of(keys)[0]
            if o < 0:
                return 0

            def batch(a: int, b: int) -> int:  # hashes [a, b) converted only now (a partial hit stops early)
                return self._take(self._table.find_run(o, keys.rank, keys.hash_array(b)[a:]))
        elif n <= SCALAR_LOOKUP_KEYS:  # key by key (the pool made their fields ints: .entry)
            i = 0
            for k in keys:
                if (namespace is not None and k.namespace != namespace) or self.get(k, touch=True) is None:
                    break
                i += 1
            return i
        else:
            def batch(a: int, b: int) -> int:
                return self._lookup_batch(keys[a:b], namespace)
        if n <= FIRST_CHUNK + FIRST_CHUNK // 2:
            return batch(0, n)
        m = batch(0, FIRST_CHUNK)
        if m < FIRST_CHUNK:
            return m
        return m + batch(FIRST_CHUNK, n)

    def _lookup_batch(self, keys: Sequence[BlockKey], namespace: str | None) -> int:
        """:meth:`lookup_prefix` of more than 8 BlockKeys in one vectorised pass: the keys' four columns in
        one :func:`key_columns` pass, the seq hashes to uint64 in one conversion; keys of one (namespace,
        tenant, rank), the usual case, probe with :meth:`~.compact_table.HashTable.find_run`."""
        n = len(keys)
        ns_col, ten_col, rank_col, seq_col = key_columns(keys)
        if namespace is not None and ns_col.count(namespace) != n:
            n = next(i for i, s in enumerate(ns_col) if s != namespace)
            if n == 0:
                return 0
            keys = keys[:n]
            ns_col, ten_col, rank_col, seq_col = ns_col[:n], ten_col[:n], rank_col[:n], seq_col[:n]
        seq = _prefix("Q", seq_col, _U)
        ranks = _prefix("I", rank_col, np.uint32)
        if min(len(seq), len(ranks)) < n:  # a key no entry can have (seq_hash or rank out of range): the end
            n = min(len(seq), len(ranks))
            if n == 0:
                return 0
            keys, seq, ranks = keys[:n], seq[:n], ranks[:n]
            ns_col, ten_col, rank_col = ns_col[:n], ten_col[:n], rank_col[:n]
        r0 = rank_col[0]
        if ns_col.count(ns_col[0]) == n and ten_col.count(ten_col[0]) == n and rank_col.count(r0) == n:
            o = self._owner_of(keys[0])[0]  # one owner and rank (a sequence's prefix): the windowed probe
            if o < 0:
                return 0
            return self._take(self._table.find_run(o, int(ranks[0]), seq))
        own = np.fromiter((self._owner_of(k)[0] for k in keys), np.int64, n)
        return self._take(self._table.find_many(own, ranks.astype(np.int64), seq))

    def _take(self, res: I64) -> int:
        """The leading found entries of ``res`` (entries, -1 = absent): adopted and touched in order;
        returns how many."""
        miss = np.flatnonzero(res < 0)
        m = int(miss[0]) if len(miss) else len(res)
        if m:
            es = res[:m]
            self._ent.flag[es] = 0  # adopted (their owners learned the tenant in _owner_of)
            self._lru.touch_many(es)
            self.touches += 1
        return m

    def get_many(self, keys: Sequence[BlockKey], namespace: str | None = None) -> list[Slot | None]:
        """``[get(k, touch=True) for k in keys]`` (None, not looked up, for a key of another ``namespace`` when
        given) with exactly that loop's effects: found entries become most recently used in key order (a repeated
        key at its last place), tag entries are adopted, :attr:`touches` grows as much. More than
        ``SCALAR_LOOKUP_KEYS`` BlockKeys of one namespace, tenant and rank with int seq hashes (a load's keys)
        are probed in one :meth:`~.compact_table.HashTable.find_run`; other lists go key by key (raising what
        ``get`` raises for a non-key). Returns one (file, slot) or None (absent, foreign) per key, in order."""
        if len(keys) > SCALAR_LOOKUP_KEYS:
            got = self._get_run(keys, namespace)
            if got is not None:
                return got
        get = self.get
        return [get(k, touch=True) if namespace is None or k.namespace == namespace else None for k in keys]

    def _get_run(self, keys: Sequence[BlockKey], namespace: str | None) -> list[Slot | None] | None:
        """:meth:`get_many` of keys of one (namespace, tenant, rank) in one batch, or None (nothing done) for
        other keys: a TagKey, mixed columns, a rank or seq hash that is no int in the journal's range."""
        n = len(keys)
        if not set(map(type, keys)) <= _RUN_TYPES:
            return None
        ns_col, ten_col, rank_col, seq_col = key_columns(keys)
        ns0, t0, r0 = ns_col[0], ten_col[0], rank_col[0]
        if (ns_col.count(ns0) != n or ten_col.count(t0) != n or rank_col.count(r0) != n or type(t0) is not str
                or set(map(type, rank_col)) != {int} or set(map(type, seq_col)) != {int} or not 0 <= r0 <= _M64 >> 32):
            return None
        seq = _prefix("Q", seq_col, _U)
        if len(seq) < n:  # a seq hash outside [0, 2**64): key by key (no entry has it)
            return None
        if namespace is not None and ns0 != namespace:
            return [None] * n
        res = self._table.find_run(self._owner_of(keys[0])[0], r0, seq)  # owner -1 (unknown): all absent
        hit = np.flatnonzero(res >= 0)
        m = len(hit)
        if not m:
            return [None] * n
        es = res if m == n else res[hit]
        ent = self._ent
        fl = ent.flag[es]
        adopted = 0
        if fl.any():  # tag entries adopted (the loop's first get of each; their owner learned the tenant above)
            adopted = len(np.unique(es[fl != 0]))
            ent.flag[es] = 0
        self._lru.touch_many(es)  # in key order: the loop's touches leave the same live order
        self.touches += m + adopted
        slots: list[Slot | None] = list(zip(ent.file[es].tolist(), ent.slot[es].tolist()))
        if m == n:
            return slots
        out: list[Slot | None] = [None] * n
        for i, sl in zip(hit.tolist(), slots):
            out[i] = sl
        return out

    def items(self) -> Items:
        """Snapshot of (key, slot) oldest first (an iterable with ``len``); restored keys whose tenant was
        not seen yet are :class:`TagKey`."""
        es, ent = self._lru.live(), self._ent
        pairs, tenants = live_owners(self._owners)
        return Items(list(pairs), list(tenants), ent.own[es], ent.rank[es],
                      ent.seq[es], ent.file[es], ent.slot[es], ent.flag[es])

    def identity(self, key: "BlockKey | TagKey", slot: Slot | None = None) -> tuple[bytes, int, int] | None:
        """``(tenant tag, rank, seq_hash)`` the index holds for ``key``'s entry (what its slot's header
        must name), or None when ``key`` is absent or (``slot`` given) maps to another slot. A G3 read
        that fails checks the stored frame against this, not against the caller's key."""
        e, _ = self._lookup(key)
        if e < 0 or (slot is not None and self._slot_of(e) != tuple(slot)):
            return None
        ent = self._ent
        pair = self._owners.pairs[ent.vown[e]]
        assert pair is not None  # a live entry's owner is never collected
        return pair[1], int(ent.vrank[e]), int(ent.vseq[e])

    def remove(self, key: BlockKey, slot: Slot | None = None) -> Slot | None:
        """Remove ``key`` (only if it still maps to ``slot`` when given). Returns the slot to free now,
        or None (absent, or pinned: freed by the last :meth:`unpin`)."""
        e, p = self._lookup(key)
        if e < 0:
            return None
        s = self._slot_of(e)
        if slot is not None and s != tuple(slot):
            return None
        self._free_entry(e, p)
        return self._pins.release(s)

    def evict(self, n: int) -> list[tuple["BlockKey | TagKey", Slot]]:
        """Remove up to ``n`` least recently used unpinned entries; returns them (oldest first)."""
        out: list[tuple[BlockKey | TagKey, Slot]] = []
        if n <= 0 or not self._table.n:
            return out
        ent, lru = self._ent, self._lru
        pinned = None
        if self._pins:
            pinned = np.array([(f << 32) | s for f, s in self._pins], np.int64)
        victims: list[npt.NDArray[np.int32]] = []
        got = 0
        pos = lru.head
        while got < n and pos < lru.tail:
            end = min(lru.tail, pos + max(4096, 2 * (n - got)))
            cand = lru.live(pos, end)
            if pinned is not None and len(cand):
                code = (ent.file[cand].astype(np.int64) << 32) | ent.slot[cand].astype(np.int64)
                cand = cand[~np.isin(code, pinned)]
            cand = cand[:n - got]
            victims.append(cand)
            got += len(cand)
            pos = end
        vs = np.concatenate(victims).astype(np.int64) if victims else np.empty(0, np.int64)
        if len(vs) < 32:
            for e in vs.tolist():
                key = self._key_of(e)
                s = self._slot_of(e)
                self._free_entry(e, self._table.cell_of(e))
                out.append((key, s))
        else:  # many: keys made from column lists, table cells emptied in one vectorised pass
            owners, tenants = live_owners(self._owners)
            for o, r, q, fl, f, sl in zip(ent.own[vs].tolist(), ent.rank[vs].tolist(), ent.seq[vs].tolist(),
                                          ent.flag[vs].tolist(), ent.file[vs].tolist(), ent.slot[vs].tolist()):
                ns, tag = owners[o]
                out.append((TagKey(ns, tag, r, q) if fl else BlockKey(ns, tenants[o], r, q), (f, sl)))
            self._table.delete_many(vs)
            ent.release_many(vs)
        lru.skip_stale()
        return out
