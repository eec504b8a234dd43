"""``G4Pool.delete`` counts a block ``deleted`` (and in its result) only once its DELETE succeeded; a key whose HEAD
found the block but whose DELETE failed counts ``delete_errors`` alone. Before 2026-12-04 the block was counted
``deleted`` right after the HEAD, so a failed DELETE counted in both, and the result said it was gone.

A real ``file://`` store whose DELETE fails while its HEAD works: a tmpfs remounted read-only (root: EROFS for
root too; skipped where nothing can be mounted), or a directory made read-only (any other user: EACCES; a mode
does not stop root, so that case is skipped as root)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.tmpfs import mounted_tmpfs

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SEQS = [1, 2, 3]


def _pool(root: Path) -> G4Pool:
    return G4Pool(G4Config(url=f"file://{root}", encrypt=False), namespace())


def _stored(root: Path) -> G4Pool:
    """A pool on ``root`` holding the blocks of :data:`SEQS` (flushed: on the filesystem)."""
    pool = _pool(root)
    assert put_blocks(pool, SEQS, "").written == len(SEQS)
    assert pool.flush(HANG_S)
    return pool


@pytest.mark.parametrize("how", ["read-only-mount", "read-only-dirs"])
def test_a_failed_delete_counts_delete_errors_only(tmp_path, how):
    ns = namespace()
    keys = ns.keys(SEQS, tenant="")
    if how == "read-only-mount":
        with mounted_tmpfs(tmp_path / "mnt", "8M", "mode=0700") as mnt:
            pool = _stored(mnt / "g4")
            try:
                subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)
                _check_failed_delete(pool, keys)
            finally:
                pool.close(timeout=HANG_S)
        return
    if os.geteuid() == 0:
        pytest.skip("root unlinks in a read-only directory; the read-only mount case covers root")
    root = tmp_path / "g4"
    pool = _stored(root)
    dirs = [Path(d) for d, _, files in os.walk(root) if files]
    try:
        for d in dirs:
            d.chmod(0o500)
        _check_failed_delete(pool, keys)
    finally:
        for d in dirs:
            d.chmod(0o700)
        pool.close(timeout=HANG_S)


def _check_failed_delete(pool: G4Pool, keys: list) -> None:
    """Every key's HEAD finds its block and every DELETE fails: nothing is counted deleted, each is a delete error,
    and every block is still there and served."""
    got = pool.delete(keys).result(timeout=HANG_S)
    s = pool.stats()
    assert (got, s.get("deleted", 0), s.get("delete_errors", 0)) == (0, 0, len(keys)), (
        f"a DELETE that failed counted as deleted: result {got}, deleted {s.get('deleted', 0)}, "
        f"delete_errors {s.get('delete_errors', 0)}")
    assert pool.lookup_prefix(keys).result(timeout=HANG_S) == len(keys)
    assert read_checked(pool, SEQS, "") == [True] * len(keys)


def test_a_delete_that_succeeds_counts_deleted(tmp_path):
    """The same store, writable: found blocks are deleted and counted, absent keys count nothing."""
    ns = namespace()
    pool = _stored(tmp_path / "g4")
    try:
        keys = ns.keys(SEQS + [99], tenant="")  # 99 never stored: its HEAD finds nothing
        assert pool.delete(keys).result(timeout=HANG_S) == len(SEQS)
        s = pool.stats()
        assert s.get("deleted", 0) == len(SEQS) and s.get("delete_errors", 0) == 0, s
        assert pool.lookup_prefix(keys).result(timeout=HANG_S) == 0
    finally:
        pool.close(timeout=HANG_S)
