"""Raw O_DIRECT baseline: what the disk gives to plain ``pwrite``/``pread`` with no engine in between.

Every benchmark reports its throughput as a ratio against this, measured in the same run on the same
directory (DESIGN.md "Measure everything as a ratio against a baseline taken in the same run").
"""
from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvbm_backend.io.probe import fdatasync, open_file, probe_o_direct
from kvbm_backend.config import io_size_problem
from kvbm_backend.memory import aligned_empty

ALIGN = 4096


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


def odirect_baseline(directory: str, total_bytes: int, io_size: int, inflight: int) -> dict:
    """Write then read ``total_bytes`` in a fresh temp file in ``directory`` with plain syscalls.

    Writes: ``os.pwrite`` of ``io_size`` bytes at consecutive offsets from a pool of ``inflight``
    threads, then one ``fdatasync`` (inside the timed span). Reads: ``os.preadv`` of the same I/Os
    with the same pool. Buffers are 4 KiB aligned; the file is O_DIRECT where :func:`probe_o_direct`
    says the filesystem takes it, else buffered with ``posix_fadvise(DONTNEED)`` before the reads.
    The read-back bytes are compared with what was written.

    Returns:
        ``{"write_gbps", "read_gbps", "write_s", "read_s", "o_direct", "total_bytes", "io_size",
        "inflight"}``; GB = 1e9 bytes, seconds of wall time.

    Raises:
        ValueError: sizes not multiples of 4 KiB / of ``io_size``, or ``inflight`` < 1.
        RuntimeError: the bytes read back differ from those written.
        OSError: I/O errors (ENOSPC, ...).
    """
    n = check_sizes(total_bytes, io_size, inflight)
    o_direct = probe_o_direct(directory)
    src = random_aligned(total_bytes, seed=1)
    dst = aligned_empty(total_bytes)
    dst[:] = 0  # fault the pages in before timing (both baseline and engines)
    fd_tmp, path = tempfile.mkstemp(prefix=".kvbm-baseline-", dir=directory)
    os.close(fd_tmp)
    fd = open_file(path, o_direct=o_direct, create=False)
    try:
        def w(i: int) -> None:
            off = i * io_size
            # an ndarray is a Buffer at run time; numpy's stubs say so from Python 3.12 (mypy checks 3.11)
            if os.pwrite(fd, src[off:off + io_size], off) != io_size:  # type: ignore[arg-type]
                raise OSError(f"short pwrite at offset {off}")

        def r(i: int) -> None:
            off = i * io_size
            if os.preadv(fd, [dst[off:off + io_size]], off) != io_size:  # type: ignore[list-item]  # as above
                raise OSError(f"short pread at offset {off}")

        with ThreadPoolExecutor(max_workers=inflight) as pool:
            t0 = time.perf_counter()
            list(pool.map(w, range(n)))
            fdatasync(fd)
            write_s = time.perf_counter() - t0
            if not o_direct:
                drop_cache(fd)
            t0 = time.perf_counter()
            list(pool.map(r, range(n)))
            read_s = time.perf_counter() - t0
        if not np.array_equal(src, dst):
            raise RuntimeError("baseline read back different bytes than it wrote")
    finally:
        os.close(fd)
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
    }
