"""Run the real vLLM CPU engine in a subprocess (``python -m kvbm_backend.integrations.vllm.engine_run``) for tests.

Each engine gets its own process so pytest's process stays free of vLLM state and a "fresh engine"
really is a new process (empty engine prefix cache, pools reopened from disk). The process is forked from
a zygote that has imported vLLM once (:mod:`tests.helpers.engine_zygote`), or, where the zygote cannot serve
the run's environment or does not start, a new interpreter.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.machinery
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tests.helpers.pools import G3_LOAD_S, G4_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
IMPORT_CACHE = Path(tempfile.gettempdir()) / "kvbm-backend-test-imports"


def import_problem(modules: tuple[str, ...], *, pythonpath: str | None = None,
                   cache_dir: Path = IMPORT_CACHE) -> str | None:
    """None when ``modules`` all import in a fresh interpreter (this one's executable), else the reason
    (the error's last line), for a skip. Runs at collection time, so a busy machine must never make it
    an error: there is no timeout (a slow import is slow, not missing). A package that is not installed
    is answered at once (``find_spec`` of the top-level name, which imports nothing); a success is cached
    in ``cache_dir`` under a key of the interpreter and the packages' paths and mtimes, so a test run
    and its workers import once (failures are not cached). ``pythonpath``: put first on the search
    path (tests of this function)."""
    search = ([pythonpath] if pythonpath else []) + sys.path
    stamp = []
    for m in modules:
        spec = importlib.machinery.PathFinder.find_spec(m.split(".")[0], search)
        if spec is None:
            return f"{m.split('.')[0]} is not installed"
        where = spec.origin if spec.origin not in (None, "namespace") else next(iter(spec.submodule_search_locations))
        stamp.append((m, where, os.stat(where).st_mtime_ns if os.path.exists(where) else 0))
    key = hashlib.sha256(json.dumps([sys.executable, pythonpath, stamp]).encode()).hexdigest()[:24]
    marker = Path(cache_dir) / f"{key}.ok"
    if marker.exists():
        return None
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], capture_output=True, text=True,
                       env=env)  # no timeout: see above
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or [f"import {', '.join(modules)} failed"])[-1]
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, marker)
    return None


def vllm_available() -> str | None:
    """None if vLLM (and its llguidance) imports here, else the reason (used to skip);
    :func:`import_problem`, so never an error on a loaded machine."""
    return import_problem(("vllm", "llguidance"))


def prompts(n: int, length: int, shared_prefix: int = 0, seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    """``n`` deterministic token-id prompts of ``length`` tokens; the first ``shared_prefix`` are common."""
    rng = np.random.default_rng(seed)
    pre = rng.integers(3, vocab, shared_prefix).tolist()
    return [pre + rng.integers(3, vocab, length - shared_prefix).tolist() for _ in range(n)]


def read_stats(path: Path) -> dict:
    """A connector stats file's JSON (``stats_path``, or the scheduler's ``<stem>.scheduler.json``); {} while it
    is not written yet (each file is replaced atomically, so a read never sees half of one)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def mirrored_blocks(sched_stats: Path) -> int:
    """Blocks the scheduler's G3 mirror holds: its stats file's ``pools.g3`` (a G3Mirror's ``stats()``: ``blocks``
    counts what ``apply()`` took from the worker's reports); 0 until it is there."""
    g3 = (read_stats(sched_stats).get("pools") or {}).get("g3") or {}
    return int(g3.get("blocks", 0)) if g3.get("mirror") else 0


def connector_extra(workdir: Path, g4_url: str | None = None, keyring: Path | None = None, **g4_kw) -> dict:
    """``kv_connector_extra_config`` for a G3 dir (admit every block) and optionally a G4 URL.

    The G4 keyring (tenant data keys) defaults to ``workdir/../g4-keyring.json``: engines that are to
    read each other's G4 blocks must share it, as the workers of one fleet do. The loads' bounds are
    :data:`~tests.helpers.pools.G3_LOAD_S` and :data:`~tests.helpers.pools.G4_TIMEOUT_S` (``g4_kw`` may name another
    ``timeout_s``): the engine tests count loads and hits, and with the serving 5 s / 2 s a read the busy CI VM froze
    (side lane at ``nice 10``) was a miss the engine recomputed."""
    cfg = {"model": "kvbm-backend/tiny-llama", "g3": {"paths": [str(workdir / "g3")], "capacity_gb": 0.5,
                                                      "files_per_path": 2, "admission": {"policy": "all"},
                                                      "load_timeout_s": G3_LOAD_S}}
    if g4_url:
        g4 = {"enabled": True, "url": g4_url, "encrypt": True, "timeout_s": G4_TIMEOUT_S,
              "keyring": {"path": str(keyring or (workdir.parent / "g4-keyring.json"))}}
        g4.update(g4_kw)
        cfg["g4"] = g4
    return {"kvbm_backend": cfg, "stats_path": str(workdir / "connector-stats.json")}


# ``TORCHDYNAMO_DISABLE=1`` in every engine process: the engines run ``enforce_eager`` (no compiled model), but
# vLLM 0.32 still wraps a few helpers in ``torch.compile``; the one these runs reach is the TP > 1 vocab
# embedding's ``get_masked_input_and_mask`` (integer masking of token ids), which every TP rank of every TP=2
# engine traced and compiled with Inductor (a C++ build on the first run: 16 s of the first request of a TP=2
# engine on the idle 2-core VM, 2 s with Inductor's cache warm; 2026-12-01). With the switch set torch runs it
# eagerly: the same integer results, so the same KV and the same greedy outputs.
NO_TORCH_COMPILE = {"TORCHDYNAMO_DISABLE": "1"}


def run_engine(tmp: Path, name: str, model_dir: Path, prompt_list: list[list[int]], connector: dict | None,
               max_tokens: int = 4, kvcache_gib: int = 1, timeout: float = 600, env: dict | None = None,
               **spec_kw) -> dict:
    """Run one engine process over ``prompt_list`` (one request at a time) and return its result dict
    (see :mod:`kvbm_backend.integrations.vllm.engine_run`). Raises RuntimeError with the process's output tail on
    failure, or when it runs past ``timeout`` seconds (then killed with everything it started): a hang guard, not a
    bound (a TP=2 test's two engines took 222 s together in CI on the slow 2-core VM with the other lanes beside
    it, 2026-11-28), so load alone never trips it. The process is forked from this test process's engine zygote
    when ``env`` sets nothing vLLM reads at import (:data:`_ZYGOTE_LAZY`), else a new interpreter; the
    process's output is also in ``tmp/<name>.log`` when forked."""
    spec = {"model_dir": str(model_dir), "prompts": prompt_list, "connector": connector, "max_tokens": max_tokens,
            "out": str(tmp / f"{name}.result.json"), **spec_kw}
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    e = dict(os.environ)
    e.update({"VLLM_CPU_KVCACHE_SPACE": str(int(kvcache_gib)), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "PYTHONPATH": str(REPO) + os.pathsep + e.get("PYTHONPATH", ""), "VLLM_LOGGING_LEVEL": "WARNING",
              **NO_TORCH_COMPILE})
    if env:
        e.update(env)
    log = tmp / f"{name}.log"
    z = _zygote(e, create=not env)  # the zygote takes the environment of a run without overrides
    if z is not None and z.busy.acquire(blocking=False):  # a second engine at once gets a new interpreter
        try:
            rc, text = z.run(spec_path, e, tmp, log, timeout)
        finally:
            z.busy.release()
    else:
        try:
            r = subprocess.run([sys.executable, "-m", "kvbm_backend.integrations.vllm.engine_run", str(spec_path)],
                               capture_output=True, text=True, timeout=timeout, env=e, cwd=str(tmp))
            rc, text = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as exc:  # killed by subprocess.run
            rc = None
            text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                           for x in (exc.stdout, exc.stderr))
    if rc is None:
        raise RuntimeError(f"engine {name} still running after {timeout:.0f} s (hang guard), killed:\n{text[-6000:]}")
    out = Path(spec["out"])
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"engine {name} failed (rc={rc}):\n{text[-6000:]}")
    res = json.loads(out.read_text())
    res["log"] = text[-20000:]
    return res


# Environment variables an engine reads after the zygote's imports (vLLM's ``vllm.envs`` reads lazily until an
# engine starts; ours at connector start), so a run may set them differently from the zygote. Any other
# difference (e.g. ``VLLM_LOGGING_LEVEL``, which vLLM reads when imported) sends the run to a new interpreter.
_ZYGOTE_LAZY = ("PYTEST_", "KVBM_", "DYN_KVBM_", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_ENABLE_V1_MULTIPROCESSING")


def _import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(_ZYGOTE_LAZY)}


class _Zygote:
    """The client of one :mod:`tests.helpers.engine_zygote` process (one per test process, started on first use,
    killed at exit)."""

    def __init__(self, env: dict):
        self.env = _import_env(env)
        self.busy = threading.Lock()  # the zygote runs one engine at a time
        self.last_pid = 0  # the last engine process it forked (its own session: pid = process group id)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.engine_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
        atexit.register(self.close)
        line = self.proc.stdout.readline()  # no timeout: a slow import is slow, and EOF ends it
        if not line.startswith('{"ready"'):
            self.close()
            raise RuntimeError(f"engine zygote did not start (rc={self.proc.returncode})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, spec_path: Path, env: dict, cwd: Path, log: Path, timeout: float) -> tuple[int | None, str]:
        """Fork one engine process for ``spec_path``; its exit code (None: still running after ``timeout``
        seconds, then killed with its process group) and its output."""
        self.proc.stdin.write(json.dumps({"spec": str(spec_path), "env": env, "cwd": str(cwd),
                                          "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        pid = self.last_pid = json.loads(self.proc.stdout.readline())["pid"]
        end = time.monotonic() + timeout
        timed_out = False
        try:
            while not select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
                if time.monotonic() >= end:
                    timed_out = True
                    break
        finally:  # timed out, or interrupted (pytest-timeout, ^C): the run goes, and the zygote is ready again
            if timed_out or sys.exc_info()[0] is not None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine zygote exited (rc={self.proc.wait()}) while running {spec_path}")
        rc = json.loads(line)["rc"]
        text = log.read_text(errors="replace") if log.is_file() else ""
        return (None if timed_out else rc), text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_zygote_state: dict = {}
_zygote_lock = threading.Lock()


def _zygote(env: dict, create: bool = True) -> "_Zygote | None":
    """This process's zygote for a run with environment ``env``, or None where a new interpreter must run it.
    A zygote whose import-time environment differs from ``env`` (this process's environment changed since it
    started: importing vLLM here sets variables, vllm/env_override.py) is replaced by one started with ``env``
    when ``create``; without ``create`` (a run with its own overrides) such a run gets a new interpreter. A
    zygote that died or failed to start is not tried again in this process: the runs then go the old way."""
    with _zygote_lock:
        if _zygote_state.get("failed"):
            return None
        z = _zygote_state.get("z")
        if z is not None and not z.alive():
            _zygote_state["failed"] = f"engine zygote exited (rc={z.proc.returncode})"
            return None
        if z is not None and _import_env(env) == z.env:
            return z
        if not create:
            return None
        if z is not None:
            if not z.busy.acquire(blocking=False):  # another thread's engine still runs in it
                return None
            z.close()
            z.busy.release()
        try:
            _zygote_state["z"] = _Zygote(env)
        except (OSError, RuntimeError) as exc:
            _zygote_state["failed"] = str(exc)
            _zygote_state.pop("z", None)
            return None
        return _zygote_state["z"]


TIERING_MODULE = "kvbm_backend.integrations.vllm.tiering"


def native_extra(workdir: Path, g4_url: str | None = None, keyring: Path | None = None, *, blocks_per_chunk: int = 4,
                 cpu_mib: int = 64, g3_capacity_gb: float = 0.5, extra_tiers: tuple = (), num_kv_heads: int = 2,
                 model: str = "kvbm-backend/tiny-llama", **g4_kw) -> dict:
    """``kv_connector_extra_config`` for vLLM's ``OffloadingConnector`` on a CPU engine: our
    ``CpuTieringOffloadingSpec`` (:mod:`kvbm_backend.integrations.vllm.native_cpu`), a ``cpu_mib`` MiB CPU
    primary tier, ``blocks_per_chunk`` engine blocks per offloaded chunk, and as secondary tiers our G3
    (``workdir/g3``), our G4 when ``g4_url`` is given (keyring as in :func:`connector_extra`), then
    ``extra_tiers`` (tier dicts, e.g. vLLM's ``{"type": "fs", "root_dir": ...}``). ``num_kv_heads``: KV heads
    per rank (the tiny Llama has 2: 1 at TP=2); ``model``: the kvbm-backend config's model name. The tiers' load
    bounds are G3_LOAD_S and G4_TIMEOUT_S, as :func:`connector_extra`'s (``g4_kw`` may name another ``timeout_s``)."""
    base = {"model": model}
    tiers = [{"type": "G3Tier", "module_path": TIERING_MODULE, "config": base, "num_kv_heads": num_kv_heads,
              "io_threads": 2,
              "g3": {"paths": [str(workdir / "g3")], "capacity_gb": g3_capacity_gb, "files_per_path": 2,
                     "load_timeout_s": G3_LOAD_S}}]
    if g4_url:
        g4 = {"url": g4_url, "encrypt": True, "timeout_s": G4_TIMEOUT_S,
              "keyring": {"path": str(keyring or (workdir.parent / "g4-keyring.json"))}, **g4_kw}
        tiers.append({"type": "G4Tier", "module_path": TIERING_MODULE, "config": base, "num_kv_heads": num_kv_heads,
                      "io_threads": 2, "g4": g4})
    tiers += [dict(t) for t in extra_tiers]
    return {"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "kvbm_backend.integrations.vllm.native_cpu",
            "cpu_bytes_to_use": int(cpu_mib) << 20, "blocks_per_chunk": int(blocks_per_chunk),
            "secondary_tiers": tiers}
