"""G3 warm restart (docs/invariants.md #6): how long a worker's G3 pool takes to open again, through the pool's
public constructor, against the I/O it cannot avoid, in the same run.

``--blocks N`` blocks of a tiny layout (8 KiB) are written through a real :class:`~kvbm_backend.pool.g3.G3Pool`
in ``--path`` (default: a directory under /dev/shm where it exists, a RAM disk that stands in for fast NVMe),
then the pool is opened again ``--rounds`` times:

* ``journal_reopen_s``: with its journal (replay, every slot header read and checked, journal rewritten);
* ``scan_reopen_s``: with the journal removed before each open (every slot header of the files read and
  indexed: ``pool/g3/scan.py``);
* ``read_floor_s`` (the baseline): only the bytes a restart must read, the journal file and one 4 KiB header
  per block, by ``os.preadv`` per header as the pool reads them, best of 1 / 4 / 8 / 16 threads (and of
  the rounds).

Medians over the rounds (the floor: the best). ``journal_ratio`` / ``scan_ratio`` = floor / reopen (1.0: the
open costs only its reads). ``python benchmarks/g3_restart.py --blocks 200000 --rounds 3 [--out DIR]`` prints
and writes ``g3_restart.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from kvbm_backend.config import AdmissionConfig, G3Config  # noqa: E402
from kvbm_backend.metrics import new_registry  # noqa: E402
from kvbm_backend.model.layout import KvLayout  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402

LAYOUT = KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64, dtype="bfloat16")  # 8 KiB blocks
NS = Namespace(model="bench/g3-restart", layout=LAYOUT)
BATCH = 4096
HEADER = 4096


def _config(path: str, blocks: int, threads: int) -> G3Config:
    slot = HEADER + LAYOUT.bytes_per_block
    return G3Config(paths=[path], capacity_gb=blocks * slot * 1.05 / 1e9, files_per_path=4, io_threads=threads,
                    admission=AdmissionConfig(policy="all"), write_queue_blocks=100_000)


def _open(path: str, blocks: int, threads: int):
    from kvbm_backend.pool.g3 import G3Pool
    return G3Pool(_config(path, blocks, threads), NS, registry=new_registry())


def _fill(path: str, blocks: int, threads: int) -> None:
    payload = np.zeros(LAYOUT.bytes_per_block, np.uint8)
    with _open(path, blocks, threads) as pool:
        for s in range(0, blocks, BATCH):
            keys = NS.keys(range(s + 1, min(blocks, s + BATCH) + 1))
            r = pool.put(keys, [payload] * len(keys)).result()
            if r.written != len(keys):
                raise SystemExit(f"g3_restart: the pool wrote {r.written} of {len(keys)} blocks ({r})")


def _timed_open(path: str, blocks: int, threads: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    pool = _open(path, blocks, threads)
    took = time.perf_counter() - t0
    st = pool.stats()
    pool.close()
    return took, st


def _read_floor(path: str, threads: int) -> float:
    """Seconds to read the journal file whole and the first 4 KiB of every slot the slab files hold."""
    journal = [f for f in os.listdir(path) if f.startswith("journal-")]
    slabs = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".slab"))
    slot = HEADER + LAYOUT.bytes_per_block
    t0 = time.perf_counter()
    for f in journal:
        with open(os.path.join(path, f), "rb") as fh:
            fh.read()
    fds = [os.open(f, os.O_RDONLY) for f in slabs]
    try:
        work = [(fd, s * slot) for fd in fds for s in range(os.fstat(fd).st_size // slot)]
        if not work:
            raise SystemExit(f"g3_restart: no slab file with a slot in {path}")
        bufs = [bytearray(HEADER) for _ in range(threads)]

        def share(i: int) -> None:
            buf = [bufs[i]]
            for fd, off in work[i::threads]:
                os.preadv(fd, buf, off)
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(share, range(threads)))
        return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def run(path: str, blocks: int, rounds: int, threads: int) -> dict:
    _fill(path, blocks, threads)
    journal = os.path.join(path, f"journal-{NS.fingerprint}.log")
    jt, st_j, scan_t, st_s, floor = [], {}, [], {}, []
    for _ in range(rounds):
        t, st_j = _timed_open(path, blocks, threads)
        jt.append(t)
        floor.append(min(_read_floor(path, n) for n in (1, 4, 8, 16)))
        os.unlink(journal)
        t, st_s = _timed_open(path, blocks, threads)
        scan_t.append(t)
    if st_j.get("restored_blocks") != blocks or st_s.get("restored_by_scan") != blocks:
        raise SystemExit(f"g3_restart: restored {st_j.get('restored_blocks')} (journal) and "
                         f"{st_s.get('restored_by_scan')} (scan) of {blocks} blocks")
    j, s, f = statistics.median(jt), statistics.median(scan_t), min(floor)
    return {"bench": "g3_restart", "blocks": blocks, "rounds": rounds, "io_threads": threads, "path": path,
            "journal_reopen_s": round(j, 4), "scan_reopen_s": round(s, 4), "read_floor_s": round(f, 4),
            "journal_ratio": round(f / j, 3), "scan_ratio": round(f / s, 3),
            "journal_us_per_block": round(j / blocks * 1e6, 2), "scan_us_per_block": round(s / blocks * 1e6, 2),
            "scanned_slots": st_s.get("restore_scanned_slots"), "journal_reopen_all_s": [round(x, 4) for x in jt],
            "scan_reopen_all_s": [round(x, 4) for x in scan_t]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="the pool's g3.io_threads (header reads in flight)")
    ap.add_argument("--path", help="directory to fill (removed afterwards; default: under /dev/shm if present)")
    ap.add_argument("--out", help="directory for g3_restart.json")
    a = ap.parse_args()
    for name, v in (("--blocks", a.blocks), ("--rounds", a.rounds), ("--threads", a.threads)):
        if v < 1:
            ap.error(f"{name}: must be >= 1, got {v}")
    base = a.path or tempfile.mkdtemp(prefix="kvbm-g3-restart-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(base, "g3")
    os.makedirs(path, mode=0o700, exist_ok=False)
    try:
        res = run(path, a.blocks, a.rounds, a.threads)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if not a.path:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "g3_restart.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
