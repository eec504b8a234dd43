"""Review findings on the native tiers (G3Tier/G4Tier through vLLM's real TieringOffloadingSpec and manager, real
G3/G4 pools on tmp_path, out of tree via ``module_path``), 2026-11-30: the config's ``model`` names the namespace,
a chunk whose load failed is not a hit again at once, removals logged while a store publishes are not lost, one
tenant's copy dropped is not the chunk removed, and a G4 lookup stops at a request's first missing chunk."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, _looked_up, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]


@pytest.fixture
def make():
    made: list[TieringHarness] = []

    def mk(tiers, **kw):
        h = TieringHarness(offloading_config(secondary_tiers=tiers, chunks=kw.pop("chunks", 32), **{**GEO, **kw}))
        made.append(h)
        return h

    yield mk
    for h in made:
        if h.primary is not None:
            h.shutdown()


def test_config_model_names_the_namespace_as_in_the_connector(tmp_path, make):
    """Two fine-tunes mounted at one path (vLLM's model name ``/model``) with different config ``model`` never
    share blocks; the same ``model`` does; without one, vLLM's model name (before: ``model`` was ignored and
    engine B served engine A's KV)."""
    a = make([g3_tier(tmp_path / "g3", config={"model": "finetune-A"})], model="/model")
    assert a.tier.namespace.model == "finetune-A"
    keys, data = keys_for(2, "ft"), payloads(a, 2, seed=1)
    a.store(keys, data)
    a.wait_idle()
    a.shutdown()
    b = make([g3_tier(tmp_path / "g3", config={"model": "finetune-B"})], model="/model")
    assert b.tier.namespace.model == "finetune-B"
    assert _looked_up(b.tier, b.context(), keys[0]) is LookupResult.MISS
    assert b.load(keys) == []
    b.shutdown()
    same = make([g3_tier(tmp_path / "g3", config={"model": "finetune-A"})], model="/model")
    got = same.load(keys)
    assert len(got) == 2 and all(np.array_equal(x, y) for x, y in zip(got, data))
    same.shutdown()
    plain = make([g3_tier(tmp_path / "g3plain")], model="/model")
    assert plain.tier.namespace.model == "/model"
