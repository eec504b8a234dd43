""":class:`Items`: a snapshot of the compact G3 index's entries in LRU order, oldest first (what ``items()``
returns: iterated as (key, slot) pairs, or read as journal columns by a journal rewrite), and
:func:`live_owners`, the owners' lists as read for live entries. A part of :mod:`.compact_index`.
"""
from __future__ import annotations

from typing import Any, Iterator, cast

import numpy as np
import numpy.typing as npt

from ...model.namespace import BlockKey
from .compact_owners import Owners
from .compact_table import U64
from .index import TagKey
from .journal_columns import JournalColumns

Slot = tuple[int, int]


def live_owners(owners: Owners) -> tuple[list[tuple[str, bytes]], list[str]]:
    """``owners.pairs`` and ``owners.tenants`` as read for live entries: a live entry's owner id is never
    collected (its pair is not None: :meth:`~.compact_index.CompactLruIndex._gc_owners` counts live
    entries), and an entry not flagged as a tag entry has its tenant known (put or adopted by a BlockKey,
    or the known ``""``). Typed so once per batch instead of a check per entry (millions at a journal
    rewrite)."""
    return cast(list[tuple[str, bytes]], owners.pairs), cast(list[str], owners.tenants)


class Items:
    """Snapshot of (key, slot) pairs, oldest first (arrays copied at creation; keys made lazily)."""

    def __init__(self, owners: list[tuple[str, bytes]], tenants: list[str], own: npt.NDArray[np.int32],
                 rank: npt.NDArray[np.uint32], seq: U64, file: npt.NDArray[np.uint16], slot: npt.NDArray[np.uint32],
                 flag: npt.NDArray[np.uint8]) -> None:
        self._owners, self._tenants = owners, tenants
        self._a: tuple[npt.NDArray[Any], ...] = (own, rank, seq, file, slot, flag)

    def __len__(self) -> int:
        return len(self._a[0])

    def __iter__(self) -> Iterator[tuple["BlockKey | TagKey", Slot]]:
        owners, tenants = self._owners, self._tenants
        n = len(self)
        for c0 in range(0, n, 65536):
            cols = [a[c0:c0 + 65536].tolist() for a in self._a]
            for o, r, s, f, sl, fl in zip(*cols):
                ns, tag = owners[o]
                if fl:
                    yield TagKey(ns, tag, r, s), (f, sl)
                else:
                    yield BlockKey(ns, tenants[o], r, s), (f, sl)

    def __getitem__(self, i: int) -> tuple["BlockKey | TagKey", Slot]:
        return list(self)[i]

    def columns(self) -> JournalColumns:
        """The snapshot as journal columns (tenant tags, ranks, sequence hashes, files, slots), oldest first:
        what a journal rewrite encodes, without a key object per entry."""
        own, rank, seq, file, slot, _flag = self._a
        otags = np.frombuffer(b"".join(p[1] if p is not None else bytes(16) for p in self._owners), np.uint8)
        return JournalColumns(otags.reshape(-1, 16)[own], rank.astype(np.uint32), seq.astype(np.uint64),
                              file.astype(np.uint16), slot.astype(np.uint32))
