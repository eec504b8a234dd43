"""Host-mode timing of layer-wise G3 loads through ``G3Pool.layerwise_load`` (no model, no GPU): for a layout
and a number of blocks on ``--dir`` (default a new directory under /dev/shm), the best of ``--repeats`` of

* ``first_layer_s``: ``layerwise_load`` (start) until ``wait_layer(0)`` returns;
* ``all_layers_s``: start until every layer was waited for (a consumer that does no work between layers);
* ``finish_s``: ``finish()`` after the last ``wait_layer`` (verification and release: the load's tail);
* ``load_gbps``: payload bytes / (all_layers_s + finish_s).

    python benchmarks/layerwise_io.py --preset llama-3.1-8b --blocks 128 --out DIR   # DIR/layerwise_io.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from kvbm_backend.config import G3Config
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.model.presets import resolve_layout
from kvbm_backend.pool.g3.pool import G3Pool

TINY = KvLayout(num_layers=6, outer_dim=2, page_size=16, inner_dim=128, dtype="bfloat16")  # 8 KiB layers


def run(layout: KvLayout, blocks: int, repeats: int, threads: int, root: Path, min_read: int | None = None) -> dict:
    """Store ``blocks`` random blocks, then time ``repeats`` layer-wise loads of them (best of each)."""
    ns = Namespace("bench/layerwise-io", layout)
    pool = G3Pool(G3Config(paths=[str(root)], capacity_gb=max(0.1, 1.5 * blocks * layout.bytes_per_block / 1e9),
                           files_per_path=4, admission={"policy": "all"}, fsync=False, load_timeout_s=120,
                           io_threads=threads), ns)
    try:
        keys = ns.keys(list(range(1, blocks + 1)), "bench", 0)
        rng = np.random.default_rng(0)
        for a in range(0, blocks, 64):
            part = [rng.integers(0, 256, layout.bytes_per_block, dtype=np.uint8) for _ in keys[a:a + 64]]
            assert pool.put(keys[a:a + 64], part).result(timeout=600).written == len(part)
        assert pool.flush(600)
        best = {"first_layer_s": float("inf"), "all_layers_s": float("inf"), "finish_s": float("inf"),
                "total_s": float("inf")}
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            ld = pool.layerwise_load(keys, "cpu", min_read=min_read)
            ld.wait_layer(0)
            t1 = time.perf_counter()
            for li in range(layout.num_layers):
                ld.wait_layer(li)
            t2 = time.perf_counter()
            why = ld.finish()
            t3 = time.perf_counter()
            assert why == [None] * blocks, why
            if _ == 0:
                continue
            for k, v in (("first_layer_s", t1 - t0), ("all_layers_s", t2 - t0), ("finish_s", t3 - t2),
                         ("total_s", t3 - t0)):
                best[k] = min(best[k], v)
        nbytes = blocks * layout.bytes_per_block
        return {"layout": layout.to_dict() if hasattr(layout, "to_dict") else str(layout), "blocks": blocks,
                "bytes": nbytes, "groups": len(ld.groups), "threads": threads,
                **{k: round(v, 6) for k, v in best.items()}, "load_gbps": round(nbytes / best["total_s"] / 1e9, 3)}
    finally:
        pool.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (kvbm_backend.model.presets); default a tiny layout")
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--min-read", type=int, default=None, help="bytes per read at least (default: the pool's)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    layout = resolve_layout(a.preset) if a.preset else TINY
    root = Path(tempfile.mkdtemp(prefix="kvbm-lw-io-", dir=a.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)))
    try:
        res = run(layout, a.blocks, a.repeats, a.threads, root, a.min_read)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "layerwise_io.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "layout"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
