"""Gather vLLM's paged per-layer KV into KVBM block buffers, and scatter them back.

A KVBM block of one TP rank is FullyContiguous ``[layer, outer(K,V), page, inner]`` with
``inner = kv_heads_per_rank * head_dim`` (:mod:`kvbm_backend.model.layout`). vLLM keeps one tensor
per attention layer whose layout depends on the attention backend:

* ``"packed"``: vLLM 0.32's GPU backends (FlashAttention ``flash_attn.py``, Triton ``triton_attn.py``,
  FlexAttention ``flex_attention.py``, ...): one tensor of logical shape
  ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` with K and V adjacent on the last dim
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``: K = ``[..., :head_dim]``, V =
  ``[..., head_dim:]``), in the stride order of vLLM's ``KVCacheLayout`` (NHD = ``LBNHC``, the default:
  physically ``[num_blocks, block_size, heads, 2 * head_dim]``; HND = ``LBHNC``; the block-major
  ``BLNHC``/``BLHNC``). Moved through the view ``[num_blocks, heads, block_size, 2, head_dim]``
  (``unflatten`` of the last dim: valid for every one of those stride orders).
* ``"cpu"``: vLLM's CPU backend (``vllm/v1/attention/backends/cpu_attn.py``), the same logical shape
  ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (contiguous), which that backend views as
  ``[num_blocks, heads, 2 * block_size, head_dim]`` and splits K (first ``block_size`` rows) and V
  (next ``block_size`` rows). So one engine block is ``[heads, 2(K,V), page, head_dim]``.
  The shape cannot tell ``"packed"`` from ``"cpu"``: the tensors' device decides
  (:func:`.geometry.engine_kv_packed`: CPU -> ``"cpu"``, any accelerator -> ``"packed"``). Before
  2026-11-30 every such tensor was read as ``"cpu"``: on a GPU engine that view raised for NHD strides
  with more than one KV head and stored a wrong K/V interleave for HND; GPU engines' namespaces now
  carry ``kv_version`` 2 so those blocks are never read (:class:`~kvbm_backend.model.namespace.Namespace`).
* ``"kv_first"``: older vLLM FlashAttention / FlashInfer / Triton NHD, tensor
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
* ``"block_first"``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
* ``"mla"`` (DeepSeek-V2/V3/R1 style Multi-head Latent Attention): one compressed latent per token,
  ``head_dim = kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek), no K/V split, the same on every
  TP rank. vLLM 0.32 allocates it as ``[num_blocks, 1, block_size, head_dim]`` (its logical
  ``[blocks, kv_heads=1, page, head]`` view; measured on the CPU MLA backend
  ``vllm/v1/attention/backends/mla/cpu_mla.py``: shape ``(64, 1, 16, 576)``, strides
  ``(9216, 576, 576, 1)``, bf16, ``MLAAttentionSpec(num_kv_heads=1, head_size=576, block_size=16)``);
  older vLLM and the GPU MLA backends use ``[num_blocks, block_size, head_dim]``. Both are accepted.
  The KVBM block is then ``[layer, outer=1, page, head_dim]`` (KVBM ``LayoutConfig`` with
  ``outer_dim = 1``).

:class:`EngineKv` detects which one it has from the shapes (raising ``ValueError`` naming the shape
when it is none of these) and moves blocks with torch indexing (any strides), on whatever device the
tensors are, or on CUDA with one Triton launch per move (:mod:`kvbm_backend.gpu.layer_copy`: every layout
above, packed ones in any of vLLM's stride orders; :attr:`EngineKv.move_mode` says which).

FP8 KV caches (``--kv-cache-dtype fp8``: ``torch.float8_e4m3fn`` / ``float8_e5m2`` tensors) are moved as
their bytes (``uint8`` views of the same storage; torch has no CPU ``index_copy_`` for float8): the
stored block holds the engine's FP8 bytes unchanged, one byte per element.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from ...gpu import layer_copy
from ...gpu.rows import device_index
from ...memory import BufferPool
from ...model.layout import KvLayout
from .geometry import FP8_CACHE_DTYPES, EngineGeometry, detect_engine_layout, dtype_name, engine_kv_packed

__all__ = ["EngineKv", "detect_engine_layout", "numpy_staging", "split_blocks", "torch_dtype_name"]


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (:func:`.geometry.dtype_name`). Raises ValueError for dtypes KV
    caches do not use."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv cache dtype: {dtype} is not supported")
    return dtype_name(dtype)


@dataclass
class EngineKv:
    """The engine's registered KV tensors (one per layer, in layer order) and their geometry.

    Attributes:
        tensors: per-layer KV tensors, all of one layout/dtype/device.
        geometry: the group's :class:`~.geometry.EngineGeometry` with ``engine_layout`` detected from the
            tensors (``num_layers`` = tensors given, ``dtype`` = theirs).
    Properties: ``layout`` (the per-rank KvLayout of one block, ``page_size`` = vLLM ``block_size``,
    ``outer_dim`` 1 for MLA, else 2), ``engine_layout`` (``"packed"``, ``"cpu"``, ``"kv_first"``,
    ``"block_first"`` or ``"mla"``), ``num_kv_heads`` and ``head_dim`` (per rank; MLA: 1 and the latent width).
    """

    tensors: list[torch.Tensor]
    geometry: EngineGeometry

    @property
    def layout(self) -> KvLayout:
        return self.geometry.kv_layout

    @property
    def engine_layout(self) -> str:
        lay = self.geometry.engine_layout
        assert lay is not None  # from_geometry detects it (the only constructor used)
        return lay

    @property
    def num_kv_heads(self) -> int:
        return self.geometry.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.geometry.head_dim

    @classmethod
    def from_geometry(cls, tensors: Sequence[torch.Tensor], geometry: EngineGeometry, num_blocks: int,
                      mla: bool | None = None, packed: bool | None = None) -> "EngineKv":
        """Wrap the per-layer tensors of a KV cache group whose geometry vLLM's KV cache spec gave
        (:meth:`EngineGeometry.from_kv_cache_spec`); layer count and dtype are the tensors' own, so a
        mismatch with the spec shows as a layout mismatch at registration.

        Args:
            num_blocks: engine blocks per tensor (``KVCacheConfig.num_blocks``).
            mla: True for an MLA latent cache, False for K/V caches, None to decide from the shape
                (MLA when ``num_kv_heads == 1`` and the tensor is ``[num_blocks, (1,) block_size,
                head_dim]``, which no K/V layout matches).
            packed: the K/V convention of a ``[num_blocks, heads, block_size, 2 * head_dim]`` tensor
                (``"packed"`` or ``"cpu"``); None: from the tensors' device
                (:func:`.geometry.engine_kv_packed`: packed unless on the CPU).
        Raises ValueError for no tensors, an unknown shape (named), or layers that differ.
        """
        if not tensors:
            raise ValueError("kv caches: no attention layers registered")
        ts = list(tensors)
        dtype = torch_dtype_name(ts[0].dtype)
        if dtype == "uint8" and geometry.dtype in FP8_CACHE_DTYPES.values():
            dtype = geometry.dtype  # vLLM allocates FP8 caches as raw bytes (geometry.kv_dtype_name)
        geo = replace(geometry, num_layers=len(ts), dtype=dtype)
        if packed is None:
            packed = engine_kv_packed(ts[0].device.type)
        geo = geo.with_engine_layout(ts[0].shape, num_blocks, mla=mla, packed=packed)
        for t in ts:
            if tuple(t.shape) != tuple(ts[0].shape) or t.dtype != ts[0].dtype:
                raise ValueError(f"kv caches: layers differ in shape/dtype ({tuple(t.shape)} {t.dtype} vs "
                                 f"{tuple(ts[0].shape)} {ts[0].dtype})")
        return cls(ts, geo)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int,
                     num_kv_heads: int, head_dim: int, mla: bool | None = None,
                     packed: bool | None = None) -> "EngineKv":
        """:meth:`from_geometry` with the geometry given as numbers (tests, benchmarks)."""
        if not tensors:
            raise ValueError("kv caches: no attention layers registered")
        geo = EngineGeometry(len(tensors), int(num_kv_heads), int(head_dim), 2,
                             torch_dtype_name(tensors[0].dtype), int(block_size))
        return cls.from_geometry(tensors, geo, num_blocks, mla=mla, packed=packed)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def num_blocks(self) -> int:
        """Engine blocks per layer tensor (ids are ``0 .. num_blocks - 1``)."""
        tv, dim = self._targets()[0]
        return int(tv.shape[dim])

    @property
    def _moved(self) -> list[torch.Tensor]:
        """The tensors as moved: FP8 (any 1-byte float) as ``uint8`` views of the same memory."""
        t0 = self.tensors[0]
        if t0.element_size() == 1 and t0.dtype.is_floating_point:
            return [t.view(torch.uint8) for t in self.tensors]
        return self.tensors

    def _targets(self) -> list[tuple[torch.Tensor, int]]:
        """``(tv, dim)`` per layer, made once: the engine tensor as moved (:attr:`_moved`) viewed so that
        ``dim`` is its block dimension, block ``i`` of :meth:`_by_layer`'s layer ``li`` being engine block
        ``idx[i]`` along it. Cached: every view costs GIL hand-offs per load (:mod:`kvbm_backend.gpu.rows`)."""
        cached = self.__dict__.get("_targets_cache")
        if cached is not None:
            return cached
        dim = 1 if self.engine_layout == "kv_first" else 0
        out = [(tv, dim) for tv in self._views(self._moved)]
        self.__dict__["_targets_cache"] = out
        return out

    def _views(self, moved: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layer tensors as moved viewed as :meth:`_targets` moves them; their dimensions are
        :attr:`_dims`."""
        H, D, N = self.num_kv_heads, self.head_dim, self.layout.page_size
        lay = self.engine_layout
        if lay == "cpu":  # [nb, H, N, 2D] == [nb, H, 2, N, D] in memory
            return [t.view(-1, H, 2, N, D) for t in moved]
        if lay == "packed":  # [nb, H, N, 2D], any strides, K|V on the last dim -> [nb, H, N, 2, D]
            return [t.unflatten(-1, (2, D)) for t in moved]
        return list(moved)

    @property
    def _dims(self) -> str:
        """What each dimension of a :meth:`_views` tensor is (:func:`kvbm_backend.gpu.layer_copy.plan`):
        ``b`` engine block, ``o`` K/V, ``t`` token, ``h`` head, ``d`` head_dim."""
        lay = self.engine_layout
        if lay == "mla":
            return "bhtd" if self.tensors[0].dim() == 4 else "btd"
        return {"cpu": "bhotd", "packed": "bhtod", "kv_first": "obthd", "block_first": "bothd"}[lay]

    def _by_layer(self, blocks: torch.Tensor) -> torch.Tensor:
        """``blocks`` (``[n, layers, outer, page, heads, head_dim]``, :meth:`block_view`) as one view whose
        ``[li]`` has layer ``li``'s target shape along its dimension (:meth:`_targets`): gathers are
        ``index_select(tv, dim, idx, out=view[li])``, scatters ``tv.index_copy_(dim, idx, view[li])``. Both read
        and write the strided views as they are: no temporary, one pass over the bytes (a gathered copy then a
        permuted copy cost two passes and, on the CPU, fresh pages per layer: measured on the 2-core dev VM,
        512 Llama-3.1-8B blocks of a ``kv_first`` engine, gather 1.3 GB/s and 262,144 page faults that way vs
        10.5-13.3 GB/s and none; scatter 2.0 vs 9.7 GB/s). One permute per call, not one per layer."""
        lay, n = self.engine_layout, blocks.shape[0]
        if lay == "mla":  # [n, L, 1, N, 1, D] -> [L, n, *engine block shape]
            return blocks.transpose(0, 1).view(blocks.shape[1], n, *self.tensors[0].shape[1:])  # a view: gathers write it
        if lay == "cpu":  # layer li of block i as [H, 2, N, D]
            return blocks.permute(1, 0, 4, 2, 3, 5)
        if lay == "packed":  # layer li of block i as [H, N, 2, D]
            return blocks.permute(1, 0, 4, 3, 2, 5)
        if lay == "kv_first":  # [2, n, N, H, D] per layer
            return blocks.permute(1, 2, 0, 3, 4, 5)
        return blocks.transpose(0, 1)  # block_first: [n, 2, N, H, D] per layer

    def block_view(self, staging: torch.Tensor, n: int) -> torch.Tensor:
        """View ``n`` contiguous KVBM blocks (uint8, ``n * bytes_per_block``) as
        ``[n, layers, outer, page, heads, head_dim]`` of the KV dtype (``outer`` 2, or 1 for MLA)."""
        L, O, N = self.layout.num_layers, self.layout.outer_dim, self.layout.page_size
        return staging.view(self._targets()[0][0].dtype).view(n, L, O, N, self.num_kv_heads, self.head_dim)

    def block_index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Engine block ids as an int64 index on :attr:`device`, without waiting for the device: on CUDA the
        ids go through pinned host memory and one ``non_blocking`` copy on the current stream, so nothing
        waits for the kernels queued there. (``torch.as_tensor(ids, device="cuda")`` copies from pageable
        memory and synchronises the current stream: inside vLLM's forward, where ``wait_for_layer_load``
        scatters, that made the host wait for every queued layer before it could launch the next; in the load
        thread, for the engine's step in flight; :func:`kvbm_backend.gpu.rows.device_index`.) A tensor already
        on the device is returned as it is."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.device == self.device:
                return block_ids
            return device_index(block_ids.tolist(), self.device)
        return device_index(list(block_ids), self.device)

    def gather(self, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        """Copy engine blocks ``block_ids`` into ``staging`` (uint8 tensor of
        ``len(block_ids) * bytes_per_block`` bytes, any device), block i at ``i * bytes_per_block``. One kernel
        launch where :attr:`move_mode` says so, else one ``index_select`` per layer. Raises IndexError for an
        id outside the engine's blocks (checked on the host first, whichever way the blocks move)."""
        self._check_ids(block_ids)
        if not self._launch(block_ids, staging, to_engine=False):
            self._torch_gather(block_ids, staging)

    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Inverse of :meth:`gather`: write block i of ``staging`` into engine block ``block_ids[i]``. Raises
        IndexError for an id outside the engine's blocks before any engine byte is written."""
        self._check_ids(block_ids)
        if len(block_ids) and not self._launch(block_ids, staging, to_engine=True):
            self._torch_scatter(staging, block_ids)

    def _check_ids(self, block_ids: Sequence[int] | torch.Tensor) -> None:
        """Raise IndexError for a listed engine block id outside ``[0, num_blocks)``, on the host, before a
        move. The torch ops alone do not do it right: on the CPU ``index_copy_`` raises only after it wrote
        the layers before the bad id; on CUDA an id out of range is a device-side assert (the process's CUDA
        context is lost), and an engine whose kernel check failed moves with the torch ops.
        An index tensor (:meth:`block_index`) is not checked (it lives on the device)."""
        if not isinstance(block_ids, torch.Tensor):
            layer_copy.check_ids(block_ids, self.num_blocks)

    def _torch_gather(self, block_ids: Sequence[int], staging: torch.Tensor) -> None:
        n = len(block_ids)
        idx = self.block_index(block_ids)
        dst = self._by_layer(self.block_view(staging, n))
        for li, (tv, dim) in enumerate(self._targets()):
            torch.index_select(tv, dim, idx, out=dst[li])

    def _torch_scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        n = len(block_ids)
        idx = self.block_index(block_ids)
        src = self.block_view(staging, n)
        if src.device != self.device:
            src = src.to(self.device, non_blocking=False)
        src = self._by_layer(src)
        for li, (tv, dim) in enumerate(self._targets()):
            tv.index_copy_(dim, idx, src[li])

    # ---- one launch per move (kvbm_backend.gpu.layer_copy) -----------------------------------------------
    @property
    def move_mode(self) -> str:
        """How :meth:`gather` and :meth:`scatter` move blocks: ``"triton kernel verified"`` (one launch per
        call, checked once against the torch ops on scratch tensors of this geometry; the first use
        synchronises the device) or why the per-layer torch ops run."""
        return self._mover()[1]

    def _mover(self) -> tuple[tuple[layer_copy.Pieces, torch.Tensor] | None, str]:
        st = self.__dict__.get("_mover_state")
        if st is None:
            st = self.__dict__["_mover_state"] = self._make_mover()
        return st

    def _make_mover(self) -> tuple[tuple[layer_copy.Pieces, torch.Tensor] | None, str]:
        moved, bpb = self._moved, self.layout.bytes_per_block
        p, why = layer_copy.plan([tv for tv, _ in self._targets()], self._dims, bpb)
        if p is None:
            return None, why
        ok, why = layer_copy.check(self._dims, bpb, self._scratch, self._views, self._reference)
        if not ok:
            return None, why
        return (p, device_index([t.data_ptr() for t in moved], self.device)), why

    def _layer_ptrs(self) -> list[torch.Tensor]:
        """One-address tables, one per layer (views made once: a view per call costs GIL hand-offs)."""
        cached = self.__dict__.get("_layer_ptrs_cache")
        if cached is None:
            mv, _ = self._mover()
            assert mv is not None
            cached = self.__dict__["_layer_ptrs_cache"] = [mv[1][li:li + 1] for li in range(mv[1].shape[0])]
        return cached

    def _scratch(self, num_blocks: int) -> list[torch.Tensor]:
        """Zeroed layer tensors like the engine's (as moved) with ``num_blocks`` blocks, in the engine's stride
        order (vLLM 0.32's NHD caches are permuted views), dense (the kernel's check)."""
        t = self._moved[0]
        shape = list(t.shape)
        shape[1 if self.engine_layout == "kv_first" else 0] = num_blocks
        st = t.stride()
        order = sorted(range(t.dim()), key=lambda d: (-st[d], d))  # outermost dimension first
        back = [order.index(d) for d in range(t.dim())]
        return [torch.zeros([shape[d] for d in order], dtype=t.dtype, device=t.device).permute(back)
                for _ in self.tensors]

    def _reference(self, tensors: list[torch.Tensor], staging: torch.Tensor, ids: list[int], to_engine: bool) -> None:
        """The torch ops' move on ``tensors`` (:meth:`_scratch`) in place of the engine's."""
        e = EngineKv(tensors, self.geometry)
        if to_engine:
            e._torch_scatter(staging, ids)
        else:
            e._torch_gather(ids, staging)

    def _launch(self, block_ids: Sequence[int], staging: torch.Tensor, to_engine: bool) -> bool:
        """Move with the kernel where it is usable for this call; False: the caller runs the torch ops."""
        mv, _ = self._mover()
        if mv is None or isinstance(block_ids, torch.Tensor) or staging.device != self.device \
                or staging.dtype != torch.uint8 or not staging.is_contiguous() or staging.data_ptr() % 4 \
                or staging.numel() != len(block_ids) * self.layout.bytes_per_block:
            return False
        p, ptrs = mv  # ids checked by the caller (_check_ids)
        layer_copy.move(p, ptrs, staging.reshape(-1), self.block_index(list(block_ids)), to_engine)
        return True

    def scatter_layer(self, layer: int, src: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> None:
        """Write layer ``layer`` of ``len(block_ids)`` blocks into engine blocks ``block_ids``: ``src`` is
        ``[n, layer_bytes]`` uint8 on the engine's device (row i: layer ``layer`` of a FullyContiguous block,
        ``[outer, page, inner]``; rows may be strided), as a layer-wise load delivers it. ``block_ids`` may be
        an index made once for every layer (:meth:`block_index`). One kernel launch where :attr:`move_mode`
        says so, else one ``index_copy_``. Listed ids outside the engine's blocks raise IndexError before any
        byte moves; an index tensor's ids are not checked again (out of range, the kernel moves nothing, the
        torch ops raise on the CPU and hit a device-side assert on CUDA)."""
        n = len(block_ids)
        if n == 0:
            return
        self._check_ids(block_ids)
        mv, _ = self._mover()
        lb = self.layout.bytes_per_block // self.layout.num_layers
        if mv is not None and src.device == self.device and src.dtype == torch.uint8 and src.dim() == 2 \
                and src.shape[1] == lb and src.stride(1) == 1 and src.stride(0) % 4 == 0 and src.data_ptr() % 4 == 0:
            layer_copy.move(mv[0], self._layer_ptrs()[layer], src, self.block_index(block_ids), True,
                            row_bytes=src.stride(0))
            return
        O, N = self.layout.outer_dim, self.layout.page_size
        s = src.reshape(n, 1, -1).view(self._targets()[0][0].dtype).view(n, 1, O, N, self.num_kv_heads, self.head_dim)
        idx = self.block_index(block_ids)
        tv, dim = self._targets()[layer]
        tv.index_copy_(dim, idx, self._by_layer(s)[0])

def numpy_staging(nbytes: int, pool: BufferPool | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """A 4 KiB-aligned host buffer of ``nbytes`` as numpy (for the pools) and as a torch uint8 tensor
    sharing its memory (``torch.from_numpy``: no copy). Taken from ``pool`` (:class:`BufferPool`; give the
    numpy array back when the pools are done with it), else newly allocated."""
    arr = (pool or _ONE_SHOT).take(nbytes)
    return arr, torch.from_numpy(arr)


_ONE_SHOT = BufferPool("host", 0, name="vllm-staging-one-shot")  # keeps nothing: plain aligned allocations


def split_blocks(arr: np.ndarray, layout: KvLayout, n: int) -> list[np.ndarray]:
    """The ``n`` per-block 1-D uint8 views of a staging buffer (the pools' block buffers)."""
    b = layout.bytes_per_block
    return [arr[i * b:(i + 1) * b] for i in range(n)]
