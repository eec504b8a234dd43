"""The demo's in-process engines (:mod:`kvbm_backend.integrations.vllm.engine_run` subprocesses): start them
side by side, wait until each has loaded and warmed up, then let them serve one at a time
(:func:`_run_engines`, used by :func:`kvbm_backend.apps.demo.run_demo`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 900.0  # an engine's load and warm-up, s from its process start
SERVE_TIMEOUT_S = 900.0  # an engine's requests, s from when it is let go (engines serve one at a time)


def _start_engine(name: str, spec: dict, workdir: Path, env_extra: dict | None = None,
                  pause_max_s: float = 3600) -> dict:
    """Start one in-process engine (``engine_run``) that loads, warms up, then waits before its first prompt
    until :func:`_serve_engine` lets it go, so engines start side by side but serve one at a time.
    ``pause_max_s``: the longest it waits so, in s (then it serves unasked)."""
    spec = dict(spec, out=str(workdir / f"{name}.result.json"), progress_file=str(workdir / f"{name}.progress"),
                pause_before=[0], pause_dir=str(workdir / f"{name}.pause"), pause_max_s=pause_max_s)
    Path(spec["pause_dir"]).mkdir(parents=True, exist_ok=True)
    Path(spec["progress_file"]).write_text("")
    spath = workdir / f"{name}.spec.json"
    spath.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    log = open(workdir / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_backend.integrations.vllm.engine_run", str(spath)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
    log.close()
    return {"name": name, "proc": proc, "spec": spec, "log": workdir / f"{name}.log", "t0": time.monotonic()}


def _check(h: dict, since: float, timeout_s: float, what: str) -> None:
    """Kill engine ``h`` and raise RuntimeError naming its log when ``what`` has taken more than ``timeout_s``
    seconds since ``since`` (a ``time.monotonic()`` value)."""
    if time.monotonic() - since > timeout_s:
        h["proc"].kill()
        raise RuntimeError(f"demo: engine {h['name']}: {what} ran past {timeout_s} s (log: {h['log']})")


def _wait_loaded(h: dict, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until engine ``h`` has loaded and warmed up (it waits before its first prompt), or has exited.
    ``timeout_s``: seconds from the engine's process start."""
    while h["proc"].poll() is None and not (Path(h["spec"]["pause_dir"]) / "paused-0").exists():
        _check(h, h["t0"], timeout_s, "start-up (load and warm-up)")
        time.sleep(0.2)


def _serve_engine(h: dict, progress=None, task=None, timeout_s: float = SERVE_TIMEOUT_S,
                  startup_timeout_s: float = START_TIMEOUT_S) -> dict:
    """Let loaded engine ``h`` serve its prompts, and return its result dict. Raises RuntimeError naming the
    log if it fails, if its start-up runs past ``startup_timeout_s`` seconds from its process start, or its
    serving past ``timeout_s`` seconds from when it is let go (time spent waiting while the engines before
    it served does not count)."""
    proc, spec, name = h["proc"], h["spec"], h["name"]
    pdir, pfile = Path(spec["pause_dir"]), Path(spec["progress_file"])
    _wait_loaded(h, startup_timeout_s)
    (pdir / "resume-0").write_text("")
    t_serve = time.monotonic()
    while proc.poll() is None:
        _check(h, t_serve, timeout_s, "serving its requests")
        if progress is not None:
            progress.update(task, completed=len(pfile.read_text().split()))
        time.sleep(0.2)
    if proc.returncode != 0 or not Path(spec["out"]).is_file():
        raise RuntimeError(f"demo: engine {name} failed (rc={proc.returncode}); log {h['log']}:\n"
                           f"{h['log'].read_text()[-4000:]}")
    if progress is not None:
        progress.update(task, completed=len(spec["prompts"]))
    return json.loads(Path(spec["out"]).read_text())


def _run_engines(runs: list[tuple[str, dict]], workdir: Path, env_extra: dict, progress, tasks: dict,
                 phases=None) -> dict:
    """Start every engine of ``runs`` side by side, wait until all have loaded (so none computes while
    another is timed), then serve them one at a time, in order. ``phases``
    (:class:`kvbm_backend.apps.phases.Phases`): a timed line when the start-up and each engine's requests
    begin and end (default: lines on stderr)."""
    from .phases import Phases
    phases = phases or Phases()
    handles = []
    try:
        with phases.phase(f"starting {len(runs)} in-process vLLM engines side by side"):
            for name, spec in runs:
                # an engine waits (paused) while the others load and those before it serve
                handles.append(_start_engine(name, spec, workdir, env_extra,
                                             pause_max_s=START_TIMEOUT_S + len(runs) * SERVE_TIMEOUT_S))
            for h in handles:
                _wait_loaded(h)
        out = {}
        for h in handles:
            progress.start_task(tasks[h["name"]])
            with phases.phase(f"engine {h['name']}: {len(h['spec'].get('prompts', []))} requests"):
                out[h["name"]] = _serve_engine(h, progress, tasks[h["name"]])
        return out
    finally:
        for h in handles:
            if h["proc"].poll() is None:
                h["proc"].kill()
