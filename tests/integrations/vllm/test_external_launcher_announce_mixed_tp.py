"""The TP ranks' hash-domain agreement for G4 announcements (``tp_events.agree_domain``, 5bacad3; review 2026-12-03).

``agree_domain`` is a collective (an all-gather over the TP group) that a rank enters only when its own scheduler
side has a G4 announcer (``side.events.announcer``: ``g4.announce`` on, KV events on, G4 open). Whether a rank has
one is that rank's own configuration, never agreed: a rank whose ``g4.announce`` differs (a per-node config file
under multi-node TP, a ConfigMap rolled to one node first) skips the all-gather while the others enter it, and their
all-gather pairs with that rank's next collective (the save plan's all-reduce): the ranks hang, or exchange each
other's unrelated tensors. Before 5bacad3 ``g4.announce`` set per rank only decided which rank announced (no
collective of it).

Two real processes forming vLLM's TP group of 2 on gloo (``tests/helpers/tp_ranks.py``); run as a script, this file
is one rank. Each rank drives its steps on a thread with a bound, so a hang is reported, not waited out."""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks
from tests.integrations.vllm.test_external_launcher_announce_tp import BS, _counting_pool, _request, _wire

pytestmark = [pytest.mark.vllm]

BOUND_S = 60.0  # the steps take well under a second once both processes are up


def _mixed_rank(rank: int, root: str, out: str, both: bool = False) -> None:
    """Rank 0 announces (``g4.announce`` on), rank 1 does not (its KV events have no announcer). Both ranks' scheduler
    sides look up, plan and offer the same 4-block save, then one more empty step, then all-reduce a check value.
    Writes whether the rank finished within the bound, the error it raised, the offered blocks and the check sum."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend.integrations.vllm.kv_events import G3KvEvents
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from tests.integrations.vllm.test_external_launcher_saves_tp import _step

    ns = Namespace("kvbm-backend/el-mixed", KvLayout(2, 2, BS, 64, "bfloat16"), tp_world_size=2)
    pool = _counting_pool(root, ns)
    group = get_tp_group()
    res: dict = {"done": False, "error": None, "warned": []}
    import logging

    class _Keep(logging.Handler):
        def emit(self, record):
            res["warned"].append(record.getMessage())
    logging.getLogger("kvbm_backend.connector").addHandler(_Keep(logging.WARNING))

    def body():
        try:
            side = SchedulerSide(ns, BS, None, pool, load=False, tp_group=group)
            side.events = G3KvEvents(2, BS, g3=False)
            if rank == 0 or both:
                _wire(side, pool, ns)
            else:
                from vllm.utils.hashing import sha256_cbor
                from vllm.v1.core.kv_cache_utils import init_none_hash
                init_none_hash(sha256_cbor)
            a = _request("a", 4, 100)
            res["matched"] = list(side.get_num_new_matched_tokens(a, 0))
            side.update_state_after_alloc(a, None, 0)
            meta = side.build_connector_meta(_step([("a", list(range(10, 14)), 0)], {"a": 4 * BS}))
            hs = [int(h) for h in side._reqs["a"].hashes]
            res["offered"] = sorted(hs.index(int(h)) for j in meta.saves for h in j.seq_hashes)
            side.build_connector_meta(_step([], {}))
            t = torch.tensor([rank + 1], dtype=torch.int64)
            dist.all_reduce(t, group=group.cpu_group)
            res["check"] = int(t[0])
            res["done"] = True
        except BaseException as e:  # noqa: BLE001 - reported
            res["error"] = f"{type(e).__name__}: {e}"[:500]

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(BOUND_S)
    res["hung"] = th.is_alive()
    Path(out).write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # a thread stuck in a collective would keep the process (and the other rank) waiting


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); bounded at BOUND_S per rank
def test_ranks_whose_announce_setting_differs_do_not_hang_or_mispair_collectives(tmp_path):
    """On 5bacad3 rank 0 enters agree_domain's all-gather at its first lookup; rank 1 (no announcer) does not, and
    enters the save plan's all-reduce next: the collectives pair up wrongly (hang, error or crossed data). Expected:
    both ranks finish every step, offer the same 4 blocks, and the final check all-reduce sums to 3."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "mixed")
    assert not r0["hung"] and not r1["hung"], (r0, r1)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["offered"] == r1["offered"] == [0, 1, 2, 3], (r0, r1)
    assert r0["check"] == r1["check"] == 3, (r0, r1)
    assert [w for w in r0["warned"] if "is on for TP ranks 0 only" in w], r0["warned"]  # MIXED_WARNING, rank 0's
    assert r1["warned"] == []


@pytest.mark.slow
def test_control_ranks_that_both_announce_finish(tmp_path):
    """The harness's control: both ranks announce (the same setting): both finish (passes on 5bacad3)."""
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path, str(tmp_path), "both")
    assert not r0["hung"] and not r1["hung"] and r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["offered"] == r1["offered"] == [0, 1, 2, 3] and r0["check"] == r1["check"] == 3, (r0, r1)


if __name__ == "__main__":  # argv: rank, port, output JSON, root, mode
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    _mixed_rank(int(sys.argv[1]), sys.argv[4], sys.argv[3], both=sys.argv[5] == "both")
