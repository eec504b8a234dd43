"""``kvbm-backend demo``: the real vLLM engine on a real trace, ``baseline`` vs ``kvbm_backend`` vs ``restart``.

Two ways to serve it (``--engine``):

* ``dynamo`` (default): NVIDIA Dynamo's frontend and three ``dynamo.vllm`` workers started from
  ``examples/dynamo/`` (:mod:`kvbm_backend.apps.demo_dynamo`); a real OpenAI client streams each request, TTFT at
  the client.
* ``direct``: each configuration is a fresh in-process vLLM engine
  (:mod:`kvbm_backend.integrations.vllm.engine_run`), TTFT is
  vLLM's own ``first_token_latency``.

What runs:

* ``baseline``: the engine's own prefix cache only.
* ``kvbm_backend``: :class:`~kvbm_backend.integrations.vllm.connector.KvbmBackendConnector` with G3 (a
  local directory) and G4 (a local directory store ``file://...`` by default, or ``--g4 s3://...``).
* ``restart``: a fresh engine process with an EMPTY G3, reading the G4 written by ``kvbm_backend``
  (the returning user after a restart).

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
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from .engine_model import DEMO, write_model_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 32  # vLLM CPU attention needs a multiple of 32
DTYPE = "float32"  # see the module docstring: bfloat16 prefill over a cached prefix is not bit-equal here


def default_trace() -> Path:
    return DEFAULT_TRACE


def select_requests(trace: str | Path, n: int, turns_per_conv: int = 3, block_tokens: int = 64,
                    max_tokens_per_request: int = 3072, min_tokens: int = 256,
                    vocab: int = DEMO.vocab_size) -> tuple[list[list[int]], dict]:
    """Pick ``n`` requests: conversations (requests sharing their first hash id, at least 2 turns) in
    order of first appearance, at most ``turns_per_conv`` turns each, replayed in trace order; derive
    token ids. Returns ``(prompts, scaling_info)``.

    Raises ValueError naming the trace if it is missing, malformed, or has too few conversations.
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
        raise ValueError(f"--trace {trace}: only {len(chosen)} multi-turn requests of >= {min_tokens} scaled tokens; "
                         f"asked for {n}")
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


def _run_engine(name: str, spec: dict, workdir: Path, progress=None, task=None, env_extra: dict | None = None,
                timeout_s: float = 900) -> dict:
    spec = dict(spec)
    spec["out"] = str(workdir / f"{name}.result.json")
    pfile = workdir / f"{name}.progress"
    pfile.write_text("")
    spec["progress_file"] = str(pfile)
    spath = workdir / f"{name}.spec.json"
    spath.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if env_extra:
        env.update(env_extra)
    log = open(workdir / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_backend.integrations.vllm.engine_run", str(spath)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    t0 = time.monotonic()
    try:
        while proc.poll() is None:
            if progress is not None:
                done = len(pfile.read_text().split())
                progress.update(task, completed=done)
            if time.monotonic() - t0 > timeout_s:
                proc.kill()
                raise RuntimeError(f"demo: engine {name} ran past {timeout_s} s (log: {workdir / (name + '.log')})")
            time.sleep(0.2)
    finally:
        log.close()
    if proc.returncode != 0 or not Path(spec["out"]).is_file():
        tail = (workdir / f"{name}.log").read_text()[-4000:]
        raise RuntimeError(f"demo: engine {name} failed (rc={proc.returncode}); log {workdir / (name + '.log')}:\n{tail}")
    if progress is not None:
        progress.update(task, completed=len(spec["prompts"]))
    return json.loads(Path(spec["out"]).read_text())


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
        lb = cs.get("lookup_blocks", 0) or 1
        out["hit_rate_by_tier"] = {"engine": cs.get("local_hit_blocks", 0) / lb, "G3": cs.get("load_g3_blocks_ok", 0) / lb,
                                   "G4": cs.get("load_g4_blocks_ok", 0) / lb}
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
                                           "written", "dropped", "encrypted", "url", "paths", "engine")}
                             for k in ("g3", "g4") if k in ps}
    return out


def plot_demo(result: dict, path: str) -> None:
    """Bar chart of TTFT p50/p90 per configuration and per-request TTFT (log scale), PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["configs"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(names))
    p50 = [result["configs"][n]["ttft_p50_s"] for n in names]
    p90 = [result["configs"][n]["ttft_p90_s"] for n in names]
    ax1.bar(x - 0.2, p50, 0.4, label="p50")
    ax1.bar(x + 0.2, p90, 0.4, label="p90")
    ax1.set_xticks(x, names)
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title("TTFT per configuration")
    for i, n in enumerate(names):
        ok = result["configs"][n]["outputs_identical"]
        ax1.annotate("outputs = baseline" if ok else "OUTPUTS DIFFER", (i, max(p90[i], p50[i])), ha="center",
                     va="bottom", fontsize=8, color="green" if ok else "red")
    ax1.legend()
    for n in names:
        ax2.plot(result["configs"][n]["ttft_s"], marker="o", ms=3, label=n)
    ax2.set_yscale("log")
    ax2.set_xlabel("request (trace order)")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_title("per request")
    ax2.legend()
    m = result.get("model", {})
    fig.suptitle(f"kvbm-backend demo: {result.get('engine', '')}, TTFT at {result.get('ttft_measured_at', 'engine')}, "
                 f"{m.get('num_hidden_layers')} layers, "
                 f"hidden {m.get('hidden_size')}, {result['scaling']['conversations']} conversations / "
                 f"{len(p50) and len(result['configs'][names[0]]['ttft_s'])} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(json_path: str | None = "kvbm-demo.json", plot: str | None = "kvbm-demo.png", trace: str | None = None,
             requests: int = 24, workdir: str | None = None, g4: str | None = None,
             endpoint_url: str | None = None, block_tokens: int = 64, turns_per_conv: int = 3,
             max_tokens_per_request: int = 3072, model=None, keep_workdir: bool | None = None,
             engine: str = "dynamo") -> dict:
    """Run the three configurations and write ``json_path`` and ``plot``. Returns the result dict:
    ``{"configs": {"baseline"|"kvbm_backend"|"restart": {"ttft_p50_s", "ttft_p90_s", "hit_rate",
    "outputs_identical", ...}}, "scaling": {...}, "serving": "dynamo"|"direct", ...}``.

    ``engine``: ``"dynamo"`` (Dynamo frontend + workers, TTFT at the HTTP client) or ``"direct"`` (in-process
    vLLM engines). Raises ValueError for a missing/malformed trace, a bad ``--g4`` URL or ``--engine``.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .phases import Phases
    console = Console(stderr=True)
    phases = Phases(lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True))  # above the bars
    model = model or DEMO
    trace_path = Path(trace) if trace else default_trace()
    if not trace_path.is_file():
        raise ValueError(f"--trace: no file {trace_path} (default is ../shared/data/mooncake_synthetic_trace.jsonl "
                         "relative to the repo root)")
    if g4 is not None and not (g4.startswith("s3://") or g4.startswith("file://")):
        raise ValueError(f"--g4: expected s3://BUCKET/PREFIX or file:///path, got {g4!r}")
    if requests < 2:
        raise ValueError(f"--requests: need at least 2, got {requests}")
    if engine not in ("dynamo", "direct"):
        raise ValueError(f"--engine: expected 'dynamo' or 'direct', got {engine!r}")
    prompts, scaling = select_requests(trace_path, requests, turns_per_conv, block_tokens, max_tokens_per_request,
                                       min_tokens=min(256, max_tokens_per_request // 2), vocab=model.vocab_size)
    own_tmp = workdir is None
    wd = Path(workdir or tempfile.mkdtemp(prefix="kvbm-demo-"))
    wd.mkdir(parents=True, exist_ok=True)
    model_dir = write_model_dir(wd / "model", model)
    max_len = max(len(p) for p in prompts) + 8
    num_blocks = math.ceil(max_len / BLOCK_SIZE) + 4  # about one request: earlier turns leave the engine
    g4_url = g4 or f"file://{wd / 'g4'}"
    console.print(f"[bold]kvbm-backend demo[/bold]: {len(prompts)} requests from {scaling['conversations']} "
                  f"conversations of {trace_path}")
    console.print(f"  scaling: 1 trace block (512 tokens) -> {block_tokens} tokens (x{scaling['length_scale']:.3f}), "
                  f"capped at {max_tokens_per_request}; mean input {scaling['trace_input_tokens_mean']:.0f} -> "
                  f"{scaling['demo_input_tokens_mean']:.0f} tokens")
    console.print(f"  model: Llama {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
                  f"{model.num_key_value_heads} KV heads x {model.head_dim}, random weights, {DTYPE}; engine KV budget "
                  f"{num_blocks} blocks x {BLOCK_SIZE} tokens ({num_blocks * BLOCK_SIZE} tokens)")
    console.print(f"  G3: {wd}/g3-*   G4: {g4_url}   workdir: {wd}")

    def extra(g3_dir: str) -> dict:
        g4cfg = {"enabled": True, "url": g4_url, "encrypt": True, "keyring": {"path": str(wd / "g4-keyring.json")},
                 "timeout_s": 5.0}
        if endpoint_url:
            g4cfg["endpoint_url"] = endpoint_url
        cfg = {"model": model.name, "g3": {"paths": [str(wd / g3_dir)], "capacity_gb": 2.0, "files_per_path": 2,
                                           "admission": {"policy": "all"}},
               "g4": g4cfg}
        return {"kvbm_backend": cfg, "stats_path": str(wd / f"{g3_dir}-stats.json")}

    base_spec = {"model_dir": str(model_dir), "prompts": prompts, "max_tokens": 4, "block_size": BLOCK_SIZE,
                 "num_gpu_blocks": num_blocks, "max_model_len": max_len, "dtype": DTYPE}
    runs = [("baseline", None), ("kvbm_backend", {"extra": extra("g3-run")}),
            ("restart", {"extra": extra("g3-restart")})]
    results: dict[str, dict] = {}
    serving: dict = {}
    t_all = time.monotonic()
    console.print(f"  serving: {engine}" + (" (Dynamo frontend + 3 dynamo.vllm workers from examples/dynamo/, "
                                            "TTFT at the streaming HTTP client; workers start side by side, "
                                            "1-3 min on 2 cores)" if engine == "dynamo" else
                                            " (in-process vLLM engines, TTFT = vLLM first_token_latency)"))
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        tasks = {name: progress.add_task(name, total=len(prompts), start=False) for name, _ in runs}
        if engine == "dynamo":
            from .demo_dynamo import run_dynamo
            results, serving = run_dynamo(prompts, model_dir, wd, lambda g3: extra(g3)["kvbm_backend"],
                                          block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=max_len,
                                          dtype=DTYPE, max_tokens=base_spec["max_tokens"], progress=progress,
                                          tasks=tasks, phases=phases)
        else:
            for name, conn in runs:
                progress.start_task(tasks[name])
                with phases.phase(f"engine {name}: vLLM start-up, then {len(prompts)} requests"):
                    results[name] = _run_engine(name, dict(base_spec, connector=conn), wd, progress, tasks[name])
    base = results["baseline"]
    from kvbm_backend.integrations.vllm.engine_run import vllm_version as _vllm_version
    vllm_version = _vllm_version()
    engine_s = (f"Dynamo {serving.get('dynamo', '?')} + vLLM {vllm_version} (CPU)" if engine == "dynamo"
                else f"vLLM {vllm_version} (CPU), in-process")
    out = {"configs": {name: _summary(results[name], None if name == "baseline" else base, BLOCK_SIZE)
                       for name, _ in runs},
           "serving": engine, "dynamo": serving or None,
           "ttft_measured_at": "HTTP client (streaming)" if engine == "dynamo" else "engine (vLLM first_token_latency)",
           "scaling": scaling, "model": model.hf_config(), "engine": engine_s,
           "block_size_tokens": BLOCK_SIZE, "engine_kv_blocks": num_blocks, "g4_url": g4_url,
           "workdir": str(wd), "wall_s": time.monotonic() - t_all}
    bp50 = out["configs"]["baseline"]["ttft_p50_s"]
    for name in ("kvbm_backend", "restart"):
        c = out["configs"][name]
        c["ttft_p50_speedup_vs_baseline"] = bp50 / c["ttft_p50_s"] if c["ttft_p50_s"] > 0 else None

    table = Table(title=f"kvbm-backend demo: {engine_s}, TTFT at {out['ttft_measured_at']}")
    for col in ("config", "TTFT p50 s", "TTFT p90 s", "hit rate", "engine / G3 / G4 hits", "loaded MB",
                "outputs = baseline"):
        table.add_column(col)
    for name in out["configs"]:
        c = out["configs"][name]
        tiers = c.get("hit_rate_by_tier")
        tier_s = "-" if tiers is None else f"{tiers['engine']:.0%} / {tiers['G3']:.0%} / {tiers['G4']:.0%}"
        loaded = c.get("bytes_moved", {}).get("loaded")
        table.add_row(name, f"{c['ttft_p50_s']:.3f}", f"{c['ttft_p90_s']:.3f}", f"{c['hit_rate']:.0%}", tier_s,
                      "-" if loaded is None else f"{loaded / 1e6:.1f}",
                      "[green]yes[/green]" if c["outputs_identical"] else "[red]NO[/red]")
    console.print(table)
    same = all(c["outputs_identical"] for c in out["configs"].values())
    console.print(f"TTFT p50: kvbm_backend {out['configs']['kvbm_backend']['ttft_p50_speedup_vs_baseline']:.1f}x "
                  f"below baseline, restart {out['configs']['restart']['ttft_p50_speedup_vs_baseline']:.1f}x; "
                  + ("all greedy outputs identical to baseline" if same else "[red]OUTPUTS DIFFER from baseline[/red]"))
    remove = own_tmp and not keep_workdir
    out["workdir_kept"] = not remove
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2, sort_keys=True))
        console.print(f"wrote {json_path}")
    if plot:
        plot_demo(out, plot)
        console.print(f"wrote {plot}")
    if remove:
        import shutil
        shutil.rmtree(wd, ignore_errors=True)
        out["workdir"] = None
    return out
