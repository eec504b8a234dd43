"""KV geometry of one TP rank's block, mirroring KVBM's ``LayoutConfig``.

KVBM (dynamo ``lib/llm/src/block_manager/layout.rs``) describes a block as
``[num_layers, outer_dim, page_size, inner_dim]`` elements of ``dtype_bytes`` each,
FullyContiguous: one rank's block is a single contiguous span of
``num_layers * outer_dim * page_size * inner_dim * dtype_bytes`` bytes.

* ``outer_dim`` is 2 for K and V, 1 for MLA (one latent per token).
* ``inner_dim`` is per rank: ``kv_heads_per_rank * head_dim`` (MLA: ``kv_lora_rank + rope_dim``,
  replicated on every rank, not split).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, TypeVar

import numpy as np
import numpy.typing as npt

_S = TypeVar("_S", bound=np.generic)  # an engine page's element type, kept by the conversions

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "fp8": 1, "fp8_e4m3": 1, "float8_e5m2": 1, "fp8_e5m2": 1,
    "uint8": 1, "int8": 1,
}


# every accepted spelling -> the one name a namespace records (torch's: what the vLLM path passes), so two
# engines describing the same element type alike share blocks whatever spelling their config used. vLLM's
# ``--kv-cache-dtype fp8`` is e4m3 on CUDA (vllm/utils/torch_utils.py), hence fp8 -> float8_e4m3fn.
_CANONICAL = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
              "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def canonical_dtype(dtype: str) -> str:
    """The name a namespace records for the KV dtype ``dtype`` (any case, any alias of :data:`_DTYPE_BYTES`):
    ``bf16``/``BFloat16`` -> ``bfloat16``, ``fp8``/``fp8_e4m3`` -> ``float8_e4m3fn``, ``fp8_e5m2`` ->
    ``float8_e5m2``, ``fp16``/``half`` -> ``float16``, ``fp32`` -> ``float32``. Raises ValueError on an
    unknown name (as :func:`dtype_bytes`)."""
    dtype_bytes(dtype)
    low = dtype.lower()
    return _CANONICAL.get(low, low)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``bfloat16`` -> 2). Raises ValueError on an unknown name."""
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype: unknown KV dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class KvLayout:
    """One TP rank's block geometry (KVBM ``LayoutConfig``, FullyContiguous).

    Attributes:
        num_layers: attention layers holding KV.
        outer_dim: 2 (K, V) or 1 (MLA).
        page_size: tokens per block.
        inner_dim: elements per token per layer per outer index on this rank
            (``kv_heads_per_rank * head_dim``).
        dtype: element type name, e.g. ``bfloat16``; any alias or case is stored as :func:`canonical_dtype`'s
            name (``bf16`` -> ``bfloat16``), so the namespace fingerprint does not depend on the spelling.
    """

    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size", "inner_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.outer_dim not in (1, 2):
            raise ValueError(f"outer_dim: must be 1 (MLA) or 2 (K and V), got {self.outer_dim!r}")
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype: must be a name such as 'bfloat16', got {self.dtype!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))  # frozen: set once, here

    @cached_property  # derived from frozen fields: computed once (read per block on the load paths)
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @cached_property  # derived from frozen fields: computed once (read per block on the load paths)
    def bytes_per_token(self) -> int:
        """Bytes of KV per token on this rank (all layers)."""
        return self.num_layers * self.outer_dim * self.inner_dim * self.dtype_bytes

    @cached_property  # derived from frozen fields: computed once (read per block on the load paths)
    def bytes_per_block(self) -> int:
        """``num_layers * outer_dim * page_size * inner_dim * dtype_bytes``: one rank's block, bytes."""
        return self.bytes_per_token * self.page_size

    @cached_property  # derived from frozen fields: computed once (read per block on the load paths)
    def region_bytes(self) -> int:
        """Bytes of one (layer, outer) region: ``page_size * inner_dim * dtype_bytes``."""
        return self.page_size * self.inner_dim * self.dtype_bytes

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(num_layers, outer_dim, page_size, inner_dim)`` in elements."""
        return (self.num_layers, self.outer_dim, self.page_size, self.inner_dim)

    def to_dict(self) -> dict[str, Any]:
        """The layout as a JSON object: ``num_layers``, ``outer_dim``, ``page_size``, ``inner_dim`` (ints)
        and ``dtype`` (str)."""
        return {"num_layers": self.num_layers, "outer_dim": self.outer_dim, "page_size": self.page_size,
                "inner_dim": self.inner_dim, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KvLayout":
        """Inverse of :meth:`to_dict` (``dtype`` defaults to ``bfloat16``). Raises KeyError for a missing
        field, ValueError for a bad value."""
        return cls(int(d["num_layers"]), int(d["outer_dim"]), int(d["page_size"]), int(d["inner_dim"]),
                   str(d.get("dtype", "bfloat16")))

    def view(self, buf: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
        """View a flat uint8 block buffer of ``bytes_per_block`` bytes as
        ``[num_layers, outer_dim, page_size, inner_dim * dtype_bytes]`` uint8 (no copy).

        Raises ValueError if the buffer has the wrong size.
        """
        if buf.nbytes != self.bytes_per_block:
            raise ValueError(f"block buffer: {buf.nbytes} bytes, layout needs {self.bytes_per_block}")
        return buf.reshape(-1).view(np.uint8).reshape(
            self.num_layers, self.outer_dim, self.page_size, self.inner_dim * self.dtype_bytes)


# ---- explicit conversions to and from engine tensor layouts -----------------------------------
# vLLM keeps one KV tensor per layer. Its page is either token-major "NHD"
# ``[..., page_size, num_kv_heads, head_dim]`` (FlashAttention, FlashInfer, the CPU backend of
# recent vLLM) or head-major "HND" ``[..., num_kv_heads, page_size, head_dim]``. K and V are the
# leading axis of size 2 (``[2, num_blocks, ...]``) or MLA's single latent (``[num_blocks, page, dim]``).
# The KVBM block is token-major within each (layer, outer) region: ``[page_size, inner_dim]``.

def engine_page_to_region(page: npt.NDArray[_S], engine_layout: str) -> npt.NDArray[_S]:
    """Convert one engine page of one layer/outer index to the KVBM region ``[page_size, inner]``.

    Args:
        page: ``[page_size, heads, head_dim]`` (NHD) or ``[heads, page_size, head_dim]`` (HND)
            or ``[page_size, dim]`` (MLA / already flat).
        engine_layout: ``"NHD"`` or ``"HND"``.
    Returns:
        array ``[page_size, heads*head_dim]`` (a copy for HND, a view when possible for NHD).
    """
    if page.ndim == 2:
        return page
    if engine_layout == "NHD":
        return page.reshape(page.shape[0], -1)
    if engine_layout == "HND":
        return np.ascontiguousarray(page.transpose(1, 0, 2)).reshape(page.shape[1], -1)
    raise ValueError(f"engine_layout: expected 'NHD' or 'HND', got {engine_layout!r}")


def region_to_engine_page(region: npt.NDArray[_S], num_heads: int, engine_layout: str) -> npt.NDArray[_S]:
    """Inverse of :func:`engine_page_to_region`: ``[page_size, heads*head_dim]`` to the engine page."""
    page_size, inner = region.shape
    head_dim = inner // num_heads
    nhd = region.reshape(page_size, num_heads, head_dim)
    if engine_layout == "NHD":
        return nhd
    if engine_layout == "HND":
        return nhd.transpose(1, 0, 2)
    raise ValueError(f"engine_layout: expected 'NHD' or 'HND', got {engine_layout!r}")
