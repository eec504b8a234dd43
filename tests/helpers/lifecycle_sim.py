"""A request-lifecycle simulation (after the 2026-12-01 lifecycle review's simulator): vLLM's real ``Scheduler`` with
``KvbmBackendConnector`` in both roles in one process (``uni`` executor: one real G3 pool), the worker role on CPU KV
tensors, and a fake forward. The forward writes ``f(token prefix)`` (:func:`fvals`) at every position it computes
and first checks that every position it reads (``[0, num_computed_tokens)``) holds ``f`` of its own prefix: a
position that does not is KV that was never loaded or computed for it. :meth:`Sim.step` records, in
:attr:`Sim.errors`, each wrong read vLLM does not discard (no load error reported in that step, a token emitted from
it, or the request keeping the step's tokens as computed)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
from tests.helpers.vllm_sched import runner_output, tiny_scheduler

BS = 16
HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a lookup, a G3 put); returns as soon as it does
_MOD = (1 << 23) - 15  # values stay exact in float32


def fvals(tokens: list[int]) -> list[float]:
    """The KV value of each position: a rolling hash of the token prefix up to it (float32-exact)."""
    out, h = [], 7
    for t in tokens:
        h = (h * 1000003 + int(t) + 1) % _MOD
        out.append(float(h))
    return out


def build(tmp: Path, num_blocks: int, batched: int, extra_g3: dict | None = None
          ) -> tuple[Scheduler, KvbmBackendConnector, dict[str, torch.Tensor]]:
    """``(scheduler, worker-role connector, KV tensors by layer)``: one full-attention group of ``num_blocks``
    blocks of :data:`BS` tokens, ``batched`` tokens a step, a G3 pool under ``tmp`` (``extra_g3``: more of its
    config, e.g. ``{"layerwise_load": True}``)."""
    g3 = {"paths": [str(tmp / "g3")], "capacity_gb": 0.2, "files_per_path": 1, "admission": {"policy": "all"}}
    g3.update(extra_g3 or {})
    s = tiny_scheduler(tmp, {"kvbm_backend": {"model": "tiny", "g3": g3}},
                       lambda kw, names: [KVCacheGroupSpec(names, FullAttentionSpec(**kw))],
                       block_size=BS, num_blocks=num_blocks, batched_tokens=batched)
    w = KvbmBackendConnector(s.vllm_config, KVConnectorRole.WORKER, s.kv_cache_config)
    names = s.kv_cache_config.kv_cache_groups[0].layer_names
    kvs = {n: torch.zeros(num_blocks, 2, BS, 128, dtype=torch.float32) for n in names}
    w.register_kv_caches(kvs)
    return s, w, kvs


def hasher() -> Callable:
    init_none_hash(sha256_cbor)
    return get_request_block_hasher(BS, sha256_cbor)


def mkreq(rid: str, toks: list[int], max_tokens: int, block_hasher: Callable) -> Request:
    return Request(rid, toks, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, 0,
                   block_hasher=block_hasher)


class Sim:
    """Steps ``s`` (the scheduler) with ``w`` (the worker-role connector) over ``kvs`` (:func:`build`)."""

    def __init__(self, s: Scheduler, w: KvbmBackendConnector, kvs: dict[str, torch.Tensor]):
        self.s, self.w, self.kvs = s, w, kvs
        self.errors: list[str] = []  # wrong reads vLLM kept (see the module doc)
        self.rolled_back = 0  # wrong reads vLLM discarded (a load error reported, the step undone)
        self.steps = 0
        self._wrong: dict[str, tuple[int, str]] = {}

    def _read(self, blk: int, off: int) -> set[float]:
        vals: set[float] = set()
        for t in self.kvs.values():
            vals.update(torch.unique(t[blk, :, off, :]).tolist())
        return vals

    def _forward(self, so: Any) -> None:
        for name in self.kvs:
            self.w.wait_for_layer_load(name)
        starts = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        starts.update((rid, c.num_computed_tokens[i]) for i, rid in enumerate(c.req_ids))
        for rid, n in so.num_scheduled_tokens.items():
            req = self.s.requests.get(rid)
            if req is None:
                continue
            start, toks = starts[rid], list(req.all_token_ids)
            f = fvals(toks)
            bids = list(self.s.kv_cache_manager.get_block_ids(rid)[0])
            for p in range(start):
                got = self._read(bids[p // BS], p % BS)
                if got != {f[p]}:
                    self._wrong[rid] = (start, f"step {self.steps}: wrong KV read by {rid} at position {p} (engine "
                                               f"block {bids[p // BS]}): {sorted(got)[:3]}, want {f[p]}")
                    break
            for p in range(start, min(start + n, len(toks))):  # KV over a wrong read is wrong: poisoned
                for t in self.kvs.values():
                    t[bids[p // BS], :, p % BS, :] = -float(p + 2) if rid in self._wrong else f[p]

    def step(self, between: Callable[[Any], None] | None = None) -> Any:
        """One engine step; ``between(scheduler_output)`` runs after ``schedule`` (before the worker's part)."""
        s, w = self.s, self.w
        self._wrong = {}
        so = s.schedule()
        if between is not None:
            between(so)
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        self._forward(so)
        w.wait_for_save()
        tr = w.get_transfer_results(so.finished_req_ids)
        inv = w.get_block_ids_with_load_errors()
        meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        eco = s.update_from_output(so, runner_output(s, so, KVConnectorOutput(
            finished_recving=tr.finished_recving or None, failed_recving=tr.failed_recving or None,
            invalid_block_ids=inv, kv_connector_worker_meta=meta)))
        emitted = {o.request_id for v in eco.values() for o in v.outputs if o.new_token_ids}
        for rid, (start, msg) in self._wrong.items():
            req = s.requests.get(rid)
            if not inv and not tr.failed_recving:
                self.errors.append(msg + ": in a step with no load error reported")
            elif rid in emitted:
                self.errors.append(msg + ": a token emitted from it")
            elif req is not None and req.num_computed_tokens > start:
                self.errors.append(msg + f": kept as computed ({req.num_computed_tokens} tokens)")
            else:
                self.rolled_back += 1
        self.steps += 1
        return so


def looked_up(sd: Any, req: Request) -> int:
    """The connector scheduler role ``sd``'s match for ``req`` once its lookup is done (tokens)."""
    end = time.monotonic() + HANG_S
    while (n := sd.get_num_new_matched_tokens(req, 0)[0]) is None:
        assert time.monotonic() < end, "lookup never done"
        time.sleep(0.01)
    return n


def warm(sim: Sim, prompt: list[int], block_hasher: Callable) -> None:
    """A request computes ``prompt`` and its saves store it in G3; then vLLM's prefix cache is dropped."""
    s, w = sim.s, sim.w
    s.add_request(mkreq("warm", prompt, 1, block_hasher))
    while s.requests:
        sim.step()
    w.parts.worker.workers[0].flush_saves(HANG_S)
    s.connector.sched.groups[0].g3.flush(HANG_S)
    assert s.reset_prefix_cache()
