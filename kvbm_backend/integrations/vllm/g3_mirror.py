"""The scheduler's copy of the worker's G3 index, when vLLM runs the scheduler and the worker in different
processes (:class:`G3Mirror`); fed by the worker's :class:`~.metadata.KvbmWorkerMeta` reports.

The mirror holds 64-bit fingerprints of :func:`~.metadata.mirror_id` triples in a numpy open-addressing
hash set (:class:`FingerprintSet`): 8 bytes per table cell at load 1/4 to 1/2, i.e. 16 to 32 bytes per
block per rank (a Python ``set`` of the triples took ~150+ bytes: ~6 GB for a 10 TB G3 of 256 KiB
rank-blocks, ~0.6-1.2 GB here).
"""
from __future__ import annotations

import struct
import threading
from concurrent.futures import Future
from typing import Iterable, Sequence

import numpy as np
import xxhash

from ...model.namespace import BlockKey, Namespace
from ...pool.base import completed
from ...pool.g3.index import tag_of
from .metadata import KvbmWorkerMeta

_U = np.uint64
_MIN_BITS = 10  # smallest table: 1024 cells (8 KiB)
_pack_rank_seq = struct.Struct("<IQ").pack
_xxh3_64 = xxhash.xxh3_64_intdigest
_EMPTY_FP = np.zeros(0, _U)


def fingerprint(tag: bytes, rank: int, seq_hash: int) -> int:
    """64-bit fingerprint of a :func:`~.metadata.mirror_id` triple ``(tenant tag, rank, seq_hash)``:
    xxh3_64 of ``tag || rank (uint32 LE) || seq_hash (uint64 LE)``, never 0 (0 marks an empty cell; a
    hash of 0 becomes 1). A rank or seq_hash outside those widths hashes ``tag || repr((rank, seq_hash))``.
    """
    try:
        b = tag + _pack_rank_seq(rank, seq_hash)
    except struct.error:
        b = tag + repr((rank, seq_hash)).encode()
    return _xxh3_64(b) or 1


def _fps_of_ids(ids: Sequence[tuple[bytes, int, int]]) -> np.ndarray:
    """uint64 fingerprints of mirror ids (one per id, in order)."""
    if not ids:
        return _EMPTY_FP
    try:  # fingerprint() inlined: the snapshot report holds every block of the worker's G3
        fps = np.array([_xxh3_64(t + _pack_rank_seq(r, s)) for t, r, s in ids], _U)
    except struct.error:  # a rank or seq_hash outside uint32 / uint64
        return np.fromiter((fingerprint(t, r, s) for t, r, s in ids), _U, len(ids))
    fps[fps == 0] = 1
    return fps


def _distinct(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values (``np.unique`` without its overhead: 50x faster on 1M uint64, numpy 2.3)."""
    if len(a) < 2:
        return a
    b = np.sort(a)
    keep = np.empty(len(b), bool)
    keep[0] = True
    np.not_equal(b[1:], b[:-1], out=keep[1:])
    return b[keep]


def _fp_of_key(k) -> int:
    """:func:`fingerprint` of a key's :func:`~.metadata.mirror_id` (a BlockKey or a tag-only key)."""
    tag = getattr(k, "tag", None)
    if tag is None:
        tag = tag_of(k.tenant)
    return fingerprint(tag, k.rank, k.seq_hash)


def _fps_of_keys(keys: Sequence, namespace: str) -> list[int]:
    """:func:`fingerprint` of each key's mirror id, up to (not including) the first key of another
    namespace fingerprint. Same values as :func:`_fp_of_key`; BlockKeys take a faster inlined path."""
    out: list[int] = []
    app = out.append
    tags: dict[str, bytes] = {}
    for k in keys:
        if k.namespace != namespace:
            break
        if type(k) is not BlockKey:
            app(_fp_of_key(k))
            continue
        t = tags.get(k.tenant)
        if t is None:
            t = tags[k.tenant] = tag_of(k.tenant)
        try:
            app(_xxh3_64(t + _pack_rank_seq(k.rank, k.seq_hash)) or 1)
        except struct.error:
            app(fingerprint(t, k.rank, k.seq_hash))
    return out


class FingerprintSet:
    """A set of non-zero 64-bit integers in one numpy ``uint64`` array: open addressing, linear probing.

    A value's home cell is its top ``bits`` bits (the values are hashes); 0 marks an empty cell. The
    table grows by doubling as soon as the load would exceed 1/2 (load after a grow >= 1/4), so memory is
    8 bytes per cell = 16 to 32 bytes per entry at the peak count (:attr:`nbytes`); it never shrinks. Every operation is
    batched and vectorised: probing advances all pending values one cell per round (rounds = the longest
    probe, a few at load <= 1/2). Deletion leaves no tombstones: a batch removal empties the freed cells,
    then takes out and re-inserts the rest of each freed cell's cluster (the entries after it up to the
    next empty cell), the batch form of backward-shift deletion. Not thread-safe.
    """

    def __init__(self, bits: int = _MIN_BITS) -> None:
        self._bits = max(_MIN_BITS, int(bits))
        self._tab = np.zeros(1 << self._bits, _U)
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
        idx = np.arange(len(fps))
        pos = self._home(fps)
        f = fps
        while idx.size:
            v = tab[pos]
            hit = v == f
            if hit.any():
                out[idx[hit]] = pos[hit]
            go = (v != 0) & ~hit
            idx, f, pos = idx[go], f[go], (pos[go] + 1) & mask
        return out

    def contains(self, fps: np.ndarray) -> np.ndarray:
        """bool array: which values are present."""
        return self.find(fps) >= 0

    def _place(self, fps: np.ndarray) -> None:
        """Insert distinct values none of which is present; the table has room for them."""
        tab, mask = self._tab, len(self._tab) - 1
        pos = self._home(fps)
        f = fps
        while f.size:
            e = np.flatnonzero(tab[pos] == 0)
            keep = np.ones(len(f), bool)
            if e.size:
                pe, fe = pos[e], f[e]
                tab[pe] = fe  # values sharing a cell: one write wins; the others see it and move on
                keep[e[tab[pe] == fe]] = False
            f, pos = f[keep], (pos[keep] + 1) & mask

    def _grow_for(self, n: int) -> None:
        bits = self._bits
        while 2 * n > (1 << bits):
            bits += 1
        if bits == self._bits:
            return
        vals = self._tab[self._tab != 0]
        self._bits = bits
        self._tab = np.zeros(1 << bits, _U)
        self._place(vals)

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
        pos = pos[pos >= 0]
        if not len(pos):
            return 0
        tab, mask = self._tab, len(self._tab) - 1
        tab[pos] = 0
        self._n -= len(pos)
        # The rest of each freed cell's cluster (up to the next empty or freed cell: the tails are disjoint)
        tails, q = [], pos
        while q.size:
            q = (q + 1) & mask
            q = q[tab[q] != 0]
            if q.size:
                tails.append(q)
        if tails:
            t = np.concatenate(tails)
            vals = tab[t]
            tab[t] = 0
            self._place(vals)
        return len(pos)

    def values(self) -> np.ndarray:
        """The values (uint64 array, table order)."""
        return self._tab[self._tab != 0]


class G3Mirror:
    """The scheduler's view of the worker's G3 index when the worker runs in another process.

    Fed by :class:`KvbmWorkerMeta` reports (blocks published, blocks that failed to load, and a first
    snapshot of the restored index). It can be stale only towards "present": a block the worker has
    since evicted is planned, fails to load, is recomputed (never wrong KV) and reported removed.

    Memory: one 64-bit :func:`fingerprint` per (tenant tag, rank, seq_hash) in a :class:`FingerprintSet`,
    16 to 32 bytes per block per rank at the peak count (``stats()["bytes"]``), no Python object per entry.

    Fingerprint collisions: two distinct ids with the same fingerprint count as one block (``len``), and a
    block the worker does not hold can look present. That can only make the scheduler plan a load of a
    block the worker does not have: the worker's load misses and the block is recomputed (never wrong KV:
    the worker verifies every frame it loads). With n blocks mirrored, the probability that any two of them
    collide is about n^2 / 2^65 (3e-6 at 10M blocks, 4e-5 at 40M); one lookup of a block the worker does
    not hold falsely hits with probability about n / 2^64.

    Thread-safe: every call holds the mirror's lock around its table operations.
    """

    tier = "G3"

    def __init__(self, namespace: Namespace):
        self.fp = namespace.fingerprint
        self._set = FingerprintSet()  # fingerprints of metadata.mirror_id: (tenant tag, rank, seq_hash)
        self._lock = threading.Lock()
        self.ready = False

    def apply(self, meta: KvbmWorkerMeta) -> None:
        """Apply one worker report: ``meta.removed`` first, then ``meta.added``; ``meta.snapshot`` marks
        the mirror ready."""
        rem = _fps_of_ids(meta.removed)
        add = _fps_of_ids(meta.added)
        with self._lock:
            self._set.remove(rem)
            self._set.add(add)
            if meta.snapshot:
                self.ready = True

    def __len__(self) -> int:
        """Blocks (per rank) mirrored: distinct fingerprints."""
        return len(self._set)

    def lookup_prefix(self, keys: Iterable) -> Future:
        """Future of how many leading ``keys`` (BlockKeys) the worker's G3 holds, in blocks; the prefix
        stops at the first absent key or key of another namespace fingerprint. Fingerprints are computed in
        growing chunks (64, 256, ... keys) so that an early miss costs little; each chunk is looked up
        under the lock (a report applied between two chunks can be seen by the later one)."""
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        n, total, chunk = 0, len(keys), 64
        while n < total:
            part = keys[n:n + chunk]
            fps = _fps_of_keys(part, self.fp)
            if not fps:
                break
            with self._lock:
                miss = np.flatnonzero(self._set.find(np.array(fps, _U)) < 0)
            if miss.size:
                return completed(n + int(miss[0]))
            n += len(fps)
            if len(fps) < len(part):
                break
            chunk *= 4
        return completed(n)

    def stats(self) -> dict:
        """``blocks``: mirrored blocks; ``bytes``: the fingerprint table's bytes; ``ready``: the worker's
        first report (snapshot) applied."""
        with self._lock:
            return {"tier": "G3", "mirror": True, "blocks": len(self._set), "ready": self.ready,
                    "bytes": self._set.nbytes}

    def close(self) -> None:
        return
