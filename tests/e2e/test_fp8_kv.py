"""FP8 (e4m3) KV caches through the connector.

* Connector path (runs everywhere): the real :class:`KvbmBackendConnector` in both roles, driven the
  way vLLM's scheduler and worker call it (``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
  ``build_connector_meta`` with a real vLLM ``Request``; ``register_kv_caches`` / ``start_load_kv`` /
  ``wait_for_save`` / ``get_finished`` on ``torch.float8_e4m3fn`` KV tensors in the CPU backend's layout):
  blocks saved by one engine's connectors are loaded by fresh connectors byte for byte; the FP8 namespace
  differs from the bf16 one, so a bf16 engine finds none of the FP8 blocks.
* Engine (``--kv-cache-dtype fp8`` on vLLM's CPU engine): runs only where vLLM's CPU attention supports
  an FP8 KV cache (x86 with AVX-512 or AMX, ``vllm/v1/attention/backends/cpu_attn.py``
  ``_get_attn_isa``); elsewhere it is skipped with that reason.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

# side: hang guards only, no wall-clock assertion (moved from the engine lane, 2026-11-29)
pytestmark = [pytest.mark.vllm, pytest.mark.side]
HANG_S = 600.0  # a hang guard, not a bound: waits for answers, loads and engine processes that must come

BS, H, D, NB, LAYERS = 32, 2, 64, 16, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def _configs(tmp_path: Path, dtype: torch.dtype, cache_dtype: str = "auto"):
    extra = {"kvbm_backend": {"model": "kvbm-backend/fp8-test",
                              "g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                                     "admission": {"policy": "all"}, "load_timeout_s": 120},  # not a bound here
                              "g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False,
                                     "timeout_s": 60}}}  # (busy CI VM: were the 5 s / 2 s defaults)
    ktc = KVTransferConfig(kv_connector="KvbmBackendConnector",
                           kv_connector_module_path="kvbm_backend.integrations.vllm.connector",
                           kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    vc = SimpleNamespace(kv_transfer_config=ktc, kv_events_config=None,
                         model_config=SimpleNamespace(served_model_name="m", model="m"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=1, distributed_executor_backend=None),
                         cache_config=SimpleNamespace(cache_dtype=cache_dtype))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    return vc, kcc


def _connectors(tmp_path: Path, dtype: torch.dtype):
    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector
    vc, kcc = _configs(tmp_path, dtype)
    return (KvbmBackendConnector(vc, KVConnectorRole.SCHEDULER, kcc),
            KvbmBackendConnector(vc, KVConnectorRole.WORKER, kcc))


def _kv_tensors(dtype: torch.dtype, seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer KV in the CPU backend's layout ``[num_blocks, heads, block_size, 2 * head_dim]``: random
    bytes (every FP8 bit pattern, NaNs included: the connector must move bytes, not values), or zeros."""
    out = {}
    for i, n in enumerate(NAMES):
        t = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
        if seed is not None:
            g = torch.Generator().manual_seed(seed + i)
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g)
                                      .view(t.view(torch.uint8).shape))
        out[n] = t
    return out


def _request(rid: str, toks: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256_cbor)
    return Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BS, sha256_cbor))


class _Blocks:
    """``KVCacheBlocks.get_block_ids()``: one block-id list per KV cache group."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def _step(rid: str, block_ids: list[int], num_computed: int, num_scheduled: int):
    """The SchedulerOutput fields the connector reads, for one new request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(block_ids),), num_computed_tokens=num_computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={rid: num_scheduled})


def _matched(sched, req, timeout: float = HANG_S) -> tuple[int, bool]:
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        n, asynchronous = sched.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n, asynchronous
        time.sleep(0.01)
    raise AssertionError("lookup never answered")


def _block_bytes(kv: dict[str, torch.Tensor], block_id: int) -> list[bytes]:
    return [kv[n][block_id].view(torch.uint8).numpy().tobytes() for n in NAMES]


def test_fp8_blocks_round_trip_through_the_connector_and_stay_out_of_bf16(tmp_path):
    toks = list(range(300, 300 + 4 * BS + 3))  # 4 full blocks + 3 tokens
    src_ids = [3, 7, 1, 12, 5]

    # --- engine 1: compute (the KV is "computed" = the random FP8 bytes), save -----------------------
    sched, worker = _connectors(tmp_path, torch.float8_e4m3fn)
    kv1 = _kv_tensors(torch.float8_e4m3fn, seed=0)
    worker.register_kv_caches(kv1)
    assert sched.ns.layout.dtype == "float8_e4m3fn" and sched.ns.layout.bytes_per_block == LAYERS * 2 * BS * H * D
    fp8_fp = sched.ns.fingerprint
    r1 = _request("r1", toks)
    assert _matched(sched, r1) == (0, False)
    sched.update_state_after_alloc(r1, _Blocks(src_ids), 0)
    meta = sched.build_connector_meta(_step("r1", src_ids, 0, len(toks)))
    assert [len(s.block_ids) for s in meta.saves] == [4] and not meta.loads
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker.shutdown()  # flushes G3 and G4
    sched.request_finished(r1, src_ids)
    sched.shutdown()

    # --- engine 2: fresh connectors and zeroed KV; the prefix is loaded from G3 byte for byte --------
    sched, worker = _connectors(tmp_path, torch.float8_e4m3fn)
    assert sched.ns.fingerprint == fp8_fp
    kv2 = _kv_tensors(torch.float8_e4m3fn, seed=None)
    worker.register_kv_caches(kv2)
    r2 = _request("r2", toks)
    assert _matched(sched, r2) == (4 * BS, True)
    dst_ids = [9, 2, 14, 6, 11]
    sched.update_state_after_alloc(r2, _Blocks(dst_ids), 4 * BS)
    meta = sched.build_connector_meta(_step("r2", dst_ids, 4 * BS, len(toks) - 4 * BS))
    assert [(j.block_ids, j.tiers) for j in meta.loads] == [(dst_ids[:4], ["G3"] * 4)]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    t = time.monotonic() + HANG_S  # a hang guard (was 30 s): returns once the load finished
    done: set = set()
    while "r2" not in done and time.monotonic() < t:
        _, recv = worker.get_finished(set())
        done |= recv or set()
        time.sleep(0.01)
    assert "r2" in done
    assert worker.get_block_ids_with_load_errors() == set()
    for s, d in zip(src_ids[:4], dst_ids[:4]):
        assert _block_bytes(kv2, d) == _block_bytes(kv1, s)
    assert not any(kv2[n][dst_ids[4]].view(torch.uint8).any() for n in NAMES)  # the partial block: untouched
    worker.shutdown()
    sched.request_finished(r2, dst_ids)
    sched.shutdown()

    # --- a bf16 engine on the same G3/G4: another namespace, so none of the FP8 blocks is a hit -------
    sched, worker = _connectors(tmp_path, torch.bfloat16)
    try:
        assert sched.ns.fingerprint != fp8_fp and sched.ns.layout.dtype == "bfloat16"
        assert _matched(sched, _request("r3", toks)) == (0, False)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_fp8_caches_vllm_allocates_as_bytes_get_their_element_type_in_the_namespace(tmp_path):
    """vLLM allocates ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` caches as ``torch.uint8`` tensors
    (``STR_DTYPE_TO_TORCH_DTYPE``; the engine test below shows it on the CPU engine): the namespace takes
    the element type from ``cache_dtype``, so e4m3 and e5m2 blocks never meet; packed formats whose bytes
    are not one value each are refused, naming the setting."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbm_backend.integrations.vllm.connector import KvbmBackendConnector

    def ns(cache_dtype: str):
        vc, kcc = _configs(tmp_path, torch.uint8, cache_dtype)
        c = KvbmBackendConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        try:
            return c.ns
        finally:
            c.shutdown()

    e4m3, e4m3b, e5m2 = ns("fp8"), ns("fp8_e4m3"), ns("fp8_e5m2")
    assert e4m3.layout.dtype == "float8_e4m3fn" and e5m2.layout.dtype == "float8_e5m2"
    assert e4m3.fingerprint == e4m3b.fingerprint != e5m2.fingerprint
    assert e4m3.layout.bytes_per_block == LAYERS * 2 * BS * H * D  # one byte per value
    with pytest.raises(ValueError, match="--kv-cache-dtype 'nvfp4'"):
        ns("nvfp4")


def _run_fp8(tmp: Path, name: str, model_dir: Path, ps, extra: dict, **spec_kw) -> dict:
    """:func:`vllm_runner.run_engine` with ``kv_cache_dtype="fp8"``: this module run as a script wraps
    ``vllm.LLM`` so that :mod:`kvbm_backend.integrations.vllm.engine_run` builds its engine with an FP8 KV cache."""
    import json
    import os
    import subprocess
    from tests.helpers.vllm_runner import REPO
    spec = {"model_dir": str(model_dir), "prompts": ps, "connector": {"extra": extra}, "max_tokens": 4,
            "out": str(tmp / f"{name}.result.json"), **spec_kw}
    sp = tmp / f"{name}.spec.json"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(sp)], capture_output=True, text=True,
                       timeout=HANG_S, env=env, cwd=str(tmp))  # a hang guard (was 300 s)
    out = Path(spec["out"])
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"engine {name} failed (rc={r.returncode}):\n{(r.stdout + r.stderr)[-6000:]}")
    return json.loads(out.read_text())


def _fp8_kv_refusal() -> str | None:
    """vLLM 0.32's reason to refuse an FP8 KV cache on this CPU (``_get_attn_isa``), or None."""
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported():
        return None
    return ("vLLM 0.32 CPU attention: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.' "
            "(vllm/v1/attention/backends/cpu_attn.py _get_attn_isa); this CPU has neither")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: three engines, each guarded at HANG_S (was 600)
@pytest.mark.skipif(_fp8_kv_refusal() is not None, reason=str(_fp8_kv_refusal()))
def test_fp8_kv_engine_fresh_engine_and_restart(tmp_path):
    """A Llama with ``kv_cache_dtype="fp8"`` on the CPU engine: a fresh engine process loads from G3 and
    a restarted one (empty G3) from G4, with outputs identical to the engine that computed the KV."""
    from tests.helpers.vllm_runner import connector_extra as _connector_extra
    from tests.helpers.vllm_runner import prompts

    from kvbm_backend.apps.engine_model import TINY, write_model_dir
    model_dir = write_model_dir(tmp_path / "model", TINY)
    ps = prompts(3, 400, seed=31)
    g4 = f"file://{tmp_path / 'g4'}"
    kw = dict(dtype="bfloat16", num_gpu_blocks=48, warmup=False)

    def connector_extra(workdir, url):  # loads are counted exactly below: G3/G4 bounds that are not the subject
        extra = _connector_extra(workdir, url, timeout_s=60.0)  # G4: was the 2 s default
        extra["kvbm_backend"]["g3"]["load_timeout_s"] = 120  # G3: was the 5 s default
        return extra
    a = _run_fp8(tmp_path, "writer", model_dir, ps, connector_extra(tmp_path / "w", g4), **kw)
    # the KV dtype in the namespace is vLLM's FP8 one (an engine of another KV dtype never loads these
    # blocks); vLLM's CPU backend allocates the FP8 cache as raw bytes (torch.uint8) on AMX CPUs
    info = a["connector_info"]
    assert info["namespace_dtype"] == "float8_e4m3fn", info
    assert info["kv_cache_dtype"] in ("torch.uint8", "torch.float8_e4m3fn", "torch.float8_e5m2"), info
    assert info["bytes_per_block"] == TINY.kv_bytes_per_token // 2 * 32, info  # 1 byte per element, not bf16's 2
    b = _run_fp8(tmp_path, "reader", model_dir, ps, connector_extra(tmp_path / "w", g4), **kw)
    assert b["outputs"] == a["outputs"]
    assert b["connector_stats"].get("load_g3_blocks_ok", 0) == 3 * (399 // 32), b["connector_stats"]
    c = _run_fp8(tmp_path, "restart", model_dir, ps, connector_extra(tmp_path / "fresh", g4), **kw)
    assert c["outputs"] == a["outputs"]
    assert c["connector_stats"].get("load_g4_blocks_ok", 0) == 3 * (399 // 32), c["connector_stats"]


if __name__ == "__main__":  # the FP8 engine process of _run_fp8
    import functools

    from kvbm_backend.integrations.vllm import engine_run
    vllm.LLM = functools.partial(vllm.LLM, kv_cache_dtype="fp8")
    sys.exit(engine_run.main(sys.argv[1:]))
