"""``kvbm-backend bench --tier g3``: write then read N blocks through :class:`G3Pool`, against plain
O_DIRECT I/O of the same bytes in the same run: the best of a sweep
(:func:`kvbm_backend.apps.bench.baseline.odirect_sweep`: 1/4/8/16 threads x I/O sizes of one slot, 1 MiB and
4 MiB, on every ``--path`` directory at once, the same share each), whatever the pool's ``--threads`` /
``--io-size``. ``baseline_sweep`` lists every point measured and the best of each direction; the ratios
are against those bests.

The pool runs as in production: admission ``all`` (every block written), ``fsync`` on (a put's Future
completes only after fdatasync and publish), headers and xxh3_128 checksums written and verified on
every read; its load deadline is the largest ``g3.load_timeout_s`` (120 s), not the 5 s serving default: a read
slowed by a busy machine is measured, not turned into a miss (CI 2026-12-03: 32 blocks read on a loaded 2-core
runner missed by ``timeout`` and the bench failed). Both sides run ``rounds`` times alternately, each in a fresh directory; the best of each is
reported (a virtual disk's throughput drifts between runs). Throughputs count payload bytes
(``blocks * block_bytes``; GB = 1e9 bytes); the pool also moves a 4 KiB header per block, the baseline
moves ``blocks * slot_bytes`` rounded up to the I/O size. The first round measures every sweep point, the
later ones the best write and read points again.

The read buffers of both sides are faulted in before timing. Reads defeat the page cache: O_DIRECT where the filesystem takes it, else the slab files' pages are
dropped with ``posix_fadvise(DONTNEED)`` before reading (``page_cache`` in the result says which).
"""
from __future__ import annotations

import os
import resource
import shutil
import time
import uuid

import numpy as np

from kvbm_backend.config import LOAD_TIMEOUT_MAX_S, AdmissionConfig, G3Config, io_size_problem
from kvbm_backend.memory import aligned_empty
from kvbm_backend.metrics import new_registry
from kvbm_backend.model.frame import slot_bytes
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.model.presets import load_preset
from . import BenchOptions, rounds_progress
from ..signals import raise_if_terminated
from .baseline import odirect_sweep, random_aligned

ROUNDS = 3


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pool_round(dirs: list[str], ns: Namespace, opts: BenchOptions, src: np.ndarray, dst: np.ndarray) -> dict:
    from kvbm_backend.pool import open_pool
    from kvbm_backend.pool.g3.pool import G3Pool

    lay = ns.layout
    bb = lay.bytes_per_block
    n = opts.blocks
    cap_gb = (n * slot_bytes(bb) * 1.05 + (256 << 20)) / 1e9
    cfg = G3Config(paths=dirs, capacity_gb=cap_gb, io_size_bytes=opts.io_size_bytes, engine=opts.engine,
                   io_threads=opts.threads, write_queue_blocks=max(n, 1), fsync=True,
                   admission=AdmissionConfig(policy="all"), min_free_fraction=0.02, load_timeout_s=LOAD_TIMEOUT_MAX_S)
    pool = open_pool(cfg, ns, registry=new_registry())
    assert isinstance(pool, G3Pool)  # open_pool(G3Config) opens a G3Pool; the bench reads its slab files
    try:
        keys = ns.keys(range(1, n + 1))
        blocks = [src[i * bb:(i + 1) * bb] for i in range(n)]
        outs = [dst[i * bb:(i + 1) * bb] for i in range(n)]
        c0 = _cpu()
        t0 = time.perf_counter()
        res = pool.put(keys, blocks).result()
        write_s = time.perf_counter() - t0
        c1 = _cpu()
        if res.written != n:
            st = pool.stats()
            full = {k: v for k, v in st["dropped_by_reason"].items() if k in ("no_space", "enospc") and v}
            if full or st["enospc"]:
                raise OSError(f"--path: no room for --blocks {n}: the pool wrote {res.written} (dropped {full}); "
                              "free space on the --path directories or use fewer --blocks")
            raise RuntimeError(f"bench: pool wrote {res.written} of {n} blocks ({res}); stats {st}")
        o_direct = all(f.o_direct for f in pool.slabs.files)
        if not o_direct:
            for f in pool.slabs.files:
                os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        c2 = _cpu()
        t0 = time.perf_counter()
        got = pool.get(keys, outs).result()
        read_s = time.perf_counter() - t0
        c3 = _cpu()
        if not all(got.ok) or not np.array_equal(src[:n * bb], dst[:n * bb]):
            raise RuntimeError(f"bench: pool read back {sum(got.ok)} of {n} verified blocks; stats {pool.stats()}")
        st = pool.stats()
        return {"write_s": write_s, "read_s": read_s, "cpu_s": (c1 - c0) + (c3 - c2), "o_direct": o_direct,
                "engine": st["engine"], "files": st["files"], "slot_bytes": st["slot_bytes"],
                "io_size_bytes": st["io_size_bytes"]}
    finally:
        pool.close()


def run(opts: BenchOptions) -> dict:
    """Run the G3 benchmark. Returns the JSON-able result (see module doc).

    Raises:
        ValueError: no ``--path``, bad layout/page size/TP, ``blocks`` < 1, or an I/O size not a
            multiple of 4 KiB.
        RuntimeError: the pool lost or corrupted blocks (never expected).
    """
    if not opts.path:
        raise ValueError("--path: bench --tier g3 needs a directory (several: comma-separated)")
    if opts.blocks < 1:
        raise ValueError(f"--blocks: must be >= 1, got {opts.blocks}")
    if io_size_problem(opts.io_size_bytes):
        raise ValueError(f"--io-size: {io_size_problem(opts.io_size_bytes)} (got {opts.io_size_bytes})")
    lay = load_preset(opts.layout).layout(page_size=opts.page_size, tp=opts.tp)
    ns = Namespace(model=f"bench/{opts.layout}", layout=lay, tp_world_size=opts.tp)
    bb = lay.bytes_per_block
    n = opts.blocks
    sb = slot_bytes(bb)
    roots = [p.strip() for p in opts.path.split(",") if p.strip()]
    for r in roots:
        os.makedirs(r, exist_ok=True)
    src = random_aligned(-(-n * bb // 4096) * 4096, seed=7)
    dst = aligned_empty(src.nbytes)
    dst[:] = 0  # fault the pages in before timing, as the baseline does with its read buffer
    pool_runs = []
    sweep = odirect_sweep(roots, n * sb, sb)
    with rounds_progress(opts.progress, "bench g3", 2 * ROUNDS) as advance:
        for rnd in range(ROUNDS):
            raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
            dirs = [os.path.join(r, f"kvbm-bench-g3-{uuid.uuid4().hex[:8]}") for r in roots]
            try:
                pool_runs.append(_pool_round(dirs, ns, opts, src, dst))
            finally:
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
            advance()
            sweep.measure(full=rnd == 0)
            advance()
    payload = n * bb
    best_w = min(r["write_s"] for r in pool_runs)
    best_r = min(r["read_s"] for r in pool_runs)
    bw, br = sweep.best_gbps("write"), sweep.best_gbps("read")
    write_gbps = payload / best_w / 1e9
    read_gbps = payload / best_r / 1e9
    cpu = min(r["cpu_s"] for r in pool_runs)
    o_direct = pool_runs[0]["o_direct"]
    return {
        "tier": "g3",
        "layout": opts.layout,
        "page_size": opts.page_size,
        "tp": opts.tp,
        "block_bytes": bb,
        "slot_bytes": sb,
        "blocks": n,
        "payload_bytes": payload,
        "io_size_bytes": pool_runs[0]["io_size_bytes"],
        "inflight": opts.threads,
        "engine": pool_runs[0]["engine"],
        "files": pool_runs[0]["files"],
        "fsync": True,
        "o_direct": o_direct,
        "page_cache": "bypassed (O_DIRECT)" if o_direct else "dropped before reads (posix_fadvise DONTNEED)",
        "rounds": ROUNDS,
        "write_gbps": write_gbps,
        "read_gbps": read_gbps,
        "baseline_write_gbps": bw,
        "baseline_read_gbps": br,
        "baseline": ("best of plain O_DIRECT" if sweep.o_direct else "best of plain buffered")
        + " pwrite/pread (threads x I/O size), every --path at once",
        "baseline_o_direct": sweep.o_direct,
        "baseline_sweep": sweep.result(),
        "write_ratio": write_gbps / bw if bw else None,
        "read_ratio": read_gbps / br if br else None,
        "cpu_s_per_gb": cpu / (2 * payload / 1e9),
        "pool_write_s": [r["write_s"] for r in pool_runs],
        "pool_read_s": [r["read_s"] for r in pool_runs],
    }
