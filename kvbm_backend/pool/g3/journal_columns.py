"""The G3 journal's version-2/3 records as numpy columns: replay and encoding without a Python object per block.

A warm restart replays every record and the pool then rewrites the journal with one record per held block; a
compaction (off the pool's lock, beside serving) writes that many again. One Python object and ``struct`` call
per record made both ~9 us a block (18 s and a GIL held that long per million blocks). Here the records are read
as one structured array (the record layout of :mod:`.journal`: ``<B H I Q I 16s Q>``, 43 bytes, docs/format.md
"G3 journal"), replayed with sorts, and encoded from the index's columns; the only per-record Python left is
the record check, one ``xxh3_64`` call over each record's 35 leading bytes (xxhash has no batch form).

Replay rule (the same as :func:`.journal._apply`, which replays version 1 and is the reference the tests hold
this to): records apply in order, the last record of a key wins (a DEL removes it) and a PUT takes its slot from
whichever key held it. So a PUT survives exactly when no later record names its key and no later PUT names its
slot (two live keys never share a slot: a PUT removes the slot's previous holder), and survivors keep the order
of their PUTs (oldest first: LRU order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import numpy.typing as npt
import xxhash

from ...model.mix64 import fmix64_v
from ...model.namespace import BlockKey
from .index import TagKey, tag_of

PUT, DEL = 1, 2
RECORD = np.dtype([("kind", "u1"), ("file", "<u2"), ("slot", "<u4"), ("seq", "<u8"), ("rank", "<u4"),
                   ("tag", "u1", (16,)), ("sum", "<u8")])  # packed: docs/format.md "G3 journal" (43 bytes)
_BODY = RECORD.itemsize - 8  # the bytes the record's xxh3_64 covers
SUM_RECORDS = 4096  # records checked per C call (no bytecode runs inside one, so the GIL is not handed over)


@dataclass
class JournalColumns:
    """Journal entries as columns, oldest first (LRU order): ``tags`` uint8 ``(N, 16)`` (tenant tags),
    ``ranks`` uint32, ``seqs`` uint64 (sequence hashes), ``files`` uint16 (the journal's file indexes),
    ``slots`` uint32 (slot indexes in that file), each ``(N,)``."""

    tags: npt.NDArray[np.uint8]
    ranks: npt.NDArray[np.uint32]
    seqs: npt.NDArray[np.uint64]
    files: npt.NDArray[np.uint16]
    slots: npt.NDArray[np.uint32]

    def __len__(self) -> int:
        return len(self.seqs)

    def take(self, sel: npt.NDArray[Any] | slice) -> "JournalColumns":
        """The entries ``sel`` picks (an index or bool array, or a slice), in its order."""
        return JournalColumns(self.tags[sel], self.ranks[sel], self.seqs[sel], self.files[sel], self.slots[sel])

    @staticmethod
    def concat(parts: "list[JournalColumns]") -> "JournalColumns":
        """``parts`` one after another (an empty list: no entries)."""
        if not parts:
            return empty()
        return JournalColumns(*(np.concatenate([getattr(p, f) for p in parts])
                                for f in ("tags", "ranks", "seqs", "files", "slots")))


def empty() -> JournalColumns:
    """No entries."""
    return JournalColumns(np.zeros((0, 16), np.uint8), np.zeros(0, np.uint32), np.zeros(0, np.uint64),
                          np.zeros(0, np.uint16), np.zeros(0, np.uint32))


def _sums(buf: Any, n: int) -> npt.NDArray[np.uint64]:
    """The xxh3_64 of each of ``n`` records' first :data:`_BODY` bytes in ``buf`` (records back to back)."""
    mv, size = memoryview(buf).cast("B"), RECORD.itemsize  # bytes or uint8
    out = np.empty(n, np.uint64)
    for a in range(0, n, SUM_RECORDS):  # one C call per piece holds the GIL: bounded to ~1 ms of engine time
        b = min(n, a + SUM_RECORDS)
        cuts = map(slice, range(a * size, b * size, size), range(a * size + _BODY, b * size, size))
        out[a:b] = np.fromiter(map(xxhash.xxh3_64_intdigest, map(mv.__getitem__, cuts)), np.uint64, b - a)
    return out


def decode(data: bytes | memoryview) -> tuple[JournalColumns, int, int]:
    """Replay version-2/3 records (the journal's bytes after its file header).

    Returns ``(entries, records, good_bytes)``: the live entries oldest first, the number of good records, and
    the byte length of the good prefix (replay stops at the first record whose type is not PUT or DEL or whose
    check fails: a torn tail after a crash starts there).
    """
    n = len(data) // RECORD.itemsize
    rec = np.frombuffer(data, RECORD, count=n)
    bad = ((rec["kind"] != PUT) & (rec["kind"] != DEL)) | (rec["sum"] != _sums(data, n))
    m = int(np.argmax(bad)) if bad.any() else n
    rec = rec[:m]
    live = rec[_live(rec)]
    cols = JournalColumns(np.ascontiguousarray(live["tag"]), live["rank"].copy(), live["seq"].copy(),
                          live["file"].copy(), live["slot"].copy())
    return cols, m, m * RECORD.itemsize


def _last_of_runs(order: npt.NDArray[np.intp], same_next: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """True for each row that is the last of its group, given the rows in a stable sort ``order`` by group and
    ``same_next[i]``: rows ``order[i]`` and ``order[i + 1]`` are in one group."""
    last = np.ones(len(order), bool)
    last[order[:-1]] = ~same_next
    return last


def _last_per_slot(file: npt.NDArray[np.uint16], slot: npt.NDArray[np.uint32]) -> npt.NDArray[np.bool_]:
    """True for each row that is the last (highest index) of the rows naming its ``(file, slot)``."""
    if len(slot) < 2:
        return np.ones(len(slot), bool)
    s = (file.astype(np.uint64) << np.uint64(32)) | slot  # exact: 16 + 32 bits
    order = np.argsort(s, kind="stable")
    ss = s[order]
    return _last_of_runs(order, ss[1:] == ss[:-1])


def _last_per_key(tag: npt.NDArray[np.uint64], rank: npt.NDArray[np.uint32],
                  seq: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
    """True for each row that is the last (highest index) of the rows naming its key ``(tag (n, 2), rank,
    seq)``: rows sorted by a 64-bit mix of the key, runs of equal mixes checked to be equal keys (a collision
    of the mix falls back to an exact sort by every column)."""
    n = len(seq)
    if n < 2:
        return np.ones(n, bool)
    h = fmix64_v(seq ^ tag[:, 0])
    h ^= tag[:, 1]
    h = fmix64_v(h)
    h ^= rank
    h = fmix64_v(h)
    order = np.argsort(h, kind="stable")
    hs = h[order]
    same_next = hs[1:] == hs[:-1]
    a, b = order[:-1][same_next], order[1:][same_next]
    if not ((tag[a] == tag[b]).all() and (rank[a] == rank[b]).all() and (seq[a] == seq[b]).all()):
        order = np.lexsort((np.arange(n), seq, rank, tag[:, 1], tag[:, 0]))
        same_next = np.ones(n - 1, bool)
        for c in (tag[:, 0], tag[:, 1], rank, seq):
            cs = c[order]
            same_next &= cs[1:] == cs[:-1]
    return _last_of_runs(order, same_next)


def _live(rec: npt.NDArray[Any]) -> npt.NDArray[np.intp]:
    """Indexes (ascending) of the PUT records that survive replay (the module docstring's rule)."""
    tag = np.ascontiguousarray(rec["tag"]).view("<u8")  # (n, 2)
    key_last = _last_per_key(tag, rec["rank"], rec["seq"])
    puts = np.flatnonzero(rec["kind"] == PUT)
    slot_last = _last_per_slot(rec["file"][puts], rec["slot"][puts])
    live = np.zeros(len(rec), bool)
    live[puts[slot_last]] = True
    return np.flatnonzero(live & key_last)


def encode(kind: int, cols: JournalColumns) -> bytes:
    """The records (all of type ``kind``) of ``cols``' entries, in their order, each with its check."""
    n = len(cols)
    rec = np.empty(n, RECORD)
    rec["kind"], rec["file"], rec["slot"] = kind, cols.files, cols.slots
    rec["seq"], rec["rank"], rec["tag"] = cols.seqs, cols.ranks, cols.tags
    rec["sum"] = _sums(rec.view(np.uint8), n)  # the sum field is not among the bytes it covers
    return rec.tobytes()


def columns_of(pairs: Iterable[tuple[Any, tuple[int, int]]]) -> JournalColumns:
    """Columns of ``(key, (file, slot))`` pairs, in their order; a key is a ``BlockKey`` (its tenant hashed to
    its tag, ``tag_of``) or a ``TagKey``."""
    ps = list(pairs)
    n = len(ps)
    tags = np.frombuffer(b"".join(k.tag if type(k) is TagKey else tag_of(k.tenant) for k, _ in ps), np.uint8)
    return JournalColumns(tags.reshape(n, 16).copy(), np.fromiter((k.rank for k, _ in ps), np.uint32, n),
                          np.fromiter((k.seq_hash for k, _ in ps), np.uint64, n),
                          np.fromiter((s[0] for _, s in ps), np.uint16, n), np.fromiter((s[1] for _, s in ps), np.uint32, n))


def pairs_of(cols: JournalColumns, namespace: str, tenants: Mapping[bytes, str] | None = None) -> list[tuple[Any, tuple[int, int]]]:
    """``cols`` as ``(key, (file, slot))`` pairs of ``namespace``: a ``BlockKey`` where ``tenants`` (tag ->
    tenant) names the tag's tenant, else a ``TagKey``."""
    out: list[tuple[Any, tuple[int, int]]] = []
    for t, r, s, f, sl in zip(map(bytes, cols.tags), cols.ranks.tolist(), cols.seqs.tolist(), cols.files.tolist(),
                              cols.slots.tolist()):
        who = tenants.get(t) if tenants else None
        out.append((TagKey(namespace, t, r, s) if who is None else BlockKey(namespace, who, r, s), (f, sl)))
    return out
