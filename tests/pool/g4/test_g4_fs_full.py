"""A full ``file://`` G4 mount is an answer, not an outage (2026-12). Before, the file store raised
StoreUnavailable for ENOSPC / EDQUOT / EROFS: the writer counted each refused put as a breaker failure, the
breaker opened, and every load missed ``breaker`` although reads worked. Now such a put is dropped as
``dropped_full``, logged once with the errno and the mount, the breaker stays closed and loads go on.

Real full filesystem: a 1 MiB tmpfs mounted for the test (root needed; skipped with the reason otherwise),
filled with a plain file."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.tmpfs import fill_filesystem, mounted_tmpfs
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
POOL_LOG = "kvbm_backend.pool.g4.pool"


@pytest.fixture
def small_mount(tmp_path):
    """A fresh 1 MiB tmpfs (mode 0700) at ``tmp_path / "mnt"`` (:func:`tests.helpers.tmpfs.mounted_tmpfs`)."""
    with mounted_tmpfs(tmp_path / "mnt", "1M", "mode=0700") as mnt:
        yield mnt



def _pool(mnt) -> G4Pool:
    cfg = G4Config(url=f"file://{mnt}/g4", encrypt=False, breaker_failures=2, timeout_s=G4_TIMEOUT_S)  # no bound here
    return G4Pool(cfg, namespace())


def test_a_full_mount_drops_offloads_as_full_and_keeps_serving_loads(small_mount, caplog):
    caplog.set_level(logging.WARNING, logger=POOL_LOG)
    pool = _pool(small_mount)
    try:
        assert put_blocks(pool, [1], "").written == 1  # stored before the mount filled
        assert pool.flush(HANG_S)
        fill_filesystem(small_mount)

        res = put_blocks(pool, list(range(2, 8)), "")  # 6 new blocks, more than breaker_failures
        s = pool.stats()
        assert (res.written, res.dropped) == (0, 6)
        assert s["breaker_state"] == "closed" and s["breaker_opens"] == 0, s
        assert read_checked(pool, [1], "") == [True], pool.stats()  # the block stored before is still a hit
        assert s.get("dropped_full") == 6 and s.get("dropped_unavailable", 0) == 0 and s.get("dropped_error", 0) == 0
        s = pool.stats()
        assert s["hits"] == 1 and s["misses"] == 0
        lines = [r.getMessage() for r in caplog.records if r.name == POOL_LOG and "refuses writes" in r.getMessage()]
        assert len(lines) == 1, lines  # once, not once per dropped block
        assert "ENOSPC" in lines[0] and f"mount {small_mount}" in lines[0] and "dropped_full" in lines[0], lines[0]

        (small_mount / "filler").unlink()  # room again: offloads are stored again, no restart
        assert put_blocks(pool, [9], "").written == 1
        assert read_checked(pool, [9], "") == [True]
    finally:
        pool.close(timeout=HANG_S)


def test_a_pool_started_on_a_full_mount_does_not_open_its_breaker(small_mount):
    """``namespace.json`` cannot be written at start: counted and logged, never a breaker trip (before, every load
    of the fresh pool missed ``breaker``)."""
    fill_filesystem(small_mount)
    pool = _pool(small_mount)
    try:
        assert pool.flush(HANG_S)  # the start-up namespace.json write has run
        s = pool.stats()
        assert s["namespace_json_errors"] == 1 and s["breaker_state"] == "closed", s
        ns = namespace()
        out = [np.zeros(ns.layout.bytes_per_block, np.uint8)]
        assert pool.get(ns.keys([1], tenant=""), out).result(timeout=HANG_S).ok == [False]
        s = pool.stats()
        assert s["miss_absent"] == 1 and s.get("miss_breaker", 0) == 0, s  # asked the store: absent
        assert put_blocks(pool, [1], "").dropped == 1 and pool.stats()["dropped_full"] == 1
    finally:
        pool.close(timeout=HANG_S)
