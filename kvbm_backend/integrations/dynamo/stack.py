"""A Dynamo 1.6.1 deployment on one host, started from the scripts in ``examples/dynamo/``: one frontend
(``frontend.sh``, OpenAI HTTP; more with :meth:`DynamoStack.add_frontend`, e.g. routers with other weights) and
workers (``agg.sh``, ``agg_kvbm_backend.sh``, ``agg_native_tiers.sh``, ``disagg_*.sh``), with file discovery, the TCP request plane and the ZMQ event plane (no etcd, no NATS), every listener on 127.0.0.1.

Used by ``kvbm-backend demo`` (its default ``--engine dynamo``) and by the Dynamo end-to-end tests, so the
example scripts are the ones that run and cannot rot. Nothing here imports Dynamo: processes are started
with the running interpreter, and :func:`clear_kv_blocks` talks to Dynamo's runtime in a subprocess.

Clients: :func:`stream_completion` streams one OpenAI completion (token ids or text) at temperature 0 and
measures TTFT at the client (request sent -> first streamed token, seconds).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = REPO_ROOT / "examples" / "dynamo"
RUNTIME_ARGS = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
READY_TIMEOUT_S = 300.0


def free_port(low: int = 20000, high: int = 32767) -> int:
    """A free loopback TCP port in ``[low, high]``. Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an i16, hence the
    32767 ceiling. Raises RuntimeError after 200 tries."""
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def loopback_env(discovery_dir: str | Path, overrides: dict | None = None) -> dict:
    """Environment for Dynamo processes on one host: this process's environment plus ``overrides``, file
    discovery in ``discovery_dir`` (``DYN_FILE_KV``), every Dynamo/vLLM listener on 127.0.0.1, this
    interpreter as ``PYTHON`` for the example scripts and the repo on ``PYTHONPATH``. Dynamo's shutdown grace
    period (``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS``, 5 s by default in ``dynamo.common.utils.graceful_shutdown``:
    in-flight requests drain after the worker leaves discovery) is 0 unless the caller sets it: a loopback stack
    stops a worker only when nothing is in flight, so the 5 s were a wait per stopped worker."""
    e = {**os.environ, **(overrides or {})}
    bindir = str(Path(sys.executable).parent)
    e.update({"PYTHON": sys.executable, "PATH": bindir + os.pathsep + e.get("PATH", ""),
              "PYTHONPATH": str(REPO_ROOT) + os.pathsep + e.get("PYTHONPATH", ""),
              "DYN_FILE_KV": str(discovery_dir), "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
              "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": e.get("VLLM_CPU_KVCACHE_SPACE", "1"),
              "VLLM_LOGGING_LEVEL": e.get("VLLM_LOGGING_LEVEL", "INFO"), "DYN_LOG": e.get("DYN_LOG", "warn"),
              "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": e.get("DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS", "0")})
    return e


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    """``(status, body)``; ``(0, error text)`` when nothing answers (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except Exception as e:  # noqa: BLE001 - not up yet
        return 0, str(e)


class Proc:
    """A command run in its own process group, output to ``log``; :meth:`stop` ends it and every process it
    spawned (vLLM's engine core, NIXL helpers)."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.log = name, Path(log)
        self._fh = open(self.log, "wb")
        self.p = subprocess.Popen(argv, env=env, stdout=self._fh, stderr=subprocess.STDOUT, cwd=str(self.log.parent),
                                  start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM to the group, without waiting (:meth:`stop` waits): several processes shut down at once."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM to the group (Dynamo and the connector shut down and flush), SIGKILL after ``grace_s``."""
        if self.p.poll() is None:
            self.terminate()
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


class Worker:
    """One ``dynamo.vllm`` worker started from an example script. ``stats`` is the connector's counters file
    (``KVBM_BACKEND_STATS_PATH``; none for a worker without our connector)."""

    def __init__(self, name: str, proc: Proc, system_port: int, stats: Path | None, served_name: str | None):
        self.name, self.proc, self.system_port, self.stats, self.served_name = (name, proc, system_port, stats,
                                                                                served_name)
        self.start_s: float | None = None

    def ready(self) -> bool:
        code, body = http_get(f"http://127.0.0.1:{self.system_port}/health")
        return code == 200 and '"ready"' in body

    def counters(self) -> dict:
        """The connector's counters: the worker file merged over the scheduler's (``<stem>.scheduler.json``,
        written when vLLM runs the scheduler in another process); ``{}`` before the first write."""
        if self.stats is None:
            return {}
        out = read_json(self.stats.with_name(self.stats.name.replace(".json", ".scheduler.json")))
        out.update(read_json(self.stats))
        return out


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


class DynamoStack:
    """A frontend on ``127.0.0.1:<free port>`` and the workers started with :meth:`start_worker`.

    ``root``: a directory for logs, the discovery store and the workers' stats files. ``frontend_args``:
    more ``dynamo.frontend`` flags (e.g. ``--router-mode kv``); ``env``: variables added to this process's
    environment for every process of the stack (e.g. ``DYN_LOG``). Use as a context manager, or call
    :meth:`close`. Raises RuntimeError if the frontend does not answer within 60 s.
    """

    def __init__(self, root: str | Path, frontend_args: list[str] | None = None, env: dict | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.env = loopback_env(self.root / "discovery", env)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.workers: dict[str, Worker] = {}
        self.frontends: list[Proc] = []  # more frontends (add_frontend)
        self.frontend = Proc("frontend", ["bash", str(EXAMPLES / "frontend.sh"), *RUNTIME_ARGS, *(frontend_args or [])],
                             {**self.env, "HTTP_HOST": "127.0.0.1", "HTTP_PORT": str(self.port)},
                             self.root / "frontend.log")
        t0 = time.monotonic()
        while http_get(f"{self.base}/v1/models")[0] != 200:
            if not self.frontend.alive() or time.monotonic() - t0 > 60:
                self.close()
                raise RuntimeError(f"Dynamo frontend did not start:\n{self.frontend.tail()}")
            time.sleep(0.3)

    def add_frontend(self, name: str, frontend_args: list[str] | None = None, timeout_s: float = 60) -> tuple[str, Proc]:
        """Start one more ``frontend.sh`` on its own free port (same discovery, same environment), e.g. a second
        ``--router-mode kv`` router with another ``--router-disk-cache-hit-weight``: every frontend receives the
        workers' KV events and keeps its own index. Returns ``(base URL, process)``; it is stopped by
        :meth:`close`. Raises RuntimeError if it does not answer within ``timeout_s``."""
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = Proc(name, ["bash", str(EXAMPLES / "frontend.sh"), *RUNTIME_ARGS, *(frontend_args or [])],
                    {**self.env, "HTTP_HOST": "127.0.0.1", "HTTP_PORT": str(port)}, self.root / f"{name}.log")
        self.frontends.append(proc)
        t0 = time.monotonic()
        while http_get(f"{base}/v1/models")[0] != 200:
            if not proc.alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"Dynamo frontend {name} did not start:\n{proc.tail()}")
            time.sleep(0.3)
        return base, proc

    def __enter__(self) -> "DynamoStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_worker(self, name: str, script: str, model_dir: str | Path, args: list[str] | None = None,
                     env: dict | None = None, stats: bool = True, served_name: str | None = None) -> Worker:
        """Start ``examples/dynamo/<script>`` as worker ``name`` (returns at once; see :meth:`wait_ready`).

        ``args`` go to ``dynamo.vllm`` (vLLM engine flags too); ``env`` adds to the process environment
        (``KVBM_BACKEND_CONFIG_FILE``, ``DYN_KVBM_DISK_CACHE_DIR``, ...); ``stats`` sets
        ``KVBM_BACKEND_STATS_PATH`` to ``<root>/<name>.stats.json``; ``served_name`` is passed as
        ``--served-model-name`` (the model name clients use; default: the model directory).
        """
        if name in self.workers and self.workers[name].proc.alive():
            raise ValueError(f"worker {name!r} is already running")
        sysport = free_port()
        stats_path = self.root / f"{name}.stats.json" if stats else None
        wenv = {**self.env, "MODEL": str(model_dir), "DYN_SYSTEM_PORT": str(sysport), **(env or {})}
        if stats_path is not None:
            wenv["KVBM_BACKEND_STATS_PATH"] = str(stats_path)
        argv = ["bash", str(EXAMPLES / script), *RUNTIME_ARGS, *(args or [])]
        if served_name:
            argv += ["--served-model-name", served_name]
        w = Worker(name, Proc(name, argv, wenv, self.root / f"{name}.log"), sysport, stats_path, served_name)
        w.start_s = time.monotonic()
        self.workers[name] = w
        return w

    def wait_ready(self, *names: str, timeout_s: float = READY_TIMEOUT_S, model: str | None = None,
                   report=None) -> dict[str, float]:
        """Wait until the named workers (default: all) report ready on ``/health`` and, when ``model`` is given,
        the frontend lists it. Returns each worker's start-up seconds. Raises RuntimeError with the worker's
        log tail if one exits or is not ready within ``timeout_s``. ``report(detail)``, if given, is called
        on every poll with the workers still starting and those ready (e.g. a rate-limited progress line)."""
        pending = set(names or self.workers)
        t0 = time.monotonic()
        took: dict[str, float] = {}
        while pending:
            for n in sorted(pending):
                w = self.workers[n]
                if not w.proc.alive():
                    raise RuntimeError(f"worker {n} exited rc={w.proc.p.returncode}; log {w.proc.log}:\n{w.proc.tail()}")
                if w.ready():
                    took[n] = time.monotonic() - (w.start_s or t0)
                    pending.discard(n)
            if pending and report is not None:
                report(f"waiting for {', '.join(sorted(pending))}"
                       + (f"; ready: {', '.join(f'{k} {v:.0f} s' for k, v in sorted(took.items()))}" if took else ""))
            if pending and time.monotonic() - t0 > timeout_s:
                n = sorted(pending)[0]
                raise RuntimeError(f"worker {n} not ready in {timeout_s:.0f} s; log {self.workers[n].proc.log}:\n"
                                   f"{self.workers[n].proc.tail()}\nfrontend:\n{self.frontend.tail()}")
            time.sleep(0.5)
        while model and not self.model_listed(model):
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the frontend does not list {model!r}:\n{self.frontend.tail()}")
            time.sleep(0.3)
        return took

    def model_listed(self, model: str) -> bool:
        code, body = http_get(f"{self.base}/v1/models")
        if code != 200:
            return False
        try:
            return any(m.get("id") == model for m in json.loads(body).get("data", []))
        except ValueError:
            return False

    def stop_worker(self, name: str, model: str | None = None, timeout_s: float = 60) -> None:
        """Stop a worker (SIGTERM, then SIGKILL) and, with ``model``, wait until the frontend drops it."""
        self.workers[name].proc.stop()
        t0 = time.monotonic()
        while model and self.model_listed(model) and time.monotonic() - t0 < timeout_s:
            time.sleep(0.3)

    def close(self) -> None:
        """Stop every worker, then the frontends: all workers get SIGTERM at once (each flushes its own tiers),
        then each is waited for (SIGKILL after :meth:`Proc.stop`'s grace)."""
        for w in self.workers.values():
            w.proc.terminate()
        for w in self.workers.values():
            w.proc.stop()
        for f in self.frontends:
            f.stop()
        self.frontend.stop()


def stream_completion(base: str, model: str, prompt: str | list[int], max_tokens: int = 8,
                      timeout_s: float = 120) -> dict:
    """One streaming ``/v1/completions`` request at temperature 0 (``ignore_eos``: exactly ``max_tokens``).

    ``prompt`` is text or token ids. Returns ``{"ttft_s", "e2e_s", "text", "prompt_tokens", "cached_tokens",
    "completion_tokens"}``: TTFT from sending the request to the first streamed token at the client
    (seconds); ``cached_tokens`` is the engine's count of prompt tokens it did not compute (its prefix
    cache plus connector loads; the usage block of the OpenAI API). Raises the OpenAI client's errors.
    """
    from openai import OpenAI
    c = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=timeout_s, max_retries=0)
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    for ch in c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += ch.choices[0].text
        if getattr(ch, "usage", None):
            usage = ch.usage
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - t0, "text": text,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None}


_CLEAR = """
import asyncio, json
from dynamo.runtime import DistributedRuntime
async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    cl = await rt.endpoint("dynamo.backend.clear_kv_blocks").client()
    await cl.wait_for_instances()
    for _ in range(100):
        if len(cl.instance_ids()) >= {n}:
            break
        await asyncio.sleep(0.1)
    out = []
    if {n} <= 1:
        out += [r.data() if hasattr(r, "data") else r async for r in await cl.round_robin(None)]
    else:
        for iid in cl.instance_ids():
            out += [r.data() if hasattr(r, "data") else r async for r in await cl.direct(None, iid)]
    rt.shutdown()
    print("RESULT" + json.dumps(out))
asyncio.run(main())
"""


def clear_kv_blocks(env: dict, n_workers: int = 1) -> list:
    """Call Dynamo's ``clear_kv_blocks`` worker endpoint (vLLM ``reset_prefix_cache``: empties the engine's
    prefix cache, G3/G4 keep their blocks) through Dynamo's runtime client, in a subprocess (this process keeps
    no Dynamo runtime; Dynamo 1.6.1's frontend has no HTTP route for it). ``n_workers`` 1: one instance
    (round robin); more: every instance, each directly. Returns the workers' replies; raises RuntimeError with
    the subprocess output when it fails."""
    r = subprocess.run([sys.executable, "-c", _CLEAR.replace("{n}", str(int(n_workers)))], env=env,
                       capture_output=True, text=True, timeout=60)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"clear_kv_blocks failed (rc={r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT"):])
