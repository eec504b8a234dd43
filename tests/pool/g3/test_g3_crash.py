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
import pytest

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (acks, a killed child's end, results); returns as soon as it does

pytestmark = [pytest.mark.slow]

ROOT = REPO  # the repo root
BB = LAYOUT.bytes_per_block


def _run_writer(d: Path, start: int, cap_gb: float, min_acks: int, extra_s: float) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "crash_writer.py"), str(d), str(start), str(cap_gb)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    last = start - 1
    acks = 0
    try:
        deadline = time.monotonic() + HANG_S
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
        p.wait(timeout=HANG_S)
        reader.join(timeout=HANG_S)
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
            got = pool.get(keys, out).result(timeout=HANG_S)
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


def test_journal_record_matches_format_md(tmp_path):
    """docs/format.md's journal layout, read with its offsets only (no journal.py struct): the version-3 file
    header (path table, header check), 43-byte records, the check over bytes 0..34; and its reading rules: a
    checksum mismatch or an unknown type ends the replay, the rest is the torn tail; a damaged header makes
    the whole journal ignored; version 2 (16-byte header, the same records) is still read."""
    import xxhash

    from kvbm_backend.model.namespace import BlockKey, tenant_tag
    from kvbm_backend.pool.g3 import journal as jr
    fp = NS.fingerprint
    other = tmp_path / "other-dir"
    j = jr.Journal(str(tmp_path), fp, files=([str(tmp_path), str(other)], 3))
    key = BlockKey(fp, "alice", 3, 0xFEDCBA9876543210)
    j.rewrite([(key, (5, 70000))])
    j.append([jr.encode(jr.DEL, key)])
    j.close()
    data = (tmp_path / f"journal-{fp}.log").read_bytes()
    u = lambda b: int.from_bytes(b, "little")  # noqa: E731
    assert data[0:8] == b"KVBMJRN3" and data[8:16] == bytes.fromhex(fp)
    h = u(data[16:20])
    assert (u(data[20:22]), u(data[22:24])) == (3, 2) and len(data) == h + 2 * 43
    paths, pos = [], 24
    for _ in range(2):
        m = u(data[pos:pos + 2])
        paths.append(data[pos + 2:pos + 2 + m].decode())
        pos += 2 + m
    assert paths == [str(tmp_path), str(other)] and pos == h - 8
    assert u(data[h - 8:h]) == xxhash.xxh3_64_intdigest(data[0:h - 8])
    r = data[h:h + 43]
    assert (r[0], u(r[1:3]), u(r[3:7]), u(r[7:15]), u(r[15:19])) == (1, 5, 70000, 0xFEDCBA9876543210, 3)
    assert r[19:35] == tenant_tag("alice") and u(r[35:43]) == xxhash.xxh3_64_intdigest(r[0:35])
    d = data[h + 43:h + 86]
    assert (d[0], u(d[1:3]), u(d[3:7]), u(d[7:15])) == (2, 0, 0, 0xFEDCBA9876543210)
    assert u(d[35:43]) == xxhash.xxh3_64_intdigest(d[0:35])

    def load(b):
        (tmp_path / f"journal-{fp}.log").write_bytes(b)
        return jr.Journal(str(tmp_path), fp).load()
    one = h + 43  # the header and the PUT
    ents, info = load(data[:one])  # the PUT alone
    assert list(ents.values()) == [(5, 70000)] and info["records"] == 1 and info["torn_bytes"] == 0
    assert info["version"] == 3 and info["files"] == ([str(tmp_path), str(other)], 3)
    ents, info = load(data)  # PUT then DEL of the key
    assert not ents and info["records"] == 2
    ents, info = load(data[:one] + data[one:one + 20])  # a piece shorter than 43 bytes: torn tail
    assert info["records"] == 1 and info["torn_bytes"] == 20
    bad = bytearray(data)
    bad[one + 10] ^= 1  # checksum mismatch in record 2
    ents, info = load(bytes(bad))
    assert info["records"] == 1 and info["torn_bytes"] == 43 and list(ents.values()) == [(5, 70000)]
    bad = bytearray(data)
    bad[one] = 3
    bad[one + 35:one + 43] = xxhash.xxh3_64_intdigest(bytes(bad[one:one + 35])).to_bytes(8, "little")
    ents, info = load(bytes(bad))  # an unknown type, even with a good check, ends the replay
    assert info["records"] == 1 and info["torn_bytes"] == 43
    ents, info = load(b"KVBMJRN9" + data[8:])  # unknown magic (version): the whole journal ignored
    assert info["bad_header"] and not ents
    bad = bytearray(data)
    bad[26] ^= 1  # a path byte: the header check fails, the whole journal is ignored
    ents, info = load(bytes(bad))
    assert info["bad_header"] and not ents
    ents, info = load(data[:h - 1])  # shorter than its header
    assert info["bad_header"] and not ents
    ents, info = load(b"KVBMJRN2" + data[8:16] + data[h:])  # version 2: the same records at offset 16
    assert info["version"] == 2 and info["files"] is None and not ents and info["records"] == 2
    ents, info = load(b"KVBMJRN2" + data[8:16] + data[h:one])
    assert list(ents.values()) == [(5, 70000)] and info["torn_bytes"] == 0


_KILLED_AT_FSYNC = r'''
import os, signal, sys
from tests.helpers.crash_writer import open_pool
_fsync = os.fsync
def fsync(fd):  # killed right before a temp file's fsync (a directory's fsync goes through)
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    _fsync(fd)
os.fsync = fsync
open_pool(sys.argv[1])
'''


def test_temp_files_of_a_writer_killed_mid_rewrite_are_removed_at_the_next_open(tmp_path):
    """A process killed (SIGKILL) in the middle of writing a namespace file (first open of a directory) or
    of the journal rewrite at open leaves its uniquely named temp file; before, no later open removed it (one
    per crash, ~43 B per block each). Now the next open, holding the directory lock, removes them, and every
    block is still restored."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def killed_child() -> None:
        r = subprocess.run([sys.executable, "-c", _KILLED_AT_FSYNC, str(tmp_path)], env=env, timeout=600,
                           capture_output=True, text=True)
        assert r.returncode == -signal.SIGKILL, r.stderr

    def temps() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))

    killed_child()  # fresh directory: killed writing namespace.json
    assert [n.startswith(".namespace.json.") for n in temps()] == [True]
    keys = NS.keys(range(1, 201))
    with open_pool(tmp_path) as pool:
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == len(keys)
    assert temps() == []
    for _ in range(2):  # killed in the journal rewrite at open: each open removed the temp of the one before
        killed_child()
        assert len(temps()) == 1 and temps()[0].startswith(f".journal-{NS.fingerprint}.")
    with open_pool(tmp_path) as pool:
        assert temps() == []
        assert pool.stats()["restored_blocks"] == len(keys)
        out = [aligned_empty(BB) for _ in keys]
        assert all(pool.get(keys, out).result(timeout=HANG_S).ok)
        assert all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, keys))
