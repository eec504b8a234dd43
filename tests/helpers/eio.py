"""A G3 slot whose reads fail with EIO, injected at the OS boundary (``os.preadv`` / ``os.pread``, which the posix
engine, the device and layer-wise loaders' ``ReadFiles`` and the pool's re-read (``G3Reader.prove_bad``) all call):
what a bad sector, a device reset or an NFS server gone for a moment does. The slab file and its bytes stay intact.

``slot_eio(monkeypatch, g3, key, times=None)``: every read that covers ``key``'s slot fails (a read of consecutive
slots, which the readers merge, fails as a whole, as the disk's would) while the returned :class:`SlotEio` is
``on``; ``times``: only the first that many such reads fail (a burst), the later ones read the slot as stored.
``failed`` counts the reads failed. The pool must use the ``posix`` engine (``g3.engine``).

:class:`FailingWrites`: the real posix engine whose write batches fail with EIO while ``fail`` is set (a G3 pool
built with it as its engine): a write lost, or landed and still reported failed (``land``)."""
from __future__ import annotations

import errno
import os
from concurrent.futures import Future
from dataclasses import dataclass

from kvbm_backend.io.posix import PosixEngine

HANG_S = 600.0  # a hang guard, not a bound


@dataclass
class SlotEio:
    on: bool = True  # set False: the outage is over, every read succeeds
    left: int | None = None  # reads still to fail (None: all while on)
    failed: int = 0


def slot_eio(monkeypatch, g3, key, times: int | None = None) -> SlotEio:
    fi, si = g3.index.get(key)
    spath, sb = os.path.realpath(g3.slabs.by_index[fi].path), g3.slot_bytes
    real_preadv, real_pread = os.preadv, os.pread
    st = SlotEio(left=times)

    def bad(fd, off, n) -> bool:
        if not st.on or (st.left is not None and st.left <= 0):
            return False
        try:
            hit = off < (si + 1) * sb and off + n > si * sb and os.readlink(f"/proc/self/fd/{fd}") == spath
        except OSError:
            return False
        if hit:
            st.failed += 1
            if st.left is not None:
                st.left -= 1
        return hit

    def preadv(fd, bufs, off, *a):
        if bad(fd, off, sum(memoryview(b).nbytes for b in bufs)):
            raise OSError(errno.EIO, "injected read error")
        return real_preadv(fd, bufs, off, *a)

    def pread(fd, n, off, *a):
        if bad(fd, off, n):
            raise OSError(errno.EIO, "injected read error")
        return real_pread(fd, n, off, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    return st


class FailingWrites(PosixEngine):
    """The real posix engine; while ``fail`` is set, every write batch fails with EIO, after its bytes were
    written (``land``) or before any was."""

    def __init__(self) -> None:
        super().__init__(threads=2)
        self.fail = False
        self.land = False

    def submit(self, ops):
        ops = list(ops)
        if not (self.fail and ops and ops[0].write):
            return super().submit(ops)
        out: Future = Future()
        if self.land:
            super().submit(ops).result(timeout=HANG_S)
        out.set_exception(OSError(errno.EIO, "injected write failure"))
        return out
