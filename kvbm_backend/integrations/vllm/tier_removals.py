"""Chunks a vLLM tiering tier published as stored (KV events on), and which of them its pool dropped since
(:class:`HeldChunks`), for the tier's removal events (:mod:`.tiering`, "KV events").

A G3 pool logs what leaves its index (evicted, deleted, proven corrupt: :meth:`G3Pool.removed_since
<kvbm_backend.pool.g3.pool.G3Pool.removed_since>`), so each check costs O(removals since the last one), on
vLLM's scheduler thread (``take_events``). Before (2026-11-29) every check read the whole index into a set and
hashed every published chunk: 1.2-2.3 s per check at 200,000 chunks, run every second while the pool evicted
(review measurement), so the scheduler spent more than a second per second on it. A pool without that log
(or a log that overflowed) is still checked by reading its index, at most every ``interval_s`` and only
when its eviction/deletion/corruption counters moved or it holds fewer blocks.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable

__all__ = ["HeldChunks"]


class HeldChunks:
    """Published chunks of one tier and their removal check.

    Args:
        pool: the tier's pool (``keys()``; ``removed_since`` / ``removal_cursor`` where it logs removals).
        namespace: the tier's namespace fingerprint (the index's other namespaces are ignored).
        copies: TP ranks per chunk (a chunk is gone once any rank's block is).
        key_hash: a chunk key's sequence hash in the pool (``offload_key_hash``).
        interval_s: the index-reading check runs at most this often (seconds).
    """

    def __init__(self, pool: Any, namespace: str, copies: int, key_hash: Callable[[Any], int], interval_s: float):
        self._pool, self._fp, self._copies, self._hash, self.interval_s = pool, namespace, copies, key_hash, interval_s
        self._since = getattr(pool, "removed_since", None)
        self._held: dict[Hashable, int] = {}  # chunk key -> the pool's removal cursor when it was published
        self._by_hash: dict[int, Hashable] = {}
        self._cursor = self.cursor()
        self._at = 0.0
        self._sig: tuple | None = None

    def __len__(self) -> int:
        return len(self._held)

    def cursor(self) -> int:
        """The pool's removal cursor now (0 for a pool without a removal log). A store job reads it once its
        blocks are published: removals logged up to it are older than the chunk's copy."""
        return int(self._pool.removal_cursor()) if self._since is not None else 0

    def published(self, keys: list[Any], cursor: int) -> None:
        """``keys`` were published stored; ``cursor``: :meth:`cursor` read after their blocks were."""
        for k in keys:
            self._held[k] = cursor
            self._by_hash[self._hash(k)] = k

    def removed(self) -> list[Any]:
        """The published chunks the pool dropped since the last call (each reported once)."""
        if self._since is not None:
            self._cursor, log = self._since(self._cursor)
            if log is not None:
                gone = []
                for n, seq_hash, _rank in log:
                    k = self._by_hash.get(seq_hash)
                    if k is not None and self._held.get(k, n) < n:  # dropped after it was published
                        gone.append(self._forget(k))
                return gone
        return self._scan()

    def _forget(self, k: Any) -> Any:
        del self._held[k]
        self._by_hash.pop(self._hash(k), None)
        return k

    def _scan(self) -> list[Any]:
        """The fallback: every published chunk against the pool's index (rate-limited, see the module doc)."""
        now = time.monotonic()
        if not self._held or now - self._at < self.interval_s:
            return []
        self._at = now
        try:
            st = self._pool.stats()
        except Exception:  # noqa: BLE001 - no counters: read the index every time
            st = {}
        sig = (st.get("evictions"), st.get("corrupt"), st.get("deleted"))
        if st and sig == self._sig and st.get("blocks", 0) >= len(self._held) * self._copies:
            return []
        self._sig = sig
        present = {(k.seq_hash, k.rank) for k in self._pool.keys() if k.namespace == self._fp}
        return [self._forget(k) for k in list(self._held)
                if any((self._hash(k), r) not in present for r in range(self._copies))]
