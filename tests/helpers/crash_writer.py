"""Helpers for the G3 tests, and a writer process the crash test kills with SIGKILL.

``python tests/helpers/crash_writer.py DIR START CAPACITY_GB`` opens a G3 pool on DIR (fsync on, admission
all) and writes batches of blocks with keys START, START+1, ... forever; after each put's Future
completes (durable and published) it prints ``ACK <last key>`` and flushes stdout. Payloads are
:func:`payload` of the key, so a reader can check every served byte.
"""
from __future__ import annotations

import sys

import numpy as np

from kvbm_backend.config import AdmissionConfig, G3Config
from kvbm_backend.metrics import new_registry
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace

LAYOUT = KvLayout(num_layers=2, outer_dim=2, page_size=16, inner_dim=64, dtype="bfloat16")  # 8 KiB blocks
NS = Namespace(model="test/g3", layout=LAYOUT)


_BASE = np.arange(LAYOUT.bytes_per_block // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def payload(seq_hash: int) -> np.ndarray:
    """Deterministic bytes for a key (cheap, so the writer spends its time writing)."""
    mix = np.uint64((seq_hash * 0xBF58476D1CE4E5B9 + 1) & (2**64 - 1))
    return (_BASE ^ mix).view(np.uint8)


def config(path, **kw) -> G3Config:
    # load_timeout_s 120 (the maximum; was 10): tests that check bytes must not see a read the busy CI VM froze for
    # 13-31 s (2026-11-29) as a timeout; tests of the bound pass their own
    base = dict(paths=[str(path)], capacity_gb=0.05, files_per_path=2, admission=AdmissionConfig(policy="all"),
                load_timeout_s=120.0)
    base.update(kw)
    return G3Config(**base)


def open_pool(path, ns: Namespace = NS, engine=None, **kw):
    from kvbm_backend.pool.g3 import G3Pool
    return G3Pool(config(path, **kw), ns, engine=engine, registry=new_registry())


def main() -> None:
    d, start, cap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    pool = open_pool(d, capacity_gb=cap, write_queue_blocks=100_000)
    print("READY", flush=True)
    k = start
    batch = 256
    while True:
        keys = NS.keys(range(k, k + batch))
        res = pool.put(keys, [payload(x.seq_hash) for x in keys]).result()
        assert res.written + res.skipped == batch, res  # skipped: published by a killed predecessor after its last ACK
        k += batch
        print(f"ACK {k - 1}", flush=True)


if __name__ == "__main__":
    main()
