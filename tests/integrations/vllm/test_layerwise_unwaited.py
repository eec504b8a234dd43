"""Layer-wise G3 loads (``g3.layerwise_load``) whose layer vLLM never waited for (review 2026-12-03, H7).

vLLM calls the connector's ``wait_for_layer_load`` from each attention layer's Python wrapper
(``maybe_transfer_kv_layer``); a forward replayed as a FULL CUDA graph (``compilation_config.cudagraph_mode``
``FULL``; ``FULL_AND_PIECEWISE``, vLLM's GPU default, and ``FULL_DECODE_ONLY`` for decode-only batches) runs no
Python, so it calls none. The
attention of such a layer reads the engine block before the layer's rows were scattered into it: the step's token
and the KV of every later position come from stale rows. Before, the connector scattered the layer after the
forward and, the payloads verifying, reported the load good: a wrong token and wrong KV saved, counted only by
``layerwise_layers_unwaited``. Now every block of such a load is a load error (vLLM recomputes them and throws the
step's token away) and the step's saves are dropped, as for a failed verification; the G3 blocks themselves are
good and stay. Under speculative decoding ``get_block_ids_with_load_errors`` comes before the draft model's forward
(``defer_kv_connector_finalize``), so layers after the last one waited for (the draft model's) are loaded then, as
before. And where vLLM says at start that it runs prefills as FULL graphs (``FULL``), layer-wise loads are not
offered at all (:func:`~kvbm_backend.integrations.vllm.layerwise.usable`).
"""
from __future__ import annotations

import logging
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.layerwise import for_worker, usable  # noqa: E402
from kvbm_backend.integrations.vllm.load_failures import FAILED_BLOCKS, LOADED_BLOCKS  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob  # noqa: E402
from kvbm_backend.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvbm_backend.integrations.vllm.workers import GroupedWorkers  # noqa: E402
from tests.helpers.lifecycle_sim import BS, Sim, build, hasher, looked_up, mkreq, warm  # noqa: E402
from tests.integrations.vllm.test_layerwise_units import (  # noqa: E402
    L, NAMES, _cfg, _engine, _rig, _same, _stored)

pytestmark = [pytest.mark.vllm]


def _delta(before: dict, name: str) -> int:
    return stats.snapshot().get(name, 0) - before.get(name, 0)


@pytest.mark.parametrize("waited, order", [
    (NAMES[:2] + NAMES[3:], "wait_for_save_first"),   # one layer skipped, the usual end of a step
    ([], "wait_for_save_first"),                      # a FULL CUDA graph: no hook at all
    ([], "load_errors_first"),                        # the same under speculative decoding's deferred order
    (NAMES[:1] + NAMES[2:], "load_errors_first"),     # a gap before the last layer waited for
], ids=["one-skipped", "none-waited", "none-waited-deferred", "gap-deferred"])
def test_a_load_with_a_layer_vllm_never_waited_for_fails_every_block(tmp_path, caplog, waited, order):
    """Worker role (real G3 pool, CPU KV tensors): every payload verifies, but the forward did not wait for some
    layer. Every engine block of the job is a load error and in the failed-load report from its first block
    (reason ``unwaited``: the G3 blocks are good, not cooled), the step's saves are dropped, the G3 blocks stay,
    the layer is not scattered after the forward; counted (``layerwise_unwaited_jobs``, ``load_blocks_failed``) and
    logged once a minute naming the layers and cudagraph_mode. Before: the load was reported good (no load errors,
    the saves kept)."""
    src, ns, cfg, g3, hashes = _stored(tmp_path, "cpu")
    dst = _engine("cpu", 2)
    gw = GroupedWorkers([WorkerSide(ns, 0, g3, None)], block_errors=True,
                        layerwise=lambda w, names: for_worker(cfg, w, names, async_scheduling=False))
    gw.register([dst], [NAMES])
    w = gw.workers[0]
    skipped = [i for i, n in enumerate(NAMES) if n not in waited]
    try:
        before = stats.snapshot()
        for rep in range(2):  # the second: counted, not logged again within the minute
            rid = f"r{rep}"
            gw.start_loads([LoadJob(rid, [9, 10, 11, 12, 13], hashes, ["G3"] * 5, "t", layerwise=True)])
            for n in waited:  # the forward (as vLLM runs it: only the hooks it calls)
                gw.wait_layer(n)
            saves = [SaveJob(rid, [14], [2000 + rep], "t"), SaveJob("q", [15], [3000 + rep], "t")]
            with caplog.at_level(logging.WARNING, logger="kvbm_backend"):
                if order == "wait_for_save_first":
                    gw.save(saves)
                    errs = gw.load_errors()
                else:
                    errs = gw.load_errors()
                    gw.save(saves)
            assert errs == {9, 10, 11, 12, 13}  # before: set() (the load reported good)
            (fl,) = w.take_failed_loads()
            assert (fl.req_id, fl.first_failed, fl.reason) == (rid, hashes[0], "unwaited")
        assert w.flush_saves(30) and g3.flush(30)
        assert not any(g3.contains(k) for k in ns.keys([2000, 2001, 3000, 3001], "t", 0))  # the saves dropped
        assert all(g3.contains(k) for k in ns.keys(hashes, "t", 0))  # good blocks: kept for the next hit
        for li in skipped:  # a skipped layer is not scattered after the forward (its blocks are recomputed)
            assert not torch.equal(dst.tensors[li][9], src.tensors[li][3])
        assert _delta(before, "layerwise_unwaited_jobs") == 2
        assert _delta(before, "layerwise_failed_jobs") == 2
        assert _delta(before, "load_blocks_failed") == 10 and _delta(before, "load_blocks_ok") == 0
        assert _delta(before, "layerwise_layers_unwaited") == 2 * len(skipped)
        lines = [r.getMessage() for r in caplog.records if "never waited for" in r.getMessage()]
        assert len(lines) == 1, lines
        assert NAMES[skipped[0]] in lines[0] and "cudagraph_mode" in lines[0]
    finally:
        gw.shutdown()
        g3.close()


def test_layers_after_the_last_one_waited_for_still_load_before_the_draft_model(tmp_path):
    """Speculative decoding: vLLM asks ``get_block_ids_with_load_errors`` after the target model's forward and
    before the draft model's (``defer_kv_connector_finalize``), whose layers follow the target's in the KV cache
    group. Layers after the last one waited for are scattered then (the draft model reads them next) and the load
    is good; ``wait_for_save`` after the draft model keeps the step's saves."""
    src, ns, cfg, g3, hashes = _stored(tmp_path, "cpu")
    dst = _engine("cpu", 2)
    gw = GroupedWorkers([WorkerSide(ns, 0, g3, None)], block_errors=True,
                        layerwise=lambda w, names: for_worker(cfg, w, names, async_scheduling=False))
    gw.register([dst], [NAMES])
    try:
        before = stats.snapshot()
        gw.start_loads([LoadJob("r", [9, 10], hashes[:2], ["G3"] * 2, "t", layerwise=True)])
        for n in NAMES[:L - 1]:  # the target model's layers
            gw.wait_layer(n)
        assert gw.load_errors() == set()
        assert _same(src, 3, dst, 9) and _same(src, 4, dst, 10)  # the last layer too, before the draft model runs
        gw.wait_layer(NAMES[L - 1])  # the draft model's forward: its load is over already
        gw.save([SaveJob("r", [14], [2000], "t")])
        assert gw.workers[0].take_failed_loads() == []
        assert gw.workers[0].flush_saves(30) and g3.flush(30) and g3.contains(ns.keys([2000], "t", 0)[0])
        assert _delta(before, "layerwise_unwaited_jobs") == 0 and _delta(before, "load_blocks_ok") == 2
    finally:
        gw.shutdown()
        g3.close()


def test_the_same_layers_unwaited_at_wait_for_save_fail_the_load(tmp_path):
    """Without speculative decoding ``wait_for_save`` ends the step's loads after the whole forward: a last layer
    not waited for then is one the forward ran without its hook, and fails the load."""
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, "cpu")
    try:
        lw.start([LoadJob("r", [9, 10], hashes[:2], ["G3"] * 2, "t", layerwise=True)])
        for n in NAMES[:L - 1]:
            lw.wait_layer(n)
        assert lw.saves([SaveJob("r", [14], [2000], "t")]) == []
        assert w.load_errors() == {9, 10}
    finally:
        lw.close()
        g3.close()


class _FullGraphSim(Sim):
    """The lifecycle simulation with vLLM's model runner replaying the attention of ``skip`` (layer names) without
    the connector's hooks, as a FULL CUDA graph does: ``wait_for_layer_load`` is not called for them."""

    skip: set[str] = set()

    def _forward(self, so) -> None:
        hook = self.w.wait_for_layer_load
        self.w.wait_for_layer_load = lambda name: None if name in self.skip else hook(name)  # vLLM's side, not ours
        try:
            super()._forward(so)
        finally:
            del self.w.wait_for_layer_load


@pytest.mark.parametrize("skip", ["all", "one"])
def test_a_forward_without_a_layers_hook_never_yields_a_token_from_stale_kv(tmp_path, skip):
    """vLLM's real ``Scheduler`` and the connector in both roles (:mod:`tests.helpers.lifecycle_sim`): r0's 4-block G3
    hit loads layer-wise in a step whose forward skips the hook of every layer (``all``: a FULL CUDA graph) or of
    one; the forward reads the engine blocks' stale bytes in those layers. vLLM must throw that step away (load
    errors from block 0: r0 rolled back to 0 computed tokens) and recompute; no wrong read is kept, no token comes
    from it; ``onboard_failed_blocks`` counts 4, ``onboard_blocks`` 0; G3 still holds the 4 blocks. Before: the
    load was reported good and the sim recorded the wrong read 'in a step with no load error reported'."""
    s, w, kvs = build(tmp_path, 40, 128, extra_g3={"layerwise_load": True})
    sim, h, sd = _FullGraphSim(s, w, kvs), hasher(), s.connector.sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    prompt = list(range(1000, 1000 + 4 * BS))
    names = list(kvs)
    try:
        assert sd.layerwise and len(names) >= 2
        warm(sim, prompt + [7] * 5, h)
        for t in kvs.values():  # stale engine bytes: what a layer not loaded yet holds
            t.fill_(-1.0)
        r0 = mkreq("r0", prompt + [8] * 5, 3, h)
        assert looked_up(sd, r0) == 4 * BS
        keys = ns.keys(list(sd._reqs["r0"].hashes)[:4])
        s.add_request(r0)
        snap0 = stats.snapshot()
        sim.skip = set(names) if skip == "all" else {names[len(names) // 2]}
        sim.step(lambda so: [j.layerwise for j in so.kv_connector_metadata.loads] == [True] or pytest.fail("sync"))
        sim.skip = set()
        assert sim.errors == [] and sim.rolled_back == 1  # the wrong read was discarded, not kept
        assert s.requests["r0"].num_computed_tokens == 0  # rolled back to the job's first block
        while s.requests:
            sim.step()
        assert sim.errors == []
        snap = stats.snapshot()
        assert snap.get(LOADED_BLOCKS, 0) - snap0.get(LOADED_BLOCKS, 0) == 0
        assert snap.get(FAILED_BLOCKS, 0) - snap0.get(FAILED_BLOCKS, 0) == 4
        assert snap.get("layerwise_unwaited_jobs", 0) - snap0.get("layerwise_unwaited_jobs", 0) == 1
        assert all(g3.contains(k) for k in keys)  # good blocks are not dropped for the forward's fault
    finally:
        w.shutdown()
        s.shutdown()
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("mode, full", [("NONE", False), ("PIECEWISE", False), ("FULL", True),
                                        ("FULL_DECODE_ONLY", False), ("FULL_AND_PIECEWISE", False)])
def test_layerwise_loads_are_not_offered_where_vllm_runs_prefills_as_full_cuda_graphs(tmp_path, mode, full):
    """``full_cudagraph_prefills_on`` reads vLLM's resolved ``compilation_config.cudagraph_mode``: ``FULL`` replays
    prefill and mixed batches as FULL graphs (no hook called: nearly every layer-wise load would fail), so
    :func:`usable` is False and the scheduler answers G3 hits asynchronously and the workers run no layer-wise load
    (both ask it). ``PIECEWISE`` and ``NONE`` run attention eagerly; ``FULL_AND_PIECEWISE`` and ``FULL_DECODE_ONLY``
    replay FULL graphs for decode-only batches alone (a hit joining one fails as unwaited, above): they keep
    layer-wise loads. A config naming no mode (no ``compilation_config``) counts as none."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CUDAGraphMode

    from kvbm_backend.integrations.vllm.layerwise import FULL_CUDAGRAPH_PREFILLS_WARNING, full_cudagraph_prefills_on
    vc = SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=CUDAGraphMode[mode]))
    assert full_cudagraph_prefills_on(vc) is full
    assert full_cudagraph_prefills_on(SimpleNamespace()) is False
    cfg = _cfg(tmp_path)
    assert usable(cfg, 1, async_scheduling=False, full_cudagraph_prefills=full_cudagraph_prefills_on(vc)) is not full
    src, ns, _, g3, _ = _stored(tmp_path, "cpu")
    try:
        lw = for_worker(cfg, WorkerSide(ns, 0, g3, None), NAMES, async_scheduling=False,
                        full_cudagraph_prefills=full_cudagraph_prefills_on(vc))
        assert (lw is None) is full
    finally:
        g3.close()
    line = FULL_CUDAGRAPH_PREFILLS_WARNING % mode
    assert "g3.layerwise_load" in line and f"cudagraph_mode is {mode}" in line and "PIECEWISE" in line


@pytest.mark.parametrize("g3_on,layerwise,want", [(True, True, True), (True, False, False), (False, True, False)])
def test_the_connector_asks_vllm_for_piecewise_cuda_graphs_while_layerwise_loads_are_on(tmp_path, g3_on, layerwise,
                                                                                        want):
    """vLLM asks the connector class at config time (``VllmConfig.__post_init__``: when its answer is True, every
    FULL ``cudagraph_mode`` is lowered to PIECEWISE, so no batch replays attention without ``wait_for_layer_load``);
    directly and through vLLM's own ``MultiConnector``, which asks each member with its ``kv_connector_extra_config``.
    A config that does not load answers False (the constructor reports it, naming the field). vLLM's CPU platform
    turns CUDA graphs off before that check, so the class method is what runs here."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
    extra = {"kvbm_backend": {"g3": {"enabled": g3_on, "paths": [str(tmp_path / "g3")], "layerwise_load": layerwise}}}
    assert KvbmBackendConnector.requires_piecewise_for_cudagraph(extra) is want
    member = {"kv_connector": "KvbmBackendConnector", "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}
    assert MultiConnector.requires_piecewise_for_cudagraph({"connectors": [member]}) is want
    assert KvbmBackendConnector.requires_piecewise_for_cudagraph({"no_such_key": 1}) is False


def test_no_piecewise_cuda_graphs_are_asked_for_by_a_connector_that_never_loads(tmp_path):
    """With ``load: false`` no layer-wise load can run: the connector must not make vLLM give up its FULL graphs
    (review of 2026-12-03: it asked whenever G3 and ``g3.layerwise_load`` were on), directly or through
    ``MultiConnector``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
    extra = {"kvbm_backend": {"g3": {"enabled": True, "paths": [str(tmp_path / "g3")], "layerwise_load": True}},
             "load": False}
    assert KvbmBackendConnector.requires_piecewise_for_cudagraph({**extra, "load": True}) is True
    assert KvbmBackendConnector.requires_piecewise_for_cudagraph(extra) is False
    member = {"kv_connector": "KvbmBackendConnector",
              "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}
    assert MultiConnector.requires_piecewise_for_cudagraph({"connectors": [member]}) is False


def test_the_full_mode_warning_advises_only_modes_whose_layerwise_loads_run():
    """The start WARNING's advice names no mode that replays FULL graphs (``FULL_AND_PIECEWISE`` does for decode-sized
    batches, where a layer-wise load fails as unwaited)."""
    from kvbm_backend.integrations.vllm.layerwise import FULL_CUDAGRAPH_PREFILLS_WARNING
    advice = (FULL_CUDAGRAPH_PREFILLS_WARNING % "FULL").split("; use ", 1)[1]
    assert "FULL_AND_PIECEWISE" not in advice and "PIECEWISE" in advice, advice


def test_a_load_ended_by_close_without_a_forward_is_no_unwaited_load(tmp_path, caplog):
    """Shutdown mid-step: a load started but never forwarded is ended by ``close()``; no forward ran on stale rows,
    so no "never waited for" WARNING and no ``layerwise_unwaited_jobs`` (review of 2026-12-03: both were)."""
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, "cpu")
    before = stats.snapshot()
    try:
        lw.start([LoadJob("r", [9, 10], hashes[:2], ["G3"] * 2, "t", layerwise=True)])
        with caplog.at_level(logging.WARNING):
            lw.close()
        assert _delta(before, "layerwise_unwaited_jobs") == 0
        assert _delta(before, "load_blocks_ok") == 0 and _delta(before, "load_blocks_failed") == 0  # none was used
        assert not [r for r in caplog.records if "never waited for" in r.getMessage()]
        assert not lw._active
    finally:
        g3.close()
