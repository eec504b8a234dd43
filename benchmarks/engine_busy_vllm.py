"""A G3 hit loaded while the real vLLM CPU engine decodes another request: the connector's load latency and
the engine's step times, with ``load_gil_switch_ms`` off (CPython's 5 ms) and on (its default, 0.5 ms).

The public path: ``vllm.LLM`` with ``KvbmBackendConnector`` (``--kv-transfer-config`` as a Dynamo worker
passes it), the engine's own step loop (``LLMEngine.step``) driven here. Per engine process:

1. prompt A (``--hit-tokens``) is computed once and offloaded to G3; the engine's prefix cache is reset;
2. ``--decoders`` requests B (other prompts, ``--decode-tokens`` tokens each, ignore EOS) start and decode;
3. a few steps later A arrives again: its prefix is a G3 hit, loaded asynchronously by the connector while the
   engine keeps stepping B. ``hit_s`` is A's arrival to A's first token; the connector's ``load_wall_s``
   (stats) is the load itself; ``step_ms_*`` are B's decode steps while A loaded vs before.

Each setting runs in its own engine process, alternated ``--rounds`` times. Writes ``engine_busy_vllm.json``
into ``--out`` and prints a line per run::

    python benchmarks/engine_busy_vllm.py --out DIR [--model demo|tiny] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def child(setting: str, workdir: Path, model: str, hit_tokens: int, decode_tokens: int, decoders: int,
          io_threads: int) -> dict:
    """One engine process: the sequence of the module doc under ``load_gil_switch_ms`` = ``setting``."""
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvbm_backend.apps.engine_model import DEMO, TINY, write_model_dir
    from kvbm_backend.integrations.vllm import stats
    mdl = DEMO if model == "demo" else TINY
    mdir = write_model_dir(workdir / "model", mdl, tokenizer=False)
    cfg = {"model": mdl.name, "load_gil_switch_ms": None if setting == "off" else float(setting),
           "g3": {"paths": [str(workdir / "g3")], "capacity_gb": 1.0, "files_per_path": 2,
                  "admission": {"policy": "all"}, "io_threads": io_threads}}
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kvbm_backend": cfg}}
    bs = 32  # the CPU attention backend takes multiples of 32
    llm = LLM(model=str(mdir), load_format="safetensors", skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              block_size=bs, max_model_len=hit_tokens + decode_tokens + 320, seed=0, gpu_memory_utilization=0.1,
              kv_transfer_config=ktc, enable_prefix_caching=True, max_num_batched_tokens=hit_tokens + 64)
    rng = np.random.default_rng(1)
    a = rng.integers(3, mdl.vocab_size, hit_tokens).tolist()
    bs_prompts = [rng.integers(3, mdl.vocab_size, 256).tolist() for _ in range(decoders)]
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=a)], one, use_tqdm=False)  # computed and offloaded to G3
    want = hit_tokens // bs - 1
    end = time.monotonic() + 120
    while stats.get("g3_put_written_blocks") < want and time.monotonic() < end:
        time.sleep(0.05)
    assert llm.reset_prefix_cache()
    eng = llm.llm_engine
    for i, b in enumerate(bs_prompts):
        eng.add_request(f"B{i}", TokensPrompt(prompt_token_ids=b),
                        SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True, detokenize=False))
    before: list[float] = []
    during: list[float] = []
    for _ in range(8):  # B prefilled and decoding
        t = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t)
    load0, ok0 = stats.get("load_wall_s"), stats.get("load_g3_blocks_ok")
    t_a = time.perf_counter()
    eng.add_request("A", TokensPrompt(prompt_token_ids=a), one)
    hit_s = None
    while hit_s is None:
        t = time.perf_counter()
        outs = eng.step()
        during.append(time.perf_counter() - t)
        for o in outs:
            if o.request_id == "A" and o.finished:
                hit_s = time.perf_counter() - t_a
        if not eng.has_unfinished_requests():
            break
    assert hit_s is not None, "request A never finished"
    while eng.has_unfinished_requests():
        eng.step()
    ms = sorted(x * 1e3 for x in during)
    return {"setting": setting, "decoders": decoders, "io_threads": io_threads, "hit_s": round(hit_s, 4), "load_wall_s": round(stats.get("load_wall_s") - load0, 4),
            "loaded_blocks": stats.get("load_g3_blocks_ok") - ok0, "steps_while_loading": len(during),
            "step_ms_before_p50": round(statistics.median(before) * 1e3, 3),
            "step_ms_during_p50": round(statistics.median(ms), 3), "step_ms_during_max": round(ms[-1], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=("demo", "tiny"), default="demo")
    ap.add_argument("--hit-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decoders", type=int, default=1, help="requests B decoding while A loads")
    ap.add_argument("--io-threads", type=int, default=8, help="g3.io_threads")
    ap.add_argument("--settings", default="off,0.5", help="load_gil_switch_ms values (off: null)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        r = child(a.child, Path(a.workdir), a.model, a.hit_tokens, a.decode_tokens, a.decoders, a.io_threads)
        Path(a.workdir, "result.json").write_text(json.dumps(r))
        return 0
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = []
    for rnd in range(a.rounds):
        for s in a.settings.split(","):
            with tempfile.TemporaryDirectory(prefix="kvbm-engine-busy-") as wd:
                p = subprocess.run([sys.executable, __file__, "--out", a.out, "--child", s, "--workdir", wd,
                                    "--model", a.model, "--hit-tokens", str(a.hit_tokens),
                                    "--decode-tokens", str(a.decode_tokens), "--decoders", str(a.decoders),
                                    "--io-threads", str(a.io_threads)], env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    print((p.stdout + p.stderr)[-4000:], file=sys.stderr)
                    return 1
                r = json.loads(Path(wd, "result.json").read_text())
            r["round"] = rnd
            runs.append(r)
            print(json.dumps(r))
    os.makedirs(a.out, exist_ok=True)
    res = {"bench": "engine_busy_vllm", "model": a.model, "decoders": a.decoders, "hit_tokens": a.hit_tokens, "decode_tokens": a.decode_tokens,
           "cpu_count": os.cpu_count(), "runs": runs}
    Path(a.out, "engine_busy_vllm.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
