"""Performance at vLLM's secondary-tier interface (issue 21 item 6): our G3 tier vs vLLM 0.32's own ``fs``
tier, same run, same blocks, both driven by vLLM's real ``TieringOffloadingManager`` (the calls its
``OffloadingConnector`` scheduler makes), no engine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tier_interface.py --path /var/tmp --out benchmarks/results

Two parts, one JSON (``tier_interface.json`` in ``--out``):

* ``throughput``: :func:`kvbm_backend.apps.bench.vllm_tiers.run` (``kvbm-backend bench --tier vllm-tiers``;
  its docstring has the method): GB/s of stores (primary -> tier) and loads (tier -> primary, page cache
  dropped first), medians of alternating rounds. Durability: the pair compared is ``vllm_fs`` and
  ``ours_nofsync``: both write without any flush (no fsync/fdatasync), both with O_DIRECT where vLLM's
  own probe of the directory says the filesystem takes it (``same_durability`` true), so a stored block
  survives a process crash but may be lost on power loss, for both. ``ours`` (our default,
  fdatasync before a block is published) is reported too. Ratios ours/vLLM's: ``write_ratio`` /
  ``read_ratio`` (same durability, ratio of the medians), ``*_ratio_paired_median`` (median of the
  per-round ratios: each round runs the tiers back to back, so this is less exposed to a shared machine's
  load swings) and ``write_ratio_ours_fsync``; ``*_cpu_s_per_gb``: the process's CPU seconds per GB.
* ``step``: per tier, the seconds of the scheduler's per-step calls into the manager, as vLLM makes them
  (``prepare_store`` + ``complete_store`` of the step's new request, ``lookup`` of each waiting
  request's chunks, ``prepare_load``/``complete_load`` of those resolved, ``on_schedule_end``, which polls
  every tier's ``get_finished_jobs`` and submits cascades and promotions, and ``take_events``), with
  :data:`FORWARD_S` of sleep between steps standing in for the forward pass. Phases: ``idle`` (nothing in
  flight), ``store`` (one request of ``--chunks-per-step`` new chunks each step until ``--blocks`` are
  stored, stepping on until the cascade is done) and ``load`` (primary emptied; one request per step
  promoting ``--chunks-per-step`` chunks from the tier, until all are loaded), the store and load phases
  :data:`STEP_ROUNDS` times with fresh keys, samples pooled. Reported: ``p50_ms``,
  ``p99_ms``, ``max_ms``, ``steps``; ``p99_ratio_store`` / ``p99_ratio_load`` = p99 in flight / p99 idle;
  ``tier_get_finished_jobs`` / ``tier_submit_store`` / ``tier_submit_load``: the same for each call of
  the tier's own method (all phases; ``steps`` is then the number of calls).

Block = one vLLM chunk of the ``--layout`` preset (one 16-token block, TP 1; llama-3.1-8b: 2 MiB).
GB = 1e9 bytes. Exit status 0; ``goals`` in the JSON says whether ours >= 1.0x both ways.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbm_backend.apps.bench import (
    BenchOptions,
    vllm_tiers,
)
from kvbm_backend.integrations.vllm.tiering_harness import (
    TieringHarness,
    offload_key,
    offloading_config,
    vllm_fs_uses_o_direct,
)

STEP_ROUNDS = 3  # store + load phases per tier in the step test (fresh keys each; samples pooled)
FORWARD_S = 0.002  # sleep between scheduler steps (the forward pass; releases the GIL as a kernel would)


def _pct(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"steps": len(xs), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


def _timed(fn, acc: list[float]):
    """``fn`` with each call's seconds appended to ``acc`` (an iterable result is consumed inside)."""
    def call(*a, **kw):
        t = time.perf_counter()
        r = fn(*a, **kw)
        if r is not None:
            r = list(r)
        acc.append(time.perf_counter() - t)
        return r
    return call


def _steps(h: TieringHarness, rounds: list[list[bytes]], payloads: list[np.ndarray], per_step: int,
           idle_steps: int) -> dict:
    """The phases of the module docstring on harness ``h``, the store and load phases once per list of
    keys in ``rounds`` (samples pooled); returns ``{phase: _pct(...)}``."""
    from vllm.v1.kv_offload.base import ScheduleEndContext
    m = h.manager
    end_ctx = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def end_of_step() -> None:
        m.on_schedule_end(end_ctx)
        for _ in m.take_events():
            pass

    def idle() -> list[float]:
        out = []
        for _ in range(idle_steps):
            t = time.perf_counter()
            end_of_step()
            out.append(time.perf_counter() - t)
            time.sleep(FORWARD_S)
        return out

    calls: dict[str, list[float]] = {"get_finished_jobs": [], "submit_store": [], "submit_load": []}
    for name, acc in calls.items():  # the tier's own calls, timed where the manager makes them
        setattr(h.tier, name, _timed(getattr(h.tier, name), acc))
    res = {"idle": _pct(idle())}
    stores, loads, loaded = [], [], 0
    for keys in rounds:
        loaded += _store_then_load(h, keys, payloads, per_step, end_of_step, stores, loads)
    res["store"] = _pct(stores)
    res["load"] = _pct(loads)
    res["load"]["chunks_loaded"] = loaded
    res["idle_after"] = _pct(idle())
    for name, acc in calls.items():
        res[f"tier_{name}"] = _pct(acc)
    for phase in ("store", "load"):
        res[f"p99_ratio_{phase}"] = res[phase]["p99_ms"] / max(res["idle"]["p99_ms"], 1e-9)
    return res


def _store_then_load(h: TieringHarness, keys: list[bytes], payloads: list[np.ndarray], per_step: int,
                     end_of_step, stores: list[float], loads: list[float]) -> int:
    """One store phase then one load phase of ``keys`` (step seconds appended to ``stores`` / ``loads``);
    returns the chunks loaded."""
    from vllm.v1.kv_offload.base import LookupResult
    m = h.manager
    # store: a new request's chunks each step (the bytes written to the primary are the worker's copy: not timed)
    times, i = stores, 0
    while i < len(keys) or m.has_pending_work():
        t = time.perf_counter()
        if i < len(keys):
            ks = keys[i:i + per_step]
            ctx = h.context()
            m.on_new_request(ctx)
            out = m.prepare_store(ks, ctx)
            if out is None:
                raise RuntimeError("primary tier is full")
            el = time.perf_counter() - t
            pos = {k: j for j, k in enumerate(ks)}
            for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                h.primary[int(cid), :h.chunk_bytes] = payloads[i + pos[k]]
            t = time.perf_counter()
            m.complete_store(out.keys_to_store, ctx, True)
            m.on_request_finished(ctx)
            i += len(ks)
        else:
            el = 0.0
        end_of_step()
        times.append(el + time.perf_counter() - t)
        time.sleep(FORWARD_S)
    h.reset_primary()
    # load: one request per step promotes its chunks; resolved requests load and finish
    times, waiting, i, loaded = loads, [], 0, 0
    while i < len(keys) or waiting:
        t = time.perf_counter()
        if i < len(keys):
            ctx = h.context()
            m.on_new_request(ctx)
            waiting.append((ctx, keys[i:i + per_step]))
            i += per_step
        still = []
        for ctx, ks in waiting:
            rs = [m.lookup(k, ctx) for k in ks]
            if any(r is LookupResult.MISS for r in rs):
                raise RuntimeError(f"chunk missing from the tier: {rs}")
            if all(r is LookupResult.HIT for r in rs):
                m.prepare_load(ks, ctx)
                m.complete_load(ks, ctx)
                m.on_request_finished(ctx)
                loaded += len(ks)
            else:
                still.append((ctx, ks))
        waiting = still
        end_of_step()
        times.append(time.perf_counter() - t)
        time.sleep(FORWARD_S)
    h.reset_primary()
    return loaded


def step_latency(path: str, layout: str, blocks: int, per_step: int, threads: int, idle_steps: int = 200) -> dict:
    """Scheduler-step latency per tier (``vllm_fs``, ``ours``, ``ours_nofsync``); see the module docstring."""
    from kvbm_backend.model.presets import load_preset
    preset = load_preset(layout)
    lay = preset.layout(page_size=16, tp=1)
    geo = dict(num_layers=lay.num_layers, num_kv_heads=preset.kv_heads_per_rank(1), head_dim=preset.head_dim,
               dtype=lay.dtype, tokens_per_block=16)
    base = os.path.join(path, f"kvbm-tier-step-{uuid.uuid4().hex[:8]}")
    os.makedirs(base)
    o_direct = "on" if vllm_fs_uses_o_direct(base) else "off"
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, lay.bytes_per_block, dtype=np.uint8) for _ in range(blocks)]
    out = {}
    try:
        for name in ("vllm_fs", "ours", "ours_nofsync"):
            root = os.path.join(base, name)
            if name == "vllm_fs":
                cfg = {"type": "fs", "root_dir": root, "n_read_threads": threads, "n_write_threads": threads}
            else:
                cfg = {"type": "G3Tier", "module_path": vllm_tiers.TIERING_MODULE, "num_kv_heads": geo["num_kv_heads"],
                       "io_threads": threads, "config": {"model": layout},
                       "g3": {"paths": [root], "capacity_gb": max(1.0, 2 * blocks * lay.bytes_per_block / 1e9),
                              "io_threads": threads, "fsync": name == "ours", "o_direct": o_direct}}
            rounds = [[offload_key(hashlib.sha256(f"{name}:{r}:{i}".encode()).digest(), 0) for i in range(blocks)]
                      for r in range(STEP_ROUNDS)]
            h = TieringHarness(offloading_config(secondary_tiers=[cfg], chunks=blocks + 8, **geo))
            try:
                out[name] = _steps(h, rounds, payloads, per_step, idle_steps)
            finally:
                h.shutdown()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/var/tmp", help="directory on the disk to test (default /var/tmp)")
    ap.add_argument("--layout", default="llama-3.1-8b", help="model preset (kvbm-backend layouts)")
    ap.add_argument("--blocks", type=int, default=256, help="chunks per tier per round (default 256)")
    ap.add_argument("--chunks-per-step", type=int, default=4, help="chunks per request in the step test")
    ap.add_argument("--rounds", type=int, default=5, help="alternating throughput rounds per tier (default 5)")
    ap.add_argument("--threads", type=int, default=8, help="I/O threads of each tier (default 8)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results", help="output directory")
    a = ap.parse_args(argv)
    if a.blocks < 1 or a.chunks_per_step < 1 or a.rounds < 1:
        ap.error("--blocks, --chunks-per-step and --rounds: must be >= 1")
    thr = vllm_tiers.run(BenchOptions(tier="vllm-tiers", layout=a.layout, blocks=a.blocks, path=a.path,
                                      threads=a.threads, progress=False), rounds_n=a.rounds)
    thr["write_ratio_ours_fsync"] = thr["write_ratio"]
    thr["write_ratio"] = thr["write_ratio_same_durability"]
    thr["read_ratio"] = (thr["ours_nofsync_read_gbps"] / thr["vllm_fs_read_gbps"])
    thr["read_ratio_ours_fsync"] = thr["ours_read_gbps"] / thr["vllm_fs_read_gbps"]
    for d in ("write", "read"):  # ours/vLLM's within each round (adjacent in time), then their median
        per = [o / v for o, v in zip(thr[f"ours_nofsync_{d}_gbps_rounds"], thr[f"vllm_fs_{d}_gbps_rounds"])]
        thr[f"{d}_ratio_rounds"] = per
        thr[f"{d}_ratio_paired_median"] = float(np.median(per))
    step = step_latency(a.path, a.layout, a.blocks, a.chunks_per_step, a.threads)
    result = {"command": " ".join(["benchmarks/tier_interface.py", *(argv if argv is not None else sys.argv[1:])]),
              "host": platform.node(), "cpus": os.cpu_count(), "vllm": _vllm_version(),
              "durability": "both without fsync; O_DIRECT for both where the filesystem takes it "
                            f"(same_durability={thr['same_durability']}); 'ours' fdatasyncs before publish",
              "throughput": thr, "step": step, "step_rounds": STEP_ROUNDS, "chunks_per_step": a.chunks_per_step,
              "forward_s": FORWARD_S,
              "goals": {"write_ge_1x": bool(thr["write_ratio"] is not None and thr["write_ratio"] >= 1.0),
                        "read_ge_1x": bool(thr["read_ratio"] >= 1.0)}}
    os.makedirs(a.out, exist_ok=True)
    p = os.path.join(a.out, "tier_interface.json")
    with open(p, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    t = thr
    print(f"write GB/s  vllm_fs {t['vllm_fs_write_gbps']:.2f}  ours_nofsync {t['ours_nofsync_write_gbps']:.2f}  "
          f"ours {t['ours_write_gbps']:.2f}  ratio {t['write_ratio'] or float('nan'):.2f}x")
    print(f"read  GB/s  vllm_fs {t['vllm_fs_read_gbps']:.2f}  ours_nofsync {t['ours_nofsync_read_gbps']:.2f}  "
          f"ours {t['ours_read_gbps']:.2f}  ratio {t['read_ratio']:.2f}x")
    print(f"paired per-round ratio medians  write {t['write_ratio_paired_median']:.2f}x  "
          f"read {t['read_ratio_paired_median']:.2f}x")
    print("CPU s/GB write/read  " + "  ".join(f"{n} {t[f'{n}_write_cpu_s_per_gb']:.2f}/{t[f'{n}_read_cpu_s_per_gb']:.2f}"
                                            for n in ("vllm_fs", "ours_nofsync", "ours")))
    for name, s in step.items():
        print(f"step p99 ms {name:13s} idle {s['idle']['p99_ms']:.3f}  store {s['store']['p99_ms']:.3f}  "
              f"load {s['load']['p99_ms']:.3f}  | tier get_finished_jobs {s['tier_get_finished_jobs']['p99_ms']:.3f}"
              f"  submit_store {s['tier_submit_store']['p99_ms']:.3f}  submit_load {s['tier_submit_load']['p99_ms']:.3f}")
    print(p)
    return 0


def _vllm_version() -> str:
    import vllm
    return vllm.__version__


if __name__ == "__main__":
    sys.exit(main())
