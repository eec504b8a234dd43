"""A zygote for the tests' engine processes: vLLM imported once, each engine run a fresh fork of it.

``python -m kvbm_backend.integrations.vllm.engine_run SPEC`` spends most of a short test run importing
vLLM (``from vllm import LLM``: 19 s of a 25 s tiny-model run on the idle 2-core VM, 2026-11-28; the suite
starts about 50 such engines). This process imports vLLM and :mod:`kvbm_backend.integrations.vllm.engine_run`
once, with no thread started, then forks one child per request; the child is the engine process the test
asked for: its own PID and session, the request's environment and working directory, its output in a file,
``engine_run.main([SPEC])`` run from the start. Nothing of an engine survives into the next one (each is a new
process from the same imported, never-started state), so "a fresh engine process" still holds.

Protocol (one JSON object per line): the zygote prints ``{"ready": pid}`` once imported (or exits non-zero
with the import error on stderr); each request ``{"spec", "env", "cwd", "log"}`` on stdin is answered with
``{"pid": child}`` at once and ``{"rc": exit code}`` (negative: killed by that signal) when the child ends.
The client is :func:`tests.helpers.vllm_runner.run_engine`, which sends only environments the zygote can
honour (what vLLM reads at import must equal the zygote's own; see ``vllm_runner._ZYGOTE_LAZY``).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback


def _child(req: dict) -> None:
    """In the forked child: become the engine process the request describes, run it, never return."""
    code = 1
    try:
        os.setsid()  # its own group: a timed-out run is killed with everything it started
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [sys.executable, "-m", "kvbm_backend.integrations.vllm.engine_run", req["spec"]]
        from kvbm_backend.integrations.vllm import engine_run
        code = engine_run.main([req["spec"]])  # os._exit(0) on success
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must report and exit, whatever it was
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# What an engine run imports only once it starts (992 modules in a tiny Llama run with our connector, 3.5 s of
# its 8.7 s): the CPU worker and model runner, the model loaders and the test models, our connector and pools.
# A module missing here is skipped; one that starts a thread makes the zygote refuse to serve (see serve).
_WARM = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.gpu_model_runner",
         "vllm.v1.engine.core", "vllm.model_executor.model_loader.default_loader",
         "vllm.model_executor.model_loader.dummy_loader", "vllm.model_executor.models.llama",
         "vllm.model_executor.models.deepseek_v2", "vllm.model_executor.models.gpt_oss",
         "vllm.model_executor.models.gemma3", "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
         "kvbm_backend.integrations.vllm.connector", "kvbm_backend.integrations.vllm.native_cpu",
         "kvbm_backend.integrations.vllm.tiering", "kvbm_backend.pool.g3", "kvbm_backend.pool.g4",
         "kvbm_backend.io.nixl_engine", "boto3", "botocore.client")


def serve() -> int:
    import gc
    import importlib

    from vllm import LLM, SamplingParams  # noqa: F401 - the import each engine run no longer pays
    from vllm.inputs import TokensPrompt  # noqa: F401

    from kvbm_backend.integrations.vllm import engine_run  # noqa: F401
    for name in _WARM:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if threading.active_count() != 1:  # forking a process with threads could copy a held lock
        print(f"engine zygote: threads after import: {threading.enumerate()}", file=sys.stderr)
        return 3
    # The imported modules' objects go to the collector's permanent generation: vLLM's gc.collect() calls (7 in
    # a tiny run, 3.2 s) then walk only what the engine itself made, and the children share those pages.
    gc.collect()
    gc.freeze()
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
