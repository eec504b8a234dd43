"""What a pool dropped from its index since a cursor (:class:`RemovalWatch`), and the chunks a vLLM tiering tier
published as stored (KV events on) that its pool dropped since (:class:`HeldChunks`, for the tier's removal events:
:mod:`.tiering`, "KV events"). The worker's G3 report to the scheduler's mirror (:mod:`.g3_report`) reads its
removals through :class:`RemovalWatch` too.

A G3 pool logs what leaves its index (evicted, deleted, proven corrupt: :meth:`G3Pool.removed_since
<kvbm_backend.pool.g3.pool.G3Pool.removed_since>`), so each check costs O(removals since the last one), no I/O.
Before (2026-11-29) every check read the whole index into a set and hashed every published chunk: 1.2-2.3 s per
check at 200,000 chunks, run every second while the pool evicted (review measurement), so the scheduler spent
more than a second per second on it; the worker's report did the same until 2026-11-30 (4.2 s per check at
500,000 blocks). A pool without that log, or a log that overflowed (more than ``catalog.REMOVED_LOG_ENTRIES``
removals between two checks), is checked by reading its index, at most every ``interval_s``; without a log only
when its eviction/deletion/corruption counters moved or it holds fewer blocks than checked. An overflow is owed
until that read happens (a read skipped for ``interval_s`` is not lost).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable

from ...pool.g3.lock_bounded import LOCK_WAIT_S

__all__ = ["HeldChunks", "RemovalWatch", "held_now"]

#: one removal of :meth:`RemovalWatch.poll`: (number in the pool's log, seq_hash, rank)
Removal = tuple[int, int, int]


class RemovalWatch:
    """A pool's removals since the last :meth:`poll`, and when the caller must read the index instead.

    Args:
        pool: the pool (``stats()``; ``removed_since`` / ``removal_cursor`` where it logs removals, a G3 pool).
        interval_s: the index is read at most this often (seconds).

    ``scans``: how many times :meth:`poll` asked for the index to be read (tests count it).
    """

    def __init__(self, pool: Any, interval_s: float):
        self._pool, self.interval_s = pool, interval_s
        self._since = getattr(pool, "removed_since", None)
        self._cursor = self.cursor()
        self._owed = False  # the log overflowed: what left is known only by reading the index
        self._at = 0.0
        self._sig: tuple | None = None
        self.scans = 0

    @property
    def logs(self) -> bool:
        """Whether the pool logs its removals (``removed_since``; its cursor counts every block that left)."""
        return self._since is not None

    def cursor(self) -> int:
        """The pool's removal cursor now (0 for a pool without a removal log)."""
        return int(self._pool.removal_cursor()) if self._since is not None else 0

    def owe(self) -> None:
        """The index read :meth:`poll` asked for could not be made now (the pool's lock busy): the next poll asks
        for it again."""
        self._owed, self._at = True, 0.0

    def poll(self, held: int) -> tuple[list[Removal], bool]:
        """``(removals, read_index)``: the removals logged since the last poll, ``[(number, seq_hash, rank),
        ...]`` in order (empty without a log), and whether the caller must now check its ``held`` blocks (a
        count) against the pool's index (``keys()``) because the log cannot tell: it overflowed (owed until
        then), or the pool keeps none and its counters say something left. At most every ``interval_s``;
        never when ``held`` is 0. O(removals) without a read; never raises for a pool whose ``stats()`` fails."""
        log: list[Removal] = []
        if self._since is not None:
            self._cursor, got = self._since(self._cursor)
            if got is None:
                self._owed = True
            else:
                log = got
            if not self._owed:
                return log, False
        if not held:
            self._owed = False  # nothing to check: what left before now concerns no held block
            return log, False
        now = time.monotonic()
        if now - self._at < self.interval_s:
            return log, False
        self._at = now
        try:
            st = self._pool.stats()
        except Exception:  # noqa: BLE001 - no counters: read the index every time
            st = {}
        sig = (st.get("evictions"), st.get("corrupt"), st.get("deleted"))
        if not self._owed and st and sig == self._sig and st.get("blocks", 0) >= held:
            return log, False
        self._sig, self._owed = sig, False
        self.scans += 1
        return log, True


class HeldChunks:
    """Published chunks of one tier and their removal check.

    Args:
        pool: the tier's pool (``keys()``; ``removed_since`` / ``removal_cursor`` where it logs removals).
        namespace: the tier's namespace fingerprint (the index's other namespaces are ignored).
        copies: TP ranks per chunk (a chunk is gone once any rank's block is).
        key_hash: a chunk key's sequence hash in the pool (``offload_key_hash``).
        interval_s: the index-reading check runs at most this often (seconds).
        block_keys: ``(chunk key, tenant) -> [BlockKey per rank]`` (the tier's), for pools that key a chunk's
            blocks by tenant too (``contains``): a chunk is gone once no tenant it was published for holds every
            rank's block. None: any removal of its hash is the chunk's.

    Tenants: the pool's removal log names a block by sequence hash and rank only, so before 2026-11-30 one tenant's
    copy dropped was reported as the chunk removed while another tenant's copy was held (and published). Names: two
    chunk keys with one ``key_hash`` (a collision) share the pool's block; its removal is both chunks' (before
    2026-12-01 only the one published last was reported, the other stayed published for good).
    """

    def __init__(self, pool: Any, namespace: str, copies: int, key_hash: Callable[[Any], int], interval_s: float,
                 block_keys: Callable[[Any, str], list] | None = None):
        self._pool, self._fp, self._copies, self._hash = pool, namespace, copies, key_hash
        self._watch = RemovalWatch(pool, interval_s)
        self._held: dict[Hashable, int] = {}  # chunk key -> the pool's removal cursor when it was published
        self._by_hash: dict[int, Hashable] = {}  # sequence hash -> the first published chunk of that name
        self._also: dict[int, list[Hashable]] = {}  # sequence hash -> the others (keys whose hashes collide)
        self._contains = getattr(pool, "contains", None) if block_keys is not None else None
        # G3: whether it holds keys, or None while its lock is busy (journal I/O): the scheduler never waits for it
        self._holds = getattr(pool, "holds", None) if self._contains is not None else None
        self._block_keys = block_keys
        self._unsure: dict[Hashable, None] = {}  # published chunks whose check found the pool busy: checked again
        self._busy = False  # the pool answered "unknown" in this call: no more checks until the next call
        self._tenants: dict[Hashable, set[str]] = {}  # chunk key -> tenants it was published for (block_keys)
        self._gone: list[Any] = []  # published chunks the pool no longer held then, for the next removed()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def interval_s(self) -> float:
        """Seconds between reads of the pool's index, when its removal log cannot tell (:class:`RemovalWatch`)."""
        return self._watch.interval_s

    @interval_s.setter
    def interval_s(self, v: float) -> None:
        self._watch.interval_s = v

    def cursor(self) -> int:
        """The pool's removal cursor now (0 for a pool without a removal log). A store job reads it before its
        first put: every removal logged after a block is published comes later. Read after the puts (before
        2026-11-30), an eviction logged between a block's publication and the read was taken for an older copy's:
        the chunk was never reported removed and stayed here (and its payload in vLLM's tracker) for good. A
        removal of an older copy logged after the read reports a chunk removed that the pool holds again: the
        safe side (the router misses a hit)."""
        return self._watch.cursor()

    def published(self, keys: list[Any], cursor: int, tenant: str = "") -> None:
        """``keys`` were published stored (``tenant``'s copies); ``cursor``: :meth:`cursor` read before their
        blocks were written. With ``contains``, those the pool no longer holds now (any rank's block gone) are
        reported by the next :meth:`removed`; a later removal is logged after this check, so :meth:`removed`
        reads it. Before 2026-11-30 none was checked: a store job finished, its chunk was evicted, and a
        :meth:`removed` call (vLLM's ``take_events``) before the job was polled took the removal from the log as
        no published chunk's: the chunk was then published stored and never reported removed."""
        # nothing left the pool since the job's cursor (its log counts every removal): every chunk is held, no
        # index lookup (the scheduler thread publishes whole jobs; a lookup takes the pool's lock per block)
        check = self._contains is not None and (not self._watch.logs or self._watch.cursor() != cursor)
        self._busy = False
        for k in keys:
            self._held[k] = cursor
            self._name(k)
            if self._contains is not None:
                self._tenants.setdefault(k, set()).add(tenant)
                if check:
                    self._check(k, self._gone)

    def _check(self, k: Any, gone: list[Any]) -> None:
        """Check published chunk ``k`` against the pool: forgotten into ``gone`` when no tenant holds it, kept when
        one does, and kept for the next :meth:`removed` when the pool could not tell (its lock busy): a chunk the
        pool holds is never reported removed because of a busy lock."""
        held = self._still_held(k)
        if held is None:
            self._unsure[k] = None
        else:
            self._unsure.pop(k, None)
            if not held:
                gone.append(self._forget(k))

    def _still_held(self, k: Any) -> bool | None:
        """Whether a tenant ``k`` was published for still holds every rank's block (keeping only those); None when
        the pool's lock stayed busy (G3's ``holds``; nothing asked again in this call once it was)."""
        if self._contains is None or self._block_keys is None:
            return False
        contains, bks = self._contains, self._block_keys
        tenants = list(self._tenants.get(k, ()))
        if self._holds is None:
            left = {t for t in tenants if all(contains(bk) for bk in bks(k, t))}
        else:
            if self._busy:
                return None
            per = [bks(k, t) for t in tenants]
            got = self._holds([bk for b in per for bk in b])
            if got is None:
                self._busy = True
                return None
            left, a = set(), 0
            for t, b in zip(tenants, per):
                if all(got[a:a + len(b)]):
                    left.add(t)
                a += len(b)
        self._tenants[k] = left
        return bool(left)

    def removed(self) -> list[Any]:
        """The published chunks the pool dropped since the last call (each reported once)."""
        log, read_index = self._watch.poll(len(self._held) * self._copies)
        gone, self._gone = self._gone, []
        self._busy = False
        for k in list(self._unsure):  # checks the busy pool could not answer before
            if k not in self._held:
                self._unsure.pop(k, None)
            elif not self._busy:
                self._check(k, gone)
        for n, seq_hash, _rank in log:
            first = self._by_hash.get(seq_hash)
            for k in ([] if first is None else [first, *self._also.get(seq_hash, ())]):
                if self._held.get(k, n) < n:  # dropped after publishing
                    self._check(k, gone)
        return gone + self._scan() if read_index else gone

    def _name(self, k: Any) -> None:
        """Index published chunk ``k`` by its sequence hash (several chunks of one name: :attr:`_also`)."""
        h = self._hash(k)
        first = self._by_hash.setdefault(h, k)
        if first != k:
            also = self._also.setdefault(h, [])
            if k not in also:
                also.append(k)

    def _forget(self, k: Any) -> Any:
        del self._held[k]
        self._unsure.pop(k, None)
        h = self._hash(k)
        also = self._also.get(h)
        if self._by_hash.get(h) == k:
            if also:
                self._by_hash[h] = also.pop(0)
            else:
                self._by_hash.pop(h, None)
        elif also and k in also:
            also.remove(k)
        if also is not None and not also:
            del self._also[h]
        self._tenants.pop(k, None)
        return k

    def _scan(self) -> list[Any]:
        """Every published chunk against the pool's index (when :class:`RemovalWatch` says so)."""
        keys = index_keys(self._pool)
        if keys is None:  # the pool's lock busy (journal I/O): the scheduler does not wait; read next call
            self._watch.owe()
            return []
        present = {(k.seq_hash, k.rank) for k in keys if k.namespace == self._fp}
        gone: list[Any] = []
        for k in list(self._held):
            if any((self._hash(k), r) not in present for r in range(self._copies)):
                gone.append(self._forget(k))
            elif self._contains is not None:  # some copy: a published tenant's?
                self._check(k, gone)
        return gone


def index_keys(pool: Any) -> list | None:
    """``pool``'s index (``keys()``), waiting for a G3 pool's lock at most ``LOCK_WAIT_S`` (``keys_within``); None
    when it stayed busy (:mod:`kvbm_backend.pool.g3.lock_bounded`)."""
    within = getattr(pool, "keys_within", None)
    return within(LOCK_WAIT_S) if within is not None else list(pool.keys())


def held_now(pool: Any, keys: list, block_keys: Callable[[Any], list]) -> list:
    """The chunks of ``keys`` whose every block (``block_keys(chunk)``) ``pool`` holds now (a tier's store job
    whose puts skipped blocks, :mod:`.tiering`). A put's ``skipped`` counts blocks already
    stored, but also blocks its admission filter refused and blocks another job is still writing
    (:class:`~kvbm_backend.pool.base.PutResult`): announcing those as stored told the router about chunks
    the tier does not hold (or not yet durably), and kept them forever for removal events that never came
    (found in review, 2026-11-29). A pool without ``contains`` (G4) counts them all held: its ``skipped`` are
    objects whose frame header says it serves them (one it will not serve, e.g. a plaintext frame once
    ``g4.encrypt`` is on, comes back ``dropped``: ``skipped_unservable``, docs/operations.md "chunks_stored")."""
    contains = getattr(pool, "contains", None)
    if not callable(contains):
        return keys
    return [k for k in keys if all(contains(bk) for bk in block_keys(k))]
