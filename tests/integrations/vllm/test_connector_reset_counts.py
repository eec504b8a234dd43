"""``reset_untiered_requests`` of the connector's ``reset_cache`` (kvbm_backend/integrations/vllm/reset_epoch.py): the
requests in the engine that the reset stopped tiering (docs/operations.md, "Resetting the connector's cache"), not
every request the scheduler knows: one already untiered (a multimodal request, or one an earlier reset stopped) is
not stopped again."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


def _request(rid: str, images: bool = False):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(40)), all_token_ids=list(range(40)),
                           cache_salt=None, lora_request=None, prompt_embeds=None, kv_transfer_params=None,
                           mm_features=["an image"] if images else [])


def test_reset_counts_only_the_requests_it_stops_tiering():
    """Three requests in the engine: A and B tiered, M multimodal (never tiered). The first reset stops A and B (2;
    before: 3, M counted); a second reset, with only C new since, stops C (1; before: 4, A, B and M counted again)."""
    from kvbm_backend.integrations.vllm import reset_epoch, stats
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    sd = SchedulerSide(Namespace("m", KvLayout(2, 2, 4, 64, "bfloat16")), 4, None, None)
    for rid, images in (("A", False), ("B", False), ("M", True)):
        sd._state(_request(rid, images))
    assert [sd._reqs[r].opaque for r in "ABM"] == [False, False, True]
    before = stats.snapshot().get("reset_untiered_requests", 0)
    reset_epoch.reset(sd, engine_cleared=True)
    assert stats.snapshot().get("reset_untiered_requests", 0) - before == 2
    sd._state(_request("C"))
    reset_epoch.reset(sd, engine_cleared=True)
    assert stats.snapshot().get("reset_untiered_requests", 0) - before == 3
    assert all(st.opaque and st.no_load for st in sd._reqs.values())
