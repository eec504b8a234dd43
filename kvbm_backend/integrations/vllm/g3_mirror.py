"""The scheduler's copy of the worker's G3 index, when vLLM runs the scheduler and the worker in different
processes (:class:`G3Mirror`); fed by the worker's :class:`~.metadata.KvbmWorkerMeta` reports.

The mirror holds 64-bit fingerprints of :func:`~.metadata.mirror_id` triples in a numpy open-addressing
hash table (:class:`FingerprintSet`, with each entry's rank as a one-bit mask beside it:
:class:`~.rank_masks.RankMasks`): 9 bytes per table cell at TP <= 8, at load 1/4 to 1/2, i.e. 18 to 36 bytes
per block per rank (a Python ``set`` of the triples took ~150+ bytes: ~6 GB for a 10 TB G3 of 256 KiB
rank-blocks, ~0.7-1.4 GB here).
"""
from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import Future
from operator import itemgetter
from typing import Iterable, Sequence

import numpy as np
import xxhash

from ...metrics import TierMetrics
from ...model.mix64 import fmix64, fmix64_v
from ...model.namespace import KeyRun, Namespace, key_columns
from ...pool.base import completed
from ...pool.g3.index import tag_of
from .metadata import KvbmWorkerMeta, snapshot_ranks

_U = np.uint64
_MIN_BITS = 10  # smallest table: 1024 cells (8 KiB)
_pack_rank = struct.Struct("<I").pack
_pack_seq = struct.Struct("<Q").pack
_xxh3_64 = xxhash.xxh3_64_intdigest
_EMPTY_FP = np.zeros(0, _U)
_WIN = np.arange(4, dtype=np.int64)  # FingerprintSet.find's second round: cells read per pending value
_FIRST_CHUNK = 512  # lookup_prefix: keys fingerprinted and probed first (an early miss stops there)
APPLY_CHUNK = 1 << 15  # report entries applied per hold of the mirror's lock (apply)
_seeds: dict[tuple[bytes, int], int] = {}
_GETS = tuple(itemgetter(i) for i in range(3))


def _seed(tag: bytes, rank: int) -> int:
    """xxh3_64 of ``tag || rank (uint32 LE)``, cached (bounded); struct.error for a rank outside uint32."""
    k = (tag, rank)
    c = _seeds.get(k)
    if c is None:
        c = _xxh3_64(tag + _pack_rank(rank))
        if len(_seeds) > 4096:
            _seeds.clear()
        _seeds[k] = c
    return c


def _fmix_v(x: np.ndarray) -> np.ndarray:
    """fmix64 of a uint64 array (:func:`~kvbm_backend.model.mix64.fmix64_v`), in place; 0 results become 1
    (0 marks an empty cell)."""
    fmix64_v(x)
    x[x == 0] = 1
    return x


def fingerprint(tag: bytes, rank: int, seq_hash: int) -> int:
    """64-bit fingerprint of a :func:`~.metadata.mirror_id` triple ``(tenant tag, rank, seq_hash)``:
    ``fmix64(seq_hash ^ xxh3_64(tag || rank (uint32 LE)))`` (fmix64: the splitmix64 finalizer), never 0
    (0 marks an empty cell; 0 becomes 1). The seed depends only on (tag, rank), so a whole prefix is
    fingerprinted in one numpy pass over its sequence hashes (:func:`_fps_cols`), and fmix64 is a
    bijection: two blocks of one tenant and rank never share a fingerprint. A rank or seq_hash outside
    uint32 / uint64 hashes ``xxh3_64(tag || repr((rank, seq_hash)))``.
    """
    try:
        c = _seed(tag, rank)
        _pack_seq(seq_hash)  # range check only
    except struct.error:
        return _xxh3_64(tag + repr((rank, seq_hash)).encode()) or 1
    return fmix64(seq_hash ^ c) or 1



def _fps_cols(tags: Sequence, ranks: Sequence, seqs: Sequence) -> np.ndarray:
    """uint64 :func:`fingerprint` of each ``(tags[i], ranks[i], seqs[i])``, vectorised: one seed per
    distinct (tag, rank) pair, then fmix64 of the sequence hashes in one numpy pass. ``tags`` items are
    tags (bytes) or tenant strings (their tag is ``tag_of(tenant)``)."""
    n = len(seqs)
    if not n:
        return _EMPTY_FP
    t0, r0 = tags[0], ranks[0]
    try:
        seq = np.fromiter(seqs, _U, n)
        if tags.count(t0) == n and ranks.count(r0) == n:
            c: np.uint64 | np.ndarray = _U(_seed(t0 if type(t0) is bytes else tag_of(t0), r0))
        elif ranks.count(r0) == n:  # one rank (a worker's report): a seed per distinct tag
            seed = {t: _seed(t if type(t) is bytes else tag_of(t), r0) for t in set(tags)}
            c = np.fromiter(map(seed.__getitem__, tags), _U, n)
        else:
            seed = {p: _seed(p[0] if type(p[0]) is bytes else tag_of(p[0]), p[1]) for p in set(zip(tags, ranks))}
            c = np.fromiter(map(seed.__getitem__, zip(tags, ranks)), _U, n)
    except (struct.error, OverflowError, TypeError, ValueError):  # a rank or seq_hash outside uint32 / uint64
        return np.fromiter((fingerprint(t if type(t) is bytes else tag_of(t), r, s)
                            for t, r, s in zip(tags, ranks, seqs)), _U, n)
    seq ^= c
    return _fmix_v(seq)


def _fps_of_ids(ids: Sequence[tuple[bytes, int, int]]) -> np.ndarray:
    """uint64 fingerprints of mirror ids (one per id, in order)."""
    if not len(ids):
        return _EMPTY_FP
    if len(ids) > 65536:  # a snapshot: columns by itemgetter (zip(*ids) would hold an iterator per id)
        return _fps_cols(*(list(map(g, ids)) for g in _GETS))
    return _fps_cols(*key_columns(ids))


def _distinct(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (``np.unique`` without its overhead: 50x faster on 1M uint64, numpy 2.3)."""
    if len(a) < 2:
        return a
    b = np.sort(a)
    keep = np.empty(len(b), bool)
    keep[0] = True
    np.not_equal(b[1:], b[:-1], out=keep[1:])
    return b[keep]


def cluster_tails(tab: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
    """The occupied cells of open-addressing table ``tab`` (power-of-two size, 0 = empty) after each just-freed
    cell of ``pos`` up to the next empty one (the rest of its cluster; the tails are disjoint), concatenated, or
    None: what a backward-shift deletion re-places."""
    mask, tails, q = len(tab) - 1, [], pos
    while q.size:
        q = (q + 1) & mask
        q = q[tab[q] != 0]
        if q.size:
            tails.append(q)
    return np.concatenate(tails) if tails else None


def _fps_of_keys(keys: Sequence, namespace: str) -> np.ndarray:
    """:func:`fingerprint` of each key's mirror id, up to (not including) the first key of another
    namespace fingerprint. Keys are BlockKeys (tenant string) or restored tag-only keys (``TagKey``:
    the tag in the tenant's place), both 4-field tuples (namespace, tenant or tag, rank, seq_hash)."""
    if not len(keys):
        return _EMPTY_FP
    ns, tags, ranks, seqs = key_columns(keys)
    n = len(ns)
    if ns.count(namespace) != n:
        n = next(i for i, s in enumerate(ns) if s != namespace)
        tags, ranks, seqs = tags[:n], ranks[:n], seqs[:n]
    return _fps_cols(tags, ranks, seqs)


class FingerprintSet:
    """A set of non-zero 64-bit integers in one numpy ``uint64`` array: open addressing, linear probing.

    A value's home cell is its top ``bits`` bits (the values are hashes); 0 marks an empty cell. The
    table grows by doubling as soon as the load would exceed 1/2 (load after a grow >= 1/4), so memory is
    8 bytes per cell = 16 to 32 bytes per entry at the peak count (:attr:`nbytes`); it never shrinks. Every operation is
    batched and vectorised: probing advances all pending values one cell per round (rounds = the longest
    probe, a few at load <= 1/2). Deletion leaves no tombstones: a batch removal empties the freed cells,
    then takes out and re-inserts the rest of each freed cell's cluster (the entries after it up to the
    next empty cell), the batch form of backward-shift deletion. A subclass with per-cell data beside the
    table (:class:`~.rank_masks.RankMasks`' masks) keeps it with its values through growth and deletion by
    three hooks: :meth:`_new_table`, :meth:`_take`, :meth:`_land`. Not thread-safe.
    """

    def __init__(self, bits: int = _MIN_BITS) -> None:
        self._new_table(max(_MIN_BITS, int(bits)))
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        """Table cells (entries fit while ``2 * len <= capacity``)."""
        return len(self._tab)

    @property
    def nbytes(self) -> int:
        """Bytes held by the table (8 per cell)."""
        return int(self._tab.nbytes)

    @staticmethod
    def _arr(fps) -> np.ndarray:
        fps = np.asarray(fps, _U)
        return np.where(fps == 0, _U(1), fps) if len(fps) and not fps.all() else fps

    def _home(self, fps: np.ndarray) -> np.ndarray:
        return (fps >> _U(64 - self._bits)).astype(np.int64)

    def find(self, fps: np.ndarray) -> np.ndarray:
        """Cell of each value (int64 array of ``fps``' length), -1 where absent (0 is taken as 1)."""
        fps = self._arr(fps)
        out = np.full(len(fps), -1, np.int64)
        if not len(fps) or not self._n:
            return out
        tab, mask = self._tab, len(self._tab) - 1
        pos = self._home(fps)
        v = tab[pos]  # round 1 over every value, without an index array
        hit = v == fps
        out[hit] = pos[hit]
        idx = np.flatnonzero((v != 0) & ~hit)
        f, pos = fps[idx], (pos[idx] + 1) & mask
        if idx.size:  # round 2: the next _WIN cells of each pending value in one gather
            cells = pos[:, None] + _WIN
            cells &= mask
            v = tab[cells]
            hit = v == f[:, None]
            found = hit.any(axis=1)
            r = np.flatnonzero(found)
            out[idx[r]] = cells[r, hit[r].argmax(axis=1)]
            go = np.flatnonzero(~found & (v != 0).all(axis=1))  # no match and no empty cell: probe on
            idx, f, pos = idx[go], f[go], (pos[go] + len(_WIN)) & mask
        while idx.size > 32:
            v = tab[pos]
            hit = v == f
            if hit.any():
                out[idx[hit]] = pos[hit]
            go = (v != 0) & ~hit
            idx, f, pos = idx[go], f[go], (pos[go] + 1) & mask
        if idx.size:  # the last few long probes, one by one
            vt = tab.data  # memoryview(tab)
            for i, x, p in zip(idx.tolist(), f.tolist(), pos.tolist()):
                while True:
                    y = vt[p]
                    if y == x:
                        out[i] = p
                        break
                    if y == 0:
                        break
                    p = (p + 1) & mask
        return out

    def contains(self, fps: np.ndarray) -> np.ndarray:
        """bool array: which values are present."""
        return self.find(fps) >= 0

    def _place(self, fps: np.ndarray, payload: np.ndarray | None = None) -> None:
        """Insert distinct values none of which is present; the table has room for them. ``payload``: an array
        aligned with ``fps`` (a subclass's per-cell data, from :meth:`_take`) handed to :meth:`_land` with the
        cells its values landed in, round by round; None: none."""
        tab, mask = self._tab, len(self._tab) - 1
        pos = self._home(fps)
        f, p = fps, payload
        while f.size:
            e = np.flatnonzero(tab[pos] == 0)
            keep = np.ones(len(f), bool)
            if e.size:
                pe, fe = pos[e], f[e]
                tab[pe] = fe  # values sharing a cell: one write wins; the others see it and move on
                won = e[tab[pe] == fe]
                if p is not None:
                    self._land(pos[won], p[won])
                keep[won] = False
            f, pos = f[keep], (pos[keep] + 1) & mask
            if p is not None:
                p = p[keep]

    def _new_table(self, bits: int) -> None:
        """An empty table of ``2**bits`` cells (a subclass adds its per-cell arrays)."""
        self._bits = bits
        self._tab = np.zeros(1 << bits, _U)

    def _take(self, cells: np.ndarray) -> np.ndarray | None:
        """A subclass's per-cell data of ``cells`` (an index array or a bool mask over the table), emptied
        there, for :meth:`_place` to move with its values; None here (a set has none)."""
        return None

    def _land(self, cells: np.ndarray, payload: np.ndarray) -> None:
        """Write per-cell data ``payload`` into ``cells`` (where :meth:`_place` put its values); never called
        here (no payload)."""

    def _grow_for(self, n: int) -> None:
        bits = self._bits
        while 2 * n > (1 << bits):
            bits += 1
        if bits == self._bits:
            return
        live = self._tab != 0
        vals, payload = self._tab[live], self._take(live)
        self._new_table(bits)
        self._place(vals, payload)

    def add(self, fps: np.ndarray) -> int:
        """Insert values (duplicates and present ones are skipped, 0 is taken as 1); returns how many
        were new."""
        fps = self._arr(fps)
        if not len(fps):
            return 0
        fps = _distinct(fps)
        fps = fps[self.find(fps) < 0]
        if not len(fps):
            return 0
        self._grow_for(self._n + len(fps))
        self._place(fps)
        self._n += len(fps)
        return len(fps)

    def remove(self, fps: np.ndarray) -> int:
        """Delete values (absent ones and duplicates are skipped, 0 is taken as 1); returns how many were
        present."""
        fps = self._arr(fps)
        if not len(fps) or not self._n:
            return 0
        pos = self.find(_distinct(fps))
        return self._delete(pos[pos >= 0])

    def _delete(self, pos: np.ndarray) -> int:
        """Empty cells ``pos`` (distinct, occupied), then take out and re-place the rest of each one's cluster
        (:func:`cluster_tails`) with its per-cell data: backward-shift deletion in batch. Returns ``len(pos)``."""
        if not len(pos):
            return 0
        tab = self._tab
        tab[pos] = 0
        self._take(pos)
        self._n -= len(pos)
        t = cluster_tails(tab, pos)
        if t is not None:
            vals, payload = tab[t], self._take(t)
            tab[t] = 0
            self._place(vals, payload)
        return len(pos)

    def values(self) -> np.ndarray:
        """The values (uint64 array, table order)."""
        return self._tab[self._tab != 0]


class G3Mirror:
    """The scheduler's view of the worker's G3 index when the worker runs in another process.

    Fed by :class:`KvbmWorkerMeta` reports (blocks published, blocks that failed to load, and a first
    snapshot of the restored index). It can be stale only towards "present": a block the worker has
    since evicted is planned, fails to load, is recomputed (never wrong KV) and reported removed.

    Memory: one 64-bit :func:`fingerprint` per (tenant tag, rank, seq_hash) in a
    :class:`~.rank_masks.RankMasks` (its rank as a one-bit mask in a parallel array, so that a snapshot can
    drop one rank's entries): 9 bytes per cell at TP <= 8 (10 at <= 16, 12 at <= 32, 16 at <= 64), 18 to 36
    bytes per block per rank at the peak count at TP <= 8 (``stats()["bytes"]``), no Python object per entry.

    Fingerprint collisions (never between two blocks of one tenant and rank: :func:`fingerprint` is a
    bijection of the sequence hash for a fixed (tag, rank)): two distinct ids with the same fingerprint count
    as one block (``len``), and a
    block the worker does not hold can look present. That can only make the scheduler plan a load of a
    block the worker does not have: the worker's load misses and the block is recomputed (never wrong KV:
    the worker verifies every frame it loads). With n blocks mirrored, the probability that any two of them
    collide is about n^2 / 2^65 (3e-6 at 10M blocks, 4e-5 at 40M); one lookup of a block the worker does
    not hold falsely hits with probability about n / 2^64.

    Thread-safe: every call holds the mirror's lock around its table operations.
    """

    tier = "G3"

    def __init__(self, namespace: Namespace, registry=None):
        self.fp = namespace.fingerprint
        layout = getattr(namespace, "layout", None)  # tokens per block, for kvbm_matched_tokens (0: not known)
        self._page = int(getattr(layout, "page_size", 0) or 0)
        self._world = int(getattr(namespace, "tp_world_size", 1) or 1)
        from .rank_masks import RankMasks  # here: rank_masks builds on this module's FingerprintSet
        # fingerprints of metadata.mirror_id (tenant tag, rank, seq_hash), with the rank as a bitmask (one bit)
        self._set = RankMasks(self._world)
        self._lock = threading.Lock()
        self.ready = False
        self._snap_ranks: set[int] = set()  # TP ranks whose first report (snapshot) came by the channel
        self._snapped: set[int] = set()  # TP ranks whose snapshot was applied (by either way)
        self.lookup_blocks = self.lookup_hits = 0
        # the scheduler's G3 lookups happen here, not in the worker's pool: their series are counted here
        # (kvbm_matched_tokens, kvbm_disk_cache_hit_rate; served with the worker's by metrics.port)
        self.metrics = TierMetrics("g3", registry)

    def apply(self, meta: KvbmWorkerMeta, rank: int | None = None) -> None:
        """Apply one worker report: ``meta.removed`` first, then ``meta.added``. ``meta.snapshot`` marks the
        mirror ready: at once for a step's report (``rank`` None: vLLM aggregated every TP rank's), else once
        every TP rank's snapshot came (reports by the channel travel per rank; a lookup before the last
        rank's snapshot would miss its blocks). A snapshot of a rank that sent one before (the report channel
        failed and lost a report: the rank's reports went back to the step output with a new snapshot; the
        ranks are ``rank`` or ``meta.snap_ranks``, :func:`~.metadata.snapshot_ranks`) first drops every entry
        of that rank, so removals the lost report carried do not stay present (before 2026-11-30 they did:
        their loads missed and recomputed)."""
        rem = _fps_of_ids(meta.removed)
        add = _fps_of_ids(meta.added)
        snap = snapshot_ranks(meta, rank)
        ranks = [i[1] for i in meta.added]
        with self._lock:
            for r in snap:
                if r in self._snapped:
                    self._set.drop_rank(r)
            self._snapped.update(snap)
        # The lock a lookup (on the scheduler's thread) needs is held for APPLY_CHUNK entries at a time (before
        # 2026-12-02 for the whole report: 0.46 s for a 1M-block snapshot on the 2-core VM, every lookup and so
        # every scheduler step waiting). A lookup between two chunks misses the blocks not applied yet: a
        # recompute, never wrong KV; before the first snapshot's end the mirror is not ready (its lookups wait).
        for i in range(0, len(rem), APPLY_CHUNK):
            if i:
                time.sleep(0)  # a waiting lookup gets the lock (a released Lock is not handed over)
            with self._lock:
                self._set.remove(rem[i:i + APPLY_CHUNK])
        for i in range(0, len(add), APPLY_CHUNK):
            if i or len(rem) > APPLY_CHUNK:
                time.sleep(0)
            part, pr = add[i:i + APPLY_CHUNK], ranks[i:i + APPLY_CHUNK]
            ok = [j for j, r in enumerate(pr) if 0 <= r < self._world] if (
                min(pr) < 0 or max(pr) >= self._world) else None
            with self._lock:
                if ok is None:
                    self._set.set_bits(part, pr)
                else:  # a rank outside [0, world): present with no rank bit (never dropped by a snapshot)
                    self._set.add(part)
                    if ok:
                        self._set.set_bits(part[ok], [pr[j] for j in ok])
        with self._lock:
            if meta.snapshot:
                if rank is not None:
                    self._snap_ranks.add(rank)
                if rank is None or len(self._snap_ranks) >= self._world:
                    self.ready = True

    def __len__(self) -> int:
        """Blocks (per rank) mirrored: distinct fingerprints."""
        return len(self._set)

    def lookup_prefix(self, keys: Iterable, *, request: bool = True) -> Future:
        """Future of how many leading ``keys`` the worker's G3 holds (:meth:`_lookup`), counted as the
        pool counts its own lookups (``lookup_blocks`` / ``lookup_hits``, ``kvbm_matched_tokens``,
        ``kvbm_disk_cache_hit_rate``) unless ``request`` is False (see :class:`~kvbm_backend.pool.base.BlockPool`)."""
        if not isinstance(keys, (list, tuple, KeyRun)):
            keys = list(keys)
        n = self._lookup(keys)
        if request:
            self.count_lookup(len(keys), n)
        return completed(n)

    def count_lookup(self, requested: int, found: int) -> None:
        """Count a request's lookup settled elsewhere (:meth:`~kvbm_backend.pool.base.BlockPool.count_lookup`)."""
        with self._lock:
            self.lookup_blocks += requested
            self.lookup_hits += found
        self.metrics.matched_tokens.inc(found * self._page)
        self.metrics.hit_rate.record(requested, found)

    def _lookup(self, keys) -> int:
        """How many leading ``keys`` (BlockKeys, or a :class:`KeyRun`: fingerprinted straight
        from its uint64 array) the worker's G3 holds, in blocks; the prefix stops at the first absent key
        or key of another namespace fingerprint. The first ``_FIRST_CHUNK`` keys are fingerprinted (one
        numpy pass) and probed first, so that an early miss costs little; then chunks 16 times bigger (an
        8K-key prefix: two chunks). Each chunk is looked up under the lock (a report applied between two
        chunks can be seen by the later one)."""
        if type(keys) is KeyRun:  # fingerprints straight from the run's uint64 hashes: one seed, one pass
            if keys.namespace != self.fp:
                return 0
            c = _U(_seed(tag_of(keys.tenant), keys.rank))

            def fps_of(a: int, b: int) -> np.ndarray:
                return _fmix_v(keys.hash_array(b)[a:] ^ c)
        else:
            if not isinstance(keys, (list, tuple)):
                keys = list(keys)

            def fps_of(a: int, b: int) -> np.ndarray:
                return _fps_of_keys(keys[a:b] if a or b < len(keys) else keys, self.fp)
        n, total, chunk = 0, len(keys), _FIRST_CHUNK
        while n < total:
            b = min(total, n + chunk)
            fps = fps_of(n, b)
            if not len(fps):
                break
            with self._lock:
                miss = np.flatnonzero(self._set.find(fps) < 0)
            if miss.size:
                return n + int(miss[0])
            if len(fps) < b - n:  # a key of another namespace ends the prefix
                return n + len(fps)
            n = b
            chunk *= 16
        return n

    def stats(self) -> dict:
        """``blocks``: mirrored blocks; ``bytes``: the fingerprint table's bytes; ``ready``: the worker's
        first report (snapshot) applied; ``lookup_blocks`` / ``lookup_hits`` / ``hit_rate``: the
        scheduler's G3 lookups (blocks asked for, found, their ratio)."""
        with self._lock:
            lb, lh = self.lookup_blocks, self.lookup_hits
            return {"tier": "G3", "mirror": True, "blocks": len(self._set), "ready": self.ready,
                    "bytes": self._set.nbytes, "lookup_blocks": lb, "lookup_hits": lh,
                    "hit_rate": lh / lb if lb else 0.0}

    def flush(self, timeout: float | None = None) -> bool:
        """True at once: the mirror queues no offloads (the worker's G3 pool, in its own process, writes
        them and flushes them at its shutdown). Part of the pool surface the connector's shutdown uses."""
        return True

    def close(self) -> None:
        return
