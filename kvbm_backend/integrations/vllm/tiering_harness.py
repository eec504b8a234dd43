"""vLLM's real tiering offloading manager driven without an engine: :func:`offloading_config` builds the
``OffloadingConfig`` the OffloadingConnector would, :class:`TieringHarness` plays the scheduler around
vLLM's ``TieringOffloadingSpec`` / ``TieringOffloadingManager`` (a host primary tier and the configured
secondary tiers). Used by ``kvbm-backend bench --tier vllm-tiers`` (``apps/bench/vllm_tiers.py``) and the
tiering tests.
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadKey
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec


def offloading_config(*, secondary_tiers: list[dict], num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype: str = "bfloat16", tokens_per_block: int = 16, blocks_per_chunk: int = 1,
                      chunks: int = 64, world_size: int = 1, kv_cache_layout: str | None = "LBNHC",
                      enable_kv_cache_events: bool = False, model: str = "kvbm-bench", engine_id: str | None = None,
                      extra: dict | None = None):
    """vLLM's ``OffloadingConfig`` for a one-group (full attention) model, as the OffloadingConnector
    would build it (``offloading/config.py``): ``worker_kv_bytes_per_block = layers * heads *
    tokens_per_block * (2 * head_dim) * dtype bytes``; ``cpu_bytes_to_use`` sized for ``chunks`` chunks."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    from kvbm_backend.model.layout import dtype_bytes
    worker_bytes = num_layers * num_kv_heads * tokens_per_block * 2 * head_dim * dtype_bytes(dtype)
    chunk_bytes = worker_bytes * blocks_per_chunk * world_size
    chunk_bytes += (-chunk_bytes) % 4096
    extra_config: dict[str, Any] = {"cpu_bytes_to_use": chunks * chunk_bytes, "secondary_tiers": secondary_tiers}
    extra_config.update(extra or {})
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens_per_block,
                                      layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(num_layers)),
                                      group_id=0),),
        worker_kv_bytes_per_block=worker_bytes, enable_kv_cache_events=enable_kv_cache_events,
        extra_config=extra_config, engine_id=engine_id or f"kvbm-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
        kv_cache_layout=kv_cache_layout)


class TieringHarness:
    """vLLM's real ``TieringOffloadingSpec`` / ``TieringOffloadingManager`` driven like its scheduler
    would, with a host primary buffer and no engine. ``config`` is an ``OffloadingConfig``; ``spec_cls`` a
    ``TieringOffloadingSpec`` subclass (e.g. :class:`.native_cpu.CpuTieringOffloadingSpec`, a CPU engine's)."""

    def __init__(self, config, spec_cls: Any = None) -> None:
        from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
        self.spec = (spec_cls or TieringOffloadingSpec)(config)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)  # what a TieringOffloadingSpec makes
        self.manager = manager
        view = self.manager.primary_tier.get_kv_memoryview()
        strides = view.strides
        assert strides is not None  # a tuple for every CPython memoryview (typeshed allows None)
        self.row_stride = int(strides[0])
        self.primary = np.asarray(view).view(np.uint8).reshape(-1, self.row_stride)
        self.chunk_bytes = int(self.spec.cpu_page_size_per_worker) * (
            1 if self.spec.replicated_layout else config.parallel.world_size)
        self._n = 0

    @property
    def tier(self):
        return self.manager.secondary_tiers[0]

    def context(self, req_id: str | None = None, kv_transfer_params: dict | None = None):
        from vllm.v1.kv_offload.base import ReqContext
        self._n += 1
        return ReqContext(req_id=req_id or f"req-{self._n}", kv_transfer_params=kv_transfer_params)

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def wait_idle(self, timeout: float = 120.0, poll_s: float = 0.0005) -> None:
        """Step until no tier job is pending. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            if not self.manager.has_pending_work():
                return
            if time.monotonic() > deadline:
                raise TimeoutError("tiering manager still has pending work")
            time.sleep(poll_s)

    def store(self, keys: list[OffloadKey], payloads: list[np.ndarray], ctx=None, finish: bool = True) -> list[int]:
        """Offload ``payloads[i]`` (``chunk_bytes`` uint8 each) under ``keys[i]``: GPU->primary is
        simulated by writing the primary chunk, then ``complete_store`` cascades to the secondary tiers.
        Returns the primary chunk ids. Does not wait for the cascade (see :meth:`wait_idle`)."""
        ctx = ctx or self.context()
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            raise RuntimeError("primary tier is full")
        ids = [int(c) for c in cast("CPULoadStoreSpec", out.store_spec).chunk_ids]  # the primary: vLLM's CPU tier
        pos = {k: i for i, k in enumerate(keys)}
        for k, cid in zip(out.keys_to_store, ids):
            self.primary[cid, :self.chunk_bytes] = payloads[pos[k]]
        self.manager.complete_store(out.keys_to_store, ctx, True)
        if finish:
            self.manager.on_request_finished(ctx)
        return ids

    def lookup_prefix(self, keys: list[OffloadKey], ctx=None, timeout: float = 60.0, poll_s: float = 0.0005) -> int:
        """Step lookups until the prefix resolves, as vLLM's ``OffloadingConnectorScheduler.
        _maximal_prefix_lookup`` does (scan on through HIT_PENDING and RETRY so every chunk's lookup
        and promotion start in one step; stop at MISS). Returns how many leading keys are primary
        HITs (promoted from a secondary tier where needed). Each key's position in the request is recorded first
        where none is (``ReqContext.set_offload_key_position``, as vLLM's ``update_offload_keys`` does for every
        key: the tiers look a request's ascending keys up as one prefix). Raises TimeoutError."""
        from vllm.v1.kv_offload.base import LookupResult
        ctx = ctx or self.context()
        for i, k in enumerate(keys):
            if ctx.get_offload_key_position(k) is None:
                ctx.set_offload_key_position(k, i + 1)
        deadline = time.monotonic() + timeout
        while True:
            n, defer = 0, False
            for k in keys:
                r = self.manager.lookup(k, ctx)
                if r is LookupResult.MISS:
                    break
                if r is LookupResult.HIT:
                    n += 1
                elif r is LookupResult.HIT_PENDING:
                    n += 1
                    defer = True
                else:  # RETRY
                    defer = True
            if not defer:
                return n
            self.step()
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookup unresolved after {timeout}s ({n} hits so far)")
            time.sleep(poll_s)

    def promote(self, keys: list[OffloadKey], ctx=None, timeout: float = 60.0):
        """Start a request for ``keys`` and resolve its prefix (promoting from secondary tiers) without
        reading the bytes. Returns ``(ctx, n)`` for :meth:`collect`, ``n`` the leading primary HITs."""
        ctx = ctx or self.context()
        self.manager.on_new_request(ctx)
        return ctx, self.lookup_prefix(keys, ctx, timeout)

    def collect(self, keys: list[OffloadKey], ctx, n: int) -> list[np.ndarray]:
        """Finish a :meth:`promote`: copies of the ``n`` leading chunks' bytes (``chunk_bytes`` each)
        read from the primary, then the request ends."""
        out: list[np.ndarray] = []
        if n:
            spec = self.manager.prepare_load(keys[:n], ctx)
            out = [self.primary[int(c), :self.chunk_bytes].copy() for c in cast("CPULoadStoreSpec", spec).chunk_ids]
            self.manager.complete_load(keys[:n], ctx)
        self.manager.on_request_finished(ctx)
        self.step()
        return out

    def load(self, keys: list[OffloadKey], ctx=None, timeout: float = 60.0) -> list[np.ndarray]:
        """Look ``keys`` up (promoting from secondary tiers) and return copies of the leading HIT chunks'
        bytes (``chunk_bytes`` each); the list is shorter than ``keys`` on a miss."""
        ctx, n = self.promote(keys, ctx, timeout)
        return self.collect(keys, ctx, n)

    def reset_primary(self) -> None:
        """vLLM's ``reset_cache``: drain the tiers, empty the primary tier (secondary data stays)."""
        self.manager.reset_cache()

    def shutdown(self) -> None:
        self.primary = None  # type: ignore[assignment]  # shut down: never read again, lets vLLM's buffer go
        self.manager.shutdown()


def offload_key(digest: bytes, group: int = 0) -> OffloadKey:
    """vLLM's offload key (``make_offload_key``) for a block hash ``digest`` in KV cache group ``group``."""
    from vllm.v1.kv_offload.base import make_offload_key
    return make_offload_key(digest, group)


def vllm_fs_uses_o_direct(path: str) -> bool:
    """Whether vLLM's own ``fs`` secondary tier would write with O_DIRECT in ``path`` (vLLM 0.32's
    ``probe_o_direct`` of the directory), so a comparison can give our G3 tier the same durability."""
    from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct
    return bool(probe_o_direct(path))
