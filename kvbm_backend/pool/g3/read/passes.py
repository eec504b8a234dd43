"""The read side of :class:`~.device.DeviceLoader`: slab files, the ring of staging
buffers, a pass's reads on the wire (kvikio into the device, or ``preadv`` into the pass's pinned host rows and one
host-to-device DMA per pass, queued once its reads are in: the bounce path) and their reaping against the call's deadline.

What is read is planned in :mod:`kvbm_backend.transfer` (:func:`~kvbm_backend.transfer.group_passes`,
:func:`~kvbm_backend.transfer.contiguous_runs`); host staging comes from the one buffer pool
(:mod:`kvbm_backend.gpu.staging`, :class:`~kvbm_backend.memory.BufferPool`), file fds from
:class:`kvbm_backend.io.files.ReadFiles`. :class:`PassReader` is a part the loader owns (``loader.reads``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ....deadlines import Deadline
from ....transfer import contiguous_runs
from ....gpu.staging import host_staging_pool
from ....io.files import ReadFiles
from ...base import BlockBuffer, SlotLease
from .stages import add_seconds
from ....threads import executor

if TYPE_CHECKING:
    import torch

    from ....io.kvikio_engine import KvikioEngine

log = logging.getLogger(__name__)


#: a ring slot's buffers: device staging, the host rows reads land in (None: kvikio reads to the device) and
#: the host buffer under them (given back to its pool)
_RingEntry = tuple["torch.Tensor", Optional["torch.Tensor"], Optional[BlockBuffer]]


@dataclass
class _Pass:
    """One pass: leases ``rows`` (indexes into the call's keys) read into ``staging`` rows 0..n-1."""
    rows: list[int]
    leases: list[SlotLease]
    slot_len: int
    staging: torch.Tensor  # uint8 [n, slot_len] on the device (host mode: the CPU)
    host: torch.Tensor | None  # pinned/host uint8 [n, slot_len] the reads land in (None: kvikio reads to the device)
    ring: int  # ring slot the buffers came from
    # (row0, nrows, future) per read: a concurrent Future of (bytes, None), or kvikio's IOFuture (untyped)
    futs: list[tuple[int, int, Any]]
    status: list[str | None]  # per pass row: None (read in full) or a reason
    # host uint8 [n, >= 256]: the headers (bounce/host: filled by the readers; kvikio: copied by the verifier)
    headers: BlockBuffer | None = None
    sums: Any = None  # host int64 [n, 4]: the device checksums' limb sums (CUDA, once ``checked`` is done)
    checked: Any = None  # torch.cuda.Event: headers and sums are on the host
    done: Any = None  # torch.cuda.Event: nothing on the device reads the staging any more (copy-out queued before)
    finished: bool = False  # the loader completed it (checked, copied out) or gave it up: its buffers may go


def _done(f: Any) -> bool:
    return bool(f.done()) if hasattr(f, "done") else True


class PassReader:
    """The read side of :class:`~.device.DeviceLoader` (a part it owns): slab file fds, the ring of staging
    buffers, a pass's reads on the wire and their reaping.

    Args:
        mode: the loader's device path (:data:`kvbm_backend.gpu.probe.MODES`): kvikio (``gds`` /
            ``kvikio-compat``) reads into the device; ``pinned-bounce`` / ``host`` read with ``threads``
            reader threads (``preadv``, O_DIRECT where the filesystem takes it).
        device: the torch device staging lives on (``pinned-bounce`` on the CPU: the same bounce path, its
            host rows plain host memory and its per-pass copy a host copy; what the CPU suite runs). io_bytes: bytes per read (at least one slot).
        threads: reads in flight (reader threads / kvikio's thread pool).
        direct: False: the bounce/host paths read buffered, never O_DIRECT (``g3.o_direct: off``).
        counters: the loader's Counter (``reads`` put on the wire, ``bytes_read``, ``timeout``, ``io_error``, ``short``, ``h2d_submit_s``,
            ``files_o_direct`` / ``files_buffered``).
    """

    def __init__(self, mode: str, device: torch.device, io_bytes: int, threads: int, counters: Counter[str], *,
                 direct: bool = True) -> None:
        self.mode, self.device, self.io_bytes, self.counters = mode, device, io_bytes, counters
        # the bounce path's host rows are page-locked for a CUDA device only (one DMA per pass); on the CPU
        # (the bounce path run by the CPU suite) plain host rows: pinning needs an accelerator there
        self.pinned = mode == "pinned-bounce" and device.type == "cuda"
        # O_DIRECT on the bounce/host paths where taken (unless g3.o_direct is off), buffered for kvikio
        self.files = ReadFiles(counters, direct=direct)
        # (futures, ring entry, pass) of timed-out reads: the entry is kept until the reads are done and the pass
        # (None: already given up) is finished, since its rows that did arrive are checked and copied out later
        self.abandoned: list[tuple[list[Any], _RingEntry | None, _Pass | None]] = []
        self.ring: dict[int, _RingEntry] = {}  # ring slot -> (staging, host, host buffer), reused across calls
        self.ring_done: dict[int, Any] = {}  # ring slot -> event of its last pass's device work (CUDA)
        self.engine: KvikioEngine | None = None  # kvikio (gds / kvikio-compat)
        self.pool: ThreadPoolExecutor | None = None  # reader threads (pinned-bounce / host)
        if mode in ("gds", "kvikio-compat"):
            from ....io.kvikio_engine import KvikioEngine
            self.engine = KvikioEngine(threads=threads)
        else:
            self.set_threads(threads)

    def set_threads(self, threads: int) -> None:
        """Reader threads of the bounce/host paths, or kvikio's (process-wide) thread pool on the kvikio
        paths (:meth:`~kvbm_backend.io.kvikio_engine.KvikioEngine.resize`); between loads."""
        if self.engine is not None:
            self.engine.resize(threads)
            return
        old, self.pool = self.pool, executor(threads, "kvbm-dev-read")
        if old is not None:
            old.shutdown(wait=True)

    def drop_ring(self) -> None:
        """Give the ring's host buffers back (between loads): the next passes take buffers of their size."""
        for ev in self.ring_done.values():
            ev.synchronize()
        self.ring_done = {}
        for entry in self.ring.values():
            self.give_ring(entry)
        self.ring = {}

    def abandon(self, p: _Pass) -> None:
        """The call ended with ``p``'s reads in flight: its buffers are never handed out again until they end."""
        p.finished = True  # nothing checks or copies out of it any more
        self.abandoned.append(([f for _, _, f in p.futs], self.ring.pop(p.ring, None), None))

    def finished(self, p: _Pass) -> None:
        """The loader has completed ``p`` (checked and copied out its rows): a buffer it kept because of
        timed-out reads goes back to the pool once those reads have ended."""
        p.finished = True
        self._release_abandoned()

    def _release_abandoned(self) -> None:
        keep = []
        for fs, entry, owner in self.abandoned:
            if all(_done(x) for x in fs) and (owner is None or owner.finished):
                self.give_ring(entry)  # the late reads ended and the pass is done with it: free again
            else:
                keep.append((fs, entry, owner))
        self.abandoned = keep

    def close(self) -> None:
        """Wait for reads in flight, release files, threads and buffers. Idempotent."""
        if self.engine is not None:
            for fs, _, _ in self.abandoned:
                for f in fs:
                    try:
                        f.get() if not hasattr(f, "result") else f.result()
                    except Exception:  # noqa: BLE001
                        pass
            for fd in self.files.open_fds():
                self.engine.forget_fd(fd)
            self.engine.close()
            self.engine = None
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        for entry in list(self.ring.values()) + [e for _, e, _ in self.abandoned]:
            self.give_ring(entry)  # every read has ended (threads joined / kvikio reads waited for)
        self.abandoned = []
        self.ring = {}
        self.files.close()

    # -- staging ring ------------------------------------------------------------------------
    def buffers(self, ring: int, n: int, slot_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(staging, host) for a pass of ``n`` rows from ring slot ``ring`` (grown as needed; the
        smaller host buffer goes back to the pool: its pass was verified and copied out)."""
        import torch
        ev = self.ring_done.pop(ring, None)
        if ev is not None:
            ev.synchronize()  # the slot's previous pass: its checks and copy-out have read the staging
        need = n * slot_len
        buf = self.ring.get(ring)
        if buf is None or buf[0].numel() < need:
            if buf is not None:
                self.give_ring(buf)
            hbuf: BlockBuffer | None = None
            host: torch.Tensor | None
            if self.mode == "host":
                hbuf = host_staging_pool(False).take(need)
                st = host = torch.from_numpy(hbuf)  # 4 KiB aligned: O_DIRECT reads land here
            else:  # kvikio reads into it; bounce: the pass's host-to-device copy lands in it
                st = torch.empty(need, dtype=torch.uint8, device=self.device)
                host = None
                if self.mode == "pinned-bounce":
                    hbuf = host_staging_pool(self.pinned).take(need)
                    host = torch.from_numpy(hbuf)  # page-locked on CUDA: the pass's copy is one DMA
            buf = self.ring[ring] = (st, host, hbuf)
        st, host, _ = buf
        return (st[:need].view(n, slot_len), None if host is None else host[:need].view(n, slot_len))

    def give_ring(self, entry: _RingEntry | None) -> None:
        """Give a ring entry's host buffer back to the pool (nothing reads into it any more)."""
        if entry is not None and entry[2] is not None:
            host_staging_pool(self.pinned).give(entry[2])

    # -- reads -------------------------------------------------------------------------------
    def submit(self, p: _Pass) -> None:
        """Put the pass's reads on the wire (returns at once): one read per run of adjacent slots of one
        file, at most ``io_bytes`` each (at least one slot)."""
        spans = [(ls.path, ls.offset, ls.slot_len) for ls in p.leases]
        # one numpy view / flat device view per pass: a tensor object per read or block costs GIL hand-offs
        host_np = p.host.numpy() if p.host is not None else None
        flat = p.staging.view(-1) if self.engine is not None else None
        for r0, nr in contiguous_runs(spans, self.io_bytes):
            ls = p.leases[r0]
            try:
                fd, _ = self.files.fd(ls.path, self.engine is None)  # opened here: a failed open is a miss
                f: Any  # a concurrent Future, or kvikio's IOFuture
                if self.pool is not None:
                    # bounce / host passes have host rows and a header buffer (DeviceLoader makes them so)
                    assert host_np is not None and p.headers is not None
                    f = self.pool.submit(self._read_bounce, ls.path, host_np[r0:r0 + nr], p.headers[r0:r0 + nr],
                                          ls.offset)
                else:
                    assert self.engine is not None and flat is not None  # the kvikio modes' engine reads
                    f = self.engine.read_to_device_async(fd, flat[r0 * p.slot_len:(r0 + nr) * p.slot_len],
                                                          nr * p.slot_len, ls.offset)
            except Exception as e:  # noqa: BLE001 - a read that cannot start: its rows are misses
                log.warning("frame read submit failed (%d rows at %s:%d): %s", nr, ls.path, ls.offset, e)
                self.counters["io_error"] += nr
                continue
            p.futs.append((r0, nr, f))
            self.counters["reads"] += 1

    def _read_bounce(self, path: str, host: BlockBuffer, hdr: BlockBuffer, offset: int) -> tuple[int, None]:
        """One read of the bounce and host paths (a reader thread): ``preadv`` into ``host``, the pass's
        host rows ``[nr, slot_len]`` as numpy (host mode: the staging itself; ``pinned-bounce``: pinned rows
        that :meth:`reap` copies to the device staging on the loader's stream, one DMA per pass), then the
        rows' 4 KiB headers into ``hdr`` (``[nr, HEADER_BYTES]``, host). Returns ``(bytes read, None)``.

        Why the loader's thread queues the copies, not the reader threads: on an H200 host (tmpfs, 4 GiB
        of 2 MiB blocks) per-thread copies on per-thread streams, each waited for, loaded at 5-7 GB/s; copies
        queued by the loader on its one stream at 12-14 GB/s (``benchmarks/gpu_bench.py --sweep``, 2026-11-25)."""
        slot_len = host.shape[1]
        buf = host.reshape(-1)
        got = self.files.preadv(path, [buf], offset, True)  # O_DIRECT (no page-cache copy) where taken
        full = got // slot_len
        if full:
            hdr[:full] = host[:full, :hdr.shape[1]]
        return got, None

    def reap(self, p: _Pass, deadline: Deadline) -> None:
        """Wait for the pass's reads (until ``deadline``); fill ``p.status``."""
        pending: list[Any] = []
        for r0, nr, f in p.futs:
            try:
                if hasattr(f, "result"):  # concurrent.futures: a bounce/host read
                    got, _ = f.result(timeout=deadline.left())
                else:  # kvikio IOFuture (no wait with a timeout): poll to honour the deadline
                    while not f.done() and not deadline.expired():
                        # 50 us: each poll oversleeps the read's end by up to a quantum; with 200 us, 65 polls of
                        # a 4 GiB load (33 passes) slept 27 ms of its ~120 (H200 host, tmpfs, loader_profile)
                        time.sleep(0.00005)
                    if not f.done():
                        raise TimeoutError
                    got = f.get()
            except TimeoutError:
                self.counters["timeout"] += nr
                for r in range(r0, r0 + nr):
                    p.status[r] = "timeout"
                pending.append(f)
                continue
            except Exception as e:  # noqa: BLE001 - I/O failure: a miss
                log.warning("frame read failed (%d rows at %s:%d): %s", nr, p.leases[r0].path,
                            p.leases[r0].offset, e)
                self.counters["io_error"] += nr
                continue
            self.counters["bytes_read"] += got
            full = min(nr, got // p.slot_len)
            for r in range(r0, r0 + nr):
                p.status[r] = None if r - r0 < full else "short"
            if full < nr:
                self.counters["short"] += nr - full
        if self.mode == "pinned-bounce" and p.host is not None and any(x is None for x in p.status):
            # one DMA for the pass on the loader's stream, overlapping the next pass's reads (a copy per read,
            # queued as each was reaped, loaded at 9.5 GB/s with 16 reader threads where one per pass had
            # loaded 13.0: H200, tmpfs, 2026-11-26; more GIL hand-offs between the loader and the readers)
            t0 = time.perf_counter()
            p.staging.copy_(p.host, non_blocking=True)
            add_seconds(self.counters, "h2d_submit_s", time.perf_counter() - t0)
        if pending:  # keep the buffers alive until the I/O ends and p is finished; never hand them out before
            self.abandoned.append((pending, self.ring.pop(p.ring, None), p))
        self._release_abandoned()
