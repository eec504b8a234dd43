"""The blocks a gc pass deletes by age or revocation (:func:`.gc.run_gc`), remembered exactly and compactly, so that a listing naming one again (an S3-compatible server repeating a page, a
file store's directory read while it changes) counts it once (:func:`.gc.run_gc`, module doc "Repeated listings"):
in ``scanned_*``, ``remaining_bytes`` and ``deleted_*``, a dry run's report included, and it is not deleted (nor its
frame header read) twice. Before 2026-12-03 an age or revoked pass kept nothing per block: a dry run counted a
repeated block's object and bytes twice, and so did a real run on a store that lists no versions (the delete by
name of a gone object succeeds), a real run on the others counting the repeat of a deleted block
``changed_since_listed`` and its bytes twice in ``scanned_bytes`` and ``remaining_bytes``.

Each name is kept as its xxh3_128 (two 64-bit words: a false match needs a 128-bit collision, ~10^-23 at 50M
names), first in a set, then, every :data:`NameSet.RUN` names, in sorted numpy runs merged as they grow (at most
~log2(n / RUN) + 1 runs): ~16 bytes per name once in runs (~0.8 GB for 50M blocks deleted in one pass, up to ~2.5
times that while the largest runs merge), where a set of the names themselves would take ~150.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

MASK64 = (1 << 64) - 1


class NameSet:
    """Names (str), exactly as far as 128-bit hashes tell (module doc). Not thread-safe."""

    RUN = 1 << 13  # names gathered in the set (~70 bytes each) before they go into a sorted run

    def __init__(self) -> None:
        self._new: set[int] = set()  # xxh3_128 of the names not yet in a run
        self._runs: list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = []  # (high words sorted, low)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def nbytes(self) -> int:
        """Bytes the runs hold (the set of the newest names aside: ~70 bytes each, at most :data:`RUN`)."""
        return sum(hi.nbytes + lo.nbytes for hi, lo in self._runs)

    @staticmethod
    def _key(name: str) -> int:
        return xxhash.xxh3_128_intdigest(name.encode("utf-8", "surrogateescape"))

    def __contains__(self, name: str) -> bool:
        if not self._n:
            return False
        k = self._key(name)
        if k in self._new:
            return True
        hi, lo = np.uint64(k >> 64), np.uint64(k & MASK64)
        for his, los in self._runs:
            i = int(his.searchsorted(hi))
            while i < len(his) and his[i] == hi:
                if los[i] == lo:
                    return True
                i += 1
        return False

    def add(self, name: str) -> bool:
        """Remember ``name``; True when it was not remembered before."""
        if name in self:
            return False
        self._new.add(self._key(name))
        self._n += 1
        if len(self._new) >= self.RUN:
            self._flush()
        return True

    def _flush(self) -> None:
        hi = np.fromiter((k >> 64 for k in self._new), dtype=np.uint64, count=len(self._new))
        lo = np.fromiter((k & MASK64 for k in self._new), dtype=np.uint64, count=len(self._new))
        self._new = set()
        while self._runs and len(self._runs[-1][0]) <= len(hi):  # merged with the runs no larger than it
            h, l_ = self._runs.pop()
            hi, lo = np.concatenate((h, hi)), np.concatenate((l_, lo))
            del h, l_
        order = np.argsort(hi)
        self._runs.append((hi[order], lo[order]))
