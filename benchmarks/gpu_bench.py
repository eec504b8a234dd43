#!/usr/bin/env python3
"""One-call GPU benchmark of the storage -> HBM path (issue 5). Needs a CUDA GPU and the NVIDIA driver.

Measures, in one process, each section recorded even if a later one fails:

1. ``h2d``: pinned host -> device copy bandwidth (and pageable, for context), 1 GiB copies, median.
2. ``file_to_hbm``: a ``--file-gib`` file read cold (``posix_fadvise(DONTNEED)`` after ``fsync``) with
   (a) O_DIRECT ``preadv`` into pinned host memory, 8 threads x 8 MiB (the storage's own limit here) and
   (b) kvikio ``CuFile.pread`` straight into a device tensor (GDS or compat: the JSON says which, from
   kvikio/cuFile and ``/proc/driver/nvidia-fs``); bytes compared on the device. Also a warm re-read.
3. ``connector_load``: the connector's worker role (``WorkerSide.start_loads`` / ``get_finished``, as
   vLLM drives it) loading Llama-3.1-8B blocks (16 tokens = 2 MiB) into vLLM's CUDA KV layout from a real
   G3 pool (saved through the worker first, so frames carry the GPU-computed device checksum) on each
   storage of ``--workdirs`` (default: the VM disk and a tmpfs), in the probed device path,
   ``pinned-bounce`` and ``kvikio-compat``, and from G4 (file store, encrypted vs plain); against that
   storage's limit (:mod:`pipeline_baseline`: the best threads x piece Python pipeline or kvikio read of
   the same bytes, with CPU cores used) and pinned H2D in the same run. Every byte is compared on the device; a corrupted block must be a miss
   that leaves its engine block untouched.
4. ``prefill``: a Llama-3.1-8B-shaped ``transformers`` model (``LlamaConfig`` of
   meta-llama/Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256;
   random bf16 weights) timed on prefill of ``--contexts`` tokens (``use_cache=False``,
   ``logits_to_keep=1``); load time of the same tokens' KV (131072 B/token) at the measured connector
   GB/s (measured directly up to the file size, projected beyond it: the JSON marks which), and the
   ratio recompute / load.
5. ``layerwise`` (:mod:`layerwise_bench`): the same forward with load-then-compute vs layer-wise overlap.

Goals: :func:`goals_of` (issue 24).

Writes ``gpu_bench-<device>.json`` to ``--out`` (default ``$OUT`` if set, else ``benchmarks/results``).
Run from the repository root: ``python benchmarks/gpu_bench.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_baseline import best_pipeline  # noqa: E402 - the storage limit (issue 24 item 1)
from loader_profile import profile_load, worker_phases  # noqa: E402 - where a load's time goes
from layerwise_bench import bench_layerwise  # noqa: E402 - layer-wise overlap (issue 24 item 5)

GIB = 1 << 30


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (user + system)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _now() -> float:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def bench_h2d(res: dict, size: int = GIB, iters: int = 8) -> None:
    import torch
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = {}
    for name, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        host.fill_(7)
        dev.copy_(host, non_blocking=pin)
        ts = []
        for _ in range(iters):
            t0 = _now()
            dev.copy_(host, non_blocking=pin)
            ts.append(_now() - t0)
        out[f"{name}_GBps"] = round(size / statistics.median(ts) / 1e9, 2)
        del host
    out["bytes_per_copy"] = size
    res["h2d"] = out


def _write_pattern_file(path: str, nbytes: int, chunk: int = 64 << 20):
    """A file of ``nbytes`` = repeats of one random ``chunk``; returns the chunk as a device tensor."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(1234)
    pat = torch.randint(0, 256, (chunk,), dtype=torch.uint8, device="cuda", generator=g)
    host = pat.cpu().numpy().tobytes()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, nbytes, chunk):
            os.pwrite(fd, host[:min(chunk, nbytes - off)], off)
        _drop_cache(fd)
    finally:
        os.close(fd)
    return pat


def bench_file_to_hbm(res: dict, workdir: str, nbytes: int) -> None:
    import torch
    from kvbm_backend.io.base import IoOp
    from kvbm_backend.io.kvikio_engine import KvikioEngine, kvikio_mode
    from kvbm_backend.io.posix import PosixEngine
    chunk = 64 << 20
    nbytes = nbytes // chunk * chunk
    path = os.path.join(workdir, "kvbm-gpu-bench.bin")
    pat = _write_pattern_file(path, nbytes, chunk)
    out: dict = {"bytes": nbytes, "file": path, "kvikio": kvikio_mode()}
    # (a) storage's own limit: O_DIRECT into pinned host
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    hn = host.numpy()
    io = 8 << 20
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        out["odirect"] = True
    except OSError as e:  # the filesystem refuses O_DIRECT: buffered, after dropping the cache
        fd = os.open(path, os.O_RDONLY)
        out["odirect"] = f"refused ({e}); buffered read after posix_fadvise(DONTNEED)"
    eng = PosixEngine(threads=8)
    try:
        _drop_cache(fd)
        t0 = time.perf_counter()
        eng.submit([IoOp(fd, o, [hn[o:o + io]], False) for o in range(0, nbytes, io)]).result()
        out["odirect_to_pinned_cold_GBps"] = round(nbytes / (time.perf_counter() - t0) / 1e9, 2)
    finally:
        eng.close()
        os.close(fd)
    del host, hn
    # (b) kvikio straight into HBM
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    keng = KvikioEngine(threads=16)
    fd = os.open(path, os.O_RDONLY)
    try:
        for label, cold in (("cold", True), ("warm", False)):
            dev.zero_()
            if cold:
                _drop_cache(fd)
            t0 = _now()
            n = keng.read_to_device(fd, dev, nbytes, 0)
            dt = _now() - t0
            ok = n == nbytes and bool(torch.equal(dev.view(-1, chunk), pat.expand(nbytes // chunk, chunk)))
            out[f"kvikio_to_hbm_{label}_GBps"] = round(nbytes / dt / 1e9, 2)
            out[f"kvikio_to_hbm_{label}_bytes_ok"] = ok
    finally:
        keng.forget_fd(fd)
        keng.close()
        os.close(fd)
    del dev
    h2d = res.get("h2d", {}).get("pinned_GBps")
    if h2d:
        out["ratio_kvikio_cold_vs_pinned_h2d"] = round(out["kvikio_to_hbm_cold_GBps"] / h2d, 3)
    out["ratio_kvikio_cold_vs_storage_odirect"] = round(
        out["kvikio_to_hbm_cold_GBps"] / out["odirect_to_pinned_cold_GBps"], 3)
    os.unlink(path)
    res["file_to_hbm"] = out


def _raw_read_gbps(path: str, nbytes: int, threads: int = 8, io: int = 8 << 20) -> tuple[float, str]:
    """The storage's own limit for ``path``: ``nbytes`` read cold with O_DIRECT ``preadv`` (buffered after
    ``posix_fadvise(DONTNEED)`` where the filesystem refuses O_DIRECT, e.g. tmpfs) into pinned host
    memory (plain host memory on a CPU-only machine), ``threads`` x ``io``-byte reads in flight."""
    import numpy as np
    import torch
    from kvbm_backend.io.base import IoOp
    from kvbm_backend.io.files import open_for_read
    from kvbm_backend.io.posix import PosixEngine
    from kvbm_backend.memory import aligned_empty
    pin = torch.cuda.is_available()
    hn = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy() if pin else aligned_empty(nbytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    chunk = np.random.default_rng(5).integers(0, 256, min(nbytes, 64 << 20), dtype=np.uint8).tobytes()
    for off in range(0, nbytes, len(chunk)):
        os.pwrite(fd, chunk[:min(len(chunk), nbytes - off)], off)
    _drop_cache(fd)
    os.close(fd)
    fd, direct = open_for_read(path, True)  # the project's one O_DIRECT rule (kvbm_backend.io.files)
    how = "O_DIRECT" if direct else "buffered after posix_fadvise(DONTNEED) (O_DIRECT refused)"
    eng = PosixEngine(threads=threads)
    try:
        _drop_cache(fd)
        t0 = time.perf_counter()
        eng.submit([IoOp(fd, o, [hn[o:o + min(io, nbytes - o)]], False) for o in range(0, nbytes, io)]).result()
        return nbytes / (time.perf_counter() - t0) / 1e9, how
    finally:
        eng.close()
        os.close(fd)
        os.unlink(path)


def _drop_dir_cache(d: str) -> None:
    for root, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


LOAD_REPEATS = 3  # timed G3 and G4 loads after the first one (median reported)
SAVE_JOB_BLOCKS = 128  # blocks per save job in the benchmark (256 MiB of Llama-3.1-8B KV)


def _minflt() -> int:
    """Minor page faults of this process so far (``getrusage``): fresh pages a load touched."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _g4_load_stats(g4) -> dict:
    """The G4 pool's load counters a bench records (hits, misses, bytes read, bounce buffers allocated past the
    arena)."""
    st = g4.stats()
    return {k: st[k] for k in ("hits", "misses", "corrupt", "bytes_read", "bounce_overflow") if k in st}


def _load_through_worker(worker, ids, seqs, tiers, tenant="bench", timeout=600):
    """``start_loads`` + ``get_finished`` polling, as vLLM drives the connector; (seconds, load errors)."""
    from kvbm_backend.integrations.vllm.metadata import LoadJob
    t0 = _now()
    worker.start_loads([LoadJob("bench", list(ids), list(seqs), list(tiers), tenant)])
    end = time.monotonic() + timeout
    while "bench" not in worker.get_finished():
        if time.monotonic() > end:
            raise TimeoutError("connector load never finished")
        time.sleep(0.0005)
    if worker.on_cuda:  # the scatter into the paged KV is queued on the engine's stream: count it
        import torch
        torch.cuda.synchronize(worker.kv.device)
    return _now() - t0, worker.load_errors()


def bench_connector_load(res: dict, workdirs: list[str], nbytes: int, device: str = "cuda",
                         g4_fraction: float = 0.25, sweep: bool = False, io_threads: int | None = None,
                         device_checksum: str = "on", engine_busy: float = 0.0) -> None:
    """The connector's worker role (:class:`WorkerSide`: what vLLM calls from ``start_load_kv``) loading
    Llama-3.1-8B blocks into vLLM's CUDA KV layout (per layer ``[2, num_blocks, 16, 8, 128]`` bf16) from a
    real G3 pool on each storage in ``workdirs`` (each device path: the probed one and ``pinned-bounce``),
    and from G4 (file store on the same storage, encrypted and not), against the storage's raw read and
    pinned H2D measured in the same run. Blocks are saved through the worker first (frames then carry
    the device checksum computed on the GPU). Every loaded byte is compared with the original on the
    device; a corrupted block must be a miss that leaves its engine block untouched.

    ``sweep``: on storages faster than 5 GB/s, also load through the worker with the device reader's
    pipeline knobs varied (passes in flight, staging bytes per pass, bytes per read), to
    choose the defaults; recorded under ``sweep``. With ``sweep`` on such storages (and on the CPU smoke run), G4 is
    also loaded at each ``g4.max_inflight`` of :data:`G4_INFLIGHT_SWEEP` (``g4_inflight_sweep``); the headline G4
    loads run at the config's default (64 before 2026-12-04 evening: more I/O threads than a 16-core host's GIL-bound
    per-block Python gains from, ``g4_load`` reached 10.2 GB/s at 8 threads, 7.5 at 16).

    ``device_checksum``: the worker's setting for the saved frames (``"on"``: what ``auto`` does on a CUDA
    engine; ``"auto"`` on the CPU: what a CPU engine runs, xxh3 checked on the host). Each load's minor page
    faults are recorded (``page_faults_per_load``): fresh pages a load touches cost kernel time per load.

    ``engine_busy`` (0 < F <= 1): the probed G3 path is also loaded with an engine's step loop stepping in this
    process (:class:`~kvbm_backend.apps.bench.busy_engine.BusyEngine`, F of each 10 ms step running Python), at
    CPython's 5 ms switch interval and at ``load_gil_switch_ms``'s default (the connector's own setting):
    ``g3_auto_engine_busy``. Loads otherwise run as the connector runs them (``load_gil_switch_ms`` default)."""
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations import load_priority
    load_priority.configure(KvbmBackendConfig().load_gil_switch_ms)  # as open_tiers does for the connector
    import shutil

    import torch
    from kvbm_backend.config import G3Config, G4Config
    from kvbm_backend.integrations.vllm.kv_io import EngineKv
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    from kvbm_backend.model.frame import HEADER_BYTES
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.model.presets import load_preset
    from kvbm_backend.pool.g3.pool import G3Pool
    layout = load_preset("llama-3.1-8b").layout(page_size=16, tp=1)
    heads, hd = 8, layout.inner_dim // 8
    bpb = layout.bytes_per_block
    n = max(8, nbytes // bpb)
    nb = n + 8
    g = torch.Generator(device=device).manual_seed(99)
    # vLLM 0.32's GPU KV cache (FlashAttention's default KVCacheLayout LBNHC, NHD): memory [nb, 16, heads, 2 * hd],
    # the logical [nb, heads, 16, 2 * hd] with K|V packed on the last dim (kv_io "packed"; on --smoke-cpu too)
    tensors = [torch.randint(-30000, 30000, (nb, 16, heads, 2 * hd), dtype=torch.int16, device=device, generator=g)
               .view(torch.bfloat16).permute(0, 2, 1, 3) for _ in range(layout.num_layers)]
    kv = EngineKv.from_tensors(tensors, nb, 16, heads, hd, packed=True)
    assert kv.layout == layout and kv.engine_layout == "packed"
    ref = [t.clone() for t in tensors]
    ns = Namespace(model="bench/llama-3.1-8b", revision="random", layout=layout, tp_world_size=1, kv_version=2)
    ids, seqs = list(range(n)), list(range(1, n + 1))
    h2d = res.get("h2d", {}).get("pinned_GBps")
    out: dict = {"device_io_threads": io_threads or G3Config().device_io_threads, "blocks": n, "bytes_per_block": bpb, "payload_bytes": n * bpb, "tokens": n * layout.page_size,
                 "engine_layout": "packed LBNHC [num_blocks, 8, 16, 2 x 128] bf16 x 32 layers (vLLM 0.32 GPU default)",
                 "storages": {}}

    def clear(rows):
        for t in tensors:
            t[rows] = 0

    def same(rows) -> bool:
        idx = torch.as_tensor(list(rows), device=device)  # compared as int16: random bf16 bits hold NaNs
        return all(torch.equal(t.view(torch.int16).index_select(0, idx), r.view(torch.int16).index_select(0, idx))
                   for t, r in zip(tensors, ref))

    best = 0.0
    res["connector_load"] = out
    for wd in workdirs:
        so: dict = {"workdir": wd}
        os.makedirs(wd, exist_ok=True)
        raw, how = _raw_read_gbps(os.path.join(wd, "kvbm-raw.bin"), n * bpb)
        so["raw_read_GBps"], so["raw_read_how"] = round(raw, 2), how
        # the storage limit: the best threads x piece storage -> pinned -> device pipeline (issue 24 item 1)
        pl = best_pipeline(os.path.join(wd, "kvbm-pipeline.bin"), n * bpb, device,
                           **({} if device != "cpu" else {"threads": (1, 2), "pieces": (4 << 20,)}))
        so["pipeline"] = pl
        storage = pl["best"]["GBps"]
        limit = min(storage, h2d) if h2d else storage
        so["storage_limit_GBps"], so["limit_GBps"] = storage, round(limit, 2)
        g3dir = os.path.join(wd, "kvbm-g3")
        shutil.rmtree(g3dir, ignore_errors=True)
        modes = ["auto", "pinned-bounce", "kvikio-compat"] if device != "cpu" else ["auto"]
        for i, mode in enumerate(modes):
            cfg = G3Config(paths=[g3dir], capacity_gb=n * (bpb + 8192) / 1e9 * 1.1 + 0.1, files_per_path=4,
                           admission={"policy": "all"}, load_timeout_s=120, device_path=mode,
                           **({"device_io_threads": io_threads} if io_threads else {}))
            g3 = G3Pool(cfg, ns)
            w = WorkerSide(ns, 0, g3, None, load_timeout_s=600, device_checksum=device_checksum)
            try:
                w.register(kv)
                rd = g3.device_reader(kv.device)
                if i == 0:  # save once (later modes reopen the same pool: warm restart)
                    t0 = _now()
                    for a in range(0, n, SAVE_JOB_BLOCKS):
                        # one job at a time, flushed: the worker's write-behind bound drops what does not fit
                        # (never stall decode), and a benchmark must load every block it saved
                        w.save([SaveJob("save", ids[a:a + SAVE_JOB_BLOCKS], seqs[a:a + SAVE_JOB_BLOCKS], "bench")])
                        w.flush_saves(600)  # a CUDA engine hands saves to the pools on its save thread
                        g3.flush(timeout=600)
                    so["save_GBps_through_worker"] = round(n * bpb / (_now() - t0) / 1e9, 2)
                    st = g3.stats()
                    so["saved_blocks"], so["save_dropped"] = st["blocks"], st.get("offloads_dropped", 0)
                    if st["blocks"] != n:
                        raise RuntimeError(f"{wd}: saved {st['blocks']} of {n} blocks into G3 ({st})")
                else:
                    so[f"restored_blocks_{mode}"] = g3.stats()["blocks"]
                # the first load of a process also allocates the reader's staging ring and compiles the
                # checksum kernel: reported on its own; the rate is the median of the loads after it
                times, cpus, faults, errs_all, ok_all = [], [], [], 0, True
                for _ in range(1 + LOAD_REPEATS):
                    clear(ids)
                    _drop_dir_cache(g3dir)
                    c0, f0 = _cpu_s(), _minflt()
                    dt, errs = _load_through_worker(w, ids, seqs, ["G3"] * n)
                    cpus.append(_cpu_s() - c0)
                    faults.append(_minflt() - f0)
                    times.append(dt)
                    errs_all += len(errs)
                    ok_all = ok_all and same(ids) and not errs
                dt = statistics.median(times[1:])
                r = {"mode": rd.mode, "mode_reason": rd.mode_reason, "block_moves": kv.move_mode,
                     "seconds": round(dt, 4),
                     "GBps_payload": round(n * bpb / dt / 1e9, 2), "load_errors": errs_all,
                     "first_load_s": round(times[0], 4), "first_load_GBps": round(n * bpb / times[0] / 1e9, 2),
                     "loads_s": [round(t, 4) for t in times], "bytes_ok": ok_all, "reader_stats": rd.stats(),
                     "pool_device_hits": g3.stats()["device_hits"], "page_faults_per_load": faults,
                     "cpu_cores": round(statistics.median(cpus[1:]) / dt, 2),
                     "cpu_s_per_gb": round(statistics.median(cpus[1:]) / (n * bpb / 1e9), 3)}
                r["ratio_vs_limit"] = round(r["GBps_payload"] / limit, 3)
                r["ratio_vs_storage_limit"] = round(r["GBps_payload"] / storage, 3)
                if h2d:
                    r["ratio_vs_pinned_h2d"] = round(r["GBps_payload"] / h2d, 3)
                so[f"g3_{mode}"] = r
                if engine_busy and i == 0:
                    so["g3_auto_engine_busy"] = _engine_busy_loads(w, ids, seqs, bpb, clear, same, engine_busy)
                out["storages"][wd] = so  # partial results survive a later failure
                if r["bytes_ok"]:
                    best = max(best, r["GBps_payload"])
                if sweep and storage > 5 and mode != "auto":
                    so.setdefault("sweep", []).extend(_sweep_reader(w, g3, rd, ids, seqs, n * bpb, clear, same))
                    pdst = torch.empty((n, bpb), dtype=torch.uint8, device=device)
                    so.setdefault("loader_profile", {})[rd.mode] = profile_load(rd, ns.keys(seqs, "bench", 0), pdst)
                    del pdst
                    so.setdefault("worker_phases", {})[rd.mode] = worker_phases(g3, rd, kv, ns, seqs, ids)
                if i == len(modes) - 1:  # a corrupted block is a miss and its engine block stays untouched
                    bad = n // 2
                    ls = g3.lease(ns.keys([seqs[bad]], "bench", 0))[0]
                    if ls is None:
                        raise RuntimeError(f"{wd}: block {bad} is not in G3 after the loads ({g3.stats()})")
                    g3.release([ls])
                    fd = os.open(ls.path, os.O_RDWR)
                    b = os.pread(fd, 1, ls.offset + HEADER_BYTES + 4097)
                    os.pwrite(fd, bytes([b[0] ^ 0x20]), ls.offset + HEADER_BYTES + 4097)
                    os.fsync(fd)
                    os.close(fd)
                    rows = ids[bad - 2:bad + 2]
                    clear(rows)
                    _, errs = _load_through_worker(w, rows, seqs[bad - 2:bad + 2], ["G3"] * 4)
                    idx = torch.as_tensor(rows[2:], device=device)
                    so["corrupt_check"] = {
                        "errors_are_the_corrupt_block_and_after": sorted(errs) == rows[2:],
                        "prefix_loaded_ok": same(rows[:2]),
                        "corrupt_dst_untouched": all(not t.index_select(0, idx).any() for t in tensors),
                        "dropped_from_pool": not g3.contains(ns.key(seqs[bad], "bench", 0))}
                    for t, r0 in zip(tensors, ref):  # the engine's KV as saved again (the next storage saves it)
                        t.copy_(r0)
            finally:
                w.shutdown()
                g3.close()
        shutil.rmtree(g3dir, ignore_errors=True)
        # G4 on the same storage: encrypted vs not, through the worker (host decrypt + one H2D copy), at the
        # config's g4.max_inflight (what users run); --sweep on fast storage (or the CPU smoke): other values too
        m = max(4, int(n * g4_fraction))
        g4_sweep = G4_INFLIGHT_SWEEP if sweep and (storage > 5 or device == "cpu") else ()
        for enc in (False, True):
            g4dir = os.path.join(wd, "kvbm-g4")
            shutil.rmtree(g4dir, ignore_errors=True)
            try:
                name = f"g4_{'encrypted' if enc else 'plain'}"
                so[name] = _g4_loads(ns, kv, g4dir, os.path.join(wd, "kvbm-keys", "keyring.json"), enc,
                                     G4Config().max_inflight, ids[:m], seqs[:m], bpb, clear, same, save=True)
                for inflight in g4_sweep:
                    so.setdefault("g4_inflight_sweep", {}).setdefault(name, []).append(_g4_loads(
                        ns, kv, g4dir, os.path.join(wd, "kvbm-keys", "keyring.json"), enc, inflight, ids[:m],
                        seqs[:m], bpb, clear, same, save=False))
            finally:
                shutil.rmtree(g4dir, ignore_errors=True)
        shutil.rmtree(os.path.join(wd, "kvbm-keys"), ignore_errors=True)
        pe, pp = so["g4_encrypted"]["GBps_payload"], so["g4_plain"]["GBps_payload"]
        so["ratio_g4_encrypted_vs_plain"] = round(pe / pp, 3) if pp else None
        out["storages"][wd] = so
    out["best_GBps_payload"] = round(best, 2)
    if h2d:
        out["ratio_best_vs_pinned_h2d"] = round(best / h2d, 3)
    res["connector_load"] = out


G4_INFLIGHT_SWEEP = (4, 8, 16, 32, 64)  # g4.max_inflight values --sweep loads G4 with (fast storage, CPU smoke)


def _g4_loads(ns, kv, g4dir: str, keyring: str, enc: bool, max_inflight: int, ids, seqs, bpb: int, clear, same,
              save: bool) -> dict:
    """G4 loads of ``ids``/``seqs`` through the worker (:class:`WorkerSide`, G4 only) from a file store at ``g4dir``
    with ``g4.max_inflight`` = ``max_inflight``; ``save``: the blocks are saved through the worker first (else
    the store holds them from an earlier call). The first load also allocates the pinned staging and starts the
    pool's read threads (reported on its own); the rate is the median of the :data:`LOAD_REPEATS` loads after it.
    Returns the measurement's dict (``GBps_payload``, ``cpu_cores``, ``bytes_ok``, ...)."""
    from kvbm_backend.config import G4Config
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    from kvbm_backend.pool.g4.pool import G4Pool
    m = len(ids)
    cfg4 = G4Config(enabled=True, url=f"file://{g4dir}", encrypt=enc, timeout_s=120, max_inflight=max_inflight,
                    keyring={"path": keyring})
    g4 = G4Pool(cfg4, ns)
    w = WorkerSide(ns, 0, None, g4, load_timeout_s=600)
    try:
        w.register(kv)
        for a in range(0, m if save else 0, SAVE_JOB_BLOCKS):
            w.save([SaveJob("save", ids[a:a + SAVE_JOB_BLOCKS], seqs[a:a + SAVE_JOB_BLOCKS], "bench")])
            w.flush_saves(600)
            g4.flush(600)
        times, cpus, faults, errs_all, ok_all = [], [], [], 0, True
        for _ in range(1 + LOAD_REPEATS):
            clear(ids)
            _drop_dir_cache(g4dir)
            c0, f0 = _cpu_s(), _minflt()
            dt, errs = _load_through_worker(w, ids, seqs, ["G4"] * m)
            cpus.append(_cpu_s() - c0)
            faults.append(_minflt() - f0)
            times.append(dt)
            errs_all += len(errs)
            ok_all = ok_all and same(ids) and not errs
        dt = statistics.median(times[1:])
        return {"blocks": m, "max_inflight": max_inflight, "seconds": round(dt, 4),
                "GBps_payload": round(m * bpb / dt / 1e9, 2),
                "first_load_s": round(times[0], 4), "first_load_GBps": round(m * bpb / times[0] / 1e9, 2),
                "loads_s": [round(t, 4) for t in times], "page_faults_per_load": faults,
                "cpu_cores": round(statistics.median(cpus[1:]) / dt, 2),
                "cpu_s_per_gb": round(statistics.median(cpus[1:]) / (m * bpb / 1e9), 3),
                "load_errors": errs_all, "bytes_ok": ok_all, "g4_stats": _g4_load_stats(g4)}
    finally:
        w.shutdown()
        g4.close()


ENGINE_BUSY_BLOCKS = 256  # blocks per load beside the busy engine (at 5 ms a 4 GiB load took 70 s on an H100)


def _engine_busy_loads(w, ids, seqs, bpb: int, clear, same, fraction: float) -> dict:
    """G3 loads of the first :data:`ENGINE_BUSY_BLOCKS` blocks through the worker alone, then with a
    :class:`BusyEngine` stepping beside them at CPython's 5 ms switch interval (``load_gil_switch_ms`` off) and
    at the setting's default: GB/s (median of ``LOAD_REPEATS``), the ratio to the same loads alone, the GIL
    hand-offs per block that slowdown implies (``handoffs_per_block_est``: added seconds per block over the
    interval) and the engine's step times. Where the engine's blocks move with the one-launch kernel
    (``EngineKv.move_mode``), ``torch_moves_at_default_ms`` repeats the default-interval loads with the
    per-layer torch ops (the A/B of :mod:`kvbm_backend.gpu.layer_copy`)."""
    import sys

    from kvbm_backend.apps.bench.busy_engine import BusyEngine
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.integrations import load_priority
    ids, seqs = ids[:ENGINE_BUSY_BLOCKS], seqs[:ENGINE_BUSY_BLOCKS]
    nbytes = len(ids) * bpb
    eng = BusyEngine(fraction)
    out: dict = {"busy_fraction": fraction, "blocks": len(ids), "step_ms_alone": round(eng.step_ms_alone, 3),
                 "by_switch_ms": {}}
    default_ms = KvbmBackendConfig().load_gil_switch_ms
    old = sys.getswitchinterval()

    def loads() -> tuple[float, bool]:
        times, ok = [], True
        for _ in range(LOAD_REPEATS):
            clear(ids)
            dt, errs = _load_through_worker(w, ids, seqs, ["G3"] * len(ids))
            times.append(dt)
            ok = ok and not errs and same(ids)
        return nbytes / statistics.median(times) / 1e9, ok
    try:
        alone, ok = loads()
        out["alone_GBps_payload"], out["alone_bytes_ok"] = round(alone, 2), ok
        for ms in (None, default_ms):
            sys.setswitchinterval(0.005)
            load_priority.configure(ms)
            with eng:
                g, ok = loads()
            # each GIL hand-off of a load waits up to one interval beside the loop: the time added per block,
            # in intervals, estimates the hand-offs (benchmarks/gil_handoffs.py counts them exactly)
            est = (nbytes / (g * 1e9) - nbytes / (alone * 1e9)) / ((ms or 5) / 1e3) / len(ids)  # g, alone: GB/s
            out["by_switch_ms"][f"{ms or 5:g}"] = {"GBps_payload": round(g, 2), "ratio_vs_alone": round(g / alone, 3),
                                                  "bytes_ok": ok, "handoffs_per_block_est": round(est, 2),
                                                  **{k: v for k, v in eng.report().items() if k.startswith("step_ms_p")}}
        kv = w.kv
        if kv is not None and kv.move_mode == "triton kernel verified":
            # A/B in the same run: the same busy loads at the default interval with the per-layer torch ops
            # scattering (the engine's mover state is swapped for this row only)
            saved = kv.__dict__["_mover_state"]
            kv.__dict__["_mover_state"] = (None, "torch ops (forced by gpu_bench for comparison)")
            try:
                sys.setswitchinterval(0.005)
                load_priority.configure(default_ms)
                with eng:
                    g, ok = loads()
                out["torch_moves_at_default_ms"] = {"GBps_payload": round(g, 2), "ratio_vs_alone": round(g / alone, 3),
                                                    "bytes_ok": ok}
            finally:
                kv.__dict__["_mover_state"] = saved
    finally:
        load_priority.configure(KvbmBackendConfig().load_gil_switch_ms)
        sys.setswitchinterval(old)
    return out


def _sweep_reader(w, g3, rd, ids, seqs, nbytes: int, clear, same) -> list[dict]:
    """Loads through the worker with the device reader's pipeline knobs varied in place (the reader of
    ``g3``; its ring is dropped between settings so buffers are re-sized): reader threads (bounce/host: the
    loader's pool; kvikio: its process-wide pool, ``KvikioEngine.resize``), passes in flight, staging bytes
    per pass, bytes per read (kvikio: up to a whole pass's run, which kvikio cuts into ``task_size`` pieces
    itself) and, on the kvikio paths, kvikio's ``task_size`` (default 4 MiB)."""
    out = []
    saved = dict(threads=rd.threads, depth=rd.depth, staging_bytes=rd.staging_bytes, io_bytes=rd.io_bytes)
    kv = rd.reads.engine is not None
    if kv:
        import kvikio.defaults
        task0 = kvikio.defaults.get("task_size")
        settings = [(t, d, s, i, None) for t in (8, 16) for d in (2, 4, 8) for s in (128 << 20, 512 << 20)
                    for i in (16 << 20, 1 << 30)]
        settings += [(16, 4, 512 << 20, 1 << 30, task) for task in (1 << 20, 16 << 20)]
    else:
        settings = [(t, d, s, i, None) for t in (8, 16) for d in (2, 4) for s in (128 << 20, 256 << 20)
                    for i in (4 << 20, 16 << 20)]
    try:
        for threads, depth, staging, io, task in settings:
            # re-sized for this setting (the ring's host buffers go back to the pool)
            rd.reconfigure(threads=threads, depth=depth, staging_bytes=staging, io_bytes=io)
            if kv:
                kvikio.defaults.set("task_size", task or task0)
            before = rd.stats()
            clear(ids)
            c0 = _cpu_s()
            dt, errs = _load_through_worker(w, ids, seqs, ["G3"] * len(ids))
            cpu = _cpu_s() - c0
            st = rd.stats()
            out.append({"mode": rd.mode, "io_threads": threads, "depth": depth, "staging_MiB": staging >> 20,
                        "io_MiB": io >> 20, "kvikio_task_MiB": (task or task0) >> 20 if kv else None,
                        "GBps_payload": round(nbytes / dt / 1e9, 2),
                        "cpu_cores": round(cpu / dt, 2), "bytes_ok": same(ids) and not errs,
                        "passes": st.get("passes", 0) - before.get("passes", 0),
                        "reads": st.get("reads", 0) - before.get("reads", 0),
                        **{k: round(st.get(k, 0) - before.get(k, 0), 4)
                           for k in ("read_wait_s", "verify_s", "load_s", "verify_headers_s", "verify_payload_s",
                                     "verify_copy_s", "h2d_submit_s", "ring_wait_s", "submit_s")}})
    finally:
        rd.reconfigure(**saved)
        if kv:
            kvikio.defaults.set("task_size", task0)
    return out


def bench_prefill(res: dict, contexts: list[int]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    out: dict = {"model": "Llama-3.1-8B shape, random bf16 weights", "params": sum(p.numel() for p in model.parameters()),
                 "init_s": round(time.perf_counter() - t0, 1), "attn": "sdpa", "runs": {}}
    bpt = 131072
    load_gbps = res.get("connector_load", {}).get("best_GBps_payload")
    measured_tokens = res.get("connector_load", {}).get("tokens", 0)
    h2d = res.get("h2d", {}).get("pinned_GBps")
    kw = {"use_cache": False, "logits_to_keep": 1}
    with torch.inference_mode():
        ids = torch.randint(0, cfg.vocab_size, (1, 1024), device="cuda")
        try:
            model(input_ids=ids, **kw)  # warm-up
        except TypeError:  # transformers older than 4.49: no logits_to_keep
            kw = {"use_cache": False, "num_logits_to_keep": 1}
            model(input_ids=ids, **kw)
        out["forward_kwargs"] = kw
        for T in contexts:
            r: dict = {}
            try:
                ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
                t0 = _now()
                model(input_ids=ids, **kw)
                r["prefill_s"] = round(_now() - t0, 4)
            except torch.cuda.OutOfMemoryError as e:
                r["error"] = f"OOM: {str(e).splitlines()[0]}"
            torch.cuda.empty_cache()
            r["kv_bytes"] = T * bpt
            if load_gbps and "prefill_s" in r:
                r["load_s"] = round(T * bpt / (load_gbps * 1e9), 4)
                r["load_s_source"] = ("measured rate, within the measured size" if T <= measured_tokens
                                      else f"projected at the rate measured over {measured_tokens} tokens")
                r["ratio_recompute_over_load"] = round(r["prefill_s"] / r["load_s"], 2)
            if h2d and "prefill_s" in r:
                r["ratio_recompute_over_pinned_h2d"] = round(r["prefill_s"] / (T * bpt / (h2d * 1e9)), 2)
            out["runs"][str(T)] = r
    del model
    torch.cuda.empty_cache()
    res["prefill"] = out


def goals_of(res: dict) -> dict:
    """Issue 24's goals from a run's sections: per storage (tmpfs = a ``/dev/shm`` work dir, memory
    speed; else a disk) the best verified G3 load of any device path against pinned H2D and the storage
    limit (:mod:`pipeline_baseline`), pinned-bounce against the kvikio path, G4 encrypted against plain
    and G4's rate; recompute / load at the longest prefill context."""
    goals: dict = {}
    h2d = res.get("h2d", {}).get("pinned_GBps")
    for wd, so in res.get("connector_load", {}).get("storages", {}).items():
        g3 = {k: v for k, v in so.items() if k.startswith("g3_") and isinstance(v, dict) and v.get("bytes_ok")}
        best = max((v["GBps_payload"] for v in g3.values()), default=0.0)
        storage = so.get("storage_limit_GBps") or 0
        tmpfs = wd.startswith("/dev/shm")
        if tmpfs and h2d:
            goals[f"g3_load_ge_0.8x_pinned_h2d[{wd}]"] = {"GBps": best, "ratio": round(best / h2d, 3),
                                                          "met": best >= 0.8 * h2d}
        if storage:
            want = 0.9
            goals[f"g3_load_ge_{want}x_storage_limit[{wd}]"] = {
                "GBps": best, "ratio": round(best / storage, 3), "met": best >= want * storage}
        kv = max((v["GBps_payload"] for k, v in g3.items() if v.get("mode") in ("gds", "kvikio-compat")), default=0)
        pb = g3.get("g3_pinned-bounce", {}).get("GBps_payload")
        if tmpfs and kv and pb:
            goals[f"pinned_bounce_ge_0.8x_kvikio[{wd}]"] = {"ratio": round(pb / kv, 3), "met": pb >= 0.8 * kv}
        if so.get("ratio_g4_encrypted_vs_plain") is not None:
            r = so["ratio_g4_encrypted_vs_plain"]
            goals[f"g4_encrypted_ge_0.8x_plain[{wd}]"] = {"ratio": r, "met": r >= 0.8}
        if tmpfs and "g4_encrypted" in so:
            g = so["g4_encrypted"]["GBps_payload"]
            goals[f"g4_encrypted_ge_10GBps[{wd}]"] = {"GBps": g, "met": g >= 10}
    cases = res.get("layerwise", {}).get("cases", [])
    if cases:  # share of the possible saving (load + compute -> max(load, compute)) the overlap captured
        cap = [round((c["serial_s"] - c["overlap_s"]) / max(c["serial_s"] - c["ideal_s"], 1e-9), 3) for c in cases]
        goals["layerwise_overlap_captures_ge_half_the_saving"] = {
            "captured": cap, "hit_fractions": [c["hit_fraction"] for c in cases],
            "identical": all(c["max_abs_diff"] == 0 for c in cases),
            # beside the goal: overlapped forward / the default whole-request path's load + forward (< 1: pays)
            "overlap_vs_default_path": [c.get("overlap_vs_default") for c in cases],
            "met": all(x >= 0.5 for x in cap) and all(c["max_abs_diff"] == 0 for c in cases)}
    runs = res.get("prefill", {}).get("runs", {})
    longest = max((int(k) for k, v in runs.items() if "ratio_recompute_over_load" in v), default=None)
    if longest:
        r = runs[str(longest)]["ratio_recompute_over_load"]
        goals["recompute_over_load_ge_20x_at_longest"] = {"tokens": longest, "ratio": r, "met": r >= 20}
    return goals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--workdir", default=None, help="directory on the storage for the raw file section "
                    "(default: a temp dir)")
    ap.add_argument("--workdirs", default="/var/tmp/kvbm-gpu-bench,/dev/shm/kvbm-gpu-bench",
                    help="comma-separated directories, one per storage, for the connector section (default: the "
                    "VM disk and a tmpfs standing in for memory-speed storage)")
    ap.add_argument("--file-gib", type=float, default=4.0, help="bytes read in sections 2 and 3, GiB")
    ap.add_argument("--contexts", default="8192,16384,32768,65536,131072", help="prefill lengths, tokens")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="no GPU: run only the connector load section on the CPU device (checks this script)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the device reader's pipeline knobs on fast "
                    "storages (connector section)")
    ap.add_argument("--io-threads", type=int, default=None, help="g3.device_io_threads of the connector "
                    "section's pools (reads in flight of a CUDA load: kvikio threads / bounce readers; default: "
                    "the config's)")
    ap.add_argument("--device-checksum", default="on", choices=("on", "auto", "off"),
                    help="the worker's device_checksum in the connector section (on: what auto does on a CUDA "
                    "engine; auto with --smoke-cpu: what a CPU engine runs, frames checked with xxh3 on the host)")
    ap.add_argument("--engine-busy", type=float, default=0.0,
                    help="connector section: also load G3 with an engine step loop running Python this share of each "
                    "10 ms step, at 5 ms and at load_gil_switch_ms's switch interval (0: off)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (h2d,file,connector,prefill,layerwise)")
    a = ap.parse_args(argv)
    import torch
    if a.smoke_cpu:
        res: dict = {"device": "cpu (smoke)", "errors": {}}
        wd = a.workdir or tempfile.mkdtemp(prefix="kvbm-gpu-bench-")
        bench_connector_load(res, [wd], int(a.file_gib * GIB), device="cpu", device_checksum=a.device_checksum,
                             engine_busy=a.engine_busy, sweep=a.sweep)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_bench-smoke-cpu.json"), "w") as fh:
            json.dump(res, fh, indent=2, sort_keys=True)
        print(json.dumps(res["connector_load"], sort_keys=True))
        return 0
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 2
    from kvbm_backend.apps.doctor import gds_info, gpu_info
    os.makedirs(a.out, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    res: dict = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu_info(),
                 "gds": gds_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "errors": {}}
    fn = os.path.join(a.out, "gpu_bench-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() + ".json")
    workdir = a.workdir or tempfile.mkdtemp(prefix="kvbm-gpu-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    res["workdir"] = workdir
    from kvbm_backend.apps.doctor import path_info
    res["workdir_info"] = path_info(workdir)
    nbytes = int(a.file_gib * GIB)
    skip = set(filter(None, a.skip.split(",")))
    sections = [("h2d", lambda: bench_h2d(res)), ("file", lambda: bench_file_to_hbm(res, workdir, nbytes)),
                ("connector", lambda: bench_connector_load(res, [d for d in a.workdirs.split(",") if d], nbytes,
                                                          sweep=a.sweep, io_threads=a.io_threads,
                                                          device_checksum=a.device_checksum,
                                                          engine_busy=a.engine_busy)),
                ("prefill", lambda: bench_prefill(res, [int(x) for x in a.contexts.split(",") if x])),
                ("layerwise", lambda: bench_layerwise(res, "cuda", switch_ms=(5.0, 0.5)))]
    for sec, f in sections:
        if sec in skip:
            continue
        t0 = time.perf_counter()
        try:
            f()
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            res["errors"][sec] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        res.setdefault("section_s", {})[sec] = round(time.perf_counter() - t0, 1)
        with open(fn, "w") as fh:
            json.dump(res, fh, indent=2, sort_keys=True)
        print(f"[{sec}] done in {res['section_s'][sec]} s", file=sys.stderr, flush=True)
    res["goals"] = goals_of(res)
    with open(fn, "w") as fh:
        json.dump(res, fh, indent=2, sort_keys=True)
    print(json.dumps({"file": fn, "device": name, "goals": res["goals"], "errors": list(res["errors"])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
