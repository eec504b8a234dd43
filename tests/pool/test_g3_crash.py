"""Invariants 2 and 6 with a real process killed by SIGKILL in the middle of writes.

A writer process (``tests/helpers/crash_writer.py``) offloads blocks continuously into a small pool (so LRU
eviction reuses slots while it writes); it is killed with ``kill -9`` at varying points, several
times, each time restarted on the same directory. After every kill the pool reopens, every block
the writer had acknowledged (put Future completed) and that is still within capacity is found, and
every block served carries exactly the bytes written for its key.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty

ROOT = Path(__file__).resolve().parents[2]  # the repo root
BB = LAYOUT.bytes_per_block


def _run_writer(d: Path, start: int, cap_gb: float, min_acks: int, extra_s: float) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "crash_writer.py"), str(d), str(start), str(cap_gb)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    last = start - 1
    acks = 0
    try:
        deadline = time.monotonic() + 60
        while acks < min_acks:
            line = p.stdout.readline()
            assert line, f"writer exited early: {p.stderr.read()}"
            assert time.monotonic() < deadline, "writer too slow"
            if line.startswith("ACK"):
                last = int(line.split()[1])
                acks += 1
        tail: list[str] = []
        reader = threading.Thread(target=lambda: tail.extend(p.stdout), daemon=True)
        reader.start()  # keep draining acks; the kill lands at a time independent of them
        time.sleep(extra_s)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        reader.join(timeout=10)
        for line in tail:  # acks printed before the kill landed
            if line.startswith("ACK"):
                last = int(line.split()[1])
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert p.returncode == -signal.SIGKILL
    return last


def test_kill9_during_writes_then_restart(tmp_path):
    rng = random.Random(1234)
    cap_gb = 600 * 12288 / 1e9  # 600 slots of 12 KiB: eviction and slot reuse while writing
    start = 1
    served_total = 0
    for round_ in range(3):
        last = _run_writer(tmp_path, start, cap_gb, min_acks=4 + 6 * round_, extra_s=rng.uniform(0.05, 0.3))
        with open_pool(tmp_path, capacity_gb=cap_gb) as pool:
            st = pool.stats()
            assert st["restored_blocks"] > 0
            keys = NS.keys(range(1, last + 1))
            out = [aligned_empty(BB) for _ in keys]
            got = pool.get(keys, out).result(timeout=60)
            for k, ok, o in zip(keys, got.ok, out):
                if ok:
                    assert np.array_equal(o, payload(k.seq_hash)), f"wrong bytes served for {k}"
            served = sum(got.ok)
            served_total += served
            # the most recently acknowledged blocks fit in capacity and were published: all found
            recent = NS.keys(range(max(1, last - 299), last + 1))
            assert all(pool.contains(k) for k in recent), "an acknowledged block was lost"
            assert pool.stats()["corrupt"] == 0 or served == sum(got.ok)
            assert pool.slot_accounting()["leaked"] == 0
        start = last + 1
    assert served_total > 0
