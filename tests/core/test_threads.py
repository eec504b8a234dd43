"""kvbm_backend's threads do not inherit one core's binding (kvbm_backend/threads.py).

vLLM's CPU worker binds the thread that opens the pools to one core; the pools' write-behind, I/O and
deadline threads inherited that core and starved there beside the engine's busy loop (the disaggregated
Dynamo test waited 91 s for blocks the prefill worker's write-behind had not written). Shown with real pools
in a child process whose main thread is bound to one core, as vLLM binds it, while another thread of the
process runs on a second core, as vLLM's OpenMP thread does."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvbm_backend.threads import parse_cpu_list
ROOT = Path(__file__).resolve().parents[2]
HANG_S = 600.0  # a hang guard only: the child returns as soon as its pools have written

CHILD = textwrap.dedent("""
    import json, logging, os, sys, threading
    import numpy as np
    from kvbm_backend.config import G4Config
    from kvbm_backend.pool import open_pool
    from tests.helpers.pools import open_g3, tiny_ns

    tmp = sys.argv[1]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    stop = threading.Event()
    omp = threading.Thread(target=lambda: (os.sched_setaffinity(0, {c1}), stop.wait()), name="omp")
    omp.start()                                  # vLLM's OpenMP thread, bound to the second core
    os.sched_setaffinity(0, {c0})                # vLLM's worker thread, bound to the first one
    ns = tiny_ns()
    g3 = open_g3(os.path.join(tmp, "g3"), ns)
    g4 = open_pool(G4Config(enabled=True, url="file://" + os.path.join(tmp, "g4"),
                            keyring={"path": os.path.join(tmp, "keys", "keyring.json")}), ns)
    keys = ns.keys([11, 12, 13], "", 0)
    blocks = [np.full(ns.layout.bytes_per_block, i, np.uint8) for i in range(3)]
    for pool in (g3, g4):
        pool.put(keys, blocks).result(120)
        pool.flush(120)
    ours = {t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
            if t.name.startswith(("kvbm", "g3", "g4"))}
    print(json.dumps({"cores": [c0, c1], "main": sorted(os.sched_getaffinity(0)), "ours": ours}))
    g3.close(); g4.close(); stop.set(); omp.join()
""")


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        parse_cpu_list("0-x")


@pytest.mark.slow  # a child process importing the pools: ~10 s on the busy CI VM
@pytest.mark.side  # no wall-clock assertion
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two CPUs this process may run on")
def test_pool_threads_run_on_every_core_of_the_process_not_the_one_their_creator_is_bound_to(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=HANG_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    both = sorted(res["cores"])
    assert res["main"] == both[:1]  # the creator keeps its own binding: only our threads are widened
    names = set(res["ours"])
    # the G3 write-behind, fsync and deadline threads, the G4 offload threads (threads start lazily)
    assert {"kvbm-g3-writer", "kvbm-g3-syncer", "kvbm-g3-deadlines", "g4-deadlines"} <= names, names
    assert any(n.startswith("g4-put") for n in names), names
    narrow = {n: cpus for n, cpus in res["ours"].items() if cpus != both}
    assert not narrow, f"threads bound like their creator, not to the process's cores {both}: {narrow}"
    cpus = ",".join(map(str, both))
    line = f"kvbm_backend.threads INFO kvbm_backend: threads run on CPUs {cpus} (the thread starting them is bound to {both[0]})"
    assert out.stderr.count(line) == 1, out.stderr[-3000:]  # docs/operations.md, "Logs": once per process


def test_every_thread_the_library_starts_goes_through_kvbm_backend_threads():
    """A ``threading.Thread(...)`` or ``ThreadPoolExecutor(...)`` made elsewhere would inherit its creator's
    binding again (``apps/`` run as their own processes: benchmarks and CLIs, not inside an engine)."""
    lib = ROOT / "kvbm_backend"
    bad = []
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib).as_posix()
        if rel == "threads.py" or rel.startswith("apps/"):
            continue
        for node in ast.walk(ast.parse(p.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("Thread", "ThreadPoolExecutor"):
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, f"threads made outside kvbm_backend/threads.py (start_thread / executor): {bad}"
