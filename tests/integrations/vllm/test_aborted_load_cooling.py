"""The failed-load cool-down of a request aborted during its load, through vLLM's real ``Scheduler`` with the
connector in both roles (:mod:`tests.helpers.lifecycle_sim`) (lifecycle review 2026-12-01, finding 2): vLLM calls
``request_finished`` for an aborted WAITING_FOR_REMOTE_KVS request at once, so the worker's failed-load report arrives
after the connector forgot the request."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from tests.helpers.lifecycle_sim import BS, HANG_S, Sim, build, hasher, looked_up, mkreq, warm  # noqa: E402
from tests.model.test_token_digest import colliding_prompts  # noqa: E402

pytestmark = [pytest.mark.vllm]


def test_a_forged_prompt_aborted_during_its_load_cools_the_block_only_for_its_own_digest(tmp_path):
    """A tenant-mate's prompt with the victim's sequence hashes but other tokens fails its load on the victim's G3
    blocks (the token digests differ). Aborted while its load is in flight, its request state is gone when the
    worker's failed load arrives: before, the block then cooled for every request of the tenant (the victim's own
    prompt was offered 0 tokens for 30 s); now the report carries the block's digest, and only the forger's cools."""
    s, w, kvs = build(tmp_path, 40, 128)
    sim, h, sd = Sim(s, w, kvs), hasher(), s.connector.sched
    victim, forged = colliding_prompts(BS, 4)
    try:
        warm(sim, victim, h)
        f = mkreq("forger", forged, 1, h)
        assert looked_up(sd, f) > 0
        s.add_request(f)

        def abort(so):
            assert [j.req_id for j in so.kv_connector_metadata.loads] == ["forger"]
            s.finish_requests("forger", RequestStatus.FINISHED_ABORTED)
        sim.step(abort)
        end = time.monotonic() + HANG_S
        while s.requests:  # vLLM keeps the aborted request's blocks until the worker reports its load over
            assert time.monotonic() < end, "the aborted load never finished"
            sim.step()
        assert len(sd.failed_blocks) >= 1  # the forger's failure was recorded
        assert looked_up(sd, mkreq("victim2", victim, 1, h)) == 4 * BS  # before: 0
        assert looked_up(sd, mkreq("forger2", forged, 1, h)) == 0  # the forger's own prompt cools
    finally:
        w.shutdown()
        s.shutdown()
