"""Peer comparison: our G3 tier vs vLLM's own ``FileSystemTierManager``, through vLLM's tiering manager.

``kvbm-backend bench --tier vllm-tiers --path DIR --layout NAME [--blocks N] [--json]``

Both tiers are driven the same way in one run, with no engine: vLLM's real ``TieringOffloadingSpec``
builds its ``TieringOffloadingManager`` with the CPU primary tier (a host mmap in ``/dev/shm``) and
one secondary tier (``{"type": "fs", "root_dir": ...}`` or ``{"type": "G3Tier", "module_path": ...}``);
:class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness` plays the scheduler:
``prepare_store`` + fill the primary chunks +
``complete_store`` (which cascades every chunk to the secondary tier), polling ``on_schedule_end``
until idle; then ``reset_cache`` empties the primary and ``lookup`` / ``on_schedule_end`` promote
every chunk back from the secondary tier, and the bytes are checked. Our tier's loads run with the largest
``g3.load_timeout_s`` (120 s, :func:`g3_tier`), as ``--tier g3`` does: a read a busy machine slows is measured.

``*_cpu_s_per_gb``: CPU seconds of the whole process (every thread) per GB moved, write and read phase.
Numbers (medians of :data:`ROUNDS` rounds that alternate which tier goes first, fresh keys each
round; the per-round values are in ``*_rounds``): ``*_write_gbps`` = chunk bytes / seconds from the first ``complete_store`` until every
cascade job finished; ``*_read_gbps`` = chunk bytes / seconds from the first ``lookup`` until every
chunk is a primary HIT (lookup + promotion, one request of ``chunks_per_store_job`` chunks at a time;
the bytes are copied out of the primary and compared after the timed part). GB = 1e9 bytes. Block = one primary chunk of
``layout.bytes_per_block`` (one vLLM block of ``page_size`` tokens, TP 1). Before each read phase the
page cache is dropped for every file under the tier's directory (``fsync`` then ``posix_fadvise
DONTNEED``), so a buffered reader also reads from the device; ``*_o_direct`` says whether the tier
used O_DIRECT. Our G3 tier fsyncs before publishing (its invariant); vLLM's fs tier does not (it writes with O_DIRECT and renames, no fsync), so ``ours_nofsync_*`` runs
our tier with ``g3.fsync: false`` as the same-durability comparison: both then write without any
flush, and both G3 runs take ``g3.o_direct`` from vLLM's own probe of the directory (``probe_o_direct``:
O_DIRECT where the filesystem takes it, else buffered), so the two write through the same path.
``durability`` says what each run's "stored" means; ``same_durability`` is true when vLLM's fs tier and
``ours_nofsync`` used O_DIRECT alike (``write_ratio_same_durability`` is null otherwise). ``ours_sync_groups_rounds``: the
group-commit barriers (fdatasync per slab file written + one journal append) our durable tier issued
per round (``g3.group_commit_ms`` / ``g3.group_commit_bytes``).
"""
from __future__ import annotations

import os
import resource
import shutil
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbm_backend.config import LOAD_TIMEOUT_MAX_S
from kvbm_backend.integrations.vllm.tiering_harness import (TieringHarness, offload_key, offloading_config,
                                                            vllm_fs_uses_o_direct)

from ..signals import raise_if_terminated
from . import BenchOptions

if TYPE_CHECKING:
    from kvbm_backend.integrations.vllm.tiering_harness import OffloadKey  # vLLM's, through the harness

TIERING_MODULE = "kvbm_backend.integrations.vllm.tiering"
ROUNDS = 3  # alternating rounds per tier; the medians are reported


def _drop_cache(directory: str) -> int:
    """fsync and ``posix_fadvise(DONTNEED)`` every regular file under ``directory``; returns the count."""
    n = 0
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


def _cpu_s() -> float:
    """CPU seconds (user + system) this process used so far, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _key(i: int, run: str) -> OffloadKey:
    import hashlib
    return offload_key(hashlib.sha256(f"{run}:{i}".encode()).digest(), 0)


def _one_tier(name: str, tier_cfg: dict, geo: dict, keys: list[OffloadKey], payloads: list[np.ndarray], root: str,
              batch: int) -> dict:
    h = TieringHarness(offloading_config(secondary_tiers=[tier_cfg], chunks=len(keys) + 8, **geo))
    try:
        t0, c0 = time.perf_counter(), _cpu_s()
        for i in range(0, len(keys), batch):
            h.store(keys[i:i + batch], payloads[i:i + batch])
            h.step()
        h.wait_idle(timeout=600)
        t_write, c_write = time.perf_counter() - t0, _cpu_s() - c0
        o_direct = bool(getattr(h.tier, "_use_o_direct", False))
        sync_groups = engine = None
        if hasattr(h.tier, "kvbm_stats"):
            pst = h.tier.kvbm_stats()["pool"]
            engine = pst.get("engine")
            od = pst.get("o_direct", {})
            o_direct = all(od.values()) if isinstance(od, dict) and od else bool(od)
            sync_groups = pst.get("sync_groups")
        h.reset_primary()
        files = _drop_cache(root)
        t0, c0 = time.perf_counter(), _cpu_s()
        promoted = [(i, *h.promote(keys[i:i + batch], timeout=600)) for i in range(0, len(keys), batch)]
        t_read, c_read = time.perf_counter() - t0, _cpu_s() - c0
        got: list[np.ndarray] = []  # the copy-out for verification is not the tier's work: not timed
        for i, ctx, n in promoted:
            got.extend(h.collect(keys[i:i + batch], ctx, n))
        ok = len(got) == len(keys) and all(np.array_equal(a, b) for a, b in zip(got, payloads))
        nbytes = len(keys) * h.chunk_bytes
        return {f"{name}_write_gbps": nbytes / t_write / 1e9, f"{name}_read_gbps": nbytes / t_read / 1e9,
                f"{name}_write_s": t_write, f"{name}_read_s": t_read,
                f"{name}_write_cpu_s_per_gb": c_write / (nbytes / 1e9), f"{name}_read_cpu_s_per_gb": c_read / (nbytes / 1e9), f"{name}_o_direct": o_direct,
                f"{name}_read_cache_dropped": files > 0, f"{name}_read_verified": ok,
                f"{name}_blocks_read": len(got), f"{name}_sync_groups": sync_groups,
                f"{name}_engine": engine}
    finally:
        h.shutdown()


def g3_tier(root: str, opts: BenchOptions, *, heads: int, threads: int, capacity_gb: float, fsync: bool,
            o_direct: str) -> dict:
    """The secondary tier dict of our G3 tier on ``root`` (``fsync``: ours or ours_nofsync). Its loads' deadline is
    the largest ``g3.load_timeout_s`` (``LOAD_TIMEOUT_MAX_S``, 120 s), not the 5 s serving default: a read a busy
    machine slowed past 5 s is measured, not turned into a failed chunk load (``*_read_verified`` false, and a read
    throughput of misses)."""
    return {"type": "G3Tier", "module_path": TIERING_MODULE, "num_kv_heads": heads, "io_threads": threads,
            "config": {"model": opts.layout},
            "g3": {"paths": [root], "capacity_gb": capacity_gb, "io_size_bytes": opts.io_size_bytes,
                   "engine": opts.engine, "io_threads": threads, "fsync": fsync, "o_direct": o_direct,
                   "load_timeout_s": LOAD_TIMEOUT_MAX_S}}


def run(opts: BenchOptions, rounds_n: int = ROUNDS) -> dict:
    """Run the comparison (see module docstring) over ``rounds_n`` alternating rounds. Raises ValueError on
    bad options."""
    from kvbm_backend.model.presets import load_preset
    if not opts.path:
        raise ValueError("--path: required for --tier vllm-tiers (a directory on the disk to test)")
    if rounds_n < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds_n}")
    if opts.blocks < 1:
        raise ValueError(f"--blocks: must be >= 1, got {opts.blocks}")
    preset = load_preset(opts.layout)
    layout = preset.layout(page_size=opts.page_size, tp=opts.tp)
    heads = preset.kv_heads_per_rank(opts.tp)
    if preset.mla:
        raise ValueError(f"--layout: {opts.layout} is MLA; vLLM's fs tier comparison uses a K/V layout")
    geo = dict(num_layers=layout.num_layers, num_kv_heads=heads, head_dim=preset.head_dim, dtype=layout.dtype,
               tokens_per_block=opts.page_size)
    base = os.path.join(opts.path, f"kvbm-vllm-tiers-{uuid.uuid4().hex[:8]}")
    fs_root = os.path.join(base, "vllm-fs")
    g3_roots = {"ours": os.path.join(base, "kvbm-g3"), "ours_nofsync": os.path.join(base, "kvbm-g3-nofsync")}
    for d in (fs_root, *g3_roots.values()):
        os.makedirs(d)
    o_direct = "on" if vllm_fs_uses_o_direct(fs_root) else "off"  # what vLLM's fs tier will use there
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, layout.bytes_per_block, dtype=np.uint8) for _ in range(opts.blocks)]
    batch = 16
    threads = max(1, opts.threads)
    capacity_gb = max(1.0, 2.5 * rounds_n * opts.blocks * layout.bytes_per_block / 1e9)
    result: dict[str, Any] = {"tier": "vllm-tiers", "engine": opts.engine, "inflight": threads,
                              "io_size_bytes": opts.io_size_bytes, "layout": opts.layout, "block_bytes": layout.bytes_per_block, "blocks": opts.blocks,
                              "chunks_per_store_job": batch, "path": opts.path, "rounds": rounds_n}
    rounds: dict[str, list[dict]] = {"vllm_fs": [], "ours": [], "ours_nofsync": []}
    try:
        for rnd in range(rounds_n):  # alternate the tiers so drift of a virtual disk hits both alike
            run_id = uuid.uuid4().hex  # fresh keys (new files / slots) every round
            keys = [_key(i, run_id) for i in range(opts.blocks)]
            order = ("vllm_fs", "ours", "ours_nofsync") if rnd % 2 == 0 else ("ours_nofsync", "ours", "vllm_fs")
            for name in order:
                raise_if_terminated()  # a SIGTERM ends the run here (apps/signals.py)
                if name == "vllm_fs":
                    cfg = {"type": "fs", "root_dir": fs_root, "n_read_threads": threads, "n_write_threads": threads}
                    root = fs_root
                else:
                    root = g3_roots[name]
                    cfg = g3_tier(root, opts, heads=heads, threads=threads, capacity_gb=capacity_gb,
                                  fsync=name == "ours", o_direct=o_direct)
                rounds[name].append(_one_tier(name, cfg, geo, keys, payloads, root, batch))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name, rs in rounds.items():
        for metric in ("write_gbps", "read_gbps", "write_cpu_s_per_gb", "read_cpu_s_per_gb"):
            vals = [r[f"{name}_{metric}"] for r in rs]
            result[f"{name}_{metric}"] = float(np.median(vals))
            result[f"{name}_{metric}_rounds"] = vals
        if name != "vllm_fs":
            result[f"{name}_sync_groups_rounds"] = [r[f"{name}_sync_groups"] for r in rs]
        for flag in ("o_direct", "read_cache_dropped", "read_verified"):
            result[f"{name}_{flag}"] = all(r[f"{name}_{flag}"] for r in rs)
    result["engine"] = rounds["ours"][0]["ours_engine"] or opts.engine  # the engine our G3 tier ran
    result["write_ratio"] = result["ours_write_gbps"] / result["vllm_fs_write_gbps"]
    result["same_durability"] = result["vllm_fs_o_direct"] == result["ours_nofsync_o_direct"]
    result["write_ratio_same_durability"] = (result["ours_nofsync_write_gbps"] / result["vllm_fs_write_gbps"]
                                             if result["same_durability"] else None)
    how = "O_DIRECT" if o_direct == "on" else "buffered (O_DIRECT refused here)"
    result["durability"] = {
        "vllm_fs": f"{how} write to a temp file + rename, no fsync: a stored block can be lost on power loss",
        "ours": f"{how} write + fdatasync of the slab files + journal append before a block is published",
        "ours_nofsync": f"g3.fsync false: {how} write + journal append, no fsync: vLLM's fs tier's durability"}
    result["read_ratio"] = result["ours_read_gbps"] / result["vllm_fs_read_gbps"]
    result["note"] = (f"medians of {rounds_n} alternating rounds; same chunks through vLLM's TieringOffloadingManager; page cache dropped (fsync + "
                      "posix_fadvise DONTNEED) for both tiers' files before reads; ours fsyncs before publish, "
                      "vLLM's fs tier does not; ours_nofsync has vLLM's fs tier's durability (no flush, same "
                      "O_DIRECT choice): write_ratio_same_durability compares those two")
    return result
