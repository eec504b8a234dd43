"""Engine comparison: the same write+fdatasync / read through each I/O engine vs the raw baseline.

Run: ``python -m kvbm_backend.apps.bench.engines [DIR] [--total-mib 256] [--io-kib 1024] [--inflight 8]
[--repeats 3]`` (prints JSON). Used to choose ``make_engine("auto")`` (see :mod:`kvbm_backend.io`).

Variants: ``posix`` (thread pool, ``inflight`` threads), ``nixl`` (NIXL POSIX/AIO, ``inflight``
transfers of one 1-op descriptor each: the same I/Os in flight as the baseline), ``nixl_batched``
(NIXL POSIX/AIO, 64 descriptors per transfer: NIXL's strength, many more I/Os in the kernel queue),
``nixl_uring`` (as ``nixl`` with io_uring). Each runs on its own fresh temp file; reads are checked
against what was written.

The baseline is the disk's limit, not the variants' settings: the best of plain ``pwrite``/``pread`` over
1, 4, 8, 16 and 64 threads (64: the batched variant's queue depth) x the I/O size, 1 MiB and 4 MiB
(:func:`kvbm_backend.apps.bench.baseline.odirect_sweep`; every point in ``baseline["sweep"]``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import NoReturn

import numpy as np

from kvbm_backend.io import make_engine
from kvbm_backend.io.base import IoOp
from kvbm_backend.io.probe import fdatasync, open_file, probe_o_direct
from kvbm_backend.memory import aligned_empty
from .baseline import SWEEP_THREADS, check_sizes, drop_cache, odirect_sweep, random_aligned

VARIANTS = ("posix", "nixl", "nixl_batched", "nixl_uring")
BASELINE_THREADS = (*SWEEP_THREADS, 64)  # 64: nixl_batched's descriptors per transfer


def _engine(variant: str, inflight: int):
    if variant == "posix":
        return make_engine("posix", threads=inflight)
    from kvbm_backend.io.nixl_engine import NixlEngine

    if variant == "nixl":
        return NixlEngine(threads=inflight, queue_depth=1)
    if variant == "nixl_batched":
        return NixlEngine(threads=inflight, queue_depth=64)
    if variant == "nixl_uring":
        return NixlEngine(threads=inflight, queue_depth=1, mode="uring")
    raise ValueError(f"unknown engine variant {variant!r}; expected one of {VARIANTS}")


def engine_run(variant: str, directory: str, total_bytes: int, io_size: int, inflight: int) -> dict:
    """One write (+ one fdatasync, timed) and one read of ``total_bytes`` through an engine variant.

    Returns ``{"write_gbps", "read_gbps", "write_s", "read_s"}`` (GB = 1e9 bytes).
    Raises RuntimeError if the bytes read back differ; OSError from the engine.
    """
    n = check_sizes(total_bytes, io_size, inflight)
    o_direct = probe_o_direct(directory)
    src = random_aligned(total_bytes, seed=2)
    dst = aligned_empty(total_bytes)
    dst[:] = 0  # fault the pages in before timing (both baseline and engines)
    fd_tmp, path = tempfile.mkstemp(prefix=f".kvbm-bench-{variant}-", dir=directory)
    os.close(fd_tmp)
    fd = open_file(path, o_direct=o_direct, create=False)
    eng = _engine(variant, inflight)
    try:
        w = [IoOp(fd, i * io_size, [src[i * io_size:(i + 1) * io_size]], write=True) for i in range(n)]
        r = [IoOp(fd, i * io_size, [dst[i * io_size:(i + 1) * io_size]], write=False) for i in range(n)]
        t0 = time.perf_counter()
        eng.submit(w).result()
        fdatasync(fd)
        write_s = time.perf_counter() - t0
        if not o_direct:
            drop_cache(fd)
        t0 = time.perf_counter()
        got = eng.submit(r).result()
        read_s = time.perf_counter() - t0
        if sum(got) != total_bytes or not np.array_equal(src, dst):
            raise RuntimeError(f"engine {variant} read back different bytes than it wrote")
    finally:
        eng.close()
        os.close(fd)
        os.unlink(path)
    return {"write_gbps": total_bytes / write_s / 1e9, "read_gbps": total_bytes / read_s / 1e9,
            "write_s": write_s, "read_s": read_s}


def compare_engines(directory: str, total_bytes: int, io_size: int, inflight: int, *,
                    repeats: int = 1, variants: tuple[str, ...] = VARIANTS) -> dict:
    """Baseline sweep and every engine variant, interleaved ``repeats`` times; medians and bests are reported.

    Returns ``{"params": {...}, "baseline": {...}, VARIANT: {..., "write_ratio", "read_ratio",
    "write_ratio_best", "read_ratio_best"}, ...}``: ratios are the variant's GB/s over the baseline's
    (medians of the same run, the baseline's at its best point of that direction; ``*_best``: best run over
    best run, less sensitive to other load). The baseline is the best point of a threads x I/O size sweep
    (first repeat: every point; later ones: the best points again), every point in ``baseline["sweep"]``.
    A variant that cannot run here (NIXL missing) appears as ``{"error": reason}``.

    Raises:
        ValueError: bad sizes (see :func:`kvbm_backend.apps.bench.baseline.check_sizes`) or ``repeats`` < 1.
    """
    check_sizes(total_bytes, io_size, inflight)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    errors: dict[str, str] = {}
    sweep = odirect_sweep([directory], total_bytes, io_size, threads=BASELINE_THREADS)
    for rep in range(repeats):
        sweep.measure(full=rep == 0)
        for v in variants:
            if v in errors:
                continue
            try:
                runs[v].append(engine_run(v, directory, total_bytes, io_size, inflight))
            except RuntimeError as e:
                if "unavailable" not in str(e):
                    raise
                errors[v] = str(e)

    def med(rs: list[dict]) -> dict:
        m = {k: statistics.median(r[k] for r in rs) for k in ("write_gbps", "read_gbps", "write_s", "read_s")}
        m["write_gbps_best"] = max(r["write_gbps"] for r in rs)  # least disturbed run (noisy neighbours)
        m["read_gbps_best"] = max(r["read_gbps"] for r in rs)
        return m

    out: dict = {"params": {"directory": directory, "total_bytes": total_bytes, "io_size": io_size,
                            "inflight": inflight, "repeats": repeats, "o_direct": sweep.o_direct,
                            "cpus": os.cpu_count()}}
    sw = sweep.result()
    bw, br = sw["best_write"], sw["best_read"]
    wruns = next(p["write_gbps_runs"] for p in sw["points"] if p["threads"] == bw["threads"] and p["io_size"] == bw["io_size"])
    rruns = next(p["read_gbps_runs"] for p in sw["points"] if p["threads"] == br["threads"] and p["io_size"] == br["io_size"])
    base = {"write_gbps": statistics.median(wruns), "read_gbps": statistics.median(rruns),
            "write_gbps_best": bw["gbps"], "read_gbps_best": br["gbps"], "sweep": sw}
    out["baseline"] = base
    for v in variants:
        if v in errors:
            out[v] = {"error": errors[v]}
            continue
        m = med(runs[v])
        m["write_ratio"] = m["write_gbps"] / base["write_gbps"]
        m["read_ratio"] = m["read_gbps"] / base["read_gbps"]
        m["write_ratio_best"] = m["write_gbps_best"] / base["write_gbps_best"]
        m["read_ratio_best"] = m["read_gbps_best"] / base["read_gbps_best"]
        out[v] = m
    return out


def _fail(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _check_args(a: argparse.Namespace) -> None:
    """One ``error:`` line naming the option (exit 2) for a bad value."""
    for name, v in (("--total-mib", a.total_mib), ("--io-kib", a.io_kib), ("--inflight", a.inflight),
                    ("--repeats", a.repeats)):
        if v < 1:
            _fail(f"{name}: must be >= 1 (got {v})")
    if a.io_kib % 4:
        _fail(f"--io-kib: must be a multiple of 4 (4 KiB, the O_DIRECT alignment; got {a.io_kib})")
    if a.total_mib * 1024 % a.io_kib:
        _fail(f"--total-mib: {a.total_mib} MiB is not a whole number of --io-kib {a.io_kib} I/Os")
    if not os.path.isdir(a.directory):
        _fail(f"DIRECTORY: {a.directory}: no such directory")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = _fail  # type: ignore[method-assign,assignment]  # usage errors as one line too
    p.add_argument("directory", nargs="?", default=tempfile.gettempdir())
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--io-kib", type=int, default=1024)
    p.add_argument("--inflight", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    _check_args(a)
    import logging

    try:  # NIXL configures its logger (INFO, to stdout) on import: import first, then quieten it
        import nixl._api  # noqa: F401
    except Exception:  # noqa: BLE001 - NIXL missing: its variants report the reason
        pass
    logging.getLogger("nixl").setLevel(logging.WARNING)  # keep stdout pure JSON
    try:
        res = compare_engines(a.directory, a.total_mib << 20, a.io_kib << 10, a.inflight, repeats=a.repeats)
    except (OSError, RuntimeError) as e:
        _fail(f"{a.directory}: {e}")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
