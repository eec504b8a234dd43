"""``kvbm-backend demo``: the real vLLM engine on a real trace, five configurations, one run.

What runs (every engine with the same CPU budget: :func:`~kvbm_backend.apps.demo_native.cpu_budget_env`):

* ``baseline``: the engine's own prefix cache only.
* ``kvbm_backend``: :class:`~kvbm_backend.integrations.vllm.connector.KvbmBackendConnector` with G3 (a
  local directory) and G4 (a local directory store ``file://...`` by default, or ``--g4 s3://...``).
* ``restart``: a fresh engine process with an EMPTY G3, reading the G4 written by ``kvbm_backend``
  (the returning user after a restart).
* ``vllm_fs`` and ``native_tiers``: vLLM's native offloading path (``OffloadingConnector``, a CPU tier,
  then vLLM's own ``fs`` tier or our G3+G4 tiers; :mod:`kvbm_backend.apps.demo_native`), always as
  in-process engines.

Two ways to serve the first three (``--engine``):

* ``dynamo`` (default): NVIDIA Dynamo's frontend and three ``dynamo.vllm`` workers started from
  ``examples/dynamo/`` (:mod:`kvbm_backend.apps.demo_dynamo`); a real OpenAI client streams each request, TTFT at
  the client. The native configs then run in-process beside an in-process ``baseline_direct``, so each
  storage-vs-recompute ratio compares engines served the same way.
* ``direct``: each configuration is a fresh in-process vLLM engine
  (:mod:`kvbm_backend.integrations.vllm.engine_run`), TTFT is vLLM's own ``first_token_latency``.

In-process engines start side by side (load, warm up, then wait) and serve one at a time, as the Dynamo
workers do. At the end the demo measures the bytes each config's tiers left on disk (allocated, as ``du``).

Requests: conversations from a Mooncake-format trace (default ``../shared/data/mooncake_synthetic_trace.jsonl``
relative to the repo root). Requests whose first hash id is shared (multi-turn conversations) are
taken in trace order, a few turns per conversation; each 512-token trace block becomes
``block_tokens`` tokens (the leading tokens of :func:`kvbm_backend.apps.replay.block_tokens`, so equal hash
ids give equal tokens, as in ``replay``), lengths are scaled by ``block_tokens / 512`` and capped.
The engine's KV budget holds about one request, so a conversation's earlier turns have left the engine
by the time it returns. The scaling is printed and written to the JSON.

Model: :data:`kvbm_backend.apps.engine_model.DEMO` with random weights
(:func:`~kvbm_backend.apps.engine_model.write_model_dir`: vLLM's own dummy weights make outputs ignore the
KV, so "outputs identical" would prove nothing), in float32 (:data:`DTYPE`), chosen so a prefill costs
clearly more than reading the same KV back (KV bytes grow with layers x KV heads, compute with
layers x hidden^2): a 4-layer hidden-256 model prefills 2,000 tokens in ~0.1-0.4 s on 2 cores, too cheap
for storage to matter much; the demo model has 8 layers, hidden 1024, 2 KV heads of 64 (8 KiB of KV
per token in float32). Why float32: in bfloat16, vLLM's CPU prefill over a cached prefix is not
bit-equal to a full prefill, and with this model that flips greedy tokens even with vLLM's own prefix
cache and no connector (measured: a 3,072-token prompt, 3,040 tokens from the engine's prefix cache,
first token 229 vs 940 from a full prefill); in float32 both paths give the same tokens, so an output
that differs from ``baseline`` means different KV.

TTFT, one request at a time: with ``dynamo``, request sent -> first streamed token at the HTTP client; with
``direct``, vLLM's per-request ``first_token_latency`` (arrival to first token, loads included). Outputs are
greedy (temperature 0, 4 tokens) and compared with ``baseline``'s (token ids with ``direct``, the completion
text with ``dynamo``).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .demo_native import (BLOCKS_PER_CHUNK, NATIVE_CONFIGS, connector_extra, cpu_budget_env, disk_bytes, native_extra,
                          native_g4_url, native_tier_summary, tier_dirs)
from .demo_engines import _run_engines
from .cli_checks import write_whole
from ..fsmodes import makedirs_private
from .engine_model import DEMO, write_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 32  # vLLM CPU attention needs a multiple of 32
DTYPE = "float32"  # see the module docstring: bfloat16 prefill over a cached prefix is not bit-equal here
# the tiers' directories under the workdir (demo_native.tier_dirs): a run must find them absent
TIER_SUBDIRS = ("g3-run", "g3-restart", "g4", "g3-native", "g4-native", "vllm-fs")


def default_trace() -> Path:
    return DEFAULT_TRACE


def check_workdir(workdir: str | Path | None) -> None:
    """Raise ValueError naming ``--workdir`` and the leftovers when ``workdir`` already holds any of
    :data:`TIER_SUBDIRS`: G3's warm restart would find the earlier run's blocks and the bytes on disk would count
    them. Nothing is deleted (it may be someone's data)."""
    left = [d for d in TIER_SUBDIRS if workdir is not None and (Path(workdir) / d).exists()]
    if left:
        raise ValueError(f"--workdir {workdir}: holds tier directories of an earlier run ({', '.join(left)}), whose "
                         "blocks this run would count as its own; give a new or empty directory (nothing was deleted)")


def select_requests(trace: str | Path, n: int, turns_per_conv: int = 3, block_tokens: int = 64,
                    max_tokens_per_request: int = 3072, min_tokens: int = 256,
                    vocab: int = DEMO.vocab_size) -> tuple[list[list[int]], dict]:
    """Pick ``n`` requests: conversations (requests sharing their first hash id, at least 2 turns) in
    order of first appearance, at most ``turns_per_conv`` turns each, replayed in trace order; derive
    token ids. Returns ``(prompts, scaling_info)``.

    Raises ValueError naming ``--trace`` if it is missing or malformed, ``--requests`` if it has too few.
    """
    from .replay import TRACE_BLOCK_TOKENS, block_tokens as trace_block_tokens, load_trace
    rows = load_trace(str(trace))
    groups: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        if r["hash_ids"]:
            groups[r["hash_ids"][0]].append(i)
    scale = block_tokens / TRACE_BLOCK_TOKENS
    # Conversations in order of first appearance, up to ``turns_per_conv`` turns each, until ``n``
    # requests; then replayed in trace order (turns of different conversations interleave).
    chosen: list[int] = []
    for first in sorted(groups, key=lambda h: groups[h][0]):
        if len(chosen) >= n:
            break
        turns = [i for i in groups[first] if math.ceil(rows[i]["input_length"] * scale) >= min_tokens]
        if len(turns) < 2:
            continue
        chosen.extend(turns[:min(turns_per_conv, n - len(chosen))])
    chosen.sort()
    if len(chosen) < n:
        raise ValueError(f"--requests {n}: --trace {trace} has only {len(chosen)} multi-turn requests of >= "
                         f"{min_tokens} scaled tokens")
    cache: dict[int, np.ndarray] = {}
    prompts = []
    lengths = []
    for i in chosen:
        r = rows[i]
        length = min(max_tokens_per_request, max(1, math.ceil(r["input_length"] * scale)))
        toks = []
        for h in r["hash_ids"]:
            if h not in cache:
                cache[h] = trace_block_tokens(h)[:block_tokens] % vocab
            toks.append(cache[h])
            if len(toks) * block_tokens >= length:
                break
        t = np.concatenate(toks)[:length]
        prompts.append([int(x) for x in t])
        lengths.append(length)
    info = {"trace": str(trace), "trace_requests_used": chosen, "conversations": len({rows[i]["hash_ids"][0] for i in chosen}),
            "turns_per_conversation_max": turns_per_conv, "trace_block_tokens": TRACE_BLOCK_TOKENS,
            "demo_tokens_per_trace_block": block_tokens, "length_scale": scale,
            "max_tokens_per_request": max_tokens_per_request,
            "trace_input_tokens_mean": float(np.mean([rows[i]["input_length"] for i in chosen])),
            "demo_input_tokens_mean": float(np.mean(lengths)), "demo_input_tokens_max": int(max(lengths))}
    return prompts, info


def _summary(res: dict, base: dict | None, bs: int) -> dict:
    ttft = np.asarray(res["ttft_s"], dtype=float)
    prompt_tokens = int(sum(res["prompt_tokens"]))
    cached = int(sum(res["cached_tokens"]))
    out = {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
           "ttft_mean_s": float(ttft.mean()), "ttft_s": [float(x) for x in ttft],
           "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
           "prompt_tokens": prompt_tokens, "cached_tokens": cached,
           "outputs_identical": base is None or res["outputs"] == base["outputs"],
           "engine_init_s": res.get("init_s")}
    if base is not None:
        out["outputs_matching"] = sum(1 for a, b in zip(res["outputs"], base["outputs"]) if a == b)
    cs = res.get("connector_stats")
    if cs is not None:
        pt = prompt_tokens or 1  # share of prompt tokens, as for the native configs (blocks x block tokens)
        out["hit_rate_by_tier"] = {"engine": cs.get("local_hit_blocks", 0) * bs / pt,
                                   "G3": cs.get("load_g3_blocks_ok", 0) * bs / pt,
                                   "G4": cs.get("load_g4_blocks_ok", 0) * bs / pt}
        out["blocks"] = {"looked_up": cs.get("lookup_blocks", 0), "engine_hits": cs.get("local_hit_blocks", 0),
                         "loaded_g3": cs.get("load_g3_blocks_ok", 0), "loaded_g4": cs.get("load_g4_blocks_ok", 0),
                         "load_failed": cs.get("load_blocks_failed", 0), "saved": cs.get("save_blocks", 0),
                         "promoted_to_g3": cs.get("promote_blocks", 0)}
        out["bytes_moved"] = {"loaded": int(cs.get("load_bytes", 0)),
                              "written_g3": int(cs.get("g3_put_written_bytes", 0)),
                              "written_g4": int(cs.get("g4_put_written_bytes", 0))}
        out["connector_stats"] = cs
        out["connector_info"] = res.get("connector_info")
        ps = res.get("pool_stats") or {}
        out["pool_stats"] = {k: {kk: v for kk, v in (ps.get(k) or {}).items()
                                 if kk in ("hits", "misses", "corrupt", "bytes_read", "bytes_written", "blocks",
                                           "written", "dropped", "encrypted", "url", "paths", "engine",
                                           "used_bytes", "evictions")}
                             for k in ("g3", "g4") if k in ps}
    if res.get("native_loads") is not None:
        out.update(native_tier_summary(res))
    return out


def vs_baseline(ratio: float) -> str:
    """A config's TTFT p50 against its baseline's, in words; ``ratio`` = baseline p50 / config p50 (both s):
    ``2.5x lower`` (faster) for ratio >= 1, ``2.0x higher`` (1 / ratio: slower) below 1."""
    return f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x higher"


def plot_demo(result: dict, path: str) -> None:
    """PNG, four panels: TTFT p50/p90 (s) per configuration (with "outputs = baseline", or "reference" for the
    baseline itself), per-request TTFT (s, log scale), hit rate by tier (stacked, share of prompt tokens) and
    the tiers' bytes on disk at the end (MB)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfgs = result["configs"]
    names = list(cfgs)
    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(14, 8.5))
    x = np.arange(len(names))
    p50 = [cfgs[n]["ttft_p50_s"] for n in names]
    p90 = [cfgs[n]["ttft_p90_s"] for n in names]
    ax1.bar(x - 0.2, p50, 0.4, label="p50")
    ax1.bar(x + 0.2, p90, 0.4, label="p90")
    ax1.set_xticks(x, names, rotation=15)
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title("TTFT per configuration")
    for i, n in enumerate(names):
        ok, ref = cfgs[n]["outputs_identical"], cfgs[n].get("compared_with") == n  # a baseline is the reference
        ax1.annotate("reference" if ref else "outputs = baseline" if ok else "OUTPUTS DIFFER",
                     (i, max(p90[i], p50[i])), ha="center", va="bottom", fontsize=8,
                     color="gray" if ref else "green" if ok else "red")
    ax1.legend()
    for n in names:
        ax2.plot(cfgs[n]["ttft_s"], marker="o", ms=3, label=n)
    ax2.set_yscale("log")
    ax2.set_xlabel("request (trace order)")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_title("per request")
    ax2.legend(fontsize=8)
    tiers = list(dict.fromkeys(t for n in names for t in (cfgs[n].get("hit_rate_by_tier") or {"engine": 0})))
    bottom = np.zeros(len(names))
    for t in tiers:
        v = np.array([(cfgs[n].get("hit_rate_by_tier") or {"engine": cfgs[n]["hit_rate"]}).get(t, 0.0) for n in names])
        ax3.bar(x, v * 100, 0.6, bottom=bottom * 100, label=t)
        bottom += v
    ax3.set_xticks(x, names, rotation=15)
    ax3.set_ylabel("% of prompt tokens not computed")
    ax3.set_title("hit rate by tier")
    ax3.legend(fontsize=8)
    kinds = list(dict.fromkeys(k for n in names for k in (cfgs[n].get("bytes_on_disk") or {})))
    w = 0.8 / max(1, len(kinds))
    for j, k in enumerate(kinds):
        mb = [((cfgs[n].get("bytes_on_disk") or {}).get(k) or 0) / 1e6 for n in names]
        ax4.bar(x - 0.4 + w * (j + 0.5), mb, w, label=k)
    for i, n in enumerate(names):
        b = cfgs[n].get("bound_bytes") or {}
        if cfgs[n].get("bytes_on_disk"):
            ax4.annotate("bounded" if b else "no bound", (i, 0), ha="center", va="bottom", fontsize=8)
    ax4.set_xticks(x, names, rotation=15)
    ax4.set_ylabel("MB on disk at the end")
    ax4.set_title("tiers' bytes on disk (G3 bounded by capacity_gb; vLLM fs: no bound)")
    if kinds:
        ax4.legend(fontsize=8)
    m = result.get("model", {})
    fig.suptitle(f"kvbm-backend demo: {result.get('engine', '')}, TTFT at {result.get('ttft_measured_at', 'engine')}, "
                 f"{m.get('num_hidden_layers')} layers, "
                 f"hidden {m.get('hidden_size')}, {result['scaling']['conversations']} conversations / "
                 f"{len(p50) and len(cfgs[names[0]]['ttft_s'])} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def demo_requests(trace: str | None = None, requests: int = 24, workdir: str | None = None, g4: str | None = None,
                  engine: str = "dynamo", block_tokens: int = 64, turns_per_conv: int = 3,
                  max_tokens_per_request: int = 3072, model=None) -> tuple[Path, list[list[int]], dict]:
    """:func:`run_demo`'s checks and request selection, before anything starts (the CLI calls it first).
    Returns ``(trace path, prompts as token ids, scaling info)``. Raises ValueError naming the option: a
    missing/malformed trace or one with fewer than ``requests`` usable requests, a bad ``--g4`` URL or
    ``--engine``, ``requests`` < 2, or a ``workdir`` holding an earlier run's tiers (:func:`check_workdir`)."""
    model = model or DEMO
    trace_path = Path(trace) if trace else default_trace()
    if not trace_path.is_file():
        raise ValueError(f"--trace: no file {trace_path} (default is ../shared/data/mooncake_synthetic_trace.jsonl "
                         "relative to the repo root)")
    if g4 is not None:
        from kvbm_backend.store_url import url_problem
        why = url_problem(g4) or (None if g4.startswith(("s3:", "file:")) else "expected s3://BUCKET/PREFIX or "
                                  "file:///path")
        if why:
            raise ValueError(f"--g4: {why} (got {g4!r})")
    if requests < 2:
        raise ValueError(f"--requests: need at least 2, got {requests}")
    if engine not in ("dynamo", "direct"):
        raise ValueError(f"--engine: expected 'dynamo' or 'direct', got {engine!r}")
    check_workdir(workdir)
    prompts, scaling = select_requests(trace_path, requests, turns_per_conv, block_tokens, max_tokens_per_request,
                                       min_tokens=min(256, max_tokens_per_request // 2), vocab=model.vocab_size)
    return trace_path, prompts, scaling


def run_demo(json_path: str | None = "kvbm-demo.json", plot: str | None = "kvbm-demo.png", trace: str | None = None,
             requests: int = 24, workdir: str | None = None, g4: str | None = None,
             endpoint_url: str | None = None, block_tokens: int = 64, turns_per_conv: int = 3,
             max_tokens_per_request: int = 3072, model=None, keep_workdir: bool | None = None,
             engine: str = "dynamo") -> dict:
    """Run the five configurations and write ``json_path`` and ``plot``. Returns the result dict:
    ``{"configs": {"baseline"|"kvbm_backend"|"restart"|"vllm_fs"|"native_tiers" (+ "baseline_direct" under
    Dynamo): {"ttft_p50_s", "ttft_p90_s", "hit_rate", "hit_rate_by_tier", "outputs_identical",
    "compared_with", "serving", "bytes_on_disk", "bound_bytes", ...}}, "storage_vs_recompute_p50":
    {"in_process": {...}, "dynamo": {...}}, "cpu_budget_env": {...}, "scaling": {...}, "serving":
    "dynamo"|"direct", "ok": every config's outputs equal its baseline's, ...}``.

    ``engine``: ``"dynamo"`` (Dynamo frontend + workers, TTFT at the HTTP client) or ``"direct"`` (in-process
    vLLM engines). Raises ValueError as :func:`demo_requests` does, before any engine starts."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .phases import Phases
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    phases = Phases(lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True))  # above the bars
    model = model or DEMO
    trace_path, prompts, scaling = demo_requests(trace, requests, workdir, g4, engine, block_tokens, turns_per_conv,
                                                 max_tokens_per_request, model)
    own_tmp = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix="kvbm-demo-"))
    remove = own_tmp and not keep_workdir  # the demo's own temp dir goes, whatever happens
    try:
        wd.mkdir(parents=True, exist_ok=True)
        model_dir = write_model_dir(wd / "model", model)
        max_len = max(len(p) for p in prompts) + 8
        num_blocks = math.ceil(max_len / BLOCK_SIZE) + 4  # about one request: earlier turns leave the engine
        # A user's --g4 store gets this run's own sub-prefix: an earlier run's blocks there (same model, same
        # prompts) would turn the cold configs into hits and the ratios into nonsense.
        g4_url = f"{g4.rstrip('/')}/kvbm-demo-{uuid.uuid4().hex[:12]}" if g4 else f"file://{wd / 'g4'}"
        console.print(f"[bold]kvbm-backend demo[/bold]: {len(prompts)} requests from {scaling['conversations']} "
                      f"conversations of {trace_path}")
        console.print(f"  scaling: 1 trace block (512 tokens) -> {block_tokens} tokens (x{scaling['length_scale']:.3f}), "
                      f"capped at {max_tokens_per_request}; mean input {scaling['trace_input_tokens_mean']:.0f} -> "
                      f"{scaling['demo_input_tokens_mean']:.0f} tokens")
        console.print(f"  model: Llama {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
                      f"{model.num_key_value_heads} KV heads x {model.head_dim}, random weights, {DTYPE}; engine KV budget "
                      f"{num_blocks} blocks x {BLOCK_SIZE} tokens ({num_blocks * BLOCK_SIZE} tokens)")
        console.print(f"  G3: {wd}/g3-*   G4: {g4_url}   workdir: {wd}")

        g3_gb = 2.0
        # the keyring in a 0700 directory of its own: a --workdir made group-writable (umask 002) is refused as the
        # keyring's directory (another user could plant a keyring there: fsmodes.open_trusted)
        makedirs_private(wd / "g4-keyring")
        keyring = str(wd / "g4-keyring" / "g4-keyring.json")
        budget = cpu_budget_env()
        # CPU primary tier of the native configs: about two engine KV budgets (float32 KV: 2x the bf16 bytes)
        cpu_bytes = 2 * num_blocks * BLOCK_SIZE * model.kv_bytes_per_token * (2 if DTYPE == "float32" else 1)

        def extra(g3_dir: str) -> dict:
            return connector_extra(g3_dir, wd, model, g3_capacity_gb=g3_gb, g4_url=g4_url, keyring=keyring,
                                   endpoint_url=endpoint_url)

        base_spec: dict[str, Any] = {"model_dir": str(model_dir), "prompts": prompts, "max_tokens": 4, "block_size": BLOCK_SIZE,
                     "num_gpu_blocks": num_blocks, "max_model_len": max_len, "dtype": DTYPE}
        native = [(n, dict(base_spec, native=native_extra(n, wd, model, cpu_bytes=cpu_bytes, g3_capacity_gb=g3_gb,
                                                          g4_url=g4_url, keyring=keyring, endpoint_url=endpoint_url)))
                  for n in NATIVE_CONFIGS]
        direct = [("baseline", dict(base_spec, connector=None)),
                  ("kvbm_backend", dict(base_spec, connector={"extra": extra("g3-run")})),
                  ("restart", dict(base_spec, connector={"extra": extra("g3-restart")}))]
        # Under Dynamo the native configs are in-process engines (no Dynamo script for them here), compared with
        # an in-process baseline of their own: ``baseline_direct``.
        inproc = direct + native if engine == "direct" else [("baseline_direct", direct[0][1])] + native
        order = [n for n, _ in direct] + [n for n, _ in inproc if n not in dict(direct)]
        results: dict[str, dict] = {}
        serving: dict = {}
        t_all = time.monotonic()
        console.print(f"  serving: {engine}" + (" (Dynamo frontend + 3 dynamo.vllm workers from examples/dynamo/, "
                                                "TTFT at the streaming HTTP client; workers start side by side, "
                                                "1-3 min on 2 cores; then the in-process engines)"
                                                if engine == "dynamo" else
                                                " (in-process vLLM engines, TTFT = vLLM first_token_latency)"))
        console.print(f"  CPU budget, every engine: {' '.join(f'{k}={v}' for k, v in budget.items())}; "
                      f"native configs: CPU tier {cpu_bytes / 2**20:.0f} MiB, {BLOCKS_PER_CHUNK * BLOCK_SIZE}-token chunks")
        with Progress(TextColumn("{task.description:<15}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            tasks = {name: progress.add_task(name, total=len(prompts), start=False) for name in order}
            if engine == "dynamo":
                from .demo_dynamo import run_dynamo
                results, serving = run_dynamo(prompts, model_dir, wd, lambda g3: extra(g3)["kvbm_backend"],
                                              block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=max_len,
                                              dtype=DTYPE, max_tokens=base_spec["max_tokens"], progress=progress,
                                              tasks=tasks, phases=phases, env=budget)
            results.update(_run_engines(inproc, wd, budget, progress, tasks, phases))
        from kvbm_backend.integrations.vllm.engine_run import vllm_version as _vllm_version
        vllm_version = _vllm_version()
        engine_s = (f"Dynamo {serving.get('dynamo', '?')} + vLLM {vllm_version} (CPU)" if engine == "dynamo"
                    else f"vLLM {vllm_version} (CPU), in-process")
        # each config's outputs against the baseline of its own serving (Dynamo: text; in-process: token ids)
        ref = {n: ("baseline" if engine == "direct" or n in dict(direct) else "baseline_direct") for n in order}
        configs = {}
        for n in order:
            c = _summary(results[n], None if ref[n] == n else results[ref[n]], BLOCK_SIZE)
            c["serving"] = engine if n in dict(direct) and engine == "dynamo" else "direct"
            c["compared_with"] = ref[n]
            dirs = tier_dirs(n, wd, g4_url)
            c["bytes_on_disk"] = {k: disk_bytes(v) for k, v in dirs.items()}
            c["bound_bytes"] = {k: int(g3_gb * 1e9) for k in dirs if k == "G3"}  # G4: the store's; fs: none
            used = ((c.get("pool_stats") or {}).get("g3") or {}).get("used_bytes")
            used = (c.get("tier_counters") or {}).get("G3", {}).get("used_bytes", used)
            if used is not None:  # G3 grows its slab files in ~64 MiB steps: allocated > used
                c["bytes_used"] = {"G3": int(used)}
            configs[n] = c
        for n, c in configs.items():
            if n != ref[n]:
                b = configs[ref[n]]["ttft_p50_s"]
                c["ttft_p50_speedup_vs_baseline"] = b / c["ttft_p50_s"] if c["ttft_p50_s"] > 0 else None
        ratios = {"in_process": {n: c["ttft_p50_speedup_vs_baseline"] for n, c in configs.items()
                                 if c["serving"] == "direct" and "ttft_p50_speedup_vs_baseline" in c}}
        if engine == "dynamo":
            ratios["dynamo"] = {n: configs[n]["ttft_p50_speedup_vs_baseline"] for n in ("kvbm_backend", "restart")}
        out = {"configs": configs, "serving": engine, "dynamo": serving or None, "cpu_budget_env": budget,
               "storage_vs_recompute_p50": ratios,
               "ttft_measured_at": "HTTP client (streaming)" if engine == "dynamo" else "engine (vLLM first_token_latency)",
               "scaling": scaling, "engine": engine_s,
               "model": dict(model.hf_config(), torch_dtype=DTYPE),  # the dtype the engines ran, not the file's
               "block_size_tokens": BLOCK_SIZE, "engine_kv_blocks": num_blocks, "g4_url": g4_url,
               "native_cpu_tier_bytes": cpu_bytes, "g3_capacity_bytes": int(g3_gb * 1e9),
               "workdir": str(wd), "wall_s": time.monotonic() - t_all}

        table = Table(title=f"kvbm-backend demo: {engine_s}, TTFT at {out['ttft_measured_at']}")
        for col in ("config", "serving", "TTFT p50 s", "TTFT p90 s", "hit rate", "by tier", "MB on disk (bound)",
                    "outputs = baseline"):
            table.add_column(col)
        for name, c in configs.items():
            tiers = c.get("hit_rate_by_tier")
            tier_s = "-" if tiers is None else " ".join(f"{k} {v:.0%}" for k, v in tiers.items())
            used = c.get("bytes_used") or {}
            disk = " ".join(f"{k} {'remote' if v is None else f'{v / 1e6:.1f}'}"
                            + (f" ({used[k] / 1e6:.1f} used, <= {c['bound_bytes'][k] / 1e6:.0f})" if k in c["bound_bytes"]
                               and k in used else f" (<= {c['bound_bytes'][k] / 1e6:.0f})" if k in c["bound_bytes"] else
                               " (no bound)" if k == "fs" else "")
                            for k, v in c["bytes_on_disk"].items()) or "-"
            same = "[green]yes[/green]" if c["outputs_identical"] else "[red]NO[/red]"
            table.add_row(name, c["serving"], f"{c['ttft_p50_s']:.3f}", f"{c['ttft_p90_s']:.3f}", f"{c['hit_rate']:.0%}",
                          tier_s, disk, same if ref[name] != name else "(reference)")
        console.print(table)
        differ = [n for n, c in configs.items() if not c["outputs_identical"]]
        out["ok"] = not differ  # the CLI exits 1 when not
        for where, label in (("in_process", "in-process engines"), ("dynamo", "under Dynamo")):
            if ratios.get(where):
                console.print(f"storage vs recompute, TTFT p50 against the baseline, {label}: "
                              + ", ".join(f"{n} {vs_baseline(r)}" for n, r in ratios[where].items() if r))
        console.print("all greedy outputs identical to their baseline" if not differ else
                      f"[red]OUTPUTS DIFFER from baseline: {', '.join(differ)}[/red]")
        out["workdir_kept"] = not remove
        if g4:
            ep = f" --endpoint-url {endpoint_url}" if endpoint_url else ""
            console.print(f"G4 blocks of this run stay under {g4_url} and {native_g4_url(g4_url)}; remove them: "
                          + " && ".join(f"kvbm-backend gc --url {u} --max-age-s 0{ep}"
                                        for u in (g4_url, native_g4_url(g4_url))),
                          highlight=False, markup=False, soft_wrap=True)
        if json_path:
            text = json.dumps(out, indent=2, sort_keys=True)
            write_whole(json_path, lambda p: Path(p).write_text(text))
            console.print(f"wrote {json_path}")
        if plot:
            write_whole(plot, lambda p: plot_demo(out, p))
            console.print(f"wrote {plot}")
        if remove:
            out["workdir"] = None
        return out
    finally:  # a failure or Ctrl-C too: no temp dir of tier files left behind unless asked
        if remove:
            shutil.rmtree(wd, ignore_errors=True)
        else:
            console.print(f"workdir kept: {wd}", highlight=False, markup=False, soft_wrap=True)
