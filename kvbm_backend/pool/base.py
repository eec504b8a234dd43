"""The BlockPool protocol shared by G3 and G4 (and anything the integrations talk to).

Every pool is bound to one :class:`~kvbm_backend.model.namespace.Namespace`; a key of another
namespace is a miss. All data-moving calls return ``concurrent.futures.Future`` at once: storage never
blocks the caller's thread. Host block buffers are 1-D ``uint8`` numpy arrays of exactly
``layout.bytes_per_block`` bytes (FullyContiguous ``[layer, outer, page, inner]``); 4 KiB-aligned
buffers (:func:`kvbm_backend.memory.aligned_empty`) take the zero-copy O_DIRECT path.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..model.layout import KvLayout
from ..model.namespace import BlockKey, Namespace


@dataclass
class PutResult:
    """Outcome of one put batch (counts of blocks)."""

    written: int = 0  # durable and published
    skipped: int = 0  # already stored, or not admitted (admission filter)
    dropped: int = 0  # queue full, no space, store down: not stored, counted


@dataclass
class GetResult:
    """Outcome of one get batch: ``ok[i]`` is True only if block i was found, its header identity
    matched and its integrity value verified in the caller's buffer. False is a miss (recompute)."""

    ok: list[bool] = field(default_factory=list)

    @property
    def prefix_hits(self) -> int:
        """Leading blocks loaded: the usable prefix."""
        n = 0
        for x in self.ok:
            if not x:
                break
            n += 1
        return n


@runtime_checkable
class BlockPool(Protocol):
    tier: str  # "G3" or "G4"
    namespace: Namespace

    @property
    def layout(self) -> KvLayout: ...

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Number of leading ``keys`` the pool holds (index/metadata only, no payload I/O)."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray]) -> Future[PutResult]:
        """Offload: store ``blocks[i]`` under ``keys[i]``, asynchronously and bounded. The pool reads the
        buffers until the future completes. Never raises for storage trouble: drops and counts."""

    def get(self, keys: Sequence[BlockKey], out: Sequence[np.ndarray]) -> Future[GetResult]:
        """Onboard: read ``keys[i]`` into ``out[i]``. Failed, short, corrupt, foreign or late reads are
        misses (``ok[i] = False``); corrupt slots/objects are dropped and counted."""

    def delete(self, keys: Sequence[BlockKey]) -> Future[int]:
        """Remove blocks; the future gives how many were present."""

    def stats(self) -> dict:
        """Counters and gauges (blocks, bytes, hits, misses, corrupt, dropped, ...)."""

    def close(self) -> None:
        """Flush or drop pending offloads (bounded), release files and threads."""


def completed(value) -> Future:
    """A Future already resolved with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f
