"""Layer-wise G3 loads (``g3.layerwise_load``) that end half-way, and pipeline parallelism (review 2026-12-03, H6).

* A load whose reads of a block fail after some of its layers landed in vLLM's paged KV (a slab cut short inside
  the block's frame: layer 0 read, the later layers short) reports that block, and every block after it, as failed
  (``get_block_ids_with_load_errors``), so vLLM (``recompute``) rolls the request back to it and its recompute
  overwrites every layer; no request ever reads the half-loaded layers as computed. The scheduler counts the
  blocks before it in ``onboard_blocks`` and the rest in ``onboard_failed_blocks``, each once. Through vLLM's real
  ``Scheduler`` and the connector in both roles (:mod:`tests.helpers.lifecycle_sim`: CPU KV tensors, a forward that
  checks every position it reads), and through the worker role alone with a half-loaded block in the middle.
* Pipeline parallelism > 1 (each stage holding, and loading, only its layers; the scheduler seeing stage 0's
  outputs) is refused when the connector is built, in both roles, before any pool opens: no layer-wise load, and no
  load count, can ever be split over stages.
"""
from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.load_failures import FAILED_BLOCKS, LOADED_BLOCKS  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob  # noqa: E402
from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire  # noqa: E402
from kvbm_backend.model.frame import HEADER_BYTES  # noqa: E402
from tests.helpers.pools import flip_g3_payload  # noqa: E402
from tests.helpers.lifecycle_sim import BS, Sim, build, fvals, hasher, looked_up, mkreq, warm  # noqa: E402
from tests.integrations.vllm.test_connector_wiring import _configs, _extra  # noqa: E402
from tests.integrations.vllm.test_layerwise_units import NAMES, _rig, _same  # noqa: E402

pytestmark = [pytest.mark.vllm]


def _cut_inside(g3, keys, layer_bytes: int) -> int:
    """Truncate the slab of ``keys``' last stored frame inside its second layer: its header and layer 0 read in
    full, its later layers short. Returns that key's index in ``keys``."""
    slots = []
    for i, k in enumerate(keys):
        (ls,) = g3.lease([k])
        g3.release([ls])
        slots.append((ls.path, ls.offset, i))
    assert len({p for p, _, _ in slots}) == 1  # files_per_path 1: one slab
    path, off, last = max(slots, key=lambda s: s[1])
    os.truncate(path, off + HEADER_BYTES + layer_bytes + 100)
    return last


def _positions(kvs: dict, blk: int, layer: int) -> list[list[float]]:
    """The values each token position of engine block ``blk`` holds in layer ``layer`` (one expected)."""
    t = list(kvs.values())[layer]
    return [sorted(torch.unique(t[blk, :, p, :]).tolist()) for p in range(BS)]


@pytest.mark.parametrize("damage", ["corrupt", "cut"])
def test_a_layerwise_load_failing_half_way_through_a_block_is_recomputed_in_every_layer(tmp_path, damage):
    """r0's 4-block G3 hit loads layer by layer and fails at block k after some of its layers were in the engine:
    ``corrupt``: a byte of the block's last layer flipped (every layer scattered as it was waited for, the
    payload check fails at the step's end: layers 0..2 right, the last one wrong); ``cut``: the slab cut inside
    the block's second layer (layer 0 read, the later ones short: layer 0 lands when its wait comes before the
    short reads are reaped). vLLM must roll r0 back to block k and recompute it whole: r0 and a later request on
    the same prompt (served from vLLM's prefix cache) read right KV at every position of every layer;
    ``onboard_blocks`` counts k, ``onboard_failed_blocks`` 4 - k."""
    s, w, kvs = build(tmp_path, 40, 128, extra_g3={"layerwise_load": True})
    sim, h, sd = Sim(s, w, kvs), hasher(), s.connector.sched
    g3, ns = sd.groups[0].g3, sd.groups[0].ns
    prompt = list(range(1000, 1000 + 4 * BS))
    nl = len(kvs)
    try:
        assert sd.layerwise
        warm(sim, prompt + [7] * 5, h)  # G3 holds the prompt's 4 blocks; vLLM's prefix cache is empty
        for t in kvs.values():  # an engine block's bytes from before: visible where nothing loaded or computed
            t.fill_(-1.0)
        toks = prompt + [8] * 5
        r0 = mkreq("r0", toks, 3, h)
        assert looked_up(sd, r0) == 4 * BS
        hs = list(sd._reqs["r0"].hashes)
        if damage == "cut":
            k = _cut_inside(g3, ns.keys(hs[:4]), ns.layout.bytes_per_block // ns.layout.num_layers)
        else:
            k = 2
            flip_g3_payload(g3, ns.keys([hs[k]])[0], ns.layout.bytes_per_block)
        s.add_request(r0)
        snap0 = stats.snapshot()

        def layerwise(so):
            assert [j.layerwise for j in so.kv_connector_metadata.loads] == [True]
        sim.step(layerwise)
        want = [[v] for v in fvals(toks)[k * BS:(k + 1) * BS]]
        blk = list(s.kv_cache_manager.get_block_ids("r0")[0])[k]
        # the half-way state the failed step left in engine block k
        if damage == "corrupt":  # every layer loaded, the last one with one wrong value
            assert all(_positions(kvs, blk, li) == want for li in range(nl - 1))
            last = _positions(kvs, blk, nl - 1)
            assert last != want and sum(a != b for a, b in zip(last, want)) == 1
        else:  # the later layers never loaded; layer 0 loaded or not (whether its wait saw the short reads)
            assert _positions(kvs, blk, 0) in (want, [[-1.0]] * BS)
            assert all(_positions(kvs, blk, li) == [[-1.0]] * BS for li in range(1, nl))
        assert s.requests["r0"].num_computed_tokens == k * BS  # rolled back to block k: recomputed whole
        assert sim.rolled_back == 1 and sim.errors == []
        sim.step()  # the recompute: every layer of block k written
        assert all(_positions(kvs, blk, li) == want for li in range(nl))
        while s.requests:
            sim.step()
        snap = stats.snapshot()
        assert snap.get(LOADED_BLOCKS, 0) - snap0.get(LOADED_BLOCKS, 0) == k
        assert snap.get(FAILED_BLOCKS, 0) - snap0.get(FAILED_BLOCKS, 0) == 4 - k
        s.add_request(mkreq("r3", prompt + [9] * 5, 2, h))  # the same prompt: vLLM's prefix cache (r0's blocks)
        for _ in range(30):
            if not s.requests:
                break
            sim.step()
        assert not s.requests
        assert sim.errors == [] and sim.rolled_back == 1
    finally:
        w.shutdown()
        s.shutdown()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_every_engine_block_a_half_way_load_touched_is_reported_failed(tmp_path):
    """Worker role alone: the job's second block is the one whose frame is cut after layer 0 (rows follow the job's
    order, not the slab's), so the blocks after it read in full. Every block from the cut one on, fully read or not, is a load error and in the failed-load report (vLLM
    recomputes them whole); block 0 is whole in every layer; the step's saves are dropped."""
    src, dst, ns, g3, w, lw, hashes = _rig(tmp_path, "cpu")
    try:
        order = [hashes[0], hashes[4], hashes[1], hashes[2], hashes[3]]  # hashes[4]: the slab's last frame
        cut = _cut_inside(g3, ns.keys(order, "t", 0), dst.layout.bytes_per_block // dst.layout.num_layers)
        assert cut == 1
        job = LoadJob("r", [9, 10, 11, 12, 13], order, ["G3"] * 5, "t", layerwise=True)
        lw.start([job])
        for n in NAMES:
            lw.wait_layer(n)
        assert lw.saves([SaveJob("r", [14], [2000], "t")]) == []
        assert _same(src, 3, dst, 9)
        assert not any(_same(src, 3 + j, dst, 9 + i) for i, j in enumerate([0, 4, 1, 2, 3]) if i)
        assert w.load_errors() == {10, 11, 12, 13}
        (fl,) = w.take_failed_loads()
        assert (fl.req_id, fl.first_failed) == ("r", hashes[4])
    finally:
        lw.close()
        g3.close()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
def test_pipeline_parallelism_is_refused_with_layerwise_loads_on_before_any_pool_opens(tmp_path, role):
    """Each PP stage would load only its own layers of a block and report alone, and vLLM's scheduler sees the
    last stage's connector output only: a layer-wise load could be counted (and kept) when one stage finished.
    The connector refuses PP > 1 in both roles (the block identity names no stage), so that never runs."""
    ktc, vc, kcc = _configs(_extra(tmp_path))
    vc.parallel_config.pipeline_parallel_size = 2
    parts = ConnectorParts()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 \(--pipeline-parallel-size\)"):
        wire(parts, ktc, vc, role, kcc)
    assert parts._groups == [] and parts.worker is None and parts.sched is None  # nothing opened
    assert not (tmp_path / "g3").exists()
    vc.parallel_config.pipeline_parallel_size = 1  # the same config with one stage wires (and loads layer-wise)
    parts = wire(ConnectorParts(), ktc, vc, role, kcc)
    try:
        assert parts.sched.layerwise if role == KVConnectorRole.SCHEDULER else parts.worker is not None
    finally:
        parts.close()
