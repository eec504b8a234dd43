"""Which TP ranks' G3 hold a block, for the KV events (:class:`~.kv_events.G3KvEvents`): :class:`RankMasks`, a
numpy map from a 64-bit block fingerprint (:func:`block_fps`) to a bitmask of ranks.

Before 2026-11-30 the events kept ``dict[(tag, seq_hash), set[rank]]``: ~357 bytes per block reported at
TP=2 (tracemalloc, 200k blocks), 4-14 GB in vLLM's scheduler process for a G3 of 10-40M blocks, most of
them restored blocks no request asks for. Here: 8 bytes of fingerprint plus 1 (TP <= 8), 2 (<= 16),
4 (<= 32) or 8 (<= 64) bytes of mask per table cell, at load 1/4 to 1/2 (18 to 36 bytes per block at TP <= 8).
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Sequence

import numpy as np

from .g3_mirror import _U, FingerprintSet, _distinct, _fps_cols

_TAG, _RANK, _SEQ = itemgetter(0), itemgetter(1), itemgetter(2)


def block_fps(tags: Sequence, seqs: Sequence) -> np.ndarray:
    """uint64 fingerprints of blocks ``(tags[i], seqs[i])`` (tenant tag, KVBM seq_hash), rank-independent:
    the G3 mirror's :func:`~.g3_mirror.fingerprint` with rank 0. A bijection of the sequence hash for one
    tenant, so only blocks of two different tenants can share a fingerprint (about n^2 / 2^65 for n blocks)."""
    if not isinstance(tags, list):
        tags = list(tags)
    return _fps_cols(tags, [0] * len(tags), seqs)


def report_columns(entries: Sequence[tuple[bytes, int, int]]) -> tuple[list, list, list]:
    """``(tags, ranks, seq_hashes)`` of a report's ``(tenant tag, rank, seq_hash)`` entries."""
    return list(map(_TAG, entries)), list(map(_RANK, entries)), list(map(_SEQ, entries))


def _dtype(tp: int) -> Any:
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if tp <= 8 * np.dtype(dt).itemsize:
            return dt
    return object  # TP > 64: Python ints in an object array (not small, but correct)


class RankMasks(FingerprintSet):
    """Non-zero 64-bit fingerprints -> bitmask of TP ranks (bit ``r``: rank ``r``), with the fingerprints in a
    :class:`~.g3_mirror.FingerprintSet` table and the masks in a parallel array (moved with their
    fingerprints on growth and deletion, through the set's per-cell hooks; :meth:`remove` deletes
    fingerprints and their masks). A fingerprint whose mask becomes 0 is deleted. Not thread-safe."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self._dt = _dtype(tp)
        super().__init__()

    @property
    def nbytes(self) -> int:
        """Bytes held by the fingerprint and mask tables."""
        return int(self._tab.nbytes) + (int(self._val.nbytes) if self._dt is not object else 8 * len(self._val))

    def _rank_bits(self, ranks: Sequence[int]) -> np.ndarray:
        if self._dt is object:
            return np.array([1 << r for r in ranks], object)
        return np.left_shift(np.ones(len(ranks), self._dt), np.asarray(ranks, self._dt))

    # the masks move with their fingerprints through FingerprintSet's growth and deletion (its per-cell hooks)
    def _new_table(self, bits: int) -> None:
        super()._new_table(bits)
        self._val = np.zeros(len(self._tab), self._dt)

    def _take(self, cells: np.ndarray) -> np.ndarray:
        v = self._val[cells]
        self._val[cells] = 0
        return v

    def _land(self, cells: np.ndarray, payload: np.ndarray) -> None:
        self._val[cells] = payload

    def masks(self, fps: np.ndarray) -> list:
        """The mask of each fingerprint (Python ints; 0 where absent)."""
        cells = self.find(fps)
        out = np.zeros(len(cells), self._dt)
        hit = cells >= 0
        out[hit] = self._val[cells[hit]]
        return out.tolist()

    def set_bits(self, fps: np.ndarray, ranks: Sequence[int]) -> None:
        """Add rank ``ranks[i]`` (0 <= rank < tp) to the mask of ``fps[i]``, inserting absent fingerprints."""
        if not len(fps):
            return
        self.add(fps)  # absent ones with an empty mask
        np.bitwise_or.at(self._val, self.find(fps), self._rank_bits(ranks))

    def clear_bits(self, fps: np.ndarray, ranks: Sequence[int]) -> None:
        """Take rank ``ranks[i]`` out of the mask of ``fps[i]``; a fingerprint left with no rank is deleted."""
        if not len(fps) or not self._n:
            return
        cells = self.find(fps)
        hit = np.flatnonzero(cells >= 0)
        if not hit.size:
            return
        cells = cells[hit]
        np.bitwise_and.at(self._val, cells, ~self._rank_bits([ranks[i] for i in hit.tolist()]))
        cells = _distinct(cells)
        self._delete(cells[self._val[cells] == 0])

    def drop_rank(self, r: int) -> np.ndarray:
        """Take rank ``r`` out of every mask (a vectorised scan of the whole table: for the rare snapshot that
        replaces a rank's entries); a fingerprint left with no rank is deleted. Returns the fingerprints whose
        mask had rank ``r`` (uint64 array; empty for a rank outside ``[0, tp)``)."""
        if not self._n or not 0 <= r < self.tp:
            return np.zeros(0, _U)
        bit = 1 << r
        if self._dt is object:
            cells = np.flatnonzero(np.fromiter((bool(v & bit) for v in self._val), bool, len(self._val)))
            for c in cells.tolist():
                self._val[c] &= ~bit
        else:
            dt = self._dt
            cells = np.flatnonzero(self._val & dt(bit))
            self._val[cells] &= dt(~bit & ((1 << 8 * np.dtype(dt).itemsize) - 1))
        fps = self._tab[cells].copy()
        self._delete(cells[self._val[cells] == 0])
        return fps
