"""A closed G3 pool writes nothing: not its journal, not through the directory fd numbers it closed.

Review finding (2026-12-02): ``G3Pool.delete`` on a closed pool found its journal closed (no fd), took it for one
needing repair and rewrote it from the stale index, relative to the directory fd NUMBER the pool had closed. In a
process that had opened a pool on the same directory since (a worker restarting its pool, a revocation purge
racing it), that number was the new pool's directory fd: the old index was renamed over the new pool's journal,
whose later appends went to an unlinked file, and the blocks the new pool had stored were gone at its next open
(8 of 8). Now a closed pool's ``delete`` holds nothing (0) and its journal's directory fd is forgotten at close
(a rewrite fails, EBADF). Run in a fresh interpreter: pytest's own files shift the fd numbers the bug needs."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.crash_writer import NS, open_pool, payload

ROOT = Path(__file__).resolve().parents[3]
HANG_S = 600.0  # a hang guard, not a bound

SCRIPT = r'''
import json, sys
sys.path.insert(0, sys.argv[2])
from tests.helpers.crash_writer import NS, open_pool, payload
d, cap = sys.argv[1], 64 * 12288 / 1e9
p1 = open_pool(d, capacity_gb=cap, files_per_path=1)
a = NS.keys(range(1, 9))
assert p1.put(a, [payload(k.seq_hash) for k in a]).result().written == 8
old_dfd = p1.slabs.dir_fd(p1.slabs.paths[0])
p1.close()
p2 = open_pool(d, capacity_gb=cap, files_per_path=1)
b = NS.keys(range(100, 108))
assert p2.put(b, [payload(k.seq_hash) for k in b]).result().written == 8  # stored: durable and journaled
reused = p2.slabs.dir_fd(p2.slabs.paths[0]) == old_dfd
deleted = p1.delete([a[0]]).result()
p2.close()
with open_pool(d, capacity_gb=cap, files_per_path=1) as p3:
    held = sorted(k.seq_hash for k in p3.keys())
print(json.dumps({"reused": reused, "deleted": deleted, "held": held}))
'''


def test_a_closed_pools_delete_never_touches_the_journal_of_a_pool_opened_since(tmp_path):
    """Pool 1 stores 8 blocks and closes; pool 2 opens the same directory (its directory fd takes pool 1's old
    number) and stores 8 blocks; pool 1 is asked to delete one of its blocks. Pool 2's 8 blocks and pool 1's 8
    are all there at the next open, and the closed pool deleted nothing (before: 1 deleted, pool 2's 8 lost)."""
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["reused"], "the fd numbers did not line up: the test proves nothing"
    assert got["held"] == list(range(1, 9)) + list(range(100, 108)), r.stderr[-3000:]
    assert got["deleted"] == 0


def test_a_closed_pool_deletes_nothing_and_its_journal_cannot_be_rewritten(tmp_path):
    p = open_pool(str(tmp_path), capacity_gb=64 * 12288 / 1e9, files_per_path=1)
    keys = NS.keys(range(1, 5))
    assert p.put(keys, [payload(k.seq_hash) for k in keys]).result(HANG_S).written == 4
    p.close()
    journal = Path(p.journal.path)
    before = journal.stat()
    assert p.delete(keys[:2]).result(HANG_S) == 0
    assert p.cat.journal_append([b"x" * 16]) is False  # nothing journaled, and no repair attempted
    with pytest.raises(OSError) as e:
        p.journal.rewrite(p.index.items())
    assert e.value.errno == errno.EBADF
    after = journal.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    with open_pool(str(tmp_path), capacity_gb=64 * 12288 / 1e9, files_per_path=1) as q:
        assert sorted(k.seq_hash for k in q.keys()) == [1, 2, 3, 4]
