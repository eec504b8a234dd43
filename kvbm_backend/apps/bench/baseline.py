"""Raw O_DIRECT baseline: what the disk gives to plain ``pwrite``/``pread`` with no engine in between.

Every benchmark reports its throughput as a ratio against this, measured in the same run on the same
directories (DESIGN.md "Measure everything as a ratio against a baseline taken in the same run"). The
baseline is the storage's limit, not a copy of the measured engine's settings: :class:`Sweep` measures every
point of a small grid (threads x I/O size, :data:`SWEEP_THREADS`, :data:`SWEEP_IO_SIZES`) and the best
point of each direction is the baseline.
"""
from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from ..signals import raise_if_terminated
from kvbm_backend.io.probe import fdatasync, open_file, probe_o_direct
from kvbm_backend.config import io_size_problem
from kvbm_backend.memory import aligned_empty

ALIGN = 4096
SWEEP_THREADS = (1, 4, 8, 16)  # I/Os in flight tried by the baseline (capped at the number of I/Os)
SWEEP_IO_SIZES = (1 << 20, 4 << 20)  # I/O sizes tried besides the pool's own unit (capped at the bytes per directory)


def check_sizes(total_bytes: int, io_size: int, inflight: int) -> int:
    """Validate benchmark sizes; returns the number of I/Os. Raises ValueError naming the bad value."""
    if io_size_problem(io_size):
        raise ValueError(f"io_size: {io_size_problem(io_size)} (got {io_size})")
    if total_bytes < io_size or total_bytes % io_size:
        raise ValueError(f"total_bytes must be a positive multiple of io_size ({io_size}), got {total_bytes}")
    if inflight < 1:
        raise ValueError(f"inflight must be >= 1, got {inflight}")
    return total_bytes // io_size


def random_aligned(nbytes: int, seed: int = 0) -> np.ndarray:
    """A 4 KiB-aligned uint8 array of ``nbytes`` pseudo-random bytes (incompressible)."""
    a = aligned_empty(nbytes)
    a.view(np.uint64)[:] = np.random.default_rng(seed).integers(0, 2**63, nbytes // 8, dtype=np.uint64)
    return a


def drop_cache(fd: int) -> None:
    """Ask the kernel to drop the file's clean pages (buffered fallback only; O_DIRECT skips the cache)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def odirect_baseline(directory: str | Sequence[str], total_bytes: int, io_size: int, inflight: int, *,
                     src: np.ndarray | None = None, dst: np.ndarray | None = None) -> dict:
    """Write then read ``total_bytes`` with plain syscalls, in a fresh temp file in ``directory`` (several:
    one file in each, I/O ``i`` going to directory ``i % len(directories)``, so each gets the same share
    and all of them are busy at once).

    Writes: ``os.pwrite`` of ``io_size`` bytes at consecutive offsets from a pool of ``inflight``
    threads, then one ``fdatasync`` per file (inside the timed span). Reads: ``os.preadv`` of the same I/Os
    with the same pool. Buffers are 4 KiB aligned; a file is O_DIRECT where :func:`probe_o_direct`
    says the filesystem takes it, else buffered with ``posix_fadvise(DONTNEED)`` before the reads.
    The read-back bytes are compared with what was written. ``src`` / ``dst``: 4 KiB-aligned buffers of at
    least ``total_bytes`` to reuse (``src`` holds the bytes to write; default: fresh ones).

    Returns:
        ``{"write_gbps", "read_gbps", "write_s", "read_s", "o_direct", "total_bytes", "io_size",
        "inflight", "directories"}``; GB = 1e9 bytes, seconds of wall time; ``o_direct``: every file.

    Raises:
        ValueError: sizes not multiples of 4 KiB / of ``io_size``, or ``inflight`` < 1.
        RuntimeError: the bytes read back differ from those written.
        OSError: I/O errors (ENOSPC, ...).
    """
    dirs = [directory] if isinstance(directory, str) else list(directory)
    n = check_sizes(total_bytes, io_size, inflight)
    if src is None:
        src = random_aligned(total_bytes, seed=1)
    if dst is None:
        dst = aligned_empty(total_bytes)
    src, dst = src[:total_bytes], dst[:total_bytes]
    dst[:] = 0  # fault the pages in before timing (both baseline and engines); a reused buffer holds no old bytes
    k = len(dirs)
    fds: list[int] = []
    try:
        o_direct = all(probe_o_direct(d) for d in dirs)  # in the try: an interrupted probe's file is removed too
        for d in dirs:
            fd_tmp, path = tempfile.mkstemp(prefix=f".kvbm-baseline-{os.getpid()}-", dir=d)
            os.close(fd_tmp)
            fds.append(open_file(path, o_direct=probe_o_direct(d), create=False))

        def w(i: int) -> None:
            raise_if_terminated()  # a SIGTERM ends the point at its next I/O (apps/signals.py)
            off, foff = i * io_size, (i // k) * io_size
            # an ndarray is a Buffer at run time; numpy's stubs say so from Python 3.12 (mypy checks 3.11)
            if os.pwrite(fds[i % k], src[off:off + io_size], foff) != io_size:  # type: ignore[arg-type]
                raise OSError(f"short pwrite at offset {foff}")

        def r(i: int) -> None:
            raise_if_terminated()
            off, foff = i * io_size, (i // k) * io_size
            if os.preadv(fds[i % k], [dst[off:off + io_size]], foff) != io_size:  # type: ignore[list-item]  # as above
                raise OSError(f"short pread at offset {foff}")

        with ThreadPoolExecutor(max_workers=inflight) as pool:
            t0 = time.perf_counter()
            list(pool.map(w, range(n)))
            list(pool.map(fdatasync, fds))
            write_s = time.perf_counter() - t0
            for fd in fds:
                drop_cache(fd)  # a no-op for O_DIRECT files
            t0 = time.perf_counter()
            list(pool.map(r, range(n)))
            read_s = time.perf_counter() - t0
        if not np.array_equal(src, dst):
            raise RuntimeError("baseline read back different bytes than it wrote")
    finally:
        for fd in fds:
            os.close(fd)
        # every file this process made here, also one a SIGTERM (KeyboardInterrupt) caught between its creation and
        # its registration here or inside an O_DIRECT probe (CI, 2026-12-01: the file outlived the interrupted bench)
        for d in dirs:
            for pat in (f".kvbm-baseline-{os.getpid()}-*", f".kvbm-odirect-probe-{os.getpid()}-*"):
                for path in glob.glob(os.path.join(glob.escape(d), pat)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
    return {
        "write_gbps": total_bytes / write_s / 1e9,
        "read_gbps": total_bytes / read_s / 1e9,
        "write_s": write_s,
        "read_s": read_s,
        "o_direct": o_direct,
        "total_bytes": total_bytes,
        "io_size": io_size,
        "inflight": inflight,
        "directories": dirs,
    }


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Sweep:
    """The best a storage does: every point of a grid measured once (:meth:`measure` with ``full``), then the
    leading point of each direction again in later rounds; :meth:`result` reports every point and the best.

    ``measure_point(point) -> {"write_gbps", "read_gbps", "o_direct"}``; a point is a dict of the knobs
    (e.g. ``{"threads": 8, "io_size": 1048576}``), reported as given."""

    def __init__(self, kind: str, points: list[dict], measure_point: Callable[[dict], dict], **info: object):
        if not points:
            raise ValueError("baseline sweep: no points")
        self.kind, self.info, self._measure = kind, info, measure_point
        self.points = [{**p, "write_gbps_runs": [], "read_gbps_runs": []} for p in points]
        self.o_direct = True

    def _best(self, what: str) -> dict:
        return max((p for p in self.points if p[f"{what}_gbps_runs"]), key=lambda p: max(p[f"{what}_gbps_runs"]))

    def measure(self, full: bool) -> None:
        """Measure every point (``full``, or nothing measured yet), else the best write and the best read
        point so far (one run each; the same point once)."""
        if full or not any(p["write_gbps_runs"] for p in self.points):
            todo = self.points
        else:
            todo = [self._best("write")]
            if self._best("read") is not todo[0]:
                todo.append(self._best("read"))
        for p in todo:
            raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
            r = self._measure({k: v for k, v in p.items() if not k.endswith("_runs")})
            p["write_gbps_runs"].append(r["write_gbps"])
            p["read_gbps_runs"].append(r["read_gbps"])
            self.o_direct = self.o_direct and bool(r.get("o_direct", True))

    def best_gbps(self, what: str) -> float:
        return max(self._best(what)[f"{what}_gbps_runs"])

    def result(self) -> dict:
        """``{"kind", **info, "o_direct", "points": [{knobs, "write_gbps_runs", "read_gbps_runs"}],
        "best_write": {knobs, "gbps"}, "best_read": {...}}``."""
        def knobs(p: dict) -> dict:
            return {k: v for k, v in p.items() if not k.endswith("_runs")}
        return {"kind": self.kind, **self.info, "o_direct": self.o_direct, "points": self.points,
                "best_write": {**knobs(self._best("write")), "gbps": self.best_gbps("write")},
                "best_read": {**knobs(self._best("read")), "gbps": self.best_gbps("read")}}


def odirect_sweep(directories: Sequence[str], nbytes: int, unit: int, *, threads: Sequence[int] = SWEEP_THREADS,
                  io_sizes: Sequence[int] = SWEEP_IO_SIZES) -> Sweep:
    """A :class:`Sweep` of :func:`odirect_baseline` over every directory at once, writing ``nbytes`` (rounded up
    to each I/O size) with every thread count x I/O size in ``{unit} | io_sizes``: an I/O size is capped at
    the bytes per directory (rounded up to 4 KiB), a thread count at the number of I/Os. The same buffers
    serve every point. Raises ValueError for a ``unit`` not a multiple of 4 KiB or ``nbytes`` < 1."""
    dirs = list(directories)
    if nbytes < 1 or unit < 1 or unit % ALIGN:
        raise ValueError(f"baseline sweep: bytes {nbytes} and unit {unit} (a multiple of {ALIGN}) must be >= 1")
    share = _round_up(-(-nbytes // len(dirs)), ALIGN)
    sizes = sorted({min(s, share) for s in (unit, *io_sizes)})
    points = []
    for io in sizes:
        total = _round_up(nbytes, io * len(dirs))
        for t in sorted({min(t, total // io) for t in threads}):
            points.append({"threads": t, "io_size": io, "total_bytes": total})
    biggest = max(p["total_bytes"] for p in points)
    src = random_aligned(biggest, seed=1)
    dst = aligned_empty(biggest)
    dst[:] = 0

    def one(p: dict) -> dict:
        return odirect_baseline(dirs, p["total_bytes"], p["io_size"], p["threads"], src=src, dst=dst)
    return Sweep("plain pwrite/pread, fdatasync, every directory at once", points, one, directories=dirs,
                 bytes=nbytes)


def object_files_baseline(directory: str, object_bytes: int, n: int, threads: int, *,
                          src: np.ndarray | None = None, dst: np.ndarray | None = None) -> dict:
    """Write then read ``n`` objects of ``object_bytes`` as a file store keeps them: one file each, written
    whole (``open``, one ``pwrite``, ``fsync``, ``close``; O_DIRECT where the filesystem takes it and the
    size is a multiple of 4 KiB, as the G4 file store does) and read whole, from ``threads`` threads, in a
    fresh temp directory in ``directory`` (removed after). Buffered files' pages are dropped before the
    reads; the bytes read are compared. Returns ``{"write_gbps", "read_gbps", "o_direct", "total_bytes"}``.
    Raises RuntimeError for different bytes read back, OSError for I/O errors."""
    total = object_bytes * n
    if src is None:
        src = random_aligned(_round_up(total, ALIGN), seed=3)
    if dst is None:
        dst = aligned_empty(_round_up(total, ALIGN))
    dst[:total] = 0
    o_direct = object_bytes % ALIGN == 0 and probe_o_direct(directory)
    tmp = tempfile.mkdtemp(prefix=".kvbm-baseline-", dir=directory)
    names = [os.path.join(tmp, f"obj-{i:08d}") for i in range(n)]

    def w(i: int) -> None:
        raise_if_terminated()  # a SIGTERM ends the run at its next object (apps/signals.py)
        fd = open_file(names[i], o_direct=o_direct, create=True)
        try:
            if os.pwrite(fd, src[i * object_bytes:(i + 1) * object_bytes], 0) != object_bytes:  # type: ignore[arg-type]
                raise OSError(f"short pwrite of {names[i]}")
            os.fsync(fd)
            if not o_direct:
                drop_cache(fd)
        finally:
            os.close(fd)

    def r(i: int) -> None:
        raise_if_terminated()
        fd = open_file(names[i], o_direct=o_direct, create=False)
        try:
            if os.preadv(fd, [dst[i * object_bytes:(i + 1) * object_bytes]], 0) != object_bytes:  # type: ignore[list-item]
                raise OSError(f"short pread of {names[i]}")
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(w, range(n)))
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(r, range(n)))
            read_s = time.perf_counter() - t0
        if not np.array_equal(src[:total], dst[:total]):
            raise RuntimeError("baseline read back different bytes than it wrote")
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return {"write_gbps": total / write_s / 1e9, "read_gbps": total / read_s / 1e9, "o_direct": o_direct,
            "total_bytes": total}


def object_files_sweep(directory: str, object_bytes: int, n: int, *,
                       threads: Sequence[int] = SWEEP_THREADS) -> Sweep:
    """A :class:`Sweep` of :func:`object_files_baseline` over ``threads`` (each capped at ``n``)."""
    src = random_aligned(_round_up(object_bytes * n, ALIGN), seed=3)
    dst = aligned_empty(src.nbytes)
    points = [{"threads": t, "object_bytes": object_bytes} for t in sorted({min(t, n) for t in threads})]
    return Sweep("plain file per object, written whole + fsync, read whole", points,
                 lambda p: object_files_baseline(directory, object_bytes, n, p["threads"], src=src, dst=dst),
                 directories=[directory], bytes=object_bytes * n)
