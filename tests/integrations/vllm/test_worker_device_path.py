"""The connector's worker-role load path through the pools' device seam (issue 8).

The worker role loads by ``pool.get(keys, rows of a staging tensor on the KV device)``: the same call
on a CUDA engine (G3 slots read into HBM and verified there; G4 decrypted on the host, one H2D copy)
and on the CPU engine (the same G3 device reader in host mode). These tests drive the real
:class:`WorkerSide` with real pools over real files, on CPU tensors in vLLM's CUDA KV layouts
(FlashAttention ``[2, num_blocks, block_size, heads, head_dim]`` per layer, and MLA), so a wiring bug
of the GPU path (the wrong object handed to the loader, a lease of the wrong shape, pins never
released) fails here. The same tests run on a CUDA device where one is present.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a load's end, flushes, results); returns as soon as it does
# the loads' bounds (worker and G3 load_timeout_s, G4 timeout_s 60 x 2): these tests check bytes and errors, not
# speed, and a read the busy CI VM froze for 13-31 s (2026-11-29) must not fail a load; the late-read test keeps 1 s
LOAD_S = 120.0

torch = pytest.importorskip("torch")

from kvbm_backend.config import G3Config, G4Config
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g3.read.device import DeviceLoader
from kvbm_backend.integrations.vllm.kv_io import EngineKv
from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
from kvbm_backend.integrations.vllm.worker_side import WorkerSide
from kvbm_backend.model import frame
from kvbm_backend.model.frame import FLAG_CHECKSUM, FLAG_DEVCHECK, HEADER_BYTES, FrameHeader
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.base import SlotLease
from kvbm_backend.pool.g3.pool import G3Pool
from tests.helpers.pools import open_g3

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NB, BS, H, D, L = 24, 16, 2, 64, 3  # engine blocks, block_size, kv heads, head_dim, layers


def _engine(device, mla=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mla:
        ts = [torch.randn(NB, 1, BS, 96, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]
        return EngineKv.from_tensors(ts, NB, BS, 1, 96, mla=True)
    ts = [torch.randn(2, NB, BS, H, D, generator=g).to(torch.bfloat16).to(device) for _ in range(L)]
    return EngineKv.from_tensors(ts, NB, BS, H, D)


def _ns(kv):
    return Namespace(model="test/worker-device", revision="r1", layout=kv.layout, tp_world_size=1)


def _g3(tmp_path, ns, **kw):
    return open_g3(tmp_path / "g3", ns, files_per_path=2, load_timeout_s=LOAD_S, **kw)


def _block_bytes(kv, block_id):
    out = torch.empty(kv.layout.bytes_per_block, dtype=torch.uint8, device=kv.device)
    kv.gather([block_id], out)
    return out.cpu().clone()


def _wait(worker, req, timeout=HANG_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if req in worker.get_finished():
            return worker.load_errors()
        time.sleep(0.01)
    raise AssertionError(f"load {req} never finished")


def _save(worker, pool, ids, seqs, tenant="acme", digests=b""):
    """Save engine blocks ``ids`` under ``seqs`` (``digests``: their token digests, as the scheduler sends them)."""
    worker.save([SaveJob("r-save", ids, seqs, tenant, digests=digests)])
    assert worker.flush_saves(HANG_S)  # a CUDA engine hands saves to the pools on its save thread
    pool.flush(timeout=HANG_S)


def _clear(kv, ids):
    for t in kv.tensors:
        if kv.engine_layout == "kv_first":
            t[:, ids] = 0
        else:
            t[ids] = 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mla", [False, True], ids=["kv_first", "mla"])
def test_worker_g3_load_goes_through_the_pool_device_seam(tmp_path, device, mla):
    kv = _engine(device, mla=mla)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, device_checksum="on")
    try:
        w.register(kv)
        src, dst = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14]
        want = [_block_bytes(kv, b) for b in src]
        _save(w, g3, src, [101, 102, 103, 104, 105])
        assert g3.stats()["blocks"] == 5
        # frames written by the worker carry the device checksum, computed where the blocks were
        ls = g3.lease(ns.keys([101], "acme", 0))
        with open(ls[0].path, "rb") as f:
            f.seek(ls[0].offset)
            h = FrameHeader.unpack(f.read(HEADER_BYTES))
        g3.release(ls)
        assert h.flags == FLAG_CHECKSUM | FLAG_DEVCHECK
        assert h.dev_check == frame.device_checksum(want[0].numpy())

        _clear(kv, dst)
        w.start_loads([LoadJob("r1", dst, [101, 102, 103, 104, 105], ["G3"] * 5, "acme")])
        assert _wait(w, "r1") == set()
        for b, x in zip(dst, want):
            assert torch.equal(_block_bytes(kv, b), x), f"engine block {b} differs from the saved block"
        st = g3.stats()
        assert st["device_loads"] == 5 and st["device_hits"] == 5, st  # the seam, not the host pipeline
        assert st["pinned_slots"] == 0  # every lease went back
        rd = g3.device_reader(kv.device)
        assert rd.mode == ("host" if device == "cpu" else rd.mode)
        assert rd.stats().get("host_verified", 0) == 0  # verified by the device checksum where it landed
        assert list(st["device_paths"].values())[0]["mode"] == rd.mode
    finally:
        w.shutdown()
        g3.close()


@pytest.mark.parametrize("device", DEVICES)
def test_worker_corrupt_g3_block_is_a_miss_and_the_engine_block_untouched(tmp_path, device):
    kv = _engine(device)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, device_checksum="on")
    try:
        w.register(kv)
        _save(w, g3, [1, 2, 3, 4], [201, 202, 203, 204])
        ls = g3.lease(ns.keys([203], "acme", 0))[0]
        g3.release([ls])
        with open(ls.path, "r+b") as f:  # flip one payload bit of the third block on disk
            f.seek(ls.offset + HEADER_BYTES + 333)
            b = f.read(1)
            f.seek(ls.offset + HEADER_BYTES + 333)
            f.write(bytes([b[0] ^ 0x04]))
            f.flush()
            os.fsync(f.fileno())
        dst = [20, 21, 22, 23]
        _clear(kv, dst)
        w.start_loads([LoadJob("r2", dst, [201, 202, 203, 204], ["G3"] * 4, "acme")])
        errs = _wait(w, "r2")
        assert errs == {22, 23}  # the corrupt block and everything after it is recomputed
        for t in kv.tensors:
            assert not t[:, 22].any() and not t[:, 23].any()  # never written
        assert not g3.contains(ns.key(203, "acme", 0))  # dropped
        st = g3.stats()
        assert st["corrupt"] == 1 and st["corrupt_by_reason"].get("devcheck") == 1 and st["pinned_slots"] == 0
    finally:
        w.shutdown()
        g3.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("defer", [False, True], ids=["inline", "deferred"])
def test_worker_g4_hits_land_on_the_device_and_are_promoted_past_admission(tmp_path, device, defer):
    """``defer``: the promotion goes to G3 through the worker's save thread (what a CUDA engine does: its rows
    are copied to pinned staging on the stream, not waited for in the load thread), else inline."""
    kv = _engine(device, seed=3)
    ns = _ns(kv)
    g4cfg = G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", timeout_s=60,
                     keyring={"path": str(tmp_path / "keys" / "keyring.json")})
    writer_g4 = G4Pool(g4cfg, ns)
    wr = WorkerSide(ns, 0, None, writer_g4, load_timeout_s=LOAD_S)
    try:
        wr.register(kv)
        src = [5, 6, 7]
        want = [_block_bytes(kv, b) for b in src]
        wr.save([SaveJob("r-save", src, [301, 302, 303], "acme")])
        assert wr.flush_saves(HANG_S) and writer_g4.flush(HANG_S)
    finally:
        wr.shutdown()
        writer_g4.close()
    # a fresh worker (restart): empty G3 with KVBM's frequency admission, G4 holds the blocks
    kv2 = _engine(device, seed=4)
    g3 = G3Pool(G3Config(paths=[str(tmp_path / "g3")], capacity_gb=0.05, files_per_path=1, load_timeout_s=LOAD_S), ns)
    g4 = G4Pool(g4cfg, ns)
    w = WorkerSide(ns, 0, g3, g4, load_timeout_s=LOAD_S)
    try:
        w.register(kv2)
        w.offloads.defer = defer
        dst = [0, 1, 2]
        w.start_loads([LoadJob("r3", dst, [301, 302, 303], ["G4"] * 3, "acme")])
        assert _wait(w, "r3") == set()
        for b, x in zip(dst, want):
            assert torch.equal(_block_bytes(kv2, b), x)
        assert w.flush_saves(HANG_S) and g3.flush(timeout=HANG_S)
        keys = ns.keys([301, 302, 303], "acme", 0)
        assert all(g3.contains(k) for k in keys), g3.stats()  # promoted on the first sighting
        out = [torch.zeros(kv.layout.bytes_per_block, dtype=torch.uint8, device=kv2.device) for _ in keys]
        assert g3.get(keys, out).result(timeout=HANG_S).ok == [True] * 3
        assert all(torch.equal(o.cpu(), x) for o, x in zip(out, want))
    finally:
        w.shutdown()
        g3.close()
        g4.close()


def test_loader_refuses_a_source_that_is_not_a_lease_source(tmp_path):
    kv = _engine("cpu")
    with pytest.raises(TypeError, match="not a SlotLeaseSource"):
        DeviceLoader(object(), kv.layout, "cpu")

    class TupleLeases:  # the shape of the old bug: locations as tuples, not SlotLease
        def __init__(self):
            self.released = []

        def lease(self, keys, timeout_s=None):
            return [("/nonexistent", 0, 8192) for _ in keys]

        def release(self, leases):
            self.released.extend(leases)

        def drop_corrupt(self, key, reason):
            pass

    ns = _ns(kv)
    ld = DeviceLoader(TupleLeases(), kv.layout, "cpu")
    with pytest.raises(TypeError, match="expected SlotLease"):  # loud, never a silent miss
        ld.load(ns.keys([1], "t", 0), [torch.zeros(kv.layout.bytes_per_block, dtype=torch.uint8)])
    ld.close()


def test_g3_lease_pins_until_release_and_counts_absent(tmp_path):
    kv = _engine("cpu")
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    try:
        blocks = [np.full(kv.layout.bytes_per_block, i, np.uint8) for i in range(2)]
        keys = ns.keys([1, 2], "t", 0)
        assert g3.put(keys, blocks).result(timeout=HANG_S).written == 2
        g3.flush(timeout=HANG_S)
        ls = g3.lease(keys + [ns.key(99, "t", 0)])
        assert isinstance(ls[0], SlotLease) and ls[0].key == keys[0] and ls[2] is None
        assert ls[0].slot_len == frame.slot_bytes(kv.layout.bytes_per_block) and ls[0].offset % 4096 == 0
        assert g3.stats()["pinned_slots"] == 2 and g3.stats()["misses_by_reason"]["absent"] == 1
        g3.delete([keys[0]]).result(timeout=HANG_S)  # deleted while leased: freed only at release
        assert g3.slot_accounting()["deferred"] == 1
        g3.release([x for x in ls if x is not None])
        acc = g3.slot_accounting()
        assert g3.stats()["pinned_slots"] == 0 and acc["deferred"] == 0 and acc["leaked"] == 0
    finally:
        g3.close()


def test_device_checksum_setting_decides_the_frame_flags(tmp_path):
    """``g3.device_checksum``: ``on`` writes FLAG_DEVCHECK from a CPU engine, ``off`` never, ``auto``
    only for a CUDA engine (so here: not)."""
    from kvbm_backend.integrations.vllm.extra_config import config_from_extra
    cfg, _ = config_from_extra({"kvbm_backend": {"g3": {"device_checksum": "off", "device_path": "pinned-bounce"}}})
    assert cfg.g3.device_checksum == "off" and cfg.g3.device_path == "pinned-bounce"
    for setting, want in (("on", FLAG_CHECKSUM | FLAG_DEVCHECK), ("off", FLAG_CHECKSUM), ("auto", FLAG_CHECKSUM)):
        kv = _engine("cpu")
        ns = _ns(kv)
        g3 = _g3(tmp_path / setting, ns)
        w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, device_checksum=setting)
        try:
            w.register(kv)
            _save(w, g3, [1], [7])
            ls = g3.lease(ns.keys([7], "acme", 0))
            with open(ls[0].path, "rb") as f:
                f.seek(ls[0].offset)
                assert FrameHeader.unpack(f.read(HEADER_BYTES)).flags == want, setting
            g3.release(ls)
            # whatever the flags, the device seam loads it (devcheck on the device, else xxh3 on the host)
            _clear(kv, [9])
            w.start_loads([LoadJob("r", [9], [7], ["G3"], "acme")])
            assert _wait(w, "r") == set()
            hv = g3.device_reader(kv.device).stats().get("host_verified", 0)
            assert hv == (0 if setting == "on" else 1), (setting, hv)
        finally:
            w.shutdown()
            g3.close()
    with pytest.raises(ValueError, match="device_checksum"):
        WorkerSide(ns, 0, None, None, device_checksum="sometimes")


def test_device_path_setting_reaches_the_reader(tmp_path):
    """``g3.device_path`` is what the pool's device reader is built with; on a CPU device the mode is
    ``host`` whatever is asked (no CUDA path exists), and the probe is reported in stats."""
    kv = _engine("cpu")
    ns = _ns(kv)
    for setting in ("auto", "gds", "kvikio-compat", "pinned-bounce"):
        g3 = _g3(tmp_path / setting, ns, device_path=setting)
        try:
            rd = g3.device_reader("cpu")
            assert rd.mode == "host" and g3.stats()["device_paths"]["cpu"]["mode"] == "host"
            assert g3.device_reader("cpu") is rd  # one per device, probed once
        finally:
            g3.close()
    from kvbm_backend.gpu.probe import probe_device_path
    # on a CUDA device (or this machine's refusal of one) the forced bounce mode is taken as asked
    assert probe_device_path(str(tmp_path), "cuda", prefer="pinned-bounce").mode == "pinned-bounce"


@pytest.mark.parametrize("device", DEVICES)
def test_device_io_threads_size_a_cuda_load_and_io_threads_a_cpu_load(tmp_path, device, caplog):
    """``g3.device_io_threads`` is the reads in flight of a load into a CUDA device (here the forced bounce
    path: its reader threads; kvikio's pool: tests/gpu/test_gpu_path.py), ``g3.io_threads`` those of a load
    into a CPU device; the start-up line names the number, and a load through the worker runs with it."""
    caplog.set_level("INFO", logger="kvbm_backend.pool.g3.read.reader")  # the reader may be made at register
    kv = _engine(device)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns, io_threads=3, device_io_threads=5, device_path="pinned-bounce")
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S)
    try:
        w.register(kv)
        _save(w, g3, [1, 2, 3], [11, 12, 13])
        want = [_block_bytes(kv, b) for b in (1, 2, 3)]
        _clear(kv, [4, 5, 6])
        w.start_loads([LoadJob("r", [4, 5, 6], [11, 12, 13], ["G3"] * 3, "acme")])
        assert _wait(w, "r") == set()
        rd = g3.device_reader(device)
        threads = 5 if device == "cuda" else 3
        assert rd.threads == threads and rd.reads.pool is not None and rd.reads.pool._max_workers == threads
        assert f"{threads} reads in flight" in caplog.text
        assert all(torch.equal(_block_bytes(kv, b), x) for b, x in zip((4, 5, 6), want))
    finally:
        w.shutdown()
        g3.close()


def test_restored_salted_tenant_blocks_reach_the_scheduler_mirror(tmp_path):
    """The G3 journal keeps tenant tags, not names: after a restart the worker's first report (the
    split-process scheduler's view of G3) must still let a salted tenant's prefix hit."""
    from kvbm_backend.integrations.vllm.scheduler_side import G3Mirror
    kv = _engine("cpu")
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S)
    try:
        w.register(kv)
        _save(w, g3, [1, 2, 3], [11, 12, 13], tenant="salted-tenant")
    finally:
        w.shutdown()
        g3.close()
    g3 = _g3(tmp_path, ns)  # restart: entries come back keyed by tag
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, report_g3=True)
    try:
        w.register(kv)
        mirror = G3Mirror(ns)
        mirror.apply(w.worker_meta())
        assert mirror.ready and len(mirror) == 3
        keys = ns.keys([11, 12, 13], "salted-tenant", 0)
        assert mirror.lookup_prefix(keys).result() == 3
        assert mirror.lookup_prefix(ns.keys([11], "other-tenant", 0)).result() == 0
        # and the worker then loads them (adopting the tag-keyed entries under the real key)
        _clear(kv, [20, 21, 22])
        w.start_loads([LoadJob("r", [20, 21, 22], [11, 12, 13], ["G3"] * 3, "salted-tenant")])
        assert _wait(w, "r") == set()
    finally:
        w.shutdown()
        g3.close()


def test_cpu_engine_load_staging_is_reused_across_loads_of_other_lengths(tmp_path):
    """A CPU engine's load staging comes from the worker's pool, sized to a power of two blocks: a load of 5
    and one of 7 blocks share one buffer (no fresh pages to fault), and the second load's blocks are its own
    (the first load's bytes left in the buffer never reach the engine)."""
    kv = _engine("cpu", seed=5)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S)
    try:
        w.register(kv)
        src = [1, 2, 3, 4, 5, 6, 7]
        want = [_block_bytes(kv, b) for b in src]
        _save(w, g3, src, [401, 402, 403, 404, 405, 406, 407])
        dst = [10, 11, 12, 13, 14, 15, 16]
        _clear(kv, dst)
        w.start_loads([LoadJob("a", dst[:5], [401, 402, 403, 404, 405], ["G3"] * 5, "acme")])
        assert _wait(w, "a") == set()
        pool = w._load_staging
        assert (pool.allocated, pool.reused) == (1, 0)
        _clear(kv, dst)
        w.start_loads([LoadJob("b", dst, [407, 406, 405, 404, 403, 402, 401], ["G3"] * 7, "acme")])
        assert _wait(w, "b") == set()
        assert (pool.allocated, pool.reused) == (1, 1)  # 5 and 7 blocks: both in the 8-block buffer
        for b, x in zip(dst, reversed(want)):
            assert torch.equal(_block_bytes(kv, b), x), f"engine block {b} differs from the saved block"
    finally:
        w.shutdown()
        g3.close()


def test_cpu_engine_load_staging_is_back_in_the_pool_when_the_load_is_reported_finished(tmp_path):
    """When ``get_finished`` reports a CPU engine's load, its staging buffer is already back in the pool, even
    if the load thread is then held up (descheduled on a busy host; here: held in the G3 report of the load's
    misses, which runs after the load is over): the next load, started on that report, reuses the buffer
    rather than allocating and faulting in a fresh one. Before 2026-11-30 the buffer went back only at the
    end of the load thread, after the load was reported: under load the next load took a new buffer (the
    flake of test_cpu_engine_load_staging_is_reused_across_loads_of_other_lengths, (2, 0) != (1, 1))."""
    import threading
    kv = _engine("cpu", seed=7)
    ns = _ns(kv)
    g3 = _g3(tmp_path, ns)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=LOAD_S, report_g3=True)
    hold, held = threading.Event(), threading.Event()
    report = w._report_load_misses

    def held_up(missed):  # the load thread, after its load is over, stalls here until the test is done
        held.set()
        hold.wait(HANG_S)
        report(missed)

    w._report_load_misses = held_up
    try:
        w.register(kv)
        src = [1, 2, 3, 4, 5, 6, 7]
        want = [_block_bytes(kv, b) for b in src]
        _save(w, g3, src, [601, 602, 603, 604, 605, 606, 607])
        dst = [10, 11, 12, 13, 14, 15, 16]
        _clear(kv, dst)
        w.start_loads([LoadJob("a", dst[:5], [601, 602, 603, 604, 605], ["G3"] * 5, "acme")])
        assert _wait(w, "a") == set()
        pool = w._load_staging
        assert held.wait(HANG_S)  # a's thread is past its load's end, and stays there
        assert pool.allocated == 1
        assert pool.stats()["kept_bytes"] == 8 * kv.layout.bytes_per_block  # a's 8-block buffer is back
        _clear(kv, dst)
        w.start_loads([LoadJob("b", dst, [607, 606, 605, 604, 603, 602, 601], ["G3"] * 7, "acme")])
        assert _wait(w, "b") == set()  # on the executor's other thread
        assert (pool.allocated, pool.reused) == (1, 1)  # b took a's buffer
        for b, x in zip(dst, reversed(want)):
            assert torch.equal(_block_bytes(kv, b), x), f"engine block {b} differs from the saved block"
    finally:
        hold.set()
        w.shutdown()
        g3.close()


def test_cpu_engine_load_staging_a_late_read_may_land_in_is_never_handed_out_again(tmp_path):
    """A load whose G4 reads hang past the worker's ``load_timeout_s`` (object opens blocked in the kernel,
    as on a hung mount) fails its blocks; its staging buffer, which the reads may still land in, is not given
    back to the pool: the next load takes a buffer of its own.

    The 1 s load bound must pass while the G4 get is in flight: a load thread the busy host held up past it
    before issuing the get (no read in flight: the load ends at its deadline check, and may rightly give its
    buffer back) did not play the scenario, seen as no ``load_get_errors``; it is played again with a fresh
    worker, up to ``ATTEMPTS`` times."""
    from kvbm_backend.integrations.vllm import stats
    from tests.helpers.held_open import HeldOpen
    ATTEMPTS = 5
    kv = _engine("cpu", seed=6)
    ns = _ns(kv)
    g4 = G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", timeout_s=30, retries=0,
                         keyring={"path": str(tmp_path / "keys" / "keyring.json")}), ns)
    src, seqs = [1, 2, 3], [501, 502, 503]
    want = [_block_bytes(kv, b) for b in src]
    try:
        for attempt in range(ATTEMPTS):
            w = WorkerSide(ns, 0, None, g4, load_timeout_s=1.0)
            try:
                w.register(kv)
                if attempt == 0:
                    _save(w, g4, src, seqs)
                held = HeldOpen([g4.store._path(g4.object_name(k))
                                 for k in w.offloads.g4_keys(ns.keys(seqs, "acme", 0))])
                errs = stats.get("load_get_errors")
                try:
                    w.start_loads([LoadJob("late", [10, 11, 12], seqs, ["G4"] * 3, "acme")])
                    # the load thread ends the load itself (nobody polls get_finished meanwhile, which would
                    # mark it timed out first): it met a get that never answered in time
                    end = time.monotonic() + HANG_S
                    while w._loads["late"].state == "pending" and time.monotonic() < end:
                        time.sleep(0.01)
                    assert _wait(w, "late") == {10, 11, 12}  # late: recomputed, never waited for
                finally:
                    held.release()
                if stats.get("load_get_errors") == errs:
                    continue  # held up past the bound before its get: no read was late, play it again
                pool = w._load_staging
                assert pool.allocated == 1 and pool.stats()["kept_bytes"] == 0  # taken, never given back
                _clear(kv, [13, 14, 15])
                w.load_timeout_s = LOAD_S  # the bound was the late load's; this one must load (busy CI VM: 1 s is not)
                w.start_loads([LoadJob("again", [13, 14, 15], seqs, ["G4"] * 3, "acme")])
                assert _wait(w, "again") == set()
                assert (pool.allocated, pool.reused) == (2, 0)  # a buffer of its own, not the abandoned one
                for b, x in zip([13, 14, 15], want):
                    assert torch.equal(_block_bytes(kv, b), x)
                return
            finally:
                w.shutdown()
        pytest.fail(f"in {ATTEMPTS} attempts the load thread never issued its G4 get within the 1 s load bound")
    finally:
        g4.close()
