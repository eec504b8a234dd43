"""G3 blocks whose failed load a re-read could not read either: how long they are kept (docs/invariants.md #1).

A load that fails other than by a timeout asks the pool to delete the block (``G3Pool.drop_unreadable``: the
connector's worker, layer-wise loads, the native ``G3Tier``), so the recompute's save writes it again. The pool
re-reads the slot first (:meth:`.reader.G3Reader.prove_bad`) and deletes it only on a proof that the stored bytes
are bad: a FrameError reason, ``short`` (the file ends inside the slot) or ``token_digest`` (another block's frame).
A re-read that fails too (EIO, a device or NFS hiccup) proves nothing: the block stays (counted
``unreadable_kept``), and the callers' cool-down of a failed load (``FAILED_BLOCK_COOLDOWN_S``, 30 s:
:mod:`kvbm_backend.integrations.vllm.failed_blocks`) keeps it from being offered again meanwhile. Before
2026-12-01 it was deleted too: three failed reads within milliseconds (the load's, the get's re-read and this
one) removed a good block and journaled its DEL.

A block that stays unreadable is deleted after all (counted ``unreadable_deleted``): at a failed re-read once
:data:`UNREADABLE_STRIKES` re-reads (each of another failed load) have failed, the first at least
:data:`UNREADABLE_SPAN_S` before, with no re-read verifying in between. With the 30 s cool-down a block that is
asked for steadily fails about ten loads (each a recompute) before it goes; its recompute's save then writes
it again. A record whose last failure is :data:`UNREADABLE_FORGET_S` old starts over (a failure an hour later
is a new episode), and one of a key that now maps to another slot too. At most :data:`UNREADABLE_MAX` records
are kept (oldest forgotten first: such a block then needs its strikes again).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Hashable

from ..pieces import Slot

UNREADABLE_STRIKES = 3  # failed re-reads (each of another failed load) before a still-unreadable block goes
UNREADABLE_SPAN_S = 300.0  # ... the first of them at least this many seconds before the last
UNREADABLE_FORGET_S = 3600.0  # a record whose last failed re-read is older starts over
UNREADABLE_MAX = 1 << 16  # records kept, oldest forgotten first


class UnreadableBlocks:
    """Failed re-reads per block key: ``key -> (slot, first failure, last failure, failures)`` (module doc).
    ``clock``: seconds, monotonic (``time.monotonic``; tests may pass their own). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = UNREADABLE_MAX) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1 (got {max_entries})")
        self.clock = clock
        self.max_entries = max_entries
        self._recs: OrderedDict[Hashable, tuple[Slot, float, float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._recs)

    def failed(self, key: Hashable, slot: Slot) -> bool:
        """A re-read of ``key``'s slot ``slot`` failed now (an I/O error, no proof). Returns True when the block
        has stayed unreadable long enough to be deleted (:data:`UNREADABLE_STRIKES` failures over at least
        :data:`UNREADABLE_SPAN_S`); its record is then forgotten (the caller deletes the block)."""
        now = self.clock()
        with self._lock:
            rec = self._recs.pop(key, None)
            if rec is None or rec[0] != slot or now - rec[2] >= UNREADABLE_FORGET_S:
                rec = (slot, now, now, 0)
            first, n = rec[1], rec[3] + 1
            if n >= UNREADABLE_STRIKES and now - first >= UNREADABLE_SPAN_S:
                return True
            self._recs[key] = (slot, first, now, n)
            while len(self._recs) > self.max_entries:
                self._recs.popitem(last=False)
            return False

    def forget(self, key: Hashable) -> None:
        """``key``'s slot re-read and verified, or the block is gone: its failures so far no longer count."""
        with self._lock:
            self._recs.pop(key, None)
