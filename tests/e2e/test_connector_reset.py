"""vLLM's ``reset_prefix_cache(reset_connector=True)`` on the real vLLM CPU engine with our connector.

RL weight updates in place, ``POST /reset_prefix_cache?reset_external=true`` and ``pause_generation(clear_cache=True)``
reset the connector's cache, and so do sleep and Dynamo 1.6.1's ``clear_kv_blocks``. Before, the connector did not
implement ``reset_cache``: vLLM reported the reset done (``True``) while G3/G4 kept serving the blocks stored before
it, i.e. KV of the old weights after an update. Now the connector option ``reset_tiers`` says which: true folds a
reset epoch into the block identity (kvbm_backend/integrations/vllm/reset_epoch.py); false (the default, what
Dynamo's clear and sleep/wake need: tiers that stay warm, as vLLM keeps its persistent tiers) keeps serving.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.vllm_runner import connector_extra, prompts, run_engine, vllm_available

from kvbm_backend.apps.engine_model import TINY, write_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]  # a hang guard, not a bound

_why = vllm_available()
if _why:
    pytestmark.append(pytest.mark.skip(reason=f"vLLM engine not importable: {_why}"))

FULL = 21  # a 700-token prompt: 21 full blocks of 32 tokens, all loadable ((700 - 1) // 32)


def _g4_block_objects(root: Path) -> int:
    """Block objects of a ``file://`` G4 store: ``<namespace>/<tenant>/<rank>/<xx>/<name>`` (``namespace.json``
    not counted)."""
    return sum(1 for f in root.rglob("*") if f.is_file() and len(f.relative_to(root).parts) == 5)


def test_reset_connector_serves_nothing_stored_before_and_deletes_nothing(tmp_path):
    """``reset_tiers`` true."""
    _reset_run(tmp_path, True)


def test_reset_connector_keeps_the_tiers_serving_by_default(tmp_path):
    """``reset_tiers`` unset (false): the reset is done (True) and G3 serves the prompt right after it, as after a
    plain engine reset (Dynamo's ``clear_kv_blocks`` asks for this reset; its G3 must stay warm)."""
    _reset_run(tmp_path, False)


def _reset_run(tmp_path, reset_tiers: bool) -> None:
    """One engine, one 700-token prompt four times, the engine's own prefix cache emptied before each repeat:
    1. after a plain engine reset it is served from G3 (the control: the tiers hold it);
    2. after ``reset_prefix_cache(reset_connector=True)`` (True: done) it gets no hit from G3 or G4 (before: 672
       tokens loaded, the old identity's blocks) and is computed again, the same greedy output;
    3. after a plain engine reset again it is served from G3: what step 2 computed was stored under the new
       identity. The G4 blocks of before the reset are still in the store (other workers' to use)."""
    model_dir = write_model_dir(tmp_path / "model", TINY)
    g4 = tmp_path / "g4"
    ps = prompts(1, 700, seed=31) * 4
    extra = connector_extra(tmp_path / "w", f"file://{g4}")
    if reset_tiers:
        extra["reset_tiers"] = True
    res = run_engine(tmp_path, "reset", model_dir, ps, {"extra": extra},
                     dtype="float32", num_gpu_blocks=48, reset_prefix_cache_before=[1, 3], reset_connector_before=[2],
                     settle_before=[1, 3], timeout=600)
    st = res["connector_stats"]
    assert res["reset_connector_results"] == [True], res["reset_connector_results"]
    assert res["outputs"] == [res["outputs"][0]] * 4, res["outputs"]
    if not reset_tiers:
        assert res["cached_tokens"] == [0, FULL * 32, FULL * 32, FULL * 32], res["cached_tokens"]
        assert st.get("connector_cache_resets_kept") == 1 and not st.get("connector_cache_resets"), st
        assert st.get("load_g3_blocks_ok") == 3 * FULL and st.get("g4_put_written_blocks") == FULL, st
        return
    assert res["cached_tokens"] == [0, FULL * 32, 0, FULL * 32], res["cached_tokens"]
    assert st.get("connector_cache_resets") == 1, st
    assert st.get("load_planned_blocks") == 2 * FULL and st.get("load_g3_blocks_ok") == 2 * FULL, st
    assert st.get("g4_put_written_blocks") == 2 * FULL, st  # the old identity's and the new one's
    assert _g4_block_objects(g4) == 2 * FULL + 1, sorted(str(p.relative_to(g4)) for p in g4.rglob("*"))  # + warm-up
