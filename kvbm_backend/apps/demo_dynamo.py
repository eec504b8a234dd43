"""``kvbm-backend demo --engine dynamo`` (the default): the demo's three configurations served by NVIDIA Dynamo.

One Dynamo frontend (``examples/dynamo/frontend.sh``) and three ``dynamo.vllm`` workers on this host, started
side by side from the example scripts (:mod:`kvbm_backend.integrations.dynamo.stack`), each under its own
served model name:

* ``baseline``: ``examples/dynamo/agg.sh`` (the engine's own prefix cache only);
* ``kvbm_backend``: ``examples/dynamo/agg_kvbm_backend.sh`` with G3 in ``<workdir>/g3-run`` and the demo's G4;
* ``restart``: ``agg_kvbm_backend.sh`` with an empty G3 (``<workdir>/g3-restart``) and the same G4, asked only
  after the ``kvbm_backend`` worker has written its G4 blocks and stopped (the returning user after a restart,
  or a second worker of the fleet).

A real OpenAI client sends the prompts as token ids, one at a time, streaming at temperature 0; TTFT is
measured at the client (request sent -> first streamed token, HTTP + tokenizer-free routing + engine), and
``cached_tokens`` is the usage block's count of prompt tokens the engine did not compute. Connector counters
come from each worker's ``KVBM_BACKEND_STATS_PATH`` file, minus their values after a warm-up request.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

WARMUP_PROMPT = list(range(1, 41))  # 40 token ids: one block, shares no block with trace prompts
CONFIGS = ("baseline", "kvbm_backend", "restart")


def _settled(worker, key: str, quiet_s: float = 2.0, timeout_s: float = 120.0) -> dict:
    """Counters once ``key`` has not moved for ``quiet_s`` (the worker's write-behind has drained)."""
    t0 = last_t = time.monotonic()
    last = worker.counters().get(key, 0)
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.25)
        now = worker.counters().get(key, 0)
        if now != last:
            last, last_t = now, time.monotonic()
        elif time.monotonic() - last_t >= quiet_s:
            break
    return worker.counters()


def _delta(after: dict, before: dict) -> dict:
    """Numeric counters of ``after`` minus ``before`` (the warm-up request's share removed)."""
    return {k: (v - before.get(k, 0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in after.items() if k not in ("info", "pools")}


def run_dynamo(prompts: list[list[int]], model_dir: Path, wd: Path, kvbm_config, *, block_size: int,
               num_blocks: int, max_model_len: int, dtype: str, max_tokens: int = 4, progress=None,
               tasks: dict | None = None, ready_timeout_s: float = 600.0, phases=None,
               env: dict | None = None) -> tuple[dict, dict]:
    """Serve ``prompts`` through Dynamo in each configuration of :data:`CONFIGS`.

    ``kvbm_config(g3_dir: str) -> dict`` gives the ``kvbm_backend`` config of a worker whose G3 is
    ``<wd>/<g3_dir>`` (written to ``<wd>/<g3_dir>.yaml``, passed as ``KVBM_BACKEND_CONFIG_FILE``; G3 also as
    ``DYN_KVBM_DISK_CACHE_DIR``). ``num_blocks``: the engine KV budget (vLLM ``--num-gpu-blocks-override``).
    Returns ``(results, info)``: per configuration the fields of
    :mod:`kvbm_backend.integrations.vllm.engine_run`'s result
    (``outputs`` are the completion texts, ``ttft_s`` at the client, ``init_s`` the worker's start-up) and
    ``info`` (versions, worker start-up seconds, ports and log paths). Raises RuntimeError naming the log of
    a process that fails. ``phases``: a :class:`kvbm_backend.apps.phases.Phases` that gets a line when the
    workers start, every 15 s while they are starting, and when they are ready (default: lines on stderr).
    ``env``: added to every process of the stack (the demo's CPU budget:
    :func:`kvbm_backend.apps.demo_native.cpu_budget_env`).
    """
    from .phases import Phases
    phases = phases or Phases()
    tasks = tasks if tasks is not None else {}  # progress task per configuration, with ``progress``
    from kvbm_backend.integrations.dynamo.stack import DynamoStack, stream_completion

    engine_args = ["--dtype", dtype, "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                   "--num-gpu-blocks-override", str(num_blocks), "--enforce-eager", "--seed", "0"]
    results: dict[str, dict] = {}
    info: dict = {"frontend_log": None, "workers": {}}
    with DynamoStack(wd / "dynamo", env={"VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}) as st:
        info["frontend_log"] = str(st.frontend.log)
        with phases.phase(f"starting the Dynamo frontend and {len(CONFIGS)} dynamo.vllm workers") as still:
            for name in CONFIGS:
                env = {}
                script = "agg.sh"
                if name != "baseline":
                    g3 = "g3-run" if name == "kvbm_backend" else "g3-restart"
                    cfg = kvbm_config(g3)
                    cfg_path = wd / f"{g3}.yaml"
                    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
                    env = {"KVBM_BACKEND_CONFIG_FILE": str(cfg_path), "DYN_KVBM_DISK_CACHE_DIR": str(wd / g3),
                           "DYN_KVBM_DISK_CACHE_GB": str(cfg["g3"]["capacity_gb"])}
                    script = "agg_kvbm_backend.sh"
                st.start_worker(name, script, model_dir, engine_args, env=env, stats=name != "baseline",
                                served_name=f"demo-{name}")
            took = st.wait_ready(timeout_s=ready_timeout_s, report=phases.heartbeat(still))
            for name in CONFIGS:
                t0 = time.monotonic()
                while not st.model_listed(f"demo-{name}"):
                    if time.monotonic() - t0 > 60:
                        raise RuntimeError(f"the Dynamo frontend does not list demo-{name}:\n{st.frontend.tail()}")
                    time.sleep(0.3)
        phases.say("workers ready: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))
        for name in CONFIGS:
            w = st.workers[name]
            if progress is not None:
                progress.start_task(tasks[name])
            stream_completion(st.base, f"demo-{name}", WARMUP_PROMPT, max_tokens=max_tokens)  # not timed
            before = _settled(w, "save_blocks", quiet_s=1.0, timeout_s=30) if w.stats else {}
            rows = []
            for i, p in enumerate(prompts):
                rows.append(stream_completion(st.base, f"demo-{name}", p, max_tokens=max_tokens))
                if progress is not None:
                    progress.update(tasks[name], completed=i + 1)
            res = {"outputs": [r["text"] for r in rows], "ttft_s": [r["ttft_s"] for r in rows],
                   "e2e_s": [r["e2e_s"] for r in rows], "prompt_tokens": [r["prompt_tokens"] for r in rows],
                   "cached_tokens": [r["cached_tokens"] for r in rows], "init_s": took[name]}
            if w.stats is not None:
                after = _settled(w, "g4_put_written_blocks")
                res["connector_stats"] = _delta(after, before)
                res["connector_info"] = after.get("info")
                res["pool_stats"] = after.get("pools")
            results[name] = res
            info["workers"][name] = {"start_s": took[name], "log": str(w.proc.log),
                                     "script": "agg.sh" if name == "baseline" else "agg_kvbm_backend.sh"}
            if name == "kvbm_backend":  # its G4 blocks are written (settled above); the restart worker reads them
                st.stop_worker(name)
    try:
        from importlib.metadata import version
        info["dynamo"] = version("ai-dynamo")
    except Exception:  # noqa: BLE001
        info["dynamo"] = "unknown"
    return results, info
