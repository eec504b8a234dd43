"""The prefill -> decode hand-off through G4 driven through vLLM's real ``Scheduler`` with our connector's
scheduler role on both sides (tests/integrations/vllm/test_handoff_hybrid.py, test_handoff_mtp.py): the
connector's configuration, stepping until a request is scheduled, the worker's part (the blocks each step's save
jobs name, put into the pools they are for) and a prefill request's hand-off."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from kvbm_backend.integrations.vllm.handoff import KEY
from tests.helpers.vllm_sched import runner_output

HANG_S = 600.0  # a hang guard, not a bound: steps until a lookup that must end has ended; returns as soon as it has


def handoff_extra(tmp: Path, name: str, model: str, keyring: bool = False, tenant: str = "") -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config`` of worker ``name`` of ``model``: its own G3 in
    ``tmp / name / "g3"`` (50 MB, every block admitted), the G4 ``file://`` store in ``tmp / "g4"`` all workers share
    (unencrypted; ``keyring``: with the keyring file ``tmp / "keys" / "kr.json"`` all workers share, so keyed names),
    ``handoff_wait_s`` 0: a decode request's wait ends at its first look, complete or not; ``tenant``: the worker's
    default tenant."""
    g4: dict[str, Any] = {"enabled": True, "url": f"file://{tmp / 'g4'}", "encrypt": False}
    if keyring:
        g4["keyring"] = {"path": str(tmp / "keys" / "kr.json")}
    return {"handoff_wait_s": 0, "kvbm_backend": {
        "model": model, "tenant": tenant, "g4": g4,
        "g3": {"paths": [str(tmp / name / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
               "admission": {"policy": "all"}}}}


def step_until(s: Scheduler, rid: str, loads: bool = False):
    """Step ``s`` (empty worker outputs) until ``rid`` is scheduled (``loads``: or a load for it is planned): the
    connector answers once its lookup (and a hand-off's wait) has ended. Returns that step's scheduler output;
    AssertionError after ``HANG_S`` seconds (a hang guard)."""
    end = time.monotonic() + HANG_S
    while time.monotonic() < end:
        so = s.schedule()
        if rid in so.num_scheduled_tokens or (loads and any(j.req_id == rid for j in so.kv_connector_metadata.loads)):
            return so
        s.update_from_output(so, runner_output(s, so))
        time.sleep(0.01)
    raise AssertionError(f"{rid} never scheduled")


def store_saves(s: Scheduler, so, g3_only: bool = False) -> None:
    """The worker's part: the blocks the step's save jobs name (bytes ``1 + group``), put into the pools they are
    for (G3 and G4, or G4 alone for a hand-off's ``g4_only`` job; ``g3_only``: G3 alone, as when G4 missed the
    writes), each flushed."""
    for j in so.kv_connector_metadata.saves:
        g = s.connector.sched.groups[j.group]
        keys = g.ns.keys(j.seq_hashes, j.tenant)
        blocks = [np.full(g.ns.layout.bytes_per_block, 1 + j.group, np.uint8) for _ in keys]
        pools = [g.g3] if g3_only else [g.g4] if j.g4_only else [g.g3, g.g4]
        for p in pools:
            p.put(keys, blocks).result(HANG_S)
            assert p.flush(HANG_S)


def prefill(pre: Scheduler, prompt: list[int], hasher, rid: str = "p", **req: Any) -> dict:
    """The prefill worker ``pre`` computes ``prompt`` for a hand-off (request ``rid``, one token; ``req``: more of
    ``Request``'s arguments, e.g. ``lora_request``, ``cache_salt``); returns its ``kv_transfer_params``."""
    pre.add_request(Request(rid, prompt, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
        KEY: True}}), None, 0, block_hasher=hasher, **req))
    so = step_until(pre, rid)
    store_saves(pre, so)
    outs = pre.update_from_output(so, runner_output(pre, so))
    (params,) = [o.kv_transfer_params for eco in outs.values() for o in eco.outputs if o.request_id == rid]
    return params
