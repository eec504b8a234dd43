"""Run the real vLLM engine on token-id prompts, one request at a time, and report outputs and TTFT.

Meant to run in its own process (vLLM spawns helpers and keeps global state)::

    python -m kvbm_backend.integrations.vllm.engine_run SPEC.json

SPEC (JSON) fields:

* ``model_dir`` (str): a directory from :func:`kvbm_backend.apps.engine_model.write_model_dir`.
* ``load_format`` (str): vLLM's load format; default ``"safetensors"`` when ``model_dir`` holds the
  ``model.safetensors`` that :mod:`kvbm_backend.apps.engine_model` writes, else ``"dummy"`` (vLLM's own
  near-zero random weights, with which outputs do not depend on the KV cache).
* ``prompts`` (list of token-id lists), ``max_tokens`` (int, default 4), ``cache_salts`` (optional list),
  ``ignore_eos`` (bool, default false: generate exactly ``max_tokens``).
* ``connector``: null (engine prefix cache only) or ``{"extra": kv_connector_extra_config,
  "multi_with": optional extra connector dict for vLLM's MultiConnector}``.
* ``block_size`` (tokens, default 32: the CPU backend needs a multiple of 32), ``dtype``
  (default bfloat16), ``num_gpu_blocks`` (engine KV budget in blocks, vLLM's
  ``num_gpu_blocks_override``: a small budget makes blocks leave the engine; the process env's
  ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, must cover it), ``max_model_len`` (default 8192, cut to
  ``(num_gpu_blocks - 1) * block_size``), ``seed`` (default 0).
* ``native``: instead of ``connector``, vLLM's own ``OffloadingConnector`` with this
  ``kv_connector_extra_config`` (e.g. :mod:`kvbm_backend.integrations.vllm.native_cpu`'s spec and our
  G3/G4 ``secondary_tiers``). In-process (``multiprocessing`` false): after the prompts the engine
  steps until its offloads (primary and secondary tiers) are done, then shuts down, which closes the
  tiers' pools (G3 persists its index). With ``multiprocessing`` (or TP > 1) the engine core steps
  itself while offloads are pending; the run waits until the files under ``settle_dirs`` (list of
  directories, e.g. the G3 paths) have not changed for ``settle_s`` seconds (default 3; ``settled`` in
  the result says whether they did within 120 s; ``settle_g3_blocks`` N: and until the G3 journals there
  name at least N blocks), then shuts the engine down; ``tier_stats`` and
  ``native_loads`` are then absent (the tiers live in the engine core process). ``tier_stats`` in the result: per secondary tier, ``type`` and
  (our tiers) ``kvbm_stats()`` read before the shutdown. ``native_loads`` in the result, the same counts
  for every tier type (vLLM's ``fs`` included), after the warm-up request: ``chunks_by_source``
  (``{"CPU" | <secondary tier type>: chunks}``, each chunk the engine loaded counted once, by the tier it
  came from: ``CPU`` when it was already in the primary tier, else the secondary tier that promoted it)
  and ``chunk_tokens`` (tokens per chunk).
* ``logprobs`` (int, optional): vLLM's ``SamplingParams.logprobs``, the top ``logprobs`` tokens of every
  generated token; ``logprobs`` in the result: per prompt, per generated token, ``[[token id, logprob], ...]``
  best first (the sampled token is among them, so a list may hold ``logprobs + 1`` entries).
* ``kv_transfer_params`` (optional list, one dict or null per prompt): the request's
  ``kv_transfer_params`` (e.g. ``{"kvbm_tenant": "a"}`` for our native tiers).
* ``multiprocessing`` (bool, default false): vLLM's engine core and (on CPU) its worker in their own
  processes, as ``vllm serve`` runs them; counters are then read from the connector's ``stats_path``
  files (``scheduler_stats`` from the scheduler's).
* ``tensor_parallel_size`` (int, default 1): TP ranks, each a worker process (implies
  ``multiprocessing``); on CPU, ``VLLM_CPU_OMP_THREADS_BIND`` is set to split this process's CPUs
  between the ranks when the caller did not set it. Rank r > 0 writes its counters to
  ``<stats_path stem>.rank<r><ext>`` (``rank_stats``: a list, rank 1 first).
* ``warmup`` (bool, default true): one throwaway request first (kernel/JIT warm-up, not timed).
* ``pause_before`` (list of prompt indexes) and ``pause_dir`` (str): before prompt ``i`` the run writes
  ``pause_dir/paused-<i>`` and waits (at most ``pause_max_s``, default 600 s) until ``pause_dir/resume-<i>``
  exists, so a test can act on the tiers of a running engine (e.g. damage G3 under a live pool).
* ``reset_prefix_cache_before`` (list of prompt indexes): empty the engine's own prefix cache before prompt
  ``i`` (vLLM's ``LLM.reset_prefix_cache``; runs no engine step), so that prompt can only hit G3/G4.
* ``reset_connector_before`` (list of prompt indexes): ``LLM.reset_prefix_cache(reset_connector=True)`` before
  prompt ``i`` (the engine's prefix cache and the connector's: :mod:`.reset_epoch`); what each call returned is in
  the result's ``reset_connector_results``. ``settle_before`` (list of prompt indexes; in-process connector runs):
  before prompt ``i`` (and before each connector reset) wait, bounded, until the connector's offloads are written.
* ``out`` (str): where the result JSON goes.

Result JSON: ``outputs`` (greedy token ids per prompt), ``ttft_s`` (vLLM's ``first_token_latency``
per request, seconds: arrival to first token, loads included), ``e2e_s`` (wall seconds per
``generate`` call), ``cached_tokens`` (vLLM's ``num_cached_tokens`` per request: prompt tokens not
computed, engine prefix cache plus connector loads), ``prompt_tokens``, ``init_s``, and with a
connector ``connector_stats`` (:mod:`kvbm_backend.integrations.vllm.stats`; in-process, counted after the
warm-up request, whose own counters are ``warmup_connector_stats``: before 2026-11-30 they were in the prompts'
counters, so the demo's kvbm_backend reported the other config's warm-up block as a G4 load; with
``multiprocessing`` the stats files hold the warm-up too), ``connector_info`` (KV cache
tensor shape per layer, engine layout, bytes per block, namespace) and ``pool_stats``
(G3/G4 ``stats()`` after a bounded flush; the warm-up included).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _default_load_format(model_dir: str) -> str:
    return "safetensors" if os.path.isfile(os.path.join(model_dir, "model.safetensors")) else "dummy"


def run(spec: dict) -> dict:
    tp_size = int(spec.get("tensor_parallel_size", 1))
    mp = bool(spec.get("multiprocessing", False)) or tp_size > 1
    if tp_size > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        cpus = sorted(os.sched_getaffinity(0))
        per = max(1, len(cpus) // tp_size)
        groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp_size)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mp else "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    conn = spec.get("connector")
    ktc = None
    if conn is not None:
        ours = {"kv_connector": "KvbmBackendConnector",
                "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": conn.get("extra", {})}
        if conn.get("multi_with"):
            ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"connectors": [ours, conn["multi_with"]]}}
        else:
            ktc = dict(ours, kv_load_failure_policy="recompute")
    if spec.get("native") is not None:
        if conn is not None:
            raise ValueError("native: needs connector null")
        ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": spec["native"]}
    kw: dict[str, Any] = {}
    if tp_size > 1:
        kw.update(tensor_parallel_size=tp_size, distributed_executor_backend="mp")
    bs = int(spec.get("block_size", 32))
    max_len = int(spec.get("max_model_len", 8192))
    if spec.get("num_gpu_blocks"):
        kw["num_gpu_blocks_override"] = int(spec["num_gpu_blocks"])
        max_len = min(max_len, (int(spec["num_gpu_blocks"]) - 1) * bs)  # one block is vLLM's null block
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], load_format=spec.get("load_format") or _default_load_format(spec["model_dir"]), skip_tokenizer_init=True,
              dtype=spec.get("dtype", "bfloat16"), enforce_eager=True, block_size=bs,
              max_model_len=max_len, seed=int(spec.get("seed", 0)),
              gpu_memory_utilization=0.1, disable_log_stats=False, kv_transfer_config=ktc,
              enable_prefix_caching=True, max_num_batched_tokens=int(spec.get("max_num_batched_tokens", max(max_len, 2048))), **kw)
    init_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 4)), detokenize=False, seed=0,
                        ignore_eos=bool(spec.get("ignore_eos", False)), logprobs=spec.get("logprobs"))
    ktps = spec.get("kv_transfer_params") or [None] * len(spec["prompts"])
    prompts = spec["prompts"]
    salts = spec.get("cache_salts") or [None] * len(prompts)
    if spec.get("warmup", True):
        llm.generate([TokensPrompt(prompt_token_ids=[7] * 40)], SamplingParams(temperature=0.0, max_tokens=1,
                     detokenize=False), use_tqdm=False)
    warm_stats = None
    if conn is not None and not mp and spec.get("warmup", True):  # the connector's counters, from here too
        warm_stats = _settled_connector_stats()[0]
    native_loads = None
    if spec.get("native") is not None and not mp:  # counted from here: the warm-up request is not in them
        native_loads = _count_native_loads(llm, bs * int(spec["native"].get("blocks_per_chunk") or 0) or None)
    outs, ttft, e2e, cached, lps = [], [], [], [], []
    progress = spec.get("progress_file")
    pause_before = set(spec.get("pause_before") or ())
    resets, reset_results = set(spec.get("reset_connector_before") or ()), []
    for i, (p, salt, ktp) in enumerate(zip(prompts, salts, ktps)):
        if i in pause_before:
            _pause(spec["pause_dir"], i, float(spec.get("pause_max_s", 600)))
        if conn is not None and not mp and i in set(spec.get("settle_before") or ()) | set(resets):
            _settled_connector_stats()  # saves of the prompts before are written (and in G3's index)
        if i in set(spec.get("reset_prefix_cache_before") or ()):
            if not llm.reset_prefix_cache():
                raise RuntimeError(f"reset_prefix_cache before prompt {i} failed")
        if i in resets:
            reset_results.append(bool(llm.reset_prefix_cache(reset_connector=True)))
        tp = TokensPrompt(prompt_token_ids=list(p))
        if salt:
            tp["cache_salt"] = salt
        t = time.perf_counter()
        o = llm.generate([tp], sp if ktp is None else _with_params(sp, ktp), use_tqdm=False)[0]
        e2e.append(time.perf_counter() - t)
        outs.append(list(o.outputs[0].token_ids))
        if spec.get("logprobs") is not None:  # per generated token: [[token id, logprob], ...], best first
            lps.append([sorted(([int(t), float(lp.logprob)] for t, lp in d.items()), key=lambda x: -x[1])
                        for d in o.outputs[0].logprobs or []])
        cached.append(int(o.num_cached_tokens or 0))
        m = o.metrics
        ttft.append(float(m.first_token_latency) if m is not None and getattr(m, "first_token_latency", None)
                    else e2e[-1])
        if progress:
            with open(progress, "a") as f:
                f.write(f"{i + 1}\n")
    result: dict[str, Any] = {"outputs": outs, "ttft_s": ttft, "e2e_s": e2e, "init_s": init_s, "cached_tokens": cached,
              "prompt_tokens": [len(p) for p in prompts]}
    if spec.get("logprobs") is not None:
        result["logprobs"] = lps
    if resets:
        result["reset_connector_results"] = reset_results
    if spec.get("native") is not None and not mp:
        result["tier_stats"] = _drain_native(llm)
        result["native_loads"] = native_loads
    elif spec.get("native") is not None:
        # The engine core (another process) keeps stepping while its OffloadingConnector has pending work
        # (vLLM's Scheduler.has_requests -> has_pending_push_work); wait until the tiers' files settle,
        # then shut it down (its scheduler shuts the tiers down: jobs drain, pools close).
        result["settled"] = _settle(spec.get("settle_dirs") or [], float(spec.get("settle_s", 3.0)),
                                    int(spec.get("settle_g3_blocks", 0)))
        llm.llm_engine.engine_core.shutdown()
    if conn is not None and mp:
        # Engine core and worker are other processes: shut them down (the connectors flush and write
        # their stats files), then read the files.
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001
            result["shutdown_error"] = str(e)
        sp_ = conn.get("extra", {}).get("stats_path")
        if sp_:
            root, ext = os.path.splitext(sp_)
            for key, path in (("connector_stats", sp_), ("scheduler_stats", f"{root}.scheduler{ext}")):
                if os.path.isfile(path):
                    with open(path) as f:
                        d = json.load(f)
                    result[key] = {k: v for k, v in d.items() if k not in ("pools", "info")}
                    result.setdefault("pool_stats", d.get("pools", {}))
                    result.setdefault("connector_info", d.get("info", {}))
            for r in range(1, tp_size):
                path = f"{root}.rank{r}{ext}"
                if os.path.isfile(path):
                    with open(path) as f:
                        d = json.load(f)
                    result.setdefault("rank_stats", []).append({k: v for k, v in d.items() if k != "info"})
    elif mp and spec.get("native") is None:
        # No connector: still shut the engine core down, or its worker processes (TP ranks) outlive this
        # process holding the caller's stdout/stderr pipes, and a caller reading them to EOF waits forever.
        llm.llm_engine.engine_core.shutdown()
    elif conn is not None:
        from . import stats
        now, pools = _settled_connector_stats()
        if warm_stats is not None:  # the warm-up request's loads, saves and lookups are not the prompts'
            now = {k: v - warm_stats.get(k, 0) for k, v in now.items() if v != warm_stats.get(k, 0)}
            result["warmup_connector_stats"] = warm_stats
        result["connector_stats"] = now
        result["connector_info"] = stats.info()
        result["pool_stats"] = pools
    return result


def _settled_connector_stats() -> tuple[dict, dict]:
    """In-process connector: let background offloads finish (bounded: the workers' hand-offs, then each pool's
    writes, 30 s each), then read the counters. Returns ``(connector counters, {"g3"|"g4": pool stats, and
    "<tier>_flush_error" / "save_flush_error" for what was still pending})``."""
    from .. import tiers
    from . import stats
    from .offloads import flush_all
    pools: dict[str, Any] = {}
    if not flush_all(timeout=30.0):
        pools["save_flush_error"] = "save hand-offs still pending after 30 s"
    for ent in list(tiers._shared.values()):
        for name, p in (("g3", ent[0]), ("g4", ent[1])):
            if p is None:
                continue
            if not p.flush(timeout=30.0):
                pools[f"{name}_flush_error"] = "offloads still pending after 30 s"
            pools[name] = p.stats()
    time.sleep(0.05)
    return stats.snapshot(), pools


def _with_params(sp, kv_transfer_params: dict):
    sp = sp.clone()
    sp.extra_args = {**(sp.extra_args or {}), "kv_transfer_params": dict(kv_transfer_params)}
    return sp


def _count_native_loads(llm, chunk_tokens: int | None) -> dict:
    """Count the chunks the in-process engine's ``OffloadingConnector`` loads, by source tier: wraps the
    tiering manager's ``_initiate_promotion`` (secondary tier ``i`` -> primary, remembered per key) and
    ``prepare_load`` (primary -> engine; a key not promoted for this load came from the CPU tier).
    ``chunk_tokens``: tokens per chunk (reported as is). Returns the live counters dict."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    tiers = [t.tier_type for t in getattr(manager, "secondary_tiers", ())]
    counts: dict = {"chunks_by_source": {"CPU": 0, **{t: 0 for t in tiers}},
                    "chunk_tokens": chunk_tokens}
    promoted: dict = {}
    initiate, prepare_load = manager._initiate_promotion, manager.prepare_load

    def _initiate(i, key, req_context, *a, **kw):
        ok = initiate(i, key, req_context, *a, **kw)
        if ok:
            promoted[key] = tiers[i]
        return ok

    def _prepare_load(keys, req_context, *a, **kw):
        for k in keys:
            src = promoted.pop(k, "CPU")
            counts["chunks_by_source"][src] = counts["chunks_by_source"].get(src, 0) + 1
        return prepare_load(keys, req_context, *a, **kw)

    manager._initiate_promotion, manager.prepare_load = _initiate, _prepare_load
    return counts


def _drain_native(llm, max_s: float = 60.0) -> list[dict]:
    """Step the in-process engine until vLLM's OffloadingConnector has no pending work (a request's last
    stores are submitted on the step after it finishes; secondary tiers cascade after that), read our
    tiers' stats, then shut the engine core down (the tiers drain and close their pools)."""
    core = llm.llm_engine.engine_core.engine_core
    end = time.monotonic() + max_s
    while core.scheduler.has_requests() and time.monotonic() < end:
        llm.llm_engine.step()
        time.sleep(0.005)
    manager = core.scheduler.connector.connector_scheduler.manager
    out = []
    for tier in getattr(manager, "secondary_tiers", ()):
        d = {"type": tier.tier_type}
        if hasattr(tier, "kvbm_stats"):
            tier.drain_jobs()
            d.update(tier.kvbm_stats())
        out.append(d)
    llm.llm_engine.engine_core.shutdown()
    return out


def _settle(dirs: list[str], quiet_s: float, g3_blocks: int = 0, max_s: float = 120.0) -> bool:
    """Wait until the G3 journals under ``dirs`` name at least ``g3_blocks`` blocks (published: durable) and
    then no file under ``dirs`` changed (count, sizes, mtimes) for ``quiet_s`` seconds, at most ``max_s``.
    True if they settled. A quiet window alone is not enough on a busy machine: the engine core may not step
    for longer than it while its stores into the tiers are still to come (a TP=2 restart test found a run
    shut down with three chunks never stored)."""
    def sig():
        return sorted((os.path.join(d, f), st.st_size, st.st_mtime_ns) for root in dirs if os.path.isdir(root)
                      for d, _, fs in os.walk(root) for f in fs
                      for st in [os.stat(os.path.join(d, f))])
    end = time.monotonic() + max_s
    last, since = sig(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.25)
        cur = sig()
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet_s and _journaled_blocks(dirs) >= g3_blocks:
            return True
    return False


def _journaled_blocks(dirs: list[str]) -> int:
    """Blocks the G3 journals (``journal-<fingerprint>.log``) under ``dirs`` name (0 for none or unreadable)."""
    if not dirs:
        return 0
    from kvbm_backend.pool.g3 import journal as jr, journal_columns as jc
    n = 0
    for root in dirs:
        for d, _, fs in os.walk(root):
            for f in fs:
                if not (f.startswith("journal-") and f.endswith(".log")):
                    continue
                fp = f[len("journal-"):-len(".log")]
                try:
                    with open(os.path.join(d, f), "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                head = jr.parse_header(data, fp)
                if head is not None and head[0] >= 2:
                    n += len(jc.decode(data[head[1]:])[0])
    return n


def _pause(pause_dir: str, i: int, max_s: float) -> None:
    """Write ``pause_dir/paused-<i>``, then wait until ``pause_dir/resume-<i>`` exists (or ``max_s`` passed)."""
    with open(os.path.join(pause_dir, f"paused-{i}"), "w") as f:
        f.write(str(os.getpid()))
    resume = os.path.join(pause_dir, f"resume-{i}")
    end = time.monotonic() + max_s
    while not os.path.exists(resume) and time.monotonic() < end:
        time.sleep(0.05)


def vllm_version() -> str:
    """``vllm.__version__``, or ``"unknown"`` where vLLM does not import."""
    try:
        import vllm
        return vllm.__version__
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kvbm_backend.integrations.vllm.engine_run SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f, default=str)
    sys.stdout.flush()
    # vLLM's engine threads can keep the interpreter alive; the result is on disk.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
