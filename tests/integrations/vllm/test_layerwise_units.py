"""The connector's layer-wise load path (``g3.layerwise_load``, issue 24 item 5) without an engine: the
scheduler offers G3-only hits synchronously, and the worker role loads them layer by layer into vLLM's
paged KV tensors (CPU and FlashAttention layouts) from a real G3 pool on tmp files; a corrupted block is
reported through ``load_errors`` / the failed-load report, never kept, and the saves of that step (any request
may have computed from the failed blocks) and the request's later ones are dropped, in both orders vLLM ends a
step in (``defer_kv_connector_finalize``: load errors asked for before ``wait_for_save``)."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.config import load_config
from kvbm_backend.integrations import load_priority
from kvbm_backend.integrations.vllm import stats
from kvbm_backend.integrations.vllm.kv_io import EngineKv
from kvbm_backend.integrations.vllm.layerwise import for_worker
from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
from kvbm_backend.integrations.vllm.worker_side import WorkerSide
from kvbm_backend.integrations.vllm.workers import GroupedWorkers
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.integrations.tiers import open_tiers
from tests.helpers.pools import G3_LOAD_S, G4_TIMEOUT_S, LOOKUP_S, flip_g3_payload

NB, BS, H, D, L = 16, 16, 2, 64, 4
HANG_S = 600.0  # a hang guard, not a bound: waits for answers and results that must come
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def _cfg(tmp_path, layerwise=True, g4=False):
    """G3 (and G4) with load bounds that are no subject here: G3_LOAD_S (was 20 s, less than the 13-31 s the busy CI
    VM froze processes for) and G4_TIMEOUT_S; the test of a layer-wise timeout passes its own."""
    d = {"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
                "admission": {"policy": "all"}, "layerwise_load": layerwise, "load_timeout_s": G3_LOAD_S}}
    if g4:
        d["g4"] = {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False, "timeout_s": G4_TIMEOUT_S}
    return load_config(d, use_env=False)


def _engine(layout: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if layout == "cpu":
        ts = [torch.randn(NB, H, BS, 2 * D, generator=g) for _ in range(L)]
    else:
        ts = [torch.randn(2, NB, BS, H, D, generator=g) for _ in range(L)]
    return EngineKv.from_tensors(ts, NB, BS, H, D)


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def _match(s, req, computed):
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        n, is_async = s.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, is_async
        time.sleep(0.01)
    raise AssertionError("no answer")


@pytest.mark.parametrize("layerwise", [True, False])
def test_layerwise_load_setting_makes_g3_hits_sync(tmp_path, layerwise):
    kv = _engine("cpu", 0)
    ns = Namespace("m", kv.layout)
    cfg = _cfg(tmp_path, layerwise=layerwise, g4=True)
    g3, g4 = open_tiers(cfg, ns)
    try:
        toks = list(range(100, 100 + BS * 6 + 5))
        hs = sequence_hashes(toks, BS)
        blk = [np.full(kv.layout.bytes_per_block, i, np.uint8) for i in range(6)]
        assert g3.put(ns.keys(hs[:3]), blk[:3]).result(HANG_S).written == 3
        assert g4.put(ns.keys(hs[:5]), blk[:5]).result(HANG_S).written == 5
        g3.flush(HANG_S)
        s = SchedulerSide(ns, BS, g3, g4, layerwise=cfg.g3.layerwise_load, lookup_timeout_s=LOOKUP_S)
        # G3 alone serves blocks 1..2 of r1 (block 0 is the engine's): offered sync when layerwise_load is on
        r1 = SimpleNamespace(request_id="r1", prompt_token_ids=toks[:BS * 3 + 1], cache_salt=None, lora_request=None)
        assert _match(s, r1, BS) == (2 * BS, not layerwise)
        s.update_state_after_alloc(r1, _Blocks([10, 11, 12, 13]), 2 * BS)
        # a hit that needs G4 stays asynchronous either way
        r2 = SimpleNamespace(request_id="r2", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        assert _match(s, r2, BS) == (4 * BS, True)
        s.update_state_after_alloc(r2, _Blocks(list(range(20, 27))), 4 * BS)
        out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                    resumed_req_ids=set()))
        j1, j2 = s.build_connector_meta(out).loads
        assert (j1.layerwise, j2.layerwise) == (layerwise, False)
        assert j1.tiers == ["G3", "G3"] and j1.block_ids == [11, 12]
    finally:
        g3.close()
        g4.close()


def _stored(tmp_path, layout):
    """A G3 pool holding blocks 3..7 of ``src`` under ``hashes`` (tenant "t", rank 0)."""
    src = _engine(layout, 1)
    ns = Namespace("test/layerwise", src.layout)
    cfg = _cfg(tmp_path)
    g3, _ = open_tiers(cfg, ns)
    writer = WorkerSide(ns, 0, g3, None)
    writer.register(src)
    hashes = [1000 + i for i in range(5)]
    writer.save([SaveJob("w", [3, 4, 5, 6, 7], hashes, "t")])
    assert g3.flush(HANG_S)
    return src, ns, cfg, g3, hashes


def _corrupt(g3, ns, src, seq_hash):
    """Flip a byte in the last layer of the stored block ``seq_hash``; returns its key."""
    key = ns.keys([seq_hash], "t", 0)[0]
    flip_g3_payload(g3, key, src.layout.bytes_per_block)
    return key


def _rig(tmp_path, layout):
    src, ns, cfg, g3, hashes = _stored(tmp_path, layout)
    dst = _engine(layout, 2)
    w = WorkerSide(ns, 0, g3, None)
    w.register(dst)
    lw = for_worker(cfg, w, NAMES, async_scheduling=False)
    assert lw is not None
    return src, dst, ns, g3, w, lw, hashes


def _same(a: EngineKv, ab: int, b: EngineKv, bb: int) -> bool:
    x = torch.empty(a.layout.bytes_per_block, dtype=torch.uint8)
    y = torch.empty_like(x)
    a.gather([ab], x)
    b.gather([bb], y)
    return torch.equal(x, y)


@pytest.mark.parametrize("layout", ["cpu", "kv_first"])
def test_layers_land_in_the_engine_as_vllm_waits_for_them(tmp_path, layout):
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, layout)
    interval = sys.getswitchinterval()
    try:
        before = stats.snapshot().get("layerwise_layer_waits", 0)
        job = LoadJob("r", [9, 10, 11, 12, 13], hashes, ["G3"] * 5, "t", layerwise=True)
        other = LoadJob("a", [1], [7], ["G3"], "t")
        assert lw.start([job, other]) == [other]
        # in flight from start to the step's end: the forward's Python yields the GIL to the reads sooner
        # (load_gil_switch_ms, default 0.5 ms; tests/integrations/vllm/test_load_priority.py)
        assert load_priority.stats()["loads_in_flight"] == 1
        assert sys.getswitchinterval() == pytest.approx(min(interval, 0.0005))
        lw.wait_layer(NAMES[0])
        lw.wait_layer("model.layers.99.not_ours")  # not a KV layer of ours: ignored
        # layer 0 is in the engine blocks before the other layers are waited for
        t0 = dst.tensors[0].view(NB, -1) if layout == "cpu" else dst.tensors[0].transpose(0, 1).reshape(NB, -1)
        s0 = src.tensors[0].view(NB, -1) if layout == "cpu" else src.tensors[0].transpose(0, 1).reshape(NB, -1)
        assert torch.equal(t0[9], s0[3])
        assert not torch.equal(dst.tensors[1], src.tensors[1])
        for n in NAMES[1:]:
            lw.wait_layer(n)
        assert lw.saves([SaveJob("r", [14], [2000], "t")]) == [SaveJob("r", [14], [2000], "t")]
        assert load_priority.stats()["loads_in_flight"] == 0 and sys.getswitchinterval() == pytest.approx(interval)
        assert all(_same(src, 3 + i, dst, 9 + i) for i in range(5))
        assert w.load_errors() == set() and w.take_failed_loads() == []
        snap = stats.snapshot()
        assert snap["layerwise_layer_waits"] - before == L
    finally:
        lw.close()
        g3.close()


def test_corrupt_block_is_reported_and_the_steps_saves_are_dropped(tmp_path):
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, "cpu")
    try:
        key = _corrupt(g3, ns, src, hashes[2])
        job = LoadJob("r", [9, 10, 11, 12, 13], hashes, ["G3"] * 5, "t", layerwise=True)
        lw.start([job])
        for n in NAMES:
            lw.wait_layer(n)
        before = stats.snapshot().get("save_dropped_blocks", 0)
        # r's KV of this step came from a bad block, and so may q's: vLLM caches r's blocks as soon as they are
        # allocated, so q, scheduled in the same step with the same prefix, may use them as its prefix hit and
        # compute its own blocks from them (before, q's save of such a block was kept: wrong KV in G3)
        assert lw.saves([SaveJob("r", [14], [2000], "t"), SaveJob("q", [15], [3000], "t")]) == []
        assert stats.snapshot()["save_dropped_blocks"] - before == 2
        assert w.load_errors() == {11, 12, 13}  # from the first failed block on: vLLM recomputes them
        (fl,) = w.take_failed_loads()
        assert (fl.req_id, fl.first_failed, fl.reason) == ("r", hashes[2], "miss")
        assert _same(src, 3, dst, 9) and _same(src, 4, dst, 10)
        assert not g3.contains(key)  # proven corrupt: dropped
        # later steps: r's saves stay dropped, the others' are kept again
        assert lw.saves([SaveJob("r", [15], [2001], "t"), SaveJob("q", [15], [3001], "t")]) == \
            [SaveJob("q", [15], [3001], "t")]
    finally:
        lw.close()
        g3.close()


@pytest.mark.parametrize("deferred", [False, True], ids=["wait_for_save_first", "load_errors_first"])
def test_every_save_of_the_failed_step_is_dropped_in_either_call_order(tmp_path, deferred):
    """vLLM ends a step with ``wait_for_save`` then ``get_block_ids_with_load_errors``, except with speculative
    decoding (``defer_kv_connector_finalize``): ``wait_for_save`` is deferred until after the draft model, so
    ``get_block_ids_with_load_errors`` ends the step's layer-wise loads first. Before, the failure was seen
    only by that first call, and q's save of the step (computed, perhaps, from r's unverified rows) reached
    G3 with a valid checksum: wrong KV served later. Real worker role, layer-wise loads and G3 pool."""
    src, ns, cfg, g3, hashes = _stored(tmp_path, "cpu")
    gw = GroupedWorkers([WorkerSide(ns, 0, g3, None)], block_errors=True,
                        layerwise=lambda w, names: for_worker(cfg, w, names, async_scheduling=False))
    gw.register([_engine("cpu", 2)], [NAMES])
    try:
        _corrupt(g3, ns, src, hashes[2])

        def step(loads, saves, stored):
            gw.start_loads(loads)  # start_load_kv
            for n in NAMES:  # the forward
                gw.wait_layer(n)
            if deferred:
                errs = gw.load_errors()
                gw.save(saves)
            else:
                gw.save(saves)
                errs = gw.load_errors()
            assert gw.workers[0].flush_saves(HANG_S) and g3.flush(HANG_S)
            assert [g3.contains(k) for k in ns.keys([s.seq_hashes[0] for s in saves], "t", 0)] == stored
            return errs

        r = LoadJob("r", [9, 10, 11, 12, 13], hashes, ["G3"] * 5, "t", layerwise=True)
        saves = [SaveJob("r", [14], [2000], "t"), SaveJob("q", [15], [3000], "t")]
        assert step([r], saves, [False, False]) == {11, 12, 13}
        # the next step (a good layer-wise load of p in it): saves reach G3 again, but r's stay dropped
        p = LoadJob("p", [1, 2], hashes[:2], ["G3"] * 2, "t", layerwise=True)
        saves = [SaveJob("r", [14], [2001], "t"), SaveJob("q", [15], [3001], "t"), SaveJob("p", [3], [4001], "t")]
        assert step([p], saves, [False, True, True]) == set()
    finally:
        gw.shutdown()
        g3.close()


def test_layers_vllm_did_not_wait_for_are_loaded_at_the_end(tmp_path):
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, "cpu")
    try:
        before = stats.snapshot().get("layerwise_layers_unwaited", 0)
        lw.start([LoadJob("r", [9, 10], hashes[:2], ["G3"] * 2, "t", layerwise=True)])
        lw.wait_layer(NAMES[0])
        assert lw.finish() == set()
        assert _same(src, 3, dst, 9) and _same(src, 4, dst, 10)
        assert stats.snapshot()["layerwise_layers_unwaited"] - before == L - 1
    finally:
        lw.close()
        g3.close()


def test_one_tp_rank_only(tmp_path):
    """With TP > 1 a rank whose layer-wise load failed cannot stop the other ranks from saving their slices of
    KV computed, through the all-reduce, from its bad rows: the setting applies to one-rank engines only, and
    both the scheduler and the workers ask :func:`usable`, so hits load asynchronously there."""
    from kvbm_backend.integrations.vllm.layerwise import usable
    kv = _engine("cpu", 0)
    cfg = _cfg(tmp_path)
    assert usable(cfg, 1, async_scheduling=False) and not usable(cfg, 2, async_scheduling=False)
    assert not usable(_cfg(tmp_path, layerwise=False), 1, async_scheduling=False)
    assert not usable(cfg, 1, async_scheduling=True)  # vLLM's async scheduling: test_connector_wiring.py
    ns2 = Namespace("m", kv.layout, tp_world_size=2)
    g3, _ = open_tiers(cfg, ns2)
    try:
        assert for_worker(cfg, WorkerSide(ns2, 0, g3, None), NAMES, async_scheduling=False) is None
    finally:
        g3.close()


def test_off_by_default_and_needs_a_g3_pool(tmp_path):
    kv = _engine("cpu", 0)
    ns = Namespace("m", kv.layout)
    assert load_config({}, use_env=False).g3.layerwise_load is False
    cfg = _cfg(tmp_path, layerwise=False)
    g3, _ = open_tiers(cfg, ns)
    try:
        assert for_worker(cfg, WorkerSide(ns, 0, g3, None), NAMES, async_scheduling=False) is None
        assert for_worker(_cfg(tmp_path), WorkerSide(ns, 0, None, None), NAMES, async_scheduling=False) is None
    finally:
        g3.close()


def test_a_block_a_layerwise_read_failed_on_stays_reported_while_g3_holds_it(tmp_path, monkeypatch):
    """A layer-wise load whose read of a block fails reports the blocks from it on failed (vLLM recomputes them)
    but removed to the scheduler's mirror / the router's KV events only those G3 no longer holds, as an
    asynchronous load does (``WorkerSide._report_load_misses``). Before, every failed row but a timeout was
    reported removed: the mirror and the events lost blocks G3 holds (the ones after the failed read). The block
    whose read failed (EIO: G3 cannot prove it bad) is kept and stays reported since 2026-12-01 (an I/O error is no
    proof of bad bytes, docs/invariants.md #1: ``G3Pool.drop_unreadable`` deletes it only once it stayed unreadable
    over several failed loads; from 2026-11-30 the worker deleted it at once and reported it removed); a block G3
    dropped as corrupt is reported removed."""
    from kvbm_backend.io.files import ReadFiles
    from kvbm_backend.integrations.vllm.metadata import mirror_id
    src, ns, cfg, g3, hashes = _stored(tmp_path, "cpu")
    w = WorkerSide(ns, 0, g3, None, report_g3=True)  # report_g3: a split scheduler or G3 KV events
    w.register(_engine("cpu", 2))
    lw = for_worker(cfg, w, NAMES, async_scheduling=False)
    assert lw is not None
    try:
        assert w.worker_meta().snapshot  # the first report (the whole index) is out
        keys = ns.keys(hashes, "t", 0)
        ls = g3.lease([keys[1]])[0]
        g3.release([ls])
        bad_path, lo, hi = ls.path, ls.offset, ls.offset + HEADER_BYTES + ns.layout.bytes_per_block
        real = ReadFiles.preadv

        def eio(self, path, bufs, offset, direct):  # the disk fails reads of block 1's slot
            if path == bad_path and lo <= offset < hi:
                raise OSError(5, "Input/output error")
            return real(self, path, bufs, offset, direct)
        monkeypatch.setattr(ReadFiles, "preadv", eio)
        real_os = os.preadv

        def os_eio(fd, bufs, offset, *a):  # every read of the slot: G3's re-read before it drops a block too
            try:
                on_bad = os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")) == os.path.realpath(bad_path)
            except OSError:
                on_bad = False
            if on_bad and lo <= offset < hi:
                raise OSError(5, "Input/output error")
            return real_os(fd, bufs, offset, *a)
        monkeypatch.setattr(os, "preadv", os_eio)
        corrupt = _corrupt(g3, ns, src, hashes[3])  # and block 3 is corrupt: dropped, so gone

        lw.start([LoadJob("r", [9, 10, 11, 12, 13], hashes, ["G3"] * 5, "t", layerwise=True)])
        for n in NAMES:
            lw.wait_layer(n)
        assert lw.finish() == {"r"}
        assert w.load_errors() == {10, 11, 12, 13}  # from the failed read on: recomputed
        assert g3.contains(keys[1]) and not g3.contains(corrupt)  # a read error proves nothing: kept
        assert all(g3.contains(k) for k in (keys[0], keys[2], keys[4]))  # read fine, or not read: kept
        meta = w.worker_meta()
        removed = set(meta.removed) if meta is not None else set()
        assert mirror_id(corrupt) in removed  # gone from G3: reported removed
        # G3 holds them (keys[1]: unreadable now, kept): they stay reported
        assert not removed & {mirror_id(k) for k in (keys[0], keys[1], keys[2], keys[4])}
    finally:
        lw.close()
        w.shutdown()
        g3.close()


def test_a_layerwise_load_that_runs_out_of_time_is_counted_a_timeout(tmp_path, monkeypatch):
    """A layer-wise load whose reads outlive its deadline is a timeout (``FailedLoad`` reason ``timeout``, the
    block not cooled) and is counted in ``load_timeouts``, as an asynchronous load is (docs/operations.md). Before,
    the layer-wise path reported the reason but never counted it: ``load_timeouts`` read 0."""
    import threading
    from kvbm_backend.io.files import ReadFiles
    from kvbm_backend.integrations.vllm.layerwise import LayerwiseLoads
    _, ns, _, g3, hashes = _stored(tmp_path, "cpu")
    w = WorkerSide(ns, 0, g3, None)
    w.register(_engine("cpu", 2))
    lw = LayerwiseLoads(w, NAMES, timeout_s=0.3)  # the deadline that must run out: reads are gated past it
    gate = threading.Event()
    real = ReadFiles.preadv

    def slow(self, *a, **k):  # a slow disk: reads wait until the test opens the gate
        gate.wait(600.0)  # a hang guard, not a bound
        return real(self, *a, **k)
    monkeypatch.setattr(ReadFiles, "preadv", slow)
    try:
        before = stats.snapshot().get("load_timeouts", 0)
        lw.start([LoadJob("r", [9, 10], hashes[:2], ["G3"] * 2, "t", layerwise=True)])
        for n in NAMES:
            lw.wait_layer(n)
        assert lw.finish() == {"r"}
        assert w.load_errors() == {9, 10}
        assert [(f.first_failed, f.reason) for f in w.take_failed_loads()] == [(hashes[0], "timeout")]
        assert stats.snapshot().get("load_timeouts", 0) - before == 1
    finally:
        gate.set()
        lw.close()
        w.shutdown()
        g3.close()


def test_a_layerwise_load_naming_an_engine_block_out_of_range_fails_whole_before_any_read(tmp_path):
    """A job whose engine block ids leave the engine's blocks fails at start (the request recomputes), never in
    the forward: its layer scatters index with a device tensor the torch ops check only as they copy (a
    device-side assert on CUDA, where vLLM 0.32's packed caches always take them; an IndexError on the CPU)."""
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, "cpu")
    try:
        before = dst.tensors[0].clone()
        job = LoadJob("r", [9, 10, NB + 3, 12, 13], hashes, ["G3"] * 5, "t", layerwise=True)
        assert lw.start([job]) == []
        for n in NAMES:
            lw.wait_layer(n)  # no IndexError into vLLM's forward
        assert lw.saves([]) == []
        assert w.load_errors() == {9, 10, NB + 3, 12, 13}
        (fl,) = w.take_failed_loads()
        assert fl.req_id == "r"
        assert torch.equal(dst.tensors[0], before)  # nothing written
    finally:
        lw.close()
        g3.close()
