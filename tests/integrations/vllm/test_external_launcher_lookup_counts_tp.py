"""Requests' lookups count once per engine in the pod's ``kvbm_matched_tokens``, hit rates and pools' lookup counters
under vLLM's ``external_launcher`` with TP > 1 (kvbm_backend/integrations/vllm/tp_sched.py, lookup.py,
scheduler_side.py; docs/operations.md "Metrics").

Review (2026-12-04): under ``external_launcher`` every TP rank's process runs its own scheduler, and each counted its
own lookup answer in the pools (``TierLookup(count=True)`` as it resolved, a hand-off's look when its wait ended),
before the ranks agreed the answer: the pod's endpoint (every process's series summed, :mod:`kvbm_backend.metrics_mp`)
showed about TP x the matched tokens, each rank's own answer rather than the agreed hit (rank 0 found 4 blocks,
rank 1 3, both loaded 3: 7 blocks counted). Now only TP rank 0 counts them, once the ranks agree, as the agreed hit.

Two real processes forming vLLM's TP group of 2 on gloo (``tests/helpers/tp_ranks.py``), each a real scheduler side
over a G3 mirror and a G4 pool on its own file store; each reads the series its process exports (the default
registry) and the pools' ``stats()``. Run as a script, this file is one rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.side]  # counts only, no wall-clock assertion: side lane

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
BS, TENANT = 16, "acme"


def _rank(rank: int, root: str, out: str) -> None:
    """One TP rank's scheduler side (the engine's TP group). G3 (the mirror, as every rank's exchange makes it): blocks
    0-1 of request ``a`` on both ranks. G4, this rank's own store: rank 0's holds ``a``'s blocks 2-3 (every rank's
    slices), rank 1's only block 2 (as a rank whose G4 lookup ran out of time sees it): the ranks agree 3 blocks.
    Request ``h``, a hand-off promising 4 blocks, all 4 in both ranks' G4 (its wait ends at the first look). Writes the
    answers, the series this process exports and the pools' and connector's lookup counters."""
    import numpy as np
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend import metrics
    from kvbm_backend.config import load_config
    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
    from kvbm_backend.integrations.vllm.handoff import KEY
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.pool.g4.pool import G4Pool

    ns = Namespace("kvbm-backend/el-lookup-counts", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    mirror = G3Mirror(ns)  # the process's registry: what this rank exports
    cfg = load_config({"g4": {"enabled": True, "url": f"file://{root}/g4-rank{rank}", "encrypt": False,
                              "timeout_s": 60.0}}, use_env=False)  # counts, not the load bound
    g4 = G4Pool(cfg.g4, ns)
    try:
        side = SchedulerSide(ns, BS, mirror, g4, lookup_timeout_s=HANG_S, handoff_wait_s=HANG_S,
                             tp_group=get_tp_group())
        a_toks = list(range(100, 100 + 4 * BS + 1))
        h_toks = list(range(900, 900 + 4 * BS + 1))
        a = SimpleNamespace(request_id="a", prompt_token_ids=a_toks, cache_salt=TENANT, lora_request=None,
                            kv_transfer_params=None)
        h = SimpleNamespace(request_id="h", prompt_token_ids=h_toks, cache_salt=TENANT, lora_request=None,
                            kv_transfer_params={KEY: {"blocks": 4, "block_size": BS}})
        ha = [int(x) for x in side._state(a).hashes]
        hh = [int(x) for x in side._state(h).hashes]
        mirror.apply(KvbmWorkerMeta([mirror_id(k) for r in range(2) for k in ns.keys(ha[:2], TENANT, rank=r)], [],
                                    True))
        bpb = ns.layout.bytes_per_block
        for hs in (ha[2:4] if rank == 0 else ha[2:3], hh):
            for r in range(2):
                keys = ns.keys(hs, TENANT, rank=r)
                assert g4.put(keys, [np.full(bpb, 7, np.uint8)] * len(keys)).result(HANG_S).written == len(keys)
        answers = {}
        for req in (a, h):
            end = time.monotonic() + HANG_S
            while True:  # vLLM asks each step until the agreed answer is known (the same call on both ranks)
                n, _ = side.get_num_new_matched_tokens(req, 0)
                if n is not None:
                    break
                assert time.monotonic() < end, f"request {req.request_id} was never answered"
                time.sleep(0.005)
            answers[req.request_id] = n
        m, g = mirror.stats(), g4.stats()
        res = {"answers": answers,
               "matched": metrics.sample_value(None, "kvbm_matched_tokens_total"),
               "g3_rate": metrics.sample_value(None, "kvbm_disk_cache_hit_rate"),
               "g4_rate": metrics.sample_value(None, "kvbm_object_cache_hit_rate"),
               "g3_pool": [m.get("lookup_blocks", 0), m.get("lookup_hits", 0)],  # (a key only once counted)
               "g4_pool": [g.get("lookups", 0), g.get("lookup_hits", 0)],
               "conn": {k: stats.get(k) for k in ("lookup_requests", "g3_found_blocks", "g4_found_blocks")}}
        Path(out).write_text(json.dumps(res))
    finally:
        g4.close()


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_ranks_count_each_request_once_with_the_agreed_hit(tmp_path):
    """Before the fix each rank counted its own answers: rank 0 ``a`` 4 blocks + ``h`` 4, rank 1 3 + 4, so the pod's
    ``kvbm_matched_tokens`` summed to 15 blocks' tokens (rank 1 alone 7 x BS) while the engine loaded 3 + 4. Expected:
    rank 0 counts the agreed hits (3 + 4 blocks: G3 2 of ``a``'s 4 and none of ``h``'s, G4 1 of the 2 G3 lacked
    and ``h``'s 4), rank 1 nothing; the connector's own counters count the agreed hit on each rank as before."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path))
    assert r0["answers"] == r1["answers"] == {"a": 3 * BS, "h": 4 * BS}, (r0, r1)
    assert r0["matched"] + r1["matched"] == 7 * BS, (r0, r1)  # the pod's sum: each request once
    assert (r0["matched"], r1["matched"]) == (7 * BS, 0), (r0, r1)  # TP rank 0 counts
    assert r0["g3_pool"] == [8, 2] and r0["g4_pool"] == [2, 5], r0  # a: G3 4 asked, 2 found; G4 2 asked, 1 agreed
    assert r0["g3_rate"] == 2 / 8 and r0["g4_rate"] == 5 / 6, r0
    assert r1["g3_pool"] == [0, 0] and r1["g4_pool"] == [0, 0], r1
    assert r1["g3_rate"] == 0 and r1["g4_rate"] == 0, r1
    for r in (r0, r1):  # unchanged: each rank's own connector counters count the agreed hit
        assert r["conn"] == {"lookup_requests": 2, "g3_found_blocks": 2, "g4_found_blocks": 5}, r


if __name__ == "__main__":  # argv: rank, port, output JSON, root
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    _rank(int(sys.argv[1]), sys.argv[4], sys.argv[3])
