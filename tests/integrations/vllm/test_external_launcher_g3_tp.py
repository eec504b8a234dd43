"""G3 hits under vLLM's ``external_launcher`` with TP > 1 (kvbm_backend/integrations/vllm/wiring.py,
report_channel.py ``TpReportExchange``).

Under ``external_launcher`` (torchrun-style SPMD) every TP rank is its own process hosting a scheduler and that
rank's worker, and vLLM's ``ExecutorWithExternalLauncher`` runs that one worker only: its step output (with the
connector's worker metadata) reaches that process's scheduler alone, and the report channel's key holds the
process's own scheduler token, so a worker's G3 reports reach its own process's scheduler only. The scheduler
uses the G3 mirror (TP > 1), and a lookup hits only when every rank holds its slice. Review finding (2026-12-03):
each scheduler's mirror held its own rank's slices only, so no G3 lookup ever hit (the tier silently lost; the
mirror also never became ready, so every request first waited the mirror's 10 s). Now every rank's scheduler
gathers all ranks' reports over vLLM's TP group at ``build_connector_meta`` and applies them in rank order.

Two real processes, each with vLLM's model-parallel state on gloo (as ``external_launcher`` sets it up on CPU),
each wiring the connector's real scheduler role (``wire``, ``distributed_executor_backend="external_launcher"``,
TP=2); each process's worker reports its rank's slices by the real report channel of its process's scheduler (the
key built from the scheduler's token, as the worker gets it in the step metadata). Run as a script, this file is
one such rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.tp_ranks import join_tp_group, run_tp_ranks

BS, STEPS, TENANT = 16, 3, "acme"
LATE_STEPS, LATE_SLEEP_S, LATE_WAIT_S = 30, 0.05, 0.2  # steps x sleep > wait: the mirror's wait runs out


def _configs(g3_dir: str, kvbm: dict | None = None, **opts):
    """``(kv_transfer_config, vllm_config, kv_cache_config)`` of a TP=2 ``external_launcher`` engine; ``kvbm``: the
    ``kvbm_backend`` tree (default: G3 in ``g3_dir``), ``opts``: the connector's other options."""
    import torch
    from vllm.config import KVTransferConfig, SchedulerConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    extra = {"kvbm_backend": kvbm or {"model": "kvbm-backend/external-launcher-test",
                                      "g3": {"paths": [g3_dir], "capacity_gb": 0.05, "files_per_path": 1}}, **opts}
    ktc = KVTransferConfig(kv_connector="KvbmBackendConnector",
                           kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
                           engine_id="el-test")
    vc = SimpleNamespace(kv_transfer_config=ktc, kv_events_config=None,
                         model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=2,
                                                         distributed_executor_backend="external_launcher"),
                         cache_config=SimpleNamespace(cache_dtype="auto"),
                         scheduler_config=SchedulerConfig(max_model_len=4096, is_encoder_decoder=False))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return ktc, vc, KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def _rank(rank: int, port: int, g3_dir: str, out: str, mode: str) -> None:
    """One TP rank's process: vLLM's TP group of 2 on gloo, the connector's scheduler role as wired under
    ``external_launcher``. ``mode`` ``channel``: its worker reports its rank's slices of a 4-block prompt (the first
    report: its G3 index snapshot) by the channel, then ``STEPS`` engine steps, each asking for the prompt's match
    and building the step's metadata. ``late``: rank 1's worker has sent nothing yet (its snapshot is late) and
    rank 0's report comes in the first step's output; ``LATE_STEPS`` steps of at least ``LATE_SLEEP_S`` each.
    Writes the answers, the mirror's state and the ranks whose slices it holds."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvbm_backend.integrations.vllm import report_channel
    from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
    from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire

    join_tp_group(rank, port)
    ktc, vc, kcc = _configs(g3_dir)
    parts = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        side = parts.scheduler_role()
        toks = list(range(100, 100 + 4 * BS + 1))
        req = SimpleNamespace(request_id="r", prompt_token_ids=toks, cache_salt=TENANT, lora_request=None)
        ns = side.ns.for_group(0)
        hashes = [int(h) for h in side._state(req).hashes[:4]]
        keys = ns.keys(hashes, TENANT, rank=rank)
        # this process's worker: the channel of its own process's scheduler (the token of the bound metadata)
        sender = report_channel.ReportSender(report_channel.channel_key(*parts.channel_base, parts.channel_token))
        assert sender.connect(), "the worker could not reach its scheduler's report channel"
        answers = []
        if mode == "channel":
            sender.send(0, rank, [mirror_id(k) for k in keys], [], True)
            for _ in range(STEPS):
                answers.append(side.get_num_new_matched_tokens(req, 0)[0])
                parts.build_connector_meta(SchedulerOutput.make_empty())
        else:
            if getattr(parts, "exchange", None) is not None:  # (absent in the old code)
                parts.exchange.wait_s = LATE_WAIT_S
            for i in range(LATE_STEPS):
                answers.append(side.get_num_new_matched_tokens(req, 0)[0])
                parts.build_connector_meta(SchedulerOutput.make_empty())
                if i == 0 and rank == 0:  # the step's output: this process's worker's report
                    parts.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KvbmWorkerMeta(
                        [mirror_id(k) for k in keys], [], True, snap_ranks=[0]), failed_recving=None))
                time.sleep(LATE_SLEEP_S)  # lets the mirror's wait run out (a lower bound only)
        mirror = side.g3
        held = [r for r in range(2) if mirror._lookup(ns.keys(hashes, TENANT, rank=r)) == 4]
        Path(out).write_text(json.dumps({"answers": answers, "ready": bool(mirror.ready), "held_ranks": held}))
    finally:
        parts.close()


def _run_ranks(tmp_path: Path, mode: str) -> tuple[dict, dict]:
    """Runs this file as TP ranks 0 and 1 (argv: rank, port, output JSON, G3 dir, ``mode``) and returns their
    outputs; both must exit 0."""
    return run_tp_ranks(__file__, tmp_path, str(tmp_path / "g3"), mode)


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_every_tp_rank_scheduler_sees_every_ranks_g3_blocks_under_external_launcher(tmp_path):
    pytest.importorskip("vllm")
    r0, r1 = _run_ranks(tmp_path, "channel")
    assert r0["held_ranks"] == [0, 1], f"rank 0's scheduler mirrors only ranks {r0['held_ranks']}"
    assert r1["held_ranks"] == [0, 1], f"rank 1's scheduler mirrors only ranks {r1['held_ranks']}"
    assert r0["ready"] and r1["ready"]
    assert r0["answers"] == r1["answers"], "the TP ranks' schedulers decided different matches"
    # the first step waits for the mirror's first snapshots (exchanged at that step); then a 4-block hit on both
    assert r0["answers"][0] is None and r0["answers"][1:] == [4 * BS] * (STEPS - 1)


@pytest.mark.slow  # two processes import vLLM (~10-20 s each on the 2-core VM); no wall-clock assertion
def test_tp_rank_schedulers_agree_while_a_ranks_snapshot_is_late_under_external_launcher(tmp_path):
    """Rank 1's worker has reported nothing yet (its G3 index snapshot is late) and rank 0's report comes in its
    step output (the fallback when the channel is not used). On the old code rank 0's scheduler applied that report
    alone (a step's report made its mirror ready at once) and answered "no hit" at once while rank 1's was still
    waiting ("ask again": None): the ranks scheduled the request at different steps (an SPMD engine's collectives
    desynchronise). Now every rank's mirror takes the same reports at the same step, and the wait for the missing
    snapshot ends at the same step on every rank (agreed by the exchange): identical answers, step by step."""
    pytest.importorskip("vllm")
    r0, r1 = _run_ranks(tmp_path, "late")
    assert r0["answers"] == r1["answers"], "the TP ranks' schedulers decided different matches"
    assert r0["answers"][0] is None and r0["answers"][-1] == 0  # waited, then a miss (rank 1 holds no slice)
    assert r0["held_ranks"] == r1["held_ranks"] == [0]  # rank 0's step report reached both mirrors


if __name__ == "__main__":  # argv: rank, port, output JSON, G3 dir, mode
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4], sys.argv[3], sys.argv[5])
