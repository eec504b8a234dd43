"""``reset_tiers`` under vLLM's ``external_launcher`` with TP > 1 (kvbm_backend/integrations/vllm/reset_epoch.py):
every TP rank is its own process with its own scheduler, each reset in the same call, and each plans the jobs of
its own rank's worker. Review finding (2026-12-03): each process drew its own random reset epoch, so rank 0 stored
and looked up its slices under one identity and rank 1 under another, and after a reset no lookup (which needs
every rank's slice) ever hit again. Now rank 0's draw is broadcast over vLLM's TP group (:func:`agreed`).

Two real processes, each with vLLM's model-parallel state on gloo (as ``external_launcher`` sets it up on CPU) and
a real :class:`~kvbm_backend.integrations.vllm.scheduler_side.SchedulerSide`, reset twice; run as a script, this
file is one such rank."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks


def _rank(rank: int, port: int, out: str) -> None:
    """One TP rank's process: vLLM's TP group of 2 on gloo, a scheduler side reset twice; writes, per reset, the
    epoch and the sequence hashes and token digests of one prompt."""
    from vllm.distributed.parallel_state import get_tp_group

    from kvbm_backend.integrations.vllm import reset_epoch
    from kvbm_backend.integrations.vllm.identity import block_digests
    from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace

    join_tp_group(rank, port)
    bs = 16
    # the TP group as the wiring hands it to the scheduler side under external_launcher (its one decision)
    side = SchedulerSide(Namespace("m", KvLayout(2, 2, bs, 64, "bfloat16"), tp_world_size=2), bs, None, None,
                         tp_group=get_tp_group())
    toks = list(range(100, 100 + 4 * bs))
    res = []
    for i in range(2):
        epoch = reset_epoch.reset(side, engine_cleared=True)
        req = SimpleNamespace(request_id=f"r{i}", prompt_token_ids=toks, all_token_ids=toks, cache_salt=None,
                              lora_request=None)
        st = side._state(req)
        res.append({"epoch": epoch, "hashes": [int(h) for h in st.hashes],
                    "digests": block_digests(st, [0, 1, 2, 3], bs).hex()})
    Path(out).write_text(json.dumps(res))


def test_without_a_tp_group_the_drawn_epoch_is_kept():
    """One scheduler (``uni``, ``mp``, ray: no TP group in the scheduler's process): the epoch drawn is used."""
    from kvbm_backend.integrations.vllm.reset_epoch import agreed
    assert agreed("0123456789abcdef") == "0123456789abcdef"


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_every_tp_rank_of_an_external_launcher_engine_resets_to_one_epoch(tmp_path):
    pytest.importorskip("vllm")
    r0, r1 = run_tp_ranks(__file__, tmp_path)
    assert [x["epoch"] for x in r0] == [x["epoch"] for x in r1], "the TP ranks reset to different epochs"
    assert r0 == r1  # so the same blocks' names and token digests on every rank
    first, second = r0
    assert first["epoch"] and second["epoch"] and first["epoch"] != second["epoch"]  # every reset a new one
    assert first["hashes"] != second["hashes"] and first["digests"] != second["digests"]


if __name__ == "__main__":  # argv: rank, port, output JSON
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
