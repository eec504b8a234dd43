"""The TP ranks' schedulers decide alike under vLLM's ``external_launcher`` with TP > 1
(kvbm_backend/integrations/vllm/tp_agree.py, wired by wiring.py).

Under ``external_launcher`` (torchrun-style SPMD) every TP rank is its own process with its own scheduler and one
worker, and each process's engine sees only its own worker's output (no ``KVOutputAggregator``); vLLM assumes every
rank's scheduler makes the same decisions (else the ranks' forward passes desynchronise: hangs in collectives or
wrong outputs). Review findings (2026-12-03, after the G3 report exchange):

* a request's load left ``WAITING_FOR_REMOTE_KVS`` when the process's own worker finished it, so at different steps on
  different ranks; failed blocks and failed loads reached only their own rank's scheduler (one rank recomputed, the
  other did not);
* ``get_num_new_matched_tokens`` ran on each process's clock and pools (G4 lookup timeouts, hand-off waits): one rank
  loaded 4 blocks while another waited, or loaded 2.

Now the worker's load results are agreed at ``get_transfer_results`` (finished once every rank finished; failures
every rank's), and the matched tokens per request (the fewest; "ask again" while any rank asks again).

Two real processes, each with vLLM's model-parallel state on gloo (as ``external_launcher`` sets it up on CPU), each
wiring the connector's real role (``wire``) as the test of the G3 report exchange does (its helpers); run as a
script, this file is one such rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
BS, TENANT, NB = 16, "acme", 32
WAIT_STEPS, STEP_SLEEP_S, HANDOFF_WAIT_S = 40, 0.05, 0.3  # steps x sleep > the hand-off wait: it runs out


def _hashes(toks: list[int]) -> list[int]:
    from kvbm_backend.model.hashing import sequence_hashes
    return [int(h) for h in sequence_hashes(toks, BS)]


def _loads_rank(rank: int, g3_dir: str, out: str) -> None:
    """One TP rank's worker role (G3 in ``g3_dir``, this rank's part). Request ``a`` loads 2 blocks on both ranks
    before step 0: rank 0's G3 holds them (saved first), rank 1's does not (a miss: failed blocks, a failed load).
    Request ``b`` loads 2 blocks G3 holds on no rank: rank 0's load runs before step 0, rank 1's only before step 2
    (a slow rank). Each rank waits for its own loads to end before the step; then 4 steps as vLLM's worker runs
    them (``get_transfer_results``, ``get_block_ids_with_load_errors``, the step's worker report). Writes each
    step's finished and failed requests, failed blocks and failed loads."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire
    from tests.integrations.vllm.test_external_launcher_g3_tp import _configs

    kvbm = {"model": "kvbm-backend/external-launcher-test",
            "g3": {"paths": [g3_dir], "capacity_gb": 0.05, "files_per_path": 1, "admission": {"policy": "all"}}}
    ktc, vc, kcc = _configs(g3_dir, kvbm)
    kcc.num_blocks = NB
    parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    try:
        names = list(kcc.kv_cache_groups[0].layer_names)
        g = torch.Generator().manual_seed(rank)
        parts.register_kv_caches({n: torch.randn(2, NB, BS, 1, 64, generator=g).to(torch.bfloat16) for n in names},
                                 kcc)
        workers = parts.worker_role()
        ha, hb = _hashes(list(range(100, 100 + 2 * BS))), _hashes(list(range(500, 500 + 2 * BS)))
        if rank == 0:  # rank 0's G3 holds a's blocks (its slices)
            workers.save([SaveJob("s", [1, 2], ha, TENANT)])
            assert parts._groups[0].g3.flush(timeout=HANG_S)

        def load(rid: str, ids: list[int], hashes: list[int]) -> None:
            workers.start_loads([LoadJob(rid, ids, hashes, ["G3", "G3"], TENANT)])
            w, end = workers.workers[0], time.monotonic() + HANG_S
            while w._loads[rid].state == "pending":  # this rank's own load ends before the step
                assert time.monotonic() < end, f"load {rid} never ended"
                time.sleep(0.01)

        load("a", [5, 6], ha)
        if rank == 0:
            load("b", [7, 8], hb)
        # the connector's get_block_ids_with_load_errors (the old code asked this rank's workers directly)
        load_errors = getattr(parts, "load_errors", workers.load_errors)
        steps = []
        for i in range(4):
            if i == 2 and rank == 1:
                load("b", [7, 8], hb)
            done, failed = parts.take_finished()
            errors = load_errors()
            meta = parts.worker_meta()
            steps.append({"done": sorted(done), "failed": sorted(failed), "errors": sorted(errors),
                          "failed_loads": [[f.req_id, f.reason] for f in (meta.failed if meta else [])]})
        Path(out).write_text(json.dumps({"steps": steps}))
    finally:
        parts.close()


def _match_rank(rank: int, root: str, out: str) -> None:
    """One TP rank's scheduler role over G4 alone (its own store directory: rank 0's holds a hand-off's 4 blocks,
    every rank's slices; rank 1's only the first 2, as a rank whose G4 lookup ran out of time would see), hand-off
    wait ``HANDOFF_WAIT_S``. The engine asks for the request's match each step until the answer is a number, then
    allocates and builds the step's metadata. Writes the answers and the blocks of the planned load."""
    import numpy as np
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvbm_backend.integrations.vllm.handoff import KEY
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire
    from tests.integrations.vllm.test_external_launcher_g3_tp import _configs

    kvbm = {"model": "kvbm-backend/external-launcher-test", "g3": {"enabled": False},
            "g4": {"enabled": True, "encrypt": False, "url": f"file://{root}/g4-rank{rank}"}}
    ktc, vc, kcc = _configs("", kvbm, handoff_wait_s=HANDOFF_WAIT_S)
    parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        side = parts.scheduler_role()
        toks = list(range(100, 100 + 4 * BS + 1))
        req = SimpleNamespace(request_id="h", prompt_token_ids=toks, cache_salt=TENANT, lora_request=None,
                              kv_transfer_params={KEY: {"blocks": 4, "block_size": BS}})
        hashes = [int(h) for h in side._state(req).hashes[:4]]
        have = 4 if rank == 0 else 2
        bpb = side.ns.layout.bytes_per_block
        for r in range(2):  # every rank's slices of the first `have` blocks
            keys = side.ns.keys(hashes[:have], TENANT, rank=r)
            assert side.g4.put(keys, [np.full(bpb, i, np.uint8) for i in range(have)]).result(HANG_S).written == have
        # the connector's get_num_new_matched_tokens (the old code asked this rank's scheduler side directly)
        matched = getattr(parts, "get_num_new_matched_tokens", side.get_num_new_matched_tokens)
        answers, planned = [], None
        for _ in range(WAIT_STEPS):
            n, is_async = matched(req, 0)
            answers.append(n)
            if n is not None:
                blocks = SimpleNamespace(get_block_ids=lambda: (list(range(10, 10 + 5)),))
                side.update_state_after_alloc(req, blocks, n)
                meta = parts.build_connector_meta(SchedulerOutput.make_empty())
                planned = [len(j.block_ids) for j in meta.loads]
                break
            time.sleep(STEP_SLEEP_S)  # lets the hand-off wait run out (a lower bound only)
        Path(out).write_text(json.dumps({"answers": answers, "planned": planned}))
    finally:
        parts.close()


def _run(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    return run_tp_ranks(__file__, tmp_path, str(tmp_path / "g3"), mode)


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_ranks_agree_finished_and_failed_loads_under_external_launcher(tmp_path):
    """On the old code rank 0 reported ``a`` and ``b`` finished at step 0, rank 1 ``a`` at step 0 and ``b`` at step
    2 (``b`` left ``WAITING_FOR_REMOTE_KVS`` two steps apart), and each rank reported only its own failed blocks and
    failed loads (rank 0's scheduler never rolled ``a`` back: its KV on rank 1 was never loaded). Now every rank
    reports the same, step by step: a load is finished once every rank finished it, failures are every rank's."""
    pytest.importorskip("vllm")
    r0, r1 = _run(tmp_path, "loads")
    assert r0["steps"] == r1["steps"], "the TP ranks' workers reported different load results"
    s0, s1, s2, s3 = r0["steps"]
    assert s0["done"] == ["a"] and s1["done"] == [] and s2["done"] == ["b"] and s3["done"] == []
    assert s0["errors"] == [5, 6, 7, 8] and s2["errors"] == [7, 8]  # a's (rank 1) and b's (rank 0), then b's (1)
    assert s0["failed_loads"] == [["b", "miss"], ["a", "miss"]] and s2["failed_loads"] == [["b", "miss"]]
    assert not s1["errors"] and not s1["failed_loads"] and not s3["errors"]


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_ranks_agree_the_tokens_to_load_under_external_launcher(tmp_path):
    """On the old code rank 0 answered 4 blocks at once (its G4 holds the hand-off's blocks) and planned a 4-block
    load, while rank 1 waited ("ask again") and then answered 2 blocks. Now both ask again until every rank has an
    answer, then answer the fewest any rank found (2 blocks), and plan a 2-block load."""
    pytest.importorskip("vllm")
    r0, r1 = _run(tmp_path, "match")
    assert r0["answers"] == r1["answers"], "the TP ranks' schedulers decided different matches"
    assert r0["answers"][0] is None and r0["answers"][-1] == 2 * BS
    assert r0["planned"] == r1["planned"] == [2]


def test_load_results_records_round_trip_and_refuse_malformed_bytes():
    """The binary records the ranks exchange (no pickles): every field round-trips; truncated or foreign bytes are
    a ValueError naming what is wrong."""
    from kvbm_backend.integrations.vllm.metadata import FailedLoad
    from kvbm_backend.integrations.vllm.tp_agree import decode_loads, encode_loads
    fl = [(0, FailedLoad("r1", "t", 2**64 - 5, "miss", b"\x01" * 16)), (1, FailedLoad("r2", "ü", 7, "timeout"))]
    blob = encode_loads({"b", "a"}, {"a"}, {9, 3}, fl)
    assert decode_loads(blob) == (["a", "b"], ["a"], [3, 9], fl)
    with pytest.raises(ValueError, match="truncated"):
        decode_loads(blob[:-3])
    with pytest.raises(ValueError, match="not"):
        decode_loads(b"XXXX" + blob[4:])
    with pytest.raises(ValueError, match="after their last record"):
        decode_loads(blob + b"\0")


if __name__ == "__main__":  # argv: rank, port, output JSON, G3 dir (the mode's root), mode
    join_tp_group(int(sys.argv[1]), int(sys.argv[2]))
    {"loads": _loads_rank, "match": _match_rank}[sys.argv[5]](int(sys.argv[1]), sys.argv[4], sys.argv[3])
