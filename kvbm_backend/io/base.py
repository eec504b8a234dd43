"""I/O engine interface: positioned scatter/gather reads and writes on open file descriptors.

Engines (``posix``: thread pool over ``os.preadv``/``os.pwritev``; ``nixl``: NIXL POSIX backend;
``kvikio``: cuFile, needs the NVIDIA driver) all take the same :class:`IoOp` lists produced by
:mod:`kvbm_backend.transfer` and complete a Future without blocking the caller.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


@dataclass
class IoOp:
    """One positioned I/O: ``bufs`` (iovecs, in order) to/from ``fd`` at ``offset``.

    For O_DIRECT fds, ``offset``, every buffer address and every buffer length are 4 KiB multiples.
    """

    fd: int
    offset: int  # bytes
    bufs: list[np.ndarray]  # 1-D uint8 arrays (host); views into caller blocks or staging
    write: bool

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs)


class IoEngine(Protocol):
    name: str

    def submit(self, ops: Sequence[IoOp]) -> Future:
        """Run all ops (concurrently, up to the engine's queue depth). The Future resolves to a list of
        bytes transferred per op (a short count is returned, not raised) or raises the first OSError."""

    def close(self) -> None: ...
