"""The vLLM tiering tier's removal check (KV events on), timed on vLLM's scheduler thread's path
(``KvbmSecondaryTier.take_events``) with ``--chunks`` published chunks in a G3 index and ``--evictions``
evictions before each check, two ways in the same run:

* ``log``: from G3's removal log (``G3Pool.removed_since``), what the tier does;
* ``scan``: the whole index read into a set and every published chunk checked, what it did before
  2026-11-29 (and still does for a pool without the log): the baseline.

``python benchmarks/tier_removals.py --chunks 200000 --evictions 1000 --rounds 3 [--out DIR]`` prints and writes
``tier_removals.json`` (milliseconds per check, median of ``--rounds``; chunks reported removed). The index is
filled in memory (no slab I/O): only the check is timed. Needs vLLM (its offloading API) importable.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run(chunks: int, evictions: int, rounds: int) -> dict:
    from vllm.v1.kv_offload.base import make_offload_key

    from kvbm_backend.integrations.vllm.tiering import offload_key_hash
    from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config
    geo = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", tokens_per_block=16)
    out: dict = {"bench": "tier_removals", "chunks": chunks, "evictions_per_check": evictions, "rounds": rounds,
                 "ms_per_check": {}, "removed_per_check": {}}
    for mode in ("scan", "log"):
        d = tempfile.mkdtemp(prefix="kvbm-tier-removals-")
        tier = {"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "num_kv_heads": 2,
                "io_threads": 2, "enable_kv_events": True, "g3": {"paths": [d + "/g3"], "capacity_gb": 0.05}}
        h = TieringHarness(offloading_config(secondary_tiers=[tier], chunks=8, enable_kv_cache_events=True, **geo))
        t = h.tier
        try:
            keys = [make_offload_key(hashlib.sha256(str(i).encode()).digest(), 0) for i in range(chunks)]
            cat = t.pool.cat
            for i, k in enumerate(keys):
                cat.index.put(t.namespace.key(offload_key_hash(k), t._tenant, 0), (0, i))
            if mode == "scan":
                t._held._watch._since = None  # the tier as it was: no removal log, the index read at every check
                t._held.interval_s = 0.0
            t._held.published(keys, t._held.cursor())
            times, removed = [], []
            for _ in range(rounds):
                with cat.lock:
                    ev = cat.index.evict(evictions)
                    cat.note_removed(k for k, _ in ev)
                t0 = time.perf_counter()
                t._reconcile()
                times.append((time.perf_counter() - t0) * 1e3)
                removed.append(sum(len(e.keys) for e in (t._events or []) if e.removed))
                t._events.clear()
            out["ms_per_check"][mode] = round(statistics.median(times), 2)
            out["removed_per_check"][mode] = removed
        finally:
            t.pool.cat.index.__init__()  # the in-memory entries have no slab bytes behind them
            h.shutdown()
            shutil.rmtree(d, ignore_errors=True)
    out["scan_over_log"] = round(out["ms_per_check"]["scan"] / max(out["ms_per_check"]["log"], 1e-3), 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=200_000)
    ap.add_argument("--evictions", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="directory for tier_removals.json (default: print only)")
    a = ap.parse_args(argv)
    if a.chunks < a.evictions * a.rounds or min(a.chunks, a.evictions, a.rounds) < 1:
        print("error: --chunks must cover --evictions x --rounds, all >= 1", file=sys.stderr)
        return 2
    res = run(a.chunks, a.evictions, a.rounds)
    print(json.dumps(res))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "tier_removals.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
