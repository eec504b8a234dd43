#!/usr/bin/env python3
"""One-call GPU benchmark of the storage -> HBM path (issue 5). Needs a CUDA GPU and the NVIDIA driver.

Measures, in one process, each section recorded even if a later one fails:

1. ``h2d``: pinned host -> device copy bandwidth (and pageable, for context), 1 GiB copies, median.
2. ``file_to_hbm``: a ``--file-gib`` file read cold (``posix_fadvise(DONTNEED)`` after ``fsync``) with
   (a) O_DIRECT ``preadv`` into pinned host memory, 8 threads x 8 MiB (the storage's own limit here) and
   (b) kvikio ``CuFile.pread`` straight into a device tensor (GDS or compat: the JSON says which, from
   kvikio/cuFile and ``/proc/driver/nvidia-fs``); bytes compared on the device. Also a warm re-read.
3. ``connector_load``: :class:`kvbm_backend.gpu.loader.DeviceLoader` (the connector's worker-role load
   path) over real frames (Llama-3.1-8B blocks, 16 tokens = 2 MiB, ``FLAG_CHECKSUM | FLAG_DEVCHECK``) in
   a slab file, into CUDA tensors, in the probed mode and in ``pinned-bounce``; every byte checked
   against the originals on the device, plus one deliberately corrupted block that must be a miss.
4. ``prefill``: a Llama-3.1-8B-shaped ``transformers`` model (``LlamaConfig`` of
   meta-llama/Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256;
   random bf16 weights) timed on prefill of ``--contexts`` tokens (``use_cache=False``,
   ``logits_to_keep=1``); load time of the same tokens' KV (131072 B/token) at the measured connector
   GB/s (measured directly up to the file size, projected beyond it: the JSON marks which), and the
   ratio recompute / load. Goals from the issue: storage->HBM >= 0.9x pinned H2D (or the storage's
   limit, stated); recompute/load >= 20x at the longest context.

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

GIB = 1 << 30


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


def bench_connector_load(res: dict, workdir: str, nbytes: int, device: str = "cuda") -> None:
    import torch
    from kvbm_backend.gpu.checksum import device_checksums_torch
    from kvbm_backend.gpu.loader import DeviceLoader
    from kvbm_backend.model import frame
    from kvbm_backend.model.frame import FLAG_CHECKSUM, FLAG_DEVCHECK, HEADER_BYTES, FrameHeader
    from kvbm_backend.model.namespace import Namespace, tenant_tag
    from kvbm_backend.model.presets import load_preset
    layout = load_preset("llama-3.1-8b").layout(page_size=16, tp=1)
    ns = Namespace(model="bench/llama-3.1-8b", revision="random", layout=layout, tp_world_size=1)
    bpb = layout.bytes_per_block
    slot = frame.slot_bytes(bpb)
    n = max(8, nbytes // slot)
    keys = ns.keys(range(1, n + 1), tenant="bench")
    g = torch.Generator(device=device).manual_seed(99)
    want = torch.randint(0, 256, (n, bpb), dtype=torch.uint8, device=device, generator=g)
    devchecks = device_checksums_torch(want, 0, bpb)  # the same algorithm the G3 writer uses on the host
    path = os.path.join(workdir, "kvbm-gpu-bench.slab")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    batch = 64
    for b0 in range(0, n, batch):
        rows = want[b0:b0 + batch].cpu().numpy()
        buf = bytearray()
        for i, p in enumerate(rows):
            k = keys[b0 + i]
            h = FrameHeader.for_block(k, layout, world=1, tenant_tag=tenant_tag(k.tenant),
                                      flags=FLAG_CHECKSUM | FLAG_DEVCHECK, integrity=frame.payload_checksum(p),
                                      dev_check=devchecks[b0 + i])
            buf += h.pack() + p.tobytes() + b"\0" * (slot - HEADER_BYTES - bpb)
        os.pwrite(fd, bytes(buf), b0 * slot)
    # spot-check: the torch checksum equals the host reference on real rows
    assert frame.device_checksum(want[0].cpu().numpy()) == devchecks[0]
    bad = n // 2  # corrupt one payload byte of one block on disk: it must be a miss
    b = os.pread(fd, 1, bad * slot + HEADER_BYTES + 4097)
    os.pwrite(fd, bytes([b[0] ^ 0x20]), bad * slot + HEADER_BYTES + 4097)
    _drop_cache(fd)
    write_s = time.perf_counter() - t0

    class Src:
        def locate(self, key):
            return (path, (key.seq_hash - 1) * slot, slot)

    out: dict = {"blocks": n, "bytes_per_block": bpb, "slot_bytes": slot, "payload_bytes": n * bpb,
                 "tokens": n * layout.page_size, "frames_written_s": round(write_s, 2), "corrupted_block": bad}
    dst = torch.empty((n, bpb), dtype=torch.uint8, device=device)
    for mode in ("auto", "pinned-bounce"):
        ld = DeviceLoader(Src(), layout, device, probe_dir=workdir, mode=mode, staging_bytes=512 << 20,
                          timeout_s=120, threads=16)
        try:
            dst.fill_(0xAB)
            _drop_cache(fd)
            t0 = _now()
            ok = ld.load(keys, list(dst.unbind(0)))
            dt = _now() - t0
            good = [i for i in range(n) if ok[i]]
            idx = torch.tensor(good, device=device)
            bytes_ok = bool(torch.equal(dst[idx], want[idx]))
            untouched = bool((dst[bad] == 0xAB).all().item())
            out[ld.mode] = {"mode_reason": ld.mode_reason, "seconds": round(dt, 4),
                            "GBps_payload": round(n * bpb / dt / 1e9, 2), "GBps_read": round(n * slot / dt / 1e9, 2),
                            "loaded": sum(ok), "missed": n - sum(ok), "miss_is_the_corrupted_block": ok[bad] is False
                            and sum(ok) == n - 1, "bytes_ok": bytes_ok, "corrupt_dst_untouched": untouched,
                            "stats": ld.stats()}
        finally:
            ld.close()
    os.close(fd)
    os.unlink(path)
    fast = max((v for v in out.values() if isinstance(v, dict) and "GBps_payload" in v),
               key=lambda v: v["GBps_payload"])
    out["best_GBps_payload"] = fast["GBps_payload"]
    h2d = res.get("h2d", {}).get("pinned_GBps")
    if h2d:
        out["ratio_best_vs_pinned_h2d"] = round(fast["GBps_read"] / h2d, 3)
    lim = res.get("file_to_hbm", {}).get("odirect_to_pinned_cold_GBps")
    if lim:
        out["ratio_best_vs_storage_odirect"] = round(fast["GBps_read"] / lim, 3)
    res["connector_load"] = out


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--workdir", default=None, help="directory on the storage to test (default: a temp dir)")
    ap.add_argument("--file-gib", type=float, default=4.0, help="bytes read in sections 2 and 3, GiB")
    ap.add_argument("--contexts", default="8192,16384,32768,65536,131072", help="prefill lengths, tokens")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="no GPU: run only the connector load section on the CPU device (checks this script)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip (h2d,file,connector,prefill)")
    a = ap.parse_args(argv)
    import torch
    if a.smoke_cpu:
        res: dict = {"device": "cpu (smoke)", "errors": {}}
        wd = a.workdir or tempfile.mkdtemp(prefix="kvbm-gpu-bench-")
        bench_connector_load(res, wd, int(a.file_gib * GIB), device="cpu")
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_bench-smoke-cpu.json"), "w") as fh:
            json.dump(res, fh, indent=2, sort_keys=True)
        print(json.dumps(res["connector_load"], sort_keys=True))
        return 0
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 2
    from kvbm_backend.doctor import gds_info, gpu_info
    os.makedirs(a.out, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    res: dict = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu_info(),
                 "gds": gds_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "errors": {}}
    fn = os.path.join(a.out, "gpu_bench-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() + ".json")
    workdir = a.workdir or tempfile.mkdtemp(prefix="kvbm-gpu-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    res["workdir"] = workdir
    from kvbm_backend.doctor import path_info
    res["workdir_info"] = path_info(workdir)
    nbytes = int(a.file_gib * GIB)
    skip = set(filter(None, a.skip.split(",")))
    sections = [("h2d", lambda: bench_h2d(res)), ("file", lambda: bench_file_to_hbm(res, workdir, nbytes)),
                ("connector", lambda: bench_connector_load(res, workdir, nbytes)),
                ("prefill", lambda: bench_prefill(res, [int(x) for x in a.contexts.split(",") if x]))]
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
    goals = {}
    cl = res.get("connector_load", {})
    if "ratio_best_vs_pinned_h2d" in cl:
        goals["storage_to_hbm_ge_0.9x_pinned_h2d"] = cl["ratio_best_vs_pinned_h2d"] >= 0.9
        goals["storage_to_hbm_vs_storage_limit"] = cl.get("ratio_best_vs_storage_odirect")
    runs = res.get("prefill", {}).get("runs", {})
    longest = max((int(k) for k, v in runs.items() if "ratio_recompute_over_load" in v), default=None)
    if longest:
        goals["longest_context"] = longest
        goals["recompute_over_load_ge_20x_at_longest"] = runs[str(longest)]["ratio_recompute_over_load"] >= 20
    res["goals"] = goals
    with open(fn, "w") as fh:
        json.dump(res, fh, indent=2, sort_keys=True)
    print(json.dumps({"file": fn, "device": name, "goals": goals, "errors": list(res["errors"])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
