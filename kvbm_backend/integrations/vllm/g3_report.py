"""What the worker told the scheduler's G3 mirror is present (:class:`ReportedBlocks`), and which of those blocks
G3 dropped by itself since (evicted for capacity, deleted, proven corrupt), for the worker's G3 report
(:meth:`.worker_side.WorkerSide.worker_meta`, the report channel's pump: :mod:`.report_channel`).

The drops are read from G3's removal log (:class:`.tier_removals.RemovalWatch` over
:meth:`G3Pool.removed_since <kvbm_backend.pool.g3.pool.G3Pool.removed_since>`): O(removals since the last
report), no I/O; each logged ``(seq_hash, rank)`` that names a reported block is checked with one index lookup
(``contains``), so a block stored again after its removal, or another tenant's or namespace's block with the
same sequence hash, stays. Before 2026-11-30 every report after G3's eviction counter moved read the whole index
(``keys()``) into a set under the catalog lock: 4.2 s per report at 500,000 blocks on the 2-core dev VM, every
0.5 s while G3 was full, on vLLM's worker thread (no report channel) or on the report thread, holding the GIL
(review measurement: a 2 ms Python step had a p99 of 21 ms, max 948 ms, during those reads). The index is read
only when the log cannot tell: it overflowed (more than ``catalog.REMOVED_LOG_ENTRIES`` = 262,144 removals
between two reports), or the pool keeps no log; then at most every ``interval_s``.

Blocks the scheduler may be told are gone although G3 still holds them (a miss, never wrong KV): a block restored
after a restart under its tenant's tag only (``TagKey``, see ``pool/g3/index.py``) that a load adopted since, when
a removal with its sequence hash and rank is logged; and blocks of tenants past :data:`TENANTS_KEPT`.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from ...model.namespace import BlockKey
from ...pool.g3.index import TagKey, tag_of
from .metadata import mirror_id
from .tier_removals import Removal, RemovalWatch, index_keys

__all__ = ["ReportedBlocks", "TENANTS_KEPT"]

#: tenant ids the worker remembers by tag (to look a reported block up by its :class:`BlockKey`); past it the
#: map starts over (a block of a forgotten tenant is looked up by its tag: reported gone when a removal with its
#: sequence hash and rank is logged, a miss at worst).
TENANTS_KEPT = 1 << 16

Id = tuple[bytes, int, int]  # metadata.mirror_id: (tenant tag, rank, seq_hash)


class _Ids:
    """A set of mirror ids found by ``(rank, seq_hash)`` (what G3's removal log names): one dict entry per block,
    its value the tag (a set of tags when several tenants hold that hash and rank)."""

    def __init__(self) -> None:
        self._d: dict[tuple[int, int], bytes | set[bytes]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __contains__(self, i: Id) -> bool:
        v = self._d.get((i[1], i[2]))
        return v == i[0] if isinstance(v, bytes) else (v is not None and i[0] in v)

    def __iter__(self) -> Iterator[Id]:
        for (rank, seq), v in self._d.items():
            for tag in ((v,) if isinstance(v, bytes) else v):
                yield tag, rank, seq

    def tags_at(self, rank: int, seq_hash: int) -> tuple[bytes, ...]:
        v = self._d.get((rank, seq_hash))
        return () if v is None else (v,) if isinstance(v, bytes) else tuple(v)

    def add(self, i: Id) -> None:
        tag, k = i[0], (i[1], i[2])
        v = self._d.get(k)
        if v is None:
            self._d[k] = tag
        elif isinstance(v, bytes):
            if v == tag:
                return
            self._d[k] = {v, tag}
        elif tag in v:
            return
        else:
            v.add(tag)
        self._n += 1

    def discard(self, i: Id) -> None:
        tag, k = i[0], (i[1], i[2])
        v = self._d.get(k)
        if v is None:
            return
        if isinstance(v, bytes):
            if v != tag:
                return
            del self._d[k]
        else:
            if tag not in v:
                return
            v.discard(tag)
            if len(v) == 1:
                (last,) = v
                self._d[k] = last
        self._n -= 1

    def clear(self) -> None:
        self._d.clear()
        self._n = 0


class ReportedBlocks:
    """The G3 blocks reported present to the scheduler (mirror ids ``(tenant tag, rank, seq_hash)``), and the
    check of which of them G3 dropped since. Not thread-safe: the worker calls it under its report lock.

    Args:
        pool: the worker's G3 pool (``contains`` or ``holds``, ``keys``, ``stats``; ``removed_since`` /
            ``removal_cursor``). With ``holds`` (G3), a check the pool cannot answer now (its lock held across
            journal I/O) is asked again at the next report: neither reported held nor gone meanwhile.
        namespace: the worker's namespace fingerprint (16 hex chars; the index's other namespaces are not ours).
        interval_s: the index is read (log overflowed, or no log) at most this often, in seconds.
    """

    def __init__(self, pool: Any, namespace: str, interval_s: float = 0.5):
        self._pool, self.fp = pool, namespace
        self.watch = RemovalWatch(pool, interval_s)
        self._ids = _Ids()
        self._tenants: dict[bytes, str] = {}  # tag -> tenant id, of BlockKeys seen (for lookups by BlockKey)
        self._polled: tuple[list[Removal], bool] = ([], False)
        self._retry_written: list[BlockKey] = []  # written blocks a busy pool could not confirm: asked again
        self._retry_log: list[Removal] = []  # logged removals a busy pool could not check: checked again

    def _ask(self, keys: list) -> list[bool] | None:
        """Whether G3 holds each of ``keys`` (one index lookup each), or None when it cannot tell now."""
        holds = getattr(self._pool, "holds", None)  # G3: None while its lock is busy (never waited for long)
        if holds is None:
            return [bool(self._pool.contains(k)) for k in keys]
        result: list[bool] | None = holds(keys)
        return result

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, i: Id) -> bool:
        return i in self._ids

    def clear(self) -> None:
        """Forget every reported block (the next report is a snapshot)."""
        self._ids.clear()
        self._retry_written, self._retry_log = [], []

    def poll(self) -> None:
        """Read G3's removals since the last poll (kept for :meth:`gone`). Call it BEFORE reading the index for
        a snapshot and taking the blocks written since the last report: a block dropped before this poll is
        not in the snapshot, or is caught by :meth:`held`'s lookup; one dropped after it is in the next poll's
        log."""
        self._polled = self.watch.poll(len(self._ids))

    def ids(self, keys: Iterable) -> list[Id]:
        """Mirror ids of G3 keys (:class:`BlockKey` or restored :class:`TagKey`), remembering their tenants."""
        out = []
        for k in keys:
            i = mirror_id(k)
            if isinstance(k, BlockKey) and i[0] not in self._tenants:
                if len(self._tenants) >= TENANTS_KEPT:
                    self._tenants.clear()
                self._tenants[i[0]] = k.tenant
            out.append(i)
        return out

    def held(self, keys: list[BlockKey]) -> list[Id]:
        """Mirror ids of those ``keys`` (written by this worker) G3 holds now: one index lookup each. When G3 cannot
        tell now (its lock busy), none is reported and all are asked again by the next call."""
        keys, self._retry_written = self._retry_written + list(keys), []
        if not keys:
            return []
        got = self._ask(keys)
        if got is None:
            self._retry_written = keys
            return []
        return [i for k, i, h in zip(keys, self.ids(keys), got) if h]

    def update(self, removed: Iterable[Id], added: Iterable[Id]) -> None:
        """Apply one report's explicit ``removed``, then ``added`` (as the scheduler's mirror does)."""
        for i in removed:
            self._ids.discard(i)
        for i in added:
            self._ids.add(i)

    def _key(self, i: Id) -> BlockKey | TagKey:
        tag, rank, seq = i
        tenant = self._tenants.get(tag)
        if tenant is None and tag == tag_of(""):
            tenant = ""
        return BlockKey(self.fp, tenant, rank, seq) if tenant is not None else TagKey(self.fp, tag, rank, seq)

    def gone(self) -> list[Id]:
        """The reported blocks G3 no longer holds, per the last :meth:`poll` (forgotten here, each returned once):
        one index lookup per logged removal that names a reported block's sequence hash and rank; the whole index
        (``keys()``) only when the poll said so."""
        (log, read_index), self._polled = self._polled, ([], False)
        log, self._retry_log = self._retry_log + log, []
        ids = self._ids
        out: list[Id] = []
        cands = [(tag, rank, seq) for _n, seq, rank in log for tag in ids.tags_at(rank, seq)]
        got = self._ask([self._key(i) for i in cands]) if cands else []
        if got is None:  # G3 cannot tell now (its lock busy): nothing reported gone, checked again next time
            self._retry_log = log
        else:
            for i, held in zip(cands, got):
                if not held and i in ids:
                    ids.discard(i)
                    out.append(i)
        keys = index_keys(self._pool) if read_index else None
        if read_index and keys is None:  # the lock busy: the forward thread does not wait; read next report
            self.watch.owe()
        elif keys is not None:
            current = {mirror_id(k) for k in keys if k.namespace == self.fp}
            lost = [i for i in ids if i not in current]
            for i in lost:
                ids.discard(i)
            out.extend(lost)
        return out
