"""Where a G3 device load's own thread spends its time: one :meth:`DeviceLoader.load` of the bench's blocks
run on the calling thread under ``cProfile`` (``gpu_bench.py --sweep`` records it per device path as
``loader_profile``).

On the H200 of 2026-12-04 (tmpfs, 4 GiB, kvikio-compat, 16 threads) the loader's thread was busy ~98% of a
load (``read_wait_s`` + ``verify_s`` + ``submit_s`` ~= ``load_s``): past that point a load is as fast as the
Python the loader's thread runs per pass, and this profile says which calls that is. cProfile slows Python
calls (the profiled load is slower than the timed ones); the ranking, not the seconds, is the result.
"""
from __future__ import annotations

import cProfile
import pstats
import time
from typing import Any


def profile_load(rd: Any, keys: list, dst: Any, top: int = 20) -> dict:
    """Profile ``rd.load(keys, dst)`` (a :class:`~kvbm_backend.pool.g3.read.device.DeviceLoader`; ``dst`` its
    ``[n, bytes_per_block]`` destination). Returns ``{"seconds", "loaded", "top": [{"func", "ncalls",
    "tottime_s", "cumtime_s"}, ...]}``: the ``top`` functions by own time (``tottime``)."""
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    try:
        ok = rd.load(keys, dst)
    finally:
        pr.disable()
    dt = time.perf_counter() - t0
    st = pstats.Stats(pr)
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{file.rsplit('/', 3)[-1] if '/' in file else file}:{line}({name})"
        rows.append({"func": where, "ncalls": nc, "tottime_s": round(tt, 5), "cumtime_s": round(ct, 5)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return {"seconds": round(dt, 4), "loaded": sum(ok), "top": rows[:top]}
