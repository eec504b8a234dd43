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


def worker_phases(g3: Any, rd: Any, kv: Any, ns: Any, seqs: list, ids: list, tenant: str = "bench",
                  repeats: int = 3) -> dict:
    """The steps a connector load takes through :class:`WorkerSide` beside the loader's own, each timed on the
    calling thread (median of ``repeats``, seconds): ``keys`` (the namespace's block keys of the sequence
    hashes), ``lease_release`` (G3's lease of every slot and its release), ``staging`` (the ``[n, bytes]``
    destination on the engine's device), ``load`` (:meth:`DeviceLoader.load` into it, which leases too),
    ``scatter`` (into the engine's paged KV, waited for on its device). The gap between a load through the
    worker and the loader's ``load_s`` is the sum of the others (and the worker's thread hand-offs)."""
    import statistics

    import torch

    def timed(fn: Any, *args: Any, **kw: Any) -> tuple[float, Any]:
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        return time.perf_counter() - t0, out

    def lease_release(keys: list) -> None:
        g3.release([x for x in g3.lease(keys) if x is not None])

    bpb = kv.layout.bytes_per_block
    steps: dict[str, list[float]] = {k: [] for k in ("keys", "lease_release", "staging", "load", "scatter")}
    loaded = 0
    for _ in range(repeats):
        t, keys = timed(ns.keys, seqs, tenant, 0)
        steps["keys"].append(t)
        steps["lease_release"].append(timed(lease_release, keys)[0])
        t, dst = timed(torch.empty, (len(keys), bpb), dtype=torch.uint8, device=kv.device)
        steps["staging"].append(t)
        t, ok = timed(rd.load, keys, dst)
        steps["load"].append(t)
        loaded = sum(ok)
        steps["scatter"].append(timed(kv.scatter, dst, ids)[0])
        del dst
    return {"loaded": loaded, **{k: round(statistics.median(v), 5) for k, v in steps.items()}}
