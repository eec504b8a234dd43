"""The G3 tier's gauges of one process (``kvbm_backend_g3_blocks``, ``_used_bytes``, ``_capacity_bytes``,
``_degraded``): one series per process, and a process may hold several G3 pools (a hybrid model: one per KV cache
group), so each pool's share is kept here and the series are their sum (``degraded``: any), so the last pool to
update no longer wins.

A child forked without exec starts with none: its parent's pools are not its own (:mod:`.forked`), and a lock
another thread of the parent held at the fork (a writer thread updating the gauges) is not the child's. Before
2026-12-04 the child inherited both: a child that opened a pool of its own exported its parent's pools' capacity
and blocks added to its own (the pod's endpoint, which sums the live processes, counted the parent's twice) and
its ``degraded`` for good, or hung opening it.
"""
from __future__ import annotations

import os
import threading

from ...metrics import TierMetrics

_parts: dict[int, dict[int, tuple[int, int, int, int]]] = {}  # id(blocks gauge) -> {id(pool): values}
_lock = threading.Lock()


def publish(m: TierMetrics, pool: object, values: tuple[int, int, int, int] | None) -> None:
    """Set ``m``'s gauges to the sum over this process's G3 pools on them, ``pool``'s part now ``values``
    (blocks, used bytes, capacity bytes, degraded 0/1; None: it closed)."""
    assert m.blocks is not None and m.used_bytes is not None and m.capacity_bytes is not None  # tier g3's
    with _lock:
        parts = _parts.setdefault(id(m.blocks), {})
        if values is None:
            parts.pop(id(pool), None)
        else:
            parts[id(pool)] = values
        blocks, used, cap = (sum(v[i] for v in parts.values()) for i in range(3))
        degraded = max((v[3] for v in parts.values()), default=0)
        m.blocks.set(blocks)
        m.used_bytes.set(used)
        m.capacity_bytes.set(cap)
        m.degraded.set(degraded)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _parts.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
