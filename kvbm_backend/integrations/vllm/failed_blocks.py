"""Blocks whose load failed, kept out of lookups for a cool-down: the connector's scheduler (:mod:`.scheduler_side`,
per ``(tenant, sequence hash)``) and the native tiers (:class:`FailedChunks`, per ``(tenant, chunk)``) share the rule
and its constants."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

log = logging.getLogger(__name__)

__all__ = ["FAILED_BLOCK_COOLDOWN_S", "FAILED_BLOCKS_MAX", "FailedBlocks", "FailedChunks", "drop_blocks",
           "unloaded_engine_blocks"]

#: seconds a block whose load failed (absent, unreadable or corrupt in the tier that was to serve it) ends
#: every prefix offered to any request: the failed request itself is never offered a load again (vLLM
#: reschedules it and asks again: the same hit would fail the same way, forever); others recompute from
#: that block until it was re-verified by a later lookup after the cool-down (a dropped slot is then simply
#: absent; a recomputed block offloaded again is a hit again)
FAILED_BLOCK_COOLDOWN_S = 30.0
FAILED_BLOCKS_MAX = 1 << 16  # (tenant, sequence hash) entries kept, oldest dropped first


class FailedBlocks:
    """``(tenant, sequence hash)`` of blocks whose load failed, each for ``cooldown_s`` seconds, at most
    ``max_entries`` (oldest forgotten first). Scheduler thread only."""

    def __init__(self, cooldown_s: float = FAILED_BLOCK_COOLDOWN_S, max_entries: int = FAILED_BLOCKS_MAX):
        self.cooldown_s, self.max_entries = cooldown_s, max_entries
        self._until: OrderedDict[tuple[str, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def add(self, tenant: str, seq_hash: int) -> None:
        k = (tenant, int(seq_hash))
        self._until.pop(k, None)
        self._until[k] = time.monotonic() + self.cooldown_s
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def first_in(self, tenant: str, hashes, start: int, end: int) -> int:
        """Index of the first of ``hashes[start:end]`` that failed within the cool-down, else ``end``."""
        if not self._until or start >= end:
            return end
        now = time.monotonic()
        while self._until:  # expired entries leave in insertion (= expiry) order
            k, t = next(iter(self._until.items()))
            if t > now:
                break
            del self._until[k]
        for i in range(start, end):
            if (tenant, int(hashes[i])) in self._until:
                return i
        return end


class FailedChunks:
    """The native tiers' (:mod:`.tiering`) chunks whose load failed, per ``(tenant, chunk key)``, for ``cooldown_s``
    seconds (the connector's :data:`FAILED_BLOCK_COOLDOWN_S`), at most ``max_entries`` (oldest forgotten first).
    Meanwhile the tier answers the chunk's lookups with a miss and does not report a store of it as held: a chunk
    G3 could not read but not prove bad (a read error, a timeout) stays in its index, and before 2026-11-30 every
    new request was offered it, loaded it in vain and recomputed it, and the recomputed chunk's store (skipped:
    held already) was reported stored again. Thread-safe (scheduler thread and the tier's I/O threads)."""

    def __init__(self, key_hash: Callable[[Any], int], cooldown_s: float = FAILED_BLOCK_COOLDOWN_S,
                 max_entries: int = FAILED_BLOCKS_MAX):
        self._hash = key_hash
        self._blocks = FailedBlocks(cooldown_s, max_entries)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, tenant: str, keys: list[Any]) -> None:
        """``tenant``'s loads of ``keys`` failed now."""
        with self._lock:
            for k in keys:
                self._blocks.add(tenant, self._hash(k))

    def cooling(self, tenant: str, key: Any) -> bool:
        """Whether ``tenant``'s load of ``key`` failed within the cool-down."""
        if not len(self._blocks):
            return False
        with self._lock:
            return self._blocks.first_in(tenant, [self._hash(key)], 0, 1) == 0

    def not_cooling(self, tenant: str, keys: list[Any]) -> list[Any]:
        """``keys`` less those :meth:`cooling` for ``tenant``."""
        return [k for k in keys if not self.cooling(tenant, k)] if len(self._blocks) else keys


def drop_blocks(pool: Any, keys: list[Any], deadline: Any, tier_type: str) -> int:
    """Delete ``keys`` (the blocks of chunks a tier failed to read, not by a timeout) from ``pool`` (a G3 pool:
    ``G3Pool.drop_unreadable``), so the recomputed chunks' stores write them again instead of skipping them as
    held; how many it deleted. A block whose slot re-reads and verifies stays: the failed read was transient
    (before 2026-11-30 it was deleted too: good blocks lost to one bad read). Never raises (logged): a block left
    in place only stays cooling (:class:`FailedChunks`)."""
    try:
        n = int(pool.drop_unreadable(keys).result(timeout=deadline.left()))
    except Exception as e:  # noqa: BLE001 - the failed load is reported either way
        log.warning("%s: could not delete %d unreadable blocks: %s", tier_type, len(keys), e)
        return 0
    if n:
        log.warning("%s: deleted %d blocks that failed to load (read error); a later store writes them again",
                    tier_type, n)
    return n


def unloaded_engine_blocks(hashes: Any, block_ids: list[int], start: int, first_failed: int) -> list[int]:
    """Engine block ids of a request whose synchronous (layer-wise) load failed, from its first failed block on
    (``first_failed``: that block's sequence hash, searched from block ``start``, the load's first; not found:
    every block from ``start``). vLLM caches a synchronous load's blocks when it schedules it, and with
    ``kv_load_failure_policy`` ``recompute`` it leaves the failed blocks, and those computed after them in that
    step, in its prefix cache for the request to recompute; until it does (never, when it is aborted or
    preempted) another request hits them and computes from, and the connector saves, KV that was never loaded.
    The scheduler removes these blocks from vLLM's prefix cache (``BlockPool.evict_blocks``, what vLLM does
    itself under the ``fail`` policy): the next request recomputes them. Never raises."""
    try:
        p = list(hashes).index(int(first_failed), max(0, start))
    except ValueError:
        p = max(0, start)
    return [b for b in block_ids[p:] if b]  # block 0 is vLLM's null block
