"""Layer-wise G3 loads (``g3.layerwise_load``, issue 24 item 5) on the real vLLM CPU engine (tiny Llama,
float32, each engine in its own process):

* the same prompts give identical greedy outputs with no connector, with the connector loading
  asynchronously and with it loading layer by layer; every layer of every layer-wise hit was waited for
  by vLLM's attention layers (``wait_for_layer_load``), none had to be loaded at the end of the step;
* a corrupted G3 block under layer-wise loading is reported after the forward, vLLM recomputes the
  request from its valid prefix, and the outputs are still identical.
"""
from __future__ import annotations

import copy
import shutil

import pytest

from tests.e2e.test_connector_e2e import DTYPE, NUM_BLOCKS, _corrupt_payloads
from tests.helpers.vllm_runner import connector_extra, prompts, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY, write_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.side, pytest.mark.timeout(600)]

_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))


def _run(*args, **kw) -> dict:
    kw.setdefault("dtype", DTYPE)
    return run_engine(*args, **kw)


def _prompts():
    # two families sharing a 320-token prefix: the second of each hits the first's blocks in G3 after a
    # fresh start (and the engine's own cache within one run)
    return prompts(2, 700, shared_prefix=320, seed=21) + prompts(1, 700, seed=22)


def _extra(workdir, layerwise: bool) -> dict:
    extra = copy.deepcopy(connector_extra(workdir))
    extra["kvbm_backend"]["g3"]["layerwise_load"] = layerwise
    return extra


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The baseline without a connector, and a writer run that fills G3 (asynchronous loads)."""
    tmp = tmp_path_factory.mktemp("layerwise")
    model = write_model_dir(tmp / "model", TINY)
    ps = _prompts()
    base = _run(tmp, "baseline", model, ps, None, num_gpu_blocks=NUM_BLOCKS)
    w = _run(tmp, "writer", model, ps, {"extra": _extra(tmp / "w", False)}, num_gpu_blocks=NUM_BLOCKS)
    assert w["outputs"] == base["outputs"]
    assert w["connector_stats"].get("g3_put_written_blocks", 0) > 0, w["connector_stats"]
    return tmp, model, ps, base, w


def _reader(tmp, model, ps, name: str, layerwise: bool) -> tuple[dict, object]:
    d = tmp / name
    shutil.copytree(tmp / "w" / "g3", d / "g3")
    return _run(tmp, name, model, ps, {"extra": _extra(d, layerwise)}, num_gpu_blocks=NUM_BLOCKS), d


def test_layerwise_on_off_and_no_connector_agree(written):
    tmp, model, ps, base, _ = written
    off, _ = _reader(tmp, model, ps, "off", False)
    on, _ = _reader(tmp, model, ps, "on", True)
    assert off["outputs"] == base["outputs"]
    assert on["outputs"] == base["outputs"]
    so, s = off["connector_stats"], on["connector_stats"]
    assert so.get("layerwise_jobs", 0) == 0 and so.get("load_g3_blocks_ok", 0) > 0, so
    # g3.layerwise_load: the G3 hits were loaded layer by layer, inside the steps
    assert s.get("layerwise_jobs", 0) >= len(ps), s
    assert s.get("load_g3_blocks_ok", 0) >= so["load_g3_blocks_ok"], (s, so)
    assert s.get("load_blocks_failed", 0) == 0, s
    layers = on["connector_info"]["num_layers"]
    assert layers == TINY.num_hidden_layers
    assert s["layerwise_layer_waits"] == layers * s["layerwise_jobs"], s  # every layer waited for, by vLLM
    assert s.get("layerwise_layers_unwaited", 0) == 0, s
    assert on["cached_tokens"] == off["cached_tokens"], (on["cached_tokens"], off["cached_tokens"])


def test_layerwise_corrupt_block_recomputes_with_identical_outputs(written):
    tmp, model, ps, base, w = written
    d = tmp / "bad"
    shutil.copytree(tmp / "w" / "g3", d / "g3")
    assert _corrupt_payloads(d / "g3", w["connector_info"]["bytes_per_block"]) > 0
    r = _run(tmp, "bad", model, ps, {"extra": _extra(d, True)}, num_gpu_blocks=NUM_BLOCKS)
    s = r["connector_stats"]
    assert r["outputs"] == base["outputs"]
    assert s.get("layerwise_failed_jobs", 0) > 0, s       # the bad block was found after the forward ...
    assert s.get("load_blocks_failed", 0) > 0, s          # ... reported, and recomputed by vLLM
    assert r["pool_stats"]["g3"]["corrupt"] > 0, r["pool_stats"]  # proven bad and dropped
