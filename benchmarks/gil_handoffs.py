"""GIL hand-offs per block of the connector's G3 loads (``WorkerSide``, as vLLM drives it), counted exactly.

Beside an engine step loop that runs Python in the same process, every time a load's thread gives the GIL
up (a torch op, a read, a checksum call, a tensor freed) it waits up to the switch interval to get it back
(docs/gpu.md, "Loads beside a busy engine"), so hand-offs per block, not bytes, set a busy worker's load rate.
This counts them with a ``perf`` uprobe on CPython's ``take_gil``: a child process saves ``--blocks`` blocks
(Llama-3.1-8B, 2 MiB each) into a G3 pool, then loads them ``--loads`` times after one warm-up load; the
same child with zero timed loads is the baseline, and the difference divided by loads and blocks is the
answer. Needs root (or perf_event access) and ``perf``; the uprobe is added if missing.

Usage: ``python benchmarks/gil_handoffs.py [--blocks 256] [--loads 4] [--device cpu] [--json OUT]``
(2-core dev VM, 2026-11-26, host mode: 16.2 per block before loads took one ``[n, bytes]`` destination and
read in file order, 3.7 after; the rest is each block's xxh3, its share of the reads and the header copy).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def child(workdir: str, blocks: int, loads: int, device: str, save: bool, layerwise: bool = False) -> None:
    """Save (``save``) or warm-load once then load ``loads`` times, through WorkerSide (``layerwise``: as the
    connector's layer-wise loads, :class:`~kvbm_backend.integrations.vllm.layerwise.LayerwiseLoads`: started,
    every layer waited for in order and scattered, finished)."""
    import torch

    from kvbm_backend.config import G3Config
    from kvbm_backend.integrations.vllm.kv_io import EngineKv
    from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.model.presets import load_preset
    from kvbm_backend.pool.g3.pool import G3Pool
    layout = load_preset("llama-3.1-8b").layout(page_size=16, tp=1)
    heads, hd, bpb = 8, layout.inner_dim // 8, layout.bytes_per_block
    g = torch.Generator(device=device).manual_seed(1)
    tensors = [torch.randint(-30000, 30000, (2, blocks + 8, 16, heads, hd), dtype=torch.int16, device=device,
                             generator=g).view(torch.bfloat16) for _ in range(layout.num_layers)]
    kv = EngineKv.from_tensors(tensors, blocks + 8, 16, heads, hd)
    ns = Namespace(model="bench/llama-3.1-8b", revision="random", layout=layout, tp_world_size=1)
    ids, seqs = list(range(blocks)), list(range(1, blocks + 1))
    cfg = G3Config(paths=[workdir], capacity_gb=blocks * (bpb + 8192) / 1e9 * 1.1 + 0.1, files_per_path=4,
                   admission={"policy": "all"}, load_timeout_s=120)
    g3 = G3Pool(cfg, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=600, device_checksum="auto")
    w.register(kv)
    try:
        if save:
            for a in range(0, blocks, 128):
                w.save([SaveJob("save", ids[a:a + 128], seqs[a:a + 128], "bench")])
                w.flush_saves(600)  # a CUDA engine hands saves to the pools on its save thread
                g3.flush(timeout=600)
            return
        if layerwise:
            from kvbm_backend.integrations.vllm.layerwise import LayerwiseLoads
            names = [f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers)]
            lw = LayerwiseLoads(w, names, timeout_s=600)
            for k in range(loads + 1):
                lw.start([LoadJob(f"l{k}", ids, seqs, ["G3"] * blocks, "bench", layerwise=True)])
                for n in names:
                    lw.wait_layer(n)
                lw.saves([])
                if w.load_errors():
                    raise RuntimeError(f"load errors: {w.load_errors()}")
            return
        for k in range(loads + 1):
            w.start_loads([LoadJob(f"l{k}", ids, seqs, ["G3"] * blocks, "bench")])
            while f"l{k}" not in w.get_finished():
                time.sleep(0.002)
            if w.load_errors():
                raise RuntimeError(f"load errors: {w.load_errors()}")
    finally:
        w.shutdown()
        g3.close()


def _probe() -> str:
    """The perf event name of CPython's ``take_gil`` uprobe (added if missing). Raises RuntimeError."""
    if shutil.which("perf") is None:
        raise RuntimeError("perf not found: install linux-perf (the count needs a uprobe)")
    lib = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or "")
    shared = os.path.exists(lib) and (lib.endswith(".so") or ".so." in lib)
    target = lib if shared else sys.executable  # libpython when CPython is linked shared
    r = subprocess.run(["perf", "probe", "-x", target, "--add", "take_gil"], capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        line = line.strip()
        if line.startswith("probe_") and ":take_gil" in line:
            return line.split()[0]
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        if ":take_gil" in line:
            return line.split()[0]
    raise RuntimeError(f"could not add a uprobe on take_gil in {target}: {r.stderr.strip()[-300:]}")


def _count(event: str, args: list[str]) -> int:
    r = subprocess.run(["perf", "stat", "-x", ",", "-e", event, sys.executable, os.path.abspath(__file__), *args],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    if r.returncode:
        raise RuntimeError(f"child failed: {r.stderr[-800:]}")
    for line in r.stderr.splitlines():
        if event.split(":")[-1] in line and line.split(",")[0].isdigit():
            return int(line.split(",")[0])
    raise RuntimeError(f"no count for {event} in perf's output: {r.stderr[-400:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="the engine KV's device (cpu: the reader's host mode)")
    ap.add_argument("--workdir", default=None, help="G3 directory (default: a temporary one under /dev/shm)")
    ap.add_argument("--layerwise", action="store_true",
                    help="count the connector's layer-wise loads (g3.layerwise_load) instead of whole-request ones")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--child", choices=["save", "load"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.workdir, a.blocks, a.loads, a.device, a.child == "save", a.layerwise)
        return 0
    if a.loads < 1 or a.blocks < 1:
        ap.error("--blocks and --loads: at least 1")
    event = _probe()
    wd = a.workdir or tempfile.mkdtemp(prefix="kvbm-gil-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        base = ["--workdir", wd, "--blocks", str(a.blocks), "--device", a.device] + \
            (["--layerwise"] if a.layerwise else [])
        subprocess.run([sys.executable, os.path.abspath(__file__), *base, "--loads", "1", "--child", "save"],
                       check=True, env={**os.environ, "PYTHONPATH": REPO})
        n0 = _count(event, [*base, "--loads", "0", "--child", "load"])
        n1 = _count(event, [*base, "--loads", str(a.loads), "--child", "load"])
    finally:
        if a.workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
    per_load = (n1 - n0) / a.loads
    out = {"bench": "gil_handoffs", "device": a.device, "load": "layerwise" if a.layerwise else "whole-request", "blocks": a.blocks, "loads": a.loads,
           "take_gil_per_load": round(per_load, 1), "take_gil_per_block": round(per_load / a.blocks, 2)}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
