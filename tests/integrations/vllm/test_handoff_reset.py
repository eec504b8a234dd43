"""A prefill -> decode hand-off (:mod:`kvbm_backend.integrations.vllm.handoff`) across a connector reset with
``reset_tiers`` on (:mod:`kvbm_backend.integrations.vllm.reset_epoch`): the requests in the engine at the reset are
never saved again (opaque), so a hand-off request's answer promises only the blocks it offered before the reset, under
the identity they were stored with (the epoch before it). Before 2026-12-03 it promised every prompt block and named
the new epoch: a decode request of that epoch (one engine doing both roles) waited ``handoff_wait_s`` for blocks never
written under a name it reads.

Real parts: the scheduler sides over one real G4 ``file://`` store (unencrypted, no keyring); the blocks the prefill
side's save jobs name are put into G4 as its worker's write-behind would."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvbm_backend.config import load_config
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.integrations.vllm import handoff, reset_epoch, stats
from kvbm_backend.integrations.vllm.handoff import KEY
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace

HANG_S = 600.0  # a hang guard, not a bound: returns as soon as the answer that must come came
BS = 32
TOKS = list(range(100, 100 + BS * 6 + 5))  # 6 loadable blocks
NS = Namespace("m", KvLayout(2, 2, BS, 64, "bfloat16"))


@pytest.fixture(autouse=True)
def _fresh_handoff_log():
    handoff.LOG.reset()
    yield


def _req(rid, params):
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKS, all_token_ids=TOKS, cache_salt=None,
                           lora_request=None, kv_transfer_params=params)


def _step(new=(), sched=None):
    """A SchedulerOutput-shaped object: ``new`` = [(req_id, block_ids, num_computed)], ``sched`` = {req_id: tokens}."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=dict(sched or {}))


def _ask(s, req):
    """Call like vLLM's scheduler (every step) until an answer; returns it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < HANG_S:
        n, _ = s.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n
        time.sleep(0.005)
    raise AssertionError("no answer")


def test_a_handoff_in_flight_at_a_reset_promises_only_what_it_offered_before_under_its_own_identity(tmp_path):
    """Prefill request p offers its first 3 blocks, then the engine is reset (``reset_tiers``); request q, seen but
    not scheduled before the reset, is scheduled after it. Both finish after the reset: p promises 3 blocks (before:
    6), q none (before: 6), both under the namespace they were stored under (before: the new epoch's). A decode request
    in the same engine (the new epoch) is served at once, an identity mismatch (before: waited for 6 blocks stored under
    names it never reads); a decode worker never reset finds p's 3 blocks and completes its wait."""
    cfg = load_config({"g3": {"enabled": False},
                       "g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False}}, use_env=False)
    g4 = open_tiers(cfg, NS)[1]
    try:
        eng = SchedulerSide(NS, BS, None, g4, handoff_wait_s=HANG_S)
        p, q = _req("p", {KEY: True}), _req("q", {KEY: True})
        assert _ask(eng, p) == 0 and _ask(eng, q) == 0  # G4 empty: p and q computed
        meta = eng.build_connector_meta(_step(new=[("p", range(1, 8), 0)], sched={"p": 3 * BS}))
        assert [j.seq_hashes for j in meta.saves] == [list(eng._reqs["p"].hashes[:3])]
        for j in meta.saves:  # the prefill worker's write-behind
            keys = NS.keys(j.seq_hashes, j.tenant, 0, j.digests)
            assert g4.put(keys, [np.full(NS.layout.bytes_per_block, 7, np.uint8)] * len(keys)).result(HANG_S).written
        assert g4.flush(HANG_S)

        epoch = reset_epoch.reset(eng, engine_cleared=True)
        meta = eng.build_connector_meta(_step(new=[("q", range(8, 15), 0)], sched={"q": len(TOKS)}))
        assert not meta.saves  # in the engine at the reset: never saved again
        cut = stats.get("handoff_promise_cut_blocks") or 0
        pre = eng.request_finished(p, [])[1][KEY]
        assert pre["blocks"] == 3, pre  # before: 6, three of which are never written
        assert pre["namespace"] == NS.fingerprint, (pre, epoch)  # before: <fingerprint>@reset-<epoch>
        assert eng.request_finished(q, [])[1][KEY]["blocks"] == 0  # before: 6, none written
        assert (stats.get("handoff_promise_cut_blocks") or 0) == cut + 3 + 6

        # one engine doing both roles: its decode request (the new epoch) reads none of those names; not waited for
        mism = stats.get("handoff_identity_mismatches") or 0
        timeouts = stats.get("handoff_timeouts") or 0
        d = _req("d", {KEY: pre})
        eng.get_num_new_matched_tokens(d, 0)
        assert eng._reqs["d"].handoff_want is None  # before: 6, then handoff_wait_s of "not yet"
        assert _ask(eng, d) == 0
        assert (stats.get("handoff_identity_mismatches") or 0) == mism + 1
        # a decode worker never reset (the identity p's blocks have): waits for the 3 promised and finds them
        done = stats.get("handoff_complete_requests") or 0
        other = SchedulerSide(NS, BS, None, g4, handoff_wait_s=HANG_S)
        e = _req("e", {KEY: pre})
        assert _ask(other, e) == 3 * BS and other._reqs["e"].handoff_want == 3
        assert (stats.get("handoff_complete_requests") or 0) == done + 1
        assert (stats.get("handoff_timeouts") or 0) == timeouts
    finally:
        g4.close()
