"""The tiers' gauges in a child forked without exec from a process with open pools (multiprocessing's fork, an
engine forking helpers): a child that opens pools of its own (on directories of its own, as
``kvbm_backend/pool/g3/forked.py`` says it must) exports its own pools' values, never its parent's.

Review finding (operator surface, 2026-12-04): the process's G3 gauges (``kvbm_backend_g3_capacity_bytes``,
``_used_bytes``, ``_blocks``, ``_degraded``: the sum, or the maximum, over the process's pools) and G4's
``kvbm_backend_g4_degraded`` (the maximum over its G4 pools) kept their per-pool parts in module dicts that a forked
child inherited: the child's gauges summed the parent's pools at the fork with its own (on the pod's endpoint, where
the live processes' values are summed, the parent's capacity and blocks counted twice), its ``degraded`` stayed at the
parent's 1 for good, and a child forked while another thread was inside a gauge update (a pool's writer thread after
each batch) hung for ever opening its own G3 pool (the lock guarding those dicts stayed held in the child).

Real pools (G3 on real files, G4 on a ``file://`` store), a real fork; the held case holds the parent's writer thread
inside the gauge update deterministically (a registry whose G3 blocks gauge waits in ``set`` while armed)."""
from __future__ import annotations

import os
import threading

import pytest
from prometheus_client import CollectorRegistry

from kvbm_backend import metrics
from kvbm_backend.config import G4Config
from kvbm_backend.pool import open_pool
from kvbm_backend.pool.g3 import G3Pool
from tests.helpers.crash_writer import NS, config, payload
from tests.helpers.forked import exit_status

HANG_S = 120.0  # a hang guard, not a bound: what is waited for happens at once


class _HoldingRegistry(CollectorRegistry):
    """While :attr:`armed`, the first thread to set the G3 ``blocks`` gauge registered here waits inside that set
    (inside the pool's gauge update) until :attr:`release`; :attr:`inside` says it is there."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self.armed, self.inside, self.release = threading.Event(), threading.Event(), threading.Event()

    def register(self, collector) -> None:
        super().register(collector)
        if getattr(collector, "_name", "") != "kvbm_backend_g3_blocks":
            return
        real = collector.set

        def held_set(value: float) -> None:
            if self.armed.is_set() and not self.inside.is_set():
                self.inside.set()
                self.release.wait(HANG_S)
            real(value)

        collector.set = held_set


def _g3_gauges(reg) -> tuple:
    return tuple(metrics.sample_value(reg, f"kvbm_backend_g3_{n}") for n in ("capacity_bytes", "used_bytes",
                                                                             "blocks", "degraded"))


@pytest.mark.parametrize("held", [False, True], ids=["idle", "writer-inside-the-gauge-update"])
def test_a_forked_childs_g3_gauges_are_its_own_pools(tmp_path, held):
    """The parent's pool holds 8 blocks and is degraded (``held``: its writer thread is inside the gauge update,
    publishing 2 more blocks); the child forked from it opens a pool of its own (another directory, a quarter of
    the capacity): the child's gauges are that pool's (its capacity, no block, not degraded), and 0 once it closed.
    Old code: capacity and blocks of both pools, degraded 1 (``held``: the child hung opening its pool)."""
    reg = _HoldingRegistry()
    parent = G3Pool(config(tmp_path / "parent", capacity_gb=0.02), NS, registry=reg)
    putter = None
    try:
        keys = NS.keys(range(1, 9))
        assert parent.put(keys, [payload(k.seq_hash) for k in keys]).result().written == 8
        if held:  # the parent's writer thread, publishing a put, is inside the gauge update at the fork
            reg.armed.set()
            more = NS.keys(range(100, 102))
            putter = threading.Thread(target=lambda: parent.put(more, [payload(k.seq_hash) for k in more]).result())
            putter.start()
            assert reg.inside.wait(HANG_S), "the parent's writer never updated the gauges"
        else:
            parent.degrade_s = 600.0
            parent.cat.degrade()
            assert _g3_gauges(reg)[2:] == (8, 1)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child = G3Pool(config(tmp_path / "child", capacity_gb=0.005), NS, registry=reg)
                own = child.stats()["capacity_bytes"]
                got = _g3_gauges(reg)
                child.close()
                gone = _g3_gauges(reg)
                code = 0 if (got, gone) == ((own, 0, 0, 0), (0, 0, 0, 0)) else 3
                if code:
                    os.write(2, f"child's G3 gauges {got}, after its close {gone}; its own pool: ({own}, 0, 0, "
                                f"0)\n".encode())
            finally:
                os._exit(code)
    finally:
        reg.release.set()
        if putter is not None:
            putter.join(HANG_S)
        parent.close()
    status = exit_status(pid, HANG_S)
    assert status is not None, "the child hung opening its own G3 pool (killed after the hang guard)"
    assert status == 0, "the child's G3 gauges included its parent's pool (stderr above)"


def test_a_forked_childs_g4_degraded_gauge_is_its_own_pools(tmp_path):
    """The parent's G4 pool has its circuit breaker open (``kvbm_backend_g4_degraded`` 1); the child forked from
    it opens a G4 pool of its own (another store) and closes it: the child's gauge is 0 (no pool of its is
    degraded). Old code: 1 (the parent's part at the fork), for as long as the child lives."""
    reg = metrics.new_registry()
    (tmp_path / "parent").mkdir(mode=0o700)
    (tmp_path / "child").mkdir(mode=0o700)
    cfg = G4Config(enabled=True, url=f"file://{tmp_path}/parent", encrypt=False, breaker_failures=1)
    parent = open_pool(cfg, NS, registry=reg)
    try:
        parent.breaker.failure("the test's store failure")
        assert parent.breaker.state == "open"
        assert metrics.sample_value(reg, "kvbm_backend_g4_degraded") == 1
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child = open_pool(cfg.model_copy(update={"url": f"file://{tmp_path}/child"}), NS, registry=reg)
                child.close()
                got = metrics.sample_value(reg, "kvbm_backend_g4_degraded")
                code = 0 if got == 0 else 3
                if code:
                    os.write(2, f"child's kvbm_backend_g4_degraded {got} with no pool of its own open\n".encode())
            finally:
                os._exit(code)
    finally:
        parent.close()
    assert exit_status(pid, HANG_S) == 0, "the child's G4 degraded gauge was its parent's (stderr above)"
