"""Why a Dynamo worker's prefill is slower than the in-process engine's (issue 21 item 4): an interleaved A/B.

Three engines of the demo's model, alive at once, asked in turn (round robin, one request in flight at a
time, so load drift on a shared machine hits each alike):

* ``inproc``: the in-process engine (``engine_run``, as ``kvbm-backend demo --engine direct``), stepping one
  prompt per ``resume`` file;
* ``dynamo_default``: a Dynamo worker (``examples/dynamo/agg.sh``) with vLLM's default CPU settings;
* ``dynamo_budget``: the same with the demo's CPU budget
  (:func:`kvbm_backend.apps.demo_native.cpu_budget_env`);
* ``dynamo_nobind`` (``--arms``): the budget plus ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM does not pin the
  OpenMP threads, as in the in-process engine).

Every prompt is distinct (no prefix hits): each request is a full prefill. Per request: TTFT (in-process:
vLLM's ``first_token_latency``; Dynamo: at the HTTP client) and the CPU seconds the engine's processes used
(``/proc`` utime + stime of its process group, so time lost to waiting or to other processes is not in
it). Usage::

    PYTHONPATH=$PWD python benchmarks/cpu_budget_ab.py --trace ../shared/data/mooncake_synthetic_trace.jsonl \\
        --rounds 5 --out /tmp/ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvbm_backend.apps.demo import BLOCK_SIZE, DTYPE, select_requests  # noqa: E402
from kvbm_backend.apps.demo_native import cpu_budget_env  # noqa: E402
from kvbm_backend.apps.engine_model import DEMO, write_model_dir  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """utime + stime (seconds) of the live processes in process group ``pgid``."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[2]) == pgid:  # fields after the command: state ppid pgrp ... utime(12) stime(13)
            total += int(f[11]) + int(f[12])
    return total / TICK


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--arms", default="dynamo_default,dynamo_budget",
                    help="Dynamo workers to compare with the in-process engine: dynamo_default, dynamo_budget, "
                         "dynamo_nobind")
    a = ap.parse_args()
    wd = Path(tempfile.mkdtemp(prefix="kvbm-ab-"))
    model_dir = write_model_dir(wd / "model", DEMO)
    ps, _ = select_requests(a.trace, 24)
    ps = sorted(ps, key=len, reverse=True)[:a.rounds]
    ps = [[(7 * i + 3) % DEMO.vocab_size] + p[1:] for i, p in enumerate(ps)]  # distinct first block: no hits
    max_len = max(len(p) for p in ps) + 8
    nblocks = -(-max_len // BLOCK_SIZE) + 4
    budget = cpu_budget_env()
    # in-process engine: one pause per prompt, so it computes only when asked
    spec = {"model_dir": str(model_dir), "prompts": ps, "max_tokens": 4, "block_size": BLOCK_SIZE,
            "num_gpu_blocks": nblocks, "max_model_len": max_len, "dtype": DTYPE, "out": str(wd / "inproc.json"),
            "pause_before": list(range(len(ps))), "pause_dir": str(wd / "pause"), "pause_max_s": 3600}
    (wd / "pause").mkdir()
    (wd / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(REPO), **budget)
    log = open(wd / "inproc.log", "w")
    inproc = subprocess.Popen([sys.executable, "-m", "kvbm_backend.integrations.vllm.engine_run",
                               str(wd / "spec.json")], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    from kvbm_backend.integrations.dynamo.stack import DynamoStack, stream_completion
    args = ["--dtype", DTYPE, "--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_len),
            "--num-gpu-blocks-override", str(nblocks), "--enforce-eager", "--seed", "0"]
    arms_env = {"dynamo_default": {}, "dynamo_budget": budget,
                "dynamo_nobind": dict(budget, VLLM_CPU_OMP_THREADS_BIND="nobind")}
    arms = [x for x in a.arms.split(",") if x]
    if not arms or any(x not in arms_env for x in arms):
        raise SystemExit(f"--arms: expected names from {sorted(arms_env)}, got {a.arms!r}")
    models = {x: f"ab-{x.split('_')[1]}" for x in arms}
    rows: dict[str, list] = {"inproc": [], **{x: [] for x in arms}}
    env_free = {k: v for k, v in os.environ.items() if k not in budget}
    os.environ.clear()
    os.environ.update(env_free)  # the stack copies this environment: the default worker gets vLLM's defaults
    try:
        with DynamoStack(wd / "dynamo", env={"VLLM_LOGGING_LEVEL": "INFO"}) as st:
            for x in arms:
                st.start_worker(x, "agg.sh", model_dir, args, env=arms_env[x], stats=False, served_name=models[x])
            st.wait_ready(timeout_s=900)
            while not all(st.model_listed(m) for m in models.values()):
                time.sleep(0.5)
            while not (wd / "pause" / "paused-0").exists():
                if inproc.poll() is not None:
                    raise RuntimeError((wd / "inproc.log").read_text()[-3000:])
                time.sleep(0.3)
            for model in models.values():
                stream_completion(st.base, model, list(range(1, 41)), max_tokens=1)  # warm-up, not timed
            for i, p in enumerate(ps):
                for name, model in models.items():
                    pg = st.workers[name].proc.p.pid
                    c0 = group_cpu_s(pg)
                    r = stream_completion(st.base, model, p, max_tokens=4, timeout_s=600)
                    time.sleep(1.5)  # the worker's shm reader spins ~1 s after its last read: count it
                    rows[name].append({"ttft_s": r["ttft_s"], "cpu_s": group_cpu_s(pg) - c0,
                                       "load1": os.getloadavg()[0]})
                c0 = group_cpu_s(inproc.pid)
                (wd / "pause" / f"resume-{i}").write_text("")
                nxt = wd / "pause" / (f"paused-{i + 1}" if i + 1 < len(ps) else "none")
                while inproc.poll() is None and not nxt.exists():
                    time.sleep(0.1)
                time.sleep(1.5)
                rows["inproc"].append({"cpu_s": group_cpu_s(inproc.pid) - c0, "load1": os.getloadavg()[0]})
                print(i, {k: v[-1] for k, v in rows.items()}, flush=True)
            info = {n: st.workers[n].proc.log.read_text(errors="replace") for n in arms}
    finally:
        os.environ.update(budget)
    inproc.wait(600)
    res = json.loads((wd / "inproc.json").read_text())
    for row, t in zip(rows["inproc"], res["ttft_s"]):
        row["ttft_s"] = t
    binding = {n: [ln.split("]", 1)[-1].strip() for ln in log_.splitlines()
                   if "core ids=" in ln or "reserve_cpu_num=" in ln or "Torch threads" in ln]
               for n, log_ in info.items()}
    summary = {n: {"ttft_median_s": float(np.median([r["ttft_s"] for r in v])),
                   "cpu_median_s": float(np.median([r["cpu_s"] for r in v])), "requests": v}
               for n, v in rows.items()}
    out = {"prompt_tokens": [len(p) for p in ps], "cpu_budget_env": budget, "omp_binding_log": binding,
           "engines": summary}
    print(json.dumps({n: {k: round(v, 2) for k, v in s.items() if k != "requests"} for n, s in summary.items()}))
    print(json.dumps(binding, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
