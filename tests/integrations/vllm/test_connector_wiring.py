"""The connector's factory (:func:`kvbm_backend.integrations.vllm.wiring.wire`) without an engine: vLLM's own
KV cache specs and configs (stand-ins only for what vLLM's engine would fill in), real pools on tmp files.

* a bad ``kv_connector_extra_config`` is a ConfigError naming the field, before any pool is opened;
* a worker-side G3 pool without the G3 extensions (``pool.base.G3Extensions``; here a real G4 file pool) is a
  TypeError naming the tier and the missing methods, at wiring time (not at the first offload);
* one path for one and several KV cache groups: a dense model is one group of the same worker/scheduler
  parts a hybrid model has several of; only the failed-load reporting and layer-wise loads differ, decided
  here once;
* ``g4.announce`` runs the scheduler's KV events with G4 alone and starts the announcer (and warns without
  vLLM's KV events);
* the scheduler's G4 lookups and the worker's load deadline wait for G4's whole load bound, retries included.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

HANG_S = 600.0  # a hang guard, not a bound: waits for a thread that must end; returns as soon as it does

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, SchedulerConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kvbm_backend.config import ConfigError, load_config  # noqa: E402
from kvbm_backend.integrations import tiers  # noqa: E402
from kvbm_backend.integrations.vllm.wiring import ConnectorParts, wire  # noqa: E402
from kvbm_backend.integrations.vllm.workers import GroupedWorkers  # noqa: E402
from kvbm_backend.pool.base import G3Extensions, require_g3_extensions  # noqa: E402
from kvbm_backend.model.hashing import sequence_hashes  # noqa: E402
from tests.helpers.pools import tiny_ns

BS, H, D, NB = 16, 2, 64, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _extra(tmp_path: Path, **over) -> dict:
    extra = {"kvbm_backend": {"model": "kvbm-backend/wiring-test",
                              "g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.05, "files_per_path": 1,
                                     "admission": {"policy": "all"}, "layerwise_load": True}}}
    extra.update(over)
    return extra


def _configs(extra: dict, hybrid: bool = False, async_scheduling: bool = False):
    ktc = KVTransferConfig(kv_connector="KvbmBackendConnector",
                           kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    vc = SimpleNamespace(kv_transfer_config=ktc, kv_events_config=None,
                         model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1, distributed_executor_backend=None),
                         cache_config=SimpleNamespace(cache_dtype="auto"),
                         scheduler_config=SchedulerConfig(async_scheduling=async_scheduling, max_model_len=4096,
                                                          is_encoder_decoder=False))
    full = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(NAMES, full)]
    if hybrid:
        sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16,
                                    sliding_window=48)
        groups = [KVCacheGroupSpec(NAMES[::2], full), KVCacheGroupSpec(NAMES[1::2], sliding)]
    return ktc, vc, KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("over, field", [
    ({"sliding_capacity_weight": 2}, "kv_connector_extra_config.sliding_capacity_weight"),
    ({"save": "yes"}, "kv_connector_extra_config.save"),
    ({"bogus_key": 1}, "bogus_key"),
    ({"kvbm_backend": {"g3": {"capacity_gb": -1}}}, "g3.capacity_gb"),
], ids=["weight", "save", "unknown-key", "pool-field"])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
def test_wire_bad_extra_config_is_an_error_naming_the_field(tmp_path, over, field, role):
    ktc, vc, kcc = _configs(_extra(tmp_path, **over))
    parts = ConnectorParts()
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        wire(parts, ktc, vc, role, kcc)
    assert parts._groups == [] and parts.worker is None and parts.sched is None  # nothing opened
    assert not (tmp_path / "g3").exists()


def test_wire_refuses_a_g3_pool_without_the_g3_extensions(tmp_path):
    """A pool given as G3 that lacks G3Extensions (a real G4 file pool) fails the worker's wiring with a
    TypeError naming the tier, the pool type and the missing methods; the old worker took it and failed
    only at its first offload or index report."""
    g4cfg = load_config({"g3": {"enabled": False},
                         "g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False}}, use_env=False)
    opened = []

    def g4_as_g3(cfg, ns, kv_heads=None):
        _, g4 = tiers.open_tiers(g4cfg, ns)
        opened.append(g4)
        return g4, None

    ktc, vc, kcc = _configs(_extra(tmp_path))
    parts = ConnectorParts()
    try:
        with pytest.raises(TypeError, match=r"g3: G4Pool is not a G3 pool \(G3Extensions lacks lease, release, "
                                            r"drop_corrupt, contains, keys, device_reader, layerwise_load\)"):
            wire(parts, ktc, vc, KVConnectorRole.WORKER, kcc, tiers=g4_as_g3)
        parts.release_partial()
        assert parts._groups == []
        # the scheduler role never needs G3's extensions (it looks prefixes up only)
        sched = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc, tiers=g4_as_g3)
        assert sched.sched is not None and sched.sched.g3 is opened[-1]
        sched.close()
    finally:
        for p in opened:
            p.close()


def test_g3_pool_satisfies_the_g3_extensions_protocol(tmp_path):
    cfg = load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.01, "files_per_path": 1}},
                      use_env=False)
    ns = tiny_ns("wiring/model")
    g3, _ = tiers.open_tiers(cfg, ns)
    try:
        assert isinstance(g3, G3Extensions) and require_g3_extensions(g3) is g3
        assert require_g3_extensions(None) is None
        with pytest.raises(TypeError, match=r"^g3: object is not a G3 pool \(G3Extensions lacks lease, release, "
                                            r"drop_corrupt, contains, keys, device_reader, layerwise_load, put\)"):
            require_g3_extensions(object())
    finally:
        g3.close()


def test_a_g3_pool_is_also_a_block_pool():
    """G3Extensions extends BlockPool (the worker gets, puts and reads stats of its G3 pool): an object with
    every G3 method but none of the BlockPool members is refused, naming them (before, it was taken)."""
    class OnlyG3Methods:
        def lease(self, keys): return [None] * len(keys)
        def release(self, leases): pass
        def drop_corrupt(self, key, reason): pass
        def contains(self, key): return False
        def keys(self): return []
        def device_reader(self, device): return None
        def layerwise_load(self, keys, device, **kw): return None
        def put(self, keys, blocks, **kw): return None

    with pytest.raises(TypeError, match=r"^g3: OnlyG3Methods is not a G3 pool \(G3Extensions lacks tier, namespace, "
                                        r"layout, lookup_prefix, get, delete, flush, stats, close\)"):
        require_g3_extensions(OnlyG3Methods())


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_wire_one_path_for_one_and_several_kv_cache_groups(tmp_path, hybrid):
    """Both models get the same parts: GroupedWorkers (one WorkerSide per group) and one SchedulerSide over
    GroupTiers; the dense model is the 1-group case with block-level load errors and layer-wise loads."""
    ktc, vc, kcc = _configs(_extra(tmp_path), hybrid=hybrid)
    w = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        n = 2 if hybrid else 1
        assert isinstance(w.worker, GroupedWorkers) and len(w.worker.workers) == n and w.sched is None
        assert w.worker.block_errors is (not hybrid)
        assert s.worker is None and len(s.sched.groups) == n and s.sched.layerwise is (not hybrid)
        assert [g.window_blocks for g in s.sched.groups] == ([None, 3] if hybrid else [None])
        # the uni executor: both roles share each group's pools
        assert [tg.g3 for tg in w._groups] == [tg.g3 for tg in s._groups]
        kvs = {n_: torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for n_ in NAMES}
        w.register_kv_caches(kvs, kcc)
        assert (w.worker.layerwise is not None) is (not hybrid)  # layer-wise loads: block-id errors only
        assert w.take_finished() == (set(), set()) and w.worker.load_errors() == set()
        # a call for the other role says so (it was an AttributeError on None)
        with pytest.raises(RuntimeError, match="^kvbm_backend: a worker-role call on the scheduler role's connector$"):
            s.register_kv_caches(kvs, kcc)
        with pytest.raises(RuntimeError, match="^kvbm_backend: a scheduler-role call on a worker role's connector$"):
            w.on_g3_report(0, 0, [], [], True)
    finally:
        w.close()
        s.close()
    assert not tiers._shared  # every group's tiers released


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async-scheduling", "sync-scheduling"])
def test_layerwise_loads_are_not_offered_under_async_scheduling(tmp_path, caplog, async_scheduling):
    """vLLM's async scheduling (``scheduler_config.async_scheduling``, its GPU default) schedules step N + 1
    before step N's ``invalid_block_ids`` are processed: a request of step N + 1 could take the blocks of a
    failed layer-wise load (cached at allocation) as its prefix hit and compute and sample from them. So with
    it on a G3 hit is answered asynchronously (``load_async=True``), the workers run no layer-wise loads and
    one WARNING names ``g3.layerwise_load`` and async scheduling; with it off layer-wise loads run as before
    (the old wiring offered them synchronously either way)."""
    ktc, vc, kcc = _configs(_extra(tmp_path), async_scheduling=async_scheduling)
    with caplog.at_level("WARNING", logger="kvbm_backend"):
        s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
        w = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    try:
        ns, g3 = s._groups[0].ns, s._groups[0].g3
        toks = list(range(100, 100 + BS * 3 + 1))
        blocks = [np.full(ns.layout.bytes_per_block, i, np.uint8) for i in range(3)]
        assert g3.put(ns.keys(sequence_hashes(toks, BS)), blocks).result(10).written == 3
        g3.flush(10)
        req = SimpleNamespace(request_id="r1", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        deadline = time.monotonic() + HANG_S
        while (answer := s.scheduler_role().get_num_new_matched_tokens(req, BS))[0] is None:
            assert time.monotonic() < deadline, "no answer from the scheduler's G3 lookup"
            time.sleep(0.01)
        assert answer == (2 * BS, async_scheduling)  # G3 serves blocks 1..2; sync (layer-wise) only without it
        assert s.sched.layerwise is (not async_scheduling)
        warned = [r.getMessage() for r in caplog.records if "async scheduling" in r.getMessage()]
        assert len(warned) == (1 if async_scheduling else 0)
        if async_scheduling:
            assert "g3.layerwise_load is on but vLLM's async scheduling is on" in warned[0]
        w.register_kv_caches({n: torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for n in NAMES}, kcc)
        assert (w.worker.layerwise is None) is async_scheduling
    finally:
        w.close()
        s.close()


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_layerwise_loads_are_not_offered_where_prefills_replay_full_cuda_graphs(tmp_path, caplog, mode):
    """A FULL ``cudagraph_mode`` seen at wiring (one the connector's ``requires_piecewise_for_cudagraph`` did not get
    to lower: a wrapper that does not ask) replays prefills without ``wait_for_layer_load``: the scheduler offers no
    layer-wise load, the workers run none, and one WARNING names the mode; PIECEWISE keeps them."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    ktc, vc, kcc = _configs(_extra(tmp_path))
    vc.compilation_config = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode])
    with caplog.at_level("WARNING", logger="kvbm_backend"):
        s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
        w = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    try:
        full = mode == "FULL"
        assert s.sched.layerwise is (not full)
        warned = [r.getMessage() for r in caplog.records if "cudagraph_mode is" in r.getMessage()]
        assert len(warned) == full and all("g3.layerwise_load is on" in m and "FULL" in m for m in warned)
        w.register_kv_caches({n: torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16) for n in NAMES}, kcc)
        assert (w.worker.layerwise is None) is full
    finally:
        w.close()
        s.close()


def test_no_full_mode_layerwise_warning_for_a_connector_that_never_loads(tmp_path, caplog):
    """``load: false``: the connector does not ask vLLM for PIECEWISE graphs (nothing loads), so vLLM keeps a FULL
    ``cudagraph_mode``; the wiring must not then advise giving the FULL graphs up for layer-wise loads the engine
    never makes (review of 2026-12-03: it did, at every start)."""
    from vllm.config import CompilationConfig, CUDAGraphMode

    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
    extra = _extra(tmp_path, load=False)
    assert KvbmBackendConnector.requires_piecewise_for_cudagraph(extra) is False
    ktc, vc, kcc = _configs(extra)
    vc.compilation_config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL)
    with caplog.at_level("WARNING", logger="kvbm_backend"):
        s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        warned = [r.getMessage() for r in caplog.records if "cudagraph_mode is" in r.getMessage()]
        assert not warned, warned
    finally:
        s.close()


@pytest.mark.parametrize("announce, events", [(True, True), (False, True), (True, False)],
                         ids=["announce", "announce-off", "no-kv-events"])
def test_wire_g4_announce_runs_kv_events_without_g3(tmp_path, caplog, announce, events):
    """``g4.announce`` with vLLM's KV events on and G4 alone: the scheduler's KV events run without G3
    (``G3KvEvents(g3=False)``) and an announcer thread is started; off, a G4-only worker publishes nothing (as
    before); without KV events the option is one WARNING and nothing is started."""
    from kvbm_backend.integrations.vllm.g4_announce import G4Announcer
    extra = {"kvbm_backend": {"model": "kvbm-backend/wiring-test", "g3": {"enabled": False},
                              "g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}",
                                     "keyring": {"path": str(tmp_path / "keys" / "keyring.json")},
                                     "announce": announce, "announce_interval_s": 0.5}}}
    ktc, vc, kcc = _configs(extra)
    vc.kv_events_config = SimpleNamespace(enable_kv_cache_events=events) if events else None
    s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        if announce and events:
            assert s.sched.events is not None and s.sched.events.g3 is False
            assert isinstance(s.announcer, G4Announcer) and s.sched.events.announcer is s.announcer
            assert s.announcer.interval_s == 0.5 and s.announcer._t.is_alive()
        else:
            assert s.sched.events is None and s.announcer is None
        warned = any("g4.announce is on but vLLM publishes no KV events" in r.message for r in caplog.records)
        assert warned is (announce and not events)
    finally:
        s.close()
    if s.announcer is not None:
        s.announcer._t.join(HANG_S)
        assert not s.announcer._t.is_alive()  # close() stops the thread


def test_wire_g4_lookup_timeout_and_load_deadline_count_g4_retries(tmp_path):
    """``g4.retries``: the G4 pool resolves within ``timeout_s x (1 + retries)`` (``G4Config.load_bound_s``), so
    the scheduler's lookups and the worker's load deadline wait that long. Review finding 7: they used
    ``timeout_s`` alone, and a G4 answer that took longer than one attempt (within the pool's bound) was a
    counted lookup timeout, matched 0 tokens. Here every HEAD waits until one attempt's ``timeout_s`` passed."""
    import time

    import numpy as np

    from kvbm_backend.integrations.vllm import stats
    from kvbm_backend.model.hashing import sequence_hashes
    g4cfg = {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False, "timeout_s": 1.0, "retries": 10}
    extra = {"kvbm_backend": {"model": "kvbm-backend/wiring-test", "g3": {"enabled": False}, "g4": g4cfg}}
    cfg = load_config(extra["kvbm_backend"], use_env=False)
    ktc, vc, kcc = _configs(extra)
    s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    w = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    try:
        assert w.worker.workers[0].load_timeout_s == cfg.g3.load_timeout_s + cfg.g4.load_bound_s
        g4, ns = s._groups[0].g4, s._groups[0].ns
        assert g4.load_bound_s == cfg.g4.load_bound_s == 1.0 * 11 + 0.05
        toks = list(range(100, 100 + BS * 4 + 5))
        keys = ns.keys(sequence_hashes(toks, BS)[:4])
        blocks = [np.full(ns.layout.bytes_per_block, i, np.uint8) for i in range(4)]
        assert g4.put(keys, blocks).result(HANG_S).written == 4
        real, slow_until = g4.store.head, [0.0]

        def slow_head(name):  # slower than one attempt, well inside the pool's bound
            while time.monotonic() < slow_until[0]:
                time.sleep(0.01)
            return real(name)
        g4.store.head = slow_head
        stats.reset()
        req = SimpleNamespace(request_id="r1", prompt_token_ids=toks, cache_salt=None, lora_request=None)
        slow_until[0] = time.monotonic() + cfg.g4.timeout_s + 0.1
        end = time.monotonic() + HANG_S
        while (n := s.sched.get_num_new_matched_tokens(req, 0)[0]) is None:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert n == 4 * BS and stats.get("lookup_timeouts") == 0
    finally:
        w.close()
        s.close()


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_wire_g3_follows_the_g4_keyrings_revocations_in_both_roles(tmp_path, monkeypatch, hybrid):
    """With G3 and a G4 keyring both roles get the tenants G3 refuses (``kvbm-backend keys revoke``:
    integrations/revoked_tenants.py): the scheduler's lookups skip G3 for them, the worker (every group's
    WorkerSide) neither loads nor stores them and purges every group's G3 pool of them; the scheduler's purges
    nothing (its G3 is the worker's). Without a keyring (or without G3) there is nothing to follow: None. Closing the
    parts stops the checks. Before 2026-12 no part followed the keyring: G3 served revoked tenants."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    g4 = {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "keyring": {"path": str(tmp_path / "kr.json"),
                                                                          "reload_interval_s": 7.0}}
    extra = _extra(tmp_path)
    extra["kvbm_backend"]["g4"] = g4
    ktc, vc, kcc = _configs(extra, hybrid=hybrid)
    w = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    s = wire(ConnectorParts(), ktc, vc, KVConnectorRole.SCHEDULER, kcc)
    try:
        assert w.revoked is not None and s.revoked is not None and s.sched.revoked is s.revoked
        assert w.revoked.g3 == [tg.g3 for tg in w._groups] and len(w.revoked.g3) == (2 if hybrid else 1)
        assert s.revoked.g3 == [] and w.revoked.interval_s == s.revoked.interval_s == 7.0
        assert all(ws.revoked is w.revoked and ws.offloads.revoked is w.revoked for ws in w.worker.workers)
        assert w.revoked.keyring is w._groups[0].g4.keyring
    finally:
        w.close()
        s.close()
    assert not w.revoked._ticker.is_alive() and not s.revoked._ticker.is_alive()
    plain = _extra(tmp_path / "plain")
    plain["kvbm_backend"]["g4"] = {"enabled": True, "url": f"file://{tmp_path / 'g4p'}", "encrypt": False}
    ktc, vc, kcc = _configs(plain)
    w = wire(ConnectorParts(), ktc, vc, KVConnectorRole.WORKER, kcc)
    try:
        assert w.revoked is None and all(ws.revoked is None for ws in w.worker.workers)
    finally:
        w.close()
