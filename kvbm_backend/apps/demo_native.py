"""The demo's configurations through vLLM's native offloading path, the tiers' bytes on disk, and the CPU
budget every engine of the demo gets.

* ``vllm_fs`` (the peer): vLLM's ``OffloadingConnector`` with our ``CpuTieringOffloadingSpec``
  (:mod:`kvbm_backend.integrations.vllm.native_cpu`: vLLM's ``TieringOffloadingSpec`` on a CPU engine), a
  CPU primary tier of about twice the engine's KV budget, and vLLM's own ``fs`` tier below it (no capacity
  bound, no restart index, no encryption).
* ``native_tiers``: the same, with our ``G3Tier`` + ``G4Tier``
  (:mod:`kvbm_backend.integrations.vllm.tiering`) as the secondary tiers instead.

Both run as in-process engines (``engine_run``'s ``native`` field), also under ``--engine dynamo``: the
demo has no Dynamo worker script for the native path (the JSON's ``serving`` per config says so).

Every tier of the demo (these, :func:`native_extra`, and the connector's, :func:`connector_extra`) loads with
:data:`G3_LOAD_S` and :data:`G4_TIMEOUT_S`, not the serving 5 s: the demo measures the trace's hits, as ``replay``
and ``bench`` do, and a read a busy machine slowed past 5 s was a miss the engine recomputed (the native tiers'
``job_timeout_s``, 60 s, still ends a load that hangs).
"""
from __future__ import annotations

import os
from typing import Any
from pathlib import Path

from kvbm_backend.config import LOAD_TIMEOUT_MAX_S

NATIVE_CONFIGS = ("vllm_fs", "native_tiers")
BLOCKS_PER_CHUNK = 2  # 64-token offload chunks over 32-token engine blocks: one demo trace block each
TIERING_MODULE = "kvbm_backend.integrations.vllm.tiering"
_TIER_NAMES = {"G3Tier": "G3", "G4Tier": "G4", "fs": "fs", "CPU": "CPU"}
G3_LOAD_S = LOAD_TIMEOUT_MAX_S  # the demo's g3.load_timeout_s: the largest (120 s), not the serving 5 s
G4_TIMEOUT_S = 60.0  # the demo's g4.timeout_s (was 5): a load bound of 120.05 s with g4.retries 1


def cpu_budget_env(ncpu: int | None = None) -> dict:
    """Environment giving every engine of the demo the same CPU budget, in-process or a Dynamo worker: all
    ``ncpu`` CPUs (default: this process's affinity) for the engine's torch/OpenMP threads
    (``OMP_NUM_THREADS``) and no core reserved for vLLM's serving process (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).

    Why: vLLM's multiprocess executor (how Dynamo runs vLLM on CPU) by default reserves one core for the
    serving process and pins the worker's OpenMP threads to the rest: 1 thread on a 2-core VM for a plain
    worker, while a worker with a kv-transfer-config asks for a second reserved core, finds too few and
    reserves none (2 threads). The in-process engine uses every CPU. ``benchmarks/cpu_budget_ab.py``
    measures the effect (with this budget a Dynamo worker's prefill takes about as long as the in-process
    engine's; whether vLLM also pins the threads made no measurable difference). Values already in this
    process's environment are kept (they then apply to every config alike)."""
    n = int(ncpu or len(os.sched_getaffinity(0)))
    want = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(n)}
    return {k: os.environ.get(k, v) for k, v in want.items()}


def native_g4_url(g4_url: str) -> str:
    """The G4 location of ``native_tiers``: ``g4_url`` + ``-native`` (its own prefix/directory, so its
    bytes are counted apart from the connector's)."""
    return g4_url.rstrip("/") + "-native"


def connector_extra(g3_dir: str, wd: Path, model, *, g3_capacity_gb: float, g4_url: str, keyring: str,
                    endpoint_url: str | None = None) -> dict:
    """``kv_connector_extra_config`` of the demo's ``KvbmBackendConnector`` configs (``kvbm_backend``, ``restart``):
    G3 in ``wd / g3_dir`` (``g3_capacity_gb`` GB, every block admitted), the encrypted G4 at ``g4_url`` (keyring file
    ``keyring``), stats in ``wd / <g3_dir>-stats.json``; loads bounded by :data:`G3_LOAD_S` / :data:`G4_TIMEOUT_S`."""
    g4: dict[str, Any] = {"enabled": True, "url": g4_url, "encrypt": True, "keyring": {"path": keyring},
                          "timeout_s": G4_TIMEOUT_S}
    if endpoint_url:
        g4["endpoint_url"] = endpoint_url
    cfg = {"model": model.name, "g3": {"paths": [str(wd / g3_dir)], "capacity_gb": g3_capacity_gb, "files_per_path": 2,
                                       "admission": {"policy": "all"}, "load_timeout_s": G3_LOAD_S},
           "g4": g4}
    return {"kvbm_backend": cfg, "stats_path": str(wd / f"{g3_dir}-stats.json")}


def native_extra(kind: str, wd: Path, model, *, cpu_bytes: int, g3_capacity_gb: float, g4_url: str,
                 keyring: str, endpoint_url: str | None = None) -> dict:
    """``kv_connector_extra_config`` of vLLM's ``OffloadingConnector`` for ``kind`` (one of
    :data:`NATIVE_CONFIGS`): a ``cpu_bytes`` CPU primary tier, :data:`BLOCKS_PER_CHUNK` engine blocks per
    chunk, and the config's secondary tiers (``vllm_fs``: vLLM's ``fs`` in ``wd/vllm-fs``; ``native_tiers``:
    G3 in ``wd/g3-native`` of ``g3_capacity_gb`` GB, then G4 at :func:`native_g4_url` (encrypted, keyring
    file ``keyring``)). Raises ValueError for another ``kind``."""
    if kind == "vllm_fs":
        tiers: list[dict[str, Any]] = [{"type": "fs", "root_dir": str(wd / "vllm-fs")}]
    elif kind == "native_tiers":
        base = {"model": model.name}
        g4 = {"url": native_g4_url(g4_url), "encrypt": True, "keyring": {"path": keyring}, "timeout_s": G4_TIMEOUT_S}
        if endpoint_url:
            g4["endpoint_url"] = endpoint_url
        common: dict[str, Any] = {"module_path": TIERING_MODULE, "config": base, "num_kv_heads": model.num_key_value_heads,
                  "io_threads": 2}
        tiers = [{**common, "type": "G3Tier", "g3": {"paths": [str(wd / "g3-native")], "capacity_gb": g3_capacity_gb,
                                                     "files_per_path": 2, "load_timeout_s": G3_LOAD_S}},
                 {**common, "type": "G4Tier", "g4": g4}]
    else:
        raise ValueError(f"native config: expected one of {NATIVE_CONFIGS}, got {kind!r}")
    return {"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "kvbm_backend.integrations.vllm.native_cpu",
            "cpu_bytes_to_use": int(cpu_bytes), "blocks_per_chunk": BLOCKS_PER_CHUNK, "secondary_tiers": tiers}


def _local(url: str) -> Path | None:
    from kvbm_backend.store_url import file_url_path
    local = file_url_path(url)  # file:///p, file:/p, file://localhost/p -> /p
    return Path(local) if local is not None else None


def tier_dirs(name: str, wd: Path, g4_url: str) -> dict[str, Path | None]:
    """The directories config ``name`` writes its tiers to (``None``: remote, an ``s3://`` G4). The
    connector's G4 is shared by ``kvbm_backend`` and ``restart`` (the returning user reads it)."""
    g4, g4n = _local(g4_url), _local(native_g4_url(g4_url))
    dirs: dict[str, dict[str, Path | None]] = {
        "baseline": {}, "kvbm_backend": {"G3": wd / "g3-run", "G4": g4},
        "restart": {"G3": wd / "g3-restart", "G4": g4}, "vllm_fs": {"fs": wd / "vllm-fs"},
        "native_tiers": {"G3": wd / "g3-native", "G4": g4n}}
    return dirs.get(name, {})


def disk_bytes(path: Path | None) -> int | None:
    """Bytes allocated on disk (``st_blocks * 512``, as ``du``) by the files under ``path``; 0 when it does
    not exist, ``None`` for ``None`` (remote)."""
    if path is None:
        return None
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def native_tier_summary(res: dict) -> dict:
    """From an ``engine_run`` native result: ``hit_rate_by_tier`` (share of prompt tokens served by the
    engine's own prefix cache, the CPU primary tier and each secondary tier; a tier's tokens are its loaded
    chunks x chunk tokens, the engine's the rest of ``cached_tokens``), ``chunks_loaded_by_tier`` and our
    tiers' counters (``tier_counters``: stored / loaded chunks, pool hits / evictions / used bytes)."""
    loads = res.get("native_loads") or {}
    by = loads.get("chunks_by_source") or {}
    ct = int(loads.get("chunk_tokens") or 0)
    prompt, cached = int(sum(res["prompt_tokens"])), int(sum(res["cached_tokens"]))
    toks = {_TIER_NAMES.get(k, k): v * ct for k, v in by.items()}
    engine = max(0, cached - sum(toks.values()))
    rate = {"engine": engine / prompt if prompt else 0.0}
    rate.update({k: (v / prompt if prompt else 0.0) for k, v in toks.items()})
    counters = {}
    for t in res.get("tier_stats") or []:
        if "tier" in t:
            tier, pool = t["tier"], t.get("pool") or {}
            counters[_TIER_NAMES.get(t["type"], t["type"])] = {
                "chunks_stored": tier.get("chunks_stored"), "chunks_loaded": tier.get("chunks_loaded"),
                "chunks_load_failed": tier.get("chunks_load_failed"), "stores_failed": tier.get("stores_failed"),
                "pool_hits": pool.get("hits"), "pool_evictions": pool.get("evictions"),
                "used_bytes": pool.get("used_bytes")}
    return {"hit_rate_by_tier": rate, "chunks_loaded_by_tier": {_TIER_NAMES.get(k, k): v for k, v in by.items()},
            "chunk_tokens": ct, "tier_counters": counters}
