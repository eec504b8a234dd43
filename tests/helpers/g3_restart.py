"""A G3 pool of ``SLOTS`` slots, a child process that leaves it as a killed worker does (``os._exit``, no close),
and the checks of the pool restarted from what it left (tests/pool/g3/test_g3_vacancy_while_dirty.py,
test_g3_withdraw_vacancy.py). Pools are :func:`tests.helpers.crash_writer.open_pool` ones (keys ``NS``, bytes
``payload``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from tests.helpers.crash_writer import LAYOUT, NS, payload

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SLOTS = 48
CFG = dict(capacity_gb=SLOTS * frame.slot_bytes(LAYOUT.bytes_per_block) / 1e9, files_per_path=1)  # SLOTS slots
REPO = Path(__file__).resolve().parents[2]


def run_child(code: str, path, mode: str) -> dict:
    """Run ``code`` in a fresh Python (argv: ``path``, ``mode``; cwd and PYTHONPATH the repository); it must exit 0
    and print one line ``RESULT <json>``: that JSON. AssertionError (with its output) otherwise."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code, str(path), mode], capture_output=True, text=True,
                       timeout=HANG_S, env=env, cwd=str(REPO))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT "):])


def check_restored(pool, held, gone) -> None:
    """The restarted ``pool`` restored exactly ``held`` (no restore drop), each a hit with its own bytes; every key
    of ``gone`` a miss (never another block's bytes); its slot accounting exact (nothing leaked)."""
    st = pool.stats()
    assert (st["restore_dropped"], st["restore_dropped_by_reason"]) == (0, {}), st
    assert st["restored_blocks"] == len(held) and set(pool.keys()) == set(held), st
    out = [aligned_empty(LAYOUT.bytes_per_block) for _ in held + gone]
    ok = pool.get(held + gone, out).result(timeout=HANG_S).ok
    assert ok == [True] * len(held) + [False] * len(gone)  # a key gone is a miss, never another's bytes
    assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, held))
    acc = pool.cat.accounting()
    assert acc["leaked"] == 0 and acc["used"] == len(held) and acc["free"] == acc["capacity"] - len(held), acc


def check_refills(pool, held, start: int) -> None:
    """The ``pool`` holding ``held`` fills to its ``SLOTS`` slots (new keys from ``start`` on) with every block
    written and no eviction: the emptied slots are usable again, and every block of ``held`` is still there."""
    fill = NS.keys(range(start, start + SLOTS - len(held)))
    r = pool.put(fill, [payload(k.seq_hash) for k in fill]).result(timeout=HANG_S)
    assert (r.written, r.dropped) == (len(fill), 0) and pool.stats()["evictions"] == 0
    assert all(pool.contains(k) for k in held)
