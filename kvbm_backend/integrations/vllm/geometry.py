"""The engine's KV geometry, derived once from vLLM's KV cache config, for the connector and the tiers.

:class:`EngineGeometry` is what both vLLM seams need to map the engine's KV to KVBM blocks: layers, KV
heads per TP rank, head size, K/V or MLA, dtype, tokens per engine block, and the engine tensor layout
once the tensors are known. It is derived from vLLM's objects in one place:

* the connector (:mod:`.connector`, :mod:`.kv_io`): :meth:`EngineGeometry.from_kv_cache_spec`, one per
  KV cache group, from ``KVCacheConfig.kv_cache_groups[g]`` (``vllm/v1/kv_cache_interface.py``), then
  :meth:`EngineGeometry.with_engine_layout` when ``register_kv_caches`` hands over the tensors;
* the secondary tiers (:mod:`.tiering`): :meth:`PrimaryGeometry.from_spec`, from the ``OffloadingSpec``
  the tier is built with (``vllm/v1/kv_offload/config.py`` ``OffloadingConfig``: vLLM does not pass the
  KV heads to the scheduler side, so the tier config gives them); :class:`PrimaryGeometry` is an
  :class:`EngineGeometry` plus the primary tier's chunk (blocks per chunk, rank slices, their bytes and
  ``KVCacheLayout``) and the permutation between that chunk and a KVBM FullyContiguous block.

Pure Python and numpy (no torch): the scheduler side imports it too.
"""
from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any, Sequence

import numpy as np

from ...model.layout import KvLayout, dtype_bytes

__all__ = ["EngineGeometry", "PrimaryGeometry", "detect_engine_layout", "engine_kv_packed", "spec_device_type",
           "dtype_name", "kv_dtype_name", "KV_DTYPES", "FP8_CACHE_DTYPES", "total_kv_heads"]

#: KV cache dtypes the tiers store (names as torch spells them, without ``torch.``)
KV_DTYPES = ("bfloat16", "float16", "float32", "uint8", "int8", "float8_e4m3fn", "float8_e5m2")


#: vLLM ``--kv-cache-dtype`` values whose cache tensor is raw bytes (``torch.uint8``, vLLM
#: ``STR_DTYPE_TO_TORCH_DTYPE``) and that the tiers store, with the element type the bytes hold
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_dtype_name(spec_dtype: Any, cache_dtype: str | None) -> str:
    """The KV dtype name of the namespace: the KV cache spec's dtype, except where vLLM allocates the
    cache as raw bytes (``torch.uint8`` for ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` and for
    packed formats, ``vllm/utils/torch_utils.py``): then the element type ``cache_dtype`` names, so that
    an e4m3 engine and an e5m2 engine never share blocks. ROCm's ``fp8`` (e4m3fnuz) is not told apart
    (this project runs vLLM on CUDA and CPU). Raises ValueError naming a ``--kv-cache-dtype`` whose
    bytes are not one element per value (nvfp4, int4 and other packed or scaled formats)."""
    name = dtype_name(spec_dtype)
    if name not in ("uint8", "int8") or cache_dtype in (None, "", "auto"):
        return name
    cd = str(cache_dtype).lower()
    if cd in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cd]
    raise ValueError(f"--kv-cache-dtype {cache_dtype!r} (a {name} cache): not supported by KvbmBackendConnector; "
                     f"supported: auto, bfloat16, float16, float32, {', '.join(sorted(FP8_CACHE_DTYPES))}")


def total_kv_heads(vllm_config: Any) -> int | None:
    """The model's KV heads before TP (vLLM ``ModelConfig.get_total_num_kv_heads()``, what canonical G4
    parts are cut by: :mod:`kvbm_backend.model.canonical`); None where the config cannot say."""
    f = getattr(getattr(vllm_config, "model_config", None), "get_total_num_kv_heads", None)
    try:
        return int(f()) if f is not None else None
    except Exception:  # noqa: BLE001 - configs without an architecture (tests' stand-ins)
        return None


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` (or ``"torch.bfloat16"`` / ``"bfloat16"``) -> ``"bfloat16"``. Raises ValueError
    for dtypes KV caches do not use."""
    name = str(dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ValueError(f"kv cache dtype: {dtype} is not supported")
    return name


def detect_engine_layout(shape: Sequence[int], num_blocks: int, block_size: int, num_kv_heads: int,
                         head_dim: int, mla: bool = False, packed: bool = False) -> str:
    """Name the engine layout of one layer's KV tensor (``"cpu"``, ``"packed"``, ``"kv_first"``,
    ``"block_first"`` or ``"mla"``; see :mod:`.kv_io`).

    Args:
        mla: the KV cache is an MLA latent cache (``num_kv_heads`` must then be 1 and ``head_dim`` the
            latent width, e.g. 576); only the ``"mla"`` layout matches then, and only it matches MLA.
        packed: how a ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` tensor holds K and V
            (both vLLM 0.32 conventions have that logical shape): True for the GPU backends' packed K|V
            (``"packed"``: K = ``[..., :head_dim]``, V = ``[..., head_dim:]``), False for the CPU
            backend's K rows then V rows (``"cpu"``). :func:`engine_kv_packed` decides it.
    Raises ValueError naming the shape when it matches none of the known layouts.
    """
    s = tuple(int(x) for x in shape)
    if mla:
        if num_kv_heads != 1:
            raise ValueError(f"kv cache: MLA has one latent per token, got num_kv_heads={num_kv_heads}")
        if s in ((num_blocks, block_size, head_dim), (num_blocks, 1, block_size, head_dim)):
            return "mla"
        raise ValueError(f"kv cache tensor shape {s}: not a known vLLM MLA layout for num_blocks={num_blocks}, "
                         f"block_size={block_size}, latent head_size={head_dim} (expected "
                         f"{(num_blocks, 1, block_size, head_dim)} or {(num_blocks, block_size, head_dim)})")
    if s == (num_blocks, num_kv_heads, block_size, 2 * head_dim):
        return "packed" if packed else "cpu"
    if s == (2, num_blocks, block_size, num_kv_heads, head_dim):
        return "kv_first"
    if s == (num_blocks, 2, block_size, num_kv_heads, head_dim):
        return "block_first"
    raise ValueError(f"kv cache tensor shape {s}: not a known vLLM layout for num_blocks={num_blocks}, "
                     f"block_size={block_size}, kv_heads={num_kv_heads}, head_dim={head_dim}")


def engine_kv_packed(device_type: str) -> bool:
    """Whether an engine on ``device_type`` (``"cuda"``, ``"cpu"``, ...: the KV tensors' ``device.type``,
    or vLLM's ``DeviceConfig.device_type`` on the scheduler side) keeps K and V packed on the last dim of a
    ``[num_blocks, heads, block_size, 2 * head_dim]`` tensor. vLLM 0.32: every GPU backend allocates
    that logical shape and splits the last dim, K = ``[..., :head_size]``, V = ``[..., head_size:]``
    (``vllm/v1/attention/backends/flash_attn.py`` ``kv_cache.transpose(1, 2).split(self.head_size,
    dim=-1)``; ``triton_attn.py``, ``flex_attention.py`` the same; the offloading connector's
    ``canonical_mapping.py`` ``_packed_kv_regions`` reads this convention), in any stride order of
    ``KVCacheLayout`` (NHD default, HND, block-major). Only vLLM's CPU backend (``cpu_attn.py``, the
    one backend of ``device_type == "cpu"``) views the same shape as ``[num_blocks, heads, 2 *
    block_size, head_dim]``: K rows then V rows. So: packed unless the device is the CPU."""
    return str(device_type) != "cpu"


@dataclass(frozen=True)
class EngineGeometry:
    """KV geometry of one KV cache group of the engine, per TP rank.

    Attributes (and where vLLM 0.32 says them):
        num_layers: attention layers of the group: ``len(KVCacheGroupSpec.layer_names)``
            (``vllm/v1/kv_cache_interface.py``; tiers: ``OffloadingGroupConfig.layer_names``,
            ``vllm/v1/kv_offload/config.py``).
        num_kv_heads: KV heads per TP rank: ``AttentionSpec.num_kv_heads`` (vLLM's attention layer
            already divides by TP); 1 for MLA. Tiers: the tier config's ``num_kv_heads`` / ``layout``
            preset (the ``OffloadingConfig`` does not carry it).
        head_dim: elements per head: ``AttentionSpec.head_size`` (MLA: the latent,
            ``kv_lora_rank + qk_rope_head_dim``, 576 for DeepSeek). Tiers: derived from
            ``cpu_page_size_per_worker`` (``vllm/v1/kv_offload/cpu/spec.py``) unless given.
        outer_dim: 2 (K and V), or 1 for MLA (``MLAAttentionSpec`` / ``use_mla``).
        dtype: KV dtype name: ``AttentionSpec.dtype`` (the ``--kv-cache-dtype``, e.g. FP8). Tiers:
            ``OffloadingModelConfig.dtype`` (``auto`` -> bfloat16).
        tokens_per_block: tokens per engine block: ``KVCacheSpec.block_size`` (tiers:
            ``OffloadingGroupConfig.tokens_per_block``).
        tp_world_size (keyword): TP ranks: ``ParallelConfig.tensor_parallel_size`` (tiers:
            ``OffloadingParallelConfig.tp_size``).
        engine_layout (keyword): the engine tensor layout (:func:`detect_engine_layout`) once the
            connector's worker has its tensors (``register_kv_caches``); None before and in the tiers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    outer_dim: int
    dtype: str
    tokens_per_block: int
    _: KW_ONLY
    tp_world_size: int = 1
    engine_layout: str | None = None

    @property
    def mla(self) -> bool:
        return self.outer_dim == 1

    @functools.cached_property
    def kv_layout(self) -> KvLayout:
        """The per-rank KvLayout of one stored block (``page_size`` = tokens per engine block)."""
        return KvLayout(num_layers=self.num_layers, outer_dim=self.outer_dim, page_size=self.tokens_per_block,
                        inner_dim=self.num_kv_heads * self.head_dim, dtype=self.dtype)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one stored block of one TP rank, all layers (``kv_layout.bytes_per_block``; a primary
        chunk's rank slice for :class:`PrimaryGeometry`)."""
        return self.kv_layout.bytes_per_block

    @classmethod
    def from_kv_cache_spec(cls, spec: Any, num_layers: int, tp_world_size: int = 1,
                           cache_dtype: str | None = None) -> "EngineGeometry":
        """From one vLLM KV cache group: its ``AttentionSpec`` (``FullAttentionSpec``, ``SlidingWindowSpec``,
        ``MLAAttentionSpec``: ``block_size``, ``num_kv_heads``, ``head_size``, ``dtype``, ``use_mla``), its
        layer count and vLLM's ``cache_config.cache_dtype`` (:func:`kv_dtype_name`). Raises ValueError for
        specs without those fields (state / linear attention), for an MLA spec with more than one KV head
        and for an unsupported ``--kv-cache-dtype``."""
        for a in ("num_kv_heads", "head_size", "block_size", "dtype"):
            if not hasattr(spec, a):
                raise ValueError(f"kv cache spec {type(spec).__name__}: no {a}; only standard attention is supported")
        mla = type(spec).__name__ == "MLAAttentionSpec" or bool(getattr(spec, "use_mla", False))
        if mla and int(spec.num_kv_heads) != 1:
            raise ValueError(f"kv cache spec {type(spec).__name__}: MLA with num_kv_heads={spec.num_kv_heads}; "
                             "expected one latent per token (num_kv_heads=1)")
        return cls(int(num_layers), int(spec.num_kv_heads), int(spec.head_size), 1 if mla else 2,
                   kv_dtype_name(spec.dtype, cache_dtype), int(spec.block_size), tp_world_size=int(tp_world_size))

    def with_engine_layout(self, shape: Sequence[int], num_blocks: int, mla: bool | None = None,
                           packed: bool = False) -> "EngineGeometry":
        """This geometry with ``engine_layout`` detected from one layer's tensor ``shape`` (vLLM's
        ``KVCacheConfig.num_blocks`` blocks). ``mla`` None: decided from the shape (MLA when one KV head and
        ``[num_blocks, (1,) block_size, head_dim]``, which no K/V layout matches). ``packed``: the engine's
        K/V convention (:func:`detect_engine_layout`, :func:`engine_kv_packed`). Raises ValueError
        naming the shape when it is no known layout."""
        n, tpb, h, d = num_blocks, self.tokens_per_block, self.num_kv_heads, self.head_dim
        if mla is None:
            mla = h == 1 and tuple(int(x) for x in shape) in ((n, tpb, d), (n, 1, tpb, d))
        lay = detect_engine_layout(shape, n, tpb, h, d, mla=mla, packed=packed)
        return replace(self, outer_dim=1 if mla else 2, engine_layout=lay)


_LAYER_MAJOR = {"LBHNC": "HNC", "LBNHC": "NHC"}
_BLOCK_MAJOR = {"BLHNC": "HNC", "BLNHC": "NHC"}
_FC_AXES = ("L", "O", "J", "N", "H", "D")
#: vLLM's legacy names of two layouts (``config/cache.py`` ``_LAYOUT_COMPAT_ALIASES``)
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def _layout_name(name: Any) -> str:
    """A ``KVCacheLayout`` name as the tiers compare it: upper case, vLLM's legacy aliases resolved."""
    n = str(name).upper()
    return _LAYOUT_ALIASES.get(n, n)


def _same_bytes(a: str, b: str, sizes: dict[str, int]) -> bool:
    """Whether layouts ``a`` and ``b`` (:func:`_layout_name` forms) place every byte of a primary chunk alike:
    a ``KVCacheLayout`` name is its axes' memory order (``L`` layers, ``B`` blocks of the chunk, ``H`` heads, ``N``
    tokens, ``C`` a head's bytes), and an axis of one element (``sizes``) moves nothing: MLA's one latent "head",
    one KV head per rank, one block per chunk."""
    if a == b:
        return True
    if sorted(a) != sorted(b) or sorted(a) != sorted("LBHNC"):
        return False
    return [x for x in a if sizes.get(x, 2) > 1] == [x for x in b if sizes.get(x, 2) > 1]


@dataclass(frozen=True)
class PrimaryGeometry(EngineGeometry):
    """How one rank's slice of a vLLM primary chunk maps to one KVBM FullyContiguous block (see
    :mod:`.tiering`): the :class:`EngineGeometry` plus the chunk.

    Attributes (sizes per rank), after those of :class:`EngineGeometry`:
        blocks_per_chunk: GPU blocks per chunk (``OffloadingCacheConfig.blocks_per_chunk``).
        copies: rank slices per primary row (TP world size, 1 when replicated: ``OffloadingSpec.
            replicated_layout``).
        rank_bytes: bytes of one rank's slice (``CPUOffloadingSpec.cpu_page_size_per_worker``).
        kv_cache_layout: vLLM KVCacheLayout name (``OffloadingConfig.kv_cache_layout``).
        packed: how a page's ``C`` holds K and V (:func:`engine_kv_packed`): True (default) for vLLM's GPU
            backends, K|V packed on the last dim, a page ``[H, N, 2, D]`` (``*HNC``) or ``[N, H, 2, D]``
            (``*NHC``); False for vLLM's CPU backend (``cpu_attn.py`` views ``[nb, H, N, 2D]`` as ``[nb, H,
            2N, D]`` and ``chunk(2, dim=2)``: K rows then V rows), a page ``[H, 2, N, D]``, LBHNC only (the
            one layout ``CPUAttentionBackend.supported_kv_cache_layouts`` gives). MLA (one latent): no K/V.
    Raises ValueError naming the setting for a layout it cannot map or sizes that disagree.
    """

    blocks_per_chunk: int
    copies: int
    rank_bytes: int
    kv_cache_layout: str = "LBNHC"
    packed: bool = True

    @property
    def kv_version(self) -> int:
        """The native tier namespace's ``kv_version``: 2 for a CPU engine's K/V blocks (read as K rows then
        V rows since 2026-11-30; before, as packed K|V: scrambled blocks under version 0), else 0 (GPU
        engines and MLA: their reading did not change, nor do their fingerprints)."""
        return 0 if self.packed or self.mla else 2

    def __post_init__(self) -> None:
        if self.kv_cache_layout not in _LAYER_MAJOR and self.kv_cache_layout not in _BLOCK_MAJOR:
            raise ValueError(
                f"kv_cache_layout: {self.kv_cache_layout!r} is not supported by the kvbm tiers "
                f"(supported: {sorted({**_LAYER_MAJOR, **_BLOCK_MAJOR})}; heads outside the block cannot "
                "be mapped to one block)")
        if not self.packed and not self.mla and self.kv_cache_layout != "LBHNC":
            raise ValueError(f"kv_cache_layout: {self.kv_cache_layout!r} on a CPU engine; vLLM's CPU attention "
                             "backend keeps only LBHNC (K rows then V rows per block and head)")
        want = (self.num_layers * self.outer_dim * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)
                * self.tokens_per_block * self.blocks_per_chunk)
        if want != self.rank_bytes:
            raise ValueError(
                f"num_kv_heads/head_dim: layers {self.num_layers} x outer {self.outer_dim} x heads "
                f"{self.num_kv_heads} x head_dim {self.head_dim} x {dtype_bytes(self.dtype)} B x tokens "
                f"{self.tokens_per_block} x blocks_per_chunk {self.blocks_per_chunk} = {want} B, but vLLM's "
                f"primary chunk holds {self.rank_bytes} B per rank (padded pages are not supported)")

    @functools.cached_property
    def kv_layout(self) -> KvLayout:
        """The per-rank KvLayout of the stored block: page_size = tokens_per_block * blocks_per_chunk."""
        return KvLayout(self.num_layers, self.outer_dim, self.tokens_per_block * self.blocks_per_chunk,
                        self.num_kv_heads * self.head_dim, self.dtype)

    def _axes(self) -> tuple[tuple[str, ...], dict[str, int]]:
        if self.kv_cache_layout in _LAYER_MAJOR:
            outer, page = ("L", "J"), _LAYER_MAJOR[self.kv_cache_layout]
        else:
            outer, page = ("J", "L"), _BLOCK_MAJOR[self.kv_cache_layout]
        page_axes = ("H", "N", "O", "D") if page == "HNC" else ("N", "H", "O", "D")
        if not self.packed:  # the CPU backend's page (LBHNC only): per head K rows then V rows
            page_axes = ("H", "O", "N", "D")
        sizes = {"L": self.num_layers, "J": self.blocks_per_chunk, "H": self.num_kv_heads,
                 "N": self.tokens_per_block, "O": self.outer_dim, "D": self.head_dim * dtype_bytes(self.dtype)}
        return outer + page_axes, sizes

    def engine_to_block(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy one rank's primary slice ``src`` (``rank_bytes`` uint8) into ``dst`` as the FullyContiguous
        block ``[layer, outer, token, heads*head_dim]``."""
        axes, s = self._axes()
        perm = [axes.index(a) for a in _FC_AXES]
        np.copyto(dst.reshape([s[a] for a in _FC_AXES]), src.reshape([s[a] for a in axes]).transpose(perm))

    def block_to_engine(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Exact inverse of :meth:`engine_to_block`: FullyContiguous ``src`` into the primary slice ``dst``."""
        axes, s = self._axes()
        perm = [_FC_AXES.index(a) for a in axes]
        np.copyto(dst.reshape([s[a] for a in axes]), src.reshape([s[a] for a in _FC_AXES]).transpose(perm))

    @classmethod
    def from_spec(cls, spec: Any, *, num_kv_heads: int | None = None, head_dim: int | None = None,
                  mla: bool | None = None, layout: str | None = None,
                  kv_cache_layout: str | None = None) -> "PrimaryGeometry":
        """Derive the geometry from vLLM's ``OffloadingSpec`` (``spec.config``: groups, model dtype,
        parallel, ``kv_cache_layout``; ``spec.cpu_page_size_per_worker``) plus what vLLM does not say on
        the scheduler side: heads per rank (``num_kv_heads``) or a ``layout`` preset.

        ``packed`` (the engine's K/V convention): :func:`engine_kv_packed` of :func:`spec_device_type`, so
        False only for :class:`~.native_cpu.CpuTieringOffloadingSpec` on vLLM's CPU platform (its
        ``kv_cache_layout`` defaults to LBHNC then, the CPU backend's only one; else LBNHC).

        ``kv_cache_layout`` (the tier's key) may only name the layout vLLM resolved for the engine
        (``spec.config.kv_cache_layout``, the bytes the primary tier holds) where it resolved one: the namespace
        does not record the layout (a chunk described right is the same block in any layout), so a key naming
        another one stored scrambled blocks that the engine restarted without it, or any engine sharing the pools,
        was served as verified hits (before 2026-12-04). Refused with a ValueError naming both layouts, unless the
        two place every byte alike (:func:`_same_bytes`: MLA, or one KV head per rank, where ``*HNC`` is ``*NHC``;
        one block per chunk, where ``LB*`` is ``BL*``): such a key stores the same blocks and is taken as before.

        Raises ValueError naming the missing or inconsistent setting.
        """
        cfg = spec.config
        if getattr(cfg, "canonical_layout", False):
            raise ValueError("canonical_layout: the kvbm tiers store vLLM's direct layout; remove "
                             "canonical_layout from kv_connector_extra_config")
        if not cfg.groups:
            raise ValueError("kv cache groups: none (attention-free model); nothing for the kvbm tiers to store")
        counts = sorted({len(g.layer_names) for g in cfg.groups})
        tpbs = sorted({int(g.tokens_per_block) for g in cfg.groups})
        if len(counts) != 1 or len(tpbs) != 1:
            raise ValueError(f"kv cache groups: the kvbm tiers need every KV cache group to have the same layer "
                             f"count and block size (one chunk = one group's layers); got layers {counts}, "
                             f"tokens_per_block {tpbs}")
        num_layers = len(cfg.groups[0].layer_names)
        tpb = int(cfg.groups[0].tokens_per_block)
        bpc = int(spec.blocks_per_chunk)
        dtype = str(cfg.model.dtype).removeprefix("torch.")
        if dtype == "auto":
            dtype = "bfloat16"
        replicated = bool(getattr(spec, "replicated_layout", False))
        copies = 1 if replicated else int(cfg.parallel.world_size)
        rank_bytes = int(spec.cpu_page_size_per_worker)
        tp = max(1, int(cfg.parallel.tp_size))
        if layout is not None:
            from ...model.presets import load_preset
            p = load_preset(layout)
            engine_layers = sum(len(g.layer_names) for g in cfg.groups)
            if p.num_layers != engine_layers:
                raise ValueError(f"layout: preset {p.name!r} has {p.num_layers} layers, the engine's KV cache "
                                 f"groups {engine_layers}: another model's preset")
            num_kv_heads = p.kv_heads_per_rank(tp)
            head_dim, mla = p.head_dim, p.mla
            dtype = p.dtype if dtype in ("", "auto") else dtype
        if mla:
            num_kv_heads, outer = 1, 1
        else:
            outer = 2
        if num_kv_heads is None:
            raise ValueError("num_kv_heads: the secondary tier config must give 'num_kv_heads' (KV heads per "
                             "rank) or 'layout' (a preset) to map vLLM's [H, N, K|V] page to KVBM's block")
        if head_dim is None:
            denom = num_layers * outer * int(num_kv_heads) * dtype_bytes(dtype) * tpb * bpc
            if denom <= 0 or rank_bytes % denom:
                raise ValueError(f"head_dim: cannot derive from {rank_bytes} B per rank chunk with "
                                 f"{num_layers} layers x {num_kv_heads} heads; set 'head_dim'")
            head_dim = rank_bytes // denom
        packed = engine_kv_packed(spec_device_type(spec))
        engine_kvl = getattr(cfg, "kv_cache_layout", None)
        if kv_cache_layout and engine_kvl and not _same_bytes(  # a name for the same bytes is no other layout
                _layout_name(kv_cache_layout), _layout_name(engine_kvl),
                {"L": num_layers, "B": bpc, "H": int(num_kv_heads), "N": tpb}):
            raise ValueError(
                f"kv_cache_layout: {kv_cache_layout!r}, but the engine's KV cache layout is {engine_kvl!r} (what vLLM "
                "resolved, the bytes of every primary chunk); remove the key (the tier takes the engine's): blocks "
                "permuted as another layout are served scrambled to this engine without the key and to every engine "
                "sharing these pools")
        kvl = kv_cache_layout or engine_kvl or ("LBNHC" if packed else "LBHNC")
        return cls(num_layers, int(num_kv_heads), int(head_dim), outer, dtype, tpb,
                   blocks_per_chunk=bpc, copies=copies, rank_bytes=rank_bytes, kv_cache_layout=_layout_name(kvl),
                   packed=packed, tp_world_size=tp)


def spec_device_type(spec: Any) -> str:
    """The device type of the engine an ``OffloadingSpec`` serves, as the scheduler side sees it: the spec's
    ``engine_device_type`` where it has one (:class:`~.native_cpu.CpuTieringOffloadingSpec`: vLLM's
    ``current_platform.device_type``), else ``"cuda"``: vLLM 0.32's own ``TieringOffloadingSpec`` runs only
    on CUDA/XPU (``vllm/v1/kv_offload/cpu/spec.py`` ``get_worker`` refuses other platforms), i.e. on
    packed K|V engines (the ``OffloadingConfig`` carries no device type)."""
    return str(getattr(spec, "engine_device_type", None) or "cuda")
