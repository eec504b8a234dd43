"""Bounded waits for a G3 pool's lock (docs/invariants.md #3, never stall decode).

The catalog's lock (:attr:`.catalog.SlotCatalog.lock`) is held by other threads across journal I/O: an append's
``os.write``, the header ``pwrite`` s of a delete or an eviction, the rename of a compaction with its ``fsync`` of
the directory. On a stalled drive or NFS mount that lasts as long as the stall. Before 2026-12-01 every caller
waited for it without a bound (reviewer, 2026-12-01): a host get or a layer-wise load started in the forward waited
past ``g3.load_timeout_s``, and a native ``G3Tier``'s ``take_events`` / ``get_finished_jobs`` (vLLM's scheduler
thread, every step) waited the whole stall. So the calls those threads make wait a bound here:

- loads (:class:`~.read.host.HostGet`, :meth:`~.read.reader.G3Reader.lease`): at most their deadline; a load
  that does not get the lock in time is a ``timeout`` miss with nothing pinned (:meth:`~.catalog.SlotCatalog.miss_unlocked`);
- :func:`holds` (``G3Pool.holds`` / ``contains``): at most :data:`LOCK_WAIT_S`, then "unknown" (None);
- :func:`pool_stats` (``G3Pool.stats``): at most :data:`LOCK_WAIT_S`, then the last snapshot read under the lock,
  with ``stats_stale`` True (the counters made without the lock are current);
- puts (:meth:`~.writer.G3Writer.put`, an offload's admission): at most :data:`PUT_LOCK_WAIT_S`, then the put is
  handed to the writer's late-put thread, which waits for the lock instead (:mod:`.writer_late`; before 2026-12-01
  a put waited the whole stall, and with it a native tier's store job, its I/O thread and vLLM's pin on its chunks;
  on 2026-12-01 it was dropped after 0.5 s instead, ``lock_busy``: load turned into lost offloads);
- ``G3Pool.removed_since`` takes the removal log's own lock (:meth:`~.catalog.SlotCatalog.removed_since`).

Prefix lookups wait for no lock at all (:mod:`.lookup_defer`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

if TYPE_CHECKING:
    from ...model.namespace import BlockKey
    from .catalog import SlotCatalog
    from .pool import G3Pool

#: seconds an index query from the scheduler thread (``holds``, ``contains``, ``stats``) waits for the pool's lock
#: before it answers "unknown" (or the last snapshot): far above an uncontended hold (microseconds; an append's
#: ``write`` of a few records), far below an engine step's budget
LOCK_WAIT_S = 0.02
#: seconds a put (an offload, off the scheduler thread) waits for the pool's lock on its caller's thread before it
#: is handed to the late-put thread (:mod:`.writer_late`): above an uncontended hold, so a hand-off is rare
PUT_LOCK_WAIT_S = 0.05


class _Lock(Protocol):
    """What :func:`held_within` needs of a lock: a ``threading.Lock``, or a forked child's
    :class:`~.forked.ForkedLock` (whose acquire raises ``G3ForkedError``)."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


@contextlib.contextmanager
def held_within(lock: _Lock, timeout_s: float | None) -> Iterator[bool]:
    """``with held_within(lock, t) as got:`` -- ``lock`` acquired waiting at most ``timeout_s`` seconds (None: no
    bound; 0 or less: only if free at once); ``got`` says whether it was, and it is released on exit if so."""
    got = lock.acquire() if timeout_s is None else lock.acquire(timeout=max(0.0, timeout_s))
    try:
        yield got
    finally:
        if got:
            lock.release()


def holds(cat: SlotCatalog, keys: Sequence[BlockKey], timeout_s: float | None = LOCK_WAIT_S) -> list[bool] | None:
    """Whether the index holds each of ``keys`` (one answer per key, no I/O), or None when the pool's lock stayed
    busy ``timeout_s`` seconds (unknown: ask again later)."""
    with held_within(cat.lock, timeout_s) as got:
        if not got:
            return None
        return [k in cat.index for k in keys]


#: G3 counters ``stats()`` reports by name (0 when never counted)
_COUNTERS = ("offloads_written", "offloads_skipped_present", "offloads_skipped_admission",
             "offloads_skipped_deleted", "offloads_dropped", "restore_unverified",
             "hits", "misses", "corrupt", "evictions", "bytes_written", "bytes_read", "enospc", "write_errors",
             "restored_blocks", "restore_dropped", "restored_by_scan", "restore_scanned_slots",
             "restore_header_retries", "deleted", "late_reads", "unreadable_kept", "unreadable_deleted",
             "device_loads", "device_hits", "sync_groups", "journal_syncs", "journal_compactions", "puts_late",
             "journal_errors", "vacancies_unjournaled", "header_clear_errors", "degradations", "duplicate_keys")


def _locked_part(pool: G3Pool) -> tuple[dict[str, Any], dict[str, int]]:
    """What ``stats()`` reads under the pool's lock (caller holds it): the gauges and the locked counters."""
    cat = pool.cat
    d: dict[str, Any] = {
        "tier": pool.tier,
        "namespace": pool.fp,
        "paths": list(cat.slabs.paths),
        "files": len(cat.slabs.files),
        "o_direct": dict(cat.slabs.o_direct),
        "engine": getattr(pool.engine, "name", type(pool.engine).__name__),
        "block_bytes": pool.block_bytes,
        "slot_bytes": pool.slot_bytes,
        "io_size_bytes": pool._io_size,
        "blocks": len(cat.index),
        "used_bytes": len(cat.index) * pool.slot_bytes,
        "capacity_blocks": cat.slabs.capacity_slots,
        "capacity_bytes": cat.slabs.capacity_slots * pool.slot_bytes,
        "configured_capacity_blocks": cat.slabs.max_capacity_slots,
        "free_slots": cat.slabs.free_slots(),
        "reserved_slots": cat.reserved,
        "pinned_slots": cat.index.pinned,
        "deferred_free_slots": cat.index.deferred,
        "pending_blocks": pool.writer.pending,
        "degraded": bool(cat.degraded_until),
        "admission": pool.admission.policy,
        "foreign_files": list(cat.slabs.foreign_files),
        "foreign_bytes": cat.slabs.foreign_bytes,
        "journal_records": cat.journal.records,
    }
    return d, dict(cat.c)


class StatsCache:
    """The last part of ``stats()`` read under the pool's lock (:func:`pool_stats` answers from it while the lock
    stays busy). ``mu`` guards ``snap``."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.snap: tuple[dict[str, Any], dict[str, int]] | None = None


def pool_stats(pool: G3Pool, cache: StatsCache, timeout_s: float | None = LOCK_WAIT_S) -> dict[str, Any]:
    """``G3Pool.stats()``: counters and gauges (sizes in bytes; ``*_blocks`` / counts in blocks). Waits at most
    ``timeout_s`` for the pool's lock; past it the gauges and locked counters are those of the last read (made
    at open at the latest), ``stats_stale`` True. Counts made without the lock (loads that could not get it in
    time, lookups) are always current."""
    cat = pool.cat
    with held_within(cat.lock, timeout_s) as got:
        if got:
            snap = _locked_part(pool)
            with cache.mu:
                cache.snap = snap
    with cache.mu:
        if not got and cache.snap is None:  # never read yet (the lock busy since open): wait for it this once
            with cat.lock:
                cache.snap = _locked_part(pool)
        assert cache.snap is not None
        d0, c0 = cache.snap
    d = dict(d0)
    d["stats_stale"] = not got
    with cat.side_mu:
        side = dict(cat.side)
    c = dict(c0)
    for k, v in side.items():
        c[k] = c.get(k, 0) + v
    for name in _COUNTERS:
        d[name] = c.get(name, 0)
    d.update(pool._lookups.snapshot())  # lookup_blocks, lookup_hits, lookups_deferred
    # the names every pool reports (pool.base.STATS_CONTRACT)
    d["written"], d["dropped"] = d["offloads_written"], d["offloads_dropped"]
    d["skipped"] = d["offloads_skipped_present"] + d["offloads_skipped_admission"] + d["offloads_skipped_deleted"]
    d["dropped_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("dropped:")}
    d["misses_by_reason"] = {k[5:]: v for k, v in c.items() if k.startswith("miss:")}
    d["corrupt_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("corrupt:")}
    d["restore_dropped_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("restore:")}
    d["hit_rate"] = d["lookup_hits"] / d["lookup_blocks"] if d["lookup_blocks"] else 0.0
    d["device_paths"] = pool.reader.device_paths()
    return d
