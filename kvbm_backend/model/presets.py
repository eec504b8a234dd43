"""Model KV-geometry presets from ``layouts/*.toml`` (one file per model).

A preset gives layers, KV heads, head dim, dtype and MLA-or-not; :meth:`ModelPreset.layout` derives
the per-rank :class:`KvLayout` for a page size and TP degree.

Hybrid models (gpt-oss, Gemma 2/3) also give ``sliding_layers`` (how many of ``num_layers`` attend to a
sliding window) and ``sliding_window`` (tokens), with the per-token KV bytes of the full-attention
layers (``full_bytes_per_token``, every token of the prefix) and of the sliding layers
(``sliding_bytes_per_token``, at most ``sliding_window`` tokens per sequence) stated separately and
checked against the geometry. ``bytes_per_token`` stays the all-layers figure (what a cache that keeps
every layer for every token holds, e.g. vLLM with its hybrid KV cache manager off).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .layout import KvLayout, dtype_bytes


def layouts_dir() -> Path:
    """Directory holding the presets: ``$KVBM_BACKEND_LAYOUTS`` or the repo's ``layouts/``. Raises
    ValueError (``layout: ...``, one line) when it is not a directory, saying where the name came from:
    otherwise a typo in the variable, or a package installed without the repo, reads as "no presets". A relative
    ``$KVBM_BACKEND_LAYOUTS`` while this process's working directory has been removed names no directory: the
    ValueError names the variable and the cause (before 2026-12-03 ``no such directory``, as if it were absent)."""
    env = os.environ.get("KVBM_BACKEND_LAYOUTS")
    _resolvable("KVBM_BACKEND_LAYOUTS", env)
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "layouts"
    if not d.is_dir():
        why = "no such directory" if not d.exists() else "not a directory"
        src = ("set by KVBM_BACKEND_LAYOUTS" if env else
               "the repository's layouts/; set KVBM_BACKEND_LAYOUTS to the directory of preset .toml files")
        raise ValueError(f"layout: presets directory {d}: {why} ({src})")
    return d


def _resolvable(name: str | None, path: str | None) -> None:
    """ValueError ``layout: NAME: why`` (``name`` None: ``layout: why``, which names ``path``) when ``path`` is
    relative while this process's working directory has been removed (:func:`kvbm_backend.fsmodes.abspath`)."""
    from ..fsmodes import WorkdirRemoved, abspath
    try:
        if path:
            abspath(path)
    except WorkdirRemoved as e:
        raise ValueError(f"layout: {f'{name}: ' if name else ''}{e}") from None


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    mla: bool
    bytes_per_token: int  # published full-model figure (TP 1), checked against the geometry
    sliding_layers: int = 0           # layers with sliding-window attention (hybrid models)
    sliding_window: int | None = None  # their window, tokens

    @property
    def full_layers(self) -> int:
        """Layers attending to the whole prefix."""
        return self.num_layers - self.sliding_layers

    @property
    def hybrid(self) -> bool:
        return self.sliding_layers > 0

    def _per_layer_bytes(self) -> int:
        return (1 if self.mla else 2) * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    @property
    def full_bytes_per_token(self) -> int:
        """KV bytes per token of the full-attention layers (TP 1): kept for every token of the prefix."""
        return self.full_layers * self._per_layer_bytes()

    @property
    def sliding_bytes_per_token(self) -> int:
        """KV bytes per token of the sliding-window layers (TP 1): needed for the last ``sliding_window``
        tokens only."""
        return self.sliding_layers * self._per_layer_bytes()

    def kv_bytes(self, tokens: int, tp: int = 1) -> int:
        """KV bytes one rank needs to resume a sequence of ``tokens`` tokens: every token of the
        full-attention layers plus at most ``sliding_window`` tokens of the sliding layers."""
        if tokens < 0:
            raise ValueError(f"tokens: must be >= 0, got {tokens}")
        per = self.kv_heads_per_rank(tp) / self.num_kv_heads if not self.mla else 1
        window = tokens if self.sliding_window is None else min(tokens, self.sliding_window)
        return int((self.full_bytes_per_token * tokens + self.sliding_bytes_per_token * window) * per)

    def group_layouts(self, page_size: int = 16, tp: int = 1, dtype: str | None = None) -> dict[str, KvLayout]:
        """Per-rank layouts of the full-attention layers (``"full"``) and, for a hybrid model, the sliding
        ones (``"sliding"``). vLLM's hybrid KV cache manager cuts them into groups (of equal layer
        count for gpt-oss and Gemma 2, of 8-10 layers for Gemma 3); each group's block is its layers' slice of
        these."""
        inner = self.kv_heads_per_rank(tp) * self.head_dim
        out = {}
        for kind, n in (("full", self.full_layers), ("sliding", self.sliding_layers)):
            if n:
                out[kind] = KvLayout(num_layers=n, outer_dim=1 if self.mla else 2, page_size=page_size,
                                     inner_dim=inner, dtype=dtype or self.dtype)
        return out

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads held by one TP rank. MLA is replicated; with ``tp > num_kv_heads`` heads are
        replicated (vLLM does the same), so each rank holds one."""
        if tp <= 0:
            raise ValueError(f"tp: must be >= 1, got {tp}")
        if self.mla:
            return self.num_kv_heads
        if tp > self.num_kv_heads:
            if tp % self.num_kv_heads:  # vLLM: divide(tp_size, total_num_kv_heads) in QKVParallelLinear
                raise ValueError(f"tp: {self.name} has {self.num_kv_heads} KV heads; tp={tp} above that must be "
                                 "a multiple of them (each head replicated on tp / heads ranks)")
            return 1
        if self.num_kv_heads % tp:
            raise ValueError(f"tp: {self.name} has {self.num_kv_heads} KV heads, not divisible by tp={tp}")
        return self.num_kv_heads // tp

    def layout(self, page_size: int = 16, tp: int = 1, dtype: str | None = None) -> KvLayout:
        """Per-rank KvLayout for ``page_size`` tokens per block at TP degree ``tp``."""
        return KvLayout(num_layers=self.num_layers, outer_dim=1 if self.mla else 2, page_size=page_size,
                        inner_dim=self.kv_heads_per_rank(tp) * self.head_dim, dtype=dtype or self.dtype)

    def computed_bytes_per_token(self) -> int:
        return self.num_layers * (1 if self.mla else 2) * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)


_Count = Annotated[int, Field(strict=True, gt=0, le=1 << 20)]


class _PresetFile(BaseModel):
    """What a ``layouts/*.toml`` may hold (unknown keys refused; integers must be TOML integers, > 0)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1)
    hf_id: str = ""
    num_layers: _Count
    num_kv_heads: _Count
    head_dim: _Count
    dtype: str = "bfloat16"
    mla: bool = False
    bytes_per_token: Annotated[int, Field(strict=True, gt=0)]
    sliding_layers: Annotated[int, Field(strict=True, ge=0)] = 0
    sliding_window: Optional[_Count] = None
    full_bytes_per_token: Optional[Annotated[int, Field(strict=True, ge=0)]] = None
    sliding_bytes_per_token: Optional[Annotated[int, Field(strict=True, ge=0)]] = None
    kv_lora_rank: Optional[_Count] = None  # MLA (DeepSeek config.json): head_dim = kv_lora_rank + qk_rope_head_dim
    qk_rope_head_dim: Optional[_Count] = None


def list_presets() -> list[str]:
    """Names of the presets in :func:`layouts_dir` (ValueError when it is not a directory)."""
    return sorted(p.stem for p in layouts_dir().glob("*.toml"))


def load_preset(name: str) -> ModelPreset:
    """Load ``layouts/NAME.toml`` (or a ``.toml`` path). ``NAME:DTYPE`` (e.g. ``llama-3.1-8b:fp8``) is that
    preset with its KV dtype replaced, for an engine whose KV cache dtype differs from its weights' (vLLM's
    ``--kv-cache-dtype fp8``: 1-byte elements, half a bfloat16 preset's bytes). Raises ValueError naming the
    known presets if absent, the field that is wrong if the file is malformed, an unknown ``DTYPE``, or no
    presets directory (:func:`layouts_dir`). A name ending in ``.toml`` is a path, whatever ``:`` it holds
    (``/runs/12:00/model.toml``); ``PATH.toml:DTYPE`` is that file with its KV dtype replaced."""
    if ":" in name and not name.lower().endswith(".toml"):
        base, kv_dtype = name.rsplit(":", 1)
        try:
            dtype_bytes(kv_dtype)
        except ValueError as e:
            raise ValueError(f"layout: {name!r}: after ':' a KV dtype (e.g. fp8): {e}") from None
        p = load_preset(base)
        p = replace(p, name=f"{p.name}:{kv_dtype}", dtype=kv_dtype)
        return replace(p, bytes_per_token=p.computed_bytes_per_token())
    if name.lower().endswith(".toml"):  # a preset file's path (.TOML too)
        _resolvable(None, name)
        path = Path(name)
    else:
        path = layouts_dir() / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"layout: no preset {name!r}; known: {', '.join(list_presets())}")
    with open(path, "rb") as f:
        try:
            d = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"layout {path}: not valid TOML: {e}") from None
    try:
        pf = _PresetFile.model_validate(d)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        why = "; ".join(f"missing field {'.'.join(str(x) for x in er['loc'])!r}" if er["type"] == "missing" else
                        f"{'.'.join(str(x) for x in er['loc'])}: {er['msg']} (got {er['input']!r:.80})" for er in errs[:3])
        raise ValueError(f"layout {path}: {why}" + (f"; and {len(errs) - 3} more" if len(errs) > 3 else "")) from None
    try:
        dtype_bytes(pf.dtype)
    except (KeyError, ValueError):
        raise ValueError(f"layout {path}: dtype: unknown KV dtype {pf.dtype!r}") from None
    if pf.mla and pf.num_kv_heads != 1:
        raise ValueError(f"layout {path}: num_kv_heads: an MLA model caches one latent per token, got {pf.num_kv_heads}")
    if pf.kv_lora_rank is not None and pf.qk_rope_head_dim is not None and \
            pf.kv_lora_rank + pf.qk_rope_head_dim != pf.head_dim:
        raise ValueError(f"layout {path}: head_dim: {pf.head_dim} != kv_lora_rank {pf.kv_lora_rank} + qk_rope_head_dim "
                         f"{pf.qk_rope_head_dim} (the MLA latent)")
    p = ModelPreset(name=pf.name, hf_id=pf.hf_id, num_layers=pf.num_layers, num_kv_heads=pf.num_kv_heads,
                    head_dim=pf.head_dim, dtype=pf.dtype, mla=pf.mla, bytes_per_token=pf.bytes_per_token,
                    sliding_layers=pf.sliding_layers, sliding_window=pf.sliding_window)
    if p.computed_bytes_per_token() != p.bytes_per_token:
        raise ValueError(f"layout {path}: bytes_per_token {p.bytes_per_token} != geometry "
                         f"{p.computed_bytes_per_token()}")
    if not 0 <= p.sliding_layers < p.num_layers or (p.sliding_layers > 0) != (p.sliding_window is not None):
        raise ValueError(f"layout {path}: sliding_layers {p.sliding_layers} and sliding_window {p.sliding_window}: "
                         f"give both (0 <= sliding_layers < num_layers {p.num_layers}) or neither")
    for fld in ("full_bytes_per_token", "sliding_bytes_per_token"):
        stated = getattr(pf, fld)
        if p.hybrid and stated is None:
            raise ValueError(f"layout {path}: missing field {fld!r} (hybrid presets state both)")
        if stated is not None and stated != getattr(p, fld):
            raise ValueError(f"layout {path}: {fld} {stated} != geometry {getattr(p, fld)}")
    return p


def resolve_layout(name: str, page_size: int = 16, tp: int = 1) -> KvLayout:
    return load_preset(name).layout(page_size=page_size, tp=tp)
